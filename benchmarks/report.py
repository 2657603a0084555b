"""Where a benchmark's current result lives and how it is written: ``<out>/<gpu slug>.json`` (the run metadata
and the measurements), ``.md`` (a header line and the tables) and ``.png`` (the figure, where the benchmark
draws one). Every run overwrites the result of its benchmark on its GPU; earlier results live in git history."""
from __future__ import annotations

import json
import re
from pathlib import Path

VENDORS = ("nvidia", "amd", "intel")


def gpu_slug(meta: dict) -> str:
    """The file stem of a result, from its :func:`benchmarks.run_info.run_metadata`: "cpu" for a CPU run, else
    the device name lower-cased, without the vendor, other characters than letters and digits as "_"
    ("NVIDIA H200" -> "h200", "NVIDIA H100 80GB HBM3" -> "h100_80gb_hbm3"); "x<N>" appended for a run over
    ``meta["gpus"]`` = N > 1 devices ("h200x2")."""
    if meta["device"] == "cpu":
        slug = "cpu"
    else:
        words = [w for w in re.split(r"[^a-z0-9]+", meta["gpu"].lower()) if w and w not in VENDORS]
        slug = "_".join(words) or "gpu"
    gpus = meta.get("gpus") or 1
    return f"{slug}x{gpus}" if gpus > 1 else slug


def write_result(out: str | Path, meta: dict, result: dict, markdown: str, figure=None) -> Path:
    """Write the current result of one benchmark on one GPU under ``out`` (a benchmark's folder, e.g.
    ``benchmarks/results/attention``), replacing the previous one:

    - ``<slug>.json``: ``{"meta": meta, **result}``;
    - ``<slug>.md``: one line naming the device, versions, commit and time, then ``markdown``;
    - ``<slug>.png``: ``figure`` (a matplotlib Figure) when given; without one a PNG left by an earlier run is
      removed, so that the three files always describe the same run.

    Returns the path of the JSON file."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    stem = gpu_slug(meta)
    path = out / f"{stem}.json"
    path.write_text(json.dumps({"meta": meta, **result}, indent=1) + "\n")
    flash_attn_4 = f", flash-attn-4 {meta['flash_attn_4']}" if meta.get("flash_attn_4") else ""
    header = (f"{meta['gpu']}; torch {meta['torch']}, triton {meta['triton']}, diffusers {meta['diffusers']}"
              f"{flash_attn_4}; commit {meta['commit']}, {meta['time']}.")
    (out / f"{stem}.md").write_text(f"{header}\n\n{markdown.strip()}\n")
    png = out / f"{stem}.png"
    if figure is not None:
        figure.savefig(png, dpi=120)
    else:
        png.unlink(missing_ok=True)
    return path
