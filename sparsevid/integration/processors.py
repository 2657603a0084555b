"""The sparse attention processor: diffusers' own processor, with its attention call made sparse.

:class:`SparseAttnProcessor` wraps the model's original processor. Dense decisions call the original
unchanged. Sparse decisions run a copy of it (pinned to diffusers' native attention backend) while a
torch-function mode routes its one ``scaled_dot_product_attention`` call to :meth:`SparseAttnProcessor._attend`,
which runs in a straight line: the layer's runtime (``sparsevid.schedules.runtime``) gives the mask, the
joint core (:func:`~sparsevid.integration.joint_attention.joint_sparse_attention`) attends under it, the runtime
records what the next step's mask needs. Projections, norms, RoPE and output layers therefore stay diffusers'
code, whatever the model or diffusers version. (Mochi's processor attends each batch entry in its own call: a
sparse layer hands it the batch packed into one entry, ``packed_batch``.)
"""
from __future__ import annotations

import copy
import functools
import inspect

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from ..plan.runtime import LayerRuntime
from .adapters import ModelAdapter, attention_heads
from .context_parallel import check_parallel_config, local_heads
from .joint_attention import TokenLayout, TokenOrder, joint_sparse_attention, text_key_sets, video_tokens
from .packed_batch import PackedBatch
from .stats import AttentionRecord, Clock, mark, mark_first
from .step_context import StepContext
from .token_order import plan_tile, relative_order, tile_order, with_leading_tokens


class SDPAInterceptor(TorchFunctionMode):
    """Inside ``with``, calls of ``F.scaled_dot_product_attention`` go to ``handler`` (same signature).

    Tensor methods that torch implements in Python (``Tensor.unflatten``, ...) are called as methods of the
    tensor rather than as the function the mode receives: their Python body calls ``super()``, which
    torch.compile cannot trace inside a mode.
    """

    def __init__(self, handler):
        super().__init__()
        self.handler = handler
        self.calls = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            self.calls += 1
            return self.handler(*args, **kwargs)
        if getattr(func, "__module__", None) == "torch._tensor":
            # A Tensor method written in Python: call it on the tensor (inside __torch_function__ the mode is off).
            return getattr(args[0], func.__name__)(*args[1:], **kwargs)
        return func(*args, **kwargs)


def _skip_as_compiled_frame(function) -> None:
    """Let torch.compile run ``function`` eagerly when it is called from eager code, while still inlining it into
    the graphs it traces. Dynamo otherwise compiles the mode's ``__torch_function__`` as a frame of its own for
    every op of an eager stretch between graph breaks (Mochi's processor, a data-dependent ``nonzero``), one
    recompilation per call signature until its recompile limit."""
    import torch._dynamo.eval_frame

    skip_code = getattr(torch._dynamo.eval_frame, "skip_code", None)  # private: kept optional across torch versions
    if skip_code is not None:
        skip_code(function.__code__)


_skip_as_compiled_frame(SDPAInterceptor.__torch_function__)


def _same(a, b) -> bool:
    """Whether ``a`` and ``b`` are the same objects, element by element for tuples and lists (a rotary embedding
    (cos, sin) is rebuilt as a tuple per call but holds the same tensors; torch.compile traces ``is`` only on
    tensors and constants)."""
    if isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a is b


def _native_copy(processor):
    """A shallow copy of ``processor`` whose diffusers attention dispatch uses the native (SDPA) backend."""
    pinned = copy.copy(processor)
    if hasattr(pinned, "_attention_backend"):
        from diffusers.models.attention_dispatch import AttentionBackendName

        pinned._attention_backend = AttentionBackendName.NATIVE
    return pinned


def _rotary_parameters(processor) -> tuple[str, tuple[str, ...]]:
    """(name of ``processor``'s rotary-embedding parameter, names of its positional parameters after it).

    Wan and Kandinsky 5 name it ``rotary_emb``, LTX-2 ``query_rotary_emb`` (then ``key_rotary_emb``), most others
    ``image_rotary_emb``."""
    parameters = inspect.signature(processor.__call__).parameters
    positional = [name for name, p in parameters.items()
                  if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    name = next((n for n in ("rotary_emb", "query_rotary_emb", "image_rotary_emb") if n in positional), None)
    if name is None:
        return "image_rotary_emb", ()
    return name, tuple(positional[positional.index(name) + 1:])


class SparseAttnProcessor:
    """Replaces the processor of one video self-attention module (see module docstring).

    Its ``__call__`` declares the arguments of diffusers' video attention processors (diffusers passes a
    processor only the keyword arguments its signature names, also under ``torch.compile``) and hands them to
    the original by name: the fifth positional argument is the rotary embedding (see :func:`_rotary_parameters`),
    later positional ones (LTX-2's key rotary embedding) take the original's next parameters; an attention mask
    goes only to processors that take one.

    A processor that attends each batch entry in its own call (Mochi: ``ModelAdapter.batch_loop``) gets the batch
    packed into one entry when the layer is sparse (``packed_batch``), so that it makes one call; dense, it runs as
    it is (under stats, its calls per entry are timed as one span).

    Under diffusers' Ulysses context parallelism (``enable_parallelism``, before or after applying) the
    sparse core runs between diffusers' all-to-alls on the whole sequence of this rank's heads
    (``context_parallel``). ``set_attention_backend`` reaches the original (the dense path) through
    ``_attention_backend``; the sparse path always runs diffusers' native backend.

    Args:
        original: the processor it replaces (kept unmodified but for the ``_parallel_config`` and
            ``_attention_backend`` that diffusers sets through this processor; ``remove_sparse_attention`` puts
            it back).
        runtime: the layer's mask decision (plan and mask reuse).
        context: the transformer's shared StepContext.
        adapter: model-family facts (where text tokens sit).
    """

    def __init__(self, original, runtime: LayerRuntime, context: StepContext, adapter: ModelAdapter):
        self.original = original
        self.runtime = runtime
        self.context = context
        self.adapter = adapter
        self._native = _native_copy(original)
        self._rotary_name, self._after_rotary = _rotary_parameters(original)

    @property
    def layer(self) -> int:
        return self.runtime.layer

    @property
    def _parallel_config(self):
        """diffusers' context-parallel config of the original (AttributeError where it has none, so that
        ``enable_parallelism`` treats this processor as it would the original)."""
        return self.original._parallel_config

    @_parallel_config.setter
    def _parallel_config(self, config) -> None:
        check_parallel_config(config, self.adapter)  # enable_parallelism on a sparse model: refused families, ring
        self.original._parallel_config = config
        self._native._parallel_config = config

    @property
    def _attention_backend(self):
        """The original's diffusers attention backend (AttributeError where it has none, so that
        ``set_attention_backend`` treats this processor as it would the original); dense calls use it."""
        return self.original._attention_backend

    @_attention_backend.setter
    def _attention_backend(self, backend) -> None:
        self.original._attention_backend = backend

    def __call__(self, attn, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor | None = None,
                 attention_mask: torch.Tensor | None = None, image_rotary_emb=None, *extra, **kwargs) -> torch.Tensor:
        if len(extra) > len(self._after_rotary):
            raise TypeError(f"{type(self.original).__name__} takes {len(self._after_rotary)} positional arguments "
                            f"after the rotary embedding, got {len(extra)}")
        args = (attn, hidden_states)
        kwargs = {"encoder_hidden_states": encoder_hidden_states, **dict(zip(self._after_rotary, extra)), **kwargs}
        if attention_mask is not None:
            kwargs["attention_mask"] = attention_mask
        if image_rotary_emb is not None:
            kwargs[self._rotary_name] = image_rotary_emb
        context = self.context
        plan = None if context.dense else self.runtime.plan
        parallel = getattr(self.original, "_parallel_config", None)
        check_parallel_config(parallel, self.adapter, attention_heads(attn))
        if plan is None and not context.collect_stats and context.measure is None:
            return self.original(*args, **kwargs)
        layout = self._layout(hidden_states, encoder_hidden_states)
        heads = None
        if parallel is not None:
            heads = local_heads(parallel, attention_heads(attn))
        record = None
        if context.collect_stats:
            forward = context.forward_record
            record = AttentionRecord(self.layer, None if forward is None else forward.step, plan is None,
                                     layout.video_len, layout.text_len, Clock(hidden_states.device))
            context.records.append(record)
        handler = functools.partial(self._attend, layout=layout, record=record, heads=heads)
        calls, packed = 1, None
        if self.adapter.batch_loop and plan is None and context.measure is None:  # dense: its own call per entry
            calls = hidden_states.shape[0]
        elif self.adapter.batch_loop:
            packed, args, kwargs = self._pack(args, kwargs, layout)
            handler = functools.partial(packed.attend, handler)
        interceptor = SDPAInterceptor(handler)
        with interceptor:
            out = self._native(*args, **kwargs)
        if interceptor.calls != calls:
            raise RuntimeError(f"expected the {type(self.original).__name__} processor to make {calls} "
                               f"scaled_dot_product_attention call(s), saw {interceptor.calls}")
        return out if packed is None else packed.outputs(*out)

    def _layout(self, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor | None) -> TokenLayout:
        video = hidden_states.shape[1]
        text = 0 if encoder_hidden_states is None else encoder_hidden_states.shape[1]
        start = text if self.adapter.text_first else 0
        return TokenLayout(start, video, video + text)

    def _token_order(self, tile, layout: TokenLayout, device: torch.device) -> TokenOrder | None:
        """How this layer reorders its video tokens: from the forward's order to the plan's ``tile`` (None:
        already so). Computed once per forward and tile, shared by the layers. Latent tokens before the grid's
        (FramePack's history) keep their place."""
        context, wanted = self.context, plan_tile(tile)
        if context.grid is None or wanted == context.tile:
            return None
        grid = context.grid
        leading = layout.video_len - grid[0] * grid[1] * grid[2]
        if leading < 0:
            raise ValueError(f"the latent grid {grid} has {grid[0] * grid[1] * grid[2]} tokens but the attention "
                             f"sees {layout.video_len} video tokens")
        orders = context.values.token_orders
        if (wanted, leading) not in orders:
            order = relative_order(context.order, None if wanted is None else tile_order(grid, wanted, device))
            orders[wanted, leading] = with_leading_tokens(order, leading)
        return orders[wanted, leading]

    def _pack(self, args: tuple, kwargs: dict, layout: TokenLayout) -> tuple[PackedBatch, tuple, dict]:
        """(packing, args, kwargs) of the call with its batch packed into one entry (``packed_batch``); the packing
        (text rows, repeated RoPE tables) is made once per forward, text mask and RoPE."""
        attn, hidden_states = args
        text_mask, rotary = kwargs.get("attention_mask"), kwargs.get(self._rotary_name)
        values = self.context.values
        if values.packed is None or not _same(values.packed[0], text_mask) or not _same(values.packed[1], rotary):
            values.packed = (text_mask, rotary, PackedBatch.of(text_mask, layout.video_len, rotary))
        packed = values.packed[2]
        hidden, text, mask = packed.inputs(hidden_states, kwargs["encoder_hidden_states"])
        kwargs = {**kwargs, "encoder_hidden_states": text, "attention_mask": mask}
        if rotary is not None:
            kwargs[self._rotary_name] = packed.rotary
        return packed, (attn, hidden), kwargs

    def _key_sets(self, attn_mask, layout: TokenLayout, batch: int):
        """The valid text keys per batch entry (read once per forward and attention mask)."""
        if attn_mask is None or layout.text_len == 0:
            return None
        values = self.context.values
        if values.key_sets is None or values.key_sets[0] is not attn_mask:
            values.key_sets = (attn_mask, text_key_sets(attn_mask, layout, batch))
        return values.key_sets[1]

    def _measure(self, query, key, value, attn_mask, scale, layout: TokenLayout) -> None:
        """Hand this dense call's video attention to the calibration measuring it (``context.measure``): the video
        q, k, v [B, H, Nv, D] in the measurement's token order and, in a joint attention, the text keys and values
        the video rows attend too, with the valid ones per batch entry, and the forward's timestep (flow convention;
        read from the device only for a measurement ``by_timestep``, else None)."""
        measure = self.context.measure
        q_v, k_v, v_v = video_tokens(query, key, value, layout, self._token_order(measure.tile, layout, query.device))
        text = None
        if layout.text_len:
            text = (key[:, :, layout.text], value[:, :, layout.text], self._key_sets(attn_mask, layout, query.shape[0]))
        measure(self.layer, q_v, k_v, v_v, scale, text, self.context.timestep if measure.by_timestep else None)

    def _attend(self, query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                enable_gqa=False, *, layout: TokenLayout, record: AttentionRecord | None, heads: range | None):
        """Stands in for ``F.scaled_dot_product_attention`` (q, k, v [B, H, N, D]) inside the processor.

        heads: under Ulysses context parallelism, the global heads of q's H local heads; q, k, v then hold the
        whole sequence (N tokens) while ``layout`` counted this rank's share of it.
        """
        runtime = self.runtime
        plan = None if self.context.dense else runtime.plan
        if heads is not None:
            if query.shape[1] != len(heads):
                raise RuntimeError(f"expected the {len(heads)} heads {heads.start}..{heads.stop - 1} on this rank, "
                                   f"got {query.shape[1]}")
            layout = TokenLayout(0, query.shape[2], query.shape[2])
            if record is not None:
                record.video_tokens = layout.video_len
                record.extra["heads"] = (heads.start, heads.stop)
        clock = None if record is None else record.clock
        mark_first(clock, "start")
        if plan is None:
            if self.context.measure is not None:
                self._measure(query, key, value, attn_mask, scale, layout)
            out = F.scaled_dot_product_attention(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p,
                                                 is_causal=is_causal, scale=scale, enable_gqa=enable_gqa)
            mark(clock, "end")
            return out
        if dropout_p or is_causal:
            raise ValueError("sparse attention supports dropout_p=0 and is_causal=False only")
        if key.shape[1] != query.shape[1]:
            raise ValueError(f"sparse attention needs as many key heads as query heads, got {key.shape[1]} "
                             f"and {query.shape[1]}")
        if attn_mask is not None and layout.text_len == 0:
            raise ValueError("sparse attention does not support an attention mask over video tokens")
        if plan.precision != "native" and plan.backend == "auto" and not query.is_cuda:
            raise ValueError(f"precision={plan.precision!r} with backend='auto' needs a CUDA GPU with FP8 tensor "
                             f"cores; the attention runs on {query.device}: use backend='reference' for the (slow) PyTorch "
                             f"emulation, or precision='native'")
        order = self._token_order(plan.tile, layout, query.device)
        video = video_tokens(query, key, value, layout, order)
        mark(clock, "reordered")
        wants_tile_mass = runtime.wants_tile_mass(query)
        mask = runtime.mask(video[0], video[1], scale, heads)
        mark(clock, "predicted")
        out, tile_mass = joint_sparse_attention(
            query, key, value, layout, mask, order, video=video, scale=scale, backend=plan.backend,
            precision=plan.precision,
            attn_mask=attn_mask, key_sets=self._key_sets(attn_mask, layout, query.shape[0]),
            tile_mass=wants_tile_mass, clock=clock)
        runtime.record(tile_mass)
        if record is not None:
            record.extra["mask_source"] = runtime.source
            record.sparsity = mask.sparsity_per_head.mean()
        mark(clock, "end")
        return out
