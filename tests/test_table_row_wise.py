"""table_row_wise: rows split over one host group, the partial pooled sums reduced inside
the host before they cross hosts.

One process: the layout (who serves whom, what travels) and the byte formulas. Gloo
ranks (4 in two hosts of 2; 2 in hosts of 1 and of 2): forward, row gradients and the
sparse optimizer step equal one EmbeddingBagCollection; with codecs on the cross-host hop
too; the ledger counts exactly the predicted bytes, fewer across hosts than row_wise
(in-host bytes under ``trw_intra``); a TRW model's checkpoint round-trips; DeepFM with
TRW tables trains like one process."""

from pathlib import Path

import pytest
import torch
from distributed import run_ranks

from hybridrec.comm.codecs import make_codec
from hybridrec.comm.ledger import CommLedger
from hybridrec.model.embedding import EmbeddingBagCollection, TableConfig, output_features
from hybridrec.parallel import plan as P
from hybridrec.parallel.cost_model import cross_host_bytes, predict_step_bytes
from hybridrec.parallel.layout import build_layout
from hybridrec.parallel.sharded_embedding import ShardedEmbeddingBagCollection
from hybridrec.parallel.topology import Topology
from hybridrec.sparse.keyed_jagged import KeyedJagged
from hybridrec.train.loop.sparse_optim import combined_sparse_optimizer

SEED, LR = 7, 0.1
# (name, rows, dim, features, pooling). On host 0, rank 1 holds "a" (dim 4) ahead of the
# TRW tables "b" (dim 8) and "d" (dim 4): its fused-group output order puts "d" before
# "b", rank 0's "b" before "d"; the in-host sum must still add "b" to "b".
TABLES = [("a", 11, 4, ["fa"], "sum"), ("b", 23, 8, ["fb1", "fb2"], "sum"),
          ("c", 40, 4, ["fc"], "sum"), ("d", 7, 4, ["fd"], "mean"), ("e", 13, 4, ["fe"], "sum")]
BATCH = {2: [5, 7], 4: [2, 3, 4, 3]}  # uneven local batches


def tables():
    return [TableConfig(name=n, num_embeddings=r, embedding_dim=d, features=f, pooling=p)
            for n, r, d, f, p in TABLES]


def host(h, lw):
    return list(range(h * lw, (h + 1) * lw))


def make_plan(world, lw, kind="table_row_wise"):
    """a: table-wise on rank 1; b, d: ``kind`` on host 0; c: on the last host; e: row-wise
    over every rank."""
    last = world // lw - 1
    split = P.table_row_wise if kind == "table_row_wise" else P.row_wise
    tp = {"a": P.table_wise("a", 11, 4, 1), "b": split("b", 23, 8, host(0, lw)),
          "c": split("c", 40, 4, host(last, lw)), "d": split("d", 7, 4, host(0, lw)),
          "e": P.row_wise("e", 13, 4, list(range(world)))}
    plan = P.ShardingPlan(world_size=world, local_world_size=lw, tables=tp)
    plan.validate()
    return plan


def global_batch(batch_sizes, step=0):
    """Multi-hot bags (empty ones too) over every feature; ``(kjt_of(rank), weights)``:
    every rank's slice of the global batch and fixed output weights ``[B, sum(dims)]``."""
    g = torch.Generator().manual_seed(11 + step)
    total = sum(batch_sizes)
    keys, vals, lens = [], [], []
    for _, rows, _, feats, _ in TABLES:
        for f in feats:
            ln = torch.randint(0, 4, (total,), generator=g)
            keys.append(f)
            lens.append(ln)
            vals.append(torch.randint(0, rows, (int(ln.sum()),), generator=g))
    width = sum(d * len(f) for _, _, d, f, _ in TABLES)
    weights = torch.randn(total, width, generator=g)

    def kjt_of(lo, hi):
        vs, ls = [], []
        for v, ln in zip(vals, lens):
            off = torch.cat([torch.zeros(1, dtype=torch.int64), ln.cumsum(0)])
            vs.append(v[off[lo] : off[hi]])
            ls.append(ln[lo:hi])
        return KeyedJagged.from_lengths_per_key(keys, vs, ls)

    return kjt_of, weights


def dense_grads(ebc, grads, names):
    """Row gradients ``[(group, ids, rows, unique)]`` -> ``{table: [rows, dim]}``."""
    by_group = {g: torch.zeros_like(ebc.group_weight(g)) for g in range(ebc.num_groups)}
    for g, ids, rows, _ in grads:
        by_group[g].index_add_(0, ids, rows)
    out = {}
    for n in names:
        g, start, rows = ebc.table_slice(n)
        out[n] = by_group[g][start : start + rows]
    return out


def reference(batch_sizes, scale, weights_of=None):
    """One EmbeddingBagCollection on the global batch: ``(output, row gradients per table,
    tables after one rowwise_adagrad step)``; the loss is ``sum(out * w) * scale`` (ranks
    scale by 1/world)."""
    kjt_of, weights = global_batch(batch_sizes)
    ebc = EmbeddingBagCollection(tables(), seed=SEED)
    out = ebc(kjt_of(0, sum(batch_sizes)))
    w = weights if weights_of is None else weights_of(weights)
    (out.values * w).sum().mul(scale).backward()
    grads = ebc.pop_sparse_grads()
    names = [t[0] for t in TABLES]
    dense = dense_grads(ebc, grads, names)
    combined_sparse_optimizer("rowwise_adagrad", ebc, lr=LR).step({"tables": grads})
    return out.values.detach(), dense, {n: ebc.table_weight(n).detach().clone() for n in names}


def sharded_step(topo, plan, ledger=None, codecs=None):
    """This rank's ``(output rows, row gradients per shard, shards after one
    rowwise_adagrad step)``; the loss is ``sum(out * w)`` over its own samples."""
    sizes = BATCH[topo.group_size]
    kjt_of, weights = global_batch(sizes)
    lo = sum(sizes[: topo.rank])
    sharded = ShardedEmbeddingBagCollection(tables(), plan, topo, seed=SEED, ledger=ledger, codecs=codecs)
    opt = combined_sparse_optimizer("rowwise_adagrad", sharded, lr=LR)
    out = sharded(kjt_of(lo, lo + sizes[topo.rank]))
    (out.values * weights[lo : lo + sizes[topo.rank]]).sum().backward()
    grads = sharded.pop_sparse_grads()
    shards = sharded.local_shards()
    local = dense_grads(sharded.local, grads["shards"], [k for k in shards if not k.endswith("@*")])
    opt.step(sharded.reduce_sparse_grads(grads))
    if ledger is not None:
        ledger.step_end()
    return (out.values.detach(), {k: (shards[k][0], g) for k, g in local.items()},
            {k: (s, w.detach().clone()) for k, (s, w) in shards.items()})


def assemble(per_rank):
    """``[{"t@i": (shard, tensor)}]`` of every rank -> ``{t: whole tensor}`` (NaN: missing)."""
    out = {n: torch.full((r, d), float("nan")) for n, r, d, _, _ in TABLES}
    for shards in per_rank:
        for key, (s, x) in shards.items():
            out[key.split("@")[0]][s.rows[0] : s.rows[1], s.cols[0] : s.cols[1]] = x
    return out


# -- one process ------------------------------------------------------------------------
def test_layout_routes_host_sums_to_the_same_local_rank_of_every_host():
    lay = build_layout(tables(), make_plan(4, 2))
    assert [lay.has_trw(h) for h in range(2)] == [True, True]
    assert [lay.served(r) for r in range(4)] == [(0, 2), (1, 3), (0, 2), (1, 3)]
    # Rank 0 sends rank 2 its own block then host 0's sums; rank 1 and rank 3 only their blocks.
    assert lay.segments(0, 2) == (0, 5) and lay.segments(1, 2) == (1,) and lay.segments(3, 0) == (3,)
    assert lay.segments(2, 0) == (2, 6) and lay.segments(0, 0) == (0, 5)
    # TRW features come whole from one host block; the owners' blocks hold none of them.
    b, c = lay.feature_names.index("fb1"), lay.feature_names.index("fc")
    assert lay.assembly[b] == ((5, 0, 0),) and lay.assembly[c] == ((6, 0, 0),)
    assert not lay.row_split[b] and lay.row_split[lay.feature_names.index("fe")]
    assert [p.feature for p in lay.host_blocks[0].pieces] == ["fb1", "fb2", "fd"]
    # Member 1's own output order differs ("a", "d", "e" fused, then "b"): same TRW pieces.
    for r in (0, 1):
        assert [(p.feature, p.width) for p in lay.trw_blocks[r].pieces] == [("fb1", 8), ("fb2", 8), ("fd", 4)]
        assert all(s.trw == (s.table in "bd") for s in lay.slots[r])
    # Rank 1's output: fa 0-3, fd 4-7, fe 8-11, fb1 12-19, fb2 20-27.
    assert lay.trw_blocks[1].field_cols == tuple(range(12, 28)) + (4, 5, 6, 7)
    assert lay.widths == (4, 4 + 4, 4, 4)  # "e" everywhere, "a" on rank 1


def test_table_row_wise_must_cover_one_whole_host_group():
    t = [TableConfig(name="t", num_embeddings=10, embedding_dim=4)]
    partial = P.ShardingPlan(world_size=4, local_world_size=2,
                             tables={"t": P.table_row_wise("t", 10, 4, [2])})
    with pytest.raises(ValueError, match=r"table 't': table_row_wise needs one shard on every rank"):
        build_layout(t, partial)


# The ledger case: one table of dim 8 on host 0 (ranks 0 and 1) of 4 ranks in hosts of 2,
# local batches 2, 3, 4, 5: member 0 serves ranks 0 and 2 (6 rows), member 1 ranks 1 and 3
# (8 rows); 32 bytes per row. Forward (the backward mirrors it):
#   table_row_wise: trw_intra 0 -> 1: 8 * 32 = 256, 1 -> 0: 6 * 32 = 192;
#                   output_dist 0 -> 2: 4 * 32 = 128, 1 -> 3: 5 * 32 = 160 (all across hosts);
#   row_wise:       output_dist 0 -> 1, 2, 3: (3 + 4 + 5) * 32 = 384, 1 -> 0, 2, 3: 11 * 32 = 352,
#                   of which across hosts (4 + 5) * 32 = 288 from each.
LEDGER_TABLE = [TableConfig(name="t", num_embeddings=40, embedding_dim=8, features=["ft"])]
LEDGER_BATCH = [2, 3, 4, 5]
TRW_COUNTS = [  # per rank: {(category, direction): (sent, received)}
    {("trw_intra", "fwd"): (256, 192), ("trw_intra", "bwd"): (192, 256),
     ("output_dist", "fwd"): (128, 0), ("output_dist", "bwd"): (0, 128)},
    {("trw_intra", "fwd"): (192, 256), ("trw_intra", "bwd"): (256, 192),
     ("output_dist", "fwd"): (160, 0), ("output_dist", "bwd"): (0, 160)},
    {("output_dist", "fwd"): (0, 128), ("output_dist", "bwd"): (128, 0)},
    {("output_dist", "fwd"): (0, 160), ("output_dist", "bwd"): (160, 0)},
]
RW_COUNTS = [
    {("output_dist", "fwd"): (384, 2 * 32), ("output_dist", "bwd"): (2 * 32, 384)},
    {("output_dist", "fwd"): (352, 3 * 32), ("output_dist", "bwd"): (3 * 32, 352)},
    {("output_dist", "fwd"): (0, 2 * 4 * 32), ("output_dist", "bwd"): (2 * 4 * 32, 0)},
    {("output_dist", "fwd"): (0, 2 * 5 * 32), ("output_dist", "bwd"): (2 * 5 * 32, 0)},
]


def ledger_plan(kind):
    make = P.table_row_wise if kind == "table_row_wise" else P.row_wise
    return P.ShardingPlan(world_size=4, local_world_size=2, tables={"t": make("t", 40, 8, [0, 1])})


def test_byte_formulas_split_in_host_from_cross_host():
    for kind, expected in (("table_row_wise", TRW_COUNTS), ("row_wise", RW_COUNTS)):
        for rank, counts in enumerate(expected):
            pred = predict_step_bytes(ledger_plan(kind), LEDGER_TABLE, rank=rank, batch_sizes=LEDGER_BATCH)
            got = {k: v for k, v in pred.items()  # (0, 0): a rank outside the TRW host
                   if k[0] in ("trw_intra", "output_dist") and v != (0, 0)}
            assert got == counts, (kind, rank, got)
    trw, rw = (cross_host_bytes(ledger_plan(kind), LEDGER_TABLE, batch_sizes=LEDGER_BATCH,
                                categories=("output_dist", "trw_intra"))
               for kind in ("table_row_wise", "row_wise"))
    assert trw == [(128, 128), (160, 160), (128, 128), (160, 160)]
    assert rw == [(288, 288), (288, 288), (256, 256), (320, 320)]
    # The same bytes in all; table_row_wise moves half of row_wise's across hosts (L = 2).
    assert sum(s for s, _ in trw) * 2 == sum(s for s, _ in rw)


# -- gloo ranks ---------------------------------------------------------------------------
def equality_worker(topo, lw, root):
    topo = Topology.init(backend="gloo", local_world_size=lw)  # hosts of lw ranks
    plan = make_plan(topo.group_size, lw)
    out = {"plain": sharded_step(topo, plan, ledger := CommLedger()),
           "plain_ledger": ledger.summary()["predicted_vs_counted"]}
    if topo.group_size == 4:
        # fp16 on "b" (a TRW table of host 0), lossless DCT on "c" (host 1): the sums are
        # coded once, by the member that serves the samples.
        codecs = {"b": make_codec("fp16"), "c": make_codec("dct", eta=1.0)}
        out["coded"] = sharded_step(topo, plan, ledger := CommLedger(), codecs)
        out["coded_ledger"] = ledger.summary()["predicted_vs_counted"]
        out["bytes"] = {}
        for kind in ("table_row_wise", "row_wise"):
            ledger = CommLedger()
            sharded = ShardedEmbeddingBagCollection(LEDGER_TABLE, ledger_plan(kind), topo, seed=SEED,
                                                    ledger=ledger)
            g = torch.Generator().manual_seed(topo.rank)
            b = LEDGER_BATCH[topo.rank]
            kjt = KeyedJagged.from_lengths_per_key(["ft"], [torch.randint(0, 40, (2 * b,), generator=g)],
                                                   [torch.full((b,), 2)])
            sharded(kjt).values.sum().backward()
            ledger.step_end()
            out["bytes"][kind] = {(e["category"], e["direction"]): (e["sent"], e["received"])
                                  for e in ledger.summary()["entries"]
                                  if e["category"] in ("output_dist", "trw_intra")}
        out["checkpoint"] = checkpoint_round_trip(topo, Path(root))
    return out


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory):
    return run_ranks(equality_worker, 4, 2, str(tmp_path_factory.mktemp("trw")), timeout_s=120)


def check_equal(results, world, key="plain"):
    sizes = BATCH[world]
    ref_out, ref_grads, ref_tables = reference(sizes, 1.0 / world)
    out = torch.cat([r[key][0] for r in results])
    torch.testing.assert_close(out, ref_out, rtol=1e-5, atol=1e-6)
    grads, after = assemble([r[key][1] for r in results]), assemble([r[key][2] for r in results])
    for n, *_ in TABLES:
        torch.testing.assert_close(grads[n], ref_grads[n], rtol=1e-5, atol=1e-7, msg=n)
        torch.testing.assert_close(after[n], ref_tables[n], rtol=1e-5, atol=1e-6, msg=n)


def check_ledger(cmp, lw):
    assert cmp and all(v["match"] for v in cmp.values()), cmp
    assert ("trw_intra" in cmp) == (lw > 1), cmp.keys()
    for v in cmp.values():
        assert v["predicted"] == v["counted"]


@pytest.mark.distributed
def test_four_ranks_in_two_hosts_equal_one_process(four_ranks):
    check_equal(four_ranks, 4)
    for r in four_ranks:
        check_ledger(r["plain_ledger"], 2)


@pytest.mark.distributed
def test_codecs_code_the_cross_host_sums(four_ranks):
    """fp16 on "b" (host 0's): the sums of host 1's samples cross hosts, rounded once, their
    gradients too (so the reference takes fp16-rounded output gradients there); the sums a
    member serves itself (host 0's samples) do not travel and stay exact, both ways; lossless
    DCT on "c": exact."""
    start = 0  # the output's columns of fb1 and fb2 (features in fused-group order)
    for f, d in output_features(tables()):
        if f == "fb1":
            break
        start += d
    cols, world = slice(start, start + 16), 4
    sizes = BATCH[world]
    far = slice(sum(sizes[:2]), sum(sizes))  # ranks 2 and 3's samples, served by ranks 0 and 1

    def rounded(w):
        w = w.clone()
        w[far, cols] = (w[far, cols] / world).half().float() * world  # exact: world is a power of 2
        return w

    ref_out, ref_grads, _ = reference(sizes, 1.0 / world, rounded)
    out = torch.cat([r["coded"][0] for r in four_ranks])
    torch.testing.assert_close(out[far, cols], ref_out[far, cols].half().float(), rtol=1e-3, atol=1e-4)
    assert not torch.allclose(out[far, cols], ref_out[far, cols], rtol=1e-5, atol=1e-6)  # (rounded)
    near = [i for i in range(out.shape[0]) if not far.start <= i < far.stop]
    torch.testing.assert_close(out[near], ref_out[near], rtol=1e-5, atol=1e-6)  # kept: not rounded
    rest = [i for i in range(out.shape[1]) if not start <= i < start + 16]
    torch.testing.assert_close(out[:, rest], ref_out[:, rest], rtol=1e-5, atol=1e-6)
    grads = assemble([r["coded"][1] for r in four_ranks])
    for n, *_ in TABLES:
        torch.testing.assert_close(grads[n], ref_grads[n], rtol=1e-5, atol=1e-7, msg=n)
    for r in four_ranks:
        check_ledger(r["coded_ledger"], 2)


@pytest.mark.distributed
def test_ledger_counts_fewer_cross_host_bytes_than_row_wise(four_ranks):
    for rank, r in enumerate(four_ranks):
        assert r["bytes"]["table_row_wise"] == TRW_COUNTS[rank], rank
        assert r["bytes"]["row_wise"] == RW_COUNTS[rank], rank


@pytest.mark.distributed
@pytest.mark.parametrize("lw", [1, 2])
def test_two_ranks_equal_one_process(lw):
    """Hosts of one rank: TRW is table-wise (nothing to sum, nothing in trw_intra); one host
    of two: everything is summed inside it, nothing crosses."""
    results = run_ranks(equality_worker, 2, lw, "")
    check_equal(results, 2)
    for r in results:
        check_ledger(r["plain_ledger"], lw)


# -- checkpoint -----------------------------------------------------------------------------
def checkpoint_round_trip(topo, root):
    """A DLRM with two TRW tables trains 2 steps, saves, trains 2 more; a fresh model
    (another seed) loads and trains the same 2 steps: the same state, step by step."""
    import test_sharded_checkpoint as ck

    from hybridrec.parallel.checkpoint import load_sharded, save_sharded

    t = ck.TABLES
    plan = P.ShardingPlan(world_size=4, local_world_size=2, tables={
        "t0": P.table_row_wise("t0", t["t0"], ck.DIM, [0, 1]),
        "t1": P.table_row_wise("t1", t["t1"], ck.DIM, [2, 3]),
        "t2": P.table_wise("t2", t["t2"], ck.DIM, 3), "t3": P.data_parallel("t3", t["t3"], ck.DIM, 4)})
    per = ck.GLOBAL_B // topo.group_size
    lo, hi = topo.rank * per, (topo.rank + 1) * per
    model, dense, sparse = ck.build(0, "rowwise_adagrad", plan, topo)
    ck.train(model, dense, sparse, ck.batches()[:2], lo, hi)
    save_sharded(root / "trw", model=model, dense_opt=dense, sparse_opts=sparse, extra={"step": 2}, topo=topo)
    saved = ck.snapshot(model, dense, sparse)
    ck.train(model, dense, sparse, ck.batches()[2:], lo, hi)
    m2, d2, s2 = ck.build(1, "rowwise_adagrad", plan, topo)
    extra = load_sharded(root / "trw", model=m2, dense_opt=d2, sparse_opts=s2, topo=topo)
    loaded = ck.snapshot(m2, d2, s2)
    ck.train(m2, d2, s2, ck.batches()[2:], lo, hi)
    return {"saved": saved, "loaded": loaded, "extra": extra, "continued": ck.snapshot(model, dense, sparse),
            "resumed": ck.snapshot(m2, d2, s2)}


@pytest.mark.distributed
def test_checkpoint_of_trw_shards_round_trips(four_ranks):
    import test_sharded_checkpoint as ck

    for rank, r in enumerate(four_ranks):
        c = r["checkpoint"]
        assert c["extra"]["step"] == 2
        ck.assert_same(c["saved"], c["loaded"], f"rank {rank} loaded")
        # Not bit for bit: the fresh model's DDP buckets its first step differently, and a
        # ring all-reduce over 4 ranks adds in another order (2 ranks cannot).
        ck.assert_same(c["continued"], c["resumed"], f"rank {rank} resumed", exact=False)


# -- DeepFM: [z_p, q_p] (and s_p when coded) are summed inside the host too ------------------
def deepfm_worker(topo, codec):
    import test_deepfm as fm

    from hybridrec.parallel.parallelize import parallelize_dlrm

    topo = Topology.init(backend="gloo", local_world_size=2)
    k = fm.K + 1
    plan = P.ShardingPlan(world_size=4, local_world_size=2, tables={
        "t0": P.table_row_wise("t0", 23, k, [0, 1]), "t1": P.table_row_wise("t1", 40, k, [2, 3]),
        "t2": P.table_wise("t2", 7, k, 1)})
    ledger = CommLedger()
    codecs = {} if codec is None else {"t0": make_codec(codec, eta=1.0), "t1": make_codec(codec, eta=1.0)}
    model = parallelize_dlrm(fm.build(), plan, topo, ledger=ledger, codecs=codecs)
    opts = combined_sparse_optimizer("sgd", model.sparse, lr=0.05)
    per = fm.GLOBAL_B // 4
    losses = fm.train(model, opts, fm.global_batches(), topo.rank * per, (topo.rank + 1) * per, ledger)
    shards = {n: (s, w.detach().clone()) for n, (s, w) in model.sparse.local_shards().items()}
    return losses, shards, ledger.summary()["predicted_vs_counted"]


@pytest.mark.distributed
@pytest.mark.parametrize("codec", [None, "dct"])
def test_deepfm_with_trw_tables_equals_one_process(codec):
    """Lossless DCT (eta = 1): the coded owners' FM piece carries s_p, summed in the host."""
    import test_deepfm as fm

    results = run_ranks(deepfm_worker, 4, codec)
    ref = fm.build()
    ref_losses = fm.train(ref, combined_sparse_optimizer("sgd", ref.sparse, lr=0.05), fm.global_batches(),
                          0, fm.GLOBAL_B)
    mean = [sum(r[0][s] for r in results) / 4 for s in range(fm.STEPS)]
    torch.testing.assert_close(torch.tensor(mean), torch.tensor(ref_losses), rtol=1e-5, atol=1e-6)
    full = fm.full_tables([r[1] for r in results])
    for n, _ in fm.TABLES:
        torch.testing.assert_close(full[n], ref.sparse.table_weight(n), rtol=1e-5, atol=1e-6)
    for r in results:
        check_ledger(r[2], 2)
