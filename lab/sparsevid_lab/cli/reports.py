"""Writing what the eval and compare commands measured: JSON, the markdown table and the first clip."""
from __future__ import annotations

import json
from pathlib import Path


def save_report(results: dict, table: str, out: str | Path, order: str) -> None:
    """Write ``results`` (whose "clips" maps label -> float32 [n, 3, T, H, W]) to out/results.json, the
    markdown ``table`` to out/results.md and every label's first clip side by side to out/first_clip.gif/.png;
    print the table. ``order`` says which label comes first (for the message)."""
    from ..eval.media import write_clips

    clips = results.pop("clips")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(results, indent=2))
    (out / "results.md").write_text(table)
    write_clips([clips[name][0] for name in clips], out / "first_clip")
    print(table)
    print(f"wrote {out / 'results.json'}, {out / 'results.md'}, {out / 'first_clip.gif'} ({order})")
