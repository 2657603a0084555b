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


FONT_SIZE = 13  # pixels: legible beside clips enlarged 4x


def _font(size: int = FONT_SIZE):
    """Pillow's default font at ``size`` pixels (its fixed small bitmap font where Pillow is too old for sizes
    or lacks FreeType)."""
    from PIL import ImageFont

    try:
        return ImageFont.load_default(size=size)
    except (TypeError, ImportError, OSError):
        return ImageFont.load_default()


def _wrap(draw, text: str, font, width: int) -> list[str]:
    """``text`` broken at spaces into lines no wider than ``width`` pixels (a longer single word stays whole);
    a newline in ``text`` always starts a new line."""
    lines: list[str] = []
    for part in text.split("\n"):
        first = len(lines)
        for word in part.split():
            if len(lines) > first and draw.textlength(f"{lines[-1]} {word}", font=font) <= width:
                lines[-1] = f"{lines[-1]} {word}"
            else:
                lines.append(word)
    return lines


def _centred(draw, lines: Sequence[str], centre: float, y: int, font, line_height: int) -> None:
    """Draw ``lines`` in black one below the other, each centred on x = ``centre``, the first at height ``y``."""
    for line in lines:
        draw.text((centre - draw.textlength(line, font=font) / 2, y), line, fill="black", font=font)
        y += line_height


def header(width: int, clip_width: int, gap: int, labels: Sequence[str] = (), caption: str | None = None,
           margin: int = 4, note: str | None = None, left: int = 0) -> np.ndarray:
    """A white band uint8 [h, width, 3]: ``caption``, then ``note`` (say, what the numbers under the labels
    mean), each wrapped and centred, then each clip's label centred over its clip (clip i spans
    ``left + i * (clip_width + gap)`` ... ``+ clip_width``). A label may hold several lines (newlines between
    them, each wrapped to the clip's width): the band grows to hold the longest. Pillow's default font."""
    from PIL import Image, ImageDraw

    font = _font()
    draw = ImageDraw.Draw(Image.new("RGB", (1, 1)))
    line_height = font.getbbox("Ag")[3] + margin
    top = [line for text in (caption, note) if text for line in _wrap(draw, text, font, width - 2 * margin)]
    columns = [_wrap(draw, label, font, clip_width - 2 * margin) for label in labels]
    labels_top = margin + line_height * len(top) + (line_height // 2 if top and columns else 0)  # a half-line apart
    image = Image.new("RGB", (width, labels_top + line_height * max(map(len, columns), default=0) + margin), "white")
    draw = ImageDraw.Draw(image)
    _centred(draw, top, width / 2, margin, font, line_height)
    for i, lines in enumerate(columns):
        _centred(draw, lines, left + i * (clip_width + gap) + clip_width / 2, labels_top, font, line_height)
    return np.asarray(image)


def frame_margin(frame_numbers: Sequence[int], row_height: int, margin: int = 6) -> np.ndarray:
    """A white column uint8 [len(frame_numbers) * row_height, w, 3] that names the rows of a strip of frames:
    "frame n" (``frame_numbers`` counted from 1) right-aligned and centred in its band of ``row_height``
    pixels."""
    from PIL import Image, ImageDraw

    font = _font()
    texts = [f"frame {n}" for n in frame_numbers]
    draw = ImageDraw.Draw(Image.new("RGB", (1, 1)))
    width = int(max(draw.textlength(text, font=font) for text in texts)) + 2 * margin
    image = Image.new("RGB", (width, row_height * len(texts)), "white")
    draw = ImageDraw.Draw(image)
    top, bottom = font.getbbox("frame 0")[1::2]
    for row, text in enumerate(texts):
        y = row * row_height + (row_height - top - bottom) / 2
        draw.text((width - margin - draw.textlength(text, font=font), y), text, fill="black", font=font)
    return np.asarray(image)


def _beside(margin: np.ndarray, frames: np.ndarray) -> np.ndarray:
    """Each frame's ``margin`` [T, H, w, 3] left of it in ``frames`` [T, H, W, 3]."""
    return np.concatenate([margin, frames], axis=2)


def _above(band: np.ndarray, image: np.ndarray) -> np.ndarray:
    """``band`` [h, W, 3] above ``image`` [..., H, W, 3] (above every frame of a stack)."""
    return np.concatenate([np.broadcast_to(band, image.shape[:-3] + band.shape), image], axis=-3)


def write_clips(videos: Sequence[torch.Tensor], stem: str | Path, scale: int = 4, fps: int = 8,
                strip_every: int = 2, labels: Sequence[str] | None = None, caption: str | None = None,
                gap: int = 2, note: str | None = None, frame_labels: bool = False) -> list[Path]:
    """Write clips [3, T, H, W] side by side as ``stem.gif`` (+ ``stem.mp4`` where supported) and
    every ``strip_every``-th frame as the PNG strip ``stem.png``. With ``labels`` (one per clip, newlines
    between its lines), a ``caption`` and/or a ``note``, a header above the clips names them (on every GIF
    frame, once on top of the strip; see :func:`header`). With ``frame_labels``, a left margin names each row
    of the strip, and each GIF frame, by its frame ("frame 1", "frame 3", ...). Returns the written paths."""
    if labels is not None and len(labels) != len(videos):
        raise ValueError(f"labels must name each of the {len(videos)} clips, got {len(labels)}")
    stem = Path(stem)
    named = lambda suffix: stem.with_name(stem.name + suffix)  # noqa: E731  (stems may contain dots)
    frames = upscale(side_by_side(videos, gap), scale)
    t, height, clips_width = frames.shape[:3]
    if frame_labels:  # the same margin beside the GIF's frames and the strip's rows
        frames = _beside(frame_margin(range(1, t + 1), height).reshape(t, height, -1, 3), frames)
    strip = np.concatenate(list(frames[::strip_every]), axis=0)[None]  # one image [1, rows * H, W, 3]
    if labels or caption or note:
        band = header(frames.shape[2], videos[0].shape[-1] * scale, gap * scale, labels or (), caption, note=note,
                      left=frames.shape[2] - clips_width)
        frames, strip = _above(band, frames), _above(band, strip)
    paths = [write_animation(frames, named(".gif"), fps)]
    if mp4_supported():
        paths.append(write_animation(frames, named(".mp4"), fps))
    paths.append(write_strip(strip, named(".png")))
    return paths
