"""Failure injection (``train.inject_failure``), restarts (``dist.max_restarts``) and the
checkpoint interval from the failure rate (``train.checkpoint_every=auto``)."""

import json
import signal
import subprocess
import sys
from types import SimpleNamespace

import pytest

from hybridrec.cli.launch import _injected_pid, failure_line
from hybridrec.cli.main import main
from hybridrec.errors import ConfigError
from hybridrec.train.checkpointing import checkpoint as ckpt
from hybridrec.train.checkpointing import faults
from hybridrec.train.checkpointing.checkpoint_interval import PROBE_STEPS, young_daly_interval
from hybridrec.train.checkpointing.faults import (
    MARKER,
    FailureInjector,
    parse_inject_failure,
    read_marker,
)
from hybridrec.train.run import load_run_model
from hybridrec.train.setup.configure import build_config

SMALL = ["model.embedding_dim=8", "model.bottom_mlp=16,8", "model.top_mlp=16,1",
         "data.batch_size=64", "data.eval_batch_size=1000", "train.progress=false"]


@pytest.fixture(scope="module")
def dataset(shared_dataset):
    return shared_dataset(days=2, rows=2000)


def _args(dataset, run, *extra):
    return ["train", "--recipe", "demo", f"data.path={dataset}", f"train.run_dir={run}", *SMALL, *extra]


def _summary(run):
    return json.loads((run / "summary.json").read_text())


# -- the interval arithmetic ------------------------------------------------------------
@pytest.mark.parametrize("save_s, step_s, mtbf_s, total, steps, clamped", [
    (2.0, 0.1, 3600.0, 10_000, 1200, False),      # sqrt(2 * 2 * 3600) = 120 s = 1200 steps
    (0.5, 0.25, 86_400.0, 100_000, 1176, False),  # sqrt(86400) = 293.94 s = 1175.8 steps
    (2.0, 0.1, 3600.0, 500, 500, True),           # clamped to the run's steps
    (1e-4, 1.0, 1.0, 100, 1, True),               # sqrt(2e-4) s is under a step: clamped to 1
    (0.0, 0.1, 3600.0, 100, 1, True),             # a free save: every step
    (1.0, 0.0, 3600.0, 100, 100, True),           # no measurable step time: the whole run
])
def test_young_daly_interval(save_s, step_s, mtbf_s, total, steps, clamped):
    got = young_daly_interval(save_s=save_s, step_s=step_s, mtbf_s=mtbf_s, total_steps=total)
    assert got["steps"] == steps
    assert set(got) == {"mtbf_s", "save_s", "step_s", "steps", "reason"}
    assert (got["mtbf_s"], got["save_s"], got["step_s"]) == (mtbf_s, save_s, step_s)
    assert got["reason"].startswith("Young/Daly optimum sqrt(2 x save")
    assert ("clamped" in got["reason"]) == clamped, got["reason"]


def test_young_daly_interval_refuses_nonsense():
    with pytest.raises(ValueError):
        young_daly_interval(save_s=1.0, step_s=0.1, mtbf_s=0.0, total_steps=10)


# -- config --------------------------------------------------------------------------
@pytest.mark.parametrize("overrides, message", [
    (["train.inject_failure=3"], "train.inject_failure '3': expected RANK:STEP"),
    (["train.inject_failure=a:b"], "expected RANK:STEP"),
    (["train.inject_failure=0:0"], "STEP must be >= 1"),
    (["train.inject_failure=-1:5"], "RANK must be >= 0"),
    (["dist.nproc=2", "train.inject_failure=2:5"], "rank 2 does not exist: this run has 2 ranks (0..1)"),
    (["train.checkpoint_every=sometimes"], "train.checkpoint_every 'sometimes': a number of steps >= 0"),
    (["train.checkpoint_every=-3"], "train.checkpoint_every -3"),
    (["train.mtbf_hours=0"], "train.mtbf_hours must be positive"),
    (["train.checkpoint_every=auto", "train.save_checkpoints=false"], "saves nothing"),
    (["dist.max_restarts=-1"], "dist.max_restarts must be >= 0"),
    # schedules: the bad entry named
    (["train.inject_failure=1:5,x"], "train.inject_failure '1:5,x', entry 'x': expected RANK:STEP"),
    (["train.inject_failure=1:5,,0:9"], "entry '': expected RANK:STEP"),
    (["train.inject_failure=1:5,0:0"], "entry '0:0': STEP must be >= 1"),
    (["train.inject_failure=1:5,-1:9"], "entry '-1:9': RANK must be >= 0"),
    (["train.inject_failure=1:5,0:5"], ("steps must increase strictly (one failure at a time), but entry "
                                        "'0:5' (step 5) follows step 5")),
    (["train.inject_failure=1:9,0:3"], "entry '0:3' (step 3) follows step 9"),
    (["dist.nproc=2", "train.inject_failure=0:5,2:9"], "rank 2 does not exist: this run has 2 ranks"),
])
def test_config_errors(overrides, message):
    with pytest.raises(ConfigError) as e:
        build_config(overrides=overrides)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_config_values():
    cfg = build_config(overrides=["train.checkpoint_every=auto", "train.inject_failure=1:7", "dist.nproc=2"])
    assert cfg.train.checkpoint_every == "auto" and cfg.train.mtbf_hours == 24.0
    assert build_config(overrides=["train.checkpoint_every=12"]).train.checkpoint_every == 12
    assert build_config(overrides=["dist.max_restarts=2"]).dist.max_restarts == 2


def test_one_process_rank_out_of_range_is_one_line(dataset, tmp_path, capsys):
    assert main(_args(dataset, tmp_path / "run", "train.inject_failure=1:3")) == 2
    err = capsys.readouterr().err.strip()
    assert err == ("hybridrec: error: train.inject_failure=1:3: rank 1 does not exist: this run has "
                   "1 rank (0..0)"), err


def test_injector_is_armed_once_per_run_directory(tmp_path):
    assert FailureInjector("0:5", rank=0, run_dir=tmp_path).armed
    assert not FailureInjector("0:5", rank=1, run_dir=tmp_path).armed
    assert not FailureInjector("", rank=0, run_dir=tmp_path).armed
    (tmp_path / MARKER).write_text(json.dumps({"rank": 0, "step": 5, "pid": 1}))
    assert not FailureInjector("0:5", rank=0, run_dir=tmp_path).armed
    assert FailureInjector("0:6", rank=0, run_dir=tmp_path).armed  # another injection


def test_schedule_parses():
    assert parse_inject_failure("") == [] and parse_inject_failure("  ") == []
    assert parse_inject_failure("1:100") == [(1, 100)]
    assert parse_inject_failure(" 1:100, 0:250 ,1:400") == [(1, 100), (0, 250), (1, 400)]
    cfg = build_config(overrides=["dist.nproc=2", "train.inject_failure=1:7,0:9"])
    assert cfg.train.inject_failure == "1:7,0:9"


def test_schedule_arms_the_entries_not_done(tmp_path):
    spec = "1:5,0:8,1:12"
    assert FailureInjector(spec, rank=1, run_dir=tmp_path).steps == (5, 12)
    assert FailureInjector(spec, rank=0, run_dir=tmp_path).step == 8
    # The first entry done: rank 1 arms its second (the restarted run dies again, later) ...
    (tmp_path / MARKER).write_text(json.dumps({"rank": 1, "step": 5, "pid": 11, "spec": spec,
                                               "injected": [{"rank": 1, "step": 5, "pid": 11}]}))
    one = FailureInjector(spec, rank=1, run_dir=tmp_path)
    assert one.armed and one.steps == (12,) and one.step == 12
    assert FailureInjector(spec, rank=0, run_dir=tmp_path).steps == (8,)
    # ... every entry done: nothing armed.
    done = [{"rank": r, "step": s, "pid": 10 + i} for i, (r, s) in enumerate([(1, 5), (0, 8), (1, 12)])]
    (tmp_path / MARKER).write_text(json.dumps({**done[-1], "spec": spec, "injected": done}))
    assert not FailureInjector(spec, rank=1, run_dir=tmp_path).armed
    assert not FailureInjector(spec, rank=0, run_dir=tmp_path).armed
    assert _injected_pid(str(tmp_path / MARKER)) == 12


def test_schedule_marker_records_every_injection(tmp_path, monkeypatch):
    kills = []
    monkeypatch.setattr(faults.os, "kill", lambda pid, sig: kills.append((pid, sig)))
    spec = "1:2,0:4"
    FailureInjector(spec, rank=1, run_dir=tmp_path).after_step(2)
    marker = read_marker(tmp_path)
    assert (marker["rank"], marker["step"], marker["spec"]) == (1, 2, spec)
    assert [(d["rank"], d["step"]) for d in marker["injected"]] == [(1, 2)]
    rank0 = FailureInjector(spec, rank=0, run_dir=tmp_path)  # the restarted run
    assert rank0.steps == (4,) and not FailureInjector(spec, rank=1, run_dir=tmp_path).armed
    rank0.after_step(3)
    assert len(kills) == 1  # not its step
    rank0.after_step(4)
    marker = read_marker(tmp_path)
    assert (marker["rank"], marker["step"]) == (0, 4)  # the top level: the last kill, for the launcher
    assert [(d["rank"], d["step"]) for d in marker["injected"]] == [(1, 2), (0, 4)]
    assert all(d["pid"] > 0 and d["time"] > 0 for d in marker["injected"])
    assert kills == [(marker["pid"], signal.SIGKILL)] * 2
    assert _injected_pid(str(tmp_path / MARKER)) == marker["pid"]


def test_launcher_names_an_injected_kill():
    dead = SimpleNamespace(exitcode=-signal.SIGKILL, pid=4242, timestamp=1)
    line, status = failure_line({1: dead}, injected_pid=4242)
    assert (line, status) == ("rank 1 (pid 4242) was killed by SIGKILL (injected: train.inject_failure)", 1)
    assert "out-of-memory" in failure_line({1: dead}, injected_pid=99)[0]


# -- one process ----------------------------------------------------------------------
@pytest.mark.slow
def test_one_process_dies_at_the_step_and_the_same_command_completes(dataset, tmp_path, capsys):
    run = tmp_path / "run"
    argv = _args(dataset, run, "train.max_steps=12", "train.checkpoint_every=4", "train.inject_failure=0:6")
    proc = subprocess.run([sys.executable, "-m", "hybridrec", *argv], capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-3000:]
    assert "rank 0 kills itself (SIGKILL) after step 6" in proc.stderr
    assert [s for s, _ in ckpt.list_checkpoints(run)] == [4]  # the last one before the kill, complete
    assert load_run_model(run)[4]["step"] == 4  # ... and it loads
    marker = read_marker(run)
    assert (marker["rank"], marker["step"], marker["spec"]) == (0, 6, "0:6") and marker["pid"] > 0
    assert not (run / "summary.json").exists()

    assert main(argv) == 0  # the same command again: resumes, does not die again
    err = capsys.readouterr().err
    assert "resumed from step 4" in err and "kills itself" not in err
    summary = _summary(run)
    assert summary["step"] == 12 and summary["resumed_from"] == 4
    steps = [json.loads(x)["step"] for x in (run / "metrics.jsonl").read_text().splitlines()
             if json.loads(x)["split"] == "eval"]
    assert steps == [12]


def test_auto_checkpoint_interval(dataset, tmp_path, capsys):
    run = tmp_path / "run"
    # 2000 rows / 64 = 31 steps; an MTBF of 0.036 s makes the interval a few steps.
    assert main(_args(dataset, run, "train.checkpoint_every=auto", "train.mtbf_hours=1e-5",
                      "train.keep_checkpoints=100")) == 0
    err = capsys.readouterr().err
    choice = _summary(run)["checkpoint_interval"]
    total = _summary(run)["step"]
    assert total == 31
    n = choice["steps"]
    assert choice["mtbf_s"] == pytest.approx(0.036) and choice["save_s"] > 0 and choice["step_s"] > 0
    assert n == young_daly_interval(save_s=choice["save_s"], step_s=choice["step_s"], mtbf_s=0.036,
                                    total_steps=total)["steps"]
    assert f"checkpoint interval: every {n:,} steps (train.checkpoint_every=auto" in err
    # The measured first checkpoint, then every multiple of the interval after it but those
    # less than half an interval before the end, and the end.
    expected = sorted({PROBE_STEPS, *(s for s in range(n * (PROBE_STEPS // n + 1), total + 1, n)
                                      if total - s >= n / 2), total})
    assert [s for s, _ in ckpt.list_checkpoints(run)] == expected


# -- several ranks --------------------------------------------------------------------
def _launch(dataset, run, *extra):
    argv = [sys.executable, "-m", "hybridrec", *_args(dataset, run, "dist.nproc=2", "dist.timeout_s=30",
                                                        "train.max_steps=10", "train.checkpoint_every=4",
                                                        "train.inject_failure=1:6", *extra)]
    return subprocess.run(argv, capture_output=True, text=True, timeout=240, check=False)


@pytest.mark.distributed
def test_two_ranks_a_killed_rank_ends_the_run_and_the_same_command_completes(dataset, tmp_path):
    run = tmp_path / "run"
    proc = _launch(dataset, run)
    assert proc.returncode == 1, proc.stderr[-3000:]
    pid = read_marker(run)["pid"]
    assert proc.stderr.splitlines()[-1] == (f"hybridrec: error: rank 1 (pid {pid}) was killed by SIGKILL "
                                            "(injected: train.inject_failure)"), proc.stderr[-3000:]
    assert [s for s, _ in ckpt.list_checkpoints(run)] == [4]
    proc = _launch(dataset, run)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "kills itself" not in proc.stderr and "resumed from step 4" in proc.stderr
    summary = _summary(run)
    assert summary["step"] == 10 and summary["resumed_from"] == 4 and summary["world_size"] == 2


@pytest.mark.distributed
def test_max_restarts_carry_one_command_across_the_failure(dataset, tmp_path):
    run = tmp_path / "run"
    proc = _launch(dataset, run, "dist.max_restarts=1")
    assert proc.returncode == 0, proc.stderr[-3000:]
    err = proc.stderr
    assert "rank 1 kills itself (SIGKILL) after step 6" in err
    assert "restarted the ranks after a failure (1 of dist.max_restarts=1)" in err
    assert "resumed from step 4" in err
    summary = _summary(run)
    assert summary["step"] == 10 and summary["resumed_from"] == 4 and summary["world_size"] == 2
