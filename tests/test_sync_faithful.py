"""The synchronizers as their papers give them, on real gloo ranks: EASGD's two updates with
the centre moving at ``beta = N alpha < 1`` by default (Zhang et al. 2015, beta 0.9) and the
centre as the final model; BMUF's default block momentum ``1 - 1/N`` (Chen and Huo 2016);
a background round's delta write-back, which keeps the steps trained during the round; and
a shadow thread that dies, which ends the run at the next step."""

import threading
import time

import pytest
import torch
from distributed import run_ranks

from hybridrec.sync import (
    BackgroundRunner,
    BlockMomentum,
    ElasticAveraging,
    ForegroundRunner,
    make_synchronizer,
)
from hybridrec.sync.algorithms import ModelAveraging, as_mean
from hybridrec.sync.runners import ShadowSyncDied

pytestmark = pytest.mark.distributed


def _close(a, b):
    torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


# -- defaults -------------------------------------------------------------------------------
@pytest.mark.parametrize("n", [2, 4, 8, 64])
def test_default_rates_follow_the_papers_for_any_number_of_ranks(n):
    alpha, beta = ElasticAveraging().rates(n)
    assert beta == 0.9 and alpha == pytest.approx(0.9 / n)  # the centre never jumps onto the mean
    assert BlockMomentum().momentum(n) == pytest.approx(1 - 1 / n)
    assert ElasticAveraging(0.25).rates(n) == (0.25, min(1.0, 0.25 * n))  # a rate the user set is kept
    assert BlockMomentum(0.5).momentum(n) == 0.5
    auto = make_synchronizer("easgd", alpha="auto")
    assert auto.alpha is None and make_synchronizer("bmuf", block_momentum="auto").block_momentum is None


# -- EASGD's and BMUF's recursions on hand-made snapshots ----------------------------------
def recursion_worker(topo, alpha, rounds):
    """EASGD (``alpha``; None: the default) and BMUF (default momentum) rounds on snapshots
    made by hand: rank r's replica is the last target plus (r + 1)(k + 1) in round k; then
    EASGD's final model from the last targets plus 1."""
    group = topo.parallel_groups(1)[0]
    easgd, bmuf = ElasticAveraging(alpha), BlockMomentum()
    easgd.init(torch.zeros(3))
    bmuf.init(torch.zeros(3))
    t_e = t_b = torch.zeros(3)
    out = []
    for k in range(rounds):
        progress = (topo.rank + 1.0) * (k + 1)
        s_e, s_b = t_e + progress, t_b + progress
        t_e, t_b = easgd.round(s_e, group), bmuf.round(s_b, group)
        out.append({"s_e": s_e, "t_e": t_e, "centre": easgd.centre.clone(), "s_b": s_b, "t_b": t_b,
                    "delta": bmuf.delta.clone()})
    final = easgd.final(t_e + 1.0, group)
    return out, final, bmuf.mu


def _check_recursions(ranks, alpha, beta, mu):
    n = len(ranks)
    c, g, delta = torch.zeros(3), torch.zeros(3), torch.zeros(3)
    for k in range(len(ranks[0][0])):
        rounds = [r[0][k] for r in ranks]
        mean_e = sum(x["s_e"] for x in rounds) / n
        c = c + beta * (mean_e - c)
        for x in rounds:  # the centre: beta of the way to the mean, the same on every rank
            _close(x["centre"], c)
        for x in rounds:  # every replica: alpha of the way to the updated centre
            _close(x["t_e"], x["s_e"] - alpha * (x["s_e"] - c))
        start = g + mu * delta  # BMUF with Nesterov: the block started from the look-ahead
        delta = mu * delta + (sum(x["s_b"] for x in rounds) / n - start)
        g = g + delta
        for x in rounds:
            _close(x["delta"], delta)
            _close(x["t_b"], g + mu * delta)
    last = sum(r[0][-1]["t_e"] + 1.0 for r in ranks) / n
    for r in ranks:  # the final model: the centre, moved once more toward the last mean
        _close(r[1], c + beta * (last - c))
        assert r[2] == pytest.approx(mu)


def test_default_easgd_and_bmuf_on_four_ranks_follow_their_recursions():
    """With 4 ranks the old default (alpha 0.25) made the centre each round's mean
    (beta = min(1, 4 * 0.25) = 1); now beta = 0.9, alpha = 0.225, and BMUF's mu = 0.75."""
    ranks = run_ranks(recursion_worker, 4, None, 5)
    _check_recursions(ranks, alpha=0.225, beta=0.9, mu=0.75)
    c = ranks[0][0][0]["centre"]
    mean = sum(r[0][0]["s_e"] for r in ranks) / 4
    assert not torch.allclose(c, mean)  # not the snapshot mean: the centre keeps its memory


def test_easgd_with_alpha_set_follows_its_recursion_on_two_ranks():
    ranks = run_ranks(recursion_worker, 2, 0.3, 4)
    _check_recursions(ranks, alpha=0.3, beta=0.6, mu=0.5)


# -- the final model ---------------------------------------------------------------------
def final_worker(topo):
    """Foreground EASGD every 2 steps over a replica that drifts per rank; finish() makes it
    the final model. Returns the replicas before finish, after it, and the centre."""
    p = torch.nn.Parameter(torch.zeros(5))
    runner = ForegroundRunner(ElasticAveraging(), [p], topo.parallel_groups(1)[0], every=2)
    runner.start()
    for step in range(1, 6):
        with torch.no_grad():
            p.add_(torch.arange(5.0) * (topo.rank + 1) - step)
        runner.after_step(step)
    before = runner.flat()
    runner.finish()
    return before, runner.flat(), runner.sync.centre.clone()


def test_easgd_ends_with_the_centre_on_every_rank():
    ranks = run_ranks(final_worker, 2)
    (b0, f0, c0), (b1, f1, c1) = ranks
    assert torch.equal(f0, f1) and torch.equal(f0, c0) and torch.equal(c0, c1)
    assert not torch.allclose(f0, (b0 + b1) / 2)  # the centre, not the replicas' mean


# -- background write-back ---------------------------------------------------------------
class Gate:
    """A synchronizer whose round waits until the test lets it go; its target is the mean
    of the snapshots plus 10."""

    name = "gate"

    def __init__(self) -> None:
        self.entered, self.go = threading.Event(), threading.Event()

    def init(self, replica):
        pass

    def round(self, snapshot, mean):
        self.entered.set()
        assert self.go.wait(30)
        return as_mean(mean)(snapshot) + 10.0

    def state_dict(self):
        return {"name": self.name}

    def load_state_dict(self, state):
        pass


def write_back_worker(topo, write_back):
    """The replica trains one step (+1) while a round is in flight; the target (snapshot
    + 10) lands at the next step boundary."""
    p = torch.nn.Parameter(torch.zeros(3))
    gate = Gate()
    runner = BackgroundRunner(gate, [p], topo.parallel_groups(1)[0], write_back=write_back)
    runner.start()
    assert gate.entered.wait(30)  # the round took its snapshot (0) and waits
    with torch.no_grad():
        p.add_(1.0)  # a training step during the round
    gate.go.set()
    deadline = time.monotonic() + 30
    while not runner.round_starts and time.monotonic() < deadline:  # (appended once its target is out)
        time.sleep(0.005)
    assert runner.round_starts, "the round's target did not come out within 30 s of its release"
    runner.after_step(1)
    written = p.detach().clone()
    runner.stop()
    return written


@pytest.mark.parametrize("write_back, expect", [("delta", 11.0), ("overwrite", 10.0)])
def test_background_write_back_keeps_or_drops_the_steps_trained_during_a_round(write_back, expect):
    """delta: target + (live - snapshot) = 10 + 1: the step trained during the round stays;
    overwrite (ShadowSync's copy): the target alone, 10."""
    (written,) = run_ranks(write_back_worker, 1, write_back)
    assert torch.equal(written, torch.full((3,), expect))


# -- a shadow thread that dies -----------------------------------------------------------
class FailingAveraging(ModelAveraging):
    """Model averaging whose ``fail_at``-th round raises (on every rank: no rank is left
    waiting in a collective)."""

    def __init__(self, fail_at: int) -> None:
        self.fail_at, self.calls = fail_at, 0

    def round(self, snapshot, mean):
        self.calls += 1
        if self.calls == self.fail_at:
            raise RuntimeError(f"injected failure in round {self.calls}")
        return super().round(snapshot, mean)


def dead_thread_worker(topo, fail_at, limit_s):
    """Steps of about 20 ms with rounds back to back, until a step's after_step raises
    (however many steps the rounds up to the failing one take on a loaded machine; none
    within ``limit_s`` seconds: the thread died unnoticed, or never ran). Returns the step
    whose after_step raised (None: none did) with its message, and the step at which the
    thread died."""
    p = torch.nn.Parameter(torch.zeros(4))
    runner = BackgroundRunner(FailingAveraging(fail_at), [p], topo.parallel_groups(1)[0])
    runner.start()
    raised, step, deadline = None, 0, time.monotonic() + limit_s
    while raised is None and time.monotonic() < deadline:
        step += 1
        with torch.no_grad():
            p.add_(topo.rank + 1.0)
        time.sleep(0.02)
        try:
            runner.after_step(step)
        except ShadowSyncDied as e:
            raised = (step, str(e))
    return raised, runner._died_at


def test_a_dead_shadow_thread_ends_the_run_at_the_next_step():
    for raised, died_at in run_ranks(dead_thread_worker, 2, 3, 60.0, timeout_s=60.0):
        assert raised is not None, "the run trained on without its shadow thread"
        step, message = raised
        assert died_at is not None and died_at <= step <= died_at + 1, (died_at, step)
        assert message == (f"the shadow sync thread died at step {died_at} after 2 round(s): "
                           "RuntimeError: injected failure in round 3")
