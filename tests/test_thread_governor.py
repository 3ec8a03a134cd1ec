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


def _train(gov: ThreadGovernor, steps: range, seconds_at: dict[int, float]) -> list[int]:
    """Feed ``gov`` the step times a machine where ``seconds_at[n]`` is a step's time at n
    threads would give (the count in force is torch's own); returns the count per step."""
    counts = []
    for step in steps:
        counts.append(torch.get_num_threads())
        gov.record(step, seconds_at[torch.get_num_threads()])
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
