"""Synchronized runs stopped at a checkpoint and resumed, on 2 gloo ranks through the real
Checkpointer: each rank gets its own replica, dense optimizer state and runner state back
(the ranks' replicas differ between rounds), and the synchronizer's state (EASGD's centre,
BMUF's global model and block momentum, a compressed mean's anchor and residuals). The
foreground runners, and the background runner in lockstep (rounds at fixed steps), then
end bit for bit where the uninterrupted run ends; a free-running background run, whose
rounds follow the thread's timing, restores exactly the state the checkpoint captured,
a target still in flight included."""

import json
import subprocess
import sys
import time

import pytest
import torch
from distributed import run_ranks
from test_sharded_embedding import GLOBAL_B, build, global_batches, local_batch, make_plan

from hybridrec.comm.compress import DCTCompressor
from hybridrec.comm.ddp_hooks import CompressedAllReduce
from hybridrec.comm.ledger import CommLedger
from hybridrec.parallel.dense_sync import NoSync
from hybridrec.parallel.parallelize import parallelize_dlrm
from hybridrec.sync import BackgroundRunner, ForegroundRunner, RankReplica, make_synchronizer
from hybridrec.sync.algorithms import CATEGORY
from hybridrec.sync.compressed import CompressedMean
from hybridrec.sync.runners import cloned
from hybridrec.train.checkpointing.checkpointer import Checkpointer, Component
from hybridrec.train.loop.optim import dense_parameters
from hybridrec.train.loop.sparse_optim import combined_sparse_optimizer
from hybridrec.train.loop.step import training_step

pytestmark = pytest.mark.distributed


def _make(topo, run_dir, algo, kw, mode, runner_kw, compress, cls=None):
    """A fresh 2-rank model (the same seeded initial values every time), Adam on its dense
    replica (per-rank state that differs between the ranks), a runner and a checkpointer
    with the components the trainer registers for a synchronizer."""
    ledger = CommLedger()
    model = parallelize_dlrm(build("sum"), make_plan("table_wise", topo.group_size), topo, ledger=ledger,
                             dense_sync=NoSync())
    dense_opt = torch.optim.Adam(dense_parameters(model), lr=0.01)
    sparse_opt = combined_sparse_optimizer("sgd", model.sparse, lr=0.1)
    group = topo.parallel_groups(1)[0]
    mean = None
    if compress:  # per-rank residuals: the compressor keeps what it did not send
        reducer = CompressedAllReduce(DCTCompressor(0.25, 3), ledger, category=CATEGORY, direction="sync")
        mean = CompressedMean(group, reducer, ledger)
    if mode == "background":  # (as the trainer builds it: the checkpoint's ranks agree on its rounds)
        runner_kw = {"train_group": topo.group, **runner_kw}
    cls = cls or (ForegroundRunner if mode == "foreground" else BackgroundRunner)
    runner = cls(make_synchronizer(algo, **kw), dense_parameters(model), group, ledger=ledger, mean=mean,
                 **runner_kw)
    components = [Component("sync", runner), Component("sync_replica", RankReplica(runner, dense_opt), per_rank=True)]
    checkpointer = Checkpointer(run_dir, topo, model=model, dense_opt=dense_opt, sparse_opt=sparse_opt,
                                components=components)
    return model, dense_opt, sparse_opt, runner, checkpointer


def _train(topo, model, dense_opt, sparse_opt, runner, first, last, pause_s=0.0):
    batches, b = global_batches(False), GLOBAL_B // topo.group_size
    for step in range(first, last + 1):
        batch = local_batch(batches[step % len(batches)], topo.rank * b, (topo.rank + 1) * b)
        training_step(model, batch, dense_opt=dense_opt, sparse_opt=sparse_opt, dense_sync=NoSync())
        runner.after_step(step)
        time.sleep(pause_s)


def _state(runner, dense_opt):
    """What a resume must bring back: the live replica and dense optimizer state, and the
    runner's global and per-rank state (inside parked(): what the checkpoint captured)."""
    return cloned({"replica": runner.flat(), "dense_opt": dense_opt.state_dict()["state"],
                   "sync": runner.state_dict(), "own": runner.replica_state()})


def _end(runner):
    """The replica as training left it (background: after the last target is written
    back), then the averaged one every rank ends with."""
    if isinstance(runner, BackgroundRunner):
        runner.stop()
    left = runner.flat()
    runner.finish()
    return left, runner.flat()


def resume_worker(topo, run_dir, algo, kw, mode, runner_kw, steps, save_at, compress=False):
    """Train ``steps`` steps with a checkpoint at ``save_at`` (as the trainer saves it:
    inside ``parked()``), then build everything afresh, restore that checkpoint and train
    the rest. Returns what was saved, what was restored and both runs' ends."""
    model, dense_opt, sparse_opt, runner, checkpointer = _make(topo, run_dir, algo, kw, mode, runner_kw, compress)
    runner.start()
    _train(topo, model, dense_opt, sparse_opt, runner, 1, save_at)
    with runner.parked():
        path = checkpointer.save(save_at)
        saved = _state(runner, dense_opt)
    _train(topo, model, dense_opt, sparse_opt, runner, save_at + 1, steps)
    full = _end(runner)

    model, dense_opt, sparse_opt, runner, checkpointer = _make(topo, run_dir, algo, kw, mode, runner_kw, compress)
    assert checkpointer.restore(path) == save_at
    restored = _state(runner, dense_opt)
    runner.start()
    _train(topo, model, dense_opt, sparse_opt, runner, save_at + 1, steps)
    resumed = _end(runner)
    return {"saved": saved, "restored": restored, "full": full, "resumed": resumed}


def assert_same(a, b, where="state"):
    """Bitwise equal nested state (tensors, dicts, lists, tuples, plain values)."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), (where, a.keys(), getattr(b, "keys", list)())
        for k in a:
            assert_same(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{where}.{i}")
    else:
        assert a == b, (where, a, b)


def _check_restored(ranks):
    """Every rank restored exactly what it saved, and the ranks' replicas did differ
    (rank 0's for both, as a checkpoint of one replica gives, would fail)."""
    for r in ranks:
        assert_same(r["saved"], r["restored"])
    assert not torch.equal(ranks[0]["saved"]["replica"], ranks[1]["saved"]["replica"])
    assert not torch.equal(ranks[0]["saved"]["dense_opt"][0]["exp_avg"], ranks[1]["saved"]["dense_opt"][0]["exp_avg"])


FOREGROUND = [("easgd", {"alpha": 0.3}, False), ("bmuf", {}, False), ("easgd", {"alpha": 0.3}, True)]


@pytest.mark.parametrize("algo, kw, compress", FOREGROUND, ids=["easgd", "bmuf", "easgd-dct"])
def test_foreground_resume_equals_uninterrupted(tmp_path, algo, kw, compress):
    """Rounds every 3 steps, the checkpoint at step 5 (between two rounds: the replicas
    differ): the resumed run ends bit for bit where the uninterrupted one ends."""
    ranks = run_ranks(resume_worker, 2, tmp_path, algo, kw, "foreground", {"every": 3}, 10, 5, compress)
    _check_restored(ranks)
    for r in ranks:
        assert_same(r["full"], r["resumed"], "end")
    assert ranks[0]["saved"]["own"]["rounds"] == 1
    if compress:  # the residuals restored are each rank's own
        res = [r["saved"]["own"]["mean"]["compressor"]["tensors"]["replica.0"]["residual"] for r in ranks]
        assert res[0].abs().sum() > 0 and not torch.equal(res[0], res[1])


@pytest.mark.parametrize("algo, kw", [("easgd", {"alpha": 0.3}), ("bmuf", {})], ids=["easgd", "bmuf"])
def test_background_lockstep_resume_equals_uninterrupted(tmp_path, algo, kw):
    """Background rounds in lockstep every 2 steps (rounds start at 0, 2, 4, ... and land a
    step later): the checkpoint at step 4 holds the target of the round started there, not
    yet written back; the resumed run writes it back at step 5 as the uninterrupted one
    does, and ends bit for bit where it ends."""
    ranks = run_ranks(resume_worker, 2, tmp_path, algo, kw, "background", {"every": 2, "lockstep": True}, 9, 4)
    _check_restored(ranks)
    for r in ranks:
        own = r["saved"]["own"]
        assert own["pending"] is not None and own["round_step"] == 4 and own["rounds"] == 2
        assert_same(r["full"], r["resumed"], "end")


def test_lockstep_background_rounds_are_reproducible(tmp_path):
    """The lockstep hook is what makes the comparison above meaningful: two runs of it are
    equal, and the replicas at the end differ from a foreground run's (the targets land a
    step late, with the step trained since kept: a background run, not a foreground one)."""
    lockstep = ("easgd", {"alpha": 0.3}, "background", {"every": 2, "lockstep": True}, 6, 3)
    a = run_ranks(resume_worker, 2, tmp_path / "a", *lockstep)
    b = run_ranks(resume_worker, 2, tmp_path / "b", *lockstep)
    fg = run_ranks(resume_worker, 2, tmp_path / "fg", "easgd", {"alpha": 0.3}, "foreground", {"every": 2}, 6, 3)
    for x, y, f in zip(a, b, fg):
        assert_same(x["full"], y["full"], "end")
        assert not torch.equal(x["full"][0], f["full"][0])


@pytest.mark.parametrize("algo, kw", [("easgd", {"alpha": 0.3}), ("bmuf", {})], ids=["easgd", "bmuf"])
def test_background_resume_restores_what_was_saved(tmp_path, algo, kw):
    """Free-running rounds (back to back, the thread's own timing): whatever the checkpoint
    caught (a round in flight finishes first; its target pending or written back), each
    rank gets exactly that back: its replica, its Adam state, the centre or global model and
    momentum, the counters and a pending target."""
    ranks = run_ranks(resume_worker, 2, tmp_path, algo, kw, "background", {"duty": 1.0}, 16, 8)
    _check_restored(ranks)
    for r in ranks:
        assert r["saved"]["own"]["step"] == 8  # (how many rounds landed by then: the thread's timing)
        sync = r["saved"]["sync"]["synchronizer"]
        assert any(isinstance(v, torch.Tensor) for v in sync.values())  # the centre, or g and delta
    assert_same(ranks[0]["saved"]["sync"], ranks[1]["saved"]["sync"])  # global: equal on every rank


class SlowSecondRound(BackgroundRunner):
    """On ``slow`` (rank 0), the thread takes 1.5 s to snapshot its second round, after every
    rank's thread passed that round's stop flag; counts the checkpoint's captures."""

    def __init__(self, *args, slow: bool, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.slow, self.captures = slow, 0

    def _snapshot(self):
        if self.slow and self._done == 1:
            time.sleep(1.5)
        return super()._snapshot()

    def _capture_once(self):
        self.captures += 1
        return super()._capture_once()


def agree_worker(topo, run_dir):
    """Rank 1 saves 0.5 s late: its thread is inside round 2's all-reduce by then, holding
    the synchronizer's lock, so its capture holds round 2; rank 0's thread is still in its
    slow snapshot, so rank 0's first capture does not."""
    made = _make(topo, run_dir, "easgd", {"alpha": 0.3}, "background", {"slow": topo.rank == 0}, False,
                 cls=SlowSecondRound)
    model, dense_opt, sparse_opt, runner, checkpointer = made
    runner.start()
    _train(topo, model, dense_opt, sparse_opt, runner, 1, 3, pause_s=0.05)
    time.sleep(0.5 * topo.rank)
    with runner.parked():
        path = checkpointer.save(3)
        saved = _state(runner, dense_opt)
    captures = runner.captures
    _end(runner)
    model, dense_opt, sparse_opt, runner, checkpointer = _make(topo, run_dir, "easgd", {"alpha": 0.3},
                                                               "background", {}, False)
    checkpointer.restore(path)
    return {"saved": saved, "restored": _state(runner, dense_opt), "captures": captures}


def test_background_checkpoint_holds_the_same_rounds_on_every_rank(tmp_path):
    """A round that one rank's capture holds and another's missed: the ranks agree on the
    rounds (the one behind waits for its round and captures again), so the global centre
    (rank 0's) fits every rank's pending target and replica."""
    ranks = run_ranks(agree_worker, 2, tmp_path)
    assert [r["captures"] for r in ranks] == [2, 1]  # rank 0 was behind, and caught up
    _check_restored(ranks)
    assert_same(ranks[0]["saved"]["sync"], ranks[1]["saved"]["sync"])
    for r in ranks:
        assert r["saved"]["own"]["pending"] is not None  # round 2's target, not yet written back


# -- end to end: `hybridrec train` on 2 ranks, a rank killed after a checkpoint -----------
SMALL = ["model.embedding_dim=8", "model.bottom_mlp=16,8", "model.top_mlp=16,1", "data.batch_size=64",
         "data.eval_batch_size=1000", "train.progress=false", "optim.decay=none", "train.checkpoint_every=10",
         "train.epochs=2", "train.max_steps=20", "sync.algorithm=easgd", "sync.mode=foreground", "sync.every=3"]


def _cli_train(dataset, run, *extra):
    cmd = [sys.executable, "-m", "hybridrec", "train", "--recipe", "demo", f"data.path={dataset}",
           f"train.run_dir={run}", "dist.nproc=2", *SMALL, *extra]
    proc = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc, json.loads((run / "summary.json").read_text())


@pytest.mark.slow  # two 2-rank runs through the launcher, one restarted: 15-30 s
def test_cli_foreground_easgd_killed_and_resumed_equals_uninterrupted(shared_dataset, tmp_path):
    """Rank 1 is killed after step 14 (the checkpoint at 10 lies between two rounds, at 9
    and 12: the replicas and their Adam states differ); the launcher restarts the ranks,
    they resume from it and end where the uninterrupted run ends, to the last bit of every
    metric."""
    dataset = shared_dataset(days=2, rows=2000)
    _, full = _cli_train(dataset, tmp_path / "full")
    proc, cut = _cli_train(dataset, tmp_path / "cut", "train.inject_failure=1:14", "dist.max_restarts=1")
    assert "resumed from step 10" in proc.stderr and cut["step"] == full["step"] == 20
    metrics = set(full["eval"]) - {"eval_seconds"}
    assert metrics >= {"log_loss", "auc", "calibration"} and set(cut["eval"]) - {"eval_seconds"} == metrics
    for k in metrics:
        assert cut["eval"][k] == full["eval"][k], k
    assert cut["sync"]["rounds"] == full["sync"]["rounds"] == 6  # (the count carried over too)
