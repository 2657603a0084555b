"""Videos with captions on disk, and their frames at a chosen size, length and frame rate.

An *item* is a video file (mp4, webm, gif, mov, mkv, avi; decoded with PyAV) or a folder of frame images (png,
jpg, webp; in name order) with a caption: a ``.txt`` file beside it with the same stem (``clip.mp4`` +
``clip.txt``, ``clip/`` + ``clip.txt``), or a row of a manifest (CSV with a header, or JSONL) naming the item's
path relative to the videos folder under ``video`` (or ``path``/``file``), its caption under ``caption`` (or
``text``/``prompt``) and optionally ``fps`` (the frame rate of a frame folder).
"""
from __future__ import annotations

import csv
import json
from dataclasses import dataclass
from pathlib import Path

import torch

VIDEO_SUFFIXES = (".mp4", ".webm", ".gif", ".mov", ".mkv", ".avi")
IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".webp", ".bmp")
PATH_KEYS, CAPTION_KEYS = ("video", "path", "file"), ("caption", "text", "prompt")


class UnusableItem(ValueError):
    """An item that cannot become a sample (it does not decode, is too short or small, has no caption); the
    message says why."""


@dataclass
class VideoItem:
    """``source``: the item's path relative to the videos folder (names it in the index and when resuming);
    ``caption``: None when none was found; ``fps``: the manifest's frame rate (frame folders have none)."""

    source: str
    path: Path
    caption: str | None
    fps: float | None = None


def find_videos(root: str | Path, manifest: str | Path | None = None) -> list[VideoItem]:
    """The items under ``root``: the rows of ``manifest`` (a .csv or .jsonl file) in order, or else every video
    file and frame folder below ``root`` in path order, each with the caption of the ``.txt`` beside it."""
    root = Path(root)
    if not root.is_dir():
        raise FileNotFoundError(f"--videos {root}: not a folder")
    if manifest is not None:
        return [_manifest_item(root, row, manifest, number) for number, row in enumerate(_read_manifest(manifest), 1)]
    paths = [p for p in root.rglob("*") if p.suffix.lower() in VIDEO_SUFFIXES and p.is_file() or _is_frame_folder(p)]
    items = []
    for path in sorted(paths):
        text = path.with_name(path.stem + ".txt") if path.is_file() else path.with_name(path.name + ".txt")
        caption = text.read_text(encoding="utf-8").strip() if text.is_file() else None
        items.append(VideoItem(path.relative_to(root).as_posix(), path, caption))
    return items


def _is_frame_folder(path: Path) -> bool:
    return path.is_dir() and any(p.suffix.lower() in IMAGE_SUFFIXES for p in path.iterdir())


def _read_manifest(path: str | Path) -> list[dict]:
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
        if path.suffix.lower() == ".csv":
            return list(csv.DictReader(text.splitlines()))
        if path.suffix.lower() in (".jsonl", ".json"):
            return [json.loads(line) for line in text.splitlines() if line.strip()]
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, csv.Error) as error:
        raise ValueError(f"--captions {path}: unreadable ({error})") from None
    raise ValueError(f"--captions {path}: expected a .csv or .jsonl manifest")


def _manifest_item(root: Path, row: dict, manifest, number: int) -> VideoItem:
    if not isinstance(row, dict):
        raise ValueError(f"--captions {manifest}: row {number} is not an object with video and caption fields")

    def pick(keys):
        return next((row[key] for key in keys if row.get(key) not in (None, "")), None)
    source, caption, fps = pick(PATH_KEYS), pick(CAPTION_KEYS), pick(("fps",))
    if source is None:
        raise ValueError(f"--captions {manifest}: row {number} names no video (a {'/'.join(PATH_KEYS)} field)")
    return VideoItem(str(source), root / str(source), None if caption is None else str(caption).strip(),
                     None if fps is None else float(fps))


@dataclass
class Clip:
    """Frames uint8 [F, 3, H, W] (RGB) at ``fps`` frames per second (None when unknown)."""

    frames: torch.Tensor
    fps: float | None


def read_clip(item: VideoItem, fps: float | None = None, count: int | None = None) -> Clip:
    """The frames of ``item``: resampled to ``fps`` (nearest frame; unchanged when ``fps`` or the item's own rate
    is unknown) and cut to the first ``count`` (all when None). UnusableItem when it does not decode."""
    if not item.path.exists():
        raise UnusableItem(f"{item.path} not found")
    if item.path.is_dir():
        source_fps, frames = item.fps, _image_frames(item.path)
    else:
        source_fps, frames = _video_frames(item.path)
    step = 1.0 if fps is None or source_fps is None else source_fps / fps
    picked = []
    try:
        for number, frame in enumerate(frames):
            while round(len(picked) * step) == number and (count is None or len(picked) < count):
                picked.append(frame)
            if count is not None and len(picked) == count:
                break
    except UnusableItem:
        raise
    except Exception as error:  # decoders raise their own error types mid-stream
        raise UnusableItem(f"{item.path}: does not decode past frame {len(picked)} ({error})") from None
    if not picked:
        raise UnusableItem(f"{item.path}: holds no frames")
    return Clip(torch.stack(picked), source_fps if fps is None else fps)


def _video_frames(path: Path):
    """(frame rate or None, a generator of uint8 [3, H, W] frames) of a video file."""
    import av

    try:
        container = av.open(str(path))
        stream = container.streams.video[0]
    except (av.FFmpegError, IndexError, OSError) as error:
        raise UnusableItem(f"{path}: not a readable video ({error or 'no video stream'})") from None
    rate = float(stream.average_rate) if stream.average_rate else None

    def frames():
        with container:
            for frame in container.decode(stream):
                yield torch.from_numpy(frame.to_ndarray(format="rgb24")).permute(2, 0, 1)
    return rate, frames()


def _image_frames(folder: Path):
    from PIL import Image, UnidentifiedImageError

    for path in sorted(p for p in folder.iterdir() if p.suffix.lower() in IMAGE_SUFFIXES):
        try:
            with Image.open(path) as image:
                array = torch.frombuffer(bytearray(image.convert("RGB").tobytes()), dtype=torch.uint8)
                yield array.view(image.height, image.width, 3).permute(2, 0, 1)
        except (UnidentifiedImageError, OSError) as error:
            raise UnusableItem(f"{path}: not a readable image ({error})") from None


def fit(frames: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """``frames`` uint8 [F, 3, h, w] scaled to cover ``height`` x ``width`` and cropped at the centre, as float32
    [F, 3, height, width] in [-1, 1]."""
    video = frames.float() / 127.5 - 1
    h, w = video.shape[-2:]
    scale = max(height / h, width / w)
    if (round(h * scale), round(w * scale)) != (h, w):
        size = (max(height, round(h * scale)), max(width, round(w * scale)))
        video = torch.nn.functional.interpolate(video, size=size, mode="bilinear", antialias=True,
                                                align_corners=False).clamp(-1, 1)
    top, left = (video.shape[-2] - height) // 2, (video.shape[-1] - width) // 2
    return video[..., top:top + height, left:left + width]
