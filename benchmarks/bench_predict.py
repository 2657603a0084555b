"""Mask-prediction benchmark: the Triton kernels stage by stage and end to end, against a naive PyTorch
version and the 95%-sparse attention forward; and attention recall of predicted masks for raster vs
3D-tiled token order.

1. Timing. For each shape (Wan 1.3B: H=12, N=32760; Wan 14B: H=40, N=75600; D=128; q and k are [B, N, H, D]
   tensors viewed as [B, H, N, D], as a DiT's projections give them), each block size (default 128x64, the
   product's default in ``SparseConfig`` and ``predict_mask``) and each input kind:

   * "random": standard normal q, k. Pooled rows are flat, so the hybrid rule's top-p part keeps ~90% of the
     tiles (a worst case for the selection's outputs).
   * "video": the video-like field below with amplitude 20, in the product's 3D-tile token order
     (``DEFAULT_TILE``). Rows are peaked; the hybrid rule (top-k 5%, top-p 90%) lands near 95% sparsity,
     the regime the product runs in.

   the Triton masks are first checked against the PyTorch path of ``predict_mask`` and the naive version;
   then, with ``triton.testing.do_bench`` medians (L2 flushed before each call): each stage alone and all three
   launches with the fastest configs ("staged"), both replayed from CUDA graphs (device time, whatever the
   host's launch rate), ``predict_mask`` end to end (eager, and replayed from a CUDA graph), its host time per
   call, the naive version, the time to read q and k once
   (``torch.sum`` over their storage: the floor), and the block-sparse attention forward at 95% sparsity
   (random mask) of the same shape. The stages are timed
   with every candidate config of their kernels (each checked against ``predict_mask``); the stage figures
   are the fastest of them.
2. Public-API overhead (``--parts api``): ``predict_mask`` + ``block_sparse_attention`` as a user calls them
   (eager, video inputs, top-k 5% and the hybrid rule) against ``block_sparse_attention`` alone under the mask
   the prediction gives, each timed four ways: ``triton.testing.do_bench`` (L2 flushed before each call: how
   the kernel tables are measured), back to back (50 calls in a row between two CUDA events: a slow host shows
   here), device time with a GPU spin ahead of each call (``timing.flushed_ms``: whatever the host's launch
   rate) and replayed from a CUDA graph; plus host time per call. The target: predict + forward within 10% of
   the forward alone. Each attention backend of ``--api-backends`` (default "auto", with what it ran on) is timed;
   on CUDA also dense cuDNN attention of the same shape, against which predict + forward is compared.
3. Recall: on the video-like field (amplitude 12) on a Wan-like grid (21x30x52), masks at ~95% sparsity
   (top-k 5%) are predicted in raster order and in several 3D-tile orders, and the exact attention recall
   (true softmax mass kept) of each is measured.

Video-like field: for a token at (t, y, x), q and k are ``amp * phi(t / l_t, y / l_s, x / l_s)`` plus
Gaussian noise of std ``noise`` (noise = 0.5), where ``phi`` are D random Fourier features
``sqrt(2/D) cos(W p + b)`` (W ~ N(0, 1), b ~ U(0, 2 pi)), so ``q_i . k_j`` approximates
``amp^2 exp(-|p_i - p_j|^2 / 2)``: attention concentrates on nearby positions in space and time, as in video
DiTs. Each head draws its own length scales l_t in [1, 4] frames and l_s in [2, 8] tokens.

Writes its result (rows, Markdown tables) under --out and prints the tables.

    python -m benchmarks predict          # predict_api: part 2 alone
    python -m benchmarks --results /tmp/p predict --shapes tiny --recall-grid 6,12,16   # CPU, slow
"""
from __future__ import annotations

import argparse
import cProfile
import functools
import math
import os
import pstats
import time
from pathlib import Path

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # the Triton kernels run on the CPU through the interpreter

import triton  # noqa: E402

import torch.nn.functional as F  # noqa: E402
from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402

import sparsevid as sv  # noqa: E402
from .report import write_result  # noqa: E402
from .run_info import run_metadata  # noqa: E402
from .timing import flushed_ms, median_ms  # noqa: E402
from sparsevid.eval import attention_recall  # noqa: E402
from sparsevid.ops import attention, triton_predict  # noqa: E402  (the stages and their candidate configs are timed alone)
from sparsevid.ops.mask import kept_index_table  # noqa: E402
from sparsevid.ops.predict import prediction_options  # noqa: E402
from sparsevid.ops.tiling import tile_tokens  # noqa: E402

# name: (B, H, N, D, (T, H, W) grid of the tokens)
SHAPES = {
    "wan1.3b": (1, 12, 32760, 128, (21, 30, 52)),
    "wan14b": (1, 40, 75600, 128, (21, 45, 80)),
    "tiny": (1, 2, 2048, 64, (8, 16, 16)),
}
INPUTS = ("random", "video")
VIDEO_AMPLITUDE = 20.0
TILES = {"2x8x8": (2, 8, 8), "4x4x8": (4, 4, 8), "1x8x16": (1, 8, 16), "2x4x16": (2, 4, 16)}
RULE = dict(rule="hybrid", topk=0.05, topp=0.9)
MAX_DIFFERING_ROWS = 1e-3
PARTS = ("stages", "api")
API_RULES = {"topk": dict(rule="topk", topk=0.05), "hybrid": RULE}
API_TARGET = 1.10  # predict + forward within 10% of the forward alone


def video_field(grid, heads: int, d: int, batch: int = 1, amp: float = 12.0, noise: float = 0.5,
                device="cpu", dtype=torch.float32, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """q, k [B, H, T*H*W, D] in raster order (module docstring), transposed views of [B, L, H, D]."""
    gen = torch.Generator(device=device).manual_seed(seed)
    t, h, w = grid
    pos = torch.stack(torch.meshgrid(torch.arange(t), torch.arange(h), torch.arange(w), indexing="ij"), -1)
    pos = pos.reshape(-1, 3).float().to(device)
    out = []
    for _ in range(2):
        per_head = []
        for head in range(heads):
            hg = torch.Generator(device="cpu").manual_seed(seed * 1000 + head)
            lt, ls = 1 + 3 * torch.rand(1, generator=hg).item(), 2 + 6 * torch.rand(1, generator=hg).item()
            freq = (torch.randn(3, d, generator=hg) / torch.tensor([[lt], [ls], [ls]])).to(device)
            phase = (2 * math.pi * torch.rand(d, generator=hg)).to(device)
            feats = amp * math.sqrt(2.0 / d) * torch.cos(pos @ freq + phase)
            per_head.append(feats + noise * torch.randn(batch, pos.shape[0], d, generator=gen, device=device))
        out.append(torch.stack(per_head, dim=2).to(dtype).transpose(1, 2))  # [B, L, H, D] viewed as [B, H, L, D]
    return out[0], out[1]


def timing_inputs(kind: str, shape: str, device, dtype, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """q, k [B, H, N, D] of one input kind (module docstring), transposed views of contiguous [B, N, H, D]."""
    b, h, n, d, grid = SHAPES[shape]
    if kind == "random":
        gen = torch.Generator(device=device).manual_seed(seed)
        return tuple(torch.randn(b, n, h, d, generator=gen, device=device, dtype=dtype).transpose(1, 2)
                     for _ in range(2))
    q, k = video_field(grid, h, d, b, amp=VIDEO_AMPLITUDE, device=device, dtype=dtype, seed=seed)
    # Reorder the [B, L, H*D] tokens into 3D tiles, keeping the [B, N, H, D] storage.
    return tuple(tile_tokens(x.transpose(1, 2).flatten(2), grid).view(b, n, h, d).transpose(1, 2) for x in (q, k))


def naive_predict(q, k, topk: float, topp: float, block_q: int, block_k: int):
    """Baseline: pool (pad + mean), softmax, full sort, cumsum, threshold, index table by sort."""
    b, h, n, d = q.shape

    def pool(x, block):
        length = x.shape[2]
        nb = -(-length // block)
        padded = torch.nn.functional.pad(x.float(), (0, 0, 0, nb * block - length))
        counts = torch.full((nb,), float(block), device=x.device)
        counts[-1] = length - (nb - 1) * block
        return padded.view(b, h, nb, block, d).sum(3) / counts[:, None]

    scores = torch.softmax(pool(q, block_q) @ pool(k, block_k).mT * d ** -0.5, dim=-1)
    ordered, _ = torch.sort(scores, dim=-1, descending=True)
    kb = scores.shape[-1]
    count = min(kb, max(1, math.ceil(topk * kb - 1e-6)))
    tau_k = ordered[..., count - 1: count]
    first = (ordered.cumsum(-1) < topp).sum(-1, keepdim=True).clamp_max(kb - 1)
    tau_p = ordered.gather(-1, first)
    keep = scores >= torch.minimum(tau_k, tau_p)
    return keep, kept_index_table(keep)


def differing_rows(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a != b).any(dim=-1).double().mean())


def read_once(q: torch.Tensor, k: torch.Tensor):
    """A call that reads q and k once (``torch.sum`` over their contiguous [B, N, H, D] storage): the floor of
    any prediction that reads them."""
    storages = [x.transpose(1, 2) for x in (q, k)]
    return lambda: [x.sum(dtype=torch.float32) for x in storages]


def attention_95_ms(q: torch.Tensor, k: torch.Tensor, block_q: int, block_k: int, measure) -> float:
    """``measure`` of the block-sparse attention forward on q, k (and a random v) with a random 95%-sparse
    block mask."""
    b, h, n, _ = q.shape
    v = torch.randn_like(q)
    sparse = sv.random_block_mask(b, h, n, k.shape[2], 0.95, block_q, block_k, device=q.device)
    return measure(lambda: sv.block_sparse_attention(q, k, v, sparse, backend="triton"))


def config_name(config: triton.Config) -> str:
    meta = " ".join(f"{k}={v}" for k, v in config.kwargs.items())
    return (f"warps={config.num_warps} stages={config.num_stages} {meta}"
            + (f" maxnreg={config.maxnreg}" if config.maxnreg else ""))


def time_candidates(run, candidates, measure, differing) -> tuple[dict, object]:
    """{config name: median ms} of ``run(config)`` for each candidate, and the fastest config. After each
    candidate's timing, ``differing()`` (the fraction of rows whose keep map then differs from predict_mask's)
    must stay within MAX_DIFFERING_ROWS: configs may sum in other orders. A config that needs more shared
    memory or registers than the GPU has is listed as None (the autotuner skips it likewise)."""
    times = {}
    for config in candidates:
        try:
            times[config_name(config)] = measure(lambda: run(config))
        except triton.runtime.errors.OutOfResources:
            times[config_name(config)] = None
            continue
        if differing() > MAX_DIFFERING_ROWS:
            raise SystemExit(f"config {config_name(config)}: {differing():.2e} of the rows differ from predict_mask")
    fitting = [c for c in candidates if times[config_name(c)] is not None]
    return times, min(fitting, key=lambda c: times[config_name(c)])


def graph_ms(fn, measure) -> float | None:
    """Median ms of ``fn`` replayed from a CUDA graph (device time without the host), None if not capturable (an
    optional backend's launcher may raise its own error types during capture)."""
    try:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            fn()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        return measure(graph.replay)
    except Exception as error:  # noqa: BLE001 (reported, and the row keeps its other timings)
        print(f"  CUDA graph capture failed: {error}")
        return None


def host_us(fn, calls: int = 50) -> float:
    """Host time per call of ``fn`` (its launches queue behind each other; the device catches up after)."""
    fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    elapsed = time.perf_counter() - start
    torch.cuda.synchronize()
    return elapsed / calls * 1e6


def host_profile(fn, calls: int = 50, top: int = 12) -> list[dict]:
    """Where the host time of ``fn`` goes: cProfile over ``calls`` calls, the ``top`` functions by their own time
    and the ``top`` by their cumulative time, together by cumulative time, each as {"function" (file:line(name)),
    "calls", "own_us", "cumulative_us"} per call of ``fn``."""
    fn()
    torch.cuda.synchronize()
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(calls):
        fn()
    profiler.disable()
    torch.cuda.synchronize()
    stats = pstats.Stats(profiler).stats  # {(file, line, name): (primitive calls, calls, own s, cumulative s, callers)}
    by_own = sorted(stats, key=lambda key: -stats[key][2])[:top]
    by_cumulative = sorted(stats, key=lambda key: -stats[key][3])[:top]
    rows = sorted(((key, stats[key]) for key in set(by_own) | set(by_cumulative)), key=lambda item: -item[1][3])
    return [{"function": f"{Path(file).name}:{line}({func})", "calls": n / calls, "own_us": own / calls * 1e6,
             "cumulative_us": cumulative / calls * 1e6} for (file, line, func), (_, n, own, cumulative, _) in rows]


def bench_case(name: str, kind: str, blocks: tuple[int, int], device, dtype, attention_ms: dict) -> dict:
    """One (shape, blocks, input kind): checks, then every timing of the module docstring."""
    b, h, n, d, _ = SHAPES[name]
    block_q, block_k = blocks
    rule = dict(RULE, block_q=block_q, block_k=block_k)
    measure = functools.partial(median_ms, device=device)
    cuda = device.type == "cuda"

    def device_ms(fn) -> float:
        """Median ms of launches replayed from a CUDA graph (device time, which the host's launch rate cannot
        bound: at the 1.3B shape a slow host takes longer to launch the kernels than the GPU to run them)."""
        ms = graph_ms(fn, measure) if cuda else None
        return measure(fn) if ms is None else ms
    q, k = timing_inputs(kind, name, device, dtype)

    predict = lambda: sv.predict_mask(q, k, backend="triton", **rule)  # noqa: E731
    mask, stats = predict()
    ref, _ = sv.predict_mask(q, k, backend="reference", **rule)
    naive_keep, _ = naive_predict(q, k, RULE["topk"], RULE["topp"], block_q, block_k)
    count, index = kept_index_table(mask.keep)
    checks = {"differing_rows_vs_torch": differing_rows(mask.keep, ref.keep),
              "differing_rows_vs_naive": differing_rows(mask.keep, naive_keep),
              "tables_match_keep": bool(torch.equal(count, mask.kv_count) and torch.equal(index, mask.kv_index)),
              "sparsity": stats.sparsity, "kept_mass_mean": float(stats.kept_mass.mean())}
    if not (checks["tables_match_keep"] and checks["differing_rows_vs_torch"] <= MAX_DIFFERING_ROWS
            and checks["differing_rows_vs_naive"] <= MAX_DIFFERING_ROWS):
        raise SystemExit(f"{name}/{kind}/{block_q}x{block_k}: Triton masks disagree: {checks}")
    del ref, naive_keep, count, index

    launch = triton_predict.PredictLaunch(q, k, **prediction_options(q, k, **rule))
    row = {"shape": name, "input": kind, "B": b, "H": h, "N": n, "D": d, **rule,
           "dtype": str(dtype).removeprefix("torch."), "checks": checks}
    # Every candidate config of each kernel, timed explicitly (whatever the autotuner would pick).
    differing = lambda: differing_rows(launch.outputs[0], mask.keep)  # noqa: E731
    pool_times, best_pool = time_candidates(launch.pool, triton_predict.POOL_CONFIGS, device_ms,
                                            lambda: (launch.logits(), launch.select(), differing())[2])
    logits_times, best_logits = time_candidates(launch.logits, triton_predict.LOGITS_CONFIGS, device_ms,
                                                lambda: (launch.select(), differing())[1])
    launch.logits(best_logits)
    select_times, best_select = time_candidates(launch.select, triton_predict.SELECT_CONFIGS, device_ms, differing)
    row["configs_ms"] = {"pool": pool_times, "logits": logits_times, "select": select_times}
    row["pool_ms"], row["logits_ms"], row["select_ms"] = (
        min(ms for ms in times.values() if ms is not None) for times in (pool_times, logits_times, select_times))
    best_configs = (best_pool, best_logits, best_select)
    row["staged_ms"] = device_ms(lambda: launch.run(best_configs))
    row["predict_mask_ms"] = measure(predict)
    row["naive_ms"] = measure(lambda: naive_predict(q, k, RULE["topk"], RULE["topp"], block_q, block_k))
    if cuda:
        row["predict_mask_graph_ms"] = graph_ms(predict, measure)
        row["predict_mask_host_us"] = host_us(predict)
        row["read_floor_ms"] = measure(read_once(q, k))
    key = (name, blocks)
    if key not in attention_ms:
        attention_ms[key] = attention_95_ms(q, k, block_q, block_k, measure)
    row["attention_95_ms"] = attention_ms[key]
    best = min(row["staged_ms"], row["predict_mask_ms"])
    read_bytes = 2 * b * h * n * d * torch.finfo(dtype).bits // 8
    row.update({"best_ms": best, "best_over_attention": best / row["attention_95_ms"],
                "speedup_vs_naive": row["naive_ms"] / best, "read_TBps": read_bytes / (best * 1e-3) / 1e12,
                "pool_read_TBps": read_bytes / (row["pool_ms"] * 1e-3) / 1e12})
    return row


def back_to_back_ms(fn, calls: int = 50) -> float:
    """Mean ms per call of ``calls`` calls of ``fn`` in a row between two CUDA events (no flush, no spin): the
    host's time per call when it launches slower than the device runs."""
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(calls):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / calls


def api_case(name: str, rule_name: str, blocks: tuple[int, int], device, dtype, backend: str = "auto") -> dict:
    """predict_mask + block_sparse_attention on ``backend`` against block_sparse_attention alone (module docstring,
    part 2), and on CUDA dense cuDNN attention of the same shape."""
    b, h, n, d, _ = SHAPES[name]
    rule = dict(API_RULES[rule_name], block_q=blocks[0], block_k=blocks[1])
    q, k = timing_inputs("video", name, device, dtype)
    v = torch.randn(b, n, h, d, device=device, dtype=dtype).transpose(1, 2)
    mask, stats = sv.predict_mask(q, k, **rule)
    calls = {"forward": lambda: sv.block_sparse_attention(q, k, v, mask, backend=backend),
             "predict_forward": lambda: sv.block_sparse_attention(q, k, v, sv.predict_mask(q, k, **rule)[0],
                                                                  backend=backend),
             "predict": lambda: sv.predict_mask(q, k, **rule)}
    row = {"shape": name, "rule_name": rule_name, "B": b, "H": h, "N": n, "D": d, **rule,
           "dtype": str(dtype).removeprefix("torch."), "sparsity": stats.sparsity, "backend": backend,
           "runs_on": attention.call_backend(q, k, v, mask, backend)}
    measure = functools.partial(median_ms, device=device)
    for label, fn in calls.items():
        row[label] = {"do_bench_ms": measure(fn)}
        if device.type == "cuda":
            row[label].update(back_to_back_ms=back_to_back_ms(fn), device_ms=flushed_ms(fn, clean=False),
                              graph_ms=graph_ms(fn, measure), host_us=host_us(fn), host_profile=host_profile(fn))
    row["ratio"] = {how: row["predict_forward"][how] / row["forward"][how] for how in row["forward"]
                    if how.endswith("_ms") and row["forward"][how] and row["predict_forward"][how]}
    row["within_target"] = {how: ratio <= API_TARGET for how, ratio in row["ratio"].items()}
    if device.type == "cuda":
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            row["cudnn_ms"] = measure(lambda: F.scaled_dot_product_attention(q, k, v))
        row["x_cudnn"] = {how: row["cudnn_ms"] / row["predict_forward"][how] for how in row["ratio"]}
    return row


def api_table(rows: list[dict]) -> str:
    """Part 2 as Markdown: per shape, rule, backend and timing method the ms of each call, the ratio to the target
    and predict + forward against dense cuDNN."""
    lines = [f"predict + forward vs forward alone (target: ratio <= {API_TARGET:.2f}), and against dense cuDNN "
             "attention; ms, host time in us; backend: as asked (-> what it ran on)", "",
             "| shape | rule | backend | sparsity | timing | forward | predict + forward | predict | ratio | "
             "predict + forward x cuDNN |", "|---" * 10 + "|"]
    for row in rows:
        backend = f"{row['backend']} -> {row['runs_on']}"
        for how, ratio in row["ratio"].items():
            x_cudnn = row.get("x_cudnn", {}).get(how)
            lines.append(f"| {row['shape']} | {row['rule_name']} | {backend} | {row['sparsity']:.3f} | {how} | "
                         f"{row['forward'][how]:.4f} | {row['predict_forward'][how]:.4f} | "
                         f"{row['predict'].get(how) or float('nan'):.4f} | {ratio:.3f} | "
                         f"{'-' if x_cudnn is None else f'{x_cudnn:.1f}x'} |")
        if "host_us" in row["forward"]:
            lines.append(f"| {row['shape']} | {row['rule_name']} | {backend} | | host us/call | "
                         f"{row['forward']['host_us']:.1f} | {row['predict_forward']['host_us']:.1f} | "
                         f"{row['predict']['host_us']:.1f} | | |")
        if "cudnn_ms" in row:
            lines.append(f"| {row['shape']} | {row['rule_name']} | dense cuDNN | | do_bench_ms | {row['cudnn_ms']:.3f} "
                         "| | | | |")
    for row in rows:  # where the host time goes (cProfile; its own overhead inflates the figures)
        for label in ("predict", "forward"):
            if "host_profile" in row[label]:
                lines += ["", f"Host profile of {label}, {row['shape']} {row['rule_name']} {row['backend']} "
                          "(us per call):", "", "| function | calls | own us | cumulative us |", "|---|---|---|---|"]
                lines += [f"| `{f['function']}` | {f['calls']:g} | {f['own_us']:.1f} | {f['cumulative_us']:.1f} |"
                          for f in row[label]["host_profile"]]
    return "\n".join(lines)


def timing_table(rows: list[dict]) -> str:
    """Part 1 as Markdown: the stage and end-to-end times (ms) per case, then every config's time per kernel."""
    lines = ["| shape | blocks | input | sparsity | pool | logits | select | staged | predict_mask | graph | "
             "host us | naive | attention 95% | best / attention | TB/s | read floor |", "|---" * 16 + "|"]
    for row in rows:
        graph, host, floor = (row.get(key) or float("nan")
                              for key in ("predict_mask_graph_ms", "predict_mask_host_us", "read_floor_ms"))
        lines.append(f"| {row['shape']} | {row['block_q']}x{row['block_k']} | {row['input']} | "
                     f"{row['checks']['sparsity']:.3f} | {row['pool_ms']:.4f} | {row['logits_ms']:.4f} | "
                     f"{row['select_ms']:.4f} | {row['staged_ms']:.4f} | {row['predict_mask_ms']:.4f} | {graph:.4f} | "
                     f"{host:.1f} | {row['naive_ms']:.3f} | {row['attention_95_ms']:.3f} | "
                     f"{row['best_over_attention']:.3f} | {row['read_TBps']:.2f} | {floor:.4f} |")
    lines.append("")
    for row in rows:
        for kernel, times in row["configs_ms"].items():
            listed = "; ".join(f"[{config}] " + ("too big" if ms is None else f"{ms:.4f}")
                               for config, ms in times.items())
            lines.append(f"- {row['shape']} {row['block_q']}x{row['block_k']} {row['input']} {kernel}: {listed}")
    return "\n".join(lines)


def recall_table(recall: dict) -> str:
    """Part 3 as Markdown: sparsity and attention recall per token order."""
    lines = [f"Recall at top-k 5% on grid {tuple(recall['grid'])}:", "", "| order | sparsity | recall |",
             "|---|---|---|"]
    lines += [f"| {row['order']} | {row['sparsity']:.3f} | {row['recall']:.4f} |" for row in recall["orders"]]
    return "\n".join(lines)


def recall_study(grid, heads: int, d: int, device, dtype, tiles: list[str]) -> list[dict]:
    q, k = video_field(grid, heads, d, device=device, dtype=dtype, seed=123)
    rows = []
    for order in ["raster", *tiles]:
        qo, ko = (q, k) if order == "raster" else (tile_tokens(t, grid, TILES[order]) for t in (q, k))
        mask, stats = sv.predict_mask(qo, ko, rule="topk", topk=0.05, block_q=128, block_k=64)
        recall = attention_recall(qo, ko, mask)
        rows.append({"order": order, "sparsity": stats.sparsity, "recall": float(recall.mean()),
                     "recall_per_head": [round(float(r), 4) for r in recall.mean(0)]})
    return rows


def main() -> None:
    cuda = torch.cuda.is_available()
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True,
                        help="folder of the result (<gpu>.json/.md); python -m benchmarks sets it")
    parser.add_argument("--shapes", default="wan1.3b,wan14b" if cuda else "tiny",
                        help=f"comma list of {sorted(SHAPES)}")
    parser.add_argument("--inputs", default=",".join(INPUTS), help=f"comma list of {list(INPUTS)}")
    parser.add_argument("--blocks", default="128x64", help="comma list of block_q x block_k, e.g. 128x64,128x128")
    parser.add_argument("--recall-grid", default="21,30,52" if cuda else "6,12,16",
                        help="T,H,W token grid of the recall study ('none' skips it)")
    parser.add_argument("--recall-heads", type=int, default=2)
    parser.add_argument("--tiles", default=",".join(TILES), help=f"comma list of {list(TILES)}")
    parser.add_argument("--parts", default=",".join(PARTS),
                        help=f"comma list of {list(PARTS)}: the stage timings (1.) and the public-API overhead (2.)")
    parser.add_argument("--api-rules", default=",".join(API_RULES), help=f"comma list of {list(API_RULES)}")
    parser.add_argument("--api-backends", default="auto",
                        help="comma list of block_sparse_attention backends the api part times, e.g. triton,flash_attn4")
    args = parser.parse_args()
    parts = [p for p in args.parts.split(",") if p]
    if not set(parts) <= set(PARTS):
        parser.error(f"--parts: expected names from {list(PARTS)}, got {parts}")

    device = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16 if cuda else torch.float32  # the interpreter's dots need fp16/fp32
    blocks = [tuple(int(v) for v in spec.split("x")) for spec in args.blocks.split(",") if spec]
    attention_ms: dict = {}
    timing, api = [], []
    for name in [s for s in args.shapes.split(",") if s]:
        for block in blocks:
            cases = [("stages", kind) for kind in args.inputs.split(",") if kind and "stages" in parts]
            cases += [("api", (rule, backend)) for rule in args.api_rules.split(",")
                      for backend in args.api_backends.split(",") if rule and backend and "api" in parts]
            for part, case in cases:
                started = time.perf_counter()
                if part == "stages":
                    timing.append(bench_case(name, case, block, device, dtype, attention_ms))
                else:
                    rule, backend = case
                    api.append(api_case(name, rule, block, device, dtype, backend=backend))
                print(f"{name} {block[0]}x{block[1]} {part} {case}: {time.perf_counter() - started:.1f} s",
                      flush=True)
                if cuda:
                    torch.cuda.empty_cache()
    result = {"timing": timing, "api": api}
    if args.recall_grid != "none":
        grid = tuple(int(v) for v in args.recall_grid.split(","))
        result["recall"] = {"grid": grid, "heads": args.recall_heads, "rule": "topk 5%",
                            "orders": recall_study(grid, args.recall_heads, 128, device, dtype,
                                                   [t for t in args.tiles.split(",") if t])}
    sections = [api_table(api) if api else "", timing_table(timing) if timing else "",
                recall_table(result["recall"]) if "recall" in result else ""]
    text = "\n\n".join(section for section in sections if section)
    write_result(args.out, run_metadata(device), result, text)
    print(text)


if __name__ == "__main__":
    main()
