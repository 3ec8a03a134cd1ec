"""DeepFM: first-order and FM terms, their sparse gradients, and DES on 2-4 gloo ranks."""

import pytest
import torch
import torch.nn.functional as F

from distributed import run_ranks
from hybridrec.comm.ledger import CommLedger
from hybridrec.model.deepfm import DeepFM
from hybridrec.model.embedding import EmbeddingBagCollection, TableConfig
from hybridrec.parallel import plan as P
from hybridrec.parallel.cost_model import predict_step_bytes
from hybridrec.parallel.parallelize import parallelize_dlrm
from hybridrec.sparse.keyed_jagged import Batch, KeyedJagged
from hybridrec.train.sparse_optim import build_sparse_optimizer

K, GLOBAL_B, STEPS = 4, 12, 3
TABLES = [("t0", 23), ("t1", 40), ("t2", 7)]


def tables():
    return [TableConfig(name=n, num_embeddings=r, embedding_dim=K + 1, features=[f"f_{n}"], fm_cols=K)
            for n, r in TABLES]


def build():
    torch.manual_seed(0)
    return DeepFM(num_dense=3, sparse=EmbeddingBagCollection(tables(), seed=7), bottom_mlp=[8, K],
                  top_mlp=[6, 1])


def global_batches(multi_hot=True, steps=STEPS):
    g = torch.Generator().manual_seed(5)
    out = []
    for _ in range(steps):
        if multi_hot:
            lengths = torch.randint(0, 4, (len(TABLES), GLOBAL_B), generator=g)  # empty bags too
        else:
            lengths = torch.ones(len(TABLES), GLOBAL_B, dtype=torch.int64)
        vals = [torch.randint(0, r, (int(lengths[i].sum()),), generator=g) for i, (_, r) in enumerate(TABLES)]
        out.append((vals, lengths, torch.randn(GLOBAL_B, 3, generator=g),
                    torch.randint(0, 2, (GLOBAL_B,), generator=g).float()))
    return out


def local_batch(b, lo, hi):
    vals, lengths, dense, labels = b
    vs, ls = [], []
    for i in range(len(TABLES)):
        off = torch.cat([torch.zeros(1, dtype=torch.int64), lengths[i].cumsum(0)])
        vs.append(vals[i][off[lo] : off[hi]])
        ls.append(lengths[i][lo:hi])
    kjt = KeyedJagged.from_lengths_per_key([f"f_{n}" for n, _ in TABLES], vs, ls)
    return Batch(dense[lo:hi], kjt, labels[lo:hi])


def reference_logits(model, weights, batch):
    """DeepFM written out with plain autograd over dense tables (per-id FM)."""
    kjt, b = batch.sparse, batch.labels.shape[0]
    parts = kjt.split_by_key()
    fields, z, q = [], torch.zeros(b), torch.zeros(b)
    for (n, _), w in zip(TABLES, weights):
        ids, lengths = parts[f"f_{n}"]
        bag = torch.repeat_interleave(torch.arange(b), lengths.to(torch.int64))
        rows = w[ids]
        fields.append(torch.zeros(b, K).index_add(0, bag, rows[:, :K]))
        z = z + torch.zeros(b).index_add(0, bag, rows[:, K])
        q = q + torch.zeros(b).index_add(0, bag, rows[:, :K].pow(2).sum(1))
    e = torch.stack(fields, 1)
    deep = model.top(model.interaction(model.bottom(batch.dense), e)).squeeze(1)
    return deep + z + 0.5 * (e.sum(1).pow(2).sum(1) - q)


@pytest.mark.parametrize("multi_hot", [False, True])
def test_sparse_row_gradients_equal_dense_autograd(multi_hot):
    model = build()
    batch = local_batch(global_batches(multi_hot, 1)[0], 0, GLOBAL_B)
    loss = F.binary_cross_entropy_with_logits(model(batch), batch.labels)
    loss.backward()
    got = {}
    for group, ids, rows, _ in model.sparse.pop_sparse_grads():
        full = torch.zeros_like(model.sparse.group_weight(group))
        got[group] = full.index_add_(0, ids, rows)
    weights = [model.sparse.table_weight(n).detach().clone().requires_grad_() for n, _ in TABLES]
    ref = F.binary_cross_entropy_with_logits(reference_logits(model, weights, batch), batch.labels)
    torch.testing.assert_close(loss, ref)
    ref.backward()
    for (n, _), w in zip(TABLES, weights):
        g, start, rows = model.sparse.table_slice(n)
        torch.testing.assert_close(got[g][start : start + rows], w.grad, rtol=1e-5, atol=1e-7)


def make_plan(kind, world):
    tp = {}
    for i, (n, rows) in enumerate(TABLES):
        k = kind if kind != "mixed" else ["row_wise", "column_wise", "data_parallel"][i]
        if k == "table_wise":
            tp[n] = P.table_wise(n, rows, K + 1, i % world)
        elif k == "row_wise":
            tp[n] = P.row_wise(n, rows, K + 1, list(range(world)))
        elif k == "column_wise":  # shards of 3 and 2 columns: the second holds the first-order column
            tp[n] = P.column_wise(n, rows, K + 1, [(i + j) % world for j in range(2)])
        else:
            tp[n] = P.data_parallel(n, rows, K + 1, world)
    plan = P.ShardingPlan(world_size=world, local_world_size=world, tables=tp)
    plan.validate()
    return plan


def train(model, sparse_opts, batches, lo, hi):
    dense_opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.05)
    losses = []
    for b in batches:
        batch = local_batch(b, lo, hi)
        loss = F.binary_cross_entropy_with_logits(model(batch), batch.labels)
        dense_opt.zero_grad()
        loss.backward()
        dense_opt.step()
        for o in sparse_opts:
            o.step()
        losses.append(loss.item())
    return losses


def worker(topo, kind, sparse_opt):
    ledger = CommLedger()
    model = parallelize_dlrm(build(), make_plan(kind, topo.world_size), topo, ledger=ledger)
    opts = [build_sparse_optimizer(sparse_opt, c, lr=0.05) for c in model.sparse.collections()]
    per = GLOBAL_B // topo.world_size
    losses = train(model, opts, global_batches(), topo.rank * per, (topo.rank + 1) * per)
    shards = {k: (s, w.detach().clone()) for k, (s, w) in model.sparse.local_shards().items()}
    counted = {d: (ledger.totals(category="output_dist", direction=d).sent // STEPS,
                   ledger.totals(category="output_dist", direction=d).received // STEPS) for d in ("fwd", "bwd")}
    pred = predict_step_bytes(make_plan(kind, topo.world_size), tables(), rank=topo.rank,
                              batch_sizes=[per] * topo.world_size)
    predicted = {d: pred.get(("output_dist", d), (0, 0)) for d in ("fwd", "bwd")}
    return losses, shards, (counted, predicted), model.sparse._widths


@pytest.mark.distributed
@pytest.mark.parametrize("kind, world, sparse_opt", [
    ("table_wise", 2, "sgd"), ("row_wise", 3, "rowwise_adagrad"), ("column_wise", 2, "sgd"), ("mixed", 4, "sgd"),
])
def test_des_deepfm_equals_single_process(kind, world, sparse_opt):
    results = run_ranks(worker, world, kind, sparse_opt)
    ref = build()
    ref_losses = train(ref, [build_sparse_optimizer(sparse_opt, ref.sparse, lr=0.05)], global_batches(), 0, GLOBAL_B)
    mean = [sum(r[0][s] for r in results) / world for s in range(STEPS)]
    torch.testing.assert_close(torch.tensor(mean), torch.tensor(ref_losses), rtol=1e-5, atol=1e-6)
    for n, rows in TABLES:
        full = torch.full((rows, K + 1), float("nan"))
        for r in results:
            for key, (sh, w) in r[1].items():
                if key.split("@")[0] == n:
                    full[sh.rows[0] : sh.rows[1], sh.cols[0] : sh.cols[1]] = w
        torch.testing.assert_close(full, ref.sparse.table_weight(n), rtol=1e-5, atol=1e-6)
    for r in results:  # the cost model knows the DES layout: predicted == counted
        assert r[2][0] == r[2][1], r[2]
    # DES: an owner sends its pieces' embedding columns plus [z_p, q_p], never the
    # first-order column: K floats per field piece + 2 per owner per sample.
    widths = results[0][3]
    for r, w in enumerate(widths):
        owned = [s for s in make_plan(kind, world).tables.values() for sh in s.shards if sh.rank == r
                 and s.sharding_type != "data_parallel"]
        if owned:
            cols = sum(sh.num_cols - (sh.cols[0] <= K < sh.cols[1])
                       for s in owned for sh in s.shards if sh.rank == r)
            assert w == cols + 2, (r, w, cols)
