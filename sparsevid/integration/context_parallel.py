"""Sparse attention under diffusers' context parallelism (Ulysses).

``transformer.enable_parallelism(config=ContextParallelConfig(ulysses_degree=P))`` shards the video tokens
over P ranks. Around each self-attention, diffusers' Ulysses all-to-all regroups q, k, v so that every rank
holds the whole sequence for H/P of the heads ([B, N, H/P, D]), and a second all-to-all brings the output
back to the rank's tokens. The sparse processor runs diffusers' own processor pinned to the native backend,
which diffusers registers as context-parallel capable, and replaces only the one
``scaled_dot_product_attention`` call inside the all-to-alls: mask prediction and the block-sparse kernels see
the full sequence of the rank's own heads, so each rank predicts the masks of its heads only and the result
equals the single-device one. Rank r of the Ulysses group holds the global heads :func:`head_range` gives.

The token order hooks follow diffusers' context-parallel plan (``_cp_plan``) of a family, so only the families in
:data:`PARALLEL_FAMILIES` run under it; the others are refused, as is ring attention (``docs/context_parallel.md``
says why).
"""
from __future__ import annotations

from .adapters import ADAPTERS, ModelAdapter

# The families whose diffusers context-parallel plan the token order follows (tests/test_context_parallel.py).
PARALLEL_FAMILIES = ("wan", "chronoedit", "ltx", "ltx2")
# Families whose sparse self-attention attends text tokens jointly with the video.
JOINT_FAMILIES = ("hunyuan_video", "hunyuan_video15", "hunyuan_video_framepack", "cogvideox", "consisid",
                  "motif_video", "easyanimate", "mochi")


def _family_refusal(adapter: ModelAdapter) -> str:
    """Why sparse attention of ``adapter``'s family does not run under context parallelism."""
    supported = ", ".join(a.class_name for a in ADAPTERS if a.name in PARALLEL_FAMILIES)
    if adapter.name in JOINT_FAMILIES:
        reason = ("its self-attention is joint text-video attention, which sparse attention under context "
                  "parallelism does not split (it takes video-only self-attention)")
    else:
        reason = ("diffusers has no context-parallel plan (`_cp_plan`) for it, and the video token order is kept "
                  "only under the diffusers plans of those families")
    return (f"sparse attention under context parallelism supports {supported}; {adapter.class_name} is refused: "
            f"{reason} (see docs/context_parallel.md)")


def check_parallel_config(parallel_config, adapter: ModelAdapter, heads: int | None = None) -> None:
    """Raise ValueError unless sparse attention of ``adapter``'s family can run under ``parallel_config``.

    parallel_config: a diffusers ``ParallelConfig`` (what ``enable_parallelism`` records on the model and gives the
        processors) or None.
    heads: the attention's head count, checked against ``ulysses_degree`` when given.
    """
    cp = getattr(parallel_config, "context_parallel_config", None)
    if cp is None:
        return
    if adapter.name not in PARALLEL_FAMILIES:
        raise ValueError(_family_refusal(adapter))
    if cp.ring_degree > 1:
        raise ValueError(f"sparse attention supports Ulysses context parallelism only, got ring_degree="
                         f"{cp.ring_degree}; use ContextParallelConfig(ulysses_degree=...) (ring attention is "
                         f"not supported, see docs/context_parallel.md)")
    if heads is not None and heads % cp.ulysses_degree and not cp.ulysses_anything:
        raise ValueError(f"the attention has {heads} heads, not divisible by ulysses_degree={cp.ulysses_degree}; "
                         f"choose a divisor of {heads} or set ContextParallelConfig(ulysses_anything=True)")


def head_range(rank: int, degree: int, heads: int) -> range:
    """The global heads that rank ``rank`` of a Ulysses group of ``degree`` ranks holds, of ``heads`` in all.

    diffusers gives each rank ceil(heads / degree) consecutive heads (``ulysses_anything`` pads the head
    count up to a multiple of ``degree`` and drops the padding on the last rank), so local head i is
    global head ``start + i``.
    """
    if not 0 <= rank < degree:
        raise ValueError(f"rank must be in [0, {degree}), got {rank}")
    per_rank = -(-heads // degree)
    start = rank * per_rank
    return range(start, min(start + per_rank, heads))


def local_heads(parallel_config, heads: int) -> range:
    """The global heads this rank's attention holds under ``parallel_config`` (Ulysses), of ``heads``."""
    cp = parallel_config.context_parallel_config
    return head_range(cp._ulysses_local_rank, cp.ulysses_degree, heads)


def output_split(module):
    """diffusers' context-parallel hook that splits ``module``'s output over the ranks, or None.

    Such a module (Wan: ``rope``) hands every rank its chunk of the output in raster token order; the token
    order hooks recompute the whole output, reorder it and split that instead (``token_order``).
    """
    registry = getattr(module, "_diffusers_hook", None)
    if registry is None:
        return None
    from diffusers.hooks.context_parallel import ContextParallelSplitHook

    for hook in registry.hooks.values():
        if isinstance(hook, ContextParallelSplitHook) and any(
                getattr(spec, "split_output", False) for spec in hook.metadata.values()):
            return hook
    return None
