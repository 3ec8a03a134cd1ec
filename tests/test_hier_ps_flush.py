"""Groups sharing parameter servers: before a checkpoint every group's pushes land, not
only group 0's (:meth:`hybridrec.train.ps_run.ServerCheckpoints.quiesce`)."""

import time

import pytest
from distributed import run_ranks

from hybridrec.train.ps_run import ServerCheckpoints

pytestmark = pytest.mark.distributed


class SlowPushes:
    """A sparse optimizer whose pushes in flight take ``seconds`` to land (on group 1)."""

    def __init__(self, seconds: float) -> None:
        self.seconds, self.landed = seconds, None

    def flush(self) -> None:
        time.sleep(self.seconds)
        self.landed = time.time()


def quiesce_worker(topo):
    from hybridrec.parallel.topology import Topology

    h = Topology.init(backend="gloo", group_size=2)
    opt = SlowPushes(1.0 if h.group_index == 1 else 0.0)
    ServerCheckpoints(h, num_ps=1, timeout_s=30).quiesce(opt)
    return h.group_index, opt.landed, time.time()  # group 0 would ask the servers to save now


def test_group_0_saves_only_after_every_groups_pushes_landed():
    ranks = run_ranks(quiesce_worker, 4, timeout_s=60)
    assert sorted(r[0] for r in ranks) == [0, 0, 1, 1]  # (two groups of two: group 0's are checked below)
    landed = max(r[1] for r in ranks if r[0] == 1)
    assert all(r[1] is not None for r in ranks)  # every trainer flushed, not only group 0's
    for group, _, ready in ranks:
        if group == 0:
            assert ready >= landed
