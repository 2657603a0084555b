"""Training data of a diffusers video transformer: latents with their text conditioning, by global sample index.

A *latent source* is what :func:`~sparsevid.training.distill.distill` and the velocity yardsticks read:

* ``latent_shape``: (C, T, H, W) of one sample's latents (the transformer's input space, channels first; with
  several shapes, the largest bucket's, see below);
* ``batch(indices, device) -> LatentBatch``: the samples at global indices ``indices`` (a list of ints >= 0;
  an index past the data wraps into a later epoch, see the source);
* ``null_text() -> (text [L, D], text_mask [L] or None)``: the conditioning of the empty prompt, which caption
  dropout substitutes (so that classifier-free guidance keeps working after fine-tuning);
* ``describe() -> dict``: JSON-able facts that pin the data (a resumed run must see the same).

:class:`LatentDirectory` reads a folder in one of two layouts, both with ``null.safetensors`` (the empty prompt's
``text`` [L, D] and optionally ``text_mask`` [L], from :func:`write_null_text`):

* **shards** (what ``sparsevid cache`` writes, :class:`ShardWriter`): ``index.json`` and safetensors shards
  ``shard_<k>.safetensors`` of up to ``shard_size`` samples of one *bucket* (one set of shapes) each, the
  samples stacked on dim 0: ``latents`` [n, C, T, H, W], ``text`` [n, L, D], optionally ``text_mask`` [n, L] and
  further transformer inputs ``extra.<name>`` [n, ...]. The index lists the shards (file, bucket, rows, bytes),
  every sample (shard, row and its metadata: source, caption, size, frames, fps) and the items that were skipped
  with their reasons.
* **one file per sample** (:func:`write_latent_sample`, handy for data made by other tools):
  ``sample_<i>.safetensors`` with unstacked tensors ``latents`` [C, T, H, W], ``text`` [L, D], ...

Why safetensors shards with a JSON index rather than webdataset tars: training visits samples by *global index*
in a seeded per-epoch permutation (:class:`~sparsevid.training.EpochOrder`), the same on every rank and after a
resume, so the reader needs random access to any sample; a safetensors shard is memory-mapped and its header
gives every tensor's offset, so reading row ``j`` reads only that row, whereas a tar is a stream that shuffles
through buffers (an order that depends on the reader, not on the index). Safetensors needs no further dependency,
stores bf16 as it is, cannot execute code, and a truncated or garbled shard fails its header check at once. A
shard groups many samples so that a data set of 10^5 clips is 10^4 files rather than 10^5.

Buckets: clips of different sizes or lengths give latents of different shapes, which cannot share a batch. With
one bucket, global index ``i`` is position ``i % n`` of epoch ``i // n``'s permutation of the ``n`` samples. With
several, each epoch shuffles each bucket, cuts it into runs of ``group`` samples (the last run filled up with
the bucket's first samples of that epoch) and shuffles the runs: every aligned run of ``group`` global indices
lies in one bucket, so every batch does whenever the batch size divides ``group`` (64 by default).
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import torch

from .checkpoint import save_safetensors_atomic
from .draws import EpochOrder

SAMPLE_PREFIX, NULL_FILE = "sample_", "null.safetensors"
LATENTS, TEXT, TEXT_MASK, EXTRA = "latents", "text", "text_mask", "extra."


@dataclass
class LatentBatch:
    """A batch of training samples.

    latents: float32 [B, C, T, H, W]; text: the text encoder's states [B, L, D] (``encoder_hidden_states``);
    text_mask: [B, L] (1 = a real token; ``encoder_attention_mask``) or None; extra: further per-sample
    transformer inputs by argument name (e.g. HunyuanVideo's ``pooled_projections`` [B, P]), batched on dim 0.
    """

    latents: torch.Tensor
    text: torch.Tensor
    text_mask: torch.Tensor | None = None
    extra: dict[str, torch.Tensor] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.latents, torch.Tensor) or self.latents.dim() != 5:
            raise ValueError(f"latents must be a 5D tensor [B, C, T, H, W], got "
                             f"{getattr(self.latents, 'shape', type(self.latents).__name__)}")
        batch = self.latents.shape[0]
        if not isinstance(self.text, torch.Tensor) or self.text.dim() != 3 or self.text.shape[0] != batch:
            raise ValueError(f"text must be a tensor [{batch}, L, D], got "
                             f"{getattr(self.text, 'shape', type(self.text).__name__)}")
        if self.text_mask is not None and tuple(self.text_mask.shape) != tuple(self.text.shape[:2]):
            raise ValueError(f"text_mask must have shape {tuple(self.text.shape[:2])}, got "
                             f"{tuple(self.text_mask.shape)}")
        for name, value in self.extra.items():
            if not isinstance(value, torch.Tensor) or value.shape[:1] != (batch,):
                raise ValueError(f"extra[{name!r}] must be a tensor with {batch} rows")

    def to(self, device: torch.device | str) -> LatentBatch:
        move = lambda t: None if t is None else t.to(device)  # noqa: E731
        return LatentBatch(move(self.latents), move(self.text), move(self.text_mask),
                           {k: move(v) for k, v in self.extra.items()})

    def select(self, rows: torch.Tensor) -> LatentBatch:
        """The rows ``rows`` (int64 [b]) of this batch."""
        pick = lambda t: None if t is None else t[rows.to(t.device)]  # noqa: E731
        return LatentBatch(pick(self.latents), pick(self.text), pick(self.text_mask),
                           {k: pick(v) for k, v in self.extra.items()})

    def drop_text(self, dropped: torch.Tensor, null: tuple[torch.Tensor, torch.Tensor | None]) -> LatentBatch:
        """This batch with the text of the rows where ``dropped`` (bool [B]) is True replaced by ``null`` (the
        empty prompt's text [L, D] and mask [L] or None, from the source's ``null_text()``)."""
        text, mask = null
        if tuple(text.shape) != tuple(self.text.shape[1:]):
            raise ValueError(f"the empty prompt's text has shape {tuple(text.shape)}, the samples' "
                             f"{tuple(self.text.shape[1:])}")
        rows = dropped.to(self.text.device).view(-1, 1, 1)
        new_text = torch.where(rows, text.to(self.text.device, self.text.dtype), self.text)
        new_mask = self.text_mask
        if self.text_mask is not None:
            null_mask = torch.ones_like(self.text_mask[0]) if mask is None else mask.to(self.text_mask)
            new_mask = torch.where(rows.view(-1, 1), null_mask, self.text_mask)
        return LatentBatch(self.latents, new_text, new_mask, self.extra)


def check_indices(indices: Sequence[int]) -> None:
    """ValueError unless ``indices`` is a non-empty list of ints >= 0."""
    if not indices or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in indices):
        raise ValueError(f"indices must be a non-empty list of ints >= 0, got {indices!r}")


def write_latent_sample(directory: str | Path, index: int, latents: torch.Tensor, text: torch.Tensor,
                        text_mask: torch.Tensor | None = None, extra: dict[str, torch.Tensor] | None = None,
                        metadata: dict | None = None) -> Path:
    """Write one sample (latents float [C, T, H, W], text [L, D], text_mask [L] or None, extra {name: tensor})
    as ``sample_<index>.safetensors`` in ``directory`` (atomically); ``metadata``: JSON-able facts kept beside."""
    if latents.dim() != 4 or text.dim() != 2:
        raise ValueError(f"latents must be [C, T, H, W] and text [L, D], got {tuple(latents.shape)} and "
                         f"{tuple(text.shape)}")
    tensors = {LATENTS: latents, TEXT: text}
    if text_mask is not None:
        tensors[TEXT_MASK] = text_mask
    tensors.update({EXTRA + name: value for name, value in (extra or {}).items()})
    meta = {"metadata": json.dumps(metadata or {})}
    return save_safetensors_atomic(tensors, Path(directory) / f"{SAMPLE_PREFIX}{index:07d}.safetensors", meta)


def write_null_text(directory: str | Path, text: torch.Tensor, text_mask: torch.Tensor | None = None) -> Path:
    """Write the empty prompt's conditioning (text [L, D], mask [L] or None) into ``directory``."""
    tensors = {TEXT: text} if text_mask is None else {TEXT: text, TEXT_MASK: text_mask}
    return save_safetensors_atomic(tensors, Path(directory) / NULL_FILE)


