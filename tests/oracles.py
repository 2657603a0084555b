"""Obviously-right attention for tests: dense scores with the token-level mask, any precision."""
from __future__ import annotations

import torch

from sparsevid.ops.mask import SparseMask, expand_block_mask

# On a GPU machine the kernel checks run on the GPU; elsewhere through Triton's interpreter (conftest.py).
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


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
