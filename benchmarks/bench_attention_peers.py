"""The quantized and block-sparse peers beside sparsevid's forwards, on the same inputs and masks: what ran, how
fast and how close, and why the others did not.

Peers (each optional: a failed import or call is recorded with its reason and the others still run):

- SageAttention (``sageattention``, Triton: dense attention with INT8 Q K^T per block and K smoothing): its dense
  time, and that time times the kept share, what a block-sparse kernel at SageAttention's speed per tile would take.
- FlashInfer's Hopper block-sparse attention (``flashinfer``: ``VariableBlockSparseAttentionWrapper`` with its
  "cake" kernels, compiled at first use with a CUDA compiler; 64-token blocks, head dim 128), bf16 and its Sage FP8
  route (quantization timed with it), on sparsevid's per-head mask (a 128-row block as two 64-row blocks); bf16
  also with the mask planned in every call, as a mask predicted every step would be.
- SpargeAttn (``spas_sage_attn``, built from source: block-sparse SageAttention2), on the same mask.
- flash-attn-4 (``flash_attn.cute``, FlashAttention's CuTe DSL kernels: FlashAttention-3's schedule on Hopper) with
  its block sparsity, on sparsevid's own count and index tables (sparsevid's ``backend="flash_attn4"``).

With ``--backward``, forward + backward too for cuDNN, sparsevid's bf16 kernels and flash-attn-4 (its Hopper backward on
the mask's transposed tables, 128-token key blocks), their gradients against sparsevid's bf16 ones (the largest
relative L1 of dq, dk, dv).

sparsevid's bf16 and int8 forwards and dense cuDNN SDPA run in the same process on the same Gaussian inputs; the
mask is ``predict_mask``'s top-k at 1 - sparsity, on each tile grid of ``--blocks`` (128x64, the library's default,
and 64x128, SpargeAttn's Hopper tile). Accuracy: cosine similarity and relative L1 of each
output against sparsevid's bf16 output on the same mask (SageAttention, dense: against cuDNN's). The default shape is
Wan 1.3B at 480p padded to 32,768 tokens, a multiple of FlashInfer's 64-token blocks (32,760 is not).

    python scripts/peer_wheels.py --out .whl/peers     # the peers' wheels, for a machine without an index
    python -m benchmarks attention_peers
"""
from __future__ import annotations

import argparse
import functools
import json
from pathlib import Path

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

import sparsevid as sv
from .bench_attention import SHAPES, bench
from .bench_attention_fp8 import output_metrics
from .report import write_result
from .run_info import run_metadata


def sage_dense(q, k, v, mask):
    """SageAttention's dense call (the mask is not used: SageAttention has no block-sparse form)."""
    from sageattention import sageattn

    return lambda: sageattn(q, k, v, tensor_layout="HND", is_causal=False)


FLASHINFER_BLOCK = 64  # the token block of FlashInfer's Hopper block-sparse kernels, query and key


def flashinfer_blocks(mask: sv.SparseMask) -> torch.Tensor:
    """The mask of batch 1 as FlashInfer's Hopper block map: bool [H, N / 64, M / 64], each query block of
    ``mask.block_q`` rows repeated as block_q / 64 rows of 64."""
    if mask.keep.shape[0] != 1 or mask.block_k != FLASHINFER_BLOCK or mask.block_q % FLASHINFER_BLOCK or \
            mask.q_len % FLASHINFER_BLOCK or mask.kv_len % FLASHINFER_BLOCK:
        raise ValueError(f"FlashInfer's Hopper block-sparse kernels take batch 1, {FLASHINFER_BLOCK}-token key blocks "
                         f"and lengths that are multiples of {FLASHINFER_BLOCK}; got batch {mask.keep.shape[0]}, "
                         f"blocks {mask.block_q}x{mask.block_k}, lengths {mask.q_len} x {mask.kv_len}")
    rows = mask.keep[0].repeat_interleave(mask.block_q // FLASHINFER_BLOCK, dim=1)
    return rows[:, :mask.q_len // FLASHINFER_BLOCK].contiguous()


def flashinfer_sparse(q, k, v, mask, fp8: bool = False, plan_per_call: bool = False):
    """FlashInfer's Hopper block-sparse attention ("cake" kernels) on the mask; with ``fp8`` its Sage FP8 route,
    each call quantizing q, k, v (``sage_fp8_quantize_sm90``) before the kernel, as sparsevid's int8 call does.
    With ``plan_per_call`` (bf16) each call also plans the mask (its host-side schedule, built from a copy of the
    block map), what a mask that changes every step (a predicted one) costs; otherwise the plan is made once."""
    import flashinfer
    from flashinfer.cake_vsa_sm90 import sage_fp8_quantize_sm90

    blocks = flashinfer_blocks(mask)
    heads, d = q.shape[1], q.shape[3]
    sizes = [torch.full((heads, n), FLASHINFER_BLOCK, dtype=torch.int32, device=q.device) for n in blocks.shape[1:]]
    workspace = torch.empty(128 << 20, dtype=torch.uint8, device=q.device)
    wrapper = flashinfer.VariableBlockSparseAttentionWrapper(workspace, backend="cake")
    q3, k3, v3 = (t[0].contiguous() for t in (q, k, v))  # [H, T, D], the kernels' HND layout
    if not fp8:
        def plan():
            wrapper.plan(blocks, *sizes, heads, heads, d, q_data_type=torch.bfloat16)

        def plan_and_run():
            plan()
            return wrapper.run(q3, k3, v3)[None]

        plan()
        return plan_and_run if plan_per_call else (lambda: wrapper.run(q3, k3, v3)[None])
    _, _, _, q_scale, k_scale, v_scale = sage_fp8_quantize_sm90(q3, k3, v3)
    wrapper.plan(blocks, *sizes, heads, heads, d, q_data_type=torch.float8_e4m3fn, q_scale=q_scale, k_scale=k_scale,
                 v_scale=v_scale)

    def quantize_and_run():
        q8, k8, v8, *scales = sage_fp8_quantize_sm90(q3, k3, v3)
        for bound, fresh in zip((q_scale, k_scale, v_scale), scales):  # the plan holds the scale tensors
            bound.copy_(fresh)
        return wrapper.run(q8, k8, v8)[None]

    return quantize_and_run


def flash_attn4_sparse(q, k, v, mask):
    """flash-attn-4's CuTe DSL forward (``flash_attn.cute``: FlashAttention-3's warp-specialised schedule on
    Hopper, compiled at first use) with its block sparsity on the mask's own tables, as sparsevid's
    ``backend="flash_attn4"`` runs it (without the public call's input checks)."""
    from sparsevid.ops.flash_attn4 import check_flash_attn4_request, flash_attn4_attention

    check_flash_attn4_request(q, k, v, mask)
    scale = q.shape[-1] ** -0.5
    return lambda: flash_attn4_attention(q, k, v, mask, scale)[0]


def sparge_tile(capability: tuple[int, int]) -> tuple[int, int]:
    """Query rows x keys of SpargeAttn's block-sparse tile on a GPU of ``capability``: 64 x 128 on Hopper (its
    sm90 kernel), 128 x 64 on the others."""
    return (64, 128) if capability == (9, 0) else (128, 64)


def sparge_sparse(q, k, v, mask):
    """SpargeAttn's block-sparse SageAttention2 with the mask as a dense [B, H, QB, KB] block map, which must be of
    SpargeAttn's tiles on this GPU; its own skipping of small P V products is off (the mask's tiles, all of them)."""
    from spas_sage_attn import block_sparse_sage2_attn_cuda

    tile = sparge_tile(torch.cuda.get_device_capability(q.device))
    if (mask.block_q, mask.block_k) != tile:
        raise ValueError(f"SpargeAttn's kernel on this GPU takes {tile[0]}x{tile[1]} tiles; the mask has "
                         f"{mask.block_q}x{mask.block_k} (run with --blocks {tile[0]}x{tile[1]})")
    blocks = mask.to_dense().to(torch.int8)
    return lambda: block_sparse_sage2_attn_cuda(q, k, v, mask_id=blocks, pvthreshd=1e9)


PEERS = {"sageattention (dense)": sage_dense, "flashinfer block-sparse bf16": flashinfer_sparse,
         "flashinfer block-sparse bf16, planned per call":
             lambda q, k, v, mask: flashinfer_sparse(q, k, v, mask, plan_per_call=True),
         "flashinfer block-sparse sage fp8": lambda q, k, v, mask: flashinfer_sparse(q, k, v, mask, fp8=True),
         "spargeattn block-sparse": sparge_sparse, "flash-attn-4 block-sparse bf16": flash_attn4_sparse}
PEER_SHAPES = {**SHAPES, "wan1.3b-480p-64": (1, 12, 32768, 128)}  # 32,760 tokens padded to FlashInfer's blocks


def peer_row(name: str, q, k, v, mask, reference: torch.Tensor) -> dict:
    """One peer on one mask: its ms and accuracy against ``reference``, or why it did not run."""
    try:
        call = PEERS[name](q, k, v, mask)
        with torch.no_grad():
            out = call()
            torch.cuda.synchronize()
            return {"peer": name, "ran": True, "ms": bench(call), **output_metrics(out, reference)}
    except Exception as error:  # recorded: the point of this benchmark is what runs where
        return {"peer": name, "ran": False, "why": _why(error)}


def _why(error: Exception) -> str:
    return f"{type(error).__name__}: {error}"[:300]


# The forward + backward of the competitors that have one: (q, k, v, mask) -> out, differentiable.
BACKWARD_CALLS = {
    "sparsevid bf16": lambda q, k, v, mask: sv.block_sparse_attention(q, k, v, mask, backend="triton"),
    "flash-attn-4 block-sparse bf16": lambda q, k, v, mask: sv.block_sparse_attention(q, k, v, mask,
                                                                                      backend="flash_attn4"),
}


def fwdbwd_fields(attend, q, k, v, grad, reference_grads=None) -> tuple[dict, tuple]:
    """Forward + backward of ``attend(q, k, v)`` (inputs that require grad, output gradient ``grad``): its ms and,
    given ``reference_grads``, the largest relative L1 of its (dq, dk, dv) against them; or why it did not run.
    Returns (fields, its gradients)."""
    try:
        grads = torch.autograd.grad(attend(q, k, v), (q, k, v), grad)
        fields = {"fwdbwd_ms": bench(lambda: attend(q, k, v).backward(grad), grad_to_none=[q, k, v])}
    except Exception as error:  # recorded, as the forward's failures are
        return {"fwdbwd_why": _why(error)}, ()
    if reference_grads:
        fields["grad_rel_l1"] = max(output_metrics(g, r)["rel_l1"] for g, r in zip(grads, reference_grads))
    return fields, grads


def chosen_peers(names: str) -> list[str]:
    """The peers of ``names`` (comma-separated parts of their names, e.g. "flash-attn-4,spargeattn"; "all": every
    one) in PEERS' order."""
    if names == "all":
        return list(PEERS)
    parts = [part.strip() for part in names.split(",") if part.strip()]
    unknown = [part for part in parts if not any(part in name for name in PEERS)]
    if unknown or not parts:
        raise ValueError(f"--peers: each part must occur in a peer's name of {list(PEERS)}, got {names!r}")
    return [name for name in PEERS if any(part in name for part in parts)]


def rows_for(shape: str, sparsity: float, block_q: int, block_k: int, generator,
             peers: tuple[str, ...] = tuple(PEERS), backward: bool = False) -> list[dict]:
    """sparsevid's forwards, cuDNN and ``peers`` at one shape and sparsity (with ``backward``, forward + backward
    too where a competitor has one)."""
    b, h, n, d = PEER_SHAPES[shape]
    q, k, v = (torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16, generator=generator) for _ in range(3))
    mask = sv.predict_mask(q, k, rule="topk", topk=1.0 - sparsity, block_q=block_q, block_k=block_k)[0]
    with torch.no_grad():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            dense = lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v)  # noqa: E731
            dense_out, cudnn_ms = dense(), bench(dense)
        ours = sv.block_sparse_attention(q, k, v, mask, backend="triton")  # "auto" may take flash-attn-4
        common = {"shape": shape, "block": f"{block_q}x{block_k}", "sparsity": mask.sparsity, "cudnn_ms": cudnn_ms}
        rows = [{**common, "peer": "sparsevid bf16", "ran": True,
                 "ms": bench(lambda: sv.block_sparse_attention(q, k, v, mask, backend="triton"))},
                {**common, "peer": "sparsevid int8", "ran": True,
                 "ms": bench(lambda: sv.block_sparse_attention(q, k, v, mask, precision="int8")),
                 **output_metrics(sv.block_sparse_attention(q, k, v, mask, precision="int8"), ours)}]
    for name in peers:
        reference = dense_out if name.endswith("(dense)") else ours
        rows.append({**common, **peer_row(name, q, k, v, mask, reference)})
    if backward:
        add_backward(rows, q, k, v, mask, generator)
    kept = 1.0 - mask.sparsity
    for row in rows:
        if row["ran"]:
            row["x_cudnn"] = cudnn_ms / row["ms"]
            if row["peer"].endswith("(dense)"):
                row["ms_at_kept_share"] = row["ms"] * kept
        if "fwdbwd_ms" in row:
            row["x_cudnn_fwdbwd"] = row["cudnn_fwdbwd_ms"] / row["fwdbwd_ms"]
    return rows


def add_backward(rows: list[dict], q, k, v, mask, generator) -> None:
    """Forward + backward of cuDNN (into every row, as cudnn_fwdbwd_ms) and of each row's competitor that has one
    (gradients against sparsevid bf16's)."""
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    grad = torch.randn(q.shape, device=q.device, dtype=q.dtype, generator=generator)
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        cudnn, _ = fwdbwd_fields(torch.nn.functional.scaled_dot_product_attention, q, k, v, grad)
    reference_grads = None
    for row in rows:
        row["cudnn_fwdbwd_ms"] = cudnn.get("fwdbwd_ms", float("nan"))
        if row["peer"] in BACKWARD_CALLS:
            attend = functools.partial(BACKWARD_CALLS[row["peer"]], mask=mask)
            fields, grads = fwdbwd_fields(attend, q, k, v, grad, reference_grads)
            reference_grads = reference_grads or grads  # sparsevid bf16's, the first row
            row.update(fields)


def markdown(rows: list[dict]) -> str:
    lines = ["| shape | tile | sparsity | peer | ms | x cuDNN | dense ms x kept share | cosine / rel L1 | "
             "fwd+bwd ms | x cuDNN | grads rel L1 | why not |", "|---" * 12 + "|"]
    for r in rows:
        ran = r["ran"]
        accuracy = f"{r['cosine']:.5f} / {r['rel_l1']:.4f}" if "cosine" in r else "-"
        head = f"| {r['shape']} | {r['block']} | {r['sparsity']:.3f} | {r['peer']} |"
        forward = (f" {r['ms']:.3f} | {r['x_cudnn']:.1f}x | {r.get('ms_at_kept_share', float('nan')):.3f} | "
                   f"{accuracy} |" if ran else " - | - | - | - |")
        backward = (f" {r['fwdbwd_ms']:.3f} | {r['x_cudnn_fwdbwd']:.1f}x | {r.get('grad_rel_l1', float('nan')):.4f} |"
                    if "fwdbwd_ms" in r else " - | - | - |")
        why = "; ".join(r[key] for key in ("why", "fwdbwd_why") if key in r)
        lines.append(f"{head}{forward}{backward} {why} |")
    return "\n".join(lines).replace("| nan |", "| - |")


def figure(rows: list[dict], meta: dict):
    """Forward ms of every competitor that ran, one horizontal bar per competitor in one panel per shape, tile and
    sparsity (log scale: FlashInfer planned per call is three orders slower). A matplotlib Figure outside pyplot,
    so that the redraw after every group of rows holds no global state."""
    from matplotlib.figure import Figure

    groups = list(dict.fromkeys((r["shape"], r["block"], r["sparsity"]) for r in rows))
    fig = Figure(figsize=(8, 1.2 + 1.6 * len(groups)))
    axes = fig.subplots(len(groups), 1, squeeze=False, sharex=True)  # one scale: bars comparable across panels
    for ax, (shape, block, sparsity) in zip(axes[:, 0], groups):
        ran = [r for r in rows if (r["shape"], r["block"], r["sparsity"]) == (shape, block, sparsity) and r["ran"]]
        colors = ["tab:blue" if r["peer"].startswith("sparsevid") else "tab:gray" for r in ran]
        ax.barh([r["peer"] for r in ran], [r["ms"] for r in ran], color=colors)
        for y, r in enumerate(ran):
            ax.text(r["ms"], y, f" {r['ms']:.3f}", va="center", fontsize=7)
        ax.set_xscale("log")
        ax.invert_yaxis()
        ax.tick_params(labelsize=7)
        ax.set_title(f"{shape}, {block} tiles, {sparsity:.1%} sparse", fontsize=8)
    times = [r["ms"] for r in rows if r["ran"]]
    axes[-1, 0].set_xlim(min(times) / 2, max(times) * 4)
    axes[-1, 0].set_xlabel("forward ms (log scale; sparsevid in blue)")
    fig.suptitle(f"Block-sparse attention peers, {meta['gpu']}, {meta['commit']}", fontsize=9)
    fig.tight_layout()
    return fig


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="folder of the result (<gpu>.json/.md/.png)")
    parser.add_argument("--shapes", default="wan1.3b-480p-64", help=f"comma-separated, of {list(PEER_SHAPES)}")
    parser.add_argument("--sparsities", default="0.95,0.9")
    parser.add_argument("--peers", default="all", help="comma-separated parts of peer names to run (default all), "
                        "e.g. flash-attn-4 for a shape the others do not take")
    parser.add_argument("--backward", action="store_true",
                        help="also forward + backward of cuDNN, sparsevid bf16 and flash-attn-4 (128-token key blocks)")
    parser.add_argument("--blocks", default="128x64,64x128",
                        help="comma-separated block_q x block_k of the masks (FlashInfer takes 64-key blocks, "
                             "SpargeAttn 64x128 on Hopper)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_attention_peers.py needs a CUDA GPU")
    peers = tuple(chosen_peers(args.peers))
    blocks = [tuple(int(s) for s in block.split("x")) for block in args.blocks.split(",")]
    meta = run_metadata("cuda", dtype="bfloat16 inputs", blocks=args.blocks)
    generator = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    for shape in args.shapes.split(","):
        for (block_q, block_k), sparsity in ((b, float(s)) for b in blocks for s in args.sparsities.split(",")):
            rows += rows_for(shape, sparsity, block_q, block_k, generator, peers, args.backward)
            write_result(args.out, meta, {"rows": rows}, markdown(rows), figure(rows, meta))
    print(json.dumps(meta))
    print(markdown(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
