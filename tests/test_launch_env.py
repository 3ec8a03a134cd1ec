"""hybridrec.launch_env: the launcher's rank variables, read in one place."""

from __future__ import annotations

import pytest

from hybridrec import launch_env

VARIABLES = ("WORLD_SIZE", "RANK", "LOCAL_WORLD_SIZE", "LOCAL_RANK")


@pytest.fixture
def env(monkeypatch):
    for name in VARIABLES:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def test_a_process_started_alone_is_rank_0_of_1(env):
    assert not launch_env.started_as_rank()
    assert (launch_env.world_size(), launch_env.rank(), launch_env.local_rank()) == (1, 0, 0)
    assert launch_env.local_world_size() == 1 and launch_env.local_world_size(5) == 5


def test_a_launched_rank_reads_its_place(env):
    env.setenv("WORLD_SIZE", "8")
    env.setenv("RANK", "5")
    env.setenv("LOCAL_RANK", "1")
    assert launch_env.started_as_rank()
    assert (launch_env.world_size(), launch_env.rank(), launch_env.local_rank()) == (8, 5, 1)
    assert launch_env.local_world_size() == 8  # no LOCAL_WORLD_SIZE: every rank on this machine
    env.setenv("LOCAL_WORLD_SIZE", "4")
    assert launch_env.local_world_size() == launch_env.local_world_size(1) == 4


@pytest.mark.parametrize("value", ["", " ", "two", "-1", "1.5"])
def test_a_malformed_value_reads_as_the_default(env, value):
    env.setenv("WORLD_SIZE", value)
    env.setenv("LOCAL_WORLD_SIZE", value)
    assert launch_env.world_size() == 1 and launch_env.local_world_size(3) == 3
