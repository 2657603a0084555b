"""The built-in model's held-out (clip, noise, t) triples and its velocity on them, through the library's
yardsticks (:mod:`sparsevid.eval.velocity`): clip ``i`` is procedural clip ``i`` of the model's own data
generator (``model.data``, so a model trained on textured or panning backgrounds is evaluated on them), seeded
far from the seeds training uses; its caption becomes text states through the model's caption encoder.
"""
from __future__ import annotations

import contextlib
from typing import Callable

import torch

from sparsevid.eval import HELDOUT_SEED, HeldOutSet
from sparsevid.eval import heldout_set as latent_heldout_set
from sparsevid.eval import predict_velocities as transformer_velocities
from sparsevid.eval import velocity_error
from sparsevid.integration import attention_records, is_sparse, set_collect_stats

from ..data.sources import ProceduralSource
from ..model.builtin import CaptionedClips


def heldout_set(model, data=None, per_bin: int = 8, num_bins: int = 5, seed: int = HELDOUT_SEED,
                exclude=None) -> HeldOutSet:
    """``per_bin * num_bins`` triples of procedural clips from ``data`` (a ProceduralVideos; default the model's
    own), captioned through ``model``'s caption encoder. ``exclude`` (e.g. a fine-tuning slice, a
    ProceduralVideos): skip the clips whose caption it could draw (``exclude.fits``); triples keep the index of
    their clip, so the set without ``exclude`` is unchanged."""
    clips = ProceduralSource(model.data if data is None else data, seed=seed)
    indices = None if exclude is None else _indices_outside(clips, exclude, per_bin * num_bins)
    return latent_heldout_set(CaptionedClips(model, clips), per_bin, num_bins, seed, indices)


def _indices_outside(source: ProceduralSource, exclude, count: int) -> list[int]:
    """The first ``count`` clip indices of ``source`` whose caption ``exclude`` cannot draw."""
    indices, start = [], 0
    while len(indices) < count:
        if start > 1000 * count:
            raise ValueError("exclude could draw (nearly) every caption of data: no held-out clips left")
        batch = list(range(start, start + 4 * count))
        indices += [i for i, c in zip(batch, source.captions(batch)) if not exclude.fits(c)]
        start += len(batch)
    return indices[:count]


def sampler_steps(model, t: torch.Tensor) -> list[int]:
    """For noise levels ``t`` [n], the step of the model's default sampler whose noise level is nearest each
    (the step a sparse configuration's schedule sees at that noise level)."""
    from ..model.sampling import make_scheduler

    sampling = model.config["sampling"]
    scheduler = make_scheduler(sampling.get("scheduler", "euler"), sampling["shift"])
    scheduler.set_timesteps(sampling["steps"])
    levels = scheduler.timesteps.double().cpu() / 1000.0
    return (levels.view(1, -1) - t.double().view(-1, 1)).abs().argmin(dim=1).tolist()


def predict_velocities(model, heldout: HeldOutSet, config=None, batch_size: int = 8,
                       on_batch: Callable[[], None] | None = None) -> torch.Tensor:
    """The model's velocity on every triple, float32 [n, 3, T, H, W] on the CPU: with ``config`` (a SparseConfig)
    each forward pinned to the sampler step nearest its noise level (:func:`sampler_steps`), so dense steps and
    schedules act as in sampling."""
    steps = None if config is None else sampler_steps(model, heldout.t)
    return transformer_velocities(model.transformer, heldout, config, steps, batch_size, on_batch)


@contextlib.contextmanager
def achieved_sparsity(transformer: torch.nn.Module):
    """Within the block, every sparse forward of ``transformer`` records its self-attention calls' sparsity (stats
    switched on as each forward begins); yields a function giving their mean so far (dense calls count 0), None
    before any sparse forward."""
    values: list[float] = []

    def begin(module, args):
        if is_sparse(module):
            set_collect_stats(module, True)

    def end(module, args, output):
        if is_sparse(module):
            values.extend(record.as_dict()["sparsity"] for record in attention_records(module))

    hooks = [transformer.register_forward_pre_hook(begin, prepend=True), transformer.register_forward_hook(end)]
    try:
        yield lambda: sum(values) / len(values) if values else None
    finally:
        for hook in hooks:
            hook.remove()


def sparse_velocity_errors(model, heldout: HeldOutSet, configs: dict) -> dict:
    """{label: {"velocity_error", "velocity_error_per_bin", "sparsity"}} of each SparseConfig of ``configs`` on
    ``heldout`` against the dense model (:func:`predict_velocities`, ``velocity_error``); "sparsity": the mean
    achieved over the self-attention calls of those forwards."""
    dense = predict_velocities(model, heldout)
    errors = {}
    for label, config in configs.items():
        with achieved_sparsity(model.transformer) as sparsity:
            error = velocity_error(predict_velocities(model, heldout, config), dense, heldout)
        errors[label] = {"velocity_error": error["overall"], "velocity_error_per_bin": error["per_bin"],
                         "sparsity": sparsity()}
    return errors
