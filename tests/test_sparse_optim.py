"""Sparse optimizers against dense references on the full table gradient."""

import pytest
import torch
import torch.nn.functional as F

from hybridrec.model.embedding import EmbeddingBagCollection, TableConfig
from hybridrec.model.id_groups import aggregate_rows
from hybridrec.sparse.keyed_jagged import KeyedJagged
from hybridrec.train.loop.sparse_optim import (
    LazyAdam,
    RowWiseAdagrad,
    SparseSGD,
    build_sparse_optimizer,
)

ROWS, DIM = 7, 3


def _setup(pooling="sum"):
    torch.manual_seed(0)
    tables = [TableConfig(name=n, num_embeddings=ROWS, embedding_dim=DIM, pooling=pooling) for n in "ab"]
    return EmbeddingBagCollection(tables)


def _batch(seed):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, 4, (2 * 5,), generator=g).to(torch.int32)
    values = torch.randint(0, ROWS, (int(lengths.sum()),), generator=g)
    return KeyedJagged(["a", "b"], values, lengths), torch.randn(5, 2 * DIM, generator=g)


def _dense_grads(ebc, kjt, coef, pooling):
    """Dense [ROWS, DIM] gradient of sum(pooled * coef) per table, by autograd."""
    out = {}
    for i, name in enumerate("ab"):
        w = ebc.table_weight(name).detach().clone().requires_grad_()
        vals, lens = kjt.split_by_key()[name]
        off = torch.zeros(lens.numel() + 1, dtype=torch.int64)
        off[1:] = torch.cumsum(lens, 0)
        pooled = F.embedding_bag(vals, w, off, mode=pooling, include_last_offset=True)
        (pooled * coef[:, i * DIM : (i + 1) * DIM]).sum().backward()
        out[name] = w.grad
    return out


def _run(ebc, opt, seeds, reference_update, pooling="sum"):
    ref = {n: ebc.table_weight(n).detach().clone() for n in "ab"}
    state = {}
    for step, seed in enumerate(seeds, 1):
        kjt, coef = _batch(seed)
        grads = _dense_grads(ebc, kjt, coef, pooling)
        (ebc(kjt).values * coef).sum().backward()
        opt.step(ebc.pop_sparse_grads())
        for n in "ab":
            reference_update(ref[n], grads[n], state.setdefault(n, {}), step)
            torch.testing.assert_close(ebc.table_weight(n), ref[n], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("pooling", ["sum", "mean"])
def test_sgd_equals_dense_sgd(pooling):
    ebc = _setup(pooling)

    def ref(w, g, state, step):
        w -= 0.3 * g

    _run(ebc, SparseSGD(ebc, lr=0.3), [1, 2, 3], ref, pooling)


def test_rowwise_adagrad_equals_dense_reference():
    ebc = _setup()

    def ref(w, g, state, step):
        acc = state.setdefault("acc", torch.zeros(ROWS))
        acc += g.pow(2).mean(1)
        w -= 0.2 * g / (acc.sqrt() + 1e-8).unsqueeze(1)

    _run(ebc, RowWiseAdagrad(ebc, lr=0.2), [4, 5, 6], ref)


def test_lazy_adam_updates_only_touched_rows():
    ebc = _setup()
    b1, b2, lr, eps = 0.9, 0.999, 0.05, 1e-8

    def ref(w, g, state, step):
        m = state.setdefault("m", torch.zeros(ROWS, DIM))
        v = state.setdefault("v", torch.zeros(ROWS, DIM))
        touched = g.abs().sum(1) > 0
        m[touched] = b1 * m[touched] + (1 - b1) * g[touched]
        v[touched] = b2 * v[touched] + (1 - b2) * g[touched] ** 2
        upd = lr / (1 - b1**step) * m / ((v / (1 - b2**step)).sqrt() + eps)
        w[touched] -= upd[touched]

    _run(ebc, LazyAdam(ebc, lr=lr), [7, 8, 9, 10], ref)


def test_aggregate_rows_sums_duplicates():
    ids = torch.tensor([3, 1, 3, 3, 0])
    rows = torch.arange(10, dtype=torch.float32).view(5, 2)
    u, s = aggregate_rows(ids, rows)
    assert u.tolist() == [0, 1, 3]
    assert s.tolist() == [[8, 9], [2, 3], [0 + 4 + 6, 1 + 5 + 7]]


@pytest.mark.parametrize("name", ["sgd", "rowwise_adagrad", "lazy_adam"])
def test_state_dict_round_trip(name):
    ebc = _setup()
    opt = build_sparse_optimizer(name, ebc, lr=0.1)
    kjt, coef = _batch(11)
    (ebc(kjt).values * coef).sum().backward()
    opt.step(ebc.pop_sparse_grads())
    sd = opt.state_dict()
    assert set(sd["tables"]) == {"a", "b"}
    fresh = build_sparse_optimizer(name, ebc, lr=0.5)
    fresh.load_state_dict(sd)
    assert fresh.lr == 0.1 and fresh.step_count == 1
    for n, tensors in sd["tables"].items():
        for k, v in tensors.items():
            torch.testing.assert_close(fresh.state_dict()["tables"][n][k], v)
    with pytest.raises(ValueError):
        build_sparse_optimizer("sgd" if name != "sgd" else "lazy_adam", ebc, lr=0.1).load_state_dict(sd)


def test_unknown_optimizer():
    with pytest.raises(ValueError, match="unknown sparse optimizer"):
        build_sparse_optimizer("adamw", _setup(), lr=0.1)
