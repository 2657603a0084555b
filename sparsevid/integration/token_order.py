"""Video token order: 3D tiles once per transformer forward, or per attention call.

Sparse attention wants the video tokens in 3D-tile order (``sparsevid.ops.tiling``). Rather than gathering
q, k, v and scattering the output in every layer, the transformer can run every block in tile order:
everything but attention and RoPE is position-wise, and attention is permutation-equivariant when its
queries, keys, values and positions are permuted together. Hooks put the patch embedding's output, the RoPE
tables and any per-token input (the ``TokenSite`` s an adapter names) into the forward's order and put
the output projection's output back in raster order. A layer whose own tile differs from the forward's
reorders q, k, v itself (:func:`relative_order`).
"""
from __future__ import annotations

import functools
from collections import Counter

import torch

from ..ops.tiling import DEFAULT_TILE, tile_permutation
from .adapters import TokenSite, forward_argument, replace_argument
from .context_parallel import output_split
from .joint_attention import TokenOrder
from .step_context import StepContext

Tile = tuple[int, int, int]


def plan_tile(tile) -> Tile | None:
    """A LayerPlan's ``tile`` ("auto", "none" or (t, h, w)) as a tile shape, None for raster order."""
    if tile == "none":
        return None
    return DEFAULT_TILE if tile == "auto" else tuple(tile)


def forward_tile(plans) -> Tile | None:
    """The token order a forward runs in: the tile (None = raster) most of its sparse layers use.

    plans: the LayerPlan (or None for dense) of every self-attention at this step. Ties go to the
    earlier layer; with no sparse layer the forward stays in raster order (dense layers match exactly).
    """
    tiles = Counter(plan_tile(plan.tile) for plan in plans if plan is not None)
    return tiles.most_common(1)[0][0] if tiles else None


def tile_order(grid: Tile, tile, device: torch.device) -> TokenOrder:
    """The 3D-tile order of a (T, H, W) token grid (``tile``: "auto" or (t, h, w)); cached by ``ops.tiling``."""
    perm, inverse = tile_permutation(grid, tile=None if tile == "auto" else tile, device=device)
    return TokenOrder(perm, inverse)


def relative_order(current: TokenOrder | None, wanted: TokenOrder | None) -> TokenOrder | None:
    """The reordering from tokens in order ``current`` to order ``wanted`` (each None = raster).

    With ``x_cur = x[perm_c]``: ``x_cur[result.perm] = x[perm_w]`` and ``x[perm_w][result.inverse] = x_cur``.
    None when no reordering is needed.
    """
    if current is None:
        return wanted
    if wanted is None:
        return TokenOrder(current.inverse, current.perm)
    return TokenOrder(current.inverse[wanted.perm], wanted.inverse[current.perm])


def with_leading_tokens(order: TokenOrder | None, leading: int) -> TokenOrder | None:
    """``order`` extended to a sequence with ``leading`` more tokens before its own, which keep their place."""
    if order is None or leading == 0:
        return order
    head = torch.arange(leading, device=order.perm.device)
    return TokenOrder(torch.cat([head, order.perm + leading]), torch.cat([head, order.inverse + leading]))


def reorder_tokens(x: torch.Tensor, dim: int, index: torch.Tensor) -> torch.Tensor:
    """x with its last ``len(index)`` entries along ``dim`` taken in the order ``index`` (a new tensor).

    x: [..., L, ...] with L >= len(index) at ``dim``; entries before the video tokens (text) keep their place.
    """
    size, video = x.shape[dim], index.numel()
    if size < video:
        raise ValueError(f"expected at least {video} video tokens in dim {dim} of a tensor of shape "
                         f"{tuple(x.shape)}: the latent grid does not match the tokens the transformer sees")
    if size > video:
        index = torch.cat([torch.arange(size - video, device=index.device), index + (size - video)])
    return x.index_select(dim, index)


def _reorder_channels_first(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """A patch embedding [B, C, T, H, W] with its T*H*W tokens reordered, laid out as [B, N, C] in memory.

    ``result.flatten(2).transpose(1, 2)`` (how the model turns it into tokens) is then contiguous, so the
    model's own copy to a contiguous token tensor becomes a no-op: the gather replaces it.
    """
    if x.dim() != 5:
        raise ValueError(f"expected a 5D patch embedding [B, C, T, H, W], got shape {tuple(x.shape)}")
    tokens = reorder_tokens(x.flatten(2).transpose(1, 2), 1, index)  # [B, N, C], contiguous
    return tokens.transpose(1, 2).unflatten(2, x.shape[2:])


def _apply(site: TokenSite, value, index: torch.Tensor):
    """``value`` (a tensor, a tuple/list of tensors or None) reordered as ``site`` says."""
    if isinstance(value, (tuple, list)):
        return type(value)(_apply(site, v, index) for v in value)
    if not isinstance(value, torch.Tensor) or value.dim() < site.min_dims:
        return value
    if site.channels_first:
        return _reorder_channels_first(value, index)
    if site.frames_in_batch:  # [B*T, H*W, C] -> [B, N, C] reordered -> [B*T, H*W, C]
        return reorder_tokens(value.reshape(-1, index.numel(), value.shape[-1]), 1, index).reshape(value.shape)
    return reorder_tokens(value, site.dim, index)


def _reorder_output(context: StepContext, site: TokenSite, module, args, kwargs, output):
    """Forward hook on a submodule: its output in the forward's token order.

    When diffusers' context parallelism split that output over the ranks (in raster order), the whole output
    is recomputed without the split, reordered, and split as diffusers would.
    """
    if not context.reordering:
        return None
    with context.forward_span("reorder"):
        split = output_split(module)
        if split is None:
            return _apply(site, output, context.order.perm)
        whole = type(module).forward(module, *args, **kwargs)
        return split.post_forward(module, _apply(site, whole, context.order.perm))


def _reorder_arguments(context: StepContext, sites: tuple[TokenSite, ...], module, args, kwargs):
    """Transformer forward pre-hook: per-token forward arguments in the forward's token order."""
    context.reordering = context.order is not None
    if not context.reordering:
        return None
    with context.forward_span("reorder"):
        for site in sites:
            value = forward_argument(module, site.name, args, kwargs)
            if value is not None:
                args, kwargs = replace_argument(module, site.name, args, kwargs,
                                                _apply(site, value, context.order.perm))
    return args, kwargs


def _restore_output(context: StepContext, module, args, output):
    """Forward hook on the output projection: its tokens [B, N, C] back in raster order."""
    if not context.reordering:
        return None
    with context.forward_span("restore"):
        return reorder_tokens(output, 1, context.order.inverse)


def _end_forward(context: StepContext, module, args, kwargs, output):
    """Transformer forward hook (also on errors): the site hooks stop acting until the next forward."""
    context.reordering = False


def install_reordering(transformer: torch.nn.Module, sites: tuple[TokenSite, ...], output_module: str,
                       context: StepContext) -> list[torch.utils.hooks.RemovableHandle]:
    """Hooks that run ``transformer`` in ``context.order``; install them after the forward pre-hook that sets
    the order. Returns their handles.

    Argument sites are reordered by a forward pre-hook, module sites by forward hooks on those submodules,
    and ``output_module``'s output is put back in raster order by a forward hook.
    """
    arguments = tuple(site for site in sites if site.argument)
    handles = [
        transformer.register_forward_pre_hook(functools.partial(_reorder_arguments, context, arguments),
                                              with_kwargs=True),
        transformer.register_forward_hook(functools.partial(_end_forward, context), with_kwargs=True,
                                          always_call=True),
    ]
    for site in sites:
        if not site.argument:
            module = transformer.get_submodule(site.name)
            handles.append(module.register_forward_hook(functools.partial(_reorder_output, context, site),
                                                        with_kwargs=True))
    output = transformer.get_submodule(output_module)
    handles.append(output.register_forward_hook(functools.partial(_restore_output, context)))
    return handles
