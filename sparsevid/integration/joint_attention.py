"""The one attention core every model processor shares: sparse video-to-video, dense everything else.

A self-attention sequence holds ``video_len`` video tokens starting at ``video_start``; any other tokens
are text (before or after the video). Video query rows attend video keys through a predicted block-sparse
mask (in 3D-tiled token order when a token order is given) and text keys densely; the two partial results
are merged exactly through their log-sum-exps. Text query rows attend every key densely.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..ops import SparseMask, block_sparse_attention
from ..ops.caching import traceable_cache
from .stats import mark


@dataclass(frozen=True)
class TokenLayout:
    """Where the video tokens sit in a joint sequence of ``total`` tokens (the rest are text)."""

    video_start: int
    video_len: int
    total: int

    @property
    def video(self) -> slice:
        return slice(self.video_start, self.video_start + self.video_len)

    @property
    def text(self) -> slice:
        """The text tokens: all tokens before the video, or (if none) all after it."""
        if self.video_start > 0:
            return slice(0, self.video_start)
        return slice(self.video_len, self.total)

    @property
    def text_len(self) -> int:
        return self.total - self.video_len


@dataclass(frozen=True)
class TokenOrder:
    """A permutation of the video tokens: ``x_tiled = x[..., perm, :]``, ``x = x_tiled[..., inverse, :]``."""

    perm: torch.Tensor
    inverse: torch.Tensor


def text_key_sets(attn_mask: torch.Tensor | None, layout: TokenLayout, batch: int) -> list[torch.Tensor] | None:
    """Valid text-key indices (relative to the text slice) per batch entry, from a key-padding mask.

    attn_mask: bool, broadcastable to [B, 1, 1, N] (True = attend), or [B|1, 1, N, N] whose video query rows all
    equal one key-padding row (HunyuanVideo 1.5's valid_i & valid_j), or None (every key valid -> None).
    Returns a list of B LongTensors. Reads the mask on the host (callers cache it per forward).
    """
    if attn_mask is None:
        return None
    if attn_mask.dtype != torch.bool:
        raise TypeError(f"sparse attention supports boolean key-padding attention masks only, got dtype {attn_mask.dtype}")
    if attn_mask.dim() == 4 and attn_mask.shape[1] == 1 and attn_mask.shape[2] == layout.total > 1:
        rows = attn_mask[:, 0, layout.video]  # [B|1, Nv, N]
        if not bool((rows == rows[:, :1]).all()):
            raise ValueError("sparse attention needs the video query rows of a [B, 1, N, N] attention mask to be one "
                             "key-padding row; this mask differs between video rows")
        attn_mask = rows[:, None, :1]  # [B|1, 1, 1, N]
    if attn_mask.dim() != 4 or attn_mask.shape[1] != 1 or attn_mask.shape[2] != 1 or attn_mask.shape[0] not in (1, batch) \
            or attn_mask.shape[3] != layout.total:
        raise ValueError(f"sparse attention supports key-padding attention masks of shape [B|1, 1, 1, N={layout.total}], "
                         f"got {tuple(attn_mask.shape)}")
    keys = attn_mask[:, 0, 0].expand(batch, layout.total)
    if not bool(keys[:, layout.video].all()):
        raise ValueError("sparse attention needs every video token to be a valid key; the attention mask hides some")
    text = keys[:, layout.text]
    if bool((text == text[:1]).all()):  # one padding pattern for the whole batch: one tensor, shared
        return [torch.nonzero(text[0]).flatten()] * batch
    return [torch.nonzero(row).flatten() for row in text]


def merge_partials(out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor,
                   out: torch.Tensor | None = None) -> torch.Tensor:
    """Softmax over the union of two disjoint key sets from each set's output [B, H, n, D] and lse [B, H, n].

    Computed in float32 (float64 for float64 inputs), returned in out_a's dtype, or written into ``out``
    [B, H, n, D] (any strides; the cast and the placement are then one copy) and returned. lse_a must be finite;
    lse_b may be -inf (an empty key set, whose out_b must then be finite).
    """
    compute = torch.promote_types(out_a.dtype, torch.float32)
    lse = torch.logaddexp(lse_a, lse_b)
    weight_a = torch.exp(lse_a - lse).unsqueeze(-1)
    weight_b = torch.exp(lse_b - lse).unsqueeze(-1)
    merged = out_a.to(compute) * weight_a + out_b.to(compute) * weight_b
    return merged.to(out_a.dtype) if out is None else out.copy_(merged)


@traceable_cache()
def _full_mask(q_len: int, kv_len: int, block_q: int, block_k: int, device: torch.device) -> SparseMask:
    """``SparseMask.full`` for these sizes, made once per (sizes, device) and shared by every layer and forward
    (as ``tile_permutation`` shares its permutations)."""
    return SparseMask.full(q_len, kv_len, block_q, block_k, device=device)


def attend_text_keys(q_video: torch.Tensor, k_text: torch.Tensor, v_text: torch.Tensor,
                     key_sets: list[torch.Tensor] | None, block_q: int, block_k: int, scale: float | None,
                     backend: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Dense attention of video rows [B, H, Nv, D] over the valid text keys (``key_sets``: see
    :func:`text_key_sets`; None: all), through ``block_sparse_attention`` with a full mask of block_q x block_k
    tiles: (out [B, H, Nv, D], lse [B, H, Nv]); an entry without valid text keys (an empty prompt's mask) gets
    zeros with lse -inf (it adds nothing)."""
    def attend(q, k, v):
        if k.shape[2] == 0:
            lse_dtype = torch.promote_types(q.dtype, torch.float32)  # as block_sparse_attention's lse
            return q.new_zeros(q.shape), q.new_full(q.shape[:3], float("-inf"), dtype=lse_dtype)
        full = _full_mask(q.shape[2], k.shape[2], block_q, block_k, q.device)
        return block_sparse_attention(q, k, v, full, scale=scale, return_lse=True, backend=backend)

    if key_sets is None:
        return attend(q_video, k_text, v_text)
    if all(s is key_sets[0] or torch.equal(key_sets[0], s) for s in key_sets[1:]):
        keys = key_sets[0]
        return attend(q_video, k_text.index_select(2, keys), v_text.index_select(2, keys))
    outs, lses = zip(*(attend(q_video[b:b + 1], k_text[b:b + 1].index_select(2, keys),
                              v_text[b:b + 1].index_select(2, keys)) for b, keys in enumerate(key_sets)))
    return torch.cat(outs), torch.cat(lses)


def video_tokens(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: TokenLayout,
                 order: TokenOrder | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The video part of q, k, v [B, H, N, D] in the order the sparse attention runs in: views when ``order`` is
    None, else gathered [B, H, Nv, D] copies. The mask of :func:`joint_sparse_attention` is over these."""
    if q.shape[2] != layout.total or k.shape[2] != layout.total:
        raise ValueError(f"q and k must have {layout.total} tokens (video + text), got {q.shape[2]} and {k.shape[2]}")
    video = layout.video
    q_v, k_v, v_v = q[:, :, video], k[:, :, video], v[:, :, video]
    if order is not None:
        q_v, k_v, v_v = (t.index_select(2, order.perm) for t in (q_v, k_v, v_v))
    return q_v, k_v, v_v


def joint_sparse_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: TokenLayout, mask: SparseMask,
                           order: TokenOrder | None = None, *, video=None, scale: float | None = None,
                           backend: str = "auto", precision: str = "native", attn_mask: torch.Tensor | None = None,
                           key_sets: list[torch.Tensor] | None = None, tile_mass: bool = False, clock=None):
    """Attention with sparse video-to-video tiles (under ``mask``) and dense text rows and columns.

    q, k, v: [B, H, N, D] (any strides), N = layout.total. mask: over the video tokens in ``order`` (the order
    the sparse part runs in, relative to q's; None: as given), e.g. predicted from :func:`video_tokens`.
    video: the ``video_tokens(q, k, v, layout, order)`` the caller already has (else gathered here).
    backend, precision: of the video-to-video block-sparse attention (the text parts run at the native
    precision). tile_mass: also return the exact tile masses float32
    [B, H, QB, KB] of the video-to-video attention (``return_tile_mass``; inference only), else None.
    attn_mask: the mask the text rows use (as in SDPA): key padding [B|1, 1, 1, N] or per row [B|1, 1, N, N];
    key_sets: its valid text keys per batch entry (see :func:`text_key_sets`), None if all are valid.
    clock: optional ``stats.Clock``; marks "attended" (before the output is put back in the original token order
    and the text rows are computed). No copies of q, k, v or the output are made beyond ``order``'s gathers and
    scatter: the video-to-video output lands in q's layout, merged joint rows go straight into the output buffer.
    Returns (out [B, H, N, D], tile masses or None).
    """
    batch, heads, total, dim = q.shape
    q_v, k_v, v_v = video_tokens(q, k, v, layout, order) if video is None else video

    def attend(return_lse: bool) -> tuple:
        """(out, lse if return_lse, tile masses or None) of the video-to-video part."""
        result = block_sparse_attention(q_v, k_v, v_v, mask, scale=scale, return_lse=return_lse, backend=backend,
                                        return_tile_mass=tile_mass, precision=precision)
        if tile_mass:
            return result
        return (*(result if return_lse else (result,)), None)

    if layout.text_len == 0 and order is None:
        # The triton kernels write q's layout: for diffusers' transposed [B, N, H, D] view, where diffusers reads.
        out_v, mass = attend(return_lse=False)
        mark(clock, "attended")
        return out_v, mass
    base = q.new_empty(batch, total, heads, dim)  # [B, N, H, D]: where diffusers reads the output
    out = base.transpose(1, 2)
    out_video = out[:, :, layout.video]
    if layout.text_len == 0:
        out_v, mass = attend(return_lse=False)
    else:
        out_vv, lse_vv, mass = attend(return_lse=True)
        out_vt, lse_vt = attend_text_keys(q_v, k[:, :, layout.text], v[:, :, layout.text], key_sets, mask.block_q,
                                          mask.block_k, scale, backend)
        out_v = merge_partials(out_vv, lse_vv, out_vt, lse_vt, out=out_video if order is None else None)
    mark(clock, "attended")
    if order is not None and layout.text_len == 0:
        # Into the base tensor itself: torch.compile's functionalisation keeps its strides (not a view's).
        base.index_copy_(1, order.perm, out_v.transpose(1, 2))
    elif order is not None:
        out_video.index_copy_(2, order.perm, out_v)
    if layout.text_len:
        text = layout.text
        if attn_mask is not None and attn_mask.shape[2] == total > 1:
            attn_mask = attn_mask[:, :, text]
        out[:, :, text] = F.scaled_dot_product_attention(q[:, :, text], k, v, attn_mask=attn_mask, scale=scale)
    return out, mass
