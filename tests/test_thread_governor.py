"""The step's thread count, chosen by timing steps: it follows whichever count is faster, as
the machine's load changes, and keeps its probes rare when nothing changes."""

import itertools

import pytest
import torch

from hybridrec.train.loop.thread_governor import ThreadGovernor, thread_governor


@pytest.fixture(autouse=True)
def torch_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


class Clock:
    """The wall time of the simulated machine: the sum of the step times fed so far."""

    def __init__(self) -> None:
        self.now = 1000.0


def _train(gov: ThreadGovernor, steps: range, seconds_at: dict[int, float], clock: Clock | None = None) -> list[int]:
    """Feed ``gov`` the step times a machine where ``seconds_at[n]`` is a step's time at n
    threads would give (the count in force is torch's own), each step ending at ``clock``'s
    time advanced by its seconds; returns the count per step."""
    clock = clock or Clock()
    counts = []
    for step in steps:
        counts.append(torch.get_num_threads())
        seconds = seconds_at[torch.get_num_threads()]
        clock.now += seconds
        gov.record(step, seconds, now=clock.now)
    return counts


def test_a_busy_machine_goes_to_one_thread_and_back_when_it_is_idle_again():
    torch.set_num_threads(4)
    gov = ThreadGovernor(4, probe_steps=4, first_at=10, period=20, max_period=80)
    busy = {4: 0.030, 2: 0.012, 1: 0.010}  # a neighbour takes cores: fewer threads are faster
    counts = _train(gov, range(1, 200), busy)
    assert counts[0] == 4 and gov.current == 1 and not gov.probing and torch.get_num_threads() == 1
    assert counts.index(1) < 60  # (4 -> 2 at the first probe, 2 -> 1 at the second)
    idle = {4: 0.005, 2: 0.007, 1: 0.010}
    _train(gov, range(200, 600), idle)
    assert gov.current == 4 and not gov.probing and torch.get_num_threads() == 4
    assert [p["kept"] for p in gov.probes if p["kept"] != p["threads"][0]] == [2, 1, 2, 4]
    assert gov.summary()["changes"] == 4


def test_steady_conditions_keep_the_count_and_space_the_probes_out():
    torch.set_num_threads(2)
    gov = ThreadGovernor(2, probe_steps=4, first_at=10, period=20, max_period=160)
    counts = _train(gov, range(1, 1000), {2: 0.005, 1: 0.008})
    assert gov.current == 2 and torch.get_num_threads() == (1 if gov.probing else 2)
    starts = [p["step"] for p in gov.probes]
    gaps = [b - a for a, b in itertools.pairwise(starts)]
    assert gaps == sorted(gaps) and gaps[-1] >= 160  # doubled until the cap
    # the steps at the slower count are the probes' alone: few
    assert counts.count(1) <= (len(gov.probes) + 1) * (gov.probe_steps + 1)
    assert counts.count(1) < 0.05 * len(counts)


def test_a_difference_within_the_margin_keeps_the_current_count():
    torch.set_num_threads(2)
    gov = ThreadGovernor(2, probe_steps=4, first_at=5, period=10, margin=0.05)
    _train(gov, range(1, 200), {2: 0.0100, 1: 0.0098})  # 1 thread 2% faster: noise, not a reason
    assert gov.current == 2 and gov.probes and all(p["kept"] == 2 for p in gov.probes)


def test_the_governor_is_left_out_where_the_count_is_not_its_to_choose():
    torch.set_num_threads(2)
    cpu = torch.device("cpu")
    assert thread_governor(0, world_size=1, workers=1, device=cpu) is not None
    assert thread_governor(2, world_size=1, workers=1, device=cpu) is None  # the user's count
    assert thread_governor(0, world_size=2, workers=1, device=cpu) is None
    assert thread_governor(0, world_size=1, workers=2, device=cpu) is None  # Hogwild
    assert thread_governor(0, world_size=1, workers=1, device=torch.device("meta")) is None
    torch.set_num_threads(1)
    assert thread_governor(0, world_size=1, workers=1, device=cpu) is None  # nothing to choose from
    with pytest.raises(ValueError, match="at least 2 threads"):
        ThreadGovernor(1)


def test_a_bad_count_kept_by_a_probe_lasts_seconds_when_steps_turn_slow():
    """The first probe keeps 2 threads on an idle machine; then a neighbour takes a core and
    2 threads train 11x slower. The next probe comes after the wall-time wait (10 s), not
    after the 400 steps of the steps' wait (68 s of such steps)."""
    torch.set_num_threads(2)
    gov, clock = ThreadGovernor(2), Clock()
    _train(gov, range(1, 60), {2: 0.011, 1: 0.015}, clock)
    assert [p["kept"] for p in gov.probes] == [2] and gov.next_at > 400
    turned = clock.now
    counts = _train(gov, range(60, 400), {2: 0.170, 1: 0.015}, clock)
    assert gov.current == 1 and gov.probes[-1]["kept"] == 1
    bad_steps = counts.index(1)  # steps at 2 threads after the machine turned busy
    assert bad_steps * 0.170 < 10 + 2 * gov.probe_steps * 0.170, bad_steps
    assert gov.probes[1]["step"] < 60 + 100, gov.probes
    assert clock.now - turned < 60


def _waits(gov: ThreadGovernor, steps: range, seconds_at: dict[int, float], clock: Clock) -> list[float]:
    """Train as :func:`_train`; the wall-time wait set by each probe that ended meanwhile."""
    waits, probes = [], len(gov.probes)
    for step in steps:
        _train(gov, range(step, step + 1), seconds_at, clock)
        if len(gov.probes) > probes:
            probes = len(gov.probes)
            waits.append(round(gov.next_time - clock.now, 6))
    return waits


def test_the_wall_time_wait_doubles_on_a_keep_and_starts_over_on_a_change():
    torch.set_num_threads(2)
    gov = ThreadGovernor(2, probe_steps=4, first_at=5, period=10_000, max_period=10_000,
                         period_s=5.0, max_period_s=40.0, spacing=0.0)
    clock = Clock()
    # steady: every probe keeps 2 threads; steps alone would wait 10,000 steps
    assert _waits(gov, range(1, 2000), {2: 0.1, 1: 0.2}, clock)[:6] == [10, 20, 40, 40, 40, 40]
    assert all(p["kept"] == 2 for p in gov.probes)
    # 1 thread turns faster: the next probe (at most 40 s on) changes the count, and the
    # wait starts over from period_s
    waits = _waits(gov, range(2000, 2500), {2: 0.2, 1: 0.1}, clock)
    assert gov.current == 1 and waits[0] == 5.0, waits
    assert gov.probes[-len(waits)]["kept"] == 1 and gov.probes[-len(waits)]["step"] < 2000 + 40 / 0.2 + 12


def test_probes_of_slow_steps_keep_their_share_of_the_time():
    """Where every step is slow, a wall-time wait is at least ``spacing`` times the probe's
    own duration: the probes do not take over the run."""
    torch.set_num_threads(2)
    gov = ThreadGovernor(2, probe_steps=4, first_at=5, period=10_000, max_period=10_000,
                         period_s=1.0, max_period_s=1.0, spacing=8.0)
    counts = _train(gov, range(1, 300), {2: 2.0, 1: 2.5}, Clock())  # 2 s steps: a probe takes 18 s
    ends = [p["step"] for p in gov.probes]
    gaps = [b - a for a, b in itertools.pairwise(ends)]
    assert gaps and all(g >= 8 * (2 * 4 + 1) for g in gaps), gaps
    assert counts.count(1) < 0.1 * len(counts)
