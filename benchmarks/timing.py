"""The one timer the benchmarks share for GPU kernels and their CPU smoke runs."""
from __future__ import annotations

import statistics
import time


def median_ms(fn, device, reps: int = 3, rep_ms: int = 100, grad_to_none=None) -> float:
    """Median time of ``fn()`` in ms: on CUDA ``triton.testing.do_bench`` (25 ms warm-up, ``rep_ms`` of
    repetitions, L2 flushed between them, the ``.grad`` of the ``grad_to_none`` tensors reset before each);
    elsewhere ``time.perf_counter`` over ``reps`` calls after one."""
    if device.type == "cuda":
        import triton

        return float(triton.testing.do_bench(fn, warmup=25, rep=rep_ms, grad_to_none=grad_to_none,
                                             return_mode="median"))
    fn()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def cuda_kernel_ms(fn, calls: int = 5) -> dict[str, float]:
    """GPU time per call of each kernel ``fn()`` launches, in ms (torch.profiler over ``calls`` calls after one
    warm-up call): which kernels a timing is made of."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    return {event.key: event.device_time_total / 1e3 / calls for event in prof.key_averages()
            if event.device_time_total > 0}


def flushed_ms(fn, clean: bool, calls: int = 100) -> float:
    """Median CUDA-event time of ``fn()`` in ms, each call after an L2 flush by zeroing a 256 MB buffer (as
    ``triton.testing.do_bench`` flushes). The zeroing leaves the L2 full of dirty lines, which the timed call
    pays to write back as it evicts them; with ``clean`` the buffer is read once more before the timing starts,
    so that the write-back happens outside it and the call starts from a clean L2. A GPU spin of ~1 ms before
    each call lets the host queue the whole call before the GPU reaches it, so that the time is the device's
    even where launching takes the host longer than the kernels take the GPU."""
    import torch

    flush = torch.empty(256 * 2**20, dtype=torch.int8, device="cuda")
    fn()
    torch.cuda.synchronize()
    events = []
    for _ in range(calls):
        flush.zero_()
        if clean:
            flush.sum(dtype=torch.int32)
        torch.cuda._sleep(2_000_000)  # clock cycles
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        events.append((start, end))
    torch.cuda.synchronize()
    return statistics.median(start.elapsed_time(end) for start, end in events)
