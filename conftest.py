"""Shared test set-up. Without CUDA, Triton kernels run on the CPU through Triton's interpreter, switched
on here before any kernel module is imported, and tests marked ``gpu`` are skipped."""
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture
def nan_poisoned_outputs(monkeypatch):
    """Every output the attention kernels write (the tile-mass scratch too) starts as NaN (integers: their
    minimum), so an element they fail to write, or a slot read before it was written, shows up."""
    from sparsevid.ops import triton_attention

    original = triton_attention._alloc
    monkeypatch.setattr(triton_attention, "_alloc", lambda *a, **kw: _poison(original(*a, **kw)))


@pytest.fixture
def free_port() -> int:
    """A TCP port on 127.0.0.1 free at the time of asking, for a process group's rendezvous."""
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.fixture
def torchrun(free_port):
    """``torchrun(args, cwd, timeout=300)``: ``python -m torch.distributed.run --nproc-per-node 2`` on a free
    port with ``args`` (one thread per process), as a CompletedProcess with text output. Past ``timeout`` seconds
    the launcher is stopped with its workers (SIGTERM, which it forwards to them; SIGKILL if it lingers), so that
    no orphaned worker slows the tests after, and the test fails with the end of what they printed."""
    import signal
    import subprocess
    import sys

    def run(args: list[str], cwd, timeout: float = 300) -> subprocess.CompletedProcess:
        command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
                   str(free_port), *args]
        launcher = subprocess.Popen(command, env={**os.environ, "OMP_NUM_THREADS": "1"}, cwd=cwd, text=True,
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        try:
            stdout, stderr = launcher.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            launcher.send_signal(signal.SIGTERM)
            try:
                stdout, stderr = launcher.communicate(timeout=60)
            except subprocess.TimeoutExpired:
                launcher.kill()
                stdout, stderr = launcher.communicate()
            pytest.fail(f"{' '.join(command)} did not finish in {timeout} s; its output ends:\n{stdout[-1000:]}\n"
                        f"{stderr[-3000:]}")
        return subprocess.CompletedProcess(command, launcher.returncode, stdout, stderr)

    return run


def _poison(t: torch.Tensor) -> torch.Tensor:
    """NaN, or for integer tensors their smallest value (which no quantizer writes: int8 spans [-127, 127])."""
    return t.fill_(float("nan") if t.is_floating_point() else torch.iinfo(t.dtype).min)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)
