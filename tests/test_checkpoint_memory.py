"""What a save costs: tables go to DCP's writer without a copy; a background save
(``Checkpointer(background=True)``) writes a staged copy while training goes on, and its
directory appears only once every rank's part is written. One spawn of 2 gloo ranks."""

import threading
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
import torch.distributed.checkpoint.filesystem as dcp_fs
from distributed import run_ranks

from hybridrec.model.dlrm import DLRM
from hybridrec.model.embedding import EmbeddingBagCollection, TableConfig
from hybridrec.parallel import plan as P
from hybridrec.parallel.checkpoint import (
    TMP_MARK,
    CheckpointError,
    is_complete,
    load_sharded,
    save_sharded,
)
from hybridrec.parallel.checkpoint_layout import local_weights, own_storage
from hybridrec.parallel.parallelize import parallelize_dlrm
from hybridrec.parallel.topology import Topology
from hybridrec.train.checkpointing.checkpointer import Checkpointer
from hybridrec.train.loop.sparse_optim import combined_sparse_optimizer

DIM = 4
TABLES = {"t0": 50, "t1": 30, "t2": 20}


def build(seed, topo=None):
    torch.manual_seed(seed)
    tables = [TableConfig(name=n, num_embeddings=r, embedding_dim=DIM) for n, r in TABLES.items()]
    model = DLRM(num_dense=3, sparse=EmbeddingBagCollection(tables, seed=seed), bottom_mlp=[8, DIM],
                 top_mlp=[6, 1])
    if topo is not None and topo.group_size > 1:
        plan = P.ShardingPlan(world_size=2, local_world_size=2, tables={
            "t0": P.row_wise("t0", TABLES["t0"], DIM, [0, 1]), "t1": P.table_wise("t1", TABLES["t1"], DIM, 1),
            "t2": P.column_wise("t2", TABLES["t2"], DIM, [0, 1])})
        model = parallelize_dlrm(model, plan, topo)
    dense = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=0.01)
    return model, dense, combined_sparse_optimizer("rowwise_adagrad", model.sparse, lr=0.1)


def state(model, sparse):
    """Every table and its row-wise state, cloned."""
    out = {k: w.clone() for k, w in local_weights(model.sparse).items()}
    for o in sparse.optimizers.values():
        out.update({f"{n}.{s}": v.clone() for n, ts in o.state_dict()["tables"].items() for s, v in ts.items()})
    out.update({k: v.clone() for k, v in model.state_dict().items() if not k.startswith("sparse.")})
    return out


def perturb(model, sparse):
    with torch.no_grad():
        for w in local_weights(model.sparse).values():
            w.add_(1.0)
        for o in sparse.optimizers.values():
            for ts in o.state_dict()["tables"].values():
                for v in ts.values():
                    v.add_(0.5)
        for p in model.parameters():
            p.add_(0.25)


def same(a, b):
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def worker_background(topo, root):
    """Background saves through the Checkpointer: the write is held until the test lets
    it go, the model changes meanwhile; a save waits for the one before; a failed
    background write raises on every rank at wait()."""
    root, out = Path(root), {}
    model, dense, sparse = build(0, topo)
    for o in sparse.optimizers.values():  # some row-wise state that is not zero
        for ts in o.state_dict()["tables"].values():
            for v in ts.values():
                v.uniform_(0, 1)
    ck = Checkpointer(root / "run", topo, model=model, dense_opt=dense, sparse_opt=sparse,
                      components=[], keep=1, background=True)
    go, original = threading.Event(), dcp.FileSystemWriter.write_data

    def held_write(self, plan, planner):  # (in the writing thread)
        assert go.wait(30)
        return original(self, plan, planner)

    dcp.FileSystemWriter.write_data = held_write
    try:
        saved = state(model, sparse)
        path = ck.save(2)
        out["visible_while_writing"] = path.exists() or is_complete(path)
        out["tmp_while_writing"] = any(TMP_MARK in p.name for p in path.parent.iterdir())
        perturb(model, sparse)  # training goes on: the checkpoint keeps what was saved
        go.set()
        out["waited"] = ck.wait() == path and is_complete(path)
        ck.restore(path)
        out["restored_saved"] = same(state(model, sparse), saved)
        perturb(model, sparse)
        later = state(model, sparse)
        go.clear()
        ck.save(3)  # pending; the next save waits for it, then prunes to keep=1
        go.set()
        ck.save(4)
        ck.wait()
        out["kept"] = sorted(p.name for p in (root / "run" / "checkpoints").iterdir())
        ck.restore(root / "run" / "checkpoints" / out["kept"][-1])
        out["restored_later"] = same(state(model, sparse), later)

        def failing_write(self, plan, planner):
            raise OSError("disk full (injected)")

        if topo.rank == 1:
            dcp.FileSystemWriter.write_data = failing_write
        ck.save(5)  # returns: the failure is the writing thread's
        try:
            ck.wait()
            out["failure"] = "saved"
        except CheckpointError as e:
            out["failure"] = str(e)
        out["after_failure"] = sorted(p.name for p in (root / "run" / "checkpoints").iterdir())
    finally:
        dcp.FileSystemWriter.write_data = original
    return out


@pytest.mark.distributed
def test_background_save_two_ranks(tmp_path):
    results = run_ranks(worker_background, 2, str(tmp_path))
    for r in results:
        assert not r["visible_while_writing"] and r["tmp_while_writing"]
        assert r["waited"] and r["restored_saved"] and r["restored_later"]
        assert "on rank 1: disk full (injected)" in r["failure"], r["failure"]
    # rank 0 prunes, and removes a failed save's tmp directory (rank 1 may look before it does)
    assert results[0]["kept"] == ["step-00000004"]
    assert results[0]["after_failure"] == ["step-00000004"]
    assert results[0]["failure"] == results[1]["failure"]


def test_tables_are_written_from_their_own_memory(tmp_path, monkeypatch):
    """Tables are row blocks of one fused weight (a view into a larger storage): DCP's
    writer would clone each one and keep the clones until the rank's file is written.
    They reach torch.save as aliases of the live memory instead, and the bytes written
    are the clone's."""
    model, _, sparse = build(0)
    live = {w.data_ptr() for w in local_weights(model.sparse).values()}
    assert all(w.untyped_storage().nbytes() > w.nbytes for w in local_weights(model.sparse).values())
    written, write_item = [], dcp_fs._write_item

    def record(transforms, stream, data, item, *args):
        if isinstance(data, torch.Tensor):
            written.append(data.data_ptr())
        return write_item(transforms, stream, data, item, *args)

    monkeypatch.setattr(dcp_fs, "_write_item", record)
    save_sharded(tmp_path / "a", model=model, dense_opt=None, sparse_opts=list(sparse.optimizers.values()),
                 extra={}, topo=Topology.single())
    assert live <= set(written)
    w = local_weights(model.sparse)["t1"]
    alias = own_storage(w)
    assert alias.data_ptr() == w.data_ptr() and alias.untyped_storage().nbytes() == w.nbytes
    assert torch.equal(alias, w)
    m2, _, s2 = build(1)
    load_sharded(tmp_path / "a", model=m2, dense_opt=None, sparse_opts=list(s2.optimizers.values()),
                 topo=Topology.single())
    assert same(state(m2, s2), state(model, sparse))
