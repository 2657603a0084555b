"""Per-layer, per-head settings chosen from measurements of a model's own attention (``sparsevid calibrate``).

A calibration measured, for every self-attention layer ``l``, head ``h`` and candidate setting ``c``, over
the dense model's attention calls: the mean achieved sparsity ``sparsity[l][h][c]``, the mean relative L1
error of that head's attention output ``error[l][h][c]`` and the mean exact attention mass the mask keeps
``recall[l][h][c]``. A head's output depends on its own mask only, so the heads' choices are independent and
the allocation is exact on the measured calls:

* ``target_sparsity`` S: minimise the summed error (by default ``output_error``, each head's error through its
  slice of the layer's output projection, where measured; or relative; or absolute) subject to a mean sparsity (over layers and heads) of at
  least S: a Lagrangian allocation (each head takes ``argmin_c error - lambda * sparsity``, ``lambda`` the
  smallest reaching S, by bisection), then the heads that the last step of ``lambda`` moved go back one by one
  while the mean stays at or above S;
* ``max_error`` E: each head takes its sparsest candidate whose error is at most E (as SpargeAttn bounds the
  L1 error per head), dense when none is.

Candidates are "dense", "topk" (a fraction of key blocks) and "topp" (a pooled mass); every head of a layer
runs the "hybrid" rule with per-head ``topk`` and ``topp``, the part a candidate does not use set to
:data:`OFF` (which keeps only a row's heaviest tile and its ties, kept by the other part anyway but for ties).
What is measured is what the configuration applies.

The file (JSON) is written beside the model: see ``docs/calibration.md`` for its fields.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import torch

from .config import SparseConfig

FORMAT, VERSION = "sparsevid-calibration", 1
# What a target sparsity's allocation minimises: the name of each kind of head error and its table.
ERROR_TABLES = {"relative": "error", "absolute": "abs_error", "output": "output_error"}
ERRORS = tuple(ERROR_TABLES)
DEFAULT_ERROR = "output"  # of a target sparsity, where measured (docs/calibration.md: it beat top-k and relative)
OFF = 1e-6
CANDIDATE_RULES = ("dense", "topk", "topp")
DEFAULT_TOPK = (0.5, 0.35, 0.25, 0.18, 0.12, 0.08, 0.05, 0.035, 0.025, 0.015)
DEFAULT_TOPP = (0.995, 0.99, 0.98, 0.97, 0.95, 0.93, 0.9, 0.85, 0.8, 0.7, 0.6, 0.5)


@dataclass(frozen=True)
class Candidate:
    """One setting a head may take: ``rule`` "dense" | "topk" | "topp" and its ``value`` (the top-k fraction of
    key blocks in (0, 1] or the top-p pooled mass in (0, 1]; 1.0 for dense)."""

    rule: str
    value: float = 1.0

    def __post_init__(self) -> None:
        if self.rule not in CANDIDATE_RULES:
            raise ValueError(f"candidate rule must be one of {CANDIDATE_RULES}, got {self.rule!r}")
        if isinstance(self.value, bool) or not isinstance(self.value, (int, float)) or not 0 < self.value <= 1:
            raise ValueError(f"candidate value must be a number in (0, 1], got {self.value!r}")

    @property
    def budgets(self) -> tuple[float, float]:
        """(topk, topp) of the hybrid rule that this candidate is."""
        if self.rule == "dense":
            return 1.0, 1.0
        return (float(self.value), OFF) if self.rule == "topk" else (OFF, float(self.value))

    @property
    def label(self) -> str:
        return "dense" if self.rule == "dense" else f"{self.rule} {self.value:g}"


def default_candidates(topk: Sequence[float] = DEFAULT_TOPK, topp: Sequence[float] = DEFAULT_TOPP,
                       ) -> tuple[Candidate, ...]:
    """Dense first (index 0; allocation ties go to the lower index), then the top-k fractions and top-p masses."""
    return ((Candidate("dense"),) + tuple(Candidate("topk", float(f)) for f in topk)
            + tuple(Candidate("topp", float(p)) for p in topp))


def _table(values, name: str) -> torch.Tensor:
    """float64 [L, H, C] of a nested list (layers may differ in heads: padded with NaN)."""
    layers = [torch.as_tensor(layer, dtype=torch.float64) for layer in values]
    if not layers or any(t.dim() != 2 for t in layers):
        raise ValueError(f"{name} must be a [layer][head][candidate] table")
    heads = max(t.shape[0] for t in layers)
    out = torch.full((len(layers), heads, layers[0].shape[1]), math.nan, dtype=torch.float64)
    for i, t in enumerate(layers):
        out[i, :t.shape[0]] = t
    return out


def _choose(error: torch.Tensor, sparsity: torch.Tensor, lam: float) -> torch.Tensor:
    """int64 [L, H]: each head's candidate minimising error - lam * sparsity (first index on ties)."""
    return torch.argmin(error - lam * sparsity, dim=-1)


def _mean_at(sparsity: torch.Tensor, choice: torch.Tensor, weights: torch.Tensor) -> float:
    """The ``weights``-weighted mean sparsity of ``choice`` (padded heads weigh 0)."""
    return float((sparsity.gather(-1, choice.unsqueeze(-1)).squeeze(-1) * weights).sum() / weights.sum())


def allocate_sparsity(error: torch.Tensor, sparsity: torch.Tensor, target: float,
                      weights: torch.Tensor | None = None) -> torch.Tensor:
    """int64 [L, H]: the candidate of each head (error, sparsity float64 [L, H, C]; padded heads NaN) that
    minimises the summed error (each head's weighed by ``weights``) at a mean sparsity >= ``target`` (the sparsest
    choice when none reaches it). ``weights``: float64 [L, H] >= 0, each head's share of the mean (default: every
    head alike; a calibration by noise range weighs each range's heads by the share of the calls it measured)."""
    valid = ~sparsity[..., 0].isnan()
    weights = (torch.ones_like(sparsity[..., 0]) if weights is None else weights.double()).nan_to_num(0.0) * valid
    error, sparsity = error.nan_to_num(0.0) * weights.unsqueeze(-1), sparsity.nan_to_num(0.0)
    gain = sparsity * weights.unsqueeze(-1)  # what a head's choice adds to the weighted sum
    low, high = 0.0, 1.0
    while _mean_at(sparsity, _choose(error, gain, high), weights) < target and high < 1e12:
        low, high = high, high * 4
    for _ in range(100):
        mid = (low + high) / 2
        if _mean_at(sparsity, _choose(error, gain, mid), weights) >= target:
            high = mid
        else:
            low = mid
    choice, fallback = _choose(error, gain, high), _choose(error, gain, low)
    # Heads whose choice the last step of lambda changed go back (most error per sparsity first) while the mean
    # stays at the target.
    d_err = (error.gather(-1, choice.unsqueeze(-1)) - error.gather(-1, fallback.unsqueeze(-1))).squeeze(-1)
    d_sp = (gain.gather(-1, choice.unsqueeze(-1)) - gain.gather(-1, fallback.unsqueeze(-1))).squeeze(-1)
    ratio = d_err / d_sp.clamp_min(1e-12)
    moved = sorted(((choice != fallback) & valid).nonzero().tolist(), key=lambda lh: -float(ratio[lh[0], lh[1]]))
    total, needed = float(gain.gather(-1, choice.unsqueeze(-1)).sum()), target * float(weights.sum())
    for layer, head in moved:
        if total - float(d_sp[layer, head]) >= needed:
            total -= float(d_sp[layer, head])
            choice[layer, head] = fallback[layer, head]
    return choice


def allocate_error(error: torch.Tensor, sparsity: torch.Tensor, bound: float) -> torch.Tensor:
    """int64 [L, H]: each head's sparsest candidate whose error is at most ``bound`` (candidate 0, dense, when
    none is; its error is 0)."""
    allowed = sparsity.nan_to_num(0.0).masked_fill(~(error.nan_to_num(0.0) <= bound), -1.0)
    allowed[..., 0] = allowed[..., 0].clamp_min(0.0)
    return torch.argmax(allowed, dim=-1)


def objective_record(target_sparsity: float | None, max_error: float | None, error: str) -> dict[str, Any]:
    """What a calibration file keeps of its objective: {"target_sparsity": S} or {"max_error": E}, with "error"
    unless it is "relative"."""
    record = {"target_sparsity": target_sparsity} if max_error is None else {"max_error": max_error}
    if error != "relative":
        record["error"] = error
    return record


def _check_objective(target_sparsity, max_error) -> None:
    if (target_sparsity is None) == (max_error is None):
        raise ValueError("give exactly one of target_sparsity and max_error")
    if target_sparsity is not None and (isinstance(target_sparsity, bool) or not isinstance(target_sparsity, (int, float))
                                        or not 0 < target_sparsity < 1):
        raise ValueError(f"target_sparsity must be a number in (0, 1), got {target_sparsity!r}")
    if max_error is not None and (isinstance(max_error, bool) or not isinstance(max_error, (int, float))
                                  or not max_error >= 0):
        raise ValueError(f"max_error must be a number >= 0, got {max_error!r}")


@dataclass
class Calibration:
    """Measurements of a model's heads under candidate settings, and the choice made from them.

    model: {"family": adapter name, "class_name", "heads": [heads of each self-attention layer]}; settings:
    {"block_q", "block_k", "tile"} the masks were measured in; candidates: the settings tried; sparsity, error,
    recall: [layer][head][candidate] means over the measured calls; choice: [layer][head] candidate indices;
    objective: {"target_sparsity": S} or {"max_error": E} (and {"error": "absolute"} when allocated on
    ``abs_error``, {"error": "output"} on ``output_error``); inputs: what was measured (free-form, JSON); abs_error:
    the heads' absolute output errors (mean |difference| per element), like ``error``; output_error: each head's
    error through its slice of the layer's output projection, relative to the layer's dense projected output (L2),
    like ``error`` (each None in files that predate it).
    """

    model: dict[str, Any]
    settings: dict[str, Any]
    candidates: tuple[Candidate, ...]
    sparsity: list
    error: list
    recall: list
    objective: dict[str, float] = field(default_factory=dict)
    choice: list | None = None
    inputs: dict[str, Any] = field(default_factory=dict)
    abs_error: list | None = None
    output_error: list | None = None

    def __post_init__(self) -> None:
        heads = self.model.get("heads")
        optional = tuple(name for name in ("abs_error", "output_error") if getattr(self, name) is not None)
        for name in ("sparsity", "error", "recall") + optional:
            table = getattr(self, name)
            if (not isinstance(table, list) or len(table) != len(heads)
                    or any(len(layer) != h or any(len(row) != len(self.candidates) for row in layer)
                           for layer, h in zip(table, heads))):
                raise ValueError(f"{name} must be a [layer][head][candidate] table of {len(heads)} layers with "
                                 f"{heads} heads and {len(self.candidates)} candidates")

    @property
    def num_layers(self) -> int:
        return len(self.model["heads"])

    def default_error(self, max_error: float | None = None) -> str:
        """The error an objective allocates on when none is given: "output" for a target sparsity where this
        calibration measured it, else "relative" (``max_error`` bounds it; files older than the output errors)."""
        return DEFAULT_ERROR if max_error is None and self.output_error is not None else "relative"

    def allocate(self, target_sparsity: float | None = None, max_error: float | None = None,
                 error: str | None = None) -> list[list[int]]:
        """[layer][head] candidate indices for one objective (exactly one of the two; see the module docstring).
        ``error``: what a target sparsity's allocation minimises, the heads' summed "relative" output errors (every
        head alike), "absolute" ones (a head weighs by the size of its output) or "output" ones (a head weighs by
        what it moves its layer's output through the output projection); None: :meth:`default_error`.
        ``max_error`` bounds the relative error."""
        _check_objective(target_sparsity, max_error)
        table, sparsity = self.allocation_tables(error, max_error)
        choice = (allocate_sparsity(table, sparsity, target_sparsity) if max_error is None
                  else allocate_error(table, sparsity, max_error))
        return [row[:h] for row, h in zip(choice.tolist(), self.model["heads"])]

    def allocation_tables(self, error: str | None, max_error: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """float64 [L, H, C] (the error table an objective allocates on, the sparsity table); ``error`` as in
        :meth:`allocate`; ValueError where this calibration did not measure it or ``max_error`` is set with it."""
        error = self.default_error(max_error) if error is None else error
        if error not in ERRORS:
            raise ValueError(f"error must be one of {ERRORS}, got {error!r}")
        if error != "relative" and (getattr(self, ERROR_TABLES[error]) is None or max_error is not None):
            raise ValueError(f"error={error!r} needs target_sparsity and a calibration that measured {error} errors "
                             "(calibrate again with this version)")
        return _table(getattr(self, ERROR_TABLES[error]), "error"), _table(self.sparsity, "sparsity")

    def choose(self, target_sparsity: float | None = None, max_error: float | None = None,
               error: str | None = None) -> None:
        """Set :attr:`choice` and :attr:`objective` for one objective (``error`` as in :meth:`allocate`)."""
        error = self.default_error(max_error) if error is None else error
        self.choice = self.allocate(target_sparsity, max_error, error)
        self.objective = objective_record(target_sparsity, max_error, error)

    @property
    def parts(self) -> list[Calibration]:
        """The calibrations this one is made of: itself (a calibration by noise range: one per range)."""
        return [self]

    def _picked(self, name: str, choice: list[list[int]]) -> list[list[float]]:
        return [[row[c] for row, c in zip(layer, picks)] for layer, picks in zip(getattr(self, name), choice)]

    def summary(self, choice: list[list[int]] | None = None) -> dict[str, Any]:
        """{"sparsity", "error", "recall": [layer][head] of the choice; "mean_sparsity", "mean_error",
        "mean_recall": their means over every head; "labels": [layer][head] candidate labels}."""
        choice = self._require(choice)
        out: dict[str, Any] = {"labels": [[self.candidates[c].label for c in picks] for picks in choice]}
        for name in ("sparsity", "error", "recall"):
            picked = self._picked(name, choice)
            flat = [x for layer in picked for x in layer]
            out[name], out[f"mean_{name}"] = picked, sum(flat) / len(flat)
        return out

    def _require(self, choice):
        choice = self.choice if choice is None else choice
        if choice is None:
            raise ValueError("this calibration has no choice yet: give target_sparsity or max_error")
        return choice

    def config(self, target_sparsity: float | None = None, max_error: float | None = None, error: str | None = None,
               **fields) -> SparseConfig:
        """The SparseConfig of the stored choice (or of a new one for ``target_sparsity`` / ``max_error``):
        per layer the hybrid rule with per-head ``topk`` and ``topp`` (scalars where every head took the same
        setting), or dense where every head is; ``fields``: further SparseConfig fields (not the per-layer ones)."""
        choice = self._require(None) if target_sparsity is None and max_error is None else self.allocate(
            target_sparsity, max_error, error)
        return SparseConfig(layer_overrides=self.layer_overrides(choice), **self.config_fields(fields))

    def config_fields(self, fields: dict[str, Any]) -> dict[str, Any]:
        """The SparseConfig fields a configuration of this calibration shares (the tiles, the model it was made
        for) with the caller's ``fields``; ValueError where those name what the calibration decides."""
        taken = sorted(set(fields) & {"layer_overrides", "dense_layers", "calibrated_for", "noise_overrides"})
        if taken:
            raise ValueError(f"{taken} come from the calibration; they cannot be given as fields")
        return {"block_q": self.settings["block_q"], "block_k": self.settings["block_k"],
                "tile": self.settings["tile"], **fields,
                "calibrated_for": {"family": self.model["family"], "heads": list(self.model["heads"])}}

    def layer_overrides(self, choice: list[list[int]]) -> dict[int, dict[str, Any]]:
        """SparseConfig layer overrides of a [layer][head] ``choice``: per layer the hybrid rule with per-head
        ``topk`` and ``topp`` (scalars where every head took the same setting), or dense where every head is."""
        overrides = {}
        for layer, picks in enumerate(choice):
            chosen = [self.candidates[c] for c in picks]
            if all(c.rule == "dense" for c in chosen):
                overrides[layer] = {"dense": True}
            elif len(set(chosen)) == 1:  # one setting for every head: scalar budgets (the scalar predictor path)
                topk, topp = chosen[0].budgets
                overrides[layer] = {"rule": "hybrid", "topk": topk, "topp": topp}
            else:
                topk, topp = zip(*(c.budgets for c in chosen))
                overrides[layer] = {"rule": "hybrid", "topk": list(topk), "topp": list(topp)}
        return overrides

    # ------------------------------------------------------------------ the file
    def to_dict(self) -> dict[str, Any]:
        def rounded(table):
            return [[[round(float(x), 6) for x in row] for row in layer] for layer in table]

        return {"format": FORMAT, "version": VERSION, "model": self.model, "settings": self.settings,
                "objective": self.objective, "choice": self.choice,
                "candidates": [{"rule": c.rule, "value": c.value} for c in self.candidates],
                "sparsity": rounded(self.sparsity), "error": rounded(self.error), "recall": rounded(self.recall),
                **{name: rounded(getattr(self, name)) for name in ("abs_error", "output_error")
                   if getattr(self, name) is not None}, "inputs": self.inputs}

    def save(self, path: str | Path) -> Path:
        """Write the calibration as JSON to ``path`` (folders created): one line per field, tables compact."""
        return write_calibration_file(path, self.to_dict())

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Calibration:
        check_format(data)
        if "noise_splits" in data:
            raise ValueError("this calibration was measured by noise range: read it with "
                             "sparsevid.plan.noise_ranges.load_calibration")
        model = data["model"]
        if not isinstance(model, dict) or not isinstance(model.get("heads"), list):
            raise ValueError(f"calibration 'model' must name the family and the heads per layer, got {model!r}")
        candidates = tuple(Candidate(c["rule"], c["value"]) for c in data["candidates"])
        return cls(model, data["settings"], candidates, data["sparsity"], data["error"], data["recall"],
                   data.get("objective") or {}, data.get("choice"), data.get("inputs") or {}, data.get("abs_error"),
                   data.get("output_error"))

    @classmethod
    def load(cls, path: str | Path) -> Calibration:
        """Read a calibration file (FileNotFoundError / ValueError naming the path when it is not one)."""
        return read_calibration_file(path, cls.from_dict)


def check_format(data: Any) -> None:
    """TypeError / ValueError unless ``data`` is a JSON object of this format and version."""
    if not isinstance(data, dict):
        raise TypeError(f"a calibration must be a JSON object, got {type(data).__name__}")
    if data.get("format") != FORMAT:
        raise ValueError(f"not a sparsevid calibration (its 'format' is not {FORMAT!r})")
    if data.get("version") != VERSION:
        raise ValueError(f"calibration version {data.get('version')!r} is not supported (this sparsevid reads "
                         f"version {VERSION})")


def write_calibration_file(path: str | Path, data: dict[str, Any], one_line_each: Sequence[str] = ()) -> Path:
    """Write calibration ``data`` as JSON to ``path`` (folders created): one line per field, and one per item of the
    list fields named in ``one_line_each`` (a calibration by noise range's "ranges"), the tables compact."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)

    def field(key: str, value) -> str:
        if key in one_line_each:
            return f" {json.dumps(key)}: [\n" + ",\n".join(f"  {json.dumps(item)}" for item in value) + "\n ]"
        return f" {json.dumps(key)}: {json.dumps(value)}"

    path.write_text("{\n" + ",\n".join(field(key, value) for key, value in data.items()) + "\n}\n")
    return path


def read_calibration_file(path: str | Path, parse):
    """``parse`` (a ``from_dict``) of the JSON in the calibration file at ``path``; FileNotFoundError / ValueError
    naming the path when it is not one."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no calibration file at {path}")
    try:
        return parse(json.loads(path.read_text()))
    except (json.JSONDecodeError, KeyError, TypeError) as error:
        raise ValueError(f"{path} is not a readable sparsevid calibration: {error}") from None
