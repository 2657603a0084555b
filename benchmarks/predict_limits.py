"""What bounds mask prediction at the Wan shapes: the time each stage takes against the floor it stands on,
and what the speed targets leave for the stages after pooling.

For each shape (Wan 1.3B 480p, Wan 14B 720p) and input kind of ``bench_predict.py`` (random, video), with the
autotuned kernels of ``predict_mask`` (hybrid rule, top-k 5%, top-p 0.9, blocks 128x64):

1. Kernel device times of the three launches (torch.profiler, no flush between calls).
2. Per-call times (CUDA events, median of 100) of the pool stage, of a plain read of q and k (``torch.sum``
   over their [B, N, H, D] storage) and of the three launches, each call after an L2 flush. Two flushes:
   "dirty" zeroes a 256 MB buffer, as ``triton.testing.do_bench`` does, and the timed call pays the write-back
   of the dirty lines it evicts; "clean" reads the buffer after zeroing it, so that the call starts from a
   clean L2. The reported prediction figures are do_bench's, i.e. "dirty".
3. The logits stage with one TF32 product per dot instead of 3xTF32: its time, and the fraction of rows whose
   mask then differs from the PyTorch path (3xTF32 differs on the rows counted by ``bench_predict.py``).
4. The budget: the target (at most 10% of the 95%-sparse attention forward at 1.3B, 0.5 ms at 14B) less the
   pool stage (dirty flush) is what logits and select may take together, against their device times.
5. Head scaling: kernel device times at the Wan 1.3B length (random q, k) with 1, 3, 6 and 12 heads, all with
   the configs tuned for 12 heads. A stage whose time hardly falls with the heads is bound by latency (one
   program's chain, launch and drain), not by throughput.

Writes its result (rows, Markdown tables) under --out and prints the tables.

    python -m benchmarks predict_limits      # CUDA only
"""
from __future__ import annotations

import argparse
import functools
import json

import torch

import sparsevid as sv
from .bench_predict import (INPUTS, RULE, SHAPES, attention_95_ms, differing_rows, read_once,
                                      timing_inputs)
from .report import write_result
from .run_info import run_metadata
from .timing import cuda_kernel_ms, flushed_ms, median_ms
from sparsevid.ops import triton_predict  # the stages' kernels are timed alone
from sparsevid.ops.predict import prediction_options

BLOCKS = (128, 64)
# shape: ("share", fraction of the attention forward) or ("ms", milliseconds)
TARGETS = {"wan1.3b": ("share", 0.10), "wan14b": ("ms", 0.5)}
STAGES = ("pool", "logits", "select")


def tuned_configs(launch: triton_predict.PredictLaunch) -> tuple:
    """Autotune the three stages on ``launch``; their chosen configs (pool, logits, select). Launches given a
    config skip the autotuner's per-call dispatch, so that host time stays below device time."""
    return launch.run()


def kernel_times(launch: triton_predict.PredictLaunch, configs: tuple) -> dict[str, float]:
    """{stage: device ms} of the three launches, from the profiler's kernel names."""
    times = cuda_kernel_ms(lambda: launch.run(configs), calls=10)
    return {stage: sum(ms for name, ms in times.items() if name.startswith(f"_{stage}_kernel")) for stage in STAGES}


def limits_case(shape: str, kind: str, device: torch.device, attention_ms: dict) -> dict:
    b, h, n, d, _ = SHAPES[shape]
    block_q, block_k = BLOCKS
    rule = dict(RULE, block_q=block_q, block_k=block_k)
    q, k = timing_inputs(kind, shape, device, torch.bfloat16)
    reference, _ = sv.predict_mask(q, k, backend="reference", **rule)
    options = prediction_options(q, k, **rule)
    launch = triton_predict.PredictLaunch(q, k, **options)
    configs = tuned_configs(launch)
    row = {"shape": shape, "input": kind, "B": b, "H": h, "N": n, "D": d, **rule,
           "configs": [str(config) for config in configs],
           "differing_rows_tf32x3": differing_rows(launch.outputs[0], reference.keep),
           "kernel_ms": kernel_times(launch, configs)}
    calls = {"pool": lambda: launch.pool(configs[0]), "read": read_once(q, k), "staged": lambda: launch.run(configs)}
    for flush in ("dirty", "clean"):
        row[f"{flush}_ms"] = {name: flushed_ms(fn, clean=flush == "clean") for name, fn in calls.items()}

    single = triton_predict.PredictLaunch(q, k, **options, score_precision="tf32")
    single_configs = tuned_configs(single)
    row["logits_ms"] = {"tf32x3": flushed_ms(lambda: launch.logits(configs[1]), clean=False),
                        "tf32": flushed_ms(lambda: single.logits(single_configs[1]), clean=False)}
    row["differing_rows_tf32"] = differing_rows(single.outputs[0], reference.keep)
    row["kept_mass_max_diff_tf32"] = float((single.outputs[3] - launch.outputs[3]).abs().max())

    if shape not in attention_ms:
        attention_ms[shape] = attention_95_ms(q, k, block_q, block_k, functools.partial(median_ms, device=device))
    row["attention_95_ms"] = attention_ms[shape]
    kind_of_target, value = TARGETS[shape]
    target_ms = value * row["attention_95_ms"] if kind_of_target == "share" else value
    pool_ms = row["dirty_ms"]["pool"]
    row["budget"] = {"target_ms": target_ms, "pool_ms": pool_ms, "left_for_logits_select_ms": target_ms - pool_ms,
                     "logits_select_device_ms": row["kernel_ms"]["logits"] + row["kernel_ms"]["select"],
                     "staged_ms": row["dirty_ms"]["staged"]}
    return row


def head_scaling(heads: list[int], device: torch.device) -> list[dict]:
    """{heads, kernel_ms} at the Wan 1.3B length for each head count, with the configs tuned for its 12 heads."""
    _, _, n, d, _ = SHAPES["wan1.3b"]
    rule = dict(RULE, block_q=BLOCKS[0], block_k=BLOCKS[1])
    configs = None
    rows = []
    for h in sorted(heads, reverse=True):
        q, k = (torch.randn(1, n, h, d, device=device, dtype=torch.bfloat16).transpose(1, 2) for _ in range(2))
        launch = triton_predict.PredictLaunch(q, k, **prediction_options(q, k, **rule))
        configs = configs or tuned_configs(launch)
        rows.append({"heads": h, "kernel_ms": kernel_times(launch, configs)})
    return rows


def markdown(rows: list[dict], scaling: list[dict]) -> str:
    """The limits per case (kernel device times; dirty / clean-flush times of the pool, a plain read and the three
    launches; the logits stage with 3xTF32 / TF32 products; the target and what it leaves after pooling), then
    the kernel times by head count."""
    ms3 = "{:.3f}".format
    lines = ["ms; dirty / clean = L2 flush before each call (module docstring)", "",
             "| shape | input | pool | logits | select | pool d/c | read d/c | staged d/c | logits tf32x3/tf32 | "
             "rows differing (TF32) | target | left after pool |", "|---" * 12 + "|"]
    for row in rows:
        kernels, dirty, clean, logits = row["kernel_ms"], row["dirty_ms"], row["clean_ms"], row["logits_ms"]
        pairs = [f"{ms3(dirty[name])}/{ms3(clean[name])}" for name in ("pool", "read", "staged")]
        lines.append(f"| {row['shape']} | {row['input']} | {ms3(kernels['pool'])} | {ms3(kernels['logits'])} | "
                     f"{ms3(kernels['select'])} | {' | '.join(pairs)} | "
                     f"{ms3(logits['tf32x3'])}/{ms3(logits['tf32'])} | "
                     f"{row['differing_rows_tf32']:.4f} | {ms3(row['budget']['target_ms'])} | "
                     f"{ms3(row['budget']['left_for_logits_select_ms'])} |")
    if scaling:
        lines += ["", "Kernel device ms at the Wan 1.3B length by heads (configs tuned for 12 heads):", "",
                  "| heads | " + " | ".join(STAGES) + " |", "|---" * (len(STAGES) + 1) + "|"]
        lines += [f"| {row['heads']} | " + " | ".join(ms3(row["kernel_ms"][stage]) for stage in STAGES) + " |"
                  for row in scaling]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True,
                        help="folder of the result (<gpu>.json/.md); python -m benchmarks sets it")
    parser.add_argument("--shapes", default=",".join(TARGETS), help=f"comma list of {list(TARGETS)}")
    parser.add_argument("--inputs", default=",".join(INPUTS), help=f"comma list of {list(INPUTS)}")
    parser.add_argument("--head-scaling", default="12,6,3,1",
                        help="comma list of head counts for part 5, the largest first ('none' skips it)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("predict_limits.py times CUDA kernels: it needs a GPU")
    device = torch.device("cuda")
    attention_ms: dict = {}
    rows = []
    for shape in [s for s in args.shapes.split(",") if s]:
        if shape not in TARGETS:
            raise SystemExit(f"--shapes: expected names from {list(TARGETS)}, got {shape!r}")
        for kind in [s for s in args.inputs.split(",") if s]:
            rows.append(limits_case(shape, kind, device, attention_ms))
            print(json.dumps(rows[-1]), flush=True)
            torch.cuda.empty_cache()
    scaling = [] if args.head_scaling == "none" else head_scaling(
        [int(v) for v in args.head_scaling.split(",")], device)
    text = markdown(rows, scaling)
    write_result(args.out, run_metadata(device), {"rows": rows, "head_scaling": scaling}, text)
    print(text)


if __name__ == "__main__":
    main()
