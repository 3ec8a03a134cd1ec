"""Table rows across groups are synced by their changes (hybridrec.sync.rows): a row that
one group touched moves by that group's whole update, not by 1/G of it, whatever the
synchronizer; the dense part still follows the synchronizer."""

import pytest
import torch
from distributed import run_ranks

from hybridrec.sync import ForegroundRunner, make_synchronizer
from hybridrec.sync.rows import TableRows, table_shapes

pytestmark = pytest.mark.distributed

INIT = torch.arange(8.0).view(4, 2)  # the table every group starts from: 4 rows x 2 columns


def rows_worker(topo, algorithm, rows):
    """Two ranks, each one group's member: a dense vector and one table. Round 1: only
    rank 0 touches row 1, both touch row 2, only rank 1 row 3, nobody row 0. Round 2: only
    rank 1 touches row 1. Returns the table and the dense part after each round, and the
    same dense part synchronized by a runner of the same algorithm without table rows."""
    dense = torch.nn.Parameter(torch.zeros(3))
    table = torch.nn.Parameter(INIT.clone(), requires_grad=False)
    runner = ForegroundRunner(make_synchronizer(algorithm), [dense, table], topo.parallel_groups(1)[0],
                              rows=rows)
    alone = torch.nn.Parameter(torch.zeros(3))
    plain = ForegroundRunner(make_synchronizer(algorithm), [alone], topo.parallel_groups(1)[0])
    runner.start()
    plain.start()
    r = topo.rank
    out, plain_out = [], []
    with torch.no_grad():
        dense.add_(float(r + 1))
        alone.add_(float(r + 1))
        if r == 0:
            table[1] += torch.tensor([1.0, -2.0])
        table[2] += torch.tensor([4.0, 4.0]) * (r + 1)
        if r == 1:
            table[3] += 3.0
    runner.after_step(1)
    plain.after_step(1)
    out.append((table.detach().clone(), dense.detach().clone()))
    plain_out.append(alone.detach().clone())
    with torch.no_grad():
        if r == 1:
            table[1] += 10.0
    runner.after_step(2)
    plain.after_step(2)
    out.append((table.detach().clone(), dense.detach().clone()))
    plain_out.append(alone.detach().clone())
    return out, runner.sync.state_dict(), plain_out


@pytest.mark.parametrize("algorithm", ["ma", "easgd", "bmuf"])
def test_a_row_one_group_touched_moves_by_that_groups_whole_update(algorithm):
    ranks = run_ranks(rows_worker, 2, algorithm, "touched")
    want1 = INIT.clone()
    want1[1] += torch.tensor([1.0, -2.0])  # rank 0's update, whole (the plain mean: half)
    want1[2] += torch.tensor([6.0, 6.0])  # both touched: the mean of their updates (4 and 8)
    want1[3] += 3.0  # rank 1's, whole
    want2 = want1.clone()
    want2[1] += 10.0  # from the agreed row, rank 1's change only
    for out, _, plain in ranks:
        torch.testing.assert_close(out[0][0], want1, rtol=0, atol=0)
        torch.testing.assert_close(out[1][0], want2, rtol=0, atol=0)
        for (_, dense), alone in zip(out, plain):  # the dense part: the synchronizer's, rows or not
            torch.testing.assert_close(dense, alone, rtol=0, atol=0)
    if algorithm == "ma":  # MA's mean, for one
        for out, _, _ in ranks:
            torch.testing.assert_close(out[0][1], torch.full((3,), 1.5))
    state = ranks[0][1]  # the anchor is checkpointed with the synchronizer's state
    torch.testing.assert_close(state["table_anchor"], want2.reshape(-1))
    again = TableRows(make_synchronizer(algorithm), 3, [(4, 2)])
    again.load_state_dict(state)
    torch.testing.assert_close(again.anchor, want2.reshape(-1))


def test_rows_all_is_the_plain_mean_that_halves_a_row_one_group_touched():
    ranks = run_ranks(rows_worker, 2, "ma", "all")
    for out, _, _ in ranks:
        torch.testing.assert_close(out[0][0][1], INIT[1] + torch.tensor([0.5, -1.0]))


def test_table_shapes_are_the_trailing_untrained_2d_parameters():
    w = torch.nn.Parameter(torch.zeros(2, 3))  # a trained (dense) weight
    t1 = torch.nn.Parameter(torch.zeros(5, 4), requires_grad=False)
    t2 = torch.nn.Parameter(torch.zeros(7, 4), requires_grad=False)
    assert table_shapes([w, t1, t2]) == [(5, 4), (7, 4)]
    assert table_shapes([t1, w]) == []  # a flat run's dense replica: no tables
    with pytest.raises(ValueError, match="touched or all"):
        TableRows(make_synchronizer("ma"), 6, [(5, 4)], rows="some")
