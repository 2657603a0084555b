"""``SparseConfig``: which attention rule applies at which layer and denoising step.

The configuration is plain data (JSON-serialisable). The one decision the integration asks of it is
:meth:`SparseConfig.plan`: given a layer index and a denoising step, either ``None`` (run that attention
dense, exactly as the unmodified model) or a :class:`LayerPlan` with the mask-prediction settings.
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any

RULES = ("topk", "topp", "hybrid")
BACKENDS = ("auto", "triton", "flex", "reference")
BLOCK_SIZES = (64, 128)
# Fields of SparseConfig that a per-layer override may change (plus "dense": True).
PLAN_FIELDS = ("rule", "topk", "topp", "block_q", "block_k", "backend", "keep_sink", "keep_diagonal",
               "similarity_threshold", "min_blocks", "tile")


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _check_plan_fields(values: dict[str, Any], where: str) -> None:
    """Raise ValueError/TypeError naming the first bad field of ``values`` (a subset of PLAN_FIELDS)."""
    def name(key):
        return f"{where}{key}"

    if "rule" in values and values["rule"] not in RULES:
        raise ValueError(f"{name('rule')} must be one of {RULES}, got {values['rule']!r}")
    if "topk" in values:
        topk = values["topk"]
        if not _is_number(topk):
            raise TypeError(f"{name('topk')} must be a float fraction in (0, 1] or an int count >= 1, got {topk!r}")
        if _is_int(topk) and topk < 1 or isinstance(topk, float) and not 0.0 < topk <= 1.0:
            raise ValueError(f"{name('topk')} must be a fraction in (0, 1] or an int count >= 1, got {topk!r}")
    if "topp" in values:
        topp = values["topp"]
        if not _is_number(topp):
            raise TypeError(f"{name('topp')} must be a number in (0, 1], got {topp!r}")
        if not 0.0 < topp <= 1.0:
            raise ValueError(f"{name('topp')} must be in (0, 1], got {topp!r}")
    for key in ("block_q", "block_k"):
        if key in values and (not _is_int(values[key]) or values[key] not in BLOCK_SIZES):
            raise ValueError(f"{name(key)} must be one of {BLOCK_SIZES}, got {values[key]!r}")
    if "backend" in values and values["backend"] not in BACKENDS:
        raise ValueError(f"{name('backend')} must be one of {BACKENDS}, got {values['backend']!r}")
    for key in ("keep_sink", "keep_diagonal"):
        if key in values and not isinstance(values[key], bool):
            raise TypeError(f"{name(key)} must be a bool, got {values[key]!r}")
    if "similarity_threshold" in values:
        sim = values["similarity_threshold"]
        if sim is not None and (not _is_number(sim) or not -1.0 <= sim <= 1.0):
            raise ValueError(f"{name('similarity_threshold')} must be None or a number in [-1, 1], got {sim!r}")
    if "min_blocks" in values and (not _is_int(values["min_blocks"]) or values["min_blocks"] < 0):
        raise ValueError(f"{name('min_blocks')} must be an int >= 0, got {values['min_blocks']!r}")
    if "tile" in values:
        tile = values["tile"]
        ok = tile in ("auto", "none") or (
            isinstance(tile, tuple) and len(tile) == 3 and all(_is_int(t) and t >= 1 for t in tile))
        if not ok:
            raise ValueError(f"{name('tile')} must be 'auto', 'none' or a (t, h, w) tuple of ints >= 1, got {tile!r}")


@dataclass(frozen=True)
class LayerPlan:
    """How one sparse attention call is made: mask-prediction settings, block sizes, backend, tiling.

    ``tile``: "auto" (the default 3D tile of ``tile_permutation``), "none" (raster token order) or (t, h, w).
    """

    rule: str
    topk: float | int
    topp: float
    block_q: int
    block_k: int
    backend: str
    keep_sink: bool
    keep_diagonal: bool
    similarity_threshold: float | None
    min_blocks: int
    tile: str | tuple[int, int, int]

    def predict_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for ``sparsevid.predict_mask`` (everything but q, k, scale and backend)."""
        return {"rule": self.rule, "topk": self.topk, "topp": self.topp, "block_q": self.block_q,
                "block_k": self.block_k, "keep_sink": self.keep_sink, "keep_diagonal": self.keep_diagonal,
                "similarity_threshold": self.similarity_threshold, "min_blocks": self.min_blocks}


def _as_tile(tile):
    return tuple(tile) if isinstance(tile, list) else tile


@dataclass
class SparseConfig:
    """Sparse-attention settings for a video DiT (see ``apply_sparse_attention``).

    Args:
        rule, topk, topp: mask-prediction rule ("topk" | "topp" | "hybrid"); topk a fraction of key blocks
            per query block (float in (0, 1]) or a count (int); topp a cumulative pooled-attention mass.
        block_q, block_k: tile sizes in tokens (64 or 128).
        backend: block-sparse attention backend ("auto" | "triton" | "flex" | "reference").
        keep_sink, keep_diagonal, similarity_threshold, min_blocks: passed to ``predict_mask``.
        dense_layers: layer indices (in the order ``apply_sparse_attention`` enumerates self-attentions)
            that stay dense.
        dense_steps: the first ``dense_steps`` denoising steps run every layer dense.
        layer_overrides: {layer: {field: value}} replacing any of the fields above for one layer;
            ``{"dense": True}`` keeps that layer dense.
        tile: token order for the sparse attention: "auto", "none" or a (t, h, w) tile in latent tokens.
    """

    rule: str = "hybrid"
    topk: float | int = 0.05
    topp: float = 0.9
    block_q: int = 128
    block_k: int = 64
    backend: str = "auto"
    keep_sink: bool = False
    keep_diagonal: bool = False
    similarity_threshold: float | None = None
    min_blocks: int = 1
    dense_layers: tuple[int, ...] = ()
    dense_steps: int = 0
    layer_overrides: dict[int, dict[str, Any]] = field(default_factory=dict)
    tile: str | tuple[int, int, int] = "auto"

    def __post_init__(self) -> None:
        self.tile = _as_tile(self.tile)
        if isinstance(self.dense_layers, (list, set, frozenset)):
            self.dense_layers = tuple(sorted(self.dense_layers))
        _check_plan_fields({k: getattr(self, k) for k in PLAN_FIELDS}, where="")
        if not isinstance(self.dense_layers, tuple) or not all(_is_int(i) and i >= 0 for i in self.dense_layers):
            raise ValueError(f"dense_layers must be a tuple of layer indices >= 0, got {self.dense_layers!r}")
        if not _is_int(self.dense_steps) or self.dense_steps < 0:
            raise ValueError(f"dense_steps must be an int >= 0, got {self.dense_steps!r}")
        if not isinstance(self.layer_overrides, dict):
            raise TypeError(f"layer_overrides must be a dict {{layer: {{field: value}}}}, got {self.layer_overrides!r}")
        overrides = {}
        for layer, values in self.layer_overrides.items():
            index = int(layer) if isinstance(layer, str) and layer.isdigit() else layer
            if not _is_int(index) or index < 0:
                raise ValueError(f"layer_overrides keys must be layer indices >= 0, got {layer!r}")
            if not isinstance(values, dict):
                raise TypeError(f"layer_overrides[{index}] must be a dict of fields, got {values!r}")
            unknown = set(values) - set(PLAN_FIELDS) - {"dense"}
            if unknown:
                raise ValueError(f"layer_overrides[{index}] has unknown fields {sorted(unknown)}; "
                                 f"allowed: {PLAN_FIELDS + ('dense',)}")
            values = {k: _as_tile(v) if k == "tile" else v for k, v in values.items()}
            if "dense" in values and not isinstance(values["dense"], bool):
                raise TypeError(f"layer_overrides[{index}].dense must be a bool, got {values['dense']!r}")
            _check_plan_fields(values, where=f"layer_overrides[{index}].")
            overrides[index] = values
        self.layer_overrides = overrides

    # ------------------------------------------------------------------ the decision
    def plan(self, layer: int, step: int | None) -> LayerPlan | None:
        """The plan for self-attention ``layer`` at denoising ``step`` (None if unknown); None = dense.

        This is the single per-(layer, step) decision of the integration; schedules extend it.
        """
        if layer in self.dense_layers or (step is not None and step < self.dense_steps):
            return None
        override = self.layer_overrides.get(layer, {})
        if override.get("dense", False):
            return None
        values = {k: getattr(self, k) for k in PLAN_FIELDS}
        values.update({k: v for k, v in override.items() if k != "dense"})
        return LayerPlan(**values)

    # ------------------------------------------------------------------ serialisation
    def to_dict(self) -> dict[str, Any]:
        """A JSON-compatible dict (tuples become lists, layer keys strings)."""
        out = dataclasses.asdict(self)
        out["dense_layers"] = list(self.dense_layers)
        out["tile"] = list(self.tile) if isinstance(self.tile, tuple) else self.tile
        out["layer_overrides"] = {
            str(layer): {k: list(v) if isinstance(v, tuple) else v for k, v in values.items()}
            for layer, values in self.layer_overrides.items()
        }
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
