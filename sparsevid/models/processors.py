"""The sparse attention processor: diffusers' own processor, with its attention call made sparse.

:class:`SparseAttnProcessor` wraps the model's original processor. Dense decisions call the original
unchanged. Sparse decisions run a copy of it (pinned to diffusers' native attention backend) while a
torch-function mode routes its one ``scaled_dot_product_attention`` call to
:func:`~sparsevid.models.joint_attention.joint_sparse_attention`. Projections, norms, RoPE and output
layers therefore stay diffusers' code, whatever the model or diffusers version.
"""
from __future__ import annotations

import copy
import functools
import inspect

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from ..schedules import LayerPlan, MaskReuse, SparseConfig
from .adapters import ModelAdapter
from .context_parallel import check_parallel_config, check_video_only, local_heads
from .joint_attention import TokenLayout, TokenOrder, joint_sparse_attention, text_key_sets
from .stats import AttentionRecord, Clock
from .step_context import StepContext
from .token_order import plan_tile, relative_order, tile_order


class SDPAInterceptor(TorchFunctionMode):
    """Inside ``with``, calls of ``F.scaled_dot_product_attention`` go to ``handler`` (same signature)."""

    def __init__(self, handler):
        super().__init__()
        self.handler = handler
        self.calls = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            self.calls += 1
            return self.handler(*args, **kwargs)
        return func(*args, **kwargs)


def _native_copy(processor):
    """A shallow copy of ``processor`` whose diffusers attention dispatch uses the native (SDPA) backend."""
    pinned = copy.copy(processor)
    if hasattr(pinned, "_attention_backend"):
        from diffusers.models.attention_dispatch import AttentionBackendName

        pinned._attention_backend = AttentionBackendName.NATIVE
    return pinned


class SparseAttnProcessor:
    """Replaces the processor of one video self-attention module (see module docstring).

    Under diffusers' Ulysses context parallelism (``enable_parallelism``, before or after applying) the
    sparse core runs between diffusers' all-to-alls on the whole sequence of this rank's heads
    (``context_parallel``).

    Args:
        original: the processor it replaces (kept unmodified but for the ``_parallel_config`` that
            ``enable_parallelism`` sets through this processor; ``remove_sparse_attention`` puts it back).
        layer: index of this self-attention in the transformer.
        config: the SparseConfig deciding dense/sparse per (layer, step).
        context: the transformer's shared StepContext.
        adapter: model-family facts (where text tokens sit).
    """

    def __init__(self, original, layer: int, config: SparseConfig, context: StepContext, adapter: ModelAdapter):
        check_parallel_config(getattr(original, "_parallel_config", None))
        self.original = original
        self.layer = layer
        self.config = config
        self.context = context
        self.adapter = adapter
        self._native = _native_copy(original)
        self._masks = MaskReuse()
        self._signature = inspect.signature(original.__call__)
        # diffusers' Attention.forward filters keyword arguments by the processor's signature: expose the original's.
        self.__call__ = functools.wraps(original.__call__)(functools.partial(type(self).__call__, self))

    @property
    def _parallel_config(self):
        """diffusers' context-parallel config of the original (AttributeError where it has none, so that
        ``enable_parallelism`` treats this processor as it would the original)."""
        return self.original._parallel_config

    @_parallel_config.setter
    def _parallel_config(self, config) -> None:
        self.original._parallel_config = config
        self._native._parallel_config = config

    def __call__(self, attn, *args, **kwargs):
        context = self.context
        plans = context.forward_cache.get("plans")  # decided once per forward by the transformer's pre-hook
        plan = plans[self.layer] if plans is not None else self.config.plan(self.layer, context.step,
                                                                             context.timestep)
        parallel = getattr(self.original, "_parallel_config", None)
        check_parallel_config(parallel, attn.heads)
        if plan is None and not context.collect_stats:
            return self.original(attn, *args, **kwargs)
        bound = self._signature.bind(attn, *args, **kwargs).arguments
        layout = self._layout(bound["hidden_states"], bound.get("encoder_hidden_states"))
        heads = None
        if parallel is not None:
            check_video_only(layout)
            heads = local_heads(parallel, attn.heads)
        record = None
        if context.collect_stats:
            record = AttentionRecord(self.layer, context.step, plan is None, layout.video_len, layout.text_len,
                                     Clock(bound["hidden_states"].device))
            context.records.append(record)
        handler = functools.partial(self._attend, plan=plan, layout=layout, record=record, heads=heads)
        with SDPAInterceptor(handler) as interceptor:
            out = self._native(attn, *args, **kwargs)
        if interceptor.calls != 1:
            raise RuntimeError(f"expected the {type(self.original).__name__} processor to make exactly one "
                               f"scaled_dot_product_attention call, saw {interceptor.calls}")
        return out

    def _layout(self, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor | None) -> TokenLayout:
        video = hidden_states.shape[1]
        text = 0 if encoder_hidden_states is None else encoder_hidden_states.shape[1]
        start = text if self.adapter.text_first else 0
        return TokenLayout(start, video, video + text)

    def _token_order(self, plan: LayerPlan, layout: TokenLayout, device: torch.device) -> TokenOrder | None:
        """How this layer reorders its video tokens: from the forward's order to the plan's (None: already so)."""
        context, wanted = self.context, plan_tile(plan.tile)
        if context.grid is None or wanted == context.tile:
            return None
        grid = context.grid
        if grid[0] * grid[1] * grid[2] != layout.video_len:
            raise ValueError(f"the latent grid {grid} has {grid[0] * grid[1] * grid[2]} tokens but the attention "
                             f"sees {layout.video_len} video tokens")
        key = ("token_order", wanted)
        if key not in context.forward_cache:
            target = None if wanted is None else tile_order(grid, wanted, device)
            context.forward_cache[key] = relative_order(context.order, target)
        return context.forward_cache[key]

    def _key_sets(self, attn_mask, layout: TokenLayout, batch: int):
        if attn_mask is None or layout.text_len == 0:
            return None
        cached = self.context.forward_cache.get("key_sets")
        if cached is None or cached[0] is not attn_mask:
            cached = (attn_mask, text_key_sets(attn_mask, layout, batch))
            self.context.forward_cache["key_sets"] = cached
        return cached[1]

    def _mask_source(self, record: AttentionRecord | None):
        """The ``predict`` callable of this call: the layer's mask reuse state (``schedules.reuse``) decides
        whether the mask is predicted, reused or refreshed; stats record which (``mask_source``)."""
        context = self.context

        def video_mask(q, k, plan, scale):
            mask, source = self._masks.mask(q, k, plan, scale, step=context.step, branch=context.branch,
                                            generation=context.generation)
            if record is not None:
                record.extra["mask_source"] = source
            return mask
        return video_mask

    def _tile_mass_sink(self, query: torch.Tensor, plan: LayerPlan):
        """Where this call's exact tile masses go when the next step's refresh wants them, else None."""
        where = {"step": self.context.step, "branch": self.context.branch}
        if not self._masks.wants_tile_mass(query, plan, **where):
            return None
        return functools.partial(self._masks.record_tile_mass, **where)

    def _attend(self, query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                enable_gqa=False, *, plan: LayerPlan | None, layout: TokenLayout, record: AttentionRecord | None,
                heads: range | None):
        """Stands in for ``F.scaled_dot_product_attention`` (q, k, v [B, H, N, D]) inside the processor.

        heads: under Ulysses context parallelism, the global heads of q's H local heads; q, k, v then hold the
        whole sequence (N tokens) while ``layout`` counted this rank's share of it.
        """
        if heads is not None:
            if query.shape[1] != len(heads):
                raise RuntimeError(f"expected the {len(heads)} heads {heads.start}..{heads.stop - 1} on this rank, "
                                   f"got {query.shape[1]}")
            layout = TokenLayout(0, query.shape[2], query.shape[2])
            if record is not None:
                record.video_tokens = layout.video_len
                record.extra["heads"] = (heads.start, heads.stop)
        if record is not None:
            record.clock.mark("start")
        if plan is None:
            out = F.scaled_dot_product_attention(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p,
                                                 is_causal=is_causal, scale=scale, enable_gqa=enable_gqa)
        else:
            if dropout_p or is_causal:
                raise ValueError("sparse attention supports dropout_p=0 and is_causal=False only")
            if key.shape[1] != query.shape[1]:
                raise ValueError(f"sparse attention needs as many key heads as query heads, got {key.shape[1]} "
                                 f"and {query.shape[1]}")
            if attn_mask is not None and layout.text_len == 0:
                raise ValueError("sparse attention does not support an attention mask over video tokens")
            out, mask = joint_sparse_attention(
                query, key, value, layout, plan, self._mask_source(record), scale=scale,
                order=self._token_order(plan, layout, query.device), attn_mask=attn_mask,
                key_sets=self._key_sets(attn_mask, layout, query.shape[0]),
                clock=None if record is None else record.clock, on_tile_mass=self._tile_mass_sink(query, plan))
            if record is not None:
                record.sparsity = mask.sparsity_per_head.mean()
        if record is not None:
            record.clock.mark("end")
        return out
