"""Model pieces against plain-PyTorch references."""

import pytest
import torch
import torch.nn.functional as F

from hybridrec.model.dlrm import DLRM
from hybridrec.model.embedding import EmbeddingBagCollection, KeyedTensor, TableConfig
from hybridrec.model.interaction import CatInteraction, DotInteraction
from hybridrec.sparse.keyed_jagged import Batch, KeyedJagged


def test_dot_interaction_matches_bmm_reference():
    torch.manual_seed(0)
    b, f, d = 5, 4, 3
    dense = torch.randn(b, d, requires_grad=True)
    sparse = torch.randn(b, f, d, requires_grad=True)
    out = DotInteraction(f)(dense, sparse)
    z = torch.cat([dense.unsqueeze(1), sparse], 1)
    gram = torch.bmm(z, z.transpose(1, 2))
    r, c = torch.tril_indices(f + 1, f + 1, offset=-1)
    ref = torch.cat([dense, gram[:, r, c]], 1)
    assert out.shape == (b, DotInteraction.output_dim(f, d))
    torch.testing.assert_close(out, ref)
    go = torch.randn_like(out)
    got = torch.autograd.grad((out * go).sum(), (dense, sparse))
    want = torch.autograd.grad((ref * go).sum(), (dense, sparse))
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w)


@pytest.mark.parametrize("impl", ["index", "gather", "gather_pad"])
def test_dot_interaction_of_parts_in_another_order_equals_the_features_in_theirs(impl):
    # A sharded collection hands over its owners' blocks as they came: parts in the blocks'
    # order. The output and the gradients must be those of the features in their own order.
    torch.manual_seed(1)
    b, f, d = 6, 5, 3
    dense = torch.randn(b, d, requires_grad=True)
    sparse = torch.randn(b, f, d, requires_grad=True)
    mod = DotInteraction(f)
    mod.impl = impl
    ref = mod(dense, sparse)
    order = [3, 0, 4, 1, 2]
    parts = (sparse[:, [3, 0]], sparse[:, [4]], sparse[:, [1, 2]])
    out = mod(dense, parts, order)
    torch.testing.assert_close(out, ref)
    go = torch.randn_like(ref)
    want = torch.autograd.grad((ref * go).sum(), (dense, sparse))
    got = torch.autograd.grad((out * go).sum(), (dense, sparse))
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w)
    assert not torch.allclose(mod(dense, (sparse[:, order],)), ref)  # the order is not ignored
    with pytest.raises(ValueError, match="an order of the 5 features"):
        mod(dense, parts, [0, 0, 1, 2, 3])


def test_keyed_tensor_parts_give_the_values_in_the_keys_order():
    b, d = 2, 3
    feats = torch.arange(b * 4 * d, dtype=torch.float32).view(b, 4, d)  # keys k0..k3
    kt = KeyedTensor(["k0", "k1", "k2", "k3"], [d] * 4, parts=(feats[:, [2, 0]], feats[:, [3, 1]]),
                     order=[2, 0, 3, 1])
    assert torch.equal(kt.values, feats.reshape(b, -1))
    assert torch.equal(kt.as_3d(), feats)
    parts, order = kt.as_parts()
    assert order == (2, 0, 3, 1) and len(parts) == 2
    plain = KeyedTensor(["k0", "k1", "k2", "k3"], [d] * 4, feats.reshape(b, -1))
    assert plain.as_parts()[1] is None and torch.equal(plain.as_parts()[0][0], feats)
    with pytest.raises(ValueError, match="an order"):
        KeyedTensor(["k0", "k1"], [d, d], parts=(feats[:, :2],), order=[0, 0])
    with pytest.raises(ValueError, match="not both"):
        KeyedTensor(["k0"], [d], feats[:, 0], parts=(feats[:, :1],), order=[0])


def test_cat_interaction_shape():
    out = CatInteraction()(torch.randn(2, 3), torch.randn(2, 4, 3))
    assert out.shape == (2, CatInteraction.output_dim(4, 3))


def _jagged_example():
    # keys a, b over 3 samples; bag (b, sample 1) is empty; ids repeat.
    keys = ["a", "b"]
    values = torch.tensor([1, 1, 4, 0, 2, 2, 3])
    lengths = torch.tensor([2, 1, 1, 1, 0, 2], dtype=torch.int32)
    return KeyedJagged(keys, values, lengths)


def _reference_pool(ebc, kjt, name, feature, mode):
    w = ebc.table_weight(name)
    vals, lens = kjt.split_by_key()[feature]
    off = torch.zeros(lens.numel() + 1, dtype=torch.int64)
    off[1:] = torch.cumsum(lens, 0)
    return F.embedding_bag(vals, w, off, mode=mode, include_last_offset=True)


@pytest.mark.parametrize("mode", ["sum", "mean"])
def test_ebc_pools_like_embedding_bag(mode):
    torch.manual_seed(0)
    tables = [TableConfig(name="ta", num_embeddings=5, embedding_dim=3, features=["a"], pooling=mode),
              TableConfig(name="tb", num_embeddings=6, embedding_dim=3, features=["b"], pooling=mode)]
    ebc = EmbeddingBagCollection(tables)
    kjt = _jagged_example()
    out = ebc(kjt).as_3d()
    torch.testing.assert_close(out[:, 0], _reference_pool(ebc, kjt, "ta", "a", mode))
    torch.testing.assert_close(out[:, 1], _reference_pool(ebc, kjt, "tb", "b", mode))
    assert torch.all(out[1, 1] == 0)  # empty bag pools to zero


def test_ebc_groups_by_dim_and_reorders_keys():
    torch.manual_seed(0)
    tables = [TableConfig(name="x", num_embeddings=4, embedding_dim=2),
              TableConfig(name="y", num_embeddings=4, embedding_dim=5)]
    ebc = EmbeddingBagCollection(tables)
    assert ebc.num_groups == 2
    kjt = KeyedJagged.from_dense(["y", "x"], torch.tensor([[1, 2], [3, 0]]))
    out = ebc(kjt)
    assert out.keys == ["x", "y"] and out.values.shape == (2, 7)
    torch.testing.assert_close(out.values[:, :2], ebc.table_weight("x")[[2, 0]])
    torch.testing.assert_close(out.values[:, 2:], ebc.table_weight("y")[[1, 3]])
    with pytest.raises(ValueError):
        out.as_3d()


def test_ebc_state_dict_is_per_table_and_round_trips():
    tables = [TableConfig(name=n, num_embeddings=3 + i, embedding_dim=2) for i, n in enumerate("pq")]
    a, b = EmbeddingBagCollection(tables), EmbeddingBagCollection(tables, seed=1)
    assert not any(torch.equal(a.table_weight(n), b.table_weight(n)) for n in "pq")  # (b differs)
    sd = a.state_dict()
    assert sorted(sd) == ["tables.p.weight", "tables.q.weight"]
    assert sd["tables.q.weight"].shape == (4, 2)
    b.load_state_dict(sd)
    for n in "pq":
        assert torch.equal(a.table_weight(n), b.table_weight(n)), n
    with pytest.raises(RuntimeError, match="Missing"):
        b.load_state_dict({"tables.p.weight": sd["tables.p.weight"]})


def test_ebc_missing_feature_is_a_clear_error():
    ebc = EmbeddingBagCollection([TableConfig(name="a", num_embeddings=3, embedding_dim=2)])
    with pytest.raises(KeyError, match="no feature"):
        ebc(KeyedJagged.from_dense(["b"], torch.tensor([[0]])))


def test_dlrm_forward_and_validation():
    torch.manual_seed(0)
    ebc = EmbeddingBagCollection([TableConfig(name=f"c{i}", num_embeddings=10, embedding_dim=4) for i in range(3)])
    model = DLRM(num_dense=2, sparse=ebc, bottom_mlp=[8, 4], top_mlp=[6, 1])
    kjt = KeyedJagged.from_dense(["c0", "c1", "c2"], torch.randint(0, 10, (7, 3)))
    batch = Batch(torch.randn(7, 2), kjt, torch.zeros(7))
    assert model(batch).shape == (7,)
    with pytest.raises(ValueError, match="bottom MLP output"):
        DLRM(num_dense=2, sparse=ebc, bottom_mlp=[8, 5], top_mlp=[6, 1])
    with pytest.raises(ValueError, match="end in 1"):
        DLRM(num_dense=2, sparse=ebc, bottom_mlp=[8, 4], top_mlp=[6, 2])


class _Recording(EmbeddingBagCollection):
    """Records the extra arguments the model passes beside the ids."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.calls = []

    def forward(self, kjt, *extra):
        self.calls.append(extra)
        return super().forward(kjt)


@pytest.mark.parametrize("arch", ["dlrm", "deepfm"])
def test_sparse_input_reaches_the_collection_only_when_given(arch):
    from hybridrec.model.deepfm import DeepFM

    fm = arch == "deepfm"
    tables = [TableConfig(name=f"c{i}", num_embeddings=10, embedding_dim=4 + fm, fm_cols=4 if fm else None)
              for i in range(2)]
    ebc = _Recording(tables)
    model = (DeepFM if fm else DLRM)(num_dense=2, sparse=ebc, bottom_mlp=[8, 4], top_mlp=[6, 1])
    batch = Batch(torch.randn(3, 2), KeyedJagged.from_dense(["c0", "c1"], torch.randint(0, 10, (3, 2))),
                  torch.zeros(3))
    plain = model(batch)
    handle = object()  # any object: the model only passes it on
    torch.testing.assert_close(model(batch, sparse_input=handle), plain)
    assert ebc.calls == [(), (handle,)]


def test_model_package_never_imports_torch_distributed():
    import ast
    from pathlib import Path

    import hybridrec.model

    for path in Path(hybridrec.model.__file__).parent.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            assert not any(n.startswith("torch.distributed") for n in names), path.name


def test_ebc_built_as_zeros_then_reset_equals_the_drawn_tables():
    tables = [TableConfig(name=n, num_embeddings=30 + i, embedding_dim=4) for i, n in enumerate("pqr")]
    drawn, zeros = EmbeddingBagCollection(tables, seed=3), EmbeddingBagCollection(tables, seed=3, init_values=False)
    assert all(zeros.table_weight(n).count_nonzero() == 0 for n in "pqr")
    zeros.reset_parameters()
    for n in "pqr":
        assert torch.equal(drawn.table_weight(n), zeros.table_weight(n)) and drawn.table_weight(n).abs().sum() > 0


@pytest.mark.parametrize("n", [0, 5, 8191, 8192, 13312, 32767, 32768, 40000])
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_the_stable_sort_equals_torchs(n, dtype):
    """Padded up to torch's radix-sort size or not, the same values and permutation, repeated
    keys in their order (the largest value of the dtype included)."""
    from hybridrec.model import id_groups as embedding

    gen = torch.Generator().manual_seed(n)
    key = torch.randint(0, 50, (n,), generator=gen).to(dtype)
    if n:
        key[n // 2] = torch.iinfo(dtype).max
    want = torch.sort(key, stable=True)
    for pads in (True, False):
        embedding._padding_pays = pads
        try:
            got = embedding.stable_sort(key)
        finally:
            embedding._padding_pays = None
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_a_batch_brings_its_bag_facts_from_the_host():
    """``KeyedJagged.to`` works out the bag sizes per key and whether every bag holds one id on
    the CPU copy and hands them over, so a GPU copy never needs the GPU to learn them."""
    from hybridrec.sparse.keyed_jagged import KeyedJagged

    one = KeyedJagged(["a", "b"], torch.tensor([3, 1, 4, 1]), torch.ones(4, dtype=torch.int32))
    moved = one.to("cpu")
    assert moved is not one and moved._length_per_key == [2, 2] and moved._one_id is True
    multi = KeyedJagged(["a", "b"], torch.tensor([3, 1, 4, 1, 5]), torch.tensor([2, 0, 1, 2], dtype=torch.int32))
    moved = multi.to("cpu")
    assert moved._length_per_key == [2, 3] and moved._one_id is False
    # the same count of ids as bags is not one id per bag
    even = KeyedJagged(["a"], torch.tensor([7, 8]), torch.tensor([2, 0], dtype=torch.int32))
    assert even.one_id_per_bag() is False and even.to("cpu")._one_id is False


@pytest.mark.parametrize("name", ["sgd", "adam", "adagrad"])
def test_dense_optimizers_take_the_fused_kernel_on_the_cpu(name):
    from hybridrec.train.loop.optim import FUSED, build_dense_optimizer
    from hybridrec.train.setup.config import OptimConfig

    params = [torch.nn.Parameter(torch.randn(3, 2)), torch.nn.Parameter(torch.randn(2))]
    opt = build_dense_optimizer(params, OptimConfig(dense=name))
    assert name in FUSED["cpu"] and opt.defaults["fused"] is True and not opt.defaults.get("foreach")
    assert "adagrad" not in FUSED["cuda"]  # (torch has no fused Adagrad for CUDA: foreach there)
    for p in params:
        p.grad = torch.ones_like(p)
    before = [p.detach().clone() for p in params]
    opt.step()
    assert all(not torch.equal(p, b) for p, b in zip(params, before))
