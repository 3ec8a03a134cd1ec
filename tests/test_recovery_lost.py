"""Partial recovery's target and its accounting: the checkpoint interval keeps
``train.lost_fraction`` or falls back to full recovery (CPR's benefit estimate), and a
recovery counts the updates really lost by rows a hot-row (CPR-MFU) delta left out."""

import itertools
import json

import pytest
import torch

from hybridrec.model.embedding import EmbeddingBagCollection, TableConfig
from hybridrec.parallel.checkpoint_io import MANIFEST
from hybridrec.parallel.sharded_embedding import SHARDS
from hybridrec.train.checkpointing.checkpoint_interval import (
    partial_recovery_interval,
    recovery_overheads,
    young_daly_interval,
)
from hybridrec.train.checkpointing.deltas import ShardDeltas
from hybridrec.train.loop.sparse_optim import RowWiseAdagrad


def _loss(steps, step_s, mtbf_s, ranks, delta_steps=0, u=1.0):
    """The expected lost share, written out: rows a delta saves lose since it, the others
    since the checkpoint; half an interval on average, for 1/ranks of the rows."""
    t = steps * step_s
    if delta_steps:
        t = u * min(delta_steps * step_s, t) + (1 - u) * t
    return t / (2 * ranks * mtbf_s)


def test_the_issues_cases_keep_the_target():
    """Save 1 s, MTBF 110 s, 2 ranks, target 0.02: Young/Daly's 148 steps of 0.1 s would lose
    0.034; the bound (8.8 s = 88 steps) keeps 0.02 and still costs less than full recovery
    (1/8.8 = 0.114 of the time against 1/14.8 + 14.8/220 = 0.135). With deltas every 25 s
    the deltas cannot keep it (25 / 440 = 0.057): the checkpoints must."""
    kw = {"save_s": 1.0, "step_s": 0.1, "mtbf_s": 110.0, "total_steps": 5200, "ranks": 2, "lost_fraction": 0.02}
    yd = young_daly_interval(save_s=1.0, step_s=0.1, mtbf_s=110.0, total_steps=5200)
    assert yd["steps"] == 148 and _loss(148, 0.1, 110, 2) > 0.033
    got = partial_recovery_interval(**kw)
    assert got["fallback"] is None and got["steps"] == 88
    assert got["lost_fraction"] == pytest.approx(0.02) and got["lost_fraction"] <= 0.02
    assert got["overheads"]["partial"] == pytest.approx(1 / 8.8)
    assert got["overheads"]["full"] == pytest.approx(1 / 14.8 + 14.8 / 220)
    slow = partial_recovery_interval(**kw, delta_steps=250, delta_share=0.3)
    assert slow["fallback"] is None and slow["steps"] == 88 and slow["lost_fraction"] <= 0.02
    assert "cannot keep it" in slow["reason"]
    # deltas every 2.5 s keep it whatever the interval when they save every touched row ...
    touched = partial_recovery_interval(**kw, delta_steps=25, delta_share=0.3)
    assert touched["steps"] == 428 and touched["lost_fraction"] == pytest.approx(2.5 / 440)
    # ... but hot rows carrying 60% of the updates leave 40% to the checkpoint:
    # (0.6 x 2.5 + 0.4 T) / 440 <= 0.02 gives T <= 18.25 s
    hot = partial_recovery_interval(**kw, delta_steps=25, delta_share=0.3, delta_update_share=0.6)
    assert hot["steps"] == 182 and hot["lost_fraction"] <= 0.02
    assert hot["lost_fraction"] == pytest.approx(_loss(182, 0.1, 110, 2, 25, 0.6))


def test_partial_recovery_falls_back_to_full_where_keeping_the_target_costs_more():
    """Target 0.005: saving every 2.2 s costs 0.45 of the time, full recovery 0.135: full
    recovery at Young/Daly's interval, said with the reason. A target not even a checkpoint
    per step keeps (a step of 5 s against a 4.4 s bound) falls back too."""
    kw = {"save_s": 1.0, "step_s": 0.1, "mtbf_s": 110.0, "total_steps": 5200, "ranks": 2}
    got = partial_recovery_interval(**kw, lost_fraction=0.005)
    assert got["fallback"] == "full" and got["steps"] == 148 and got["lost_fraction"] == 0.0
    assert got["overheads"]["benefit"] < 0
    assert "full recovery instead" in got["reason"] and "costs partial recovery" in got["fallback_reason"]
    never = partial_recovery_interval(save_s=0.001, step_s=5.0, mtbf_s=110.0, total_steps=100, ranks=2,
                                      lost_fraction=0.01)
    assert never["fallback"] == "full" and "cannot keep" in never["fallback_reason"]


def test_the_target_holds_or_the_choice_says_full():
    """Over a grid of saves, steps, MTBFs, ranks, targets and deltas: the chosen interval
    keeps the target (the loss written out here) at a cost below full recovery's, or the
    choice falls back to full recovery at Young/Daly's interval."""
    fallbacks = cases = 0
    for save_s, step_s, mtbf_s, ranks, target, delta_steps, u in itertools.product(
            (0.05, 8.0), (0.01, 0.2), (30.0, 3600.0), (2, 8), (0.001, 0.02, 0.2), (0, 5, 400), (1.0, 0.3)):
        if not delta_steps and u < 1:
            continue
        fallbacks += _check_choice(save_s, step_s, mtbf_s, ranks, target, delta_steps, u)
        cases += 1
    assert 0 < fallbacks < cases  # (the grid has both)


def _check_choice(save_s, step_s, mtbf_s, ranks, target, delta_steps, u) -> bool:
    got = partial_recovery_interval(save_s=save_s, step_s=step_s, mtbf_s=mtbf_s, total_steps=1_000_000,
                                    ranks=ranks, lost_fraction=target, delta_steps=delta_steps,
                                    delta_share=0.25, delta_update_share=u)
    if got["fallback"] == "full":
        yd = young_daly_interval(save_s=save_s, step_s=step_s, mtbf_s=mtbf_s, total_steps=1_000_000)
        assert got["steps"] == yd["steps"] and got["fallback_reason"]
        if "cannot keep" in got["fallback_reason"]:  # not even a checkpoint per step keeps it
            assert _loss(1, step_s, mtbf_s, ranks, delta_steps, u) > target
        else:  # keeping it costs partial recovery at least as much as full recovery
            assert got["overheads"]["partial"] >= got["overheads"]["full"]
            if not delta_steps:  # (saving at most every B)
                assert got["overheads"]["partial"] >= save_s / (2 * ranks * mtbf_s * target) * (1 - 1e-9)
        return True
    assert _loss(got["steps"], step_s, mtbf_s, ranks, delta_steps, u) <= target * (1 + 1e-9)
    assert got["overheads"]["partial"] < got["overheads"]["full"]
    return False


def test_recovery_overheads():
    got = recovery_overheads(save_s=2.0, mtbf_s=100.0, full_s=20.0, partial_s=50.0)
    assert got["full"] == pytest.approx(0.1 + 0.1) and got["partial"] == pytest.approx(0.04)
    assert got["benefit"] == pytest.approx(0.16)
    # with deltas every 5 s replayed in 0.5 s each: 50 x 0.5 / (2 x 5 x 100) more
    d = recovery_overheads(save_s=2.0, mtbf_s=100.0, full_s=20.0, partial_s=50.0, delta_s=5.0, replay_s=0.5)
    assert d["partial"] == pytest.approx(0.04 + 0.025)
    with pytest.raises(ValueError, match="mtbf_s"):
        recovery_overheads(save_s=1.0, mtbf_s=0.0, full_s=1.0, partial_s=1.0)


def _step(deltas, ebc, opt, g, looked: dict[int, int]):
    """One step's updates of group ``g``: row -> lookups."""
    ids = torch.tensor([i for i, n in looked.items() for _ in range(n)])
    w = ebc.group_weight(g)
    with torch.no_grad():
        w.index_add_(0, ids.unique(), torch.ones(ids.unique().numel(), w.shape[1]))
    deltas.track({SHARDS: [(g, ids, None, None)]})


def test_hot_deltas_record_the_step_their_left_out_rows_hold(tmp_path):
    """CPR-MFU: rows a delta leaves out hold their own newest save's values (the checkpoint's
    or an older delta's). Each delta's manifest counts them by shard and that step; apply
    returns the newest's, and the update share a delta saves is measured."""
    ebc = EmbeddingBagCollection([TableConfig(name="a@0", num_embeddings=10, embedding_dim=4),
                                  TableConfig(name="b@1", num_embeddings=6, embedding_dim=4)], seed=0)
    assert ebc.num_groups == 1 and ebc.table_slice("b@1")[1] == 10
    opt = RowWiseAdagrad(ebc, lr=0.1)
    deltas = ShardDeltas(ebc, opt, directory=tmp_path / "d", plan=None, every=1, rows="hot", hot=0.5)
    deltas.checkpointed(3)
    _step(deltas, ebc, opt, 0, {1: 5, 2: 4, 11: 1, 12: 1})  # b's rows 1 and 2 (fused 11, 12): cold
    deltas.save(4)  # saves 1 and 2; 11 and 12 hold step 3
    _step(deltas, ebc, opt, 0, {2: 9, 5: 9, 13: 1})
    deltas.save(5)  # 2 and 5 (9 lookups), 11, 12, 13 (1 each): saves 2, 5 and 11 (the first of the ties)
    deltas.wait()
    assert json.loads((deltas.dir / "step-00000004" / MANIFEST).read_text())["pending_held"] == {"b@1": {"3": 2}}
    assert json.loads((deltas.dir / "step-00000005" / MANIFEST).read_text())["pending_held"] == {"b@1": {"3": 2}}
    _step(deltas, ebc, opt, 0, {1: 7, 3: 3, 0: 2, 11: 1})
    deltas.save(6)  # saves 1, 3, 0; left out: 11 (saved at 5), 12 and 13 (at the checkpoint, 3)
    deltas.wait()
    held6 = json.loads((deltas.dir / "step-00000006" / MANIFEST).read_text())["pending_held"]
    assert held6 == {"b@1": {"3": 2, "5": 1}}
    assert 0 < deltas.update_share() < 1
    saved_at = deltas.state_dict()["saved_at"][0]
    assert (saved_at[1], saved_at[11], saved_at[5], saved_at[13]) == (6, 5, 5, 3)
    for ahead in (False, True):  # a rank rolling back: the newest delta's left-out rows, and their steps
        if ahead:
            deltas.prefetch(3)
        newest, pending, older = deltas.apply(3, 6)
        assert (newest, pending, older) == (6, 3, held6)
        assert [int(deltas.saved_at[0][i]) for i in (1, 11, 5, 13)] == [6, 5, 5, 3]


def test_touched_deltas_leave_nothing_older(tmp_path):
    ebc = EmbeddingBagCollection([TableConfig(name="t@0", num_embeddings=8, embedding_dim=4)], seed=0)
    deltas = ShardDeltas(ebc, RowWiseAdagrad(ebc, lr=0.1), directory=tmp_path,
                         plan=None, every=1)
    deltas.counts[0][torch.tensor([1, 2])] = torch.tensor([9, 1], dtype=torch.int32)
    assert deltas.update_share() == 1.0


def test_a_fallback_makes_the_rank_recover_fully(tmp_path, capsys):
    """``Recovery.fall_back`` (the interval's ``fallback: "full"``): no more deltas, and a
    failure writes no snapshot, only the step reached, marked ``full`` (what the restarted
    run's record then says)."""
    from types import SimpleNamespace

    from hybridrec.train.checkpointing.recovery import Recovery
    from hybridrec.train.checkpointing.snapshots import read_progress

    ebc = EmbeddingBagCollection([TableConfig(name="t@0", num_embeddings=8, embedding_dim=4)], seed=0)
    deltas = ShardDeltas(ebc, RowWiseAdagrad(ebc, lr=0.1), directory=tmp_path / "d", plan=None, every=2)
    ckpt = SimpleNamespace(topo=SimpleNamespace(rank=0, lead=True), run_dir=tmp_path, components=[])
    rec = Recovery(ckpt, mode="partial", global_batch=64, deltas=deltas)
    assert rec.delta_due(4)
    rec.fall_back("keeping train.lost_fraction=0.02 costs partial recovery more")
    assert "falls back to full recovery (keeping train.lost_fraction" in capsys.readouterr().err
    assert not rec.delta_due(4) and rec.mode == "full"
    rec.step = 7
    rec.on_failure()
    progress = read_progress(tmp_path, 0)
    assert progress["step"] == 7 and progress["snapshot"] is False and progress["mode"] == "full"
    assert not (tmp_path / "recovery" / "rank-00000").exists()
