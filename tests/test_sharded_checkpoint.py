"""Sharded checkpoints (DCP): same-plan resume, resharding 2 -> 3 ranks, single process
<-> N ranks, and an interrupted save. Three spawns in all (2, 3 and 2 ranks)."""

import os
import pickle
import time
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from distributed import run_ranks

from hybridrec.model.dlrm import DLRM
from hybridrec.model.embedding import EmbeddingBagCollection, TableConfig
from hybridrec.parallel import plan as P
from hybridrec.parallel.checkpoint import (
    TMP_MARK,
    CheckpointError,
    SafeFileSystemReader,
    is_complete,
    load_sharded,
    save_sharded,
)
from hybridrec.parallel.parallelize import parallelize_dlrm
from hybridrec.parallel.topology import Topology
from hybridrec.sparse.keyed_jagged import Batch, KeyedJagged
from hybridrec.train.loop.sparse_optim import build_sparse_optimizer, combined_sparse_optimizer
from hybridrec.train.loop.step import sparse_grads

DIM, GLOBAL_B, STEPS = 4, 12, 4  # save after 2 steps, then 2 more
TABLES = {"t0": 23, "t1": 40, "t2": 7, "t3": 11}
OPTS = ("rowwise_adagrad", "lazy_adam")


def plan_a(world=2):
    """Row-wise, table-wise (on rank 1 only), column-wise, data-parallel."""
    t = TABLES
    return P.ShardingPlan(world_size=world, local_world_size=world, tables={
        "t0": P.row_wise("t0", t["t0"], DIM, [0, 1]), "t1": P.table_wise("t1", t["t1"], DIM, 1),
        "t2": P.column_wise("t2", t["t2"], DIM, [0, 1]), "t3": P.data_parallel("t3", t["t3"], DIM, world)})


def plan_b(world=3):
    """Every table changes type: column-wise over ranks 2 and 0, row-wise over 3, data-parallel, table-wise."""
    t = TABLES
    return P.ShardingPlan(world_size=world, local_world_size=world, tables={
        "t0": P.column_wise("t0", t["t0"], DIM, [2, 0]), "t1": P.row_wise("t1", t["t1"], DIM, [0, 1, 2]),
        "t2": P.data_parallel("t2", t["t2"], DIM, world), "t3": P.table_wise("t3", t["t3"], DIM, 1)})


def build(seed, sparse_opt, plan=None, topo=None):
    """A DLRM, sharded by ``plan`` when given; Adam on the dense part (it has state)."""
    torch.manual_seed(seed)
    tables = [TableConfig(name=n, num_embeddings=r, embedding_dim=DIM) for n, r in TABLES.items()]
    model = DLRM(num_dense=3, sparse=EmbeddingBagCollection(tables, seed=seed), bottom_mlp=[8, DIM],
                 top_mlp=[6, 1])
    if plan is not None:
        model = parallelize_dlrm(model, plan, topo)
    dense = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=0.01)
    return model, dense, combined_sparse_optimizer(sparse_opt, model.sparse, lr=0.1)


def batches():
    g = torch.Generator().manual_seed(5)
    out = []
    for _ in range(STEPS):
        lengths = torch.randint(0, 4, (len(TABLES), GLOBAL_B), generator=g)
        vals = [torch.randint(0, r, (int(lengths[i].sum()),), generator=g) for i, r in enumerate(TABLES.values())]
        out.append((vals, lengths, torch.randn(GLOBAL_B, 3, generator=g),
                    torch.randint(0, 2, (GLOBAL_B,), generator=g).float()))
    return out


def train(model, dense, sparse, steps, lo, hi):
    for vals, lengths, x, y in steps:
        off = [torch.cat([torch.zeros(1, dtype=torch.int64), ln.cumsum(0)]) for ln in lengths]
        kjt = KeyedJagged.from_lengths_per_key(list(TABLES), [v[o[lo]:o[hi]] for v, o in zip(vals, off)],
                                               [ln[lo:hi] for ln in lengths])
        batch = Batch(x[lo:hi], kjt, y[lo:hi])
        loss = F.binary_cross_entropy_with_logits(model(batch), batch.labels)
        dense.zero_grad()
        loss.backward()
        grads = sparse_grads(model.sparse)
        dense.step()
        sparse.step(grads)


def snapshot(model, dense, sparse):
    """Everything a checkpoint holds, as plain cloned data."""
    if hasattr(model.sparse, "local_shards"):
        tables = {k: (s, w.clone()) for k, (s, w) in model.sparse.local_shards().items()}
    else:
        tables = {n: (None, model.sparse.table_weight(n).clone()) for n in TABLES}
    state = {}
    for o in sparse:
        sd = o.state_dict()
        state["header"] = (sd["name"], sd["lr"], sd["step"])
        state.update({n: {k: v.clone() for k, v in ts.items()} for n, ts in sd["tables"].items()})
    dense_sd = {k.replace(".module", ""): v.clone() for k, v in model.state_dict().items()
                if not k.startswith("sparse.")}
    osd = dense.state_dict()
    opt = {"state": {i: {k: v.clone() for k, v in s.items()} for i, s in osd["state"].items()},
           "param_groups": osd["param_groups"]}
    return {"tables": tables, "sparse": state, "dense": dense_sd, "dense_opt": opt}


def assert_same(a, b, where="", exact=True):
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape, where
        if exact:
            assert torch.equal(a, b), f"{where}: {a} != {b}"
        else:
            torch.testing.assert_close(a, b, rtol=1e-6, atol=0, msg=where)
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), f"{where}: {sorted(a, key=str)} != {sorted(b, key=str)}"
        for k in a:
            assert_same(a[k], b[k], f"{where}.{k}", exact)
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{where}[{i}]", exact)
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


def make_extra(step):
    return {"step": step, "rng": torch.get_rng_state(), "loader": {"epoch": 0, "step": step},
            "config": {"name": "tiny", "betas": (0.9, 0.99), "ids": [1, 2], "none": None}, 7: "int key"}


# -- workers (spawned ranks) --------------------------------------------------------------------
def worker_save_resume(topo, root):
    """Plan A on 2 ranks: train 2 steps, save, train 2 more; a fresh model (another seed)
    loads the checkpoint and trains the same 2 steps."""
    per = GLOBAL_B // topo.group_size
    lo, hi = topo.rank * per, (topo.rank + 1) * per
    out = {}
    for name in OPTS:
        model, dense, sparse = build(0, name, plan_a(), topo)
        train(model, dense, sparse, batches()[:2], lo, hi)
        extra = make_extra(2)
        path = Path(root) / f"a-{name}"
        save_sharded(path, model=model, dense_opt=dense, sparse_opts=sparse, extra=extra, topo=topo)
        saved = snapshot(model, dense, sparse)
        train(model, dense, sparse, batches()[2:], lo, hi)
        m2, d2, s2 = build(1, name, plan_a(), topo)
        got_extra = load_sharded(path, model=m2, dense_opt=d2, sparse_opts=s2, topo=topo)
        loaded = snapshot(m2, d2, s2)
        train(m2, d2, s2, batches()[2:], lo, hi)
        out[name] = {"saved": saved, "loaded": loaded, "extra": (extra, got_extra),
                     "continued": snapshot(model, dense, sparse), "resumed": snapshot(m2, d2, s2)}
    return out


def worker_reshard(topo, root):
    """Plan B on 3 ranks loads plan A's checkpoints and the single-process one."""
    out = {}
    for name in [f"a-{o}" for o in OPTS] + ["single-rowwise_adagrad"]:
        model, dense, sparse = build(3, name.split("-", 1)[1], plan_b(), topo)
        extra = load_sharded(Path(root) / name, model=model, dense_opt=dense, sparse_opts=sparse, topo=topo)
        out[name] = {"loaded": snapshot(model, dense, sparse), "extra": extra}
    return out


def worker_interrupted(topo, root, timeout):
    """A good save; then rank 1 fails inside DCP's write; then rank 1 is interrupted after
    its write, outside the ranks' agreement, and stays stuck: rank 0 must error, not hang."""
    root = Path(root)
    model, dense, sparse = build(0, "rowwise_adagrad", plan_a(), topo)
    args = {"model": model, "dense_opt": dense, "sparse_opts": sparse, "extra": {"step": 0}, "topo": topo}
    save_sharded(root / "good", **args)
    good = snapshot(model, dense, sparse)
    with torch.no_grad():
        for _, w in model.sparse.local_shards().values():
            w.add_(1.0)
    out = {}

    def failing_write(self, plan, planner):
        raise OSError("disk full (injected)")

    original = dcp.FileSystemWriter.write_data
    if topo.rank == 1:
        dcp.FileSystemWriter.write_data = failing_write
    t0 = time.monotonic()
    try:
        save_sharded(root / "good", **args)  # would replace the good checkpoint
        out["dcp_failure"] = "saved"
    except CheckpointError as e:
        out["dcp_failure"] = str(e)
    out["dcp_failure_s"] = time.monotonic() - t0
    dcp.FileSystemWriter.write_data = original
    m2, d2, s2 = build(1, "rowwise_adagrad", plan_a(), topo)
    load_sharded(root / "good", model=m2, dense_opt=d2, sparse_opts=s2, topo=topo)
    out["good_after_failure"] = (good, snapshot(m2, d2, s2))

    save = dcp.save

    def interrupted_save(*a, **k):
        save(*a, **k)
        raise KeyboardInterrupt

    if topo.rank == 1:
        dcp.save = interrupted_save
    t0 = time.monotonic()
    try:
        save_sharded(root / "interrupted", **args)
        out["interrupt"] = "saved"
    except KeyboardInterrupt:
        out["interrupt"] = "interrupted"
        time.sleep(timeout + 2)  # stuck, but alive: only the process-group timeout frees rank 0
    except Exception as e:  # noqa: BLE001 - rank 0: the peer left mid-protocol
        out["interrupt"] = f"{type(e).__name__}: {e}"
    out["interrupt_s"] = time.monotonic() - t0
    return out


# -- fixtures: one spawn each -------------------------------------------------------------------
@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("sharded_ckpt")


@pytest.fixture(scope="module")
def two_ranks(root):
    return run_ranks(worker_save_resume, 2, str(root))


@pytest.fixture(scope="module")
def single(root):
    """A checkpoint saved by one process (plain EmbeddingBagCollection, world 1)."""
    model, dense, sparse = build(0, "rowwise_adagrad")
    train(model, dense, sparse, batches()[:2], 0, GLOBAL_B)
    save_sharded(root / "single-rowwise_adagrad", model=model, dense_opt=dense, sparse_opts=sparse,
                 extra=make_extra(2), topo=Topology.single())
    return snapshot(model, dense, sparse)


@pytest.fixture(scope="module")
def three_ranks(root, two_ranks, single):
    return run_ranks(worker_reshard, 3, str(root))


# -- expected global tensors --------------------------------------------------------------------
def full_tables(snaps):
    """Whole tables from every rank's shards; NaN where nothing was found."""
    out = {n: torch.full((r, DIM), float("nan")) for n, r in TABLES.items()}
    for snap in snaps:
        for key, (shard, w) in snap["tables"].items():
            block = (slice(*shard.rows), slice(*shard.cols)) if shard else (slice(None),)
            out[key.split("@")[0]][block] = w
    return out


def full_state(snaps, plan, state):
    """Per-table optimizer state as [rows, dim] cells: the state that applies to each element
    (row-wise state broadcast over its shard's columns)."""
    out = {n: torch.full((r, DIM), float("nan")) for n, r in TABLES.items()}
    for snap in snaps:
        for key, ts in snap["sparse"].items():
            if key == "header":
                continue
            name, _, idx = key.partition("@")
            s = plan.tables[name].shards[int(idx)] if idx and plan else None
            v = ts[state]
            v = v.unsqueeze(1).expand(-1, s.num_cols if s else DIM) if v.dim() == 1 else v
            out[name][(slice(*s.rows), slice(*s.cols)) if s else (slice(None),)] = v
    return out


def check_loaded(loaded, src_snaps, src_plan, dst_plan, name):
    """Loaded shards equal the saved global tables; per-row state is the mean of the saved
    cells over the shard's columns (exact unless the source table was column-split)."""
    tables, dst = full_tables(src_snaps), loaded["tables"]
    for key, (shard, w) in dst.items():
        block = (slice(*shard.rows), slice(*shard.cols)) if shard else (slice(None),)
        assert_same(w, tables[key.split("@")[0]][block], key)
    states = ("sum",) if name.endswith("rowwise_adagrad") else ("exp_avg", "exp_avg_sq")
    for state in states:
        cells = full_state(src_snaps, src_plan, state)
        for key, ts in loaded["sparse"].items():
            if key == "header":
                continue
            t, _, idx = key.partition("@")
            s = dst_plan.tables[t].shards[int(idx)] if idx and dst_plan else None
            block = cells[t][(slice(*s.rows), slice(*s.cols)) if s else (slice(None),)]
            split = src_plan is not None and src_plan.tables[t].sharding_type == "column_wise"
            want = block if state != "sum" else block.mean(1) if split else block[:, 0]
            assert_same(ts[state], want, f"{key}.{state}", exact=not split)
    assert loaded["sparse"]["header"] == src_snaps[0]["sparse"]["header"]
    assert_same(loaded["dense"], src_snaps[0]["dense"], "dense")
    assert_same(loaded["dense_opt"], src_snaps[0]["dense_opt"], "dense_opt")


# -- tests --------------------------------------------------------------------------------------
@pytest.mark.distributed
@pytest.mark.parametrize("name", OPTS)
def test_resume_same_plan_is_exact(two_ranks, root, name):
    for rank in two_ranks:
        r = rank[name]
        assert_same(r["loaded"], r["saved"], "loaded")
        assert_same(r["extra"][1], r["extra"][0], "extra")
        assert_same(r["resumed"], r["continued"], "resumed")  # training goes on as if never stopped
        assert not torch.equal(r["saved"]["dense"]["top.layers.0.weight"],
                               r["continued"]["dense"]["top.layers.0.weight"])
    assert is_complete(root / f"a-{name}")
    assert not [p for p in root.iterdir() if TMP_MARK in p.name]


@pytest.mark.distributed
@pytest.mark.parametrize("name", OPTS)
def test_reshard_2_ranks_plan_a_to_3_ranks_plan_b(two_ranks, three_ranks, name):
    saved = [r[name]["saved"] for r in two_ranks]
    for rank in three_ranks:
        check_loaded(rank[f"a-{name}"]["loaded"], saved, plan_a(), plan_b(), name)
    full = full_tables([r["loaded"] for r in (x[f"a-{name}"] for x in three_ranks)])
    assert not any(torch.isnan(t).any() for t in full.values())


@pytest.mark.distributed
def test_single_process_checkpoint_into_3_ranks(single, three_ranks):
    for rank in three_ranks:
        r = rank["single-rowwise_adagrad"]
        check_loaded(r["loaded"], [single], None, plan_b(), "rowwise_adagrad")
        assert r["extra"]["config"]["betas"] == (0.9, 0.99) and r["extra"][7] == "int key"


@pytest.mark.distributed
@pytest.mark.parametrize("name", OPTS)
def test_sharded_checkpoint_into_single_process(two_ranks, root, name):
    model, dense, sparse = build(5, name)
    extra = load_sharded(root / f"a-{name}", model=model, dense_opt=dense, sparse_opts=sparse,
                         topo=Topology.single())
    check_loaded(snapshot(model, dense, sparse), [r[name]["saved"] for r in two_ranks], plan_a(), None, name)
    assert_same(extra, two_ranks[0][name]["extra"][0], "extra")
    # the model keys are the single-process state dict's: no mapping left to do
    state = model.state_dict()
    assert_same(state["sparse.tables.t1.weight"], full_tables([r[name]["saved"] for r in two_ranks])["t1"])


@pytest.mark.distributed
def test_interrupted_save_leaves_no_checkpoint_and_no_hang(tmp_path):
    timeout = 5.0  # the process group's: bounds every collective (rank 0 waits it out once)
    r0, r1 = run_ranks(worker_interrupted, 2, str(tmp_path), timeout, timeout_s=timeout)
    # 1. rank 1's write failed: both ranks raised, at once; the previous checkpoint is intact
    for r in (r0, r1):
        assert "rank 1" in r["dcp_failure"] and "disk full" in r["dcp_failure"], r["dcp_failure"]
        assert r["dcp_failure_s"] < timeout / 2
        good, reloaded = r["good_after_failure"]
        assert_same(reloaded["tables"], good["tables"], "tables")
    # 2. rank 1 stopped after writing its part: rank 0 raised at the timeout, published nothing
    assert r1["interrupt"] == "interrupted"
    assert r0["interrupt"] not in ("saved", "interrupted")
    assert timeout - 1 < r0["interrupt_s"] < timeout + 10, r0["interrupt_s"]
    assert not (tmp_path / "interrupted").exists()
    assert not [p for p in tmp_path.iterdir() if TMP_MARK in p.name]
    assert is_complete(tmp_path / "good") and not is_complete(tmp_path / "interrupted")


def test_tmp_dirs_never_look_complete(tmp_path):
    model, _, sparse = build(0, "sgd")
    save_sharded(tmp_path / "ck", model=model, dense_opt=None, sparse_opts=sparse, extra={},
                 topo=Topology.single())
    os.replace(tmp_path / "ck", tmp_path / f"ck{TMP_MARK}123")
    assert not is_complete(tmp_path / f"ck{TMP_MARK}123")
    with pytest.raises(CheckpointError, match="not a complete"):
        load_sharded(tmp_path / f"ck{TMP_MARK}123", model=model, dense_opt=None, sparse_opts=None,
                     topo=Topology.single())


def test_metadata_unpickler_builds_no_code(tmp_path):
    class Evil:
        def __reduce__(self):
            return (os.system, ("touch " + str(tmp_path / "pwned"),))

    model, dense, sparse = build(0, "sgd")
    save_sharded(tmp_path / "ck", model=model, dense_opt=dense, sparse_opts=sparse, extra={},
                 topo=Topology.single())
    assert SafeFileSystemReader(tmp_path / "ck").read_metadata().state_dict_metadata
    (tmp_path / "ck" / ".metadata").write_bytes(pickle.dumps(Evil()))
    with pytest.raises(CheckpointError, match="os.system|posix.system"):
        load_sharded(tmp_path / "ck", model=model, dense_opt=dense, sparse_opts=sparse,
                     topo=Topology.single())
    assert not (tmp_path / "pwned").exists()


def test_extra_rejects_objects(tmp_path):
    model, _, sparse = build(0, "sgd")
    with pytest.raises(CheckpointError, match="extra.cfg: cannot store a PosixPath"):
        save_sharded(tmp_path / "ck", model=model, dense_opt=None, sparse_opts=sparse,
                     extra={"cfg": Path("x")}, topo=Topology.single())
    assert not list(tmp_path.iterdir())


def test_files_hold_each_table_once(tmp_path):
    """Table weights are views into one fused tensor; ``torch.save`` of a view would write
    the whole fused storage once per table."""
    tables = [TableConfig(name=f"t{i}", num_embeddings=2000, embedding_dim=DIM) for i in range(4)]
    model = DLRM(num_dense=3, sparse=EmbeddingBagCollection(tables), bottom_mlp=[8, DIM], top_mlp=[6, 1])
    sparse = [build_sparse_optimizer("rowwise_adagrad", model.sparse, lr=0.1)]
    save_sharded(tmp_path / "ck", model=model, dense_opt=None, sparse_opts=sparse, extra={},
                 topo=Topology.single())
    payload = sum(v.numel() * v.element_size() for v in model.state_dict().values()) + 4 * 2000 * 4
    written = sum(p.stat().st_size for p in (tmp_path / "ck").glob("*.distcp"))
    assert payload <= written < 1.5 * payload, (written, payload)
