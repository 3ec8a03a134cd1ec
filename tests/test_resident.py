"""A rank's shards in files of local memory (hybridrec.train.checkpointing.resident): the tensors move into
the files with their values, updates land in the files, a snapshot takes the files by a
rename and a restarted process maps them again or reads them back."""

import inspect
import time

import pytest
import torch

from hybridrec.cli import launch
from hybridrec.model.embedding import EmbeddingBagCollection, TableConfig
from hybridrec.train.checkpointing.resident import (
    ResidentShards,
    files_fit,
    read_into,
    shard_tensors,
)
from hybridrec.train.loop.sparse_optim import RowWiseAdagrad


def _shards(seed: int):
    tables = [TableConfig(name="a", num_embeddings=50, embedding_dim=4),
              TableConfig(name="b", num_embeddings=30, embedding_dim=4)]
    c = EmbeddingBagCollection(tables, seed=seed)
    opt = RowWiseAdagrad(c, lr=0.1)
    with torch.no_grad():
        opt.row_state(0)["sum"].uniform_(0, 1, generator=torch.Generator().manual_seed(seed))
    return c, opt


def _file(path, like):
    return torch.from_file(str(path), shared=False, size=like.numel(), dtype=like.dtype).view(like.shape)


def _step(c, opt, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, c.group_weight(0).shape[0], (12,), generator=g)
    opt.step([(0, ids, torch.randn(12, 4, generator=g), False)])


def test_tensors_move_into_files_with_their_values_and_updates_land_there(tmp_path):
    c, opt = _shards(1)
    before = {k: t.clone() for k, t in shard_tensors(c, opt).items()}
    r = ResidentShards(tmp_path, 3, c, opt)
    r.create(copy=True)
    assert r.dir == tmp_path / "live-rank-00003" and r.intact()
    now = shard_tensors(c, opt)
    for k, t in now.items():
        assert torch.equal(t, before[k]), k
        assert torch.equal(_file(r.dir / f"{k}.bin", t), t), k
    _step(c, opt, 7)  # the optimizer's own references see the files' memory
    assert not torch.equal(c.group_weight(0), before["g0.weight"])
    for k, t in shard_tensors(c, opt).items():
        assert torch.equal(_file(r.dir / f"{k}.bin", t), t), k


def test_new_files_start_as_zeros(tmp_path):
    c, opt = _shards(1)
    r = ResidentShards(tmp_path, 0, c, opt)
    r.create(copy=False)
    assert all(not t.any() for t in shard_tensors(c, opt).values())


def test_a_snapshot_takes_the_files_and_a_new_process_maps_or_reads_them(tmp_path):
    c, opt = _shards(1)
    r = ResidentShards(tmp_path / "shm", 0, c, opt)
    r.create(copy=True)
    _step(c, opt, 7)
    want = {k: t.clone() for k, t in shard_tensors(c, opt).items()}
    snap = tmp_path / "shm" / "rank-00000" / "resident"
    entries = r.hand_over(snap)
    assert not r.dir.exists() and sorted(p.name for p in snap.iterdir()) == sorted(f"{k}.bin" for k in want)
    # the restarted process: other values, then its own snapshot's files taken ...
    c2, opt2 = _shards(2)
    assert files_fit(snap, entries, shard_tensors(c2, opt2)) is None
    r2 = ResidentShards(tmp_path / "shm", 0, c2, opt2)
    r2.adopt(snap, entries)
    assert r2.intact()
    for k, t in shard_tensors(c2, opt2).items():
        assert torch.equal(t, want[k]), k
    _step(c2, opt2, 8)  # ... trains on in them; the snapshot's names go, its own stay
    for p in snap.iterdir():
        p.unlink()
    for k, t in shard_tensors(c2, opt2).items():
        assert torch.equal(_file(r2.dir / f"{k}.bin", t), t), k
    # or read back into memory of its own (a snapshot the launcher moved to disk)
    c3, opt3 = _shards(3)
    held = r2.hand_over(tmp_path / "disk")
    read_into(tmp_path / "disk", held, shard_tensors(c3, opt3))
    for k, t in shard_tensors(c3, opt3).items():
        assert torch.equal(t, shard_tensors(c2, opt2)[k]), k


def test_files_that_do_not_fit_are_refused_with_the_reason(tmp_path):
    c, opt = _shards(1)
    r = ResidentShards(tmp_path, 0, c, opt)
    r.create(copy=True)
    entries = r.hand_over(tmp_path / "snap")
    tensors = shard_tensors(c, opt)
    other = EmbeddingBagCollection([TableConfig(name="a", num_embeddings=51, embedding_dim=4),
                                    TableConfig(name="b", num_embeddings=30, embedding_dim=4)], seed=0)
    assert "g0.weight is float32 [80, 4], this rank's torch.float32 [81, 4]" in files_fit(
        tmp_path / "snap", entries, shard_tensors(other, RowWiseAdagrad(other, lr=0.1)))
    with open(tmp_path / "snap" / "g0.weight.bin", "r+b") as f:
        f.truncate(100)
    assert "has 100 bytes, not 1280" in files_fit(tmp_path / "snap", entries, tensors)
    (tmp_path / "snap" / "g0.state.sum.bin").unlink()
    assert "missing" in files_fit(tmp_path / "snap", {"g0.state.sum": entries["g0.state.sum"]},
                                  {"g0.state.sum": tensors["g0.state.sum"]})
    assert "this rank's" in files_fit(tmp_path / "snap", {"x": entries["g0.weight"]}, tensors)


def test_a_tensor_given_other_memory_is_not_handed_over(tmp_path):
    c, opt = _shards(1)
    r = ResidentShards(tmp_path, 0, c, opt)
    r.create(copy=True)
    c.group_weight(0).data = c.group_weight(0).detach().clone()
    assert not r.intact()


def test_the_launch_leaves_out_the_rendezvous_spread_and_the_stack_reading():
    from torch.distributed.elastic.rendezvous import dynamic_rendezvous as rdzv

    before = (rdzv._delay, rdzv.get_method_name)

    def caller():
        return rdzv.get_method_name(1)

    expected = caller()  # torch's, through inspect.stack()
    with launch._one_agent_rendezvous():
        assert caller() == expected == "caller"
        assert inspect.currentframe().f_code.co_name == rdzv.get_method_name(1)
        start = time.perf_counter()
        rdzv._delay(seconds=(5.0, 5.0))  # the random spread: none (torch's would sleep these 5 s)
        assert time.perf_counter() - start < 5.0
        rdzv._delay(seconds=0.05)  # a fixed delay (a retry's) is kept
        assert time.perf_counter() - start >= 0.05
    assert (rdzv._delay, rdzv.get_method_name) == before


def test_the_frame_name_beyond_the_stack_is_torchs_default():
    from torch.distributed.elastic.rendezvous import dynamic_rendezvous as rdzv

    with launch._one_agent_rendezvous():
        assert rdzv.get_method_name(len(inspect.stack()) + 5) == "no_method_name"


def test_a_failed_move_gives_the_tensors_process_memory_again_with_their_values(tmp_path):
    c, opt = _shards(1)
    r = ResidentShards(tmp_path / "shm", 0, c, opt)
    r.create(copy=True)
    entries = r.hand_over(tmp_path / "shm" / "snap")
    c2, opt2 = _shards(2)
    r2 = ResidentShards(tmp_path / "shm", 0, c2, opt2)
    r2.adopt(tmp_path / "shm" / "snap", entries)
    want = {k: t.clone() for k, t in shard_tensors(c2, opt2).items()}
    r2.release()
    assert not r2.intact() and not r2.dir.exists()
    for k, t in shard_tensors(c2, opt2).items():
        assert torch.equal(t, want[k]), k
        t.zero_()  # (not into the snapshot's files)
    for k, e in entries.items():
        assert torch.equal(_file(tmp_path / "shm" / "snap" / e["file"], want[k]), want[k]), k


def _recovery(tmp_path, c, opt, fast_dir=None):
    from types import SimpleNamespace

    from hybridrec.parallel.sharded_embedding import SHARDS
    from hybridrec.train.checkpointing.recovery import Recovery
    from hybridrec.train.loop.sparse_optim import CombinedSparseOptimizer

    ckpt = SimpleNamespace(topo=SimpleNamespace(rank=0, group_size=2, device=torch.device("cpu")), run_dir=tmp_path / "run",
                           model=SimpleNamespace(sparse=SimpleNamespace(local=c)),
                           sparse_opt=CombinedSparseOptimizer({SHARDS: opt}), components=[])
    return Recovery(ckpt, mode="partial", global_batch=64, fast_dir=fast_dir)


@pytest.mark.parametrize("room", [True, False])
@pytest.mark.parametrize("drawn", [True, None])
def test_tables_left_unset_start_as_zeros_with_or_without_room(tmp_path, monkeypatch, capsys, room, drawn):
    """A restarted rank's shards are built untouched (``drawn`` None): they start as zeros in
    new files, or, where the directory has no room, zeroed where they are (with a note).
    Drawn values are kept either way."""
    from hybridrec.train.checkpointing import resident

    (tmp_path / "shm").mkdir(mode=0o700)  # (the launcher makes it so: snapshots.private_dir)
    if not room:
        monkeypatch.setattr(resident, "ROOM", 1e12)
    c, opt = _shards(1)
    if drawn is None:
        with torch.no_grad():
            for t in shard_tensors(c, opt).values():
                t.fill_(7.0)  # (what untouched memory may hold)
    want = {k: (t.clone() if drawn else torch.zeros_like(t)) for k, t in shard_tensors(c, opt).items()}
    rec = _recovery(tmp_path, c, opt, fast_dir=tmp_path / "shm")
    rec.start_resident(resume=False, drawn=drawn)
    assert (rec.resident is not None and rec.resident.intact()) == room
    for k, t in shard_tensors(c, opt).items():
        assert torch.equal(t, want[k]), k
    assert ("has no room for its shards" in capsys.readouterr().err) == (not room)
