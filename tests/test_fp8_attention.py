"""precision="fp8": the scaling math, the PyTorch emulation against float64, the Triton kernel under the
interpreter, and the clear errors (CPU; the GPU checks are in test_attention_gpu.py).

Error budget. Rounding to e4m3 (3 mantissa bits, round to nearest) moves an element by at most 2^-4 of its
magnitude; on Gaussian data the measured relative error of one rounded tensor, eps = ||deq(x8) - x|| / ||x||,
is about 0.026. FP8 attention rounds four operands (Q and K enter the logits, V and P the output): on random
data, where the output is itself noise and nothing averages out, its error is about 2 eps; the emulation must
stay within 3 eps of float64.
"""
from __future__ import annotations

import pytest
import torch

import sparsevid as sv
from sparsevid.ops import fp8, fp8_reference
from sparsevid.ops.triton_launch import INTERPRET
from oracles import ATTENTION_SHAPES, rel_err

FP8_SHAPES = [p for p in ATTENTION_SHAPES if p.values[0][4] >= fp8.MIN_FP8_HEAD_DIM and p.values[0][4] % 16 == 0]


def _inputs(b, h, n, m, d, outlier: bool = False):
    generator = torch.Generator().manual_seed(0)  # fixed draws: the budgets are checked on these
    q, k, v = (torch.randn(b, h, t, d, dtype=torch.float32, generator=generator) for t in (n, m, m))
    if outlier:  # video DiTs: a few channels of K carry a large offset shared by all tokens, V a large range
        k[..., :3] += 20.0
        v[..., 5] *= 30.0
    return q, k, v


def _mask(b, h, n, m, block_q, block_k, kind="random"):
    qb, kb = -(-n // block_q), -(-m // block_k)
    if kind == "full":
        return sv.SparseMask.full(n, m, block_q, block_k)
    keep = torch.rand(b, h, qb, kb, generator=torch.Generator().manual_seed(0)) < 0.5
    keep[..., 0, :] = False  # an empty row of blocks
    return sv.SparseMask.from_dense(keep, n, m, block_q, block_k)


def test_smoothing_is_exact_for_softmax():
    """Subtracting K's token mean shifts each row's logits by scale * q . mean: out is unchanged and the
    log-sum-exp moves by exactly that shift (float64)."""
    q, k, v = (t.double() for t in _inputs(1, 2, 200, 333, 64))
    mask = _mask(1, 2, 200, 333, 128, 64)
    scale = 64 ** -0.5
    mean = k.mean(dim=2, keepdim=True)
    out, lse = sv.block_sparse_attention(q, k, v, mask, return_lse=True, backend="reference")
    out_s, lse_s = sv.block_sparse_attention(q, k - mean, v, mask, return_lse=True, backend="reference")
    assert rel_err(out_s, out) < 1e-12
    assert rel_err(lse_s + scale * (q @ mean.transpose(-1, -2)).squeeze(-1), lse) < 1e-12


def test_scale_is_the_smallest_power_of_two_in_range():
    amax = torch.cat([torch.rand(10000) * 10.0 ** torch.randint(-30, 30, (10000,)),
                      torch.tensor([448.0, 449.0, 1.0, 224.0, 1e-40, float("inf")])])
    scale = fp8.scale_from_amax(amax)
    mantissa, _ = torch.frexp(scale.double())
    assert (mantissa == 0.5).all()  # powers of two
    finite = amax < 1e37
    assert (amax / scale <= 448)[finite].all() and (amax / (scale / 2) > 448)[finite & (amax > 1e-35)].all()
    assert scale[-6:-1].tolist() == [1.0, 2.0, 2.0 ** -8, 0.5, 2.0 ** -126]
    assert fp8.scale_from_amax(torch.zeros(3)).tolist() == [1.0, 1.0, 1.0]


def test_scales_and_rounding():
    """q/k scales are the power-of-two scales of each block of block_q/block_k tokens (per head), v's of each
    channel over all tokens; every k and v element rounds to within half an e4m3 step (2^-4 relative, or half
    the smallest subnormal 2^-10 times the scale); q's two terms to within half a step of the residual (2^-8
    relative, the residual being at most 2^-4 of the element up to that rounding, or 2^-10 times the scale)."""
    b, h, n, m, d, block_q, block_k = 2, 3, 333, 200, 64, 128, 64
    q, k, v = _inputs(b, h, n, m, d, outlier=True)
    x = fp8_reference.quantize_fp8(q, k, v, block_q, block_k)
    k_mean = k.mean(dim=2)
    assert torch.allclose(x.k_mean, k_mean)
    ks = k - k_mean[:, :, None]
    scale = fp8.scale_from_amax
    assert torch.equal(x.q_scale[:, :, 1], scale(q[:, :, 128:256].abs().amax(dim=(-2, -1))))
    assert torch.equal(x.q_scale[:, :, 2], scale(q[:, :, 256:].abs().amax(dim=(-2, -1))))  # the short last block
    assert torch.allclose(x.k_scale[:, :, 3], scale(ks[:, :, 192:].abs().amax(dim=(-2, -1))))
    assert torch.equal(x.v_scale, scale(v.abs().amax(dim=2)))
    dq, dk, dv = fp8_reference.dequantize_fp8(x, block_q, block_k)
    q_step = 2.0 ** -8 / (1 - 2.0 ** -4)
    for deq, ref, scale, step in ((dq, q, x.q_scale.repeat_interleave(block_q, 2)[:, :, :n, None], q_step),
                                  (dk, ks, x.k_scale.repeat_interleave(block_k, 2)[:, :, :m, None], 2.0 ** -4),
                                  (dv, v, x.v_scale[:, :, None], 2.0 ** -4)):
        bound = torch.maximum(ref.abs() * step, scale * 2.0 ** -10)
        assert ((deq - ref.double()).abs() <= bound * (1 + 1e-6)).all()
        assert (deq.abs() <= scale.double() * (448 + 16)).all()  # (448 + a residual of at most half its step)
        assert (deq.abs().amax(dim=-1) > scale.double()[..., 0] * 224).any()  # the range is used


def test_all_zero_block_gets_unit_scale():
    q, k, v = _inputs(1, 1, 256, 128, 32)
    q[:, :, :128] = 0
    x = fp8_reference.quantize_fp8(q, k, v, 128, 64)
    assert x.q_scale[0, 0, 0] == 1 and torch.equal(x.q8[:, :, :128].float(), torch.zeros(1, 1, 128, 32))


@pytest.mark.parametrize("outlier", [False, True], ids=["gaussian", "outlier-channels"])
@pytest.mark.parametrize("shape", FP8_SHAPES)
def test_emulation_within_fp8_budget_of_float64(shape, outlier):
    b, h, n, m, d, block_q, block_k = shape
    q, k, v = _inputs(b, h, n, m, d, outlier)
    mask = _mask(b, h, n, m, block_q, block_k)
    out, lse = sv.block_sparse_attention(q, k, v, mask, return_lse=True, precision="fp8")  # auto: reference
    ref, ref_lse = sv.block_sparse_attention(q.double(), k.double(), v.double(), mask, return_lse=True,
                                             backend="reference")
    x = fp8_reference.quantize_fp8(q, k, v, block_q, block_k)
    eps = rel_err(x.v8.double() * x.v_scale[:, :, None], v)  # one tensor's rounding error
    assert 0.01 < eps < 0.04
    assert out.dtype == q.dtype and lse.dtype == torch.float32
    assert rel_err(out, ref) <= 3 * eps
    # lse = log-sum-exp of the smoothed logits + scale * q . k_mean; with outlier channels the second term is a
    # sum of a few q elements times K's large means, off by up to q's half-step, 2^-4 of each
    assert rel_err(lse, ref_lse) <= (2.0 ** -4 if outlier else eps)
    empty = ~mask.keep.any(-1).repeat_interleave(block_q, -1)[..., :n].expand(b, h, n)
    assert torch.equal(out[empty], torch.zeros_like(out[empty])) and (lse[empty] == float("-inf")).all()


def test_full_mask_emulation_against_dense():
    b, h, n, d = 1, 2, 300, 64
    q, k, v = _inputs(b, h, n, n, d)
    mask = _mask(b, h, n, n, 128, 64, "full")
    out = sv.block_sparse_attention(q, k, v, mask, precision="fp8", backend="reference")
    dense = torch.nn.functional.scaled_dot_product_attention(q.double(), k.double(), v.double())
    assert rel_err(out, dense) <= 0.08


@pytest.mark.parametrize("tma", ["all", "none"])
@pytest.mark.parametrize("shape", FP8_SHAPES)
def test_triton_kernel_interpreted_against_emulation(shape, tma, nan_poisoned_outputs, monkeypatch):
    """The kernel on quantized inputs from the PyTorch quantizer (V moved to the tokens-contiguous layout):
    its lse depends on the logits only, which match the emulation's up to fp32 rounding. Its output also
    rounds P to fp8, which the interpreter does wrongly (a value rounding up to a power of two loses the carry,
    127.2 -> 64): within 2x of the emulation's error there, exact on the GPU (test_attention_gpu.py)."""
    from sparsevid.ops import triton_attention, triton_fp8_attention

    monkeypatch.setattr(triton_attention, "TMA", triton_attention.tma_kernels(tma))  # descriptors or pointers
    b, h, n, m, d, block_q, block_k = shape
    q, k, v = _inputs(b, h, n, m, d)
    mask = _mask(b, h, n, m, block_q, block_k)
    x = fp8_reference.quantize_fp8(q, k, v, block_q, block_k)
    x = x._replace(v8=x.v8.transpose(-1, -2).contiguous().transpose(-1, -2))
    out, lse = triton_fp8_attention.fp8_forward(x, mask.kv_count, mask.kv_index, block_q, block_k, d ** -0.5, q)
    emu, emu_lse = fp8_reference.emulate_fp8_attention(x, mask, d ** -0.5)
    ref = sv.block_sparse_attention(q.double(), k.double(), v.double(), mask, backend="reference")
    assert rel_err(lse, emu_lse) < 1e-5
    assert rel_err(out, ref) <= 2 * rel_err(emu, ref)


@pytest.mark.skipif(not INTERPRET, reason="the interpreter's fp8 cast")
def test_triton_quantizer_interpreted_matches_pytorch():
    """The two-launch Triton quantizer (several programs per head, each over several blocks): K's mean within
    float32 summation error of torch's; given that mean, every scale equal; fp8 values equal except a few (< 5%)
    where the interpreter's cast rounds otherwise (it drops the carry into the exponent, 127.2 -> 64, rounds
    ties away from zero and the smallest subnormal to 0; bit for bit on the GPU: test_attention_gpu.py): none of
    those moves by more than its own size. A NaN in V leaves its channel's scale alone."""
    from sparsevid.ops import triton_fp8_attention

    q, k, v = _inputs(2, 2, 333, 200, 64, outlier=True)
    v[1, 0, 17, 9] = float("nan")
    fast = triton_fp8_attention.quantize(q, k, v, 128, 64)
    assert (fast.k_mean - k.double().mean(dim=2)).abs().max() <= 200 * 2.0 ** -24 * k.abs().max()
    ref = fp8_reference.quantize_fp8(q, k, v, 128, 64, k_mean=fast.k_mean)
    for name in ("q_scale", "k_scale", "v_scale", "k_mean"):
        assert torch.equal(getattr(fast, name), getattr(ref, name)), name
    assert torch.isfinite(fast.v_scale).all() and torch.isnan(ref.v8[1, 0, 17, 9].float())
    for a, r in ((fast.q8, ref.q8), (fast.k8, ref.k8), (fast.v8, ref.v8)):
        a, r = a.float().masked_fill(r.float().isnan(), 0), r.float().nan_to_num()  # (the interpreter drops NaN)
        assert (a != r).float().mean() < 0.05
        assert ((a - r).abs() <= r.abs()).all()
    same_hi = fast.q8.float() == ref.q8.float()  # Q's residual: where the interpreter rounded the first term alike
    assert (fast.q8_lo.float() != ref.q8_lo.float())[same_hi].float().mean() < 0.05


@pytest.mark.skipif(not INTERPRET, reason="the interpreted Triton quantizer")
def test_triton_statistics_reduce_more_chunks_than_one_step():
    """K's mean and V's scales when a head has more 256-token chunks than the last program reduces in one step
    (34 > 32): the partials of every chunk counted once."""
    from sparsevid.ops import triton_fp8_attention

    q, k, v = _inputs(1, 2, 64, 8500, 32, outlier=True)
    v[0, 1, 8450, 3] = 1e4  # in the last chunk
    fast = triton_fp8_attention.quantize(q, k, v, 64, 64)
    assert (fast.k_mean - k.double().mean(dim=2)).abs().max() <= 8500 * 2.0 ** -24 * k.abs().max()
    assert torch.equal(fast.v_scale, fp8.scale_from_amax(v.abs().amax(dim=2)))


def test_errors_name_the_requirement():
    q, k, v = _inputs(1, 2, 200, 200, 64)
    mask = _mask(1, 2, 200, 200, 128, 64)
    with pytest.raises(ValueError, match="precision must be one of"):
        sv.block_sparse_attention(q, k, v, mask, precision="fp16")
    with pytest.raises(ValueError, match="backends"):
        sv.block_sparse_attention(q, k, v, mask, precision="fp8", backend="gather")
    with pytest.raises(ValueError, match="return_tile_mass=True needs precision='native'"):
        sv.block_sparse_attention(q, k, v, mask, precision="fp8", return_tile_mass=True)
    with pytest.raises(ValueError, match="multiple of 16"):
        sv.block_sparse_attention(q[..., :40], k[..., :40], v[..., :40], mask, precision="fp8")
    q.requires_grad_()
    with pytest.raises(ValueError, match="no backward"):
        sv.block_sparse_attention(q, k, v, mask, precision="fp8")
    with torch.no_grad():
        assert sv.block_sparse_attention(q, k, v, mask, precision="fp8").shape == q.shape


def test_old_gpu_refused_by_name(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100")
    fake = torch.empty(1, 1, 1, 64, device="meta")
    monkeypatch.setattr(type(fake), "is_cuda", property(lambda self: True))
    with pytest.raises(ValueError, match=r"compute capability >= 8\.9.*A100 has 8\.0"):
        fp8.check_fp8_device(fake)


@pytest.mark.parametrize("precision", ["fp8", "int8"])
def test_triton_quantized_traces_under_torch_compile(precision):
    """Under torch.compile the Triton path of a quantized precision is the custom op
    torch.ops.sparsevid.block_sparse_attn_quantized (its fake gives the shapes); the compiled call returns what the
    eager one does."""
    q, k, v = _inputs(1, 2, 200, 333, 64)
    mask = _mask(1, 2, 200, 333, 128, 64)

    def attend(q, k, v):
        return sv.block_sparse_attention(q, k, v, mask, return_lse=True, backend="triton", precision=precision)

    graphs = []

    def record(graph, example_inputs):
        graphs.append(graph)
        return graph.forward

    out, lse = torch.compile(attend, backend=record, fullgraph=True)(q, k, v)
    eager_out, eager_lse = attend(q, k, v)
    assert torch.equal(out, eager_out) and torch.equal(lse, eager_lse)
    targets = [node.target for node in graphs[0].graph.nodes if node.op == "call_function"]
    assert torch.ops.sparsevid.block_sparse_attn_quantized.default in targets
