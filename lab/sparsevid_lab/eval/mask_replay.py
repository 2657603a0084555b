"""Masks recorded from one sampling run and replayed in another: what a change of the attention's arithmetic
(a quantized precision, another backend) does to the sampled clips with every layer's mask held as the native run
chose it, apart from what it does by flipping tiles near a row's threshold (the masks are predicted from each layer's
own q and k, which any change in the layers before perturbs)."""
from __future__ import annotations

import contextlib
from typing import Iterator
from unittest import mock

from sparsevid.plan.runtime import LayerRuntime


@contextlib.contextmanager
def recording_masks() -> Iterator[list]:
    """Yields a list to which, while active, every sparse self-attention call's mask (a
    :class:`~sparsevid.SparseMask`) is appended, in call order."""
    predict = LayerRuntime.mask
    masks = []

    def mask(runtime, q, k, scale, heads=None):
        masks.append(predict(runtime, q, k, scale, heads))
        return masks[-1]

    with mock.patch.object(LayerRuntime, "mask", mask):
        yield masks


@contextlib.contextmanager
def replaying_masks(masks: list) -> Iterator[None]:
    """While active, sparse self-attention calls take the masks of ``masks`` in order instead of predicting their
    own. A call of other token counts than its recorded mask's, or one more than recorded, raises ValueError (the
    replaying run must make the recording run's calls), as does leaving with recorded masks unused."""
    calls = iter(enumerate(masks))

    def mask(runtime, q, k, scale, heads=None):
        index, recorded = next(calls, (len(masks), None))
        if recorded is None:
            raise ValueError(f"mask replay: call {index} has no recorded mask ({len(masks)} recorded)")
        if (recorded.q_len, recorded.kv_len) != (q.shape[2], k.shape[2]):
            raise ValueError(f"mask replay: call {index} has q {tuple(q.shape)}, k {tuple(k.shape)}; the recorded "
                             f"mask is for {recorded.q_len} x {recorded.kv_len} tokens")
        return recorded

    with mock.patch.object(LayerRuntime, "mask", mask):
        yield
    left = sum(1 for _ in calls)
    if left:
        raise ValueError(f"mask replay: {left} of {len(masks)} recorded masks were not used")
