"""End-to-end transformer benchmark: Wan2.1 forward, dense (cuDNN SDPA) vs sparsevid at 90% / 95% sparsity,
eager and compiled (``--compile``: each setting is also timed under ``torch.compile``, dense compiled against
sparse compiled), at the inputs' precision or quantized (``--precision native,int8``: each sparse setting at each),
on one attention backend or several (``--backend triton,flash_attn4``: each sparse setting on each).

The transformers are built from the Wan2.1 configs with random weights (bf16, the fp32 modules diffusers keeps
in fp32 stay fp32). Per model and setting it measures the transformer forward (CUDA-event median), the
once-per-forward token reordering into 3D tiles and back (``sparsevid.forward_stats``), the per-layer
attention time split into in-layer reordering, mask prediction, kernels and restore (from
``sparsevid.attention_stats``), the time per layer outside the attention kernels, and projects the forward
time to a 50-step generation with classifier-free guidance. Compiled rows time the forward only (the breakdown
comes from eager stats) and record the compile time of their first call. Writes its result (rows, Markdown
table) under --out.

    python -m benchmarks e2e     # also e2e_13b_compiled, e2e_13b_modes, e2e_13b_quantized, e2e_13b_flash_attn4,
                                 # e2e_14b, e2e_14b_compiled
    # CPU smoke run of the same code path:
    python -m benchmarks --results /tmp/e2e e2e --device cpu --dtype float32 --layers 2 --grid 3x8x8 \
        --heads 2 --models wan1.3b --warmup 0 --iters 1
"""
from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import time
from pathlib import Path

import torch

import sparsevid as sv
from .report import write_result
from .run_info import run_metadata

# Wan2.1 configs; grid = latent (T, H, W) after 1x2x2 patching.
MODELS = {
    "wan1.3b": {"config": {"num_attention_heads": 12, "attention_head_dim": 128, "ffn_dim": 8960, "num_layers": 30},
                "grid": (21, 30, 52), "label": "Wan2.1-1.3B 480p"},
    "wan14b": {"config": {"num_attention_heads": 40, "attention_head_dim": 128, "ffn_dim": 13824, "num_layers": 40},
               "grid": (21, 45, 80), "label": "Wan2.1-14B 720p"},
}
COMMON = {"patch_size": (1, 2, 2), "in_channels": 16, "out_channels": 16, "text_dim": 4096, "freq_dim": 256,
          "cross_attn_norm": True, "qk_norm": "rms_norm_across_heads", "eps": 1e-6}
TEXT_TOKENS = 512
E2E_BACKENDS = ("auto", "triton", "flex", "reference", "flash_attn4")  # the sparse settings' (--backend)


def parse_grid(text: str) -> tuple[int, int, int]:
    parts = text.lower().split("x")
    if len(parts) != 3 or not all(p.isdigit() and int(p) > 0 for p in parts):
        raise argparse.ArgumentTypeError(f"--grid must look like 21x30x52, got {text!r}")
    return tuple(int(p) for p in parts)


def build_model(model_class: str, config: dict, device: torch.device, dtype: torch.dtype):
    """A random-weight diffusers ``model_class`` built on ``device`` in ``dtype``; the modules the class keeps in
    fp32 (``_keep_in_fp32_modules``) stay float32."""
    import diffusers

    with torch.device(device):
        model = getattr(diffusers, model_class)(**config)
    keep = set(model._keep_in_fp32_modules or ())
    for module_name, module in model.named_modules():
        for name, tensor in [*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)]:
            if keep & set(f"{module_name}.{name}".split(".")) or not tensor.is_floating_point():
                continue
            if isinstance(tensor, torch.nn.Parameter):
                tensor.data = tensor.data.to(dtype)
            else:
                module._buffers[name] = tensor.to(dtype)
    return model.eval().requires_grad_(False)


def build_transformer(config: dict, device: torch.device, dtype: torch.dtype):
    """A random-weight WanTransformer3DModel of ``config`` (over ``COMMON``), as :func:`build_model` builds it."""
    return build_model("WanTransformer3DModel", {**COMMON, **config}, device, dtype)


def make_inputs(grid, device, dtype, generator, text_tokens: int = TEXT_TOKENS):
    """Forward arguments of a Wan transformer: random latents [1, 16, T, 2H, 2W] of the token ``grid`` (T, H, W),
    random umT5 text states [1, text_tokens, 4096], timestep 900."""
    frames, height, width = grid
    latents = torch.randn(1, 16, frames, 2 * height, 2 * width, generator=generator).to(device, dtype)
    text = torch.randn(1, text_tokens, 4096, generator=generator).to(device, dtype)
    return {"hidden_states": latents, "timestep": torch.tensor([900.0], device=device),
            "encoder_hidden_states": text, "return_dict": False}


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_forward(model, inputs_list, warmup: int, iters: int, device) -> list[float]:
    """Forward times in ms; each iteration uses the next input set (fresh random data)."""
    for i in range(warmup):
        model(**inputs_list[i % len(inputs_list)])
    times = []
    for i in range(iters):
        inputs = inputs_list[i % len(inputs_list)]
        sync(device)
        start = time.perf_counter()
        model(**inputs)
        sync(device)
        times.append((time.perf_counter() - start) * 1e3)
    return times


def dense_sdpa_context(device, backend: str):
    """Pin the dense SDPA backend ("cudnn" | "flash" | "default") on CUDA."""
    if device.type != "cuda" or backend == "default":
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel({"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION}[backend])


def layer_breakdown(model, inputs) -> dict:
    """Mean per-layer attention times (ms), achieved sparsity and the per-forward token reordering (tile,
    reorder / restore ms) from one forward with stats on."""
    sv.set_collect_stats(model, True)
    model(**inputs)
    stats = sv.attention_stats(model)
    forward = sv.forward_stats(model)
    sv.set_collect_stats(model, False)
    keys = ("attention_ms", "reorder_ms", "predict_ms", "kernel_ms", "restore_ms")
    out = {k: statistics.fmean(s[k] for s in stats) if all(s[k] is not None for s in stats) else None for k in keys}
    out["sparsity"] = statistics.fmean(s["sparsity"] for s in stats)
    out["layers"] = len(stats)
    out["forward"] = forward
    return out


def model_config(name: str, args) -> tuple[dict, tuple[int, int, int], int]:
    """(transformer config, latent token grid, tokens) of MODELS[name], shrunk by --layers/--heads/--grid."""
    spec = MODELS[name]
    config = dict(spec["config"])
    if args.layers:
        config["num_layers"] = args.layers
    if args.heads:
        config["num_attention_heads"] = args.heads
    grid = args.grid or spec["grid"]
    return config, grid, grid[0] * grid[1] * grid[2]


def sparse_config(sparsity: float | None, num_layers: int, args, precision: str = "native",
                  backend: str = "auto") -> "sv.SparseConfig":
    """The configuration of one setting: every layer dense (None) or top-k at ``1 - sparsity`` at ``precision`` on
    ``backend``."""
    if sparsity is None:
        return sv.SparseConfig(dense_layers=tuple(range(num_layers)))
    return sv.SparseConfig(rule="topk", topk=round(1.0 - sparsity, 6), block_q=args.block_q, block_k=args.block_k,
                           backend=backend, tile=args.tile, precision=precision)


def settings(args) -> list[tuple[str, float | None, str, str]]:
    """(label, sparsity or None for dense, precision, backend) of every timed setting: dense, then each sparsity on
    each ``--backend`` at each ``--precision`` (the backend named in the label when there are several)."""
    rows = [("dense", None, "native", "auto")]
    for sparsity in args.sparsity:
        for backend in args.backend:
            for precision in args.precision:
                suffix = "" if precision == "native" else f" {precision}"
                suffix += f" {backend}" if len(args.backend) > 1 else ""
                rows.append((f"sparse {sparsity:.0%}{suffix}", sparsity, precision, backend))
    return rows


def compiled(model, mode: str, scope: str):
    """``model`` compiled as ``--compile-scope`` says: the whole forward (``torch.compile``) or each repeated
    block (diffusers' ``compile_repeated_blocks``, in place). Returns the callable to time."""
    torch._dynamo.reset()
    options = {} if mode == "default" else {"mode": mode}
    if scope == "blocks":
        model.compile_repeated_blocks(**options)
        return model
    return torch.compile(model, **options)


def uncompile(model) -> None:
    """Undo ``compile_repeated_blocks``: the blocks run eagerly again."""
    for module in model.modules():
        if getattr(module, "_compiled_call_impl", None) is not None:
            module._compiled_call_impl = None


def run_model(name: str, args, device, dtype) -> list[dict]:
    spec = MODELS[name]
    config, grid, tokens = model_config(name, args)
    generator = torch.Generator().manual_seed(0)
    model = build_transformer(config, device, dtype)
    inputs_list = [make_inputs(grid, device, dtype, generator) for _ in range(2)]
    rows = []
    with torch.no_grad(), dense_sdpa_context(device, args.dense_backend):
        for label, sparsity, precision, backend in settings(args):
            cfg = sparse_config(sparsity, config["num_layers"], args, precision, backend)
            for mode in args.compile:
                if sparsity is not None:
                    sv.apply_sparse_attention(model, cfg)
                row = {"model": spec["label"], "setting": label, "compile": mode, "tokens": tokens,
                       "grid": list(grid), "layers": config["num_layers"], "heads": config["num_attention_heads"],
                       "config": cfg.to_dict()}
                if mode == "eager":
                    times = time_forward(model, inputs_list, args.warmup, args.iters, device)
                    if sparsity is None:  # per-layer dense attention time: the same processors, every layer dense
                        sv.apply_sparse_attention(model, cfg)
                    row.update(breakdown_columns(layer_breakdown(model, inputs_list[0]), sparsity))
                else:
                    target = compiled(model, mode, args.compile_scope)
                    sync(device)
                    start = time.perf_counter()
                    target(**inputs_list[0])
                    sync(device)
                    row["compile_s"] = time.perf_counter() - start
                    times = time_forward(target, inputs_list, args.warmup, args.iters, device)
                    uncompile(model)
                if sv.is_sparse(model):
                    sv.remove_sparse_attention(model)
                forward_ms = statistics.median(times)
                row.update({"forward_ms": forward_ms, "forward_ms_all": times,
                            "generation_s": forward_ms * args.cfg_passes * args.steps / 1e3})
                if row.get("kernel_ms_per_layer") is not None:
                    row["outside_kernels_ms_per_layer"] = forward_ms / config["num_layers"] - row["kernel_ms_per_layer"]
                rows.append(row)
                print(f"{spec['label']:18s} {label:11s} {mode:12s} forward {forward_ms:10.1f} ms", flush=True)
    for row in rows:  # against dense under the same compilation
        dense = next(r for r in rows if r["setting"] == "dense" and r["compile"] == row["compile"])
        row["speedup_forward"] = dense["forward_ms"] / row["forward_ms"]
        warm = min(args.dense_steps, args.steps)
        row["generation_s_with_dense_steps"] = (
            (warm * dense["forward_ms"] + (args.steps - warm) * row["forward_ms"]) * args.cfg_passes / 1e3)
    del model
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return rows


def breakdown_columns(breakdown: dict, sparsity: float | None) -> dict:
    """The per-layer and per-forward columns of an eager row from :func:`layer_breakdown`."""
    return {
        "achieved_sparsity": breakdown["sparsity"],
        "token_tile": breakdown["forward"]["tile"],
        "reorder_ms_per_forward": breakdown["forward"]["reorder_ms"],
        "restore_ms_per_forward": breakdown["forward"]["restore_ms"],
        "attention_ms_per_layer": breakdown["attention_ms"],
        "reorder_ms_per_layer": breakdown["reorder_ms"], "predict_ms_per_layer": breakdown["predict_ms"],
        "kernel_ms_per_layer": breakdown["kernel_ms"] if sparsity is not None else breakdown["attention_ms"],
        "restore_ms_per_layer": breakdown["restore_ms"],
    }


def fmt(value, spec=".2f"):
    return "-" if value is None else format(value, spec)


def table(rows, args) -> str:
    head = ("| model | setting | compile | tokens | achieved sparsity | forward ms | speedup | compile s | "
            "tiling/forward ms | untiling/forward ms | attn/layer ms | in-layer tiling ms | predict ms | kernel ms | "
            f"restore ms | outside kernels/layer ms | {args.steps}-step s | "
            f"{args.steps}-step s ({args.dense_steps} dense) |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        lines.append(
            f"| {r['model']} | {r['setting']} | {r['compile']} | {r['tokens']} | {fmt(r.get('achieved_sparsity'), '.3f')} | "
            f"{r['forward_ms']:.1f} | {r['speedup_forward']:.2f}x | {fmt(r.get('compile_s'), '.0f')} | "
            f"{fmt(r.get('reorder_ms_per_forward'))} | {fmt(r.get('restore_ms_per_forward'))} | "
            f"{fmt(r.get('attention_ms_per_layer'))} | {fmt(r.get('reorder_ms_per_layer'))} | "
            f"{fmt(r.get('predict_ms_per_layer'))} | {fmt(r.get('kernel_ms_per_layer'))} | "
            f"{fmt(r.get('restore_ms_per_layer'))} | {fmt(r.get('outside_kernels_ms_per_layer'))} | "
            f"{r['generation_s']:.1f} | {r['generation_s_with_dense_steps']:.1f} |")
    return "\n".join(lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, type=Path,
                        help="folder of the result (<gpu>.json/.md); python -m benchmarks sets it")
    parser.add_argument("--models", default="wan1.3b,wan14b", help=f"comma list of {sorted(MODELS)}")
    parser.add_argument("--sparsity", default="0.9,0.95", help="comma list of target sparsities")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--backend", default="auto",
                        help=f"comma list of sparse attention backends, of {list(E2E_BACKENDS)}")
    parser.add_argument("--dense-backend", default="cudnn", choices=["cudnn", "flash", "default"],
                        help="SDPA backend of the dense baseline (and of dense text rows)")
    parser.add_argument("--block-q", type=int, default=128)
    parser.add_argument("--block-k", type=int, default=64)
    parser.add_argument("--tile", default="auto", help="'auto', 'none' or t,h,w")
    parser.add_argument("--layers", type=int, default=0, help="override the number of layers (shrink)")
    parser.add_argument("--heads", type=int, default=0, help="override the number of heads (shrink)")
    parser.add_argument("--grid", type=parse_grid, default=None, help="override the latent grid TxHxW (shrink)")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--iters", type=int, default=3)
    parser.add_argument("--steps", type=int, default=50, help="denoising steps of the projected generation")
    parser.add_argument("--cfg-passes", type=int, default=2, help="transformer calls per step (2 with CFG)")
    parser.add_argument("--dense-steps", type=int, default=0, help="dense warm-up steps in the second projection")
    parser.add_argument("--compile", default="eager",
                        help="comma list of 'eager' and torch.compile modes ('default', 'max-autotune-no-cudagraphs', "
                             "...); every setting is timed under each")
    parser.add_argument("--precision", default="native",
                        help="comma list of sparse precisions: 'native' (the inputs' dtype), 'int8', 'fp8'")
    parser.add_argument("--compile-scope", default="full", choices=["full", "blocks"],
                        help="'full': torch.compile(transformer); 'blocks': transformer.compile_repeated_blocks()")
    args = parser.parse_args(argv)
    args.compile = args.compile.split(",")
    args.sparsity = [float(s) for s in args.sparsity.split(",")]
    args.precision = args.precision.split(",")
    args.backend = args.backend.split(",")
    if not set(args.backend) <= set(E2E_BACKENDS):
        parser.error(f"--backend values must be among {list(E2E_BACKENDS)}, got {args.backend}")
    if not set(args.precision) <= {"native", "int8", "fp8"}:
        parser.error(f"--precision values must be 'native', 'int8' or 'fp8', got {args.precision}")
    if not all(0.0 < s < 1.0 for s in args.sparsity):
        parser.error(f"--sparsity values must be in (0, 1), got {args.sparsity}")
    if args.tile not in ("auto", "none"):
        args.tile = tuple(int(t) for t in args.tile.split(","))
    names = args.models.split(",")
    unknown = [n for n in names if n not in MODELS]
    if unknown:
        parser.error(f"--models: unknown {unknown}; choose from {sorted(MODELS)}")
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)

    rows = []
    for name in names:
        rows.extend(run_model(name, args, device, dtype))
    meta = run_metadata(device, dtype=args.dtype, warmup=args.warmup, iters=args.iters, steps=args.steps,
                        cfg_passes=args.cfg_passes, dense_steps=args.dense_steps, dense_backend=args.dense_backend,
                        compile=args.compile, compile_scope=args.compile_scope)
    text = table(rows, args)
    write_result(args.out, meta, {"rows": rows}, text)
    print(json.dumps(meta))
    print(text)


if __name__ == "__main__":
    main()
