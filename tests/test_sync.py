"""Synchronizers of dense replicas on 2 gloo ranks: the identities that pin each algorithm
(MA every step = synchronous data parallelism, BMUF(0, 1) = MA, EASGD(alpha 0) = independent
training), BMUF's block momentum against its recursion, a background shadow thread that
drives the replicas together while training runs, its throttle, and the bytes it counts."""

import time
from itertools import pairwise

import pytest
import torch
from distributed import run_ranks
from test_sharded_embedding import GLOBAL_B, build, global_batches, local_batch, make_plan

from hybridrec.comm.ledger import CommLedger, ring_allreduce_bytes
from hybridrec.parallel.dense_sync import DDPSync, NoSync
from hybridrec.parallel.parallelize import parallelize_dlrm
from hybridrec.sync import BackgroundRunner, BlockMomentum, ForegroundRunner, make_synchronizer
from hybridrec.train.loop.optim import dense_parameters
from hybridrec.train.loop.sparse_optim import combined_sparse_optimizer
from hybridrec.train.loop.step import training_step

pytestmark = pytest.mark.distributed


def worker(topo, algo, mode="foreground", steps=3, finish=False, kw=None, runner_kw=None):
    """Train ``steps`` steps (cycling 3 global batches) with ``algo`` (None: independent
    replicas; "ddp": synchronous data parallelism; ``runner_kw``: the runner's throttle);
    returns the dense replica, the final one, the runner's summary and sync bytes sent, and
    the background runner's round starts and the seconds from its start to its stop."""
    ledger = CommLedger()
    sync = DDPSync(topo, ledger=ledger) if algo == "ddp" else NoSync()
    model = parallelize_dlrm(build("sum"), make_plan("table_wise", topo.group_size), topo, ledger=ledger,
                             dense_sync=sync)
    dense_opt = torch.optim.SGD(dense_parameters(model), lr=0.1)
    sparse_opt = combined_sparse_optimizer("sgd", model.sparse, lr=0.1)
    group = topo.parallel_groups(1)[0]
    runner = None
    if algo not in (None, "ddp"):
        cls = BackgroundRunner if mode == "background" else ForegroundRunner
        runner = cls(make_synchronizer(algo, **(kw or {})), dense_parameters(model), group, ledger=ledger,
                     **(runner_kw or {}))
        runner.start()
    began = time.monotonic()
    batches, b = global_batches(False), GLOBAL_B // topo.group_size
    for step in range(1, steps + 1):
        batch = local_batch(batches[step % len(batches)], topo.rank * b, (topo.rank + 1) * b)
        training_step(model, batch, dense_opt=dense_opt, sparse_opt=sparse_opt, dense_sync=sync)
        if runner is not None:
            runner.after_step(step)
    if isinstance(runner, BackgroundRunner):
        runner.stop()  # the replicas as training left them, before the final average
    elapsed = time.monotonic() - began
    replica = torch.cat([p.detach().reshape(-1) for p in dense_parameters(model)])
    if runner is not None and finish:
        runner.finish()
    final = torch.cat([p.detach().reshape(-1) for p in dense_parameters(model)])
    stats = runner.summary() if runner else {}
    starts = list(getattr(runner, "round_starts", []))
    return replica, final, stats, ledger.totals(category="sync").sent, starts, elapsed


@pytest.fixture(scope="module")
def ranks():
    """``ranks(*args)``: ``run_ranks(worker, 2, *args)``, run once per arguments in this
    module (MA's 3 foreground steps serve two tests, the independent replicas of the
    background test all three of its algorithms: the same deterministic run each time)."""
    runs = {}

    def get(*args):
        key = repr(args)
        if key not in runs:
            runs[key] = run_ranks(worker, 2, *args)
        return runs[key]

    return get


def _close(a, b):
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_foreground_ma_every_step_equals_synchronous_data_parallelism(ranks):
    ma, ddp = ranks("ma"), run_ranks(worker, 2, "ddp")
    for (a, *_), (d, *_) in zip(ma, ddp):
        _close(a, d)
    assert torch.equal(ma[0][0], ma[1][0])  # every round leaves the replicas identical
    n = ma[0][0].numel()
    assert ma[0][2]["rounds"] == 3 and ma[0][3] == 3 * ring_allreduce_bytes(4 * n, 2)


def test_bmuf_without_momentum_and_unit_block_lr_equals_ma(ranks):
    bmuf = run_ranks(worker, 2, "bmuf", "foreground", 3, False, {"block_momentum": 0.0, "block_lr": 1.0})
    ma = ranks("ma")
    for (b, *_), (m, *_) in zip(bmuf, ma):
        _close(b, m)


def test_easgd_with_alpha_zero_is_independent_training():
    easgd, alone = run_ranks(worker, 2, "easgd", "foreground", 3, False, {"alpha": 0.0}), run_ranks(worker, 2, None)
    for (e, *_), (a, *_) in zip(easgd, alone):
        assert torch.equal(e, a)
    assert not torch.equal(alone[0][0], alone[1][0])  # the replicas did drift apart


@pytest.mark.parametrize("algo, kw", [("ma", {}), ("easgd", {"alpha": 0.4}), ("bmuf", {})])
def test_background_sync_drives_the_replicas_together(ranks, algo, kw):
    synced = run_ranks(worker, 2, algo, "background", 40, True, kw)
    alone = ranks(None, "background", 40)
    gap_synced = (synced[0][0] - synced[1][0]).norm()
    gap_alone = (alone[0][0] - alone[1][0]).norm()
    stats = synced[0][2]
    assert stats["rounds"] >= 1 and stats["mode"] == "background"
    assert gap_synced < 0.5 * gap_alone, (gap_synced, gap_alone, stats)
    assert torch.equal(synced[0][1], synced[1][1])  # finish() averages: one model at the end


def bmuf_worker(topo, mu, zeta, nesterov, rounds):
    """BMUF rounds on snapshots made by hand: every round, each rank's replica is the last
    target plus a fixed progress of its own (rank r: r + 1 in every coordinate)."""
    bmuf = BlockMomentum(mu, zeta, nesterov=nesterov)
    group = topo.parallel_groups(1)[0]
    target = torch.zeros(4)
    bmuf.init(target)
    deltas = []
    for _ in range(rounds):
        target = bmuf.round(target + (topo.rank + 1.0), group)
        deltas.append(bmuf.delta.clone())
    return deltas, target


@pytest.mark.parametrize("nesterov", [True, False])
def test_bmuf_block_momentum_follows_its_recursion(nesterov):
    """delta_k = mu delta_{k-1} + zeta p with p the replicas' mean progress in the block
    (1.5 here), whether or not the replicas start from the Nesterov look-ahead: the
    momentum decays (delta -> zeta p / (1 - mu)) instead of building up without end."""
    mu, zeta, p, rounds = 0.5, 1.0, 1.5, 12
    (deltas, _), (deltas1, _) = run_ranks(bmuf_worker, 2, mu, zeta, nesterov, rounds)
    expect = torch.zeros(4)
    for d, d1 in zip(deltas, deltas1):
        expect = mu * expect + zeta * p
        _close(d, expect)
        assert torch.equal(d, d1)  # the same global state on every rank
    _close(deltas[-1], torch.full((4,), zeta * p / (1 - mu) * (1 - mu**rounds)))


def test_background_rounds_wait_for_the_interval_and_stop_wakes_the_wait():
    """With an interval far longer than the run, only the first round happens on each rank
    (rounds <= elapsed / interval + 1), and stop() ends the wait for the second: the run
    does not last the interval."""
    interval = 3600.0
    ranks = run_ranks(worker, 2, "ma", "background", 20, True, None, {"interval_s": interval}, timeout_s=30)
    for _, final, stats, sent, starts, elapsed in ranks:
        assert stats["rounds"] == len(starts) <= elapsed / interval + 1
        assert stats["rounds"] == 1 and stats["interval_s"] == interval
    assert torch.equal(ranks[0][1], ranks[1][1])


def test_background_rounds_every_k_steps():
    """sync.every in the background: a round starts only once k training steps passed since
    the previous one started; every rank runs the same rounds; each round's bytes are counted."""
    k, steps = 4, 40
    ranks = run_ranks(worker, 2, "ma", "background", steps, True, None, {"every": k})
    counts = {stats["rounds"] for _, _, stats, *_ in ranks}
    assert len(counts) == 1, counts  # the ranks agree on the number of rounds
    for replica, final, stats, sent, starts, _ in ranks:
        at = [step for _, step, _ in starts]
        assert 2 <= len(at) == stats["rounds"] <= steps // k + 1  # (at least one gap to check)
        assert all(b - a >= k for a, b in pairwise(at)), at
        n = replica.numel()  # rounds, the final average, and one stop flag per round and the last
        assert sent == (len(at) + 1) * ring_allreduce_bytes(4 * n, 2) + (len(at) + 1) * ring_allreduce_bytes(4, 2)
    assert torch.equal(ranks[0][1], ranks[1][1])


def test_background_duty_rests_after_each_round():
    """sync.duty: after a round of T seconds the thread rests T (1/duty - 1) before the next
    (so it spends at most ``duty`` of its time in rounds)."""
    duty = 0.25
    ranks = run_ranks(worker, 2, "ma", "background", 40, True, None, {"duty": duty})
    assert ranks[0][2]["rounds"] == ranks[1][2]["rounds"] >= 2  # (a rest to check between two rounds)
    for *_, stats, _, starts, elapsed in ranks:
        assert stats["duty"] == duty and len(starts) == stats["rounds"]
        for (t0, _, took), (t1, _, _) in pairwise(starts):
            assert t1 - t0 >= took / duty
        assert 0 < stats["busy_fraction"] <= 1
