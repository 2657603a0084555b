"""Training data of a diffusers video transformer: latents with their text conditioning, by global sample index.

A *latent source* is what :func:`~sparsevid.training.distill.distill` and the velocity yardsticks read:

* ``latent_shape``: (C, T, H, W) of one sample's latents (the transformer's input space, channels first; with
  several shapes, the largest bucket's, see below);
* ``batch(indices, device) -> LatentBatch``: the samples at global indices ``indices`` (a list of ints >= 0;
  an index past the data wraps into a later epoch, see the source);
* ``null_text() -> (text [L, D], text_mask [L] or None)``: the conditioning of the empty prompt, which caption
  dropout substitutes (so that classifier-free guidance keeps working after fine-tuning); a third element
  {name: tensor} where the empty prompt has further inputs (HunyuanVideo's pooled projection);
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

from .checkpoint import save_safetensors_atomic, write_text_atomic
from .draws import EpochOrder

SAMPLE_PREFIX, SHARD_PREFIX, NULL_FILE, INDEX_FILE = "sample_", "shard_", "null.safetensors", "index.json"
LATENTS, TEXT, TEXT_MASK, EXTRA = "latents", "text", "text_mask", "extra."
INDEX_FORMAT, INDEX_VERSION = "sparsevid-latent-shards", 1
DEFAULT_GROUP = 64


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

    def to(self, device: torch.device | str, dtype: torch.dtype | None = None) -> LatentBatch:
        """This batch on ``device``, its floating-point tensors in ``dtype`` (None: as they are) except float64 ones
        (numbers a forward takes exactly, such as LTX's RoPE scale, which a cast to bf16 would round)."""
        def move(t):
            if t is None:
                return None
            cast = dtype is not None and t.is_floating_point() and t.dtype != torch.float64
            return t.to(device, dtype) if cast else t.to(device)

        return LatentBatch(move(self.latents), move(self.text), move(self.text_mask),
                           {k: move(v) for k, v in self.extra.items()})

    def select(self, rows: torch.Tensor) -> LatentBatch:
        """The rows ``rows`` (int64 [b]) of this batch."""
        pick = lambda t: None if t is None else t[rows.to(t.device)]  # noqa: E731
        return LatentBatch(pick(self.latents), pick(self.text), pick(self.text_mask),
                           {k: pick(v) for k, v in self.extra.items()})

    def drop_text(self, dropped: torch.Tensor, null: tuple[torch.Tensor, torch.Tensor | None]) -> LatentBatch:
        """This batch with the text of the rows where ``dropped`` (bool [B]) is True replaced by ``null`` (the
        empty prompt's text [L, D], mask [L] or None and optionally its extra inputs {name: tensor [...]}, from the
        source's ``null_text()``; extras it names replace the rows' own)."""
        text, mask, *null_extra = null
        if tuple(text.shape) != tuple(self.text.shape[1:]):
            raise ValueError(f"the empty prompt's text has shape {tuple(text.shape)}, the samples' "
                             f"{tuple(self.text.shape[1:])}")
        rows = dropped.to(self.text.device).view(-1, 1, 1)
        new_text = torch.where(rows, text.to(self.text.device, self.text.dtype), self.text)
        new_mask = self.text_mask
        if self.text_mask is not None:
            null_mask = torch.ones_like(self.text_mask[0]) if mask is None else mask.to(self.text_mask)
            new_mask = torch.where(rows.view(-1, 1), null_mask, self.text_mask)
        extra = dict(self.extra)
        for name, value in (null_extra[0] if null_extra else {}).items():
            own = extra[name]
            where = rows.view(-1, *[1] * (own.dim() - 1))
            extra[name] = torch.where(where, value.to(own.device, own.dtype), own)
        return LatentBatch(self.latents, new_text, new_mask, extra)


def check_indices(indices: Sequence[int]) -> None:
    """ValueError unless ``indices`` is a non-empty list of ints >= 0."""
    if not indices or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in indices):
        raise ValueError(f"indices must be a non-empty list of ints >= 0, got {indices!r}")


def write_latent_sample(directory: str | Path, index: int, latents: torch.Tensor, text: torch.Tensor,
                        text_mask: torch.Tensor | None = None, extra: dict[str, torch.Tensor] | None = None,
                        metadata: dict | None = None) -> Path:
    """Write one sample (latents float [C, T, H, W], text [L, D], text_mask [L] or None, extra {name: tensor})
    as ``sample_<index>.safetensors`` in ``directory`` (atomically); ``metadata``: JSON-able facts kept beside."""
    tensors = sample_tensors(latents, text, text_mask, extra)
    meta = {"metadata": json.dumps(metadata or {})}
    return save_safetensors_atomic(tensors, Path(directory) / f"{SAMPLE_PREFIX}{index:07d}.safetensors", meta)


def sample_tensors(latents: torch.Tensor, text: torch.Tensor, text_mask: torch.Tensor | None = None,
                   extra: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """One sample's tensors by their stored names (latents [C, T, H, W], text [L, D], text_mask [L], extras)."""
    if latents.dim() != 4 or text.dim() != 2:
        raise ValueError(f"latents must be [C, T, H, W] and text [L, D], got {tuple(latents.shape)} and "
                         f"{tuple(text.shape)}")
    return {LATENTS: latents, **_text_tensors(text, text_mask, extra)}


def _text_tensors(text: torch.Tensor, text_mask: torch.Tensor | None,
                  extra: dict[str, torch.Tensor] | None) -> dict[str, torch.Tensor]:
    """The stored names of one prompt's conditioning: text [L, D], text_mask [L] if given, ``extra.<name>``."""
    if text_mask is not None and tuple(text_mask.shape) != tuple(text.shape[:1]):
        raise ValueError(f"text_mask must have shape {tuple(text.shape[:1])}, got {tuple(text_mask.shape)}")
    tensors = {TEXT: text} if text_mask is None else {TEXT: text, TEXT_MASK: text_mask}
    tensors.update({EXTRA + name: value for name, value in (extra or {}).items()})
    return tensors


def bucket_key(shapes: dict[str, Sequence[int]]) -> str:
    """The bucket of a sample whose tensors have ``shapes`` {name: shape}, e.g.
    ``latents:16x21x60x104;text:512x4096``."""
    return ";".join(f"{name}:{'x'.join(str(n) for n in shape)}" for name, shape in sorted(shapes.items()))


def write_null_text(directory: str | Path, text: torch.Tensor, text_mask: torch.Tensor | None = None,
                    extra: dict[str, torch.Tensor] | None = None) -> Path:
    """Write the empty prompt's conditioning (text [L, D], mask [L] or None, further inputs {name: tensor [...]})
    into ``directory``."""
    return save_safetensors_atomic(_text_tensors(text, text_mask, extra), Path(directory) / NULL_FILE)




def read_index(path: str | Path) -> dict:
    """The shard index at ``path`` (ValueError naming the file when it is no readable index)."""
    path = Path(path)
    try:
        index = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ValueError(f"{path}: not a readable shard index ({error}); the folder's shards cannot be found "
                         f"without it") from None
    if not isinstance(index, dict) or index.get("format") != INDEX_FORMAT:
        raise ValueError(f"{path}: not a sparsevid shard index (expected format {INDEX_FORMAT!r})")
    if index.get("version") != INDEX_VERSION:
        raise ValueError(f"{path}: index version {index.get('version')!r}, this sparsevid reads {INDEX_VERSION}")
    return index


class ShardWriter:
    """Appends samples to a folder of shards (the module docstring's first layout), resumably.

    Samples of one bucket (one set of tensor shapes) collect in memory and are written as one shard when
    ``shard_size`` of them are there and at :meth:`close`; every write replaces a shard and then the index
    atomically, so a run killed at any moment leaves a readable folder that lists only what was completely
    written. Opening a folder that holds an index continues it: :attr:`done` names the sources already written,
    and a bucket's unfilled last shard is extended rather than a new one begun.

    Args:
        directory: the folder (created if missing).
        settings: JSON-able facts the samples are made with (model, size, frames, ...); a folder begun with other
            settings is refused (ValueError), so one folder never mixes two encodings.
        shard_size: samples per shard (>= 1). Memory holds up to this many samples per bucket.
    """

    def __init__(self, directory: str | Path, settings: dict | None = None, shard_size: int = 16):
        if not isinstance(shard_size, int) or shard_size < 1:
            raise ValueError(f"shard_size must be an int >= 1, got {shard_size!r}")
        self.directory, self.shard_size = Path(directory), shard_size
        self.directory.mkdir(parents=True, exist_ok=True)
        settings = json.loads(json.dumps(settings or {}))
        path = self.directory / INDEX_FILE
        if path.exists():
            self.index = read_index(path)
            if self.index["settings"] != settings:
                raise ValueError(f"{self.directory} was written with other settings ({self.index['settings']}), "
                                 f"not {settings}: use a new folder, or the same settings to continue it")
        else:
            self.index = {"format": INDEX_FORMAT, "version": INDEX_VERSION, "settings": settings, "shards": [],
                          "samples": [], "skipped": []}
        self.pending: dict[str, dict] = {}  # bucket -> {"shard": position or None, "file", "rows", "metadata"}
        self.next_file = len(self.index["shards"])

    @property
    def done(self) -> set[str]:
        """The ``source`` of every sample written (as its metadata named it)."""
        return {sample["source"] for sample in self.index["samples"] if "source" in sample}

    @property
    def count(self) -> int:
        """Samples written or waiting to be."""
        return len(self.index["samples"]) + sum(len(p["rows"]) for p in self.pending.values())

    def add(self, latents: torch.Tensor, text: torch.Tensor, text_mask: torch.Tensor | None = None,
            extra: dict[str, torch.Tensor] | None = None, metadata: dict | None = None) -> None:
        """Append one sample (shapes as :func:`write_latent_sample`); ``metadata``: JSON-able facts, ``source``
        naming the item (what :attr:`done` reports)."""
        tensors = {k: v.detach().cpu() for k, v in sample_tensors(latents, text, text_mask, extra).items()}
        key = bucket_key({name: value.shape for name, value in tensors.items()})
        pending = self.pending.get(key) or self._open_bucket(key)
        pending["rows"].append(tensors)
        pending["metadata"].append(json.loads(json.dumps(metadata or {})))
        if "source" in pending["metadata"][-1]:
            self._forget_skip(pending["metadata"][-1]["source"])
        if len(pending["rows"]) == self.shard_size:
            self._write(key)

    def skip(self, source: str, reason: str) -> None:
        """Record that item ``source`` was left out and why (replacing an earlier record of it)."""
        self._forget_skip(source)
        self.index["skipped"].append({"source": source, "reason": reason})

    def close(self) -> None:
        """Write every unfilled shard and the index."""
        for key in list(self.pending):
            self._write(key)
        write_text_atomic(json.dumps(self.index, indent=1), self.directory / INDEX_FILE)

    def __enter__(self) -> ShardWriter:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _forget_skip(self, source: str) -> None:
        self.index["skipped"] = [s for s in self.index["skipped"] if s["source"] != source]

    def _open_bucket(self, key: str) -> dict:
        """The pending shard of bucket ``key``: its unfilled last shard (rows read back) or a new file."""
        for position, shard in enumerate(self.index["shards"]):
            if shard["bucket"] == key and shard["samples"] < self.shard_size:
                stored = read_shard_rows(self.directory / shard["file"], range(shard["samples"]))
                pending = {"shard": position, "file": shard["file"], "rows": stored, "metadata": []}
                break
        else:
            pending = {"shard": None, "file": f"{SHARD_PREFIX}{self.next_file:05d}.safetensors", "rows": [],
                       "metadata": []}
            self.next_file += 1
        self.pending[key] = pending
        return pending

    def _write(self, key: str) -> None:
        pending = self.pending.pop(key)
        rows = pending["rows"]
        path = save_safetensors_atomic({name: torch.stack([row[name] for row in rows]) for name in rows[0]},
                                       self.directory / pending["file"])
        record = {"file": pending["file"], "bucket": key, "samples": len(rows), "bytes": path.stat().st_size}
        if pending["shard"] is None:
            pending["shard"] = len(self.index["shards"])
            self.index["shards"].append(record)
        else:
            self.index["shards"][pending["shard"]] = record
        first = len(rows) - len(pending["metadata"])
        self.index["samples"] += [{"shard": pending["shard"], "row": first + i, **meta}
                                  for i, meta in enumerate(pending["metadata"])]
        write_text_atomic(json.dumps(self.index, indent=1), self.directory / INDEX_FILE)


def _open_safetensors(path: Path):
    """safe_open(path), with a ValueError naming the file when it is empty, truncated or no safetensors file."""
    from safetensors import SafetensorError, safe_open

    try:
        return safe_open(str(path), framework="pt")
    except (SafetensorError, OSError) as error:
        size = path.stat().st_size if path.is_file() else "no"
        raise ValueError(f"{path}: unreadable ({size} bytes; {error}): the file is empty, truncated or corrupt; "
                         f"write it again (sparsevid cache continues a folder whose index no longer lists it)"
                         ) from None


def shard_shapes(path: Path) -> dict[str, tuple[int, ...]]:
    """{tensor name: shape} from the header of the safetensors file ``path`` (ValueError when unreadable)."""
    with _open_safetensors(path) as f:
        return {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}


def read_shard_rows(path: Path, rows: Sequence[int | None]) -> list[dict[str, torch.Tensor]]:
    """Samples ``rows`` of the file ``path`` ({name: tensor} each): row ``j`` of a shard, or the whole file of
    a one-sample file (row None). ValueError naming the file for non-finite latents or text (a corrupt file)."""
    samples = []
    with _open_safetensors(path) as f:
        for row in rows:
            sample = {name: f.get_tensor(name) if row is None else f.get_slice(name)[row] for name in f.keys()}
            for name in (LATENTS, TEXT):
                if name in sample and not torch.isfinite(sample[name]).all():
                    where = "" if row is None else f" row {row}"
                    raise ValueError(f"{path}{where}: non-finite values in {name!r}: the file is corrupt; write "
                                     f"it again")
            samples.append(sample)
    return samples


class BucketOrder:
    """The sample each global index visits, epoch after epoch, for samples sorted into buckets of ``sizes[b]``
    samples each: with one bucket, global index ``i`` is position ``i % n`` of epoch ``i // n``'s permutation;
    with several, each epoch permutes each bucket, cuts it into runs of ``group`` (the last run filled up from
    the start of that permutation) and permutes the runs, so that indices ``k*group ... (k+1)*group - 1`` lie
    in one bucket. Bucket ``b`` is permuted by ``EpochOrder(sizes[b], seed + b)`` (one bucket: exactly
    ``EpochOrder(n, seed)``), the runs by ``EpochOrder(runs, seed + len(sizes))``. Calling it with a global index
    returns (bucket, position in the bucket)."""

    def __init__(self, sizes: Sequence[int], group: int = DEFAULT_GROUP, seed: int = 0):
        if not sizes or any(n < 1 for n in sizes):
            raise ValueError(f"sizes must be a non-empty list of positive counts, got {list(sizes)}")
        if not isinstance(group, int) or group < 1:
            raise ValueError(f"group must be an int >= 1, got {group!r}")
        self.sizes = list(sizes)
        self.group = sizes[0] if len(sizes) == 1 else group
        self.runs = [(b, start) for b, n in enumerate(sizes) for start in range(0, n, self.group)]
        self.epoch_length = len(self.runs) * self.group
        self.within = [EpochOrder(n, seed + b) for b, n in enumerate(sizes)]  # one bucket: EpochOrder(n, seed)
        self.run_order = EpochOrder(len(self.runs), seed + len(sizes))

    def __call__(self, index: int) -> tuple[int, int]:
        epoch, position = divmod(index, self.epoch_length)
        run, offset = divmod(position, self.group)
        bucket, start = self.runs[self.run_order(epoch * len(self.runs) + run)]
        size = self.sizes[bucket]
        return bucket, self.within[bucket](epoch * size + (start + offset) % size)


class LatentDirectory:
    """A folder of samples in either layout of the module docstring, visited in a fresh random order every
    epoch seeded by ``seed`` (:class:`BucketOrder`; ``group``: the run length that keeps batches within one
    bucket when the folder holds several shapes). Opening checks every shard's header and size: an empty,
    truncated or corrupt file is a ValueError naming it."""

    def __init__(self, directory: str | Path, seed: int = 0, group: int = DEFAULT_GROUP):
        self.directory, self.seed = Path(directory), seed
        if not self.directory.is_dir():
            raise FileNotFoundError(f"{self.directory} is not a directory of latent samples")
        self.settings: dict = {}  # what made the shards (the cache's settings: pipeline, family, sizes)
        if (self.directory / INDEX_FILE).is_file():
            self.rows, keys, self.skipped = self._shards()
        else:
            self.rows, keys, self.skipped = self._sample_files()
        if not (self.directory / NULL_FILE).is_file():
            raise ValueError(f"{self.directory / NULL_FILE} not found: the empty prompt's text (caption dropout) is "
                             f"missing; write it with write_null_text")
        self.buckets = sorted(set(keys), key=keys.index)  # in order of first appearance
        self.members = [[s for s, key in enumerate(keys) if key == bucket] for bucket in self.buckets]
        self.shapes = [self._bucket_shapes(bucket) for bucket in self.buckets]
        largest = max(range(len(self.buckets)), key=lambda b: len(self.members[b]))
        self.latent_shape, self.text_shape = self.shapes[largest][LATENTS], self.shapes[largest][TEXT]
        widths = {(shapes[LATENTS][0], shapes[TEXT][-1]) for shapes in self.shapes}
        if len(widths) > 1:
            raise ValueError(f"{self.directory}: samples differ in latent channels or text width "
                             f"({sorted(widths)}): data of two models in one folder")
        self.order = BucketOrder([len(m) for m in self.members], group, seed)

    def _shards(self) -> tuple[list[tuple[Path, int]], list[str], list[dict]]:
        index = read_index(self.directory / INDEX_FILE)
        self.settings = index.get("settings", {})
        for shard in index["shards"]:
            path = self.directory / shard["file"]
            if not path.is_file() or path.stat().st_size != shard["bytes"]:
                size = f"{path.stat().st_size} bytes" if path.is_file() else "missing"
                raise ValueError(f"{path}: {size}, the index says {shard['bytes']} bytes: the shard is truncated "
                                 f"or was replaced; write it again")
            shapes = shard_shapes(path)
            expected = {name: (shard["samples"], *dims) for name, dims in _parse_bucket(shard["bucket"]).items()}
            if shapes != expected:
                raise ValueError(f"{path}: holds {shapes}, the index says {expected}: the shard does not match "
                                 f"its index")
        rows = [(self.directory / index["shards"][s["shard"]]["file"], s["row"]) for s in index["samples"]]
        keys = [index["shards"][s["shard"]]["bucket"] for s in index["samples"]]
        if not rows:
            raise ValueError(f"{self.directory / INDEX_FILE} lists no samples"
                             + (f" ({len(index['skipped'])} skipped)" if index["skipped"] else ""))
        return rows, keys, index["skipped"]

    def _sample_files(self) -> tuple[list[tuple[Path, None]], list[str], list[dict]]:
        files = sorted(self.directory.glob(f"{SAMPLE_PREFIX}*.safetensors"))
        if not files:
            raise ValueError(f"{self.directory} holds no {SAMPLE_PREFIX}*.safetensors samples and no {INDEX_FILE}")
        return [(path, None) for path in files], [bucket_key(shard_shapes(path)) for path in files], []

    def _bucket_shapes(self, bucket: str) -> dict[str, tuple[int, ...]]:
        shapes = _parse_bucket(bucket)
        if LATENTS not in shapes or TEXT not in shapes or len(shapes[LATENTS]) != 4 or len(shapes[TEXT]) != 2:
            raise ValueError(f"{self.directory}: samples of shapes {shapes} lack latents [C, T, H, W] or "
                             f"text [L, D]")
        return shapes

    def __len__(self) -> int:
        return len(self.rows)

    def sample(self, index: int) -> int:
        """The sample (0 ... len - 1, in the index's or the files' order) that global index ``index`` reads."""
        bucket, position = self.order(index)
        return self.members[bucket][position]

    def file(self, index: int) -> Path:
        """The file that global sample ``index`` reads."""
        return self.rows[self.sample(index)][0]

    def batch(self, indices: Sequence[int], device: torch.device | str = "cpu") -> LatentBatch:
        check_indices(indices)
        visits = [self.order(index) for index in indices]
        chosen = [self.members[bucket][position] for bucket, position in visits]
        buckets = {bucket for bucket, _ in visits}
        if len(buckets) > 1:
            raise ValueError(f"indices {indices[0]}...{indices[-1]} fall in {len(buckets)} buckets of different "
                             f"shapes ({', '.join(self.buckets[b] for b in sorted(buckets))}); a batch must lie in "
                             f"one aligned run of group={self.order.group} indices: make the batch size divide it")
        by_file: dict[Path, list[int]] = {}
        for sample in chosen:
            by_file.setdefault(self.rows[sample][0], []).append(sample)
        read = {}
        for path, samples in by_file.items():
            read.update(zip(samples, read_shard_rows(path, [self.rows[s][1] for s in samples])))
        samples = [read[s] for s in chosen]
        stack = lambda key: torch.stack([s[key] for s in samples]) if key in samples[0] else None  # noqa: E731
        extra = {key[len(EXTRA):]: stack(key) for key in samples[0] if key.startswith(EXTRA)}
        return LatentBatch(stack(LATENTS).float(), stack(TEXT), stack(TEXT_MASK), extra).to(device)

    def null_text(self) -> tuple:
        """(text [L, D], text_mask [L] or None), and {name: tensor} when the empty prompt has extra inputs."""
        (null,) = read_shard_rows(self.directory / NULL_FILE, [None])
        extra = {key[len(EXTRA):]: value for key, value in null.items() if key.startswith(EXTRA)}
        return (null[TEXT], null.get(TEXT_MASK)) + ((extra,) if extra else ())

    def describe(self) -> dict:
        info = {"kind": "latent_directory", "directory": str(self.directory), "samples": len(self.rows),
                "latent_shape": list(self.latent_shape), "text_shape": list(self.text_shape), "seed": self.seed}
        if len(self.buckets) > 1:
            info.update(buckets={b: len(m) for b, m in zip(self.buckets, self.members)}, group=self.order.group)
        return info


def _parse_bucket(bucket: str) -> dict[str, tuple[int, ...]]:
    """The shapes :func:`bucket_key` wrote into ``bucket``."""
    shapes = {}
    for part in bucket.split(";"):
        name, _, dims = part.partition(":")
        shapes[name] = tuple(int(n) for n in dims.split("x")) if dims else ()
    return shapes
