"""predict_mask end to end: the Triton kernels (interpreter on the CPU) against the PyTorch path,
pooling against float64 brute force, stats, and input checks."""
from __future__ import annotations

import math
import warnings

import pytest
import torch

import sparsevid as sv
from sparsevid.ops import triton_predict
from sparsevid.ops.mask import kept_index_table
from sparsevid.ops.pooling import block_similarity, pool_blocks, pooled_scores
from sparsevid.ops.predict import prediction_options
from sparsevid.ops.settings import PredictSettings, forget_warnings
from oracles import DEVICE

# (B, H, N, M, D, block_q, block_k): N, M not multiples of the blocks, N < one block, N != M, B > 1,
# a head dim that is not a power of two.
SHAPES = [
    pytest.param((1, 2, 333, 200, 64, 128, 64), id="N333-M200-d64-128x64"),
    pytest.param((2, 3, 200, 333, 64, 64, 128), id="B2-H3-N200-M333-64x128"),
    pytest.param((1, 1, 50, 70, 16, 64, 64), id="N-below-block-d16"),
    pytest.param((1, 2, 1000, 1100, 80, 64, 64), id="N1000-M1100-d80"),
    # More than 512 key blocks (rows selected a few at a time) and more than one program of query rows.
    pytest.param((1, 1, 1100, 33000, 16, 64, 64), id="KB516-QB18-d16"),
    # A power-of-two row longer than the packed search (one row tile) next to the ragged rows above (two tiles).
    pytest.param((1, 1, 300, 8192, 16, 64, 64), id="KB128-one-row-tile"),
]

# (rule, options): rules alone and with every option (per-head thresholds where marked).
SETTINGS = [
    pytest.param("hybrid", {}, id="hybrid"),
    pytest.param("topk", dict(keep_sink=True, keep_diagonal=True, similarity_threshold=0.52, min_blocks=2),
                 id="topk-options"),
    pytest.param("topp", dict(keep_sink=True, similarity_threshold="per-head", min_blocks=0), id="topp-per-head"),
]


def structured(b, h, t, d, dtype, transposed=False):
    """[B, H, T, D] tokens = a random mean per run of 32 tokens plus noise, so pooled rows are peaked and
    block self-similarities spread over (0, 1). With ``transposed`` a [B, T, H, D] tensor's view."""
    means = 2.0 * torch.randn(b, h, -(-t // 32), d)
    x = means.repeat_interleave(32, dim=2)[:, :, :t] + torch.randn(b, h, t, d) * torch.rand(b, h, t, 1) * 3
    x = x.to(DEVICE, dtype)
    return x.transpose(1, 2).contiguous().transpose(1, 2) if transposed else x


def per_head(value, heads, spread):
    return torch.linspace(value - spread, value + spread, heads) if heads > 1 else torch.tensor([value])


def assert_same_masks(mask_a, stats_a, mask_b, stats_b):
    assert torch.equal(mask_a.keep, mask_b.keep)
    torch.testing.assert_close(stats_a.kept_mass, stats_b.kept_mass, atol=1e-5, rtol=0)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("rule,options", SETTINGS)
def test_triton_matches_torch(shape, rule, options):
    torch.manual_seed(sum(shape))
    b, h, n, m, d, block_q, block_k = shape
    dtype = torch.float16 if d == 64 else torch.float32
    q = structured(b, h, n, d, dtype, transposed=True)
    k = structured(b, h, m, d, dtype)
    options = dict(options)
    topk, topp = 0.2, 0.7
    if options.get("similarity_threshold") == "per-head":
        options["similarity_threshold"] = per_head(0.5, h, 0.05)
        topp = per_head(0.7, h, 0.2)
    kwargs = dict(rule=rule, topk=topk, topp=topp, block_q=block_q, block_k=block_k, **options)
    mask_t, stats_t = sv.predict_mask(q, k, backend="triton", **kwargs)
    mask_r, stats_r = sv.predict_mask(q, k, backend="reference", **kwargs)
    assert_same_masks(mask_t, stats_t, mask_r, stats_r)
    # The kernel's index tables are exactly those SparseMask would build from the keep map.
    count, index = kept_index_table(mask_t.keep)
    assert torch.equal(mask_t.kv_count, count)
    assert torch.equal(mask_t.kv_index, index)
    assert stats_t.sparsity == pytest.approx(mask_t.sparsity)
    assert stats_t.sparsity_per_head.shape == (h,)


def launches():
    """(name, run) for every candidate config: each pool, logits and select config, with the configs of the
    other stages taken in turn."""
    pools, logits, selects = (triton_predict.POOL_CONFIGS, triton_predict.LOGITS_CONFIGS,
                              triton_predict.SELECT_CONFIGS)
    runs = max(len(pools), len(logits), len(selects))
    return [(f"staged-{i}", lambda launch, configs=(pools[i % len(pools)], logits[i % len(logits)],
                                                    selects[i % len(selects)]): launch.run(configs))
            for i in range(runs)]


# (B, H, N, M, D, block_q, block_k): rows short enough to search whole (KB <= COMPACT), and longer rows whose
# search finishes on the packed bracket; B > 1, ragged lengths.
LAUNCH_SHAPES = [
    pytest.param((2, 2, 333, 1000, 32, 128, 64), id="KB16-B2"),
    pytest.param((1, 3, 200, 5000, 16, 64, 64), id="KB79-H3"),
]


@pytest.mark.parametrize("shape", LAUNCH_SHAPES)
def test_every_launch_and_config_matches_torch(shape):
    """The launches with every candidate config, on per-head budgets, every option and
    within=: the reference path's keep map and kept mass, and the index tables of that keep map."""
    torch.manual_seed(sum(shape))
    b, h, n, m, d, block_q, block_k = shape
    q = structured(b, h, n, d, torch.float32, transposed=True)
    k = structured(b, h, m, d, torch.float32)
    blocks = dict(block_q=block_q, block_k=block_k)
    earlier, _ = sv.predict_mask(q, k, rule="topk", topk=0.6, backend="reference", **blocks)
    kwargs = dict(rule="hybrid", topk=per_head(0.2, h, 0.1), topp=per_head(0.7, h, 0.2), keep_sink=True,
                  keep_diagonal=True, similarity_threshold=0.5, within=earlier, **blocks)
    ref, ref_stats = sv.predict_mask(q, k, backend="reference", **kwargs)
    ref_count, ref_index = kept_index_table(ref.keep)
    options = prediction_options(q, k, **kwargs)
    for name, run in launches():
        launch = triton_predict.PredictLaunch(q, k, **options)
        run(launch)
        keep, count, index, kept_mass = launch.outputs
        assert torch.equal(keep, ref.keep), name
        assert torch.equal(count, ref_count) and torch.equal(index, ref_index), name
        torch.testing.assert_close(kept_mass, ref_stats.kept_mass, atol=1e-5, rtol=0, msg=name)


def test_pooling_matches_float64_brute_force():
    torch.manual_seed(3)
    x = structured(2, 3, 333, 24, torch.float32, transposed=True)
    block = 64
    pooled = pool_blocks(x, block)
    sim = block_similarity(x, block, pooled)
    xd = x.double()
    for i in range(pooled.shape[2]):
        tokens = xd[:, :, i * block:(i + 1) * block]
        mean = tokens.mean(dim=2)
        cos = torch.nn.functional.cosine_similarity(tokens, mean[:, :, None], dim=-1)
        torch.testing.assert_close(pooled[:, :, i].double(), mean, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(sim[:, :, i].double(), cos.mean(dim=2), atol=1e-5, rtol=1e-5)
    assert float(sim.min()) < 0.9  # the test inputs exercise dissimilar blocks


def test_pooled_scores_and_kept_mass():
    torch.manual_seed(4)
    q = structured(1, 2, 300, 32, torch.float32)
    k = structured(1, 2, 260, 32, torch.float32)
    mask, stats = sv.predict_mask(q, k, rule="topk", topk=3, block_q=64, block_k=64, scale=0.3, backend="reference")
    scores = pooled_scores(pool_blocks(q, 64), pool_blocks(k, 64), 0.3)
    ref = torch.softmax(0.3 * pool_blocks(q.double(), 64).double() @ pool_blocks(k.double(), 64).double().mT, -1)
    torch.testing.assert_close(scores.double(), ref, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(stats.kept_mass.double(), (ref * mask.keep).sum(-1), atol=1e-5, rtol=0)
    assert stats.kept_mass.shape == (1, 2, 5)
    assert stats.sparsity_per_head.shape == (2,)
    assert bool((mask.kv_count == 3).all())


def test_full_keep_when_every_block_is_asked_for():
    torch.manual_seed(5)
    q, k = structured(1, 2, 200, 32, torch.float32), structured(1, 2, 200, 32, torch.float32)
    for backend in ("reference", "triton"):
        mask, stats = sv.predict_mask(q, k, rule="topk", topk=1.0, block_q=64, block_k=64, backend=backend)
        assert bool(mask.keep.all()) and stats.sparsity == 0.0
        torch.testing.assert_close(stats.kept_mass, torch.ones_like(stats.kept_mass), atol=1e-5, rtol=0)


BAD_INPUTS = [
    pytest.param(dict(q="x"), TypeError, "q", id="q-not-tensor"),
    pytest.param(dict(q=torch.randn(2, 64, 8)), ValueError, "q", id="q-3d"),
    pytest.param(dict(k=torch.randn(1, 2, 64, 16)), ValueError, r"share \[B, H\] and the head dim D", id="k-head-dim"),
    pytest.param(dict(k=torch.randn(1, 2, 64, 8).double()), TypeError, "dtype", id="k-dtype"),
    pytest.param(dict(q=torch.ones(1, 2, 64, 8, dtype=torch.int32)), TypeError, "q", id="q-int"),
    pytest.param(dict(rule="topq"), ValueError, "rule", id="rule"),
    pytest.param(dict(topk=0.0), ValueError, "topk", id="topk-zero"),
    pytest.param(dict(topk=1.5), ValueError, "topk", id="topk-fraction-above-1"),
    pytest.param(dict(topk=0), ValueError, "topk", id="topk-count-zero"),
    pytest.param(dict(topk="5%"), TypeError, "topk", id="topk-str"),
    pytest.param(dict(topk=torch.tensor([0.1, 0.2, 0.3])), ValueError, "topk", id="topk-wrong-heads"),
    pytest.param(dict(topp=0.0), ValueError, "topp", id="topp-zero"),
    pytest.param(dict(topp=torch.tensor([1, 1])), TypeError, "topp", id="topp-int-tensor"),
    pytest.param(dict(similarity_threshold=2.0), ValueError, "similarity_threshold", id="sim-range"),
    pytest.param(dict(block_q=96), ValueError, "block_q", id="block_q"),
    pytest.param(dict(block_k=32), ValueError, "block_k", id="block_k"),
    pytest.param(dict(scale=-1.0), ValueError, "scale", id="scale"),
    pytest.param(dict(scale=float("inf")), ValueError, "scale", id="scale-inf"),
    pytest.param(dict(keep_sink=1), TypeError, "keep_sink", id="keep_sink"),
    pytest.param(dict(min_blocks=-1), ValueError, "min_blocks", id="min_blocks"),
    pytest.param(dict(backend="cuda"), ValueError, "backend", id="backend"),
]


@pytest.mark.parametrize("override,error,match", BAD_INPUTS)
def test_bad_input_names_the_argument(override, error, match):
    kwargs = dict(q=torch.randn(1, 2, 64, 8), k=torch.randn(1, 2, 64, 8))
    kwargs.update(override)
    with pytest.raises(error, match=match):
        sv.predict_mask(**kwargs)


def test_launch_rejects_unknown_score_precision():
    q = torch.randn(1, 2, 64, 8)
    options = prediction_options(q, q)
    with pytest.raises(ValueError, match="score_precision"):
        triton_predict.PredictLaunch(q, q, **options, score_precision="bf16")


# --------------------------------------------------------------------------- GPU: real sizes in bf16

def differing_row_fraction(keep_a: torch.Tensor, keep_b: torch.Tensor) -> float:
    return float((keep_a != keep_b).any(dim=-1).double().mean())


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [
    pytest.param((1, 12, 32760, 32760, 128, 128, 64), id="wan-1.3b"),
    pytest.param((2, 4, 4100, 3000, 64, 64, 128), id="B2-N4100-M3000-d64"),
])
@pytest.mark.parametrize("rule", ["topk", "topp", "hybrid"])
def test_gpu_triton_matches_torch_bf16(shape, rule):
    torch.manual_seed(6)
    b, h, n, m, d, block_q, block_k = shape
    q = structured(b, h, n, d, torch.bfloat16, transposed=True)
    k = structured(b, h, m, d, torch.bfloat16, transposed=True)
    kwargs = dict(rule=rule, topk=0.05, topp=0.9, block_q=block_q, block_k=block_k, keep_sink=True,
                  similarity_threshold=0.3)
    mask_t, stats_t = sv.predict_mask(q, k, backend="triton", **kwargs)
    mask_r, stats_r = sv.predict_mask(q, k, backend="reference", **kwargs)
    # The kernel computes the pooled logits with 3xTF32 products and its own summation order, the torch
    # path with fp32 cuBLAS: a row can only differ where its threshold falls between two scores (or the
    # cumulative mass lands on p) within ~1e-6 relative, which random inputs hit in well under 0.1% of rows.
    assert differing_row_fraction(mask_t.keep, mask_r.keep) <= 1e-3
    same = ~(mask_t.keep != mask_r.keep).any(dim=-1)
    torch.testing.assert_close(stats_t.kept_mass[same], stats_r.kept_mass[same], atol=1e-5, rtol=0)
    count, index = kept_index_table(mask_t.keep)
    assert torch.equal(mask_t.kv_count, count)
    assert torch.equal(mask_t.kv_index, index)


def block_means_fp64(x: torch.Tensor, block: int) -> torch.Tensor:
    """float64 [B, H, ceil(L/block), D]: block means of x [B, H, L, D], the last block over its real tokens."""
    length = x.shape[2]
    padded = torch.nn.functional.pad(x.double(), (0, 0, 0, -length % block))
    counts = torch.full((padded.shape[2] // block,), float(block), dtype=torch.float64, device=x.device)
    counts[-1] = length - (counts.numel() - 1) * block
    return padded.unflatten(2, (-1, block)).sum(3) / counts[:, None]


@pytest.mark.gpu
@pytest.mark.parametrize("precision,tolerance", [("tf32x3", 1e-5), ("tf32", 1e-3)])
def test_gpu_pooled_logits_precision(precision, tolerance):
    """The logits stage against float64 pooled logits, ||out - ref|| / ||ref||: 3xTF32 within fp32's 1e-5,
    one TF32 product within 1e-3 (tf32 lands near 3e-4)."""
    torch.manual_seed(9)
    q = structured(1, 8, 8200, 128, torch.bfloat16, transposed=True)
    k = structured(1, 8, 8200, 128, torch.bfloat16, transposed=True)
    options = prediction_options(q, k, rule="hybrid", block_q=128, block_k=64)
    launch = triton_predict.PredictLaunch(q, k, **options, score_precision=precision)
    launch.pool()
    launch.logits()
    qb, kb = launch._qb, launch._kb
    logits = launch._pooled_logits.view(8 * qb, -1)[:, :kb].view(1, 8, qb, kb).double()
    ref = block_means_fp64(q, 128) @ block_means_fp64(k, 64).mT * (128 ** -0.5 / math.log(2))
    assert float((logits - ref).norm() / ref.norm()) <= tolerance


@pytest.mark.gpu
def test_gpu_every_launch_and_config_bf16():
    """40 heads, ragged N, bf16: every config against the reference path, within the rounding allowance of
    test_gpu_triton_matches_torch_bf16."""
    torch.manual_seed(8)
    q = structured(1, 40, 8200, 128, torch.bfloat16, transposed=True)
    k = structured(1, 40, 8200, 128, torch.bfloat16, transposed=True)
    kwargs = dict(rule="hybrid", topk=0.05, topp=0.9, block_q=128, block_k=64)
    ref, _ = sv.predict_mask(q, k, backend="reference", **kwargs)
    options = prediction_options(q, k, **kwargs)
    for name, run in launches():
        launch = triton_predict.PredictLaunch(q, k, **options)
        run(launch)
        keep, count, index, _ = launch.outputs
        assert differing_row_fraction(keep, ref.keep) <= 1e-3, name
        ref_count, ref_index = kept_index_table(keep)
        assert torch.equal(count, ref_count) and torch.equal(index, ref_index), name


# --------------------------------------------------------------------------- settings object, 0%-sparsity warnings

def test_settings_object_and_keywords_give_the_same_mask():
    torch.manual_seed(10)
    q, k = structured(1, 2, 300, 32, torch.float32), structured(1, 2, 700, 32, torch.float32)
    kwargs = dict(rule="hybrid", topk=0.2, topp=0.6, block_q=64, block_k=64, keep_sink=True, min_blocks=2,
                  backend="reference")
    settings = PredictSettings(**kwargs)
    by_keywords, _ = sv.predict_mask(q, k, **kwargs)
    by_object, _ = sv.predict_mask(q, k, settings)
    assert torch.equal(by_object.keep, by_keywords.keep)
    # Keywords replace the object's fields.
    replaced, _ = sv.predict_mask(q, k, settings, topk=0.5)
    assert torch.equal(replaced.keep, sv.predict_mask(q, k, **{**kwargs, "topk": 0.5})[0].keep)
    assert settings.replace(topk=0.5) == PredictSettings(**{**kwargs, "topk": 0.5})
    assert prediction_options(q, k, settings) == prediction_options(q, k, **kwargs)


def test_settings_are_checked_on_construction_and_unknown_keywords_are_refused():
    with pytest.raises(ValueError, match="topk"):
        PredictSettings(topk=1.5)
    with pytest.raises(ValueError, match="block_k"):
        PredictSettings().replace(block_k=32)
    q = torch.randn(1, 2, 64, 8)
    with pytest.raises(TypeError, match="topkk"):
        sv.predict_mask(q, q, topkk=0.1)
    with pytest.raises(TypeError, match="settings"):
        sv.predict_mask(q, q, "hybrid")


@pytest.fixture
def fresh_warnings():
    """Every 'keeps every tile' warning can be given again; all warnings are recorded."""
    forget_warnings()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        yield caught
    forget_warnings()


def every_tile_warnings(caught) -> list[str]:
    return [str(w.message) for w in caught if issubclass(w.category, UserWarning) and "0% sparsity" in str(w.message)]


@pytest.mark.parametrize("backend", ["reference", "triton"])
@pytest.mark.parametrize("kwargs,length,cause", [
    pytest.param(dict(rule="topk", topk=1000), 640, "topk=1000", id="topk-count-above-KB"),
    pytest.param(dict(rule="hybrid", topk=10), 640, "topk=10", id="hybrid-topk-count-equals-KB"),
    pytest.param(dict(rule="topk", topk=0.95), 640, "topk=0.95", id="topk-fraction-rounds-up-to-KB"),
    pytest.param(dict(rule="topp", min_blocks=12), 640, "min_blocks=12", id="min_blocks-above-KB"),
    pytest.param(dict(rule="hybrid"), 50, "kv_len=50", id="clip-below-one-block"),
])
def test_settings_that_keep_every_tile_warn_once(fresh_warnings, backend, kwargs, length, cause):
    torch.manual_seed(11)
    q, k = structured(1, 2, length, 16, torch.float32), structured(1, 2, length, 16, torch.float32)
    for _ in range(3):  # layers and steps repeat the cause: one warning
        mask, stats = sv.predict_mask(q, k, block_q=64, block_k=64, backend=backend, **kwargs)
        assert bool(mask.keep.all()) and stats.sparsity == 0.0
    messages = every_tile_warnings(fresh_warnings)
    assert len(messages) == 1 and cause in messages[0] and "keeps every tile" in messages[0]
    # Another cause warns again.
    sv.predict_mask(q[:, :, :30], k[:, :, :30], block_q=64, block_k=64, backend=backend, **kwargs)
    assert len(every_tile_warnings(fresh_warnings)) == 2


def test_sparse_or_explicitly_dense_settings_do_not_warn(fresh_warnings):
    torch.manual_seed(12)
    q, k = structured(1, 2, 640, 16, torch.float32), structured(1, 2, 640, 16, torch.float32)
    blocks = dict(block_q=64, block_k=64, backend="reference")
    sv.predict_mask(q, k, rule="topk", topk=9, **blocks)                # one key block skipped per row
    sv.predict_mask(q, k, rule="topk", topk=0.9, **blocks)              # rounds up to 9 of 10
    sv.predict_mask(q, k, rule="topk", topk=1.0, **blocks)              # asks for every tile
    sv.predict_mask(q, k, rule="topp", topp=1.0, **blocks)              # asks for every tile
    earlier, _ = sv.predict_mask(q, k, rule="topk", topk=3, **blocks)
    sv.predict_mask(q, k, rule="topk", topk=1000, within=earlier, **blocks)  # keeps the earlier mask's tiles
    assert every_tile_warnings(fresh_warnings) == []
