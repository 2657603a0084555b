"""A cache that ``torch.compile`` traces through: small tensors built from sizes alone (token permutations, the
all-kept mask) are made once per key in eager code and shared, and computed in the graph while dynamo traces
(a cache lookup the compiled code would skip is not consulted, and nothing is read on the host, so CUDA graphs
can capture the result)."""
from __future__ import annotations

import functools

import torch


def traceable_cache(maxsize: int = 64):
    """Decorator: ``fn`` memoised by ``functools.lru_cache(maxsize)`` (hashable arguments) in eager code,
    called afresh while ``torch.compile`` traces. Cached results are shared: treat them as read-only."""

    def wrap(fn):
        cached = functools.lru_cache(maxsize=maxsize)(fn)

        @functools.wraps(fn)
        def call(*args, **kwargs):
            if torch.compiler.is_compiling():
                return fn(*args, **kwargs)
            return cached(*args, **kwargs)

        return call

    return wrap
