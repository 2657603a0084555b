"""``PredictSettings``: the settings of mask prediction as one frozen object, each default declared here once.

:func:`~sparsevid.ops.predict.predict_mask`, :func:`~sparsevid.ops.refine.select_from_mass` and
:func:`~sparsevid.ops.predict.prediction_options` take such an object and/or its fields as keyword arguments
(which replace the object's); ``sparsevid.plan``'s ``SparseConfig`` and ``LayerPlan`` take their defaults from
it. The warnings for settings that keep every tile (0% sparsity) are given here, once per cause.
"""
from __future__ import annotations

import dataclasses
import inspect
import numbers
import os
import sys
import warnings
from dataclasses import dataclass
from typing import Any

import torch

from .mask import DEFAULT_BLOCK_K, DEFAULT_BLOCK_Q, check_block_size
from .selection import RULES, check_similarity_threshold, check_topk, check_topp, uses_topk, uses_topp
from .validation import check_backend, check_choice, check_scale

BACKENDS = ("auto", "triton", "reference")


@dataclass(frozen=True)
class PredictSettings:
    """How a mask is predicted from pooled scores: ``rule``, its budgets ``topk`` / ``topp``, the tiles
    ``block_q`` x ``block_k``, the pooled-score ``scale`` (None: D ** -0.5), the option tiles (``keep_sink``,
    ``keep_diagonal``, ``similarity_threshold``), ``min_blocks`` and the ``backend``;
    :func:`~sparsevid.ops.predict.predict_mask` says what each does.

    Scalar values are checked on construction (ValueError/TypeError naming the field); per-head tensors
    (``topk``, ``topp``, ``similarity_threshold`` as [H]) get their shape and value checks where the number of
    heads is known.
    """

    rule: str = "hybrid"
    topk: float | int | torch.Tensor = 0.05
    topp: float | torch.Tensor = 0.9
    block_q: int = DEFAULT_BLOCK_Q
    block_k: int = DEFAULT_BLOCK_K
    scale: float | None = None
    keep_sink: bool = False
    keep_diagonal: bool = False
    similarity_threshold: float | torch.Tensor | None = None
    min_blocks: int = 1
    backend: str = "auto"

    def __post_init__(self) -> None:
        check_choice("rule", self.rule, RULES)
        check_topk(self.topk)
        check_topp(self.topp)
        check_block_size("block_q", self.block_q)
        check_block_size("block_k", self.block_k)
        check_scale(self.scale)
        for name in ("keep_sink", "keep_diagonal"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be a bool, got {type(getattr(self, name)).__name__}")
        check_similarity_threshold(self.similarity_threshold)
        min_blocks = self.min_blocks
        if not isinstance(min_blocks, numbers.Integral) or isinstance(min_blocks, bool) or min_blocks < 0:
            raise ValueError(f"min_blocks must be an int >= 0, got {min_blocks!r}")
        check_backend(self.backend, BACKENDS)

    @property
    def uses_topk(self) -> bool:
        """Whether the rule has a top-k part ("topk", "hybrid")."""
        return uses_topk(self.rule)

    @property
    def uses_topp(self) -> bool:
        """Whether the rule has a top-p part ("topp", "hybrid")."""
        return uses_topp(self.rule)

    def replace(self, **changes) -> PredictSettings:
        """A copy with ``changes`` (field names) applied and checked; self when there are none."""
        return merge_settings(self, changes, "PredictSettings.replace")


FIELDS = tuple(f.name for f in dataclasses.fields(PredictSettings))
DEFAULTS = PredictSettings()


def merge_settings(settings: PredictSettings | None, options: dict[str, Any], caller: str) -> PredictSettings:
    """``settings`` (None: the defaults) with the keyword ``options`` replacing its fields. A name that is no
    field raises TypeError, as an unknown keyword argument of ``caller`` would."""
    if settings is None:
        settings = DEFAULTS
    elif not isinstance(settings, PredictSettings):
        raise TypeError(f"{caller}: settings must be a sparsevid.ops.PredictSettings or None, "
                        f"got {type(settings).__name__}")
    if not options:
        return settings
    unknown = sorted(set(options) - set(FIELDS))
    if unknown:
        raise TypeError(f"{caller}() got unexpected keyword argument(s) {unknown}; the settings are {FIELDS}")
    return dataclasses.replace(settings, **options)


def with_settings_signature(func):
    """Decorator: ``func``'s signature (as ``help()`` and editors show it) lists the fields of
    :class:`PredictSettings`, with their defaults, as keyword arguments in place of its ``**options``."""
    signature = inspect.signature(func)
    params = [p for p in signature.parameters.values() if p.kind is not inspect.Parameter.VAR_KEYWORD]
    params += [inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=f.default, annotation=f.type)
               for f in dataclasses.fields(PredictSettings)]
    func.__signature__ = signature.replace(parameters=params)
    return func


# --------------------------------------------------------------------------- settings that keep every tile

# Causes already warned about (each warning is given once per process, not once per layer and step).
_warned: set[tuple] = set()
_OUTSIDE = (os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep,
            os.path.dirname(os.path.abspath(torch.__file__)) + os.sep)


def forget_warnings() -> None:
    """Let every "keeps every tile" warning be given again (each is given once per cause otherwise)."""
    _warned.clear()


def _stacklevel() -> int:
    """The ``warnings.warn`` stacklevel, seen from the caller of this function, of the first frame outside
    sparsevid and torch: the code whose settings caused the warning."""
    frame, level = sys._getframe(1), 1
    while frame is not None and frame.f_code.co_filename.startswith(_OUTSIDE):
        frame, level = frame.f_back, level + 1
    return level


def warn_once(cause: tuple, message: str) -> None:
    """``warnings.warn(message)`` (UserWarning) unless ``cause`` was warned about before."""
    if cause in _warned:
        return
    _warned.add(cause)
    warnings.warn(message, UserWarning, stacklevel=_stacklevel())


def warn_if_every_tile_kept(settings: PredictSettings, kv_len: int, num_kv_blocks: int,
                            rule_topk: int | torch.Tensor | None) -> None:
    """Warn, once per cause, when ``settings`` make every row keep every key block of a ``kv_len``-token
    sequence whatever the scores: the sequence fits in one key block, the top-k count (``rule_topk``, resolved)
    reaches the number of key blocks, or ``min_blocks`` does.

    An explicit ``topk=1.0`` or ``topp=1.0`` asks for every tile and is not warned about; per-head tensor
    budgets are not checked (that would read the device).
    """
    kb, block_k = num_kv_blocks, settings.block_k
    topk = settings.topk
    every = "every row keeps every key block, so the mask keeps every tile (0% sparsity)"
    if kb == 1:
        warn_once(("one key block", kv_len, block_k),
                  f"kv_len={kv_len} tokens fit in one key block (block_k={block_k}): {every}. Sparse attention "
                  f"needs sequences longer than one key block (a longer clip, or run this attention dense).")
    elif settings.uses_topk and isinstance(rule_topk, int) and rule_topk >= kb and not (
            isinstance(topk, float) and topk == 1.0):
        if isinstance(topk, numbers.Integral):
            reason = f"topk={topk} (a count of key blocks) is at least the {kb} key blocks"
            advice = f"a count below {kb} or a fraction in (0, 1)"
        else:
            reason = f"topk={topk} of the {kb} key blocks rounds up to all of them"
            advice = f"a fraction of at most {(kb - 1) / kb:.4g}"
        warn_once(("topk", topk, kb),
                  f"{reason} of kv_len={kv_len} tokens (block_k={block_k}): {every}. Use {advice}.")
    elif settings.min_blocks >= kb:
        warn_once(("min_blocks", settings.min_blocks, kb),
                  f"min_blocks={settings.min_blocks} is at least the {kb} key blocks of kv_len={kv_len} tokens "
                  f"(block_k={block_k}): {every}. Use min_blocks below {kb}.")
