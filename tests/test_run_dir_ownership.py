"""A run directory is hybridrec's alone, through the CLI: the root, the home directory and
someone else's files are refused before anything is written; train.resume=false deletes
only the run's own files; nothing is written through a symbolic link; the leftovers of
killed saves go at the next start; SIGTERM says where the run stands and leaves no
unfinished save behind."""

import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hybridrec.cli.main import main
from hybridrec.train import run_files
from hybridrec.train.run_lock import LOCK_NAME

SMALL = ["model.embedding_dim=8", "model.bottom_mlp=16,8", "model.top_mlp=16,1",
         "data.batch_size=64", "data.eval_batch_size=1000", "train.progress=false"]
CLI = [sys.executable, "-m", "hybridrec"]


@pytest.fixture(scope="module")
def dataset(shared_dataset):
    return shared_dataset(days=2, rows=1000)


def _args(dataset, run, *extra):
    return ["train", "--recipe", "demo", f"data.path={dataset}", *SMALL, f"train.run_dir={run}", *extra]


def _hashes(root: Path) -> dict:
    """Every entry under ``root``: a file's SHA-256, a link's target, a directory's name."""
    out = {}
    for p in sorted(root.rglob("*")):
        rel = str(p.relative_to(root))
        if p.is_symlink():
            out[rel] = ("link", os.readlink(p))
        elif p.is_file():
            out[rel] = ("file", hashlib.sha256(p.read_bytes()).hexdigest())
        else:
            out[rel] = ("dir",)
    return out


def _one_error(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("hybridrec: error: "), err
    return err[0]


def _someone_elses(d: Path) -> Path:
    """A directory of files no hybridrec run wrote, under names a run writes."""
    for sub in ("report", "checkpoints/x"):
        (d / sub).mkdir(parents=True)
    (d / "metrics.jsonl").write_text('{"mine": 1}\n')
    (d / "summary.json").write_text('{"mine": 2}\n')
    (d / "report" / "index.html").write_text("<p>mine</p>\n")
    (d / "checkpoints" / "x" / "y.ckpt").write_bytes(os.urandom(64))
    (d / "config.json").write_text('{"name": "my experiment"}\n')
    return d


@pytest.fixture(scope="module")
def run5(dataset, tmp_path_factory):
    """A finished 5-step run with checkpoints at steps 2 and 4 (tests copy it)."""
    run = tmp_path_factory.mktemp("run5") / "run"
    assert main(_args(dataset, run, "train.max_steps=5", "train.checkpoint_every=2", "train.keep_checkpoints=5")) == 0
    return run


def _copy(run: Path, to: Path) -> Path:
    shutil.copytree(run, to, symlinks=True)
    return to


# -- whose directory ---------------------------------------------------------------------------
def test_the_root_directory_is_refused(dataset, capsys):
    before = {n: os.path.lexists(os.path.join(os.sep, n)) for n in (LOCK_NAME, "config.json")}
    assert main(_args(dataset, "/")) == 2
    line = _one_error(capsys)
    assert "train.run_dir=/ is the root directory" in line and "train.run_dir=DIR" in line, line
    assert {n: os.path.lexists(os.path.join(os.sep, n)) for n in before} == before


@pytest.mark.parametrize("home_holds", [[], ["notes.txt"]])
def test_the_home_directory_is_refused_without_writing_anything(dataset, tmp_path, monkeypatch, capsys, home_holds):
    home = tmp_path / "home"
    home.mkdir()
    for name in home_holds:
        (home / name).write_text("mine\n")
    before = _hashes(home)
    monkeypatch.setenv("HOME", str(home))
    for named in (str(home), f"{home}/."):
        assert main(_args(dataset, named)) == 2
        line = _one_error(capsys)
        assert f"train.run_dir={named} is the home directory" in line, line
    assert _hashes(home) == before  # (no .lock, no marker: an empty home stays empty)


@pytest.mark.slow
@pytest.mark.parametrize("extra", [[], ["train.resume=false"]])
def test_someone_elses_directory_is_left_byte_identical(dataset, tmp_path, capsys, extra):
    theirs = _someone_elses(tmp_path / "theirs")
    before = _hashes(theirs)
    assert main(_args(dataset, theirs, "train.max_steps=3", *extra)) == 2
    line = _one_error(capsys)
    assert f"{theirs} is not empty and is not a hybridrec run (it holds checkpoints, config.json, " in line, line
    assert "train.run_dir=DIR" in line
    assert _hashes(theirs) == before
    # The launcher refuses it the same way, before any rank starts.
    proc = subprocess.run([*CLI, *_args(dataset, theirs, "train.max_steps=3", "dist.nproc=2", *extra)],
                          capture_output=True, text=True, timeout=180, check=False)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr[-2000:]
    assert "is not a hybridrec run" in proc.stderr and "launching" not in proc.stderr
    assert _hashes(theirs) == before


def test_a_new_or_empty_directory_becomes_a_run_and_older_runs_still_resume(dataset, run5, tmp_path, capsys):
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / LOCK_NAME).write_text("")  # (a lock file alone: empty still)
    assert main(_args(dataset, empty, "train.max_steps=2")) == 0
    assert json.loads((empty / LOCK_NAME).read_text())["hybridrec"] and run_files.is_run(empty)
    resume = ["train.max_steps=5", "train.checkpoint_every=2", "train.keep_checkpoints=5"]
    # A run is recognised by its config.json alone (a run from before the lock file), and,
    # before config.json is written, by its lock file alone (here as runs before the
    # "hybridrec" key wrote it): both resume.
    for name, old_lock in (("config-only", None), ("lock-only", {"pid": 1, "host": "h", "since": "2025"})):
        old = _copy(run5, tmp_path / name)
        (old / "summary.json").unlink()
        shutil.rmtree(old / "checkpoints" / "step-00000005")
        if old_lock is None:
            (old / LOCK_NAME).unlink()
        else:
            (old / "config.json").unlink()
            (old / LOCK_NAME).write_text(json.dumps(old_lock))
        assert run_files.is_run(old)
        capsys.readouterr()
        assert main(_args(dataset, old, *resume)) == 0
        assert "resumed from step 4" in capsys.readouterr().err


# -- what starting over deletes -------------------------------------------------------------------
@pytest.mark.parametrize("foreign", ["notes.txt", "checkpoints/x/y.ckpt", "report/my.pdf"])
def test_starting_over_refuses_what_the_run_did_not_write_and_deletes_nothing(
        dataset, run5, tmp_path, capsys, foreign):
    run = _copy(run5, tmp_path / "run")
    (run / foreign).parent.mkdir(parents=True, exist_ok=True)
    (run / foreign).write_bytes(os.urandom(32))
    before = _hashes(run)
    capsys.readouterr()
    assert main(_args(dataset, run, "train.max_steps=5", "train.resume=false")) == 2
    line = _one_error(capsys)
    shown = foreign if "/" not in foreign or foreign.startswith("report") else "checkpoints/x/"
    assert f"{run} holds what no hybridrec run wrote ({shown})" in line, line
    assert "train.resume=false deletes only the run's own files" in line
    after = _hashes(run)  # (the lock file names the refused training: it held the directory)
    assert after.keys() == before.keys() and {k: v for k, v in after.items() if k != LOCK_NAME} == \
        {k: v for k, v in before.items() if k != LOCK_NAME}
    # Without it, train.resume=false replaces the run: its own files go, and are written anew.
    (run / foreign).unlink()
    if foreign.startswith("checkpoints"):
        (run / foreign).parent.rmdir()
    assert main(_args(dataset, run, "train.max_steps=3", "train.resume=false")) == 0
    assert json.loads((run / "summary.json").read_text())["step"] == 3
    steps = {p.name for p in (run / "checkpoints").iterdir()}
    assert "step-00000003" in steps and not steps & {"step-00000004", "step-00000005"}, steps


# -- no writes through links ---------------------------------------------------------------------
def test_a_lock_that_is_a_symbolic_link_is_refused_and_its_target_unchanged(dataset, run5, tmp_path, capsys):
    target = tmp_path / "precious"
    target.write_text("do not truncate me\n")
    for where in (_copy(run5, tmp_path / "run"), tmp_path / "new"):
        where.mkdir(exist_ok=True)
        (where / LOCK_NAME).unlink(missing_ok=True)
        (where / LOCK_NAME).symlink_to(target)
        before = _hashes(where)
        assert main(_args(dataset, where, "train.max_steps=5")) == 2
        line = _one_error(capsys)
        assert f"{where}/.lock is a symbolic link (to {target})" in line and "remove the link" in line, line
        assert target.read_text() == "do not truncate me\n" and _hashes(where) == before


@pytest.mark.parametrize("extra", [[], ["train.resume=false"]])
def test_checkpoints_that_are_a_symbolic_link_are_refused(dataset, run5, tmp_path, capsys, extra):
    run = _copy(run5, tmp_path / "run")
    elsewhere = tmp_path / "elsewhere"
    (run / "checkpoints").rename(elsewhere)
    (run / "checkpoints").symlink_to(elsewhere)
    before, theirs = _hashes(run), _hashes(elsewhere)
    assert main(_args(dataset, run, "train.max_steps=8", *extra)) == 2
    line = _one_error(capsys)
    assert f"{run}/checkpoints is a symbolic link (to {elsewhere})" in line, line
    assert _hashes(elsewhere) == theirs and set(_hashes(run)) == set(before)


def test_the_metrics_file_and_the_report_are_not_written_through_links(dataset, run5, tmp_path, capsys):
    run = _copy(run5, tmp_path / "run")
    (run / "summary.json").unlink()  # (a run to resume: it would append to metrics.jsonl)
    target = tmp_path / "theirs.jsonl"
    target.write_text("theirs\n")
    (run / "metrics.jsonl").rename(tmp_path / "metrics.jsonl")
    (run / "metrics.jsonl").symlink_to(target)
    assert main(_args(dataset, run, "train.max_steps=8")) == 2
    assert f"{run}/metrics.jsonl is a symbolic link (to {target})" in _one_error(capsys)
    assert target.read_text() == "theirs\n"
    # `hybridrec report RUN` does not write through RUN/report either.
    (run / "metrics.jsonl").unlink()
    (tmp_path / "metrics.jsonl").rename(run / "metrics.jsonl")
    elsewhere = tmp_path / "elsewhere"
    shutil.rmtree(run / "report")
    elsewhere.mkdir()
    (run / "report").symlink_to(elsewhere)
    assert main(["report", str(run)]) == 2
    assert "report is a symbolic link: the report is not written through it" in _one_error(capsys)
    assert list(elsewhere.iterdir()) == []


# -- killed saves and SIGTERM ---------------------------------------------------------------------
def _dead_pid() -> int:
    proc = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True, check=True)
    return int(proc.stdout)


def test_the_leftovers_of_killed_saves_are_removed_at_the_next_start(dataset, run5, tmp_path, capsys):
    run = _copy(run5, tmp_path / "run")
    (run / "summary.json").unlink()
    dead, alive = _dead_pid(), os.getpid()
    leftovers = [f"checkpoints/step-00000005.tmp-{dead}", f"recovery/.tmp-rank-00000-{dead}",
                 f"recovery/deltas/rank-00000/.tmp-step-00000003-{dead}"]
    for d in [*leftovers, f"checkpoints/step-00000006.tmp-{alive}"]:
        (run / d).mkdir(parents=True)
        (run / d / "__0_0.distcp").write_bytes(b"half")
    assert main(_args(dataset, run, "train.max_steps=5", "train.checkpoint_every=2", "train.keep_checkpoints=5")) == 0
    assert not [d for d in leftovers if os.path.lexists(run / d)]
    # A live process's (it might still be writing it) is left; so is everything else.
    assert (run / f"checkpoints/step-00000006.tmp-{alive}" / "__0_0.distcp").read_bytes() == b"half"
    assert {"step-00000002", "step-00000004"} <= {p.name for p in (run / "checkpoints").iterdir()}


def _saving(args: list[str], run: Path, **kw) -> subprocess.Popen:
    """The CLI training ``run``, once a checkpoint is published and the next one is being
    written (its ``.tmp-`` directory seen: the signal the test sends next most likely
    reaches the process mid-save; if the save ended first, the test is only weaker)."""
    proc = subprocess.Popen([*CLI, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kw)
    deadline = time.monotonic() + 300
    while not (list((run / "checkpoints").glob("step-????????")) and list((run / "checkpoints").glob("*.tmp-*"))):
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            _, err = proc.communicate()
            pytest.fail(f"no checkpoint (status {proc.returncode}): {err[-3000:]}")
        time.sleep(0.002)
    return proc


def _unfinished(run: Path) -> list[str]:
    return [str(p.relative_to(run)) for p in run.rglob("*") if ".tmp-" in p.name]


@pytest.mark.slow
def test_sigterm_says_where_the_run_stands_and_leaves_no_unfinished_save(dataset, tmp_path):
    run = tmp_path / "run"
    args = _args(dataset, run, "train.epochs=1000", "train.checkpoint_every=1", "train.eval_every=0")
    proc = _saving(args, run)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGTERM, err[-3000:]
    lines = [ln for ln in err.splitlines() if "terminated" in ln]
    assert len(lines) == 1, err[-3000:]
    m = re.fullmatch(r"hybridrec: terminated at step ([\d,]+); the newest checkpoint is (.+/step-(\d{8})) "
                     r"\(step ([\d,]+)\); run the same command to resume", lines[0])
    assert m and int(m.group(3)) == int(m.group(4).replace(",", "")), lines[0]
    assert Path(m.group(2)) == run / "checkpoints" / f"step-{m.group(3)}" and Path(m.group(2)).is_dir()
    assert _unfinished(run) == []
    # The same command resumes from that checkpoint (here to a few steps more).
    newest = int(m.group(3))
    again = subprocess.run([*CLI, *args, f"train.max_steps={newest + 2}"], capture_output=True, text=True,
                           timeout=300, check=False)
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"resumed from step {newest} " in again.stderr, again.stderr[-3000:]


@pytest.mark.distributed
@pytest.mark.parametrize("to", ["launcher", "group"])
def test_sigterm_to_the_launcher_is_said_once_and_leaves_no_unfinished_save(dataset, tmp_path, to):
    run = tmp_path / "run"
    args = _args(dataset, run, "dist.nproc=2", "train.epochs=1000", "train.checkpoint_every=1", "train.eval_every=0")
    proc = _saving(args, run, start_new_session=True)
    if to == "group":  # the launcher, its fork server and its ranks, as a scheduler's stop
        os.killpg(proc.pid, signal.SIGTERM)
    else:  # the launcher alone (its agent stops the ranks)
        proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=180)
    assert proc.returncode == 128 + signal.SIGTERM, err[-3000:]
    lines = [ln for ln in err.splitlines() if "terminated" in ln or "error" in ln]
    assert len(lines) == 1, err[-3000:]
    assert re.fullmatch(r"hybridrec: terminated; the newest checkpoint is .+/step-\d{8} \(step [\d,]+\); "
                        r"run the same command to resume", lines[0]), lines[0]
    assert _unfinished(run) == []


def test_the_names_a_run_writes_are_their_owners():
    """run_files names what other modules write; they must agree."""
    from hybridrec.bench.report import REPORT_DIR
    from hybridrec.train.checkpointing.checkpoint import checkpoint_dir
    from hybridrec.train.checkpointing.lost_work import EVENTS
    from hybridrec.train.checkpointing.snapshots import RECOVERY_DIR
    from hybridrec.train.init_from import RECORD

    assert {EVENTS, RECORD} <= set(run_files.FILES)
    assert (REPORT_DIR, RECOVERY_DIR, checkpoint_dir("").name) == (run_files.REPORT, run_files.RECOVERY,
                                                                   run_files.CHECKPOINTS)
    assert LOCK_NAME == run_files.LOCK
