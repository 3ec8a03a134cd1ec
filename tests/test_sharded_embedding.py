"""Sharded training on 2-4 gloo ranks equals single-process training on the global batch."""

import pytest
import torch
import torch.nn.functional as F
from distributed import run_ranks

from hybridrec.model.dlrm import DLRM
from hybridrec.model.embedding import EmbeddingBagCollection, TableConfig
from hybridrec.parallel import plan as P
from hybridrec.parallel.dense_sync import DDPSync, NoSync
from hybridrec.parallel.parallelize import parallelize_dlrm
from hybridrec.sparse.keyed_jagged import Batch, KeyedJagged
from hybridrec.train.loop.sparse_optim import combined_sparse_optimizer
from hybridrec.train.loop.step import training_step

pytestmark = pytest.mark.distributed

DIM, STEPS, GLOBAL_B = 4, 3, 12
TABLES = [("t0", 23), ("t1", 40), ("t2", 7)]


def tables(pooling="sum"):
    return [TableConfig(name=n, num_embeddings=r, embedding_dim=DIM, features=[f"f_{n}"], pooling=pooling)
            for n, r in TABLES]


def make_plan(kind, world):
    lw = 2 if kind == "table_row_wise" else world  # two host groups of 2 when world is 4
    tp = {}
    for i, (n, rows) in enumerate(TABLES):
        k = {"mixed": ["row_wise", "column_wise", "data_parallel"],  # the receiver adds row-wise partials
             "mixed_placed": ["table_wise", "column_wise", "data_parallel"]}.get(kind, [kind] * 3)[i]
        if k == "table_wise":
            tp[n] = P.table_wise(n, rows, DIM, i % world)
        elif k == "row_wise":
            tp[n] = P.row_wise(n, rows, DIM, list(range(world)))
        elif k == "column_wise":
            tp[n] = P.column_wise(n, rows, DIM, [(i + j) % world for j in range(2)])
        elif k == "table_row_wise":
            host = i % (world // lw)
            tp[n] = P.table_row_wise(n, rows, DIM, list(range(host * lw, (host + 1) * lw)))
        else:
            tp[n] = P.data_parallel(n, rows, DIM, world)
    plan = P.ShardingPlan(world_size=world, local_world_size=lw, tables=tp)
    plan.validate()
    return plan


def global_batches(multi_hot):
    g = torch.Generator().manual_seed(123)
    out = []
    for _ in range(STEPS):
        keys = [f"f_{n}" for n, _ in TABLES]
        if multi_hot:
            lengths = torch.randint(0, 4, (len(TABLES), GLOBAL_B), generator=g)  # empty bags too
        else:
            lengths = torch.ones(len(TABLES), GLOBAL_B, dtype=torch.int64)
        vals = [torch.randint(0, r, (int(lengths[i].sum()),), generator=g) for i, (_, r) in enumerate(TABLES)]
        out.append((keys, vals, lengths, torch.randn(GLOBAL_B, 3, generator=g),
                    torch.randint(0, 2, (GLOBAL_B,), generator=g).float()))
    return out


def local_batch(b, lo, hi):
    keys, vals, lengths, dense, labels = b
    vs, ls = [], []
    for i in range(len(keys)):
        off = torch.cat([torch.zeros(1, dtype=torch.int64), lengths[i].cumsum(0)])
        vs.append(vals[i][off[lo] : off[hi]])
        ls.append(lengths[i][lo:hi])
    return Batch(dense[lo:hi], KeyedJagged.from_lengths_per_key(keys, vs, ls), labels[lo:hi])


def build(pooling, interaction="dot"):
    torch.manual_seed(0)
    ebc = EmbeddingBagCollection(tables(pooling), seed=7)
    return DLRM(num_dense=3, sparse=ebc, bottom_mlp=[8, DIM], top_mlp=[6, 1], interaction=interaction,
                dcn_layers=2, dcn_rank=2)


def train(model, opts, batches, lo, hi, pipeline=False, sync=None):
    """The trainer's step over ``batches`` (rows ``lo:hi`` of each); ``sync``: the dense
    synchronization the model was parallelized with (None: one process)."""
    dense_opt, sparse_opts = opts
    losses = []
    local = [local_batch(b, lo, hi) for b in batches]
    pending = model.sparse.start_input_dist(local[0].sparse) if pipeline else None
    for i, batch in enumerate(local):
        # The next batch's ids travel during this step.
        nxt = model.sparse.start_input_dist(local[i + 1].sparse) if pipeline and i + 1 < len(local) else None
        losses.append(training_step(model, batch, dense_opt=dense_opt, sparse_opt=sparse_opts,
                                    dense_sync=sync or NoSync(), pending=pending).item())
        pending = nxt
    return losses


def full_tables_from_shards(shards):
    out = {}
    for rank_shards in shards:
        for key, (shard, w) in rank_shards.items():
            name = key.split("@")[0]
            t = out.setdefault(name, torch.full((dict(TABLES)[name], DIM), float("nan")))
            t[shard.rows[0]:shard.rows[1], shard.cols[0]:shard.cols[1]] = w
    return out


def plan_topology(topo, plan):
    """``topo`` with the plan's host groups (table_row_wise sums inside them); the ranks
    start with one host group of every rank."""
    if plan.local_world_size == topo.local_world_size:
        return topo
    from hybridrec.parallel.topology import Topology

    return Topology.init(backend="gloo", local_world_size=plan.local_world_size)


def worker(topo, kind, sparse_opt, multi_hot, pooling, pipeline=False, exchange="collective", interaction="dot"):
    plan = make_plan(kind, topo.group_size)
    topo = plan_topology(topo, plan)
    topo.exchange = exchange
    sync = DDPSync(topo)
    model = parallelize_dlrm(build(pooling, interaction), plan, topo, dense_sync=sync)
    dense_opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    sparse = combined_sparse_optimizer(sparse_opt, model.sparse, lr=0.1)
    per = GLOBAL_B // topo.group_size
    lo = topo.rank * per
    losses = train(model, (dense_opt, sparse), global_batches(multi_hot), lo, lo + per, pipeline, sync)
    shards = {k: (s, w.detach().clone()) for k, (s, w) in model.sparse.local_shards().items()}
    dense = {k: v.detach().clone() for k, v in model.state_dict().items() if "sparse" not in k}
    return losses, shards, dense


def reference(sparse_opt, multi_hot, pooling, interaction="dot"):
    model = build(pooling, interaction)
    dense_opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    sparse = combined_sparse_optimizer(sparse_opt, model.sparse, lr=0.1)
    losses = train(model, (dense_opt, sparse), global_batches(multi_hot), 0, GLOBAL_B)
    return losses, model


CASES = [
    ("table_wise", 2, "sgd", False, "sum"),
    ("row_wise", 2, "rowwise_adagrad", True, "sum"),
    ("row_wise", 3, "sgd", True, "mean"),
    ("column_wise", 2, "sgd", True, "sum"),
    ("column_wise", 3, "lazy_adam", True, "mean"),
    ("table_row_wise", 4, "rowwise_adagrad", True, "sum"),
    ("data_parallel", 2, "rowwise_adagrad", True, "sum"),
    ("mixed", 4, "sgd", True, "mean"),
    ("table_wise", 4, "sgd", True, "sum"),  # fewer tables than ranks: rank 3 owns nothing
]


@pytest.mark.parametrize("kind, world, sparse_opt, multi_hot, pooling", CASES)
def test_sharded_equals_single_process(kind, world, sparse_opt, multi_hot, pooling):
    check_against_reference(kind, world, sparse_opt, multi_hot, pooling, pipeline=False)


@pytest.mark.parametrize("kind, world", [("row_wise", 2), ("mixed", 4)])
def test_pipelined_input_dist_changes_nothing(kind, world):
    """The next batch's input_dist started before the current step: same result."""
    check_against_reference(kind, world, "sgd", True, "sum", pipeline=True)


def check_against_reference(kind, world, sparse_opt, multi_hot, pooling, pipeline, exchange="collective",
                             interaction="dot"):
    results = run_ranks(worker, world, kind, sparse_opt, multi_hot, pooling, pipeline, exchange, interaction)
    ref_losses, ref = reference(sparse_opt, multi_hot, pooling, interaction)
    mean_losses = [sum(r[0][s] for r in results) / world for s in range(STEPS)]
    torch.testing.assert_close(torch.tensor(mean_losses), torch.tensor(ref_losses), rtol=1e-5, atol=1e-6)
    full = full_tables_from_shards([r[1] for r in results])
    for name, _ in TABLES:
        assert not torch.isnan(full[name]).any(), name
        torch.testing.assert_close(full[name], ref.sparse.table_weight(name), rtol=1e-5, atol=1e-6)
    ref_dense = {k: v for k, v in ref.state_dict().items() if "sparse" not in k}
    for r in results:
        got = {k.replace(".module", ""): v for k, v in r[2].items()}
        for k, v in ref_dense.items():
            torch.testing.assert_close(got[k], v, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kind, world, sparse_opt", [("mixed", 4, "sgd"), ("table_row_wise", 4, "rowwise_adagrad")])
def test_the_cross_network_trains_sharded_as_in_one_process(kind, world, sparse_opt):
    """DLRM-DCNv2 (2 cross layers of rank 2 over the 4 x 4 inputs): its weights are dense
    parameters all-reduced like the MLPs', fed by every sharding type's pooled vectors; every
    rank ends with the single process's cross weights, tables and losses. (Not row-wise
    Adagrad with "mixed": its column shards keep one accumulator each, by design not exact.)"""
    check_against_reference(kind, world, sparse_opt, True, "sum", pipeline=False, interaction="dcn")


@pytest.mark.parametrize("kind, world", [("mixed", 3)])
def test_pairwise_exchange_changes_nothing(kind, world):
    """The output all-to-all as receive-first isend/irecv: the same result."""
    check_against_reference(kind, world, "sgd", True, "sum", pipeline=True, exchange="pairwise")


def api_worker(topo):
    import torch.distributed as dist

    per = GLOBAL_B // topo.group_size
    batch = local_batch(global_batches(True)[0], topo.rank * per, (topo.rank + 1) * per)
    model = parallelize_dlrm(build("sum"), make_plan("mixed", topo.group_size), topo)
    sparse = model.sparse
    pending = sparse.start_input_dist(batch.sparse)
    F.binary_cross_entropy_with_logits(model(batch, sparse_input=pending), batch.labels).backward()
    with pytest.raises(RuntimeError, match="already consumed"):  # raises before any collective
        model(batch, sparse_input=pending)
    names = ("all_reduce", "all_to_all_single", "all_gather", "broadcast")
    saved = {n: getattr(dist, n) for n in names}

    def refuse(*args, **kwargs):
        raise AssertionError("pop_sparse_grads communicated")

    for n in names:
        setattr(dist, n, refuse)
    try:
        grads = sparse.pop_sparse_grads()
    finally:
        for n, f in saved.items():
            setattr(dist, n, f)
    assert set(grads) == {"shards", "replicated"}
    own = [(g, ids.clone(), rows.clone()) for g, ids, rows, _ in grads["replicated"]]
    reduced = sparse.reduce_sparse_grads(grads)
    assert reduced["shards"] is grads["shards"] and all(u for *_, u in reduced["replicated"])
    row_wise = parallelize_dlrm(build("sum"), make_plan("row_wise", topo.group_size), topo).sparse
    untouched = row_wise.pop_sparse_grads()
    assert set(untouched) == {"shards"} and row_wise.reduce_sparse_grads(untouched) is untouched

    def dense(entries):
        out = torch.zeros_like(sparse.replicated.group_weight(0))
        for g, ids, rows, *_ in entries:
            assert g == 0
            out.index_add_(0, ids, rows)
        return out

    return dense(own), dense(reduced["replicated"])


def test_row_gradients_popped_locally_then_reduced_explicitly():
    """pop_sparse_grads communicates nothing (each rank's own replicated rows);
    reduce_sparse_grads sums them over ranks; a handle serves one forward."""
    results = run_ranks(api_worker, 2)
    total = sum(own for own, _ in results)
    for _, reduced in results:
        torch.testing.assert_close(reduced, total)


def zero_start_worker(topo, kind):
    from hybridrec.parallel.sharded_embedding import ShardedEmbeddingBagCollection

    plan = make_plan(kind, topo.group_size)
    drawn = ShardedEmbeddingBagCollection(tables(), plan, topo, seed=7)
    zeros = ShardedEmbeddingBagCollection(tables(), plan, topo, seed=7, init_values=False)
    parts = [(a, b) for a, b in ((drawn.local, zeros.local), (drawn.replicated, zeros.replicated)) if a is not None]
    assert parts and all(b.group_weight(g).count_nonzero() == 0 for _, b in parts for g in range(b.num_groups))
    zeros.reset_parameters()
    return all(torch.equal(a.group_weight(g), b.group_weight(g)) and a.group_weight(g).count_nonzero() > 0
               for a, b in parts for g in range(a.num_groups))


@pytest.mark.parametrize("kind", ["mixed", "table_wise"])
def test_tables_built_as_zeros_then_reset_get_the_drawn_values(kind):
    """``init_values=False`` (a resumed run: its checkpoint overwrites the tables) leaves
    every shard and replica zero; ``reset_parameters`` then draws exactly the values of
    the tables built with them."""
    assert run_ranks(zero_start_worker, 2, kind) == [True, True]
