"""Fine-tuning clips on disk: one clip per file, with an optional caption.

Format (one of):

- ``<name>.safetensors``: a tensor named ``"video"``, float [C, T, H, W] (pixels in [-1, 1] for the built-in
  model, or latents in the model's input space), and the caption as the metadata entry ``"caption"``.
- ``<name>.pt`` / ``<name>.pth``: ``torch.save({"video": tensor [C, T, H, W], "caption": str})``, read
  with ``weights_only=True``.

A missing caption is the null caption "" (unconditional). :func:`write_clip` writes the first form.
"""
from __future__ import annotations

from pathlib import Path

import torch

SUFFIXES = (".safetensors", ".pt", ".pth")
VIDEO_KEY, CAPTION_KEY = "video", "caption"


def write_clip(path: str | Path, video: torch.Tensor, caption: str = "") -> Path:
    """Write ``video`` float [C, T, H, W] and ``caption`` to ``path`` (a ``.safetensors`` file, atomically)."""
    from sparsevid.training.checkpoint import save_safetensors_atomic

    path = Path(path)
    if path.suffix != ".safetensors":
        raise ValueError(f"path must end in .safetensors, got {path.name!r}")
    _check_video(video, str(path))
    if not isinstance(caption, str):
        raise TypeError(f"caption must be a str, got {type(caption).__name__}")
    return save_safetensors_atomic({VIDEO_KEY: video}, path, metadata={CAPTION_KEY: caption})


def read_clip(path: str | Path) -> tuple[torch.Tensor, str]:
    """(video float32 [C, T, H, W], caption) from a clip file in either format."""
    path = Path(path)
    if path.suffix == ".safetensors":
        from safetensors import SafetensorError, safe_open

        try:
            with safe_open(str(path), framework="pt") as f:
                if VIDEO_KEY not in f.keys():
                    raise ValueError(f"{path}: no tensor named {VIDEO_KEY!r} (found {sorted(f.keys())})")
                video, caption = f.get_tensor(VIDEO_KEY), (f.metadata() or {}).get(CAPTION_KEY, "")
        except SafetensorError as error:
            raise ValueError(f"{path}: not a readable safetensors file ({error})") from error
    elif path.suffix in (".pt", ".pth"):
        try:
            data = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as error:  # torch raises several types for corrupt or unsafe pickles
            raise ValueError(f"{path}: not a readable torch file ({error})") from error
        if not isinstance(data, dict) or VIDEO_KEY not in data:
            raise ValueError(f"{path}: expected a dict with a {VIDEO_KEY!r} tensor (and optionally a "
                             f"{CAPTION_KEY!r} string), got {type(data).__name__}")
        video, caption = data[VIDEO_KEY], data.get(CAPTION_KEY, "")
        if not isinstance(caption, str):
            raise ValueError(f"{path}: {CAPTION_KEY!r} must be a str, got {type(caption).__name__}")
    else:
        raise ValueError(f"{path}: clip files end in {SUFFIXES}")
    _check_video(video, str(path))
    return video.float(), caption


def list_clip_files(directory: str | Path) -> list[Path]:
    """The clip files directly inside ``directory``, sorted by name."""
    directory = Path(directory)
    if not directory.is_dir():
        raise ValueError(f"data directory {str(directory)!r} does not exist or is not a directory")
    files = sorted(p for p in directory.iterdir() if p.suffix in SUFFIXES and not p.name.startswith("."))
    if not files:
        raise ValueError(f"data directory {str(directory)!r} holds no clip files ({', '.join(SUFFIXES)})")
    return files


def _check_video(video, where: str) -> None:
    if not isinstance(video, torch.Tensor) or not video.is_floating_point():
        raise ValueError(f"{where}: {VIDEO_KEY!r} must be a floating-point tensor, got "
                         f"{getattr(video, 'dtype', type(video).__name__)}")
    if video.dim() != 4:
        raise ValueError(f"{where}: {VIDEO_KEY!r} must have shape [C, T, H, W], got {tuple(video.shape)}")
