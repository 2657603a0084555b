"""Launching autotuned Triton kernels with little host time per call.

``kernel[grid](...)`` on a ``triton.autotune`` kernel looks its config up on every call: it names every
argument, filters them, builds the tuning key with the dtype of each tensor argument and merges the config's
arguments, all host time on every launch (``benchmarks/NOTES.md``, "Runtime host time", has the figures).
:func:`launch_tuned` asks the autotuner once per call-site key and then launches the kernel underneath with
the config it chose.
"""
from __future__ import annotations

import os

import triton

# TRITON_INTERPRET=1 (read when this module is first imported): the kernels run on the CPU in Triton's
# interpreter, with one candidate config each.
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
# SPARSEVID_AUTOTUNE=off: one fixed config per kernel instead of tuning (fast start-up, e.g. for tests).
AUTOTUNE = os.environ.get("SPARSEVID_AUTOTUNE", "on") != "off"

# (kernel, caller's key, constexpr arguments) -> (the config, its launch arguments)
_CHOSEN: dict[tuple, tuple[triton.Config, dict]] = {}


def launch_tuned(kernel, grid, key: tuple, *args, **meta) -> triton.Config:
    """Launch the autotuned ``kernel`` on ``grid`` with ``args`` and the constexpr arguments ``meta``; returns the
    config it ran with.

    key: hashable values that, together with ``meta``, fix the autotuner's own key (its ``key`` arguments that
    are not in ``meta``, the dtypes of the tensor arguments, the device). The first call with a new key goes
    through the autotuner (tuning if needed); later calls launch ``kernel.fn`` with the config it chose, running
    the config's pre-hook (e.g. the tensor-descriptor boxes) as the autotuner would.
    """
    lookup = (kernel, key, tuple(meta.items()))
    chosen = _CHOSEN.get(lookup)
    if chosen is None:
        kernel[grid](*args, **meta)
        config = kernel.best_config
        _CHOSEN[lookup] = (config, config.all_kwargs())
        return config
    config, config_args = chosen
    if config.pre_hook is not None:
        config.pre_hook({**dict(zip(kernel.arg_names, args)), **meta, **config_args})
    kernel.fn[grid](*args, **meta, **config_args)
    return config
