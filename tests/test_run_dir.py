"""A run directory a user can trust, through the CLI: it belongs to one run (another
config is refused, a finished run is left alone), default directories are new, progress
and resume messages, metrics without duplicates, portable config.json, the memory check
before anything is allocated, and a complete summary.json."""

import datetime
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from distributed import free_port

import hybridrec
from hybridrec.cli.main import main
from hybridrec.train.run_lock import LOCK_NAME

SMALL = ["model.embedding_dim=8", "model.bottom_mlp=16,8", "model.top_mlp=16,1",
         "data.batch_size=64", "data.eval_batch_size=1000", "train.progress=false"]
STEPS_PER_EPOCH = 1000 // 64  # 1000 training rows, drop_last


@pytest.fixture(scope="module")
def dataset(shared_dataset):
    return shared_dataset(days=2, rows=1000)


def _args(dataset, *extra):
    return ["train", "--recipe", "demo", f"data.path={dataset}", *SMALL, *extra]


def _snapshot(run: Path) -> dict:
    """Every file under ``run``: bytes and modification time (but the run lock's, which
    names whichever training held the directory last, a refused one too)."""
    return {str(p.relative_to(run)): (p.read_bytes(), p.stat().st_mtime_ns)
            for p in sorted(run.rglob("*")) if p.is_file() and p.name != LOCK_NAME}


def _records(run: Path) -> list[tuple[int, str]]:
    return [(r["step"], r["split"]) for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())]


def _dataset_with_tables(dataset: Path, out: Path, rows) -> Path:
    """``dataset`` with every table's num_embeddings changed by ``rows(name, n)`` in its
    meta.json (the shards are the same, linked)."""
    out.mkdir()
    for p in dataset.iterdir():
        if p.name != "meta.json":
            (out / p.name).symlink_to(p)
    meta = json.loads((dataset / "meta.json").read_text())
    for f in meta["schema"]["features"]:
        f["num_embeddings"] = rows(f["name"], f["num_embeddings"])
    (out / "meta.json").write_text(json.dumps(meta))
    return out


@pytest.fixture(scope="module")
def finished_run(dataset, tmp_path_factory):
    """A finished 10-step run; tests that share it must leave it as it is."""
    run = tmp_path_factory.mktemp("finished") / "run"
    assert main(_args(dataset, f"train.run_dir={run}", "train.max_steps=10", "train.log_every=5")) == 0
    return run


@pytest.mark.parametrize("change, difference", [
    (["model.embedding_dim=4", "model.bottom_mlp=16,4"], "model.embedding_dim: 8 -> 4; model.bottom_mlp: 16,8 -> 16,4"),
    (["data.batch_size=32"], "global batch (data.batch_size x ranks): 64 (64 x 1) -> 32 (32 x 1)"),
    (["optim.sparse=sgd"], "optim.sparse: rowwise_adagrad -> sgd"),
    ("tables", "table C1 rows: 64 -> 65"),
])
def test_another_config_is_refused_and_the_run_is_left_as_it_was(
        dataset, finished_run, tmp_path, capsys, change, difference):
    if change == "tables":
        data = _dataset_with_tables(dataset, tmp_path / "data", lambda name, n: n + (name == "C1"))
        change = [f"data.path={data}"]
    capsys.readouterr()
    before = _snapshot(finished_run)
    assert main([*_args(dataset, f"train.run_dir={finished_run}", "train.max_steps=10",
                        "train.log_every=5"), *change]) == 2
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("hybridrec: error: "), err
    assert difference in lines[0] and "train.run_dir=" in lines[0] and "train.resume=false" in lines[0], lines[0]
    assert _snapshot(finished_run) == before
    # The refused attempt broke nothing: the run evaluates as before.
    assert main(["eval", str(finished_run)]) == 0
    summary = json.loads((finished_run / "summary.json").read_text())
    assert json.loads((finished_run / "eval.json").read_text())["auc"] == pytest.approx(summary["eval"]["auc"])
    (finished_run / "eval.json").unlink()


def test_a_finished_run_named_again_is_left_alone(dataset, finished_run, tmp_path, capsys):
    args = _args(dataset, f"train.run_dir={finished_run}", "train.max_steps=10", "train.log_every=5")
    before = _snapshot(finished_run)
    capsys.readouterr()
    assert main(args) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 1 and "is finished (step 10 of 10" in out[0] and "train.reevaluate=true" in out[0], out
    assert _snapshot(finished_run) == before
    # Asked to, it evaluates again: the new evaluation replaces the old one in metrics.jsonl.
    again = tmp_path / "again"
    shutil.copytree(finished_run, again)
    records = _records(again)
    assert main(_args(dataset, f"train.run_dir={again}", "train.max_steps=10", "train.log_every=5",
                      "train.reevaluate=true")) == 0
    assert "AUC" in capsys.readouterr().out
    assert _records(again) == records
    old_eval, new_eval = ([r for r in map(json.loads, (d / "metrics.jsonl").read_text().splitlines())
                           if r["split"] == "eval"] for d in (finished_run, again))
    assert new_eval[-1]["time"] > old_eval[-1]["time"]  # written again, in the old one's place
    old, new = (json.loads((d / "summary.json").read_text()) for d in (finished_run, again))
    assert new["eval"]["auc"] == pytest.approx(old["eval"]["auc"]) and new["step"] == 10
    assert new["train_loss"] == pytest.approx(old["train_loss"])
    assert new["ended_at"] >= old["ended_at"]


@pytest.mark.slow
def test_default_run_dirs_are_new_and_config_paths_absolute(dataset, tmp_path, monkeypatch, capsys):
    work, elsewhere = tmp_path / "work", tmp_path / "elsewhere"
    work.mkdir(), elsewhere.mkdir()
    monkeypatch.chdir(work)
    rel = os.path.relpath(dataset, work)
    for _ in range(2):
        assert main(_args(rel, "train.max_steps=2")) == 0
    runs = sorted((work / "runs").iterdir())
    assert len(runs) == 2 and all(re.fullmatch(r"\d{8}-\d{6}(-\d+)?", r.name) for r in runs), runs
    assert all((r / "summary.json").is_file() for r in runs)
    assert f"run directory runs/{runs[0].name}" in capsys.readouterr().err
    config = json.loads((runs[0] / "config.json").read_text())
    assert config["data"]["path"] == str(dataset) and config["train"]["run_dir"] == str(runs[0])
    # config.json names its dataset absolutely: the run evaluates from any directory.
    monkeypatch.chdir(elsewhere)
    assert main(["eval", str(runs[0])]) == 0
    assert json.loads((runs[0] / "eval.json").read_text())["count"] == 1000


@pytest.mark.slow
def test_progress_lines_summary_fields_and_file_modes(dataset, tmp_path):
    run = tmp_path / "run"
    argv = [sys.executable, "-m", "hybridrec", *_args(dataset, f"train.run_dir={run}"),
            "train.progress=true", "train.log_interval_s=0.0001"]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=120, check=False,
                          preexec_fn=lambda: os.umask(0o027))
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = re.findall(r"^step (\d+)/15 \(\d+%\)  [\d,]+ samples/s  loss \d+\.\d{4}  ETA \d+:\d\d:\d\d$",
                       proc.stderr, re.MULTILINE)
    assert len(lines) >= 2 and lines[-1] == "15", proc.stderr[-3000:]
    s = json.loads((run / "summary.json").read_text())
    start, end = (datetime.datetime.fromisoformat(s[k]) for k in ("started_at", "ended_at"))
    assert start.tzinfo is not None and start <= end
    assert 0 < s["wall_seconds"] < 120
    assert s["command"][1:] == argv[3:]
    assert s["versions"]["hybridrec"] == hybridrec.__version__
    head = subprocess.run(["git", "-C", str(Path(hybridrec.__file__).parent), "rev-parse", "HEAD"],
                          capture_output=True, text=True, check=False)
    if head.returncode == 0:  # a git checkout: the commit the run's code came from
        assert re.fullmatch(r"[0-9a-f]{40}", s["versions"]["git_commit"])
        assert isinstance(s["versions"]["git_dirty"], bool)
    assert s["run"]["steps"] == 15 and s["run"]["samples"] == 15 * 64 and s["run"]["invocations"] == 1
    assert s["run"]["samples_per_sec"] > 0 and s["run"]["started_at"] == s["started_at"]
    # Every file the run writes itself has open()'s mode under the umask (0640 here).
    modes = {name: oct((run / name).stat().st_mode & 0o777)
             for name in ("config.json", "metrics.jsonl", "summary.json")}
    assert set(modes.values()) == {"0o640"}, modes


def test_resume_says_so_and_metrics_keep_every_step_once(dataset, tmp_path, capsys):
    run = tmp_path / "run"
    args = _args(dataset, f"train.run_dir={run}", "train.checkpoint_every=5", "train.keep_checkpoints=5",
                 "train.log_every=2", "train.eval_every=5")
    assert main(args) == 0
    uninterrupted = _records(run)
    assert len(set(uninterrupted)) == len(uninterrupted) and (15, "eval") in uninterrupted
    # As if the process died after its checkpoint at step 10: the records of steps 11-15
    # are in metrics.jsonl, the checkpoint of step 15 and summary.json are not.
    shutil.rmtree(run / "checkpoints" / "step-00000015")
    (run / "summary.json").unlink()
    capsys.readouterr()
    assert main(args) == 0
    err = capsys.readouterr().err
    assert err.count("resumed from step") == 1
    assert f"resumed from step 10 ({run / 'checkpoints' / 'step-00000010'})" in err, err
    assert _records(run) == uninterrupted
    s = json.loads((run / "summary.json").read_text())
    assert s["resumed_from"] == 10 and s["step"] == 15
    # Throughput over the whole run: the steps in the final checkpoint, each counted once.
    assert s["run"]["steps"] == 15 and s["run"]["samples"] == 15 * 64 and s["run"]["invocations"] == 2


def test_a_plan_that_cannot_fit_is_refused_before_anything_is_allocated(dataset, tmp_path, capsys):
    run = tmp_path / "run"
    huge = _dataset_with_tables(dataset, tmp_path / "huge", lambda name, n: 2**31 - 1)
    # 26 tables of 2^31 - 1 rows x 8 floats, and row-wise Adagrad's accumulator per row.
    tables = f"embedding tables with their rowwise_adagrad state {26 * (2**31 - 1) * 36 / 1e9:,.1f} GB"
    for data, extra, expected in (
            (huge, [], tables),
            (huge, [], "(train.memory_limit_gb=0: the machine's)"),
            (dataset, ["train.memory_limit_gb=0.0001"], "train.memory_limit_gb=0.0001 is 100.0 kB"),
            (dataset, ["train.memory_limit_gb=0.0001", "dist.nproc=2"], "the 2 ranks on this machine need")):
        capsys.readouterr()
        assert main(_args(data, f"train.run_dir={run}", *extra)) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("hybridrec: error: not enough memory"), err
        assert expected in err[0], err[0]
        assert "dist.nproc=N" in err[0] and "dist.sharding=row_wise" in err[0] and "--table-size" in err[0]
        assert not run.exists()


@pytest.mark.distributed
def test_two_ranks_agree_on_a_new_run_dir_and_both_refuse_another_config(dataset, tmp_path, capfd):
    cli = [sys.executable, "-m", "hybridrec"]
    proc = subprocess.run([*cli, *_args(dataset, "dist.nproc=2", "train.max_steps=3")], cwd=tmp_path,
                          capture_output=True, text=True, timeout=240, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (run,) = (tmp_path / "runs").iterdir()  # one directory, every rank's
    assert {"plan.json", "config.json", "summary.json", "metrics.jsonl"} <= {p.name for p in run.iterdir()}
    assert json.loads((run / "summary.json").read_text())["world_size"] == 2
    before = _snapshot(run)
    # Two ranks started as a launcher would, but with no agent to stop one when the other
    # fails: each must refuse on its own (exit 2), none may wait for the other.
    port = str(free_port())
    ranks = [subprocess.Popen([*cli, *_args(dataset, f"train.run_dir={run}", "data.batch_size=32",
                                            "dist.timeout_s=30")],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env={**os.environ, "RANK": str(r), "LOCAL_RANK": str(r), "WORLD_SIZE": "2",
                                   "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
                                   "MASTER_PORT": port})
             for r in range(2)]
    try:
        outcomes = [(p.communicate(timeout=90)[1], p.returncode)[::-1] for p in ranks]
    finally:
        for p in ranks:
            p.kill()
    assert [rc for rc, _ in outcomes] == [2, 2], outcomes
    message = "global batch (data.batch_size x ranks): 128 (64 x 2) -> 64 (32 x 2)"
    assert message in outcomes[0][1], outcomes
    # Through the launcher (this process's): one line, and no rank is started.
    capfd.readouterr()
    status = main(_args(dataset, f"train.run_dir={run}", "dist.nproc=2", "data.batch_size=32"))
    err = capfd.readouterr().err
    assert status == 2 and err.count("\n") == 1, err
    assert "global batch" in err and "launching" not in err
    assert _snapshot(run) == before


def test_starting_over_removes_what_the_old_run_wrote(tmp_path):
    from hybridrec.errors import ConfigError
    from hybridrec.train.build import start_over

    run = tmp_path / "run"
    names = ["config.json", "summary.json", "eval.json", "plan.json", "metrics.jsonl", "failure_injected.json",
             "recovery.jsonl", "checkpoint_interval.json", "init_from.json", ".summary.json.k2j3.tmp", LOCK_NAME]
    for d in ("checkpoints/step-00000004", "checkpoints/step-00000005.tmp-123", "recovery/deltas/rank-00000",
              "tensorboard", "report"):
        (run / d).mkdir(parents=True)
    for n in [*names, "checkpoints/step-00000004/__0_0.distcp", "report/index.html", "report/loss.svg"]:
        (run / n).write_text("{}")
    # Something no run wrote: refused, and nothing is deleted.
    (run / "checkpoints" / "x").mkdir()
    (run / "notes.txt").write_text("mine")
    with pytest.raises(ConfigError, match=r"run holds what no hybridrec run wrote \(checkpoints/x/, notes.txt\)"):
        start_over(run)
    assert (run / "summary.json").is_file() and (run / "checkpoints" / "step-00000004").is_dir()
    (run / "checkpoints" / "x").rmdir()
    (run / "notes.txt").unlink()
    start_over(run)
    assert sorted(p.name for p in run.iterdir()) == [LOCK_NAME]
