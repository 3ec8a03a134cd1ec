"""hybridrec.broadcast.rank0_value: rank 0's value on every rank, as JSON (nothing unpickled)."""

from __future__ import annotations

import pytest
from distributed import run_ranks

from hybridrec.broadcast import rank0_value


def test_one_process_gets_its_own_value_back():
    value = {"steps": 3}
    assert rank0_value(value, None) is value


def _decide(topo):
    mine = {
        "run_dir": f"runs/of-rank-{topo.rank}",  # train/run.py: a new run directory
        "kept": {"steps": 7, "reason": "Young/Daly", "seconds": 0.25} if topo.rank == 0 else None,
        "picks": {"model.bottom": ["onednn", "torch"], "model.top": ["torch"]},  # kernels timed
    }
    if topo.rank:
        mine["picks"] = {"model.bottom": ["torch", "torch"], "model.top": ["onednn"]}
    return {key: rank0_value(value, topo.run_group, device=topo.comm_device) for key, value in mine.items()}


@pytest.mark.distributed
def test_every_rank_takes_rank_0s_values():
    r0, r1 = run_ranks(_decide, 2)
    assert r1 == r0 == {"run_dir": "runs/of-rank-0",
                        "kept": {"steps": 7, "reason": "Young/Daly", "seconds": 0.25},
                        "picks": {"model.bottom": ["onednn", "torch"], "model.top": ["torch"]}}
