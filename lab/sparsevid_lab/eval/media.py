"""Writing clips as GIF / MP4 and as PNG strips of frames."""
from __future__ import annotations

from pathlib import Path
from typing import Sequence

import numpy as np
import torch


def to_uint8(video: torch.Tensor) -> np.ndarray:
    """[3, T, H, W] in [-1, 1] -> uint8 [T, H, W, 3]."""
    if video.dim() != 4 or video.shape[0] != 3:
        raise ValueError(f"video must be [3, T, H, W], got {tuple(video.shape)}")
    return ((video.detach().float().cpu().clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8).permute(1, 2, 3, 0).numpy()


def side_by_side(videos: Sequence[torch.Tensor], gap: int = 2) -> np.ndarray:
    """Clips [3, T, H, W] next to each other with white gaps: uint8 [T, H, sum(W) + gaps, 3]."""
    frames = [to_uint8(v) for v in videos]
    t, h = frames[0].shape[:2]
    if any(f.shape[:2] != (t, h) for f in frames):
        raise ValueError("videos must share frames and height")
    spacer = np.full((t, h, gap, 3), 255, np.uint8)
    parts = [frames[0]]
    for f in frames[1:]:
        parts += [spacer, f]
    return np.concatenate(parts, axis=2)


def upscale(frames: np.ndarray, factor: int) -> np.ndarray:
    """Nearest-neighbour enlargement of [T, H, W, 3] frames by an integer ``factor``."""
    return frames.repeat(factor, axis=1).repeat(factor, axis=2)


def write_animation(frames: np.ndarray, path: str | Path, fps: int = 8) -> Path:
    """Save uint8 [T, H, W, 3] frames as a looping GIF (or MP4 when ``path`` ends in .mp4)."""
    import imageio.v2 as imageio

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.suffix == ".mp4":
        imageio.mimsave(path, list(frames), fps=fps, macro_block_size=1)
    else:
        imageio.mimsave(path, list(frames), duration=1000 / fps, loop=0)
    return path


def mp4_supported() -> bool:
    """Whether imageio can write MP4 here (it needs its ffmpeg plugin)."""
    try:
        import imageio_ffmpeg  # noqa: F401
    except ImportError:
        return False
    return True


def write_strip(frames: np.ndarray, path: str | Path, every: int = 1) -> Path:
    """Save frames [T, H, W, 3] stacked vertically (every ``every``-th frame) as one PNG."""
    from PIL import Image

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(np.concatenate(list(frames[::every]), axis=0)).save(path)
    return path


def _wrap(draw, text: str, font, width: int) -> list[str]:
    """``text`` broken at spaces into lines no wider than ``width`` pixels (a longer single word stays whole)."""
    lines: list[str] = []
    for word in text.split():
        if lines and draw.textlength(f"{lines[-1]} {word}", font=font) <= width:
            lines[-1] = f"{lines[-1]} {word}"
        else:
            lines.append(word)
    return lines


def header(width: int, clip_width: int, gap: int, labels: Sequence[str] = (), caption: str | None = None,
           margin: int = 4) -> np.ndarray:
    """A white band uint8 [h, width, 3]: ``caption`` (wrapped, centred), then each clip's label centred over
    its clip (clip i spans ``i * (clip_width + gap)`` ... ``+ clip_width``). Pillow's default font."""
    from PIL import Image, ImageDraw, ImageFont

    font = ImageFont.load_default()
    draw = ImageDraw.Draw(Image.new("RGB", (1, 1)))
    line_height = font.getbbox("Ag")[3] + margin
    lines = _wrap(draw, caption, font, width - 2 * margin) if caption else []
    image = Image.new("RGB", (width, margin + line_height * (len(lines) + bool(labels))), "white")
    draw = ImageDraw.Draw(image)
    y = margin
    for line in lines:
        draw.text(((width - draw.textlength(line, font=font)) / 2, y), line, fill="black", font=font)
        y += line_height
    for i, label in enumerate(labels):
        centre = i * (clip_width + gap) + clip_width / 2
        draw.text((centre - draw.textlength(label, font=font) / 2, y), label, fill="black", font=font)
    return np.asarray(image)


def write_clips(videos: Sequence[torch.Tensor], stem: str | Path, scale: int = 4, fps: int = 8,
                strip_every: int = 2, labels: Sequence[str] | None = None, caption: str | None = None,
                gap: int = 2) -> list[Path]:
    """Write clips [3, T, H, W] side by side as ``stem.gif`` (+ ``stem.mp4`` where supported) and
    every ``strip_every``-th frame as the PNG strip ``stem.png``. With ``labels`` (one per clip) and/or a
    ``caption``, a header above the clips names them (on every GIF frame, once on top of the strip).
    Returns the written paths."""
    if labels is not None and len(labels) != len(videos):
        raise ValueError(f"labels must name each of the {len(videos)} clips, got {len(labels)}")
    stem = Path(stem)
    named = lambda suffix: stem.with_name(stem.name + suffix)  # noqa: E731  (stems may contain dots)
    frames = upscale(side_by_side(videos, gap), scale)
    strip = np.concatenate(list(frames[::strip_every]), axis=0)[None]  # one image [1, rows * H, W, 3]
    if labels or caption:
        band = header(frames.shape[2], videos[0].shape[-1] * scale, gap * scale, labels or (), caption)
        frames = np.concatenate([np.broadcast_to(band, (len(frames),) + band.shape), frames], axis=1)
        strip = np.concatenate([band[None], strip], axis=1)
    paths = [write_animation(frames, named(".gif"), fps)]
    if mp4_supported():
        paths.append(write_animation(frames, named(".mp4"), fps))
    paths.append(write_strip(strip, named(".png")))
    return paths
