"""A SparseConfig from a one-line spec, as command lines take it."""
from __future__ import annotations

import json
from pathlib import Path

from .calibration import FORMAT as CALIBRATION_FORMAT
from .config import SparseConfig


def parse_config(spec: str):
    """A SparseConfig from ``"rule=hybrid,topk=0.05,topp=0.9"`` (values parsed as JSON where possible,
    e.g. ``dense_layers=[0,5]``), from the path of a JSON file written by ``SparseConfig.to_json``, or from a
    calibration file written by ``sparsevid calibrate`` (its saved choice, ``SparseConfig.from_calibration``)."""
    if not isinstance(spec, str) or not spec.strip():
        raise ValueError(f"config spec must be a non-empty string, got {spec!r}")
    if spec.endswith(".json"):
        data = json.loads(Path(spec).read_text())
        if isinstance(data, dict) and data.get("format") == CALIBRATION_FORMAT:
            return SparseConfig.from_calibration(spec)
        return SparseConfig.from_dict(data)
    values = {}
    for item in _split_top_level(spec):
        if "=" not in item:
            raise ValueError(f"config spec items must be key=value, got {item!r} in {spec!r}")
        key, raw = (s.strip() for s in item.split("=", 1))
        try:
            values[key] = json.loads(raw)
        except json.JSONDecodeError:
            values[key] = raw
    return SparseConfig.from_dict(values)


def _split_top_level(spec: str) -> list[str]:
    """Split at commas outside brackets: "a=1,b=[1,2]" -> ["a=1", "b=[1,2]"]."""
    items, depth, current = [], 0, ""
    for ch in spec:
        depth += ch in "[{" and 1 or (-1 if ch in "]}" else 0)
        if ch == "," and depth == 0:
            items.append(current)
            current = ""
        else:
            current += ch
    return items + [current] if current else items
