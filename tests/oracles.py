"""Obviously-right attention for tests: dense scores with the token-level mask, any precision."""
from __future__ import annotations

import pytest
import torch

from sparsevid.ops.mask import SparseMask, expand_block_mask

# On a GPU machine the kernel checks run on the GPU; elsewhere through Triton's interpreter (conftest.py).
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

# Attention test shapes (B, H, N, M, D, block_q, block_k): odd lengths, N < one block, N != M, B > 1, head dims
# 16..128.
ATTENTION_SHAPES = [
    pytest.param((1, 2, 200, 333, 64, 128, 64), id="N200-M333-d64-128x64"),
    pytest.param((2, 1, 100, 100, 32, 64, 64), id="B2-N100-d32-64x64"),
    pytest.param((1, 1, 50, 70, 16, 64, 128), id="N-below-block-d16-64x128"),
    pytest.param((2, 3, 333, 200, 128, 64, 128), id="B2-H3-N333-M200-d128-64x128"),
    pytest.param((1, 2, 256, 256, 80, 128, 128), id="even-d80-128x128"),
]

# Real-size GPU cases (B, H, N, M, D, block_q, block_k, sparsity): the Wan 1.3B 480p length (ragged), B > 1 with
# N != M, 64-row blocks, N below one block with every tile kept.
GPU_ATTENTION_CASES = [
    pytest.param((1, 2, 32760, 32760, 128, 128, 64, 0.95), id="wan480p-N32760-d128-128x64-95"),
    pytest.param((1, 2, 32760, 32760, 128, 128, 128, 0.90), id="wan480p-N32760-d128-128x128-90"),
    pytest.param((2, 3, 4133, 2900, 64, 128, 64, 0.5), id="B2-N4133-M2900-d64-128x64"),
    pytest.param((1, 4, 333, 200, 64, 64, 128, 0.5), id="N333-M200-d64-64x128"),
    pytest.param((1, 2, 100, 100, 128, 128, 128, 0.0), id="N-below-block-full"),
]


def dense_masked_attention(q, k, v, mask: SparseMask, scale: float | None = None,
                           compute_dtype: torch.dtype = torch.float64):
    """out [B, H, N, D] and lse [B, H, N] by dense masked softmax computed in ``compute_dtype``.

    With a half ``compute_dtype`` this is plain PyTorch's own low-precision attention (scores and
    products in that dtype, softmax in float32), the yardstick for kernel error budgets.
    """
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    qc, kc, vc = (t.to(compute_dtype) for t in (q, k, v))
    scores = (qc @ kc.transpose(-1, -2)).to(torch.promote_types(compute_dtype, torch.float32)) * scale
    scores = scores.masked_fill(~expand_block_mask(mask), float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)
    return (probs.to(compute_dtype) @ vc), lse


def rel_err(a: torch.Tensor, ref: torch.Tensor) -> float:
    """||a - ref|| / ||ref|| in float64 over the finite entries of ref (which a must share)."""
    a, ref = a.detach().double(), ref.detach().double()
    finite = torch.isfinite(ref)
    assert torch.equal(finite, torch.isfinite(a)), "finite/infinite entries differ"
    return float((a[finite] - ref[finite]).norm() / ref[finite].norm().clamp_min(1e-300))
