"""``SparseConfig``: which attention rule applies at which layer and denoising step.

The configuration is plain data (JSON-serialisable). The one decision the integration asks of it is
:meth:`SparseConfig.plan`: given a layer index, a denoising step (and the step's timestep), either ``None``
(run that attention dense, exactly as the unmodified model) or a :class:`LayerPlan` with the mask-prediction
settings of that step: with a growing-sparsity ``schedule`` the rule's budget (``topk``, ``topp``) moves
from its starting value toward ``final_topk`` / ``final_topp`` as the denoising progresses.
"""
from __future__ import annotations

import dataclasses
import functools
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from ..ops.attention import BACKENDS, FP8_BACKENDS, PRECISIONS
from ..ops.mask import SUPPORTED_BLOCK_SIZES as BLOCK_SIZES
from ..ops.refine import SELECT_FIELDS
from ..ops.selection import RULES
from ..ops.settings import DEFAULTS as PREDICT_DEFAULTS
from ..ops.settings import PredictSettings

SCHEDULES = ("constant", "linear", "cosine", "snr")
REFRESH_SEARCHES = ("full", "within", "exact")
# The mask predictor's backend for each attention backend (the predictor has a triton and a reference path).
PREDICT_BACKENDS = {"auto": "auto", "triton": "triton", "flex": "auto", "gather": "reference", "reference": "reference",
                    "flash_attn4": "auto"}


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _check_topk(name: str, topk) -> None:
    if not _is_number(topk):
        raise TypeError(f"{name} must be a float fraction in (0, 1] or an int count >= 1, got {topk!r}")
    if _is_int(topk) and topk < 1 or isinstance(topk, float) and not 0.0 < topk <= 1.0:
        raise ValueError(f"{name} must be a fraction in (0, 1] or an int count >= 1, got {topk!r}")


def _check_topp(name: str, topp) -> None:
    if not _is_number(topp):
        raise TypeError(f"{name} must be a number in (0, 1], got {topp!r}")
    if not 0.0 < topp <= 1.0:
        raise ValueError(f"{name} must be in (0, 1], got {topp!r}")


def _per_head(check):
    """``check`` extended to a per-head list (or tuple) of values, one per attention head; a per-head top-k holds
    fractions only or counts only."""
    def check_values(name: str, value) -> None:
        if not isinstance(value, (list, tuple)):
            check(name, value)
            return
        if not value:
            raise ValueError(f"{name} per head must be a non-empty list, got {value!r}")
        for head, item in enumerate(value):
            check(f"{name}[{head}]", item)
        if len({_is_int(item) for item in value}) > 1:
            raise ValueError(f"{name} per head must be all fractions or all counts, got {list(value)!r}")
    return check_values


def is_per_head(value) -> bool:
    """Whether a budget (topk, topp) is a per-head tuple."""
    return isinstance(value, tuple)


def _check_optional(check):
    def check_unless_none(name: str, value) -> None:
        if value is not None:
            check(name, value)
    return check_unless_none


def _check_choice(choices: tuple):
    def check(name: str, value) -> None:
        if value not in choices or isinstance(value, bool):
            raise ValueError(f"{name} must be one of {choices}, got {value!r}")
    return check


def _check_backend(name: str, value) -> None:
    if value not in BACKENDS:
        hint = ": the plain-PyTorch backend is called 'reference'" if value == "torch" else ""
        raise ValueError(f"{name} must be one of {BACKENDS}, got {value!r}{hint}")


def _check_block(name: str, value) -> None:
    if not _is_int(value) or value not in BLOCK_SIZES:
        raise ValueError(f"{name} must be one of {BLOCK_SIZES}, got {value!r}")


def _check_bool(name: str, value) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {value!r}")


def _check_int_at_least(low: int):
    def check(name: str, value) -> None:
        if not _is_int(value) or value < low:
            raise ValueError(f"{name} must be an int >= {low}, got {value!r}")
    return check


def _check_similarity(name: str, sim) -> None:
    if sim is not None and (not _is_number(sim) or not -1.0 <= sim <= 1.0):
        raise ValueError(f"{name} must be None or a number in [-1, 1], got {sim!r}")


def _check_tile(name: str, tile) -> None:
    ok = tile in ("auto", "none") or (
        isinstance(tile, tuple) and len(tile) == 3 and all(_is_int(t) and t >= 1 for t in tile))
    if not ok:
        raise ValueError(f"{name} must be 'auto', 'none' or a (t, h, w) tuple of ints >= 1, got {tile!r}")


@dataclass(frozen=True)
class MaskSetting:
    """One setting of how a sparse layer makes its mask: declared once, it becomes a field of
    :class:`SparseConfig` (with this default), a field of :class:`LayerPlan`, a key ``layer_overrides`` accepts
    and, where ``uses`` says so, a field of the plan's :class:`~sparsevid.ops.PredictSettings` read by
    ``predict_mask`` ("predict") and by ``select_from_mass`` ("select"). The defaults of those are
    ``PredictSettings``'s.

    check: ``check(name, value)`` raises ValueError/TypeError naming ``name`` when ``value`` is not valid.
    """

    name: str
    type: str
    default: Any
    check: Callable[[str, Any], None]
    uses: frozenset[str] = frozenset()


def _predictor_setting(name: str, type_: str, check: Callable[[str, Any], None]) -> MaskSetting:
    """A setting the plan hands to the predictor: its default is ``PredictSettings``'s (declared there once)."""
    uses = frozenset({"predict", "select"} if name in SELECT_FIELDS else {"predict"})
    return MaskSetting(name, type_, getattr(PREDICT_DEFAULTS, name), check, uses)


MASK_SETTINGS = (
    _predictor_setting("rule", "str", _check_choice(RULES)),
    _predictor_setting("topk", "float | int | tuple", _per_head(_check_topk)),
    _predictor_setting("topp", "float | tuple", _per_head(_check_topp)),
    _predictor_setting("block_q", "int", _check_block),
    _predictor_setting("block_k", "int", _check_block),
    MaskSetting("backend", "str", "auto", _check_backend),
    MaskSetting("precision", "str", "native", _check_choice(PRECISIONS)),
    _predictor_setting("keep_sink", "bool", _check_bool),
    _predictor_setting("keep_diagonal", "bool", _check_bool),
    _predictor_setting("similarity_threshold", "float | None", _check_similarity),
    _predictor_setting("min_blocks", "int", _check_int_at_least(0)),
    MaskSetting("tile", "str | tuple[int, int, int]", "auto", _check_tile),
    MaskSetting("refresh_interval", "int", 1, _check_int_at_least(1)),
    MaskSetting("refresh_search", "str", "full", _check_choice(REFRESH_SEARCHES)),
)
# Fields of SparseConfig that a LayerPlan carries; a per-layer override may change them, the schedule's
# final budgets (SCHEDULE_FIELDS) and "dense": True.
PLAN_FIELDS = tuple(setting.name for setting in MASK_SETTINGS)
SCHEDULE_FIELDS = ("final_topk", "final_topp")
_SCHEDULE_CHECKS = {"final_topk": _check_optional(_check_topk), "final_topp": _check_optional(_check_topp)}
_CHECKS = {**{setting.name: setting.check for setting in MASK_SETTINGS}, **_SCHEDULE_CHECKS}


def _check_plan_fields(values: dict[str, Any], where: str) -> None:
    """Raise ValueError/TypeError naming the first bad field of ``values`` (a subset of PLAN_FIELDS and
    SCHEDULE_FIELDS; other keys are the caller's to check)."""
    for key, value in values.items():
        if key in _CHECKS:
            _CHECKS[key](f"{where}{key}", value)


_PREDICTED = tuple(setting.name for setting in MASK_SETTINGS if "predict" in setting.uses)


@functools.lru_cache(maxsize=256, typed=True)
def _predict_settings(*values) -> PredictSettings:
    """The PredictSettings of a plan's ``_PREDICTED`` values and predictor backend (cached: plans are made per
    layer and step, and most repeat). Where either budget is per head, both become CPU tensors [H] (a scalar one
    repeated): top-k fractions float64 (rounded up to counts as a scalar fraction is), counts int64, top-p float32
    (the predictor's own precision)."""
    settings = dict(zip(_PREDICTED + ("backend",), values))
    per_head = [settings[name] for name in ("topk", "topp") if is_per_head(settings[name])]
    if per_head:
        for name in ("topk", "topp"):
            value = settings[name]
            value = value if is_per_head(value) else (value,) * len(per_head[0])
            dtype = torch.float32 if name == "topp" else torch.int64 if _is_int(value[0]) else torch.float64
            settings[name] = torch.tensor(value, dtype=dtype)
    return PredictSettings(**settings)


def _with_mask_settings(cls):
    """Class decorator (below ``@dataclass``): the MASK_SETTINGS become ``cls``'s first fields."""
    own = dict(cls.__dict__.get("__annotations__", {}))
    cls.__annotations__ = {**{setting.name: setting.type for setting in MASK_SETTINGS}, **own}
    for setting in MASK_SETTINGS:
        if setting.name not in own:
            setattr(cls, setting.name, setting.default)
    return cls


@dataclass(frozen=True)
@_with_mask_settings
class LayerPlan:
    """How one sparse attention call is made: the MASK_SETTINGS of one layer at one step.

    ``tile``: "auto" (the default 3D tile of ``tile_permutation``), "none" (raster token order) or (t, h, w).
    ``topk`` / ``topp`` are the budget of this step (the schedule already applied). ``refresh_interval``: a
    mask is kept for this many steps; ``refresh_search``: how a due refresh searches ("full": all tiles,
    "within": only the previous mask's tiles, "exact": the previous mask's tiles by the exact tile masses of
    the step before, see ``sparsevid.plan.reuse``). ``predict_settings``: the
    :class:`~sparsevid.ops.PredictSettings` of this plan (its "predict" settings and the predictor backend
    that goes with the attention backend; scale None), for ``predict_mask`` and ``select_from_mass``.
    """

    predict_settings: PredictSettings = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        settings = _predict_settings(*(getattr(self, name) for name in _PREDICTED), PREDICT_BACKENDS[self.backend])
        object.__setattr__(self, "predict_settings", settings)

    @property
    def predict_backend(self) -> str:
        """The ``predict_mask`` backend that goes with this plan's attention backend."""
        return self.predict_settings.backend

    def predict_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for ``sparsevid.predict_mask`` (everything but q, k, scale and backend); the same
        settings as ``predict_settings``."""
        return self._arguments("predict")

    def select_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for ``sparsevid.ops.select_from_mass`` (everything but the masses and the mask)."""
        return self._arguments("select")

    @property
    def reuses_masks(self) -> bool:
        """Whether masks are kept across steps (reused or refreshed from the previous one)."""
        return self.refresh_interval > 1 or self.refresh_search != "full"

    def _arguments(self, use: str) -> dict[str, Any]:
        """The settings ``use`` takes, as ``predict_settings`` holds them (per-head budgets as tensors [H])."""
        return {setting.name: getattr(self.predict_settings, setting.name) for setting in MASK_SETTINGS
                if use in setting.uses}


def _as_value(name: str, value):
    """A plan field's value as plans hold it: lists (from JSON) as tuples (a tile, per-head budgets)."""
    return tuple(value) if name in ("tile", "topk", "topp") and isinstance(value, list) else value


def _check_final(values: dict[str, Any], where: str) -> None:
    """The budgets of merged plan values: per-head ones of one length and constant; final budgets of the start's
    kind and no larger than the start."""
    final_topk, topk = values.get("final_topk"), values["topk"]
    topp = values["topp"]
    if is_per_head(topk) and is_per_head(topp) and len(topk) != len(topp):
        raise ValueError(f"{where}topk and topp per head must have one value per head each, got {len(topk)} and "
                         f"{len(topp)} values")
    if (is_per_head(topk) or is_per_head(topp)) and (final_topk, values.get("final_topp")) != (None, None):
        raise ValueError(f"{where}topk / topp per head need a constant budget: final_topk and final_topp must be None")
    if final_topk is not None:
        if _is_int(final_topk) != _is_int(topk):
            raise ValueError(f"{where}final_topk must be of the same kind as topk (both fractions or both counts), "
                             f"got final_topk={final_topk!r} and topk={topk!r}")
        if final_topk > topk:
            raise ValueError(f"{where}final_topk must not exceed topk={topk!r} (sparsity grows), got {final_topk!r}")
    final_topp = values.get("final_topp")
    if final_topp is not None and final_topp > values["topp"]:
        raise ValueError(f"{where}final_topp must not exceed topp={values['topp']!r} (sparsity grows), "
                         f"got {final_topp!r}")


def _check_precision(values: dict[str, Any], where: str) -> None:
    """A quantized precision ("fp8", "int8": forwards without backward) with what it cannot run with: another
    backend than FP8_BACKENDS, or refresh_search="exact" (its exact tile masses come from the native kernels)."""
    precision = values["precision"]
    if precision == "native":
        return
    if values["backend"] not in FP8_BACKENDS:
        raise ValueError(f"{where}precision={precision!r} runs on the backends {FP8_BACKENDS}, got backend="
                         f"{values['backend']!r}")
    if values["refresh_search"] == "exact":
        raise ValueError(f"{where}precision={precision!r} cannot refresh masks by exact tile masses "
                         "(refresh_search='exact' needs precision='native'); use refresh_search 'full' or 'within'")


def _overrides_dict(overrides: dict[int, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """JSON form of layer overrides: layer keys strings, tuples lists."""
    return {str(layer): {k: list(v) if isinstance(v, tuple) else v for k, v in values.items()}
            for layer, values in overrides.items()}


def _interpolate(start, final, progress: float):
    """start + (final - start) * progress; counts (ints) are rounded to the nearest count."""
    if final is None:
        return start
    value = start + (final - start) * progress
    return int(round(value)) if _is_int(start) else float(value)


@dataclass
@_with_mask_settings
class SparseConfig:
    """Sparse-attention settings for a video DiT (see ``apply_sparse_attention``).

    Args:
        rule, topk, topp: mask-prediction rule ("topk" | "topp" | "hybrid"); topk a fraction of key blocks
            per query block (float in (0, 1]) or a count (int); topp a cumulative pooled-attention mass. Either
            may be a list with one value per head (a constant budget; ``from_calibration`` makes such lists).
        block_q, block_k: tile sizes in tokens (64 or 128).
        backend: block-sparse attention backend ("auto" | "triton" | "flex" | "gather" | "reference" |
            "flash_attn4": flash-attn-4's kernels, where it is installed, on Hopper; gradients with 128-token key
            blocks).
        precision: "native" (the inputs' dtype), "fp8" (e4m3 products) or "int8" (int8 Q K^T, e4m3 P V; see
            ``block_sparse_attention``): the quantized ones are inference only (a forward that needs gradients
            raises), on the backends "auto" (CUDA with FP8 tensor cores; "auto" off CUDA raises), "triton" or
            "reference" (the PyTorch emulation), not with refresh_search="exact".
        keep_sink, keep_diagonal, similarity_threshold, min_blocks: passed to ``predict_mask``.
        dense_layers: layer indices (in the order ``apply_sparse_attention`` enumerates self-attentions)
            that stay dense.
        dense_steps: the first ``dense_steps`` denoising steps run every layer dense.
        layer_overrides: {layer: {field: value}} replacing any of the fields above for one layer (and
            ``final_topk`` / ``final_topp``, ``refresh_interval`` / ``refresh_search``);
            ``{"dense": True}`` keeps that layer dense.
        tile: token order for the sparse attention: "auto", "none" or a (t, h, w) tile in latent tokens.
        schedule: how the budget grows sparser over the steps after ``dense_steps``: "constant" (``topk``,
            ``topp`` throughout), "linear" or "cosine" in the step index (from the first sparse step to step
            ``num_steps - 1``), or "snr": in the noise level of the step, progress ``1 - sigma`` with
            ``sigma = timestep / num_train_timesteps`` (follows the sampler's own timesteps, shift included).
        final_topk, final_topp: the budget at the end of the schedule (None: that part stays constant);
            ``final_topk`` is of topk's kind (fraction or count) and not larger; ``final_topp <= topp``.
        num_steps: the number of denoising steps ("linear" and "cosine").
        num_train_timesteps: the timestep of pure noise ("snr"; 1000 for diffusers' flow-matching schedulers).
        refresh_interval: a layer's mask is predicted at one step and reused for the next
            ``refresh_interval - 1`` steps (1: a new mask every step).
        refresh_search: how a due refresh searches: "full" (predict over all tiles), "within" (only the tiles
            of the previous mask are candidates, ``predict_mask(within=...)``) or "exact" (choose among the
            previous mask's tiles by the exact tile masses its attention produced on the step before the
            refresh; Triton / gather / reference backends, inference only; otherwise as "within").
        calibrated_for: None, or {"family": adapter name, "heads": [heads of each self-attention layer]} of the
            model a calibration was made for; ``apply_sparse_attention`` refuses another model (``check_model``).
        noise_overrides: layer overrides by noise level (a calibration with noise ranges makes them): a list of
            ``{"noise_range": [low, high], "layer_overrides": {layer: {field: value}}}`` with non-overlapping ranges
            of sigma = timestep / ``num_train_timesteps`` (``[low, high)``; a range ending at 1 includes it). A step
            whose sigma lies in a range takes that range's override of a layer in place of ``layer_overrides``'
            (a layer the range does not name keeps its ``layer_overrides`` entry); a forward without a timestep, or
            one outside every range, uses ``layer_overrides``. A batch of several timesteps follows its largest.

    The mask settings (``rule`` ... ``refresh_search``, the first fields) are declared once, in
    ``MASK_SETTINGS``; the rest say where and when they apply.
    """

    dense_layers: tuple[int, ...] = ()
    dense_steps: int = 0
    layer_overrides: dict[int, dict[str, Any]] = field(default_factory=dict)
    schedule: str = "constant"
    final_topk: float | int | None = None
    final_topp: float | None = None
    num_steps: int | None = None
    num_train_timesteps: float = 1000.0
    calibrated_for: dict[str, Any] | None = None
    noise_overrides: list[dict[str, Any]] = field(default_factory=list)

    def __post_init__(self) -> None:
        for name in ("tile", "topk", "topp"):
            setattr(self, name, _as_value(name, getattr(self, name)))
        layers = self.dense_layers
        if not isinstance(layers, (tuple, list, set, frozenset)) or not all(_is_int(i) and i >= 0 for i in layers):
            raise ValueError(f"dense_layers must be a tuple of layer indices >= 0, got {layers!r}")
        if not isinstance(layers, tuple):
            self.dense_layers = tuple(sorted(layers))
        _check_plan_fields({k: getattr(self, k) for k in PLAN_FIELDS + SCHEDULE_FIELDS}, where="")
        self._check_schedule()
        _check_final({k: getattr(self, k) for k in ("topk", "topp") + SCHEDULE_FIELDS}, where="")
        _check_precision({k: getattr(self, k) for k in PLAN_FIELDS}, where="")
        if not _is_int(self.dense_steps) or self.dense_steps < 0:
            raise ValueError(f"dense_steps must be an int >= 0, got {self.dense_steps!r}")
        self.layer_overrides = self._checked_overrides(self.layer_overrides, "layer_overrides")
        self.noise_overrides = self._checked_noise_overrides()
        self._check_calibrated_for()

    def _checked_overrides(self, overrides: Any, where: str) -> dict[int, dict[str, Any]]:
        """``overrides`` ({layer: {field: value}}, layer keys ints or digit strings) checked and normalised; errors
        name ``where``."""
        if not isinstance(overrides, dict):
            raise TypeError(f"{where} must be a dict {{layer: {{field: value}}}}, got {overrides!r}")
        checked = {}
        for layer, values in overrides.items():
            index = int(layer) if isinstance(layer, str) and layer.isdigit() else layer
            if not _is_int(index) or index < 0:
                raise ValueError(f"{where} keys must be layer indices >= 0, got {layer!r}")
            if not isinstance(values, dict):
                raise TypeError(f"{where}[{index}] must be a dict of fields, got {values!r}")
            unknown = set(values) - set(PLAN_FIELDS + SCHEDULE_FIELDS) - {"dense"}
            if unknown:
                raise ValueError(f"{where}[{index}] has unknown fields {sorted(unknown)}; "
                                 f"allowed: {PLAN_FIELDS + SCHEDULE_FIELDS + ('dense',)}")
            values = {k: _as_value(k, v) for k, v in values.items()}
            if "dense" in values and not isinstance(values["dense"], bool):
                raise TypeError(f"{where}[{index}].dense must be a bool, got {values['dense']!r}")
            _check_plan_fields(values, where=f"{where}[{index}].")
            if self.schedule == "constant" and set(values) & set(SCHEDULE_FIELDS):
                raise ValueError(f"{where}[{index}] sets {sorted(set(values) & set(SCHEDULE_FIELDS))} but "
                                 "schedule is 'constant'")
            _check_final(self._layer_values(values), where=f"{where}[{index}].")
            _check_precision(self._layer_values(values), where=f"{where}[{index}].")
            checked[index] = values
        return checked

    def _checked_noise_overrides(self) -> list[dict[str, Any]]:
        """``noise_overrides`` checked (ranges within [0, 1], not overlapping; their overrides as
        ``layer_overrides``) and normalised (ranges as float pairs, sorted by their start)."""
        if not isinstance(self.noise_overrides, (list, tuple)):
            raise TypeError(f"noise_overrides must be a list of {{'noise_range': [low, high], 'layer_overrides': "
                            f"{{...}}}}, got {self.noise_overrides!r}")
        checked = []
        for i, entry in enumerate(self.noise_overrides):
            where = f"noise_overrides[{i}]"
            if not isinstance(entry, dict) or set(entry) != {"noise_range", "layer_overrides"}:
                raise ValueError(f"{where} must be {{'noise_range': [low, high], 'layer_overrides': {{...}}}}, "
                                 f"got {entry!r}")
            bounds = entry["noise_range"]
            if (not isinstance(bounds, (list, tuple)) or len(bounds) != 2 or not all(_is_number(b) for b in bounds)
                    or not 0 <= bounds[0] < bounds[1] <= 1):
                raise ValueError(f"{where}.noise_range must be [low, high] with 0 <= low < high <= 1 (noise levels "
                                 f"sigma), got {bounds!r}")
            checked.append({"noise_range": (float(bounds[0]), float(bounds[1])),
                            "layer_overrides": self._checked_overrides(entry["layer_overrides"],
                                                                       f"{where}.layer_overrides")})
        checked.sort(key=lambda entry: entry["noise_range"])
        for before, after in zip(checked, checked[1:]):
            if after["noise_range"][0] < before["noise_range"][1]:
                raise ValueError(f"noise_overrides ranges {list(before['noise_range'])} and "
                                 f"{list(after['noise_range'])} overlap")
        return checked

    def _check_calibrated_for(self) -> None:
        made = self.calibrated_for
        if made is None:
            return
        heads = made.get("heads") if isinstance(made, dict) else None
        if (not isinstance(made, dict) or not isinstance(made.get("family"), str) or not isinstance(heads, list)
                or not heads or not all(_is_int(h) and h >= 1 for h in heads)):
            raise ValueError(f"calibrated_for must be None or {{'family': str, 'heads': [heads of each layer]}}, "
                             f"got {made!r}")

    def _check_schedule(self) -> None:
        if self.schedule not in SCHEDULES:
            raise ValueError(f"schedule must be one of {SCHEDULES}, got {self.schedule!r}")
        has_final = self.final_topk is not None or self.final_topp is not None
        if self.schedule == "constant" and has_final:
            raise ValueError("final_topk / final_topp are set but schedule is 'constant'; choose a schedule "
                             f"among {SCHEDULES[1:]}")
        if self.schedule != "constant" and not has_final:
            raise ValueError(f"schedule={self.schedule!r} needs final_topk and/or final_topp (the final budget)")
        if self.num_steps is not None and (not _is_int(self.num_steps) or self.num_steps < 1):
            raise ValueError(f"num_steps must be None or an int >= 1, got {self.num_steps!r}")
        if self.schedule in ("linear", "cosine") and (self.num_steps is None or self.num_steps <= self.dense_steps):
            raise ValueError(f"schedule={self.schedule!r} needs num_steps (an int > dense_steps={self.dense_steps}), "
                             f"got {self.num_steps!r}")
        if not _is_number(self.num_train_timesteps) or not 0 < self.num_train_timesteps < math.inf:
            raise ValueError(f"num_train_timesteps must be a positive finite number, got {self.num_train_timesteps!r}")

    def _layer_values(self, override: dict[str, Any]) -> dict[str, Any]:
        """The plan and schedule fields of one layer: the config's, with the layer's override applied."""
        values = {k: getattr(self, k) for k in PLAN_FIELDS + SCHEDULE_FIELDS}
        values.update({k: v for k, v in override.items() if k != "dense"})
        return values

    # ------------------------------------------------------------------ the decision
    @property
    def varies_with_step(self) -> bool:
        """Whether a layer's plan or mask depends on the denoising step: dense steps, a growing schedule or
        mask reuse. When not, every layer's plan is ``plan(layer, None)`` and the step need not be known."""
        if self.dense_steps > 0 or self.schedule != "constant":
            return True
        if self.noise_overrides:
            return True
        layers = [{}] + list(self.layer_overrides.values())
        return any(values["refresh_interval"] > 1 or values["refresh_search"] != "full"
                   for values in map(self._layer_values, layers))

    @property
    def follows_timestep(self) -> bool:
        """Whether a plan depends on the step's timestep value (the "snr" schedule, noise overrides): the
        integration then reads it for every forward."""
        return self.schedule == "snr" or bool(self.noise_overrides)

    def all_layer_overrides(self) -> list[dict[int, dict[str, Any]]]:
        """``layer_overrides`` and the layer overrides of every noise range."""
        return [self.layer_overrides] + [entry["layer_overrides"] for entry in self.noise_overrides]

    def _override(self, layer: int, timestep: float | None) -> dict[str, Any]:
        """The override of ``layer`` at a step of ``timestep``: its noise range's, else ``layer_overrides``'."""
        if timestep is not None:
            sigma = float(timestep) / self.num_train_timesteps
            for entry in self.noise_overrides:
                low, high = entry["noise_range"]
                if low <= sigma < high or sigma == high == 1.0:
                    if layer in entry["layer_overrides"]:
                        return entry["layer_overrides"][layer]
                    break
        return self.layer_overrides.get(layer, {})

    def progress(self, step: int | None, timestep: float | None = None) -> float:
        """How far the schedule is at ``step`` (with that step's ``timestep``), in [0, 1]: 0 at the first
        sparse step, 1 at the last ("linear", "cosine") or at sigma = 0 ("snr"); 0 for "constant" and
        whenever the step (or, for "snr", the timestep) is unknown."""
        if self.schedule == "snr":
            if timestep is None:
                return 0.0
            return min(max(1.0 - float(timestep) / self.num_train_timesteps, 0.0), 1.0)
        if self.schedule == "constant" or step is None:
            return 0.0
        span = self.num_steps - 1 - self.dense_steps
        linear = 1.0 if span <= 0 else min(max((step - self.dense_steps) / span, 0.0), 1.0)
        return linear if self.schedule == "linear" else 0.5 - 0.5 * math.cos(math.pi * linear)

    def plan(self, layer: int, step: int | None, timestep: float | None = None) -> LayerPlan | None:
        """The plan for self-attention ``layer`` at denoising ``step`` (None if unknown); None = dense.

        ``timestep``: the step's timestep value (the "snr" schedule follows it). This is the single
        per-(layer, step) decision of the integration: dense layers and steps, per-layer overrides, and the
        budget of the step, ``topk + (final_topk - topk) * progress`` (counts rounded; likewise ``topp``).
        """
        if layer in self.dense_layers or (step is not None and step < self.dense_steps):
            return None
        override = self._override(layer, timestep)
        if override.get("dense", False):
            return None
        values = self._layer_values(override)
        progress = self.progress(step, timestep)
        values["topk"] = _interpolate(values["topk"], values.pop("final_topk"), progress)
        values["topp"] = _interpolate(values["topp"], values.pop("final_topp"), progress)
        return LayerPlan(**values)

    def check_model(self, family: str, heads: Sequence[int]) -> None:
        """Raise ValueError when this configuration does not fit a transformer of ``family`` whose self-attention
        layers have ``heads[i]`` heads: another family, layer count or head count than the model it was
        calibrated for (``calibrated_for``), or per-head budgets of another length than their layer's heads."""
        made = self.calibrated_for
        if made is not None:
            where = (f"this configuration was calibrated for a {made['family']} transformer with "
                     f"{len(made['heads'])} self-attention layers")
            if made["family"] != family:
                raise ValueError(f"{where}, not for a {family} transformer")
            if len(made["heads"]) != len(heads):
                raise ValueError(f"{where}; this transformer has {len(heads)}")
            for layer, (expected, count) in enumerate(zip(made["heads"], heads)):
                if expected != count:
                    raise ValueError(f"{where}, layer {layer} with {expected} heads; this transformer's layer {layer} "
                                     f"has {count}")
        for overrides in self.all_layer_overrides():
            for layer, count in enumerate(heads):
                override = overrides.get(layer, {})
                if layer in self.dense_layers or override.get("dense", False):
                    continue
                values = self._layer_values(override)
                for name in ("topk", "topp"):
                    if is_per_head(values[name]) and len(values[name]) != count:
                        raise ValueError(f"layer {layer}: {name} gives {len(values[name])} per-head values, but the "
                                         f"layer has {count} heads")

    # ------------------------------------------------------------------ serialisation
    @classmethod
    def from_calibration(cls, path: str | Path, *, target_sparsity: float | None = None,
                         max_error: float | None = None, error: str | None = None, **fields) -> SparseConfig:
        """The per-layer, per-head configuration of a calibration file written by ``sparsevid calibrate``
        (:class:`~sparsevid.plan.calibration.Calibration`): the settings chosen there, or chosen afresh from its
        measurements for ``target_sparsity`` (mean over layers and heads; ``error`` "output", the default where the
        file measured it, weighs each head by what it moves its layer's output through the output projection,
        "absolute" by the size of its output, "relative" every head alike) or ``max_error`` (per head). A file
        measured by noise range (``sparsevid calibrate --noise-splits``) gives ``noise_overrides``. ``fields``:
        further SparseConfig fields (e.g. ``backend``, ``dense_steps``). Applying it to another model than the
        calibrated one raises ValueError."""
        from .noise_ranges import load_calibration

        return load_calibration(path).config(target_sparsity=target_sparsity, max_error=max_error, error=error,
                                             **fields)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-compatible dict (tuples become lists, layer keys strings)."""
        out = dataclasses.asdict(self)
        out["dense_layers"] = list(self.dense_layers)
        for name in ("tile", "topk", "topp"):
            value = getattr(self, name)
            out[name] = list(value) if isinstance(value, tuple) else value
        out["layer_overrides"] = _overrides_dict(self.layer_overrides)
        out["noise_overrides"] = [{"noise_range": list(entry["noise_range"]),
                                   "layer_overrides": _overrides_dict(entry["layer_overrides"])}
                                  for entry in self.noise_overrides]
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "SparseConfig":
        """Inverse of :meth:`to_dict`; unknown keys raise ValueError."""
        if not isinstance(data, dict):
            raise TypeError(f"data must be a dict, got {type(data).__name__}")
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = set(data) - names
        if unknown:
            raise ValueError(f"unknown SparseConfig fields {sorted(unknown)}")
        return cls(**data)

    def to_json(self, **kwargs) -> str:
        return json.dumps(self.to_dict(), **kwargs)

    @classmethod
    def from_json(cls, text: str) -> "SparseConfig":
        return cls.from_dict(json.loads(text))
