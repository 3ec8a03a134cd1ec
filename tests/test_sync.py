"""Synchronizers of dense replicas on 2 gloo ranks: the identities that pin each algorithm
(MA every step = synchronous data parallelism, BMUF(0, 1) = MA, EASGD(alpha 0) = independent
training), a background shadow thread that drives the replicas together while training
runs, and the bytes it counts."""

import pytest
import torch

from distributed import run_ranks
from hybridrec.comm.ledger import CommLedger, ring_allreduce_bytes
from hybridrec.parallel.dense_sync import DDPSync, NoSync
from hybridrec.parallel.parallelize import parallelize_dlrm
from hybridrec.sync import BackgroundRunner, ForegroundRunner, make_synchronizer
from hybridrec.train.optim import dense_parameters
from hybridrec.train.sparse_optim import combined_sparse_optimizer
from hybridrec.train.trainer import training_step
from test_sharded_embedding import GLOBAL_B, build, global_batches, local_batch, make_plan

pytestmark = pytest.mark.distributed


def worker(topo, algo, mode="foreground", steps=3, finish=False, kw=None):
    """Train ``steps`` steps (cycling 3 global batches) with ``algo`` (None: independent
    replicas; "ddp": synchronous data parallelism); returns the dense replica and stats."""
    ledger = CommLedger()
    sync = DDPSync(topo, ledger=ledger) if algo == "ddp" else NoSync()
    model = parallelize_dlrm(build("sum"), make_plan("table_wise", topo.world_size), topo, ledger=ledger,
                             dense_sync=sync)
    dense_opt = torch.optim.SGD(dense_parameters(model), lr=0.1)
    sparse_opt = combined_sparse_optimizer("sgd", model.sparse, lr=0.1)
    group = topo.parallel_groups(1)[0]
    runner = None
    if algo not in (None, "ddp"):
        cls = BackgroundRunner if mode == "background" else ForegroundRunner
        runner = cls(make_synchronizer(algo, **(kw or {})), dense_parameters(model), group, ledger=ledger)
        runner.start()
    batches, b = global_batches(False), GLOBAL_B // topo.world_size
    for step in range(1, steps + 1):
        batch = local_batch(batches[step % len(batches)], topo.rank * b, (topo.rank + 1) * b)
        training_step(model, batch, dense_opt=dense_opt, sparse_opt=sparse_opt, dense_sync=sync)
        if runner is not None:
            runner.after_step(step)
    if isinstance(runner, BackgroundRunner):
        runner.stop()  # the replicas as training left them, before the final average
    replica = torch.cat([p.detach().reshape(-1) for p in dense_parameters(model)])
    if runner is not None and finish:
        runner.finish()
    final = torch.cat([p.detach().reshape(-1) for p in dense_parameters(model)])
    stats = runner.summary() if runner else {}
    return replica, final, stats, ledger.totals(category="sync").sent


def _close(a, b):
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_foreground_ma_every_step_equals_synchronous_data_parallelism():
    ma, ddp = run_ranks(worker, 2, "ma"), run_ranks(worker, 2, "ddp")
    for (a, *_), (d, *_) in zip(ma, ddp):
        _close(a, d)
    assert torch.equal(ma[0][0], ma[1][0])  # every round leaves the replicas identical
    n = ma[0][0].numel()
    assert ma[0][2]["rounds"] == 3 and ma[0][3] == 3 * ring_allreduce_bytes(4 * n, 2)


def test_bmuf_without_momentum_and_unit_block_lr_equals_ma():
    bmuf = run_ranks(worker, 2, "bmuf", "foreground", 3, False, {"block_momentum": 0.0, "block_lr": 1.0})
    ma = run_ranks(worker, 2, "ma")
    for (b, *_), (m, *_) in zip(bmuf, ma):
        _close(b, m)


def test_easgd_with_alpha_zero_is_independent_training():
    easgd, alone = run_ranks(worker, 2, "easgd", "foreground", 3, False, {"alpha": 0.0}), run_ranks(worker, 2, None)
    for (e, *_), (a, *_) in zip(easgd, alone):
        assert torch.equal(e, a)
    assert not torch.equal(alone[0][0], alone[1][0])  # the replicas did drift apart


@pytest.mark.parametrize("algo, kw", [("ma", {}), ("easgd", {"alpha": 0.4}), ("bmuf", {})])
def test_background_sync_drives_the_replicas_together(algo, kw):
    synced = run_ranks(worker, 2, algo, "background", 40, True, kw)
    alone = run_ranks(worker, 2, None, "background", 40)
    gap_synced = (synced[0][0] - synced[1][0]).norm()
    gap_alone = (alone[0][0] - alone[1][0]).norm()
    stats = synced[0][2]
    assert stats["rounds"] >= 1 and stats["mode"] == "background"
    assert gap_synced < 0.5 * gap_alone, (gap_synced, gap_alone, stats)
    assert torch.equal(synced[0][1], synced[1][1])  # finish() averages: one model at the end
