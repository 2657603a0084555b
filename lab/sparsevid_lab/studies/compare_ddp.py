"""Compare two distillation runs of the same settings on different numbers of processes (log.jsonl of each):
per-step loss difference and throughput (samples per second after the first steps). Writes results.json and
results.md under --out and prints the table.

    python3 -m sparsevid_lab.studies.compare_ddp runs/procs1 runs/procs2 --out runs
"""
from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from benchmarks.run_info import run_metadata


def load(run: Path) -> tuple[list[dict], dict]:
    rows = [json.loads(line) for line in (run / "log.jsonl").read_text().splitlines() if line.strip()]
    if len(rows) < 3:
        raise SystemExit(f"{run}: fewer than 3 logged steps")
    info = json.loads((run / "student.json").read_text())  # the student record distill() writes, with its run
    return rows, info


def throughput(rows: list[dict], batch: int, skip: int) -> float:
    """Samples per second between the step after ``skip`` (compilation, warm-up) and the last step."""
    first, last = rows[min(skip, len(rows) - 2)], rows[-1]
    return (last["step"] - first["step"]) * batch / (last["seconds"] - first["seconds"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs=2, type=Path, help="the run on fewer processes, then the one on more")
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--skip", type=int, default=5, help="steps left out of the throughput")
    args = parser.parse_args()
    (rows_a, info_a), (rows_b, info_b) = load(args.runs[0]), load(args.runs[1])
    batch = info_a["run"]["batch_size"]
    if info_b["run"] != info_a["run"]:
        raise SystemExit("the two runs differ in their settings (run_info): not comparable")
    common = min(len(rows_a), len(rows_b))
    diffs = [abs(a["loss"] - b["loss"]) / max(abs(a["loss"]), 1e-12) for a, b in zip(rows_a[:common], rows_b[:common])]
    result = {
        "meta": run_metadata(), "runs": [str(r) for r in args.runs], "world_sizes": [info_a["world_size"], info_b["world_size"]],
        "global_batch": batch, "steps": common,
        "loss_first": [rows_a[0]["loss"], rows_b[0]["loss"]], "loss_last": [rows_a[common - 1]["loss"],
                                                                             rows_b[common - 1]["loss"]],
        "relative_loss_difference_median": statistics.median(diffs), "relative_loss_difference_max": max(diffs),
        "samples_per_s": [throughput(rows_a, batch, args.skip), throughput(rows_b, batch, args.skip)],
    }
    result["throughput_ratio"] = result["samples_per_s"][1] / result["samples_per_s"][0]
    ws = result["world_sizes"]
    table = "\n".join([
        f"| processes | loss at step {rows_a[0]['step']} | loss at step {rows_a[common - 1]['step']} | samples/s |",
        "|---|---|---|---|",
        *(f"| {w} | {first:.5g} | {last:.5g} | {sps:.1f} |" for w, first, last, sps in
          zip(ws, result["loss_first"], result["loss_last"], result["samples_per_s"])),
        "", f"Per-step relative loss difference: median {result['relative_loss_difference_median']:.2e}, max "
            f"{result['relative_loss_difference_max']:.2e}; throughput ratio {result['throughput_ratio']:.2f}x."])
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(result, indent=1))
    (args.out / "results.md").write_text(table + "\n")
    print(table)


if __name__ == "__main__":
    main()
