"""benchmarks/failure_schedule.py's reading of a run: a partial run whose checkpoint interval
fell back to full recovery lost no updates (its failures' shards were trained again), and the
report says how each failure was recovered and that the run fell back."""

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def fs():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    spec = importlib.util.spec_from_file_location("failure_schedule", ROOT / "benchmarks/failure_schedule.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _failure(mode, failed_at, checkpoint, resumed_at, lost_rank):
    """A failure's record as failures_of builds it: two ranks' shards of one table (equal
    halves); partial: only the failed rank's shard lost steps; full: every shard trains again."""
    lost = failed_at - checkpoint
    shards = [{"table": 0, "rank": r, "row_start": 50 * r, "col_start": 0, "rows": 50, "cols": 8,
               "steps_lost": lost if (mode == "full" or r == lost_rank) else 0}
              for r in range(2)]
    return {"failed_rank": lost_rank, "failed_at_step": failed_at, "checkpoint_step": checkpoint,
            "resumed_at_step": resumed_at, "shards": shards, "mode": mode}


def test_full_recoveries_lose_nothing(fs):
    partial = [_failure("partial", 40, 20, 40, 1)]  # half the rows lost 20 steps of 100
    assert fs.lost_fraction(partial, 100) == pytest.approx(0.1)
    # The same failure recovered fully (the run fell back): trained again, nothing lost.
    assert fs.lost_fraction([_failure("full", 40, 20, 20, 1)], 100) == 0.0
    mixed = partial + [_failure("full", 90, 60, 60, 0)]
    assert fs.lost_fraction(mixed, 100) == pytest.approx(0.1)
    # (a record without a mode, as before it was recorded: counted as partial)
    old = [{**_failure("partial", 40, 20, 40, 1), "mode": None}]
    assert fs.lost_fraction(old, 100) == pytest.approx(0.1)


def test_fallback_recorded_and_said(fs):
    reason = "keeping train.lost_fraction=0.01 costs partial recovery 0.3 ... full recovery instead"
    summary = {"checkpoint_interval": {"steps": 70, "fallback": "full", "fallback_reason": reason},
               "recovery": {"mode": "full", "events": []}}
    said = "hybridrec: train.recovery=partial falls back to full recovery (" + reason + ")"
    stderr = [(1.0, "checkpoint interval: every 70 steps ..."), (1.1, said), (5.0, said)]
    failures = [_failure("full", 40, 20, 20, 1), _failure("full", 90, 60, 60, 0)]
    got = fs.fallback_of(summary, stderr, failures)
    assert got == {"fallback": "full", "fallback_reason": reason, "fallback_said": said,
                   "recovery_mode": "full", "recovered_as": ["full", "full"]}
    assert fs.recovered_as(got) == "full x2 (fell back)"
    kept = fs.fallback_of({"checkpoint_interval": {"steps": 83, "fallback": None},
                           "recovery": {"mode": "partial"}}, [(1.0, "checkpoint interval: ...")],
                          [_failure("partial", 40, 20, 40, 1)] * 3)
    assert kept["fallback"] is None and kept["fallback_said"] is None
    assert fs.recovered_as(kept) == "partial x3"
    assert fs.recovered_as({"recovered_as": []}) == "-"


def test_report_names_the_fallback(fs):
    run = {"name": "partial", "failures": 2, "wall_seconds": 50.0, "overhead_seconds": 5.0, "overhead_share": 0.1,
           "save_seconds": 3.0, "saves": 9, "delta_seconds": 0.0, "deltas": 0, "lost_steps": 80,
           "lost_seconds": 4.0, "restart_seconds": 2.0, "other_seconds": -4.0, "cpr_overhead_share": 0.18,
           "lost_fraction": 0.0, "auc": 0.75, "auc_vs_reference": -0.001, "saves_source": "metrics.jsonl",
           "failures_source": "summary.json recovery.events", "fallback": "full",
           "fallback_reason": "keeping it costs more", "fallback_said": "hybridrec: ... falls back to full recovery (x)",
           "recovered_as": ["full", "full"]}
    rep = {"machine": "m", "date": "d", "settings": {"nproc": 2, "steps": 100, "batch_size": 8, "recipe": "bench",
                                                     "mtbf_s": 30.0, "seeds": [9]},
           "seeds": [{"seed": 9, "inject_failure": "1:40,0:90",
                      "reference": {"wall_seconds": 45.0, "train_seconds": 40.0, "step_seconds": 0.05, "auc": 0.751},
                      "runs": [run]}]}
    text = fs.format_report(rep)
    row = next(line for line in text.splitlines() if line.startswith("| partial |"))
    header = next(line for line in text.splitlines() if line.startswith("| run | seed |"))
    assert row.count("|") == header.count("|")
    assert "| full x2 (fell back) | 0.0000 |" in row
    assert "partial (seed 9) fell back to full recovery: keeping it costs more; the run said: hybridrec:" in text


def test_lost_fraction_flag(fs):
    assert fs.parse_args(["--lost-fraction", "0.05"]).lost_fraction == 0.05
    assert fs.parse_args([]).lost_fraction == 0.0
    with pytest.raises(SystemExit):
        fs.parse_args(["--lost-fraction", "1.5"])
