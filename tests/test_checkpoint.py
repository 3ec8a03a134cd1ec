"""The one checkpointer on one process: every component saved and restored, atomic
directories, pruning, per-rank state that cannot carry over is reset with a warning."""

import json

import pytest
import torch

from hybridrec.comm.compress import DCTCompressor
from hybridrec.comm.ddp_hooks import CompressedAllReduce
from hybridrec.model.dlrm import DLRM
from hybridrec.model.embedding import EmbeddingBagCollection, TableConfig
from hybridrec.parallel.checkpoint_io import MANIFEST
from hybridrec.parallel.dense_sync import AllReduceSync
from hybridrec.parallel.topology import Topology
from hybridrec.train.checkpointing import checkpoint as ckpt
from hybridrec.train.checkpointing.checkpointer import Checkpointer, Component, TorchRNG
from hybridrec.train.loop.optim import dense_parameters
from hybridrec.train.loop.sparse_optim import CombinedSparseOptimizer, build_sparse_optimizer


class Counter:
    def __init__(self):
        self.value = 0

    def state_dict(self):
        return {"value": self.value, "t": torch.full((3,), float(self.value))}

    def load_state_dict(self, state):
        assert torch.equal(state["t"], torch.full((3,), float(state["value"])))
        self.value = state["value"]


def _parts(seed=0):
    torch.manual_seed(seed)
    tables = [TableConfig(name="a", num_embeddings=20, embedding_dim=4),
              TableConfig(name="b", num_embeddings=7, embedding_dim=4)]
    model = DLRM(num_dense=3, sparse=EmbeddingBagCollection(tables, seed=seed), bottom_mlp=[4],
                 top_mlp=[4, 1])
    dense = torch.optim.Adam(dense_parameters(model), lr=0.1)
    sparse = CombinedSparseOptimizer({"tables": build_sparse_optimizer("rowwise_adagrad", model.sparse,
                                                                       lr=0.1)})
    return model, dense, sparse


def _checkpointer(run, parts, *components, keep=2):
    model, dense, sparse = parts
    return Checkpointer(run, Topology.single(), model=model, dense_opt=dense, sparse_opt=sparse,
                        components=list(components), keep=keep)


def test_save_restore_every_component_and_prune(tmp_path):
    parts, glob, mine = _parts(0), Counter(), Counter()
    c = _checkpointer(tmp_path, parts, Component("g", glob), Component("mine", mine, per_rank=True),
                      Component("rng", TorchRNG(), per_rank=True))
    with torch.no_grad():
        parts[0].top.layers[0].weight.add_(1.0)
        parts[2].optimizers["tables"]._acc[0].add_(2.0)
    for step in (10, 20, 30):
        glob.value, mine.value = step, step + 1
        c.save(step)
    assert [s for s, _ in ckpt.list_checkpoints(tmp_path)] == [20, 30]
    expected_rand = torch.rand(4)  # what the generator draws after the last save

    fresh, glob2, mine2 = _parts(1), Counter(), Counter()
    c2 = _checkpointer(tmp_path, fresh, Component("g", glob2), Component("mine", mine2, per_rank=True),
                       Component("rng", TorchRNG(), per_rank=True))
    torch.rand(100)  # moves the generator: restoring must bring it back
    assert c2.restore(c2.latest()) == 30
    assert (glob2.value, mine2.value) == (30, 31)
    assert torch.equal(torch.rand(4), expected_rand)
    for k, v in parts[0].state_dict().items():
        assert torch.equal(v, fresh[0].state_dict()[k]), k
    assert torch.equal(fresh[2].optimizers["tables"]._acc[0], parts[2].optimizers["tables"]._acc[0])
    manifest = json.loads((c2.latest() / MANIFEST).read_text())
    assert manifest["step"] == 30 and manifest["world_size"] == 1
    assert manifest["components"] == {"model": "sharded", "dense_opt": "replicated",
                                      "sparse_opt": "sharded", "g": "global", "mine": "per_rank",
                                      "rng": "per_rank"}


def test_failed_save_leaves_nothing(tmp_path):
    parts = _parts()

    class Broken(Counter):
        def state_dict(self):
            raise RuntimeError("disk on fire")

    _checkpointer(tmp_path, parts).save(1)
    with pytest.raises(Exception, match="disk on fire"):
        _checkpointer(tmp_path, parts, Component("x", Broken())).save(2)
    assert [s for s, _ in ckpt.list_checkpoints(tmp_path)] == [1]
    assert sorted(p.name for p in ckpt.checkpoint_dir(tmp_path).iterdir()) == ["step-00000001"]


def test_incomplete_directory_is_ignored(tmp_path):
    (ckpt.checkpoint_dir(tmp_path) / "step-00000005").mkdir(parents=True)
    assert ckpt.latest_checkpoint(tmp_path) is None


def test_compressor_state_of_another_compressor_is_reset_with_a_warning(tmp_path):
    parts = _parts()
    topo = Topology.single()
    saved = AllReduceSync(topo, CompressedAllReduce(DCTCompressor(0.1, 5)))
    saved.reducer.compressor.compress("top.layers.0.weight", torch.randn(10))
    _checkpointer(tmp_path, parts, Component("dense_sync", saved, per_rank=True)).save(3)
    other = AllReduceSync(topo, CompressedAllReduce(DCTCompressor(0.2, 5)))
    c = _checkpointer(tmp_path, _parts(), Component("dense_sync", other, per_rank=True))
    with pytest.warns(UserWarning, match="dense_sync: the saved state does not fit"):
        assert c.restore(c.latest()) == 3
    assert other.reducer.compressor.states == {}

    same = AllReduceSync(topo, CompressedAllReduce(DCTCompressor(0.1, 5)))
    c = _checkpointer(tmp_path, _parts(), Component("dense_sync", same, per_rank=True))
    c.restore(c.latest())
    st, ref = same.reducer.compressor.states["top.layers.0.weight"], \
        saved.reducer.compressor.states["top.layers.0.weight"]
    assert st.step == ref.step == 1 and torch.equal(st.residual, ref.residual) and torch.equal(st.tau, ref.tau)


def test_missing_component_is_reset_with_a_warning(tmp_path):
    parts = _parts()
    _checkpointer(tmp_path, parts).save(4)
    late = Counter()
    late.value = 7
    c = _checkpointer(tmp_path, _parts(), Component("late", late, per_rank=True))
    with pytest.warns(UserWarning, match="late: not in the checkpoint"):
        c.restore(c.latest())
    assert late.value == 7
