"""Attention recorded during the built-in model's dense generation: the oracle study of a whole generation and
the (q, k) pairs that calibrate rule settings (:mod:`sparsevid.eval.calibrate`)."""
from __future__ import annotations

import math
from typing import Callable, Sequence

import torch

from sparsevid import is_sparse
from sparsevid.eval import ORACLE_SPARSITIES, OracleStudy, calibrate_rules, check_targets
from sparsevid.integration import SDPAInterceptor, tile_order

from ..model.sampling import generate
from .harness import SelfAttentionProbe, resolve_probe_steps, video_token_grid


class VideoAttentionRecorder:
    """SDPA handler that keeps q, k [B, H, N, D] of video self-attention calls, in 3D-tile order, at given steps."""

    def __init__(self, grid: tuple[int, int, int], steps: Sequence[int]):
        self.grid, self.steps, self.step = grid, set(steps), 0
        self.calls: list[tuple[torch.Tensor, torch.Tensor]] = []

    def on_step(self, i: int, t: float) -> None:
        self.step = i

    def __call__(self, query, key, value, **kwargs):
        if self.step in self.steps and query.shape[2] == key.shape[2] == math.prod(self.grid):
            perm = tile_order(self.grid, "auto", query.device).perm
            self.calls.append((query.index_select(2, perm), key.index_select(2, perm)))
        return torch.nn.functional.scaled_dot_product_attention(query, key, value, **kwargs)


def record_video_attention(model, caption: str, seed: int, steps: int | None = None, guidance: float | None = None,
                           probe_steps: Sequence[int] | None = None) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(q, k) of every video self-attention of ``model``'s dense generation of ``caption`` at ``probe_steps``
    (default first, middle, last), in 3D-tile order."""
    steps = model.config["sampling"]["steps"] if steps is None else steps
    probe_steps = resolve_probe_steps(steps, probe_steps)
    grid = video_token_grid(model)
    recorder = VideoAttentionRecorder(grid, probe_steps)
    with SDPAInterceptor(recorder):
        generate(model, [caption], [seed], steps=steps, guidance=guidance, on_step=recorder.on_step)
    return recorder.calls



def oracle_study_of_model(model, captions: Sequence[str], seeds: Sequence[int], steps: int | None = None,
                          guidance: float | None = None, probe_steps: Sequence[int] | None = None,
                          sparsities: Sequence[float] = ORACLE_SPARSITIES, configs: dict | None = None,
                          on_probe: Callable[[], None] | None = None, **study_options) -> dict:
    """:meth:`OracleStudy.summary` over the dense generation of every (caption, seed) pair by ``model`` (a dense
    :class:`~sparsevid_lab.model.builtin.BuiltinVideoDiT`), probing its video self-attentions at ``probe_steps``
    (default: first, middle, last). ``on_probe()`` is called after each probed step of each clip. ``study_options``:
    further :class:`OracleStudy` fields (tile, block_q, block_k, backend)."""
    if is_sparse(model.transformer):
        raise ValueError("model must run dense attention (remove its sparse attention first)")
    if len(captions) != len(seeds) or not captions:
        raise ValueError(f"captions ({len(captions)}) and seeds ({len(seeds)}) must be non-empty and of equal length")
    steps = model.config["sampling"]["steps"] if steps is None else steps
    probe_steps = resolve_probe_steps(steps, probe_steps)
    grid = video_token_grid(model)
    study = OracleStudy(sparsities, dict(configs or {}), grid, **study_options)
    for caption, seed in zip(captions, seeds):
        probe = SelfAttentionProbe({}, {}, grid, probe_steps, on_attention=study.add, on_probe=on_probe)
        with SDPAInterceptor(probe):
            generate(model, [caption], [seed], steps=steps, guidance=guidance, on_step=probe.on_step)
        probe.finish()
    return study.summary()


def rules_at_sparsity(model, targets: Sequence[float], caption: str, seed: int = 0, steps: int | None = None,
                      guidance: float | None = None, block_q: int = 128, block_k: int = 64) -> dict:
    """:func:`calibrate_rules` on ``model``'s attention for ``caption`` and ``seed`` (one dense generation; the
    targets are checked before it runs)."""
    check_targets(targets)
    calls = record_video_attention(model, caption, seed, steps, guidance)
    return calibrate_rules(calls, targets, block_q, block_k)
