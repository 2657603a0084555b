"""Input videos for the benchmarks of data preparation: random clips with captions on disk."""
from __future__ import annotations

from pathlib import Path

import numpy as np


def write_clips(folder: Path, count: int, frames: int, height: int, width: int, kind: str,
                words: list[str]) -> None:
    """``count`` clips of ``frames`` random frames [height, width, 3] with a caption of 8 of ``words`` each: mp4 files
    (8 fps, PyAV) or folders of PNG frames (``kind`` "mp4" or "png")."""
    from PIL import Image

    rng = np.random.default_rng(0)
    folder.mkdir(parents=True, exist_ok=True)
    for i in range(count):
        pixels = [rng.integers(0, 256, (height, width, 3), dtype=np.uint8) for _ in range(frames)]
        if kind == "png":
            (folder / f"clip{i:03d}").mkdir()
            for j, frame in enumerate(pixels):
                Image.fromarray(frame).save(folder / f"clip{i:03d}" / f"{j:03d}.png", compress_level=1)
        else:
            import av

            with av.open(str(folder / f"clip{i:03d}.mp4"), "w") as container:
                stream = container.add_stream("mpeg4", rate=8)
                stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
                for frame in pixels:
                    container.mux(stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")))
                container.mux(stream.encode())
        (folder / f"clip{i:03d}.txt").write_text(" ".join(rng.choice(words, 8)))
