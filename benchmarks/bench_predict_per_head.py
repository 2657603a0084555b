"""Per-head budgets at run time: mask prediction, and prediction + block-sparse forward, of a layer plan with
per-head budgets against a scalar plan, eager and compiled. The target (issue 35): a per-head plan costs at most
2% more attention time than the scalar one.

For each shape (``bench_predict.SHAPES``: Wan 1.3B 480p, B=1, H=12, N=32,760; Wan 14B 720p, H=40, N=75,600;
D=128; video-like q, k in the product's tile order as ``bench_predict.timing_inputs`` makes them; 128x64 tiles),
three plans of the top-k rule at 5%:

* "scalar": ``SparseConfig(topk=0.05)``;
* "same": one value per head, 0.05 in each (its masks are checked to be the scalar plan's);
* "varied": one value per head, spread evenly over 0.05 * (1 -/+ SPREAD) (mean 5%).

Each runs through the public API as a sparse model's attention does: ``LayerRuntime(0, config).mask(q, k, None)``
("predict") and ``block_sparse_attention(q, k, v, that mask)`` ("attention"); eagerly, and each call compiled
alone (``torch.compile(fullgraph=True)``; its masks are checked to be the eager ones). Timings, each the median
over ``--rounds`` rounds that take the plans in turn: ``timing.median_ms`` (``do_bench``, L2 flushed), on CUDA
also back to back (50 calls between two CUDA events: a host slower than the device shows here) and the host
time per call. The overhead of a per-head plan: its attention time minus the scalar plan's, over the scalar's.

    python -m benchmarks predict_per_head
    # CPU smoke run (numbers meaningless): reference backends, compiled without inductor
    python -m benchmarks --results /tmp/r predict_per_head --shapes tiny --backend reference --compile-backend aot_eager
"""
from __future__ import annotations

import argparse
import statistics

import torch

import sparsevid as sv
from sparsevid.plan import LayerRuntime

from .bench_predict import SHAPES, back_to_back_ms, host_us, timing_inputs
from .report import write_result
from .run_info import run_metadata
from .timing import median_ms

TOPK = 0.05
SPREAD = 0.5
PLANS = ("scalar", "same", "varied")
MODES = ("eager", "compiled")
TARGET = 0.02  # per-head attention at most 2% slower than scalar, in the timings of TARGET_TIMES
TARGET_TIMES = ("do_bench_ms", "back_to_back_ms")


def plan_budgets(heads: int) -> dict[str, float | list[float]]:
    """The top-k budget of each plan (module docstring) for a layer of ``heads`` heads."""
    step = 2 * SPREAD / max(heads - 1, 1)
    return {"scalar": TOPK, "same": [TOPK] * heads,
            "varied": [TOPK * (1 - SPREAD + step * head) for head in range(heads)] if heads > 1 else [TOPK]}


def plan_calls(topk, blocks: tuple[int, int], backend: str, mode: str, compile_backend: str) -> dict:
    """{"predict": fn(q, k) -> keep, "attention": fn(q, k, v) -> out} for a fresh runtime of a plan with ``topk``,
    eager or compiled (each call alone, one graph)."""
    config = sv.SparseConfig(rule="topk", topk=topk, block_q=blocks[0], block_k=blocks[1], backend=backend)
    runtime = LayerRuntime(0, config)
    calls = {"predict": lambda q, k: runtime.mask(q, k, None).keep,
             "attention": lambda q, k, v: sv.block_sparse_attention(q, k, v, runtime.mask(q, k, None),
                                                                    backend=backend)}
    if mode == "compiled":
        calls = {name: torch.compile(fn, backend=compile_backend, fullgraph=True) for name, fn in calls.items()}
    return calls


def timings(fn, device: torch.device) -> dict[str, float]:
    """do_bench median (ms); on CUDA also back to back (ms) and host time per call (us)."""
    times = {"do_bench_ms": median_ms(fn, device)}
    if device.type == "cuda":
        times.update(back_to_back_ms=back_to_back_ms(fn), host_us=host_us(fn))
    return times


def bench_shape(name: str, blocks: tuple[int, int], backend: str, modes: list[str], compile_backend: str,
                rounds: int, device: torch.device, dtype: torch.dtype) -> list[dict]:
    """One row per (mode, plan): its sparsity and the median timings of predict and attention (module docstring)."""
    b, h, n, d, _ = SHAPES[name]
    q, k = timing_inputs("video", name, device, dtype)
    v = torch.randn(b, n, h, d, device=device, dtype=dtype).transpose(1, 2)
    budgets = plan_budgets(h)
    keeps = {}
    rows = []
    for mode in modes:
        torch.compiler.reset()  # each compiled call below compiles once, well within dynamo's recompile limit
        calls = {plan: plan_calls(topk, blocks, backend, mode, compile_backend) for plan, topk in budgets.items()}
        for plan, fns in calls.items():  # first calls: compiles, autotuning, and the masks checked
            keeps[mode, plan] = fns["predict"](q, k)
            fns["attention"](q, k, v)
        check_masks(name, keeps, modes[0], mode)
        samples = {(plan, call): [] for plan in calls for call in ("predict", "attention")}
        for _ in range(rounds):
            for plan, fns in calls.items():
                predict, attend = fns["predict"], fns["attention"]
                samples[plan, "predict"].append(timings(lambda: predict(q, k), device))
                samples[plan, "attention"].append(timings(lambda: attend(q, k, v), device))
        for plan in calls:
            row = {"shape": name, "B": b, "H": h, "N": n, "D": d, "block_q": blocks[0], "block_k": blocks[1],
                   "backend": backend, "mode": mode, "plan": plan, "topk": budgets[plan],
                   "tile_sparsity": 1 - float(keeps[mode, plan].float().mean())}
            for call in ("predict", "attention"):
                runs = samples[plan, call]
                row[call] = {key: statistics.median(run[key] for run in runs) for key in runs[0]}
            rows.append(row)
    return rows


def check_masks(name: str, keeps: dict, first_mode: str, mode: str) -> None:
    """The masks of ``mode`` (``keeps``: {(mode, plan): keep}) are those of ``first_mode``, and the per-head plan
    of equal values predicts the scalar plan's."""
    for plan in PLANS:
        if not torch.equal(keeps[mode, plan], keeps[first_mode, plan]):
            raise SystemExit(f"{name}: the {mode} {plan} plan predicted other masks than {first_mode}")
    if not torch.equal(keeps[mode, "same"], keeps[mode, "scalar"]):
        raise SystemExit(f"{name}: the per-head plan of equal values predicted other masks than the scalar plan")


def overheads(rows: list[dict]) -> list[dict]:
    """Per (shape, mode, per-head plan): the predict and attention time over the scalar plan's, per timing method,
    and whether the attention overhead is within TARGET in each of TARGET_TIMES measured."""
    scalar = {(r["shape"], r["mode"]): r for r in rows if r["plan"] == "scalar"}
    result = []
    for row in rows:
        base = scalar[row["shape"], row["mode"]]
        if row is base:
            continue
        entry = {"shape": row["shape"], "mode": row["mode"], "plan": row["plan"]}
        for call in ("predict", "attention"):
            entry[call] = {key: row[call][key] / base[call][key] - 1 for key in base[call] if base[call][key]}
        entry["within_target"] = all(share <= TARGET for key, share in entry["attention"].items()
                                     if key in TARGET_TIMES)
        result.append(entry)
    return result


def _cell(times: dict, key: str, form: str) -> str:
    return format(times[key], form) if key in times else "-"


def table(rows: list[dict], summary: list[dict]) -> str:
    lines = [(f"Per-head vs scalar top-k {TOPK:.0%} plans (\"same\": {TOPK} in every head; \"varied\": spread over "
              f"{TOPK * (1 - SPREAD):.3f}..{TOPK * (1 + SPREAD):.3f}); ms, host time in us"), "",
             ("| shape | mode | plan | tile sparsity | predict | attention | predict back to back | "
              "attention back to back | predict host us | attention host us |"), "|---" * 10 + "|"]
    for row in rows:
        p, a = row["predict"], row["attention"]
        cells = [_cell(times, key, form) for key, form in
                 (("do_bench_ms", ".4f"), ("back_to_back_ms", ".4f"), ("host_us", ".1f")) for times in (p, a)]
        lines.append(f"| {row['shape']} | {row['mode']} | {row['plan']} | {row['tile_sparsity']:.3f} | "
                     + " | ".join(cells) + " |")
    lines += ["", f"Overhead over the scalar plan (target: attention at most +{TARGET:.0%})", "",
              ("| shape | mode | plan | predict | attention | predict back to back | attention back to back | "
               "within target |"), "|---" * 8 + "|"]
    for entry in summary:
        p, a = entry["predict"], entry["attention"]
        cells = [_cell(times, key, "+.2%") for key in ("do_bench_ms", "back_to_back_ms") for times in (p, a)]
        lines.append(f"| {entry['shape']} | {entry['mode']} | {entry['plan']} | " + " | ".join(cells)
                     + f" | {'yes' if entry['within_target'] else 'no'} |")
    return "\n".join(lines)


def _comma_list(text: str, choices, what: str) -> list[str]:
    values = [value for value in text.split(",") if value]
    unknown = [value for value in values if value not in choices]
    if not values or unknown:
        raise argparse.ArgumentTypeError(f"{what}: expected a comma list of {list(choices)}, got {text!r}")
    return values


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    cuda = torch.cuda.is_available()
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True,
                        help="folder of the result (<gpu>.json/.md); python -m benchmarks sets it")
    parser.add_argument("--shapes", default="wan1.3b,wan14b" if cuda else "tiny",
                        type=lambda text: _comma_list(text, SHAPES, "--shapes"),
                        help=f"comma list of {sorted(SHAPES)}")
    parser.add_argument("--blocks", default="128x64", help="block_q x block_k")
    parser.add_argument("--backend", default="triton" if cuda else "reference", choices=("triton", "reference"),
                        help="the plans' backend (predictor and attention)")
    parser.add_argument("--modes", default=",".join(MODES), type=lambda text: _comma_list(text, MODES, "--modes"),
                        help=f"comma list of {list(MODES)}")
    parser.add_argument("--compile-backend", default="inductor", help="torch.compile backend of the compiled mode")
    parser.add_argument("--rounds", type=int, default=3, help="timing rounds, the plans taken in turn in each")
    args = parser.parse_args(argv)
    try:
        args.blocks = tuple(int(value) for value in args.blocks.split("x"))
    except ValueError:
        parser.error(f"--blocks: expected block_q x block_k such as 128x64, got {args.blocks!r}")
    if len(args.blocks) != 2 or args.rounds < 1:
        parser.error("--blocks takes two sizes and --rounds at least 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    rows = []
    for name in args.shapes:
        rows += bench_shape(name, args.blocks, args.backend, args.modes, args.compile_backend, args.rounds, device,
                            dtype)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    summary = overheads(rows)
    text = table(rows, summary)
    settings = dict(topk=TOPK, spread=SPREAD, rounds=args.rounds, compile_backend=args.compile_backend)
    write_result(args.out, run_metadata(device, **settings), {"rows": rows, "overhead": summary}, text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
