"""Per-head settings by noise level: one calibration per range of the denoising's noise level, allocated jointly.

A head's attention changes over the denoising (broad at high noise, local near the end, or the reverse), so the
setting that serves it best may change too. :class:`NoiseRangeCalibration` holds one
:class:`~sparsevid.plan.calibration.Calibration` per range of sigma = timestep / ``num_train_timesteps``, the
ranges split at ``splits`` ([0, s1), [s1, s2), ..., [sk, 1]), each measured on the calls whose step fell in it.

A target sparsity is allocated over every (range, layer, head) at once: the summed error, each range's heads
weighed by the share of the measured calls that fell in it, is minimised at a call-weighted mean sparsity of at
least the target (the Lagrangian allocation of ``allocate_sparsity``), so a range whose heads lose little from
sparsity gives its budget to one whose heads lose more. An error bound applies per range and head. The
configuration has the ranges' choices as ``SparseConfig.noise_overrides`` and, for forwards without a timestep,
the choice of the pooled measurements (every call alike) as ``layer_overrides``.
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import torch

from .calibration import (FORMAT, VERSION, Calibration, _check_objective, _table, allocate_sparsity, check_format,
                          objective_record, read_calibration_file, write_calibration_file)
from .config import SparseConfig


def check_splits(splits: Sequence[float]) -> tuple[float, ...]:
    """``splits`` as a tuple of floats, strictly ascending within (0, 1); ValueError otherwise."""
    if isinstance(splits, (str, bytes)) or not isinstance(splits, Sequence):
        raise TypeError(f"noise splits must be a sequence of noise levels, got {splits!r}")
    values = tuple(splits)
    if (not values or not all(isinstance(s, (int, float)) and not isinstance(s, bool) for s in values)
            or not all(0 < s < 1 for s in values) or any(b <= a for a, b in zip(values, values[1:]))):
        raise ValueError(f"noise splits must be noise levels strictly ascending within (0, 1), got {list(values)!r}")
    return tuple(float(s) for s in values)


def check_timestep_scale(num_train_timesteps) -> float:
    """The timestep of pure noise (sigma = timestep / it), a positive number; ValueError otherwise."""
    if isinstance(num_train_timesteps, bool) or not isinstance(num_train_timesteps, (int, float)) \
            or not num_train_timesteps > 0:
        raise ValueError(f"num_train_timesteps must be a positive number, got {num_train_timesteps!r}")
    return float(num_train_timesteps)


def range_index(splits: Sequence[float], sigma: float) -> int:
    """The index of the range of noise level ``sigma`` among the ranges ``splits`` cut [0, 1] into."""
    return bisect.bisect_right(splits, sigma)


def range_bounds(splits: Sequence[float]) -> list[tuple[float, float]]:
    """[(0, s1), (s1, s2), ..., (sk, 1)]."""
    edges = [0.0, *splits, 1.0]
    return list(zip(edges[:-1], edges[1:]))


def range_label(low: float, high: float) -> str:
    """"[0.5, 0.8)", or "[0.8, 1]" for the range that includes pure noise."""
    return f"[{low:g}, {high:g}{']' if high == 1 else ')'}"


@dataclass
class NoiseRangeCalibration:
    """Calibrations of one model measured over ranges of noise level (see the module docstring).

    splits: the noise levels the ranges are cut at; ranges: one Calibration per range (same model, tiles and
    candidates; ``inputs["calls_per_layer"]`` the calls each measured); num_train_timesteps: the timestep of pure
    noise in the model's convention (sigma = timestep / num_train_timesteps); objective: the stored choice's.
    """

    splits: tuple[float, ...]
    ranges: list[Calibration]
    num_train_timesteps: float = 1000.0
    objective: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.splits = check_splits(self.splits)
        if len(self.ranges) != len(self.splits) + 1:
            raise ValueError(f"{len(self.splits)} noise splits make {len(self.splits) + 1} ranges, got "
                             f"{len(self.ranges)} calibrations")
        first = self.ranges[0]
        for i, other in enumerate(self.ranges[1:], 1):
            if (other.model != first.model or other.settings != first.settings
                    or other.candidates != first.candidates):
                raise ValueError(f"range {i}'s calibration is of another model, tiles or candidates than range 0's")
        self.num_train_timesteps = check_timestep_scale(self.num_train_timesteps)

    # ------------------------------------------------------------------ what was measured
    @property
    def model(self) -> dict[str, Any]:
        return self.ranges[0].model

    @property
    def num_layers(self) -> int:
        return self.ranges[0].num_layers

    @property
    def bounds(self) -> list[tuple[float, float]]:
        return range_bounds(self.splits)

    def calls(self) -> list[list[int]]:
        """[range][layer]: the attention calls each range measured in each layer."""
        return [list(r.inputs["calls_per_layer"]) for r in self.ranges]

    def weights(self) -> list[float]:
        """Each range's share of the measured calls (summed over layers)."""
        totals = [sum(calls) for calls in self.calls()]
        return [t / sum(totals) for t in totals]

    def pooled(self) -> Calibration:
        """The calibration of every call alike: each layer's tables the call-weighted means over the ranges (what
        one measurement without ranges would have found), with no choice."""
        calls = torch.tensor(self.calls(), dtype=torch.float64)  # [R, L]
        share = (calls / calls.sum(dim=0).clamp_min(1))[..., None, None]

        def pooled_table(name: str):
            if any(getattr(r, name) is None for r in self.ranges):
                return None
            tables = torch.stack([_table(getattr(r, name), name) for r in self.ranges])  # [R, L, H, C], NaN-padded
            pooled = (share * tables).sum(dim=0)
            return [layer[:heads].tolist() for layer, heads in zip(pooled, self.model["heads"])]

        first = self.ranges[0]
        inputs = {**first.inputs, "calls_per_layer": [int(c) for c in calls.sum(dim=0).tolist()]}
        return Calibration(first.model, first.settings, first.candidates, pooled_table("sparsity"),
                           pooled_table("error"), pooled_table("recall"), inputs=inputs,
                           abs_error=pooled_table("abs_error"), output_error=pooled_table("output_error"))

    # ------------------------------------------------------------------ the choice
    def allocate(self, target_sparsity: float | None = None, max_error: float | None = None,
                 error: str | None = None) -> list[list[list[int]]]:
        """[range][layer][head] candidate indices for one objective (``Calibration.allocate``'s arguments): a
        target sparsity jointly over the ranges (each weighed by its share of the calls), an error bound per
        range."""
        _check_objective(target_sparsity, max_error)
        if max_error is not None:
            return [r.allocate(max_error=max_error, error=error) for r in self.ranges]
        tables = [r.allocation_tables(error, max_error) for r in self.ranges]
        errors = torch.cat([t[0] for t in tables])  # [R * L, H, C]
        sparsity = torch.cat([t[1] for t in tables])
        heads = errors.shape[1]
        weights = torch.cat([torch.full((self.num_layers, heads), w, dtype=torch.float64) for w in self.weights()])
        choice = allocate_sparsity(errors, sparsity, target_sparsity, weights).view(len(self.ranges),
                                                                                     self.num_layers, heads)
        return [[row[:h] for row, h in zip(picks.tolist(), self.model["heads"])] for picks in choice]

    def choose(self, target_sparsity: float | None = None, max_error: float | None = None,
               error: str | None = None) -> None:
        """Set each range's choice and :attr:`objective` for one objective."""
        error = self.ranges[0].default_error(max_error) if error is None else error
        self.objective = objective_record(target_sparsity, max_error, error)
        for calibration, choice in zip(self.ranges, self.allocate(target_sparsity, max_error, error)):
            calibration.choice, calibration.objective = choice, dict(self.objective)

    @property
    def parts(self) -> list[Calibration]:
        """The calibrations this one is made of: one per noise range."""
        return self.ranges

    def summary(self) -> dict[str, Any]:
        """{"ranges": each range's ``Calibration.summary()`` with its "noise_range" and "weight"; "mean_sparsity",
        "mean_error", "mean_recall": their call-weighted means}."""
        out: dict[str, Any] = {"ranges": []}
        for calibration, bounds, weight in zip(self.ranges, self.bounds, self.weights()):
            out["ranges"].append({**calibration.summary(), "noise_range": list(bounds), "weight": weight})
        for name in ("sparsity", "error", "recall"):
            out[f"mean_{name}"] = sum(r[f"mean_{name}"] * r["weight"] for r in out["ranges"])
        return out

    def config(self, target_sparsity: float | None = None, max_error: float | None = None, error: str | None = None,
               **fields) -> SparseConfig:
        """The SparseConfig of the stored choice (or of a new one for ``target_sparsity`` / ``max_error``): the
        ranges' choices as ``noise_overrides``, the pooled measurements' choice for the same objective as
        ``layer_overrides``; ``fields``: further SparseConfig fields (not those the calibration decides)."""
        if "num_train_timesteps" in fields:
            raise ValueError("['num_train_timesteps'] comes from the calibration; it cannot be given as a field")
        if target_sparsity is None and max_error is None:
            if any(r.choice is None for r in self.ranges) or not self.objective:
                raise ValueError("this calibration has no choice yet: give target_sparsity or max_error")
            choices = [r.choice for r in self.ranges]
            objective = {"error": "relative", **self.objective}  # the record leaves out the relative error
        else:
            choices = self.allocate(target_sparsity, max_error, error)
            objective = {"target_sparsity": target_sparsity, "max_error": max_error, "error": error}
        pooled = self.pooled()
        fallback = pooled.layer_overrides(pooled.allocate(**objective))
        noise_overrides = [{"noise_range": list(bounds), "layer_overrides": r.layer_overrides(choice)}
                           for r, bounds, choice in zip(self.ranges, self.bounds, choices)]
        return SparseConfig(layer_overrides=fallback, noise_overrides=noise_overrides,
                            num_train_timesteps=self.num_train_timesteps, **self.ranges[0].config_fields(fields))

    # ------------------------------------------------------------------ the file
    def to_dict(self) -> dict[str, Any]:
        return {"format": FORMAT, "version": VERSION, "noise_splits": list(self.splits),
                "num_train_timesteps": self.num_train_timesteps, "objective": self.objective,
                "ranges": [r.to_dict() for r in self.ranges]}

    def save(self, path: str | Path) -> Path:
        """Write the calibration as JSON to ``path`` (folders created): one line per field and per range."""
        return write_calibration_file(path, self.to_dict(), one_line_each=("ranges",))

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> NoiseRangeCalibration:
        check_format(data)
        ranges = [Calibration.from_dict(r) for r in data["ranges"]]
        return cls(tuple(data["noise_splits"]), ranges, data.get("num_train_timesteps", 1000.0),
                   data.get("objective") or {})


def _from_dict(data: Any) -> Calibration | NoiseRangeCalibration:
    if isinstance(data, dict) and "noise_splits" in data:
        return NoiseRangeCalibration.from_dict(data)
    return Calibration.from_dict(data)


def load_calibration(path: str | Path) -> Calibration | NoiseRangeCalibration:
    """Read a calibration file written by ``sparsevid calibrate``: a :class:`Calibration`, or a
    :class:`NoiseRangeCalibration` where it was measured by noise range (FileNotFoundError / ValueError naming the
    path when it is not one)."""
    return read_calibration_file(path, _from_dict)
