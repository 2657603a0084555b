"""Per-head budgets on the hot path: a plan's prediction with per-head budgets gives exactly what ``predict_mask``
gives with them as tensors (mask, kv tables, kept mass; eager and compiled, both backends), resolves and moves them
on its first call only and again for another device, head slice, key-block count or plan; compiled, the prediction
op takes the plan's own tensors and returns outputs that share no memory."""
import pytest
import torch

import sparsevid as sv
from sparsevid.ops import budgets, predict
from sparsevid.ops.predict_op import _predict_mask_op, _predict_per_head_op
from sparsevid.plan.reuse import predict_plan_mask
from oracles import DEVICE

BLOCKS = dict(block_q=64, block_k=64)
TOPP = (0.3, 0.6, 0.9)
FRACTIONS, COUNTS = (0.2, 0.5, 0.8), (1, 3, 2)


@pytest.fixture(autouse=True)
def resolutions(monkeypatch):
    """An empty cache of reused budgets, and the list of the resolutions made (arguments of each)."""
    made = []
    resolve = budgets.resolve_budgets
    monkeypatch.setattr(budgets, "_REUSED", budgets.ByIdentity())
    monkeypatch.setattr(budgets, "resolve_budgets", lambda *args: made.append(args) or resolve(*args))
    return made


def _qk(tokens=320, heads=3):
    torch.manual_seed(0)
    return (torch.randn(1, heads, tokens, 16, device=DEVICE) * 2 for _ in range(2))


def _plan(topk, topp=TOPP, backend="reference"):
    return sv.SparseConfig(rule="hybrid", topk=list(topk), topp=list(topp), backend=backend, **BLOCKS).plan(0, None)


def _expected(q, k, topk, topp, backend, heads: range | None):
    """predict_mask with the budgets of ``heads`` as tensors, typed as plans have always made them."""
    part = slice(None) if heads is None else slice(heads.start, heads.stop)
    topk = torch.tensor(topk, dtype=torch.int64 if isinstance(topk[0], int) else torch.float64)[part]
    mask, stats = sv.predict_mask(q, k, rule="hybrid", topk=topk, topp=torch.tensor(topp)[part], backend=backend,
                                  **BLOCKS)
    return mask.keep, mask.kv_count, mask.kv_index, stats.kept_mass


def _outputs(mask, kept_mass):
    return mask.keep, mask.kv_count, mask.kv_index, kept_mass


def _assert_equal(got, expected):
    assert len(got) == len(expected) == 4
    for a, b in zip(got, expected):
        assert a.dtype == b.dtype and torch.equal(a, b)


@pytest.mark.parametrize("backend", ["reference", "triton"])
@pytest.mark.parametrize("topk", [FRACTIONS, COUNTS], ids=["fractions", "counts"])
@pytest.mark.parametrize("heads", [None, range(1, 3)], ids=["all-heads", "a-ranks-heads"])
def test_eager_plan_predictions_are_predict_mask_with_tensor_budgets(backend, topk, heads, resolutions):
    q, k = _qk()
    if heads is not None:
        q, k = q[:, heads.start:heads.stop], k[:, heads.start:heads.stop]
    expected = _expected(q, k, topk, TOPP, backend, heads)
    plan = _plan(topk, backend=backend)
    for _ in range(2):  # the first call resolves, the second reuses
        _assert_equal(_outputs(*predict_plan_mask(q, k, plan, None, heads=heads)), expected)
    assert len(resolutions) == 1


@pytest.mark.parametrize("backend, topk, heads", [("reference", FRACTIONS, range(1, 3)), ("triton", COUNTS, None)],
                         ids=["reference-fractions-slice", "triton-counts"])
def test_compiled_plan_predictions_take_the_plans_tensors_and_resolve_them_once(backend, topk, heads, resolutions):
    q, k = _qk(heads=2 if heads else 3)
    plan = _plan(topk, backend=backend)
    expected = _expected(q, k, topk, TOPP, backend, heads)
    graphs = []

    def backend_keeping_the_graph(graph, example_inputs):
        from torch._dynamo.backends.debugging import aot_eager

        graphs.append(graph)
        return aot_eager(graph, example_inputs)

    torch._dynamo.reset()
    compiled = torch.compile(lambda q, k: _outputs(*predict_plan_mask(q, k, plan, None, heads=heads)),
                             backend=backend_keeping_the_graph, fullgraph=True)
    for _ in range(3):
        _assert_equal(compiled(q, k), expected)
    torch._dynamo.reset()
    (graph,) = graphs
    (call,) = [node for node in graph.graph.nodes if node.target is torch.ops.sparsevid.predict_mask_per_head.default]
    head_topk, head_topp, start, stop = call.args[2:6]
    assert head_topk.op == head_topp.op == "placeholder"  # the plan's tensors, the same objects on every call
    assert range(start, stop) == (heads or range(3))
    assert len(resolutions) == 1


def test_the_per_head_op_stays_out_of_cuda_graphs():
    """It keeps device memory between calls, which a CUDA graph's private pool must not hold."""
    if not hasattr(torch.Tag, "cudagraph_unsafe"):
        pytest.skip("no cudagraph_unsafe tag in this torch (nor graph partitions: host inputs skip CUDA graphs)")
    assert torch.Tag.cudagraph_unsafe in torch.ops.sparsevid.predict_mask_per_head.default.tags
    assert torch.Tag.cudagraph_unsafe not in torch.ops.sparsevid.predict_mask.default.tags


def test_the_backend_gets_the_same_device_budgets_on_every_call(monkeypatch, resolutions):
    seen = []
    reference = predict._reference_predict

    def spy(q, k, **options):
        seen.append((options["rule_topk"], options["rule_topp"]))
        return reference(q, k, **options)

    monkeypatch.setattr(predict, "_reference_predict", spy)
    q, k = _qk()
    plan = _plan(FRACTIONS)
    for _ in range(3):
        predict_plan_mask(q, k, plan, None)
    assert len(resolutions) == 1 and len(seen) == 3
    topk, topp = seen[0]
    assert topk.dtype == torch.int32 and topp.dtype == torch.float32 and topk.device == q.device
    assert all(later[0] is topk and later[1] is topp for later in seen[1:])


def test_budgets_are_resolved_again_for_another_slice_block_count_device_or_plan(resolutions):
    q, k = _qk()
    plan = _plan(FRACTIONS)
    predict_plan_mask(q, k, plan, None)
    predict_plan_mask(q, k, plan, None)
    assert len(resolutions) == 1
    predict_plan_mask(q[:, 1:], k[:, 1:], plan, None, heads=range(1, 3))  # a rank's slice of the heads
    predict_plan_mask(q, k[:, :, :200], plan, None)  # 4 key blocks instead of 5
    assert [(kb, heads) for _, kb, heads, _ in resolutions[1:]] == [(5, 2), (4, 3)]
    assert torch.equal(resolutions[1][0].topk, torch.tensor(FRACTIONS[1:], dtype=torch.float64))
    keep = predict_plan_mask(q, k, plan, None)[0].keep
    wider = predict_plan_mask(q, k, _plan((0.9,) + FRACTIONS[1:]), None)[0].keep  # a changed plan: other settings
    assert wider[:, 0].sum() > keep[:, 0].sum() and torch.equal(wider[:, 1:], keep[:, 1:])
    assert len(resolutions) == 4
    settings = resolutions[0][0]
    on_meta = budgets.reused_budgets(settings, 5, 3, torch.device("meta"))  # another device
    assert len(resolutions) == 5 and on_meta[0].device.type == "meta"
    assert budgets.reused_budgets(settings, 5, 3, q.device)[0].device == q.device and len(resolutions) == 5


@pytest.mark.parametrize("backend", ["reference", "triton"])
@pytest.mark.parametrize("per_head", [False, True], ids=["scalar", "per-head-slice"])
def test_the_prediction_op_matches_predict_mask_with_outputs_that_share_no_memory(backend, per_head):
    torch.manual_seed(0)
    q, k = torch.randn(2, 2, 200, 16, device=DEVICE), torch.randn(2, 2, 333, 16, device=DEVICE)
    fields = (64, 64, None, True, False, None, 1, backend)
    if per_head:  # heads 1 and 2 of a plan of three
        topk, topp = torch.tensor((4, 1, 3)), torch.tensor((0.9, 0.3, 0.6))
        budget, op, args = {"topk": topk[1:], "topp": topp[1:]}, _predict_per_head_op, (topk, topp, 1, 3, "hybrid")
    else:
        budget, op, args = {"topk": 3, "topp": 0.8}, _predict_mask_op, ("hybrid", 3.0, True, 0.8)
    args = (q, k, *args, *fields)
    outputs = op(*args)
    mask, stats = sv.predict_mask(q, k, rule="hybrid", keep_sink=True, backend=backend, **budget, **BLOCKS)
    _assert_equal(outputs, (mask.keep, mask.kv_count, mask.kv_index, stats.kept_mass))
    assert len({tensor.untyped_storage().data_ptr() for tensor in outputs}) == 4
    if backend == "reference":
        torch.library.opcheck(op, args)
