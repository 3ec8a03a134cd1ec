"""Linear kernels chosen by measurement, and bf16 compute for the dense arches."""

import json

import pytest
import torch
import torch.nn.functional as F
from distributed import run_ranks
from processor import needs_onednn_bf16

from hybridrec.model import kernels
from hybridrec.model.dlrm import DLRM
from hybridrec.model.embedding import EmbeddingBagCollection, TableConfig
from hybridrec.model.mlp import tune_mlps
from hybridrec.sparse.keyed_jagged import Batch, KeyedJagged

IMPLS = [i for i in kernels.IMPLS if i == "torch" or kernels.onednn_available()]
BF16_IMPLS = [pytest.param(i, marks=needs_onednn_bf16) if i == "onednn" else i for i in IMPLS]


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("HYBRIDREC_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache" / "kernels.json"


def _grads(impl, relu, dtype=None):
    torch.manual_seed(0)
    x = torch.randn(37, 19, requires_grad=True)
    w = torch.randn(11, 19, requires_grad=True)
    b = torch.randn(11, requires_grad=True)
    with torch.autocast("cpu", dtype=dtype or torch.bfloat16, enabled=dtype is not None):
        y = kernels.linear(x, w, b, relu=relu, impl=impl)
    go = torch.randn(y.shape)
    return y, torch.autograd.grad((y.float() * go).sum(), (x, w, b))


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("relu", [False, True])
def test_every_implementation_matches_f_linear(impl, relu):
    y, grads = _grads(impl, relu)
    torch.manual_seed(0)
    x, w, b = (torch.randn(37, 19, requires_grad=True), torch.randn(11, 19, requires_grad=True),
               torch.randn(11, requires_grad=True))
    ref = F.linear(x, w, b)
    ref = F.relu(ref) if relu else ref
    go = torch.randn(ref.shape)
    want = torch.autograd.grad((ref * go).sum(), (x, w, b))
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5)
    for g, r in zip(grads, want):
        torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("impl", BF16_IMPLS)
def test_bf16_autocast_computes_in_bf16_and_keeps_fp32_gradients(impl):
    # (no ReLU: bf16 rounding flips the gate of pre-activations near 0, a whole term apart)
    y, grads = _grads(impl, relu=False, dtype=torch.bfloat16)
    ref, want = _grads("torch", relu=False)
    assert y.dtype == torch.bfloat16
    assert all(g.dtype == torch.float32 for g in grads)  # the master weights' gradients
    torch.testing.assert_close(y.float(), ref, rtol=0.05, atol=0.1)  # bf16: 8 mantissa bits
    for g, r in zip(grads, want):
        torch.testing.assert_close(g, r, rtol=0.05, atol=0.25)
    assert not torch.equal(y.float(), ref)  # bf16 really rounds (the scope did something)


def _shapes():
    return [kernels.LinearShape(64, 32, 16, relu=True, input_grad=False),
            kernels.LinearShape(64, 16, 1, relu=False, input_grad=True)]


def test_measured_choices_are_cached_and_reused(_cache):
    first = kernels.choose_linears(_shapes())
    assert {c.source for c in first.values()} <= {"measured", "only"}
    for c in first.values():
        assert c.impl in IMPLS
        if c.source == "measured":
            assert set(c.seconds) == set(IMPLS) and all(t > 0 for t in c.seconds.values())
            assert c.impl == min(c.seconds, key=c.seconds.get)
    data = json.loads(_cache.read_text())
    assert any(kernels.machine_id() in k for k in data)
    again = kernels.choose_linears(_shapes())
    for s, c in again.items():
        assert c.impl == first[s].impl
        assert c.source == ("cached" if first[s].source == "measured" else "only")
    # "measure" times again and does not read the cache
    assert all(c.source in ("measured", "only") for c in kernels.choose_linears(_shapes(), mode="measure").values())


def test_a_damaged_or_unwritable_cache_only_costs_a_measurement(_cache, tmp_path, monkeypatch):
    _cache.parent.mkdir(parents=True)
    _cache.write_text("{not json")
    got = kernels.choose_linears(_shapes())
    assert all(c.source in ("measured", "only") for c in got.values())
    assert json.loads(_cache.read_text())  # rewritten whole
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv("HYBRIDREC_CACHE_DIR", str(blocker / "sub"))  # a directory under a file
    assert all(c.source in ("measured", "only") for c in kernels.choose_linears(_shapes()).values())


def test_an_override_is_used_everywhere_it_fits_and_unknown_modes_are_refused():
    got = kernels.choose_linears(_shapes(), mode="torch")
    assert {(c.impl, c.source) for c in got.values()} == {("torch", "override")}
    if kernels.onednn_available():
        got = kernels.choose_linears(_shapes(), mode="onednn")
        assert {c.impl for c in got.values()} == {"onednn"}
    with pytest.raises(ValueError, match="kernels 'fast'"):
        kernels.choose_linears(_shapes(), mode="fast")


def _tiny_dlrm(precision="fp32"):
    torch.manual_seed(0)
    tables = [TableConfig(name="t0", num_embeddings=50, embedding_dim=4, features=["f0"]),
              TableConfig(name="t1", num_embeddings=30, embedding_dim=4, features=["f1"])]
    return DLRM(num_dense=3, sparse=EmbeddingBagCollection(tables, seed=0), bottom_mlp=[8, 4],
                top_mlp=[8, 1], precision=precision)


def _batch(n=16):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 30, (n, 2), generator=g)
    return Batch(torch.randn(n, 3, generator=g), KeyedJagged.from_dense(["f0", "f1"], ids),
                 torch.randint(0, 2, (n,), generator=g).float())


def test_tune_mlps_sets_every_layer_and_knows_the_bottom_input_needs_no_gradient():
    model = _tiny_dlrm()
    choices = tune_mlps(model, 16, mode="torch")
    assert model.bottom.impls == ["torch", "torch"] and model.top.impls == ["torch", "torch"]
    keys = [c.key for c in choices]
    assert " dx" not in keys[0] and all(k.endswith(" dx") for k in keys[1:])
    # the top MLP's input: the bottom output (4) and the 3 dot products of 3 vectors
    assert [k.split()[2] for k in keys] == ["16x3->8", "16x8->4", "16x7->8", "16x8->1"]
    model(_batch())  # still runs


def test_bf16_dlrm_keeps_fp32_parameters_and_logits_near_fp32():
    fp32, bf16 = _tiny_dlrm(), _tiny_dlrm("bf16")
    batch = _batch()
    a, b = fp32(batch), bf16(batch)
    assert b.dtype == torch.float32
    torch.testing.assert_close(b, a, rtol=0.05, atol=0.05)
    assert not torch.equal(a, b)
    F.binary_cross_entropy_with_logits(b, batch.labels).backward()
    for p in bf16.parameters():
        assert p.dtype == torch.float32
        assert p.grad is None or p.grad.dtype == torch.float32
    assert bf16.top.layers[0].weight.grad is not None
    with pytest.raises(ValueError, match="precision 'fp8'"):
        _tiny_dlrm("fp8")


def _agree_on_kernels(topo):
    from hybridrec.train.build import tune_kernels
    from hybridrec.train.setup.config import Config

    cfg = Config()
    cfg.data.batch_size = 16
    model = _tiny_dlrm()
    # Each rank alone would pick differently.
    cfg.train.kernels = "torch" if topo.rank == 0 else "onednn"
    report = tune_kernels(cfg, model, topo)
    return model.bottom.impls + model.top.impls, report["mode"]


@pytest.mark.distributed
@pytest.mark.skipif(not kernels.onednn_available(), reason="one candidate: nothing to disagree on")
def test_ranks_train_with_rank_0s_choices():
    (r0, mode0), (r1, mode1) = run_ranks(_agree_on_kernels, 2)
    assert (mode0, mode1) == ("torch", "onednn")
    assert r0 == r1 == ["torch"] * 4


def test_the_row_update_is_timed_on_the_table_without_changing_it():
    w = torch.randn(1000, 8)
    before = w.clone()
    got = kernels.choose_rows_add([(w, 300), (w, 0)])
    assert got[0].impl in kernels.ROW_ADDS and got[0].source == "measured"
    assert set(got[0].seconds) == set(kernels.row_add_impls("cpu")) == {"scatter_add", "index_add"}
    assert got[1].source == "only"  # nothing added per step: nothing to time
    torch.testing.assert_close(w, before, rtol=0, atol=0)
    assert kernels.choose_rows_add([(w, 300)])[0].source == "cached"
    # both candidates add repeated ids alike
    ids, delta = torch.tensor([3, 1, 3, 3]), torch.randn(4, 8)
    a, b = w.clone(), w.clone()
    kernels.rows_add_(a, ids, delta, "scatter_add")
    kernels.rows_add_(b, ids, delta, "index_add")
    torch.testing.assert_close(a, b)
    torch.testing.assert_close(a[3], before[3] + delta[[0, 2, 3]].sum(0))


@pytest.mark.parametrize("features", [5, 26])  # 6 rows (gather_pad: 8), 27 (32)
@pytest.mark.parametrize("dtype", [None, torch.bfloat16])
def test_every_interaction_implementation_computes_the_same(dtype, features):
    from hybridrec.model.interaction import INTERACTION_IMPLS, DotInteraction

    torch.manual_seed(0)
    dense, sparse = torch.randn(6, 4, requires_grad=True), torch.randn(6, features, 4, requires_grad=True)
    mod, outs = DotInteraction(features, 4), []
    for impl in INTERACTION_IMPLS:
        mod.impl = impl
        with torch.autocast("cpu", dtype=dtype or torch.bfloat16, enabled=dtype is not None):
            out = mod(dense, sparse)
        go = torch.linspace(-1, 1, out.numel()).view(out.shape)
        outs.append((out, torch.autograd.grad((out.float() * go).sum(), (dense, sparse))))
    (a, ga), *rest = outs
    assert a.dtype == (dtype or torch.float32)
    for impl, (b, gb) in zip(INTERACTION_IMPLS[1:], rest):
        if impl == "gather":  # the same products, only picked differently
            torch.testing.assert_close(a, b, rtol=0, atol=0)
        else:  # (padded: the same sums, maybe in another order)
            torch.testing.assert_close(a, b)
        for x, y in zip(ga, gb):
            torch.testing.assert_close(x, y)


def test_the_interaction_is_timed_and_the_choice_set():
    from hybridrec.model.interaction import interaction_impls, tune_interactions

    model = _tiny_dlrm()
    got = tune_interactions(model, 16)
    assert len(got) == 1 and got[0].source == "measured" and set(got[0].seconds) == set(interaction_impls("cpu"))
    assert interaction_impls("cpu") == ["index", "gather"] and "gather_pad" in interaction_impls("cuda")
    assert model.interaction.impl == got[0].impl
    assert tune_interactions(model, 16)[0].source == "cached"
