"""Errors a user can cause end `hybridrec` with one line, ``hybridrec: error: PATH: what``,
and status 2; a traceback only with ``--debug`` / ``HYBRIDREC_DEBUG=1``; a closed pipe
ends quietly."""

from __future__ import annotations

import errno
import io
import json
import os
import pickle
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from hybridrec.cli.main import BROKEN_PIPE, DEBUG_ENV, main
from hybridrec.errors import ConfigError, DataError

ROOT = os.geteuid() == 0


@pytest.fixture(scope="module")
def data(shared_dataset):
    return shared_dataset(days=2, rows=400)


@pytest.fixture(scope="module")
def bad_eval_data(data, tmp_path_factory):
    """``data`` with an id past its table in the eval split, which every rank opens: an
    error each rank of a launch meets alike, after the launcher's checks."""
    import json
    import shutil

    import numpy as np

    copy = tmp_path_factory.mktemp("bad_eval") / "data"
    shutil.copytree(data, copy)
    part = copy / json.loads((copy / "meta.json").read_text())["splits"]["eval"][0]
    for cached in part.glob("id_ranges*"):
        cached.unlink()
    ids = np.load(part / "onehot.npy", mmap_mode="r+")
    ids[0, 0] = 10**9
    ids.flush()
    del ids
    return copy


BAD_EVAL_LINE = "onehot.npy: feature C1 holds id 1000000000, past its table"


@pytest.fixture(scope="module")
def trained(data, tmp_path_factory):
    """A finished run directory with one checkpoint."""
    run = tmp_path_factory.mktemp("trained") / "run"
    assert main(train_args(data, run)) == 0
    return run


def train_args(data: Path, run: Path) -> list[str]:
    return ["train", "--recipe", "demo", f"data.path={data}", f"train.run_dir={run}",
            "data.batch_size=64", "train.max_steps=2"]


def error_of(capsys, code: int, err: str | None = None) -> str:
    """The one error line (without the prefix) after checking the status and that nothing
    else looks like an error or a traceback (in ``err``, else what capsys holds)."""
    assert code == 2, code
    err = capsys.readouterr().err if err is None else err
    assert "Traceback" not in err, err
    lines = [line for line in err.splitlines() if line.startswith("hybridrec: error: ")]
    assert len(lines) == 1, err
    return lines[0].removeprefix("hybridrec: error: ")


def checkpoint_of(run: Path) -> Path:
    (ck,) = (run / "checkpoints").iterdir()
    return ck


def copy_run(run: Path, dest: Path) -> Path:
    import shutil

    shutil.copytree(run, dest)
    return dest


# -- the run directory ----------------------------------------------------------------------
def test_run_directory_is_a_file(data, tmp_path, capsys):
    (tmp_path / "f").write_text("x")
    code = main(train_args(data, tmp_path / "f"))
    assert error_of(capsys, code) == f"{tmp_path / 'f'}: is a file, not a directory"


def test_run_directory_under_a_file(data, tmp_path, capsys):
    (tmp_path / "f").write_text("x")
    code = main(train_args(data, tmp_path / "f" / "run"))
    assert error_of(capsys, code) == f"{tmp_path / 'f' / 'run'}: Not a directory ({tmp_path / 'f'} is a file)"


@pytest.mark.skipif(ROOT, reason="root writes into a 0o555 directory")
def test_run_directory_in_a_read_only_directory(data, tmp_path, capsys):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    try:
        code = main(train_args(data, ro / "run"))
    finally:
        ro.chmod(0o755)
    assert error_of(capsys, code) == f"{ro / 'run'}: Permission denied"


class _Tmpfs:
    """A small tmpfs at ``path`` (root only; skips the test where mounting is not allowed)."""

    def __init__(self, path: Path, options: str) -> None:
        if not ROOT:
            pytest.skip("mounting a tmpfs needs root")
        path.mkdir()
        proc = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)],
                              capture_output=True, text=True, check=False)
        if proc.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs: {proc.stderr.strip()}")
        self.path = path

    def __enter__(self) -> Path:
        return self.path

    def __exit__(self, *exc) -> None:
        subprocess.run(["umount", str(self.path)], check=True)


def test_read_only_file_system(data, tmp_path, capsys):
    with _Tmpfs(tmp_path / "ro", "ro,size=1m") as ro:
        code = main(train_args(data, ro / "run"))
    assert error_of(capsys, code) == f"{ro / 'run'}: Read-only file system"


def test_full_disk_while_saving_a_checkpoint(data, tmp_path, capsys):
    # Room for config.json and metrics.jsonl, not for the checkpoint (about 700 kB).
    with _Tmpfs(tmp_path / "small", "size=200k") as small:
        code = main(train_args(data, small / "run"))
        line = error_of(capsys, code)
        assert not [p for p in (small / "run" / "checkpoints").iterdir()]  # no partial checkpoint
    assert re.fullmatch(rf"{re.escape(str(small / 'run'))}/checkpoints/step-\d+: saving the checkpoint "
                        r"failed: No space left on device", line), line


def test_a_summary_that_cannot_be_written_still_shows_the_results(data, tmp_path, capsys, monkeypatch):
    from hybridrec.train import run

    real = run.write_json_atomic

    def full(path, obj, **kw):
        if Path(path).name == "summary.json":
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        return real(path, obj, **kw)

    monkeypatch.setattr(run, "write_json_atomic", full)
    code = main(train_args(data, tmp_path / "run"))
    out = capsys.readouterr()
    assert code == 2
    assert out.err.strip().splitlines()[-1] == f"hybridrec: error: {tmp_path / 'run' / 'summary.json'}: No space left on device"
    assert re.search(r"^AUC\s+0\.\d{4}", out.out, re.MULTILINE), out.out  # the table was printed first
    assert not (tmp_path / "run" / "summary.json").exists()


def _fill(directory: Path) -> None:
    """Fill the file system of ``directory`` to the last byte."""
    with open(directory / "filler", "wb", buffering=0) as f, pytest.raises(OSError) as full:
        while True:
            f.write(b"\0" * 4096)
    assert full.value.errno == errno.ENOSPC


def _records(path: Path) -> list[dict]:
    """Every line of a JSONL file, each a whole record (json.loads fails on a cut line)."""
    text = path.read_text()
    assert text == "" or text.endswith("\n"), text[-200:]
    return [json.loads(line) for line in text.splitlines()]


def test_metrics_on_a_full_disk_keep_whole_records(tmp_path):
    from hybridrec.errors import error_line
    from hybridrec.metrics import MetricLogger

    with _Tmpfs(tmp_path / "small", "size=4k") as small:  # one page
        log = MetricLogger(small / "run")
        with pytest.raises(OSError) as full:
            for step in range(1000):
                log.log(step, {"loss": 0.5, "samples_per_sec": 12345.678})
        assert error_line(full.value) == f"{small / 'run' / 'metrics.jsonl'}: No space left on device"
        log.close()  # nothing left to write: no second error
        records = _records(small / "run" / "metrics.jsonl")
        assert step > 10 and [r["step"] for r in records] == list(range(step))  # all but the failed one


def test_metrics_on_a_full_device(tmp_path):
    """The same without root: metrics.jsonl is /dev/full, where every write fails."""
    from hybridrec.errors import error_line
    from hybridrec.metrics import MetricLogger

    (tmp_path / "metrics.jsonl").symlink_to("/dev/full")
    log = MetricLogger(tmp_path, flush_every=3)
    log.log(1, {"loss": 0.5})
    log.log(2, {"loss": 0.5})
    with pytest.raises(OSError) as full:
        log.log(3, {"loss": 0.5})
    assert error_line(full.value) == f"{tmp_path / 'metrics.jsonl'}: No space left on device"
    log.log(4, {"loss": 0.5})
    with pytest.raises(OSError, match="No space left on device"):
        log.close()  # the last record cannot be written either, and the file is closed
    log.close()


@pytest.mark.slow
def test_training_on_a_disk_that_fills_up(data, tmp_path, capsys):
    # Room for the run's lock, config.json and one page of metrics.jsonl (about 25 records).
    with _Tmpfs(tmp_path / "small", "size=12k") as small:
        run = small / "run"
        code = main([*train_args(data, run), "data.batch_size=8", "train.epochs=100",
                     "train.max_steps=1000", "train.log_every=1", "train.progress=false"])
        assert error_of(capsys, code) == f"{run / 'metrics.jsonl'}: No space left on device"
        assert len(_records(run / "metrics.jsonl")) > 10  # whole records, the last one too
        assert json.loads((run / "config.json").read_text())["train"]["run_dir"] == str(run)
        assert sorted(p.name for p in run.iterdir()) == [".lock", "config.json", "metrics.jsonl"]


def test_eval_and_report_on_a_full_disk(trained, tmp_path, capsys):
    with _Tmpfs(tmp_path / "small", "size=2m") as small:
        run = copy_run(trained, small / "run")
        shutil.rmtree(run / "report", ignore_errors=True)
        _fill(small)
        code = main(["eval", str(run)])
        out, err = capsys.readouterr()  # the metrics, computed before the write failed
        assert re.search(r"^AUC +\d\.\d{4}$", out, re.MULTILINE), out
        assert error_of(capsys, code, err) == f"{run / 'eval.json'}: No space left on device"
        code = main(["report", str(run)])
        assert re.fullmatch(rf"{re.escape(str(run / 'report'))}/\w+\.svg: No space left on device",
                            error_of(capsys, code))
        # Nothing half-written: no eval.json, no temporary file, no empty chart.
        assert not [p for p in run.rglob("*") if p.name.endswith(".tmp") or p.name == "eval.json"
                    or (p.is_file() and p.stat().st_size == 0)]


def test_eval_on_a_read_only_run_directory(trained, tmp_path, capsys):
    """The metrics are printed and the command succeeds; one line says they were not saved,
    and --out saves them elsewhere."""
    with _Tmpfs(tmp_path / "ro", "size=2m") as ro:
        run = copy_run(trained, ro / "run")
        subprocess.run(["mount", "-o", "remount,ro", str(ro)], check=True)
        code = main(["eval", str(run)])
        out, err = capsys.readouterr()
        assert code == 0, err
        auc = re.search(r"^AUC +(\d\.\d{4})$", out, re.MULTILINE)
        assert auc, out
        assert err.splitlines() == [(f"hybridrec: warning: the metrics were not saved: {run / 'eval.json'}: "
                                     "Read-only file system (--out FILE writes them elsewhere)")]
        assert main(["eval", str(run), "--out", str(tmp_path / "ev.json")]) == 0
        assert f"{json.loads((tmp_path / 'ev.json').read_text())['auc']:.4f}" == auc[1]
        assert not (run / "eval.json").exists()


def test_eval_out_names_where_the_metrics_go(trained, tmp_path, capsys):
    run = copy_run(trained, tmp_path / "run")
    assert main(["eval", str(run), "--out", str(tmp_path / "m" / "ev.json")]) == 0
    result = json.loads((tmp_path / "m" / "ev.json").read_text())
    assert re.search(rf"^AUC +{result['auc']:.4f}$", capsys.readouterr().out, re.MULTILINE)
    assert not (run / "eval.json").exists()
    # --out that cannot be written is the error it is, named (not a warning)
    (tmp_path / "f").write_text("x")
    code = main(["eval", str(run), "--out", str(tmp_path / "f" / "ev.json")])
    assert error_of(capsys, code) == f"{tmp_path / 'f'}: is a file, not a directory"


# -- settings that could never take effect ---------------------------------------------------
@pytest.mark.parametrize("extra, message", [
    (["train.eval_every=3"], ("train.eval_every=3 is past the run's last step (2): it would never evaluate "
                              "before the end; set train.eval_every <= 2, or 0 (only at the end)")),
    (["train.inject_failure=0:3"], ("train.inject_failure=0:3: step 3 (rank 0) is past the run's last step "
                                    "(2): that failure would never happen")),
    (["train.inject_failure=0:1,0:5"], "train.inject_failure=0:1,0:5: step 5 (rank 0) is past the run's last step (2)"),
    # 400 training rows, batch 64: 6 steps an epoch, 12 in two
    (["train.max_steps=0", "train.epochs=2", "train.eval_every=13"], "train.eval_every=13 is past the run's last step (12)"),
    # the launcher's check, before any rank starts (2 ranks: 3 steps an epoch)
    (["train.max_steps=0", "dist.nproc=2", "train.eval_every=4"], "train.eval_every=4 is past the run's last step (3)"),
])
def test_a_setting_past_the_last_step_is_refused(data, tmp_path, capsys, extra, message):
    code = main([*train_args(data, tmp_path / "run"), *extra])
    err = capsys.readouterr().err
    assert error_of(capsys, code, err).startswith(message), err
    assert "launching" not in err and not (tmp_path / "run").exists()


def test_a_setting_past_the_last_step_changes_nothing(trained, tmp_path, capsys):
    """train.resume=false would delete the old run first: refused before it does."""
    run = copy_run(trained, tmp_path / "run")
    before = sorted(p.relative_to(run) for p in run.rglob("*"))
    code = main([*train_args(json.loads((run / "config.json").read_text())["data"]["path"], run),
                 "train.resume=false", "train.eval_every=5"])
    assert error_of(capsys, code).startswith("train.eval_every=5 is past the run's last step (2)")
    assert sorted(p.relative_to(run) for p in run.rglob("*")) == before


def test_settings_at_the_last_step_are_taken(data, tmp_path):
    assert main([*train_args(data, tmp_path / "run"), "train.eval_every=2"]) == 0


# -- checkpoints that cannot be loaded --------------------------------------------------------
def test_missing_checkpoint(trained, tmp_path, capsys):
    code = main(["eval", str(trained), "--checkpoint", str(tmp_path / "nothere")])
    assert error_of(capsys, code) == f"{tmp_path / 'nothere'}: loading the checkpoint failed: No such file or directory"


def test_truncated_checkpoint(trained, tmp_path, capsys):
    run = copy_run(trained, tmp_path / "run")
    ck = checkpoint_of(run)
    (tensors,) = ck.glob("*.distcp")
    size = tensors.stat().st_size
    os.truncate(tensors, 1000)
    code = main(["eval", str(run)])
    assert error_of(capsys, code) == (f"{ck}: loading the checkpoint failed: {tensors.name}: "
                                      f"truncated (1,000 of {size:,} bytes)")


class _Payload:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _replace_first_tensor(ck: Path, blob: bytes) -> str:
    """Put ``blob`` where the checkpoint's first tensor is stored and fix the offsets in
    ``.metadata`` (what a tampered checkpoint looks like to the reader)."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo

    from hybridrec.parallel.checkpoint_io import SafeFileSystemReader

    md = SafeFileSystemReader(ck).read_metadata()
    items = sorted(md.storage_data.items(), key=lambda kv: (kv[1].relative_path, kv[1].offset))
    name = items[0][1].relative_path
    raw, out = (ck / name).read_bytes(), bytearray()
    for i, (key, info) in enumerate(items):
        if info.relative_path != name:
            continue
        chunk = blob if i == 0 else raw[info.offset:info.offset + info.length]
        md.storage_data[key] = _StorageInfo(name, len(out), len(chunk), info.transform_descriptors)
        out += chunk
    (ck / name).write_bytes(bytes(out))
    md.storage_meta = None
    (ck / ".metadata").write_bytes(pickle.dumps(md))
    manifest = json.loads((ck / "manifest.json").read_text())
    del manifest["checksums"]  # (a forger rewrites them, or drops them: then they are not checked)
    (ck / "manifest.json").write_text(json.dumps(manifest))
    return name


def test_a_pickle_in_a_tensor_file_is_refused(trained, tmp_path, capsys):
    import torch

    run = copy_run(trained, tmp_path / "run")
    ck = checkpoint_of(run)
    buf = io.BytesIO()
    torch.save({"x": _Payload(tmp_path / "pwned")}, buf)
    name = _replace_first_tensor(ck, buf.getvalue())
    code = main(["eval", str(run)])
    assert error_of(capsys, code) == (f"{ck}: loading the checkpoint failed: {name}: refused: it holds "
                                      "objects other than tensors (posix.system), which are never "
                                      "unpickled")
    assert not (tmp_path / "pwned").exists()


def test_a_pickle_in_the_metadata_is_refused(trained, tmp_path, capsys):
    run = copy_run(trained, tmp_path / "run")
    ck = checkpoint_of(run)
    (ck / ".metadata").write_bytes(pickle.dumps(_Payload(tmp_path / "pwned")))
    code = main(["eval", str(run)])
    assert error_of(capsys, code) == (f"{ck}: loading the checkpoint failed: .metadata: refused: it "
                                      "references posix.system; checkpoint metadata may hold only "
                                      "DCP's metadata types")
    assert not (tmp_path / "pwned").exists()


# -- --debug ----------------------------------------------------------------------------------
def test_debug_flag_and_variable_show_the_traceback(tmp_path, capsys, monkeypatch):
    (tmp_path / "f").write_text("x")
    argv = ["plan", "--nproc", "2", "--tables", "2x100x8", "--out", str(tmp_path / "f" / "plan.json")]
    assert error_of(capsys, main(argv)) == (f"{tmp_path / 'f' / 'plan.json'}: Not a directory "
                                            f"({tmp_path / 'f'} is a file)")
    with pytest.raises(NotADirectoryError):
        main(["--debug", *argv])
    monkeypatch.delenv(DEBUG_ENV)
    monkeypatch.setenv(DEBUG_ENV, "1")
    with pytest.raises(NotADirectoryError):
        main(argv)
    monkeypatch.setenv(DEBUG_ENV, "0")
    assert main(argv) == 2


@pytest.mark.slow
def test_debug_reaches_a_subprocess(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "hybridrec", "--debug", "data", "inspect",
                           str(tmp_path / "none")], capture_output=True, text=True, check=False)
    assert proc.returncode == 1 and "Traceback" in proc.stderr and "DataError" in proc.stderr
    proc = subprocess.run([sys.executable, "-m", "hybridrec", "data", "inspect", str(tmp_path / "none")],
                          capture_output=True, text=True, check=False)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr


# -- several ranks ----------------------------------------------------------------------------
def _as_rank(monkeypatch, rank: int, world: int = 2, attempt: Path | None = None) -> None:
    monkeypatch.setenv("RANK", str(rank))
    monkeypatch.setenv("WORLD_SIZE", str(world))
    if attempt is not None:  # torchrun: one error file per local rank in one attempt directory
        (attempt / str(rank)).mkdir(parents=True, exist_ok=True)
        monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(attempt / str(rank) / "error.json"))


def test_torchrun_ranks_print_an_identical_error_once(tmp_path, capsys, monkeypatch):
    argv = ["data", "inspect", str(tmp_path / "none")]
    for rank in (0, 1):
        _as_rank(monkeypatch, rank, attempt=tmp_path / "attempt_0")
        assert main(argv) == 2
    assert capsys.readouterr().err == f"hybridrec: error: {tmp_path / 'none'}: dataset directory does not exist\n"
    _as_rank(monkeypatch, 1, attempt=tmp_path / "attempt_0")
    assert main(["data", "inspect", str(tmp_path / "other")]) == 2  # another message: shown
    assert str(tmp_path / "other") in capsys.readouterr().err


def test_other_launchers_rank_0_prints_what_every_rank_raises(tmp_path, capsys, monkeypatch):
    config = tmp_path / "c.toml"
    config.write_text("[nosuch]\nx = 1\n")
    argv = ["train", "--config", str(config)]
    _as_rank(monkeypatch, 1)
    assert main(argv) == 2
    assert capsys.readouterr().err == ""  # a config error: every rank has it, rank 0 says it
    _as_rank(monkeypatch, 0)
    assert main(argv) == 2
    assert capsys.readouterr().err.startswith(f"hybridrec: error: {config}: unknown config section")
    _as_rank(monkeypatch, 1)
    assert main(["data", "inspect", str(tmp_path / "none")]) == 2  # may be this rank's own
    assert capsys.readouterr().err.count("hybridrec: error: ") == 1


@pytest.mark.distributed
@pytest.mark.timeout(180)
def test_two_torchrun_ranks_with_the_same_error_print_it_once(bad_eval_data, tmp_path):
    proc = subprocess.run([sys.executable, "-m", "hybridrec", *train_args(bad_eval_data, tmp_path / "run"),
                           "dist.nproc=2"], capture_output=True, text=True, check=False, timeout=170)
    assert proc.returncode == 2
    # The ranks' error once, then the launcher's line; no traceback.
    lines = [line for line in proc.stderr.splitlines() if "hybridrec: error:" in line]
    assert lines[0].startswith(f"hybridrec: error: {bad_eval_data}/") and BAD_EVAL_LINE in lines[0], proc.stderr
    assert re.fullmatch(r"hybridrec: error: (rank [01]|ranks 0 and 1) exited with code 2 \(see above\)", lines[1]), proc.stderr
    assert len(lines) == 2 and "Traceback" not in proc.stderr, proc.stderr


@pytest.mark.distributed
@pytest.mark.timeout(180)
def test_a_full_disk_on_rank_0_ends_in_its_line_and_the_launchers(data, tmp_path):
    """Rank 0 alone writes metrics.jsonl: its error stops it mid-training, and rank 1,
    whose collective loses its peer, says nothing (neither does the agent)."""
    with _Tmpfs(tmp_path / "small", "size=24k") as small:  # lock, config, plan and a page of metrics
        run = small / "run"
        proc = subprocess.run([sys.executable, "-m", "hybridrec", *train_args(data, run), "dist.nproc=2",
                               "data.batch_size=4", "train.epochs=100", "train.max_steps=1000",
                               "train.log_every=1", "train.progress=false", "dist.timeout_s=60"],
                              capture_output=True, text=True, check=False, timeout=170)
        assert len(_records(run / "metrics.jsonl")) > 10
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.splitlines()[1:] == [
        f"hybridrec: error: {run / 'metrics.jsonl'}: No space left on device",
        "hybridrec: error: rank 0 exited with code 2 (see above)"], proc.stderr


def test_the_launchers_line_names_the_rank_that_failed_not_those_it_stopped():
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    from hybridrec.cli.launch import PEER_LOST, failure_line

    def failures(*codes):
        return {rank: ProcessFailure(rank, 1000 + rank, code, "<N/A>") for rank, code in enumerate(codes)}

    # Rank 2's error (status 2) ended the run; rank 0 lost its peer, rank 1 was stopped.
    assert failure_line(failures(PEER_LOST, -15, 2)) == ("rank 2 exited with code 2 (see above)", 2)
    assert failure_line(failures(2, 2)) == ("ranks 0 and 1 exited with code 2 (see above)", 2)
    assert failure_line(failures(-15, 1)) == ("rank 1 exited with code 1 (see above)", 1)
    line, status = failure_line(failures(-15, -9))
    assert line.startswith("rank 1 (pid 1001) was killed by SIGKILL") and status == 1
    assert failure_line(failures(-15, 130)) == ("rank 1 interrupted", 130)
    # Nothing but stopped ranks (someone sent them SIGTERM): said as it is.
    assert failure_line(failures(-15, -15)) == ("rank 0 (pid 1000) was killed by SIGTERM", 1)


def _recorded(monkeypatch, attempt: Path, rank: int, e: BaseException, world: int = 2) -> str:
    """Rank ``rank``'s error file in the torchrun attempt directory ``attempt``, with ``e``
    recorded in it as the rank records it."""
    from hybridrec.errors import record_error

    _as_rank(monkeypatch, rank, world, attempt=attempt)
    assert record_error(e)
    return os.environ["TORCHELASTIC_ERROR_FILE"]


def _failure(rank: int, exitcode: int, error_file: str = "<N/A>"):
    """The agent's record of a failed rank (it reads the rank's error file, if any)."""
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    return ProcessFailure(rank, 1000 + rank, exitcode, error_file)


def test_a_recorded_error_is_the_cause_however_its_rank_then_died(tmp_path, monkeypatch):
    import signal

    from hybridrec.cli.launch import PEER_LOST, failure_line, recorded_error

    attempt = tmp_path / "attempt_0"
    bad = _recorded(monkeypatch, attempt, 0, DataError(f"{tmp_path / 'd'}: dataset directory does not exist"))
    assert recorded_error(_failure(0, 2, bad)) == (f"{tmp_path / 'd'}: dataset directory does not exist", 2)
    # Rank 0 recorded its error, then exited, or gloo's teardown aborted it, or the agent
    # stopped it because rank 1, whose collective lost it, exited first: its error either way.
    for died in (2, -signal.SIGABRT, -signal.SIGTERM, -signal.SIGKILL):
        for other in (PEER_LOST, -signal.SIGTERM, -signal.SIGABRT, -signal.SIGKILL):
            failures = {0: _failure(0, died, bad), 1: _failure(1, other)}
            assert failure_line(failures) == ("rank 0 exited with code 2 (see above)", 2), (died, other)
    # Both recorded the same error: named once, both ranks.
    same = _recorded(monkeypatch, attempt, 1, DataError(f"{tmp_path / 'd'}: dataset directory does not exist"))
    failures = {0: _failure(0, -signal.SIGABRT, bad), 1: _failure(1, 2, same)}
    assert failure_line(failures) == ("ranks 0 and 1 exited with code 2 (see above)", 2)
    # A kill by train.inject_failure is the cause even so; without a recorded error, a
    # killed rank is named with its signal (as before).
    failures = {0: _failure(0, 2, bad), 1: _failure(1, -signal.SIGKILL)}
    assert failure_line(failures, injected_pid=1001)[0] == (
        "rank 1 (pid 1001) was killed by SIGKILL (injected: train.inject_failure)")
    failures = {0: _failure(0, PEER_LOST), 1: _failure(1, -signal.SIGABRT)}
    assert failure_line(failures) == ("rank 1 (pid 1001) was killed by SIGABRT", 1)


def test_only_one_line_errors_are_recorded_whole(tmp_path, monkeypatch):
    from hybridrec.cli.launch import recorded_error
    from hybridrec.errors import record_error

    assert not record_error(DataError("x"))  # no TORCHELASTIC_ERROR_FILE: not a rank of the agent
    attempt = tmp_path / "attempt_0"
    _as_rank(monkeypatch, 0, attempt=attempt)
    error_file = Path(os.environ["TORCHELASTIC_ERROR_FILE"])
    for other in (RuntimeError("Connection closed by peer"), BrokenPipeError(32, "Broken pipe"), ValueError("bug")):
        assert not record_error(other) and not error_file.exists()  # peer lost, quiet exit, traceback
    try:
        os.mkdir(tmp_path)
    except FileExistsError as e:
        assert record_error(e)
    assert [p.name for p in error_file.parent.iterdir()] == ["error.json"]  # renamed into place
    assert json.loads(error_file.read_text())["message"]["errorCode"] == 2
    assert recorded_error(_failure(0, -6, str(error_file))) == (f"{tmp_path}: File exists", 2)
    # The same in a directory that cannot take it: nothing recorded, nothing raised.
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(tmp_path / "none" / "sub" / "error.json"))
    (tmp_path / "none").write_text("x")
    assert not record_error(DataError("x"))


def test_the_launcher_prints_a_recorded_error_no_rank_printed(tmp_path, monkeypatch, capsys):
    from hybridrec.cli.launch import unprinted_errors
    from hybridrec.cli.main import report

    attempt = tmp_path / "attempt_0"
    said, unsaid = DataError("a: printed by its rank"), DataError("b: its rank died first")
    f0 = _recorded(monkeypatch, attempt, 0, said, world=3)
    report(said)  # rank 0 printed its error (and claimed it for this machine)
    assert capsys.readouterr().err == "hybridrec: error: a: printed by its rank\n"
    f1 = _recorded(monkeypatch, attempt, 1, unsaid, world=3)
    f2 = _recorded(monkeypatch, attempt, 2, unsaid, world=3)
    failures = {0: _failure(0, 2, f0), 1: _failure(1, -15, f1), 2: _failure(2, -15, f2), 3: _failure(3, 3)}
    assert unprinted_errors(failures) == ["b: its rank died first"]  # once, though two ranks recorded it


_SIMULATED_TEARDOWN = """\
import atexit, os, time

def _end():  # in rank 0, once it has printed its error and returned from main
    if os.environ.get("RANK") != "0":
        return
    if os.environ["SIMULATE"] == "abort":  # gloo's teardown aborts the rank
        import resource
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # (no core file in the test's directory)
        os.abort()
    import torch.distributed as dist  # its sockets close, then a slow teardown: the peer,
    dist.destroy_process_group()      # losing it, exits first and the agent stops rank 0
    time.sleep(30)

if os.environ.get("TORCHELASTIC_ERROR_FILE"):
    atexit.register(_end)
"""


@pytest.mark.distributed
@pytest.mark.timeout(180)
@pytest.mark.parametrize("teardown", ["abort", "slow"])
def test_a_rank_that_dies_after_its_error_still_ends_in_it(bad_eval_data, tmp_path, teardown):
    """Both ways the race of the ranks' teardown went wrong, made certain: the rank that
    printed the error is then killed by SIGABRT, or by the agent's SIGTERM after its peer
    exited as peer-lost. The launcher still names the error (recorded before either)."""
    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "sitecustomize.py").write_text(_SIMULATED_TEARDOWN)
    path = os.pathsep.join(filter(None, [str(tmp_path / "site"), os.environ.get("PYTHONPATH")]))
    proc = subprocess.run([sys.executable, "-m", "hybridrec", *train_args(bad_eval_data, tmp_path / "run"),
                           "dist.nproc=2"], capture_output=True, text=True, check=False, timeout=170,
                          env={**os.environ, "PYTHONPATH": path, "SIMULATE": teardown})
    lines = [line for line in proc.stderr.splitlines() if "hybridrec: error:" in line]
    assert len(lines) == 2 and BAD_EVAL_LINE in lines[0], proc.stderr
    # (both ranks meet the bad id: whichever exits first with its code is named)
    assert re.fullmatch(r"hybridrec: error: rank [01] exited with code 2 \(see above\)", lines[1]), proc.stderr
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr


def _a_collective_without_its_peer(topo):
    """Rank 0 all-reduces while rank 1 sleeps past the timeout: the error rank 0 gets."""
    import time

    import torch
    import torch.distributed as dist

    from hybridrec.cli.outcome import peer_failure

    if topo.rank == 1:
        time.sleep(2)
        return None
    try:
        dist.all_reduce(torch.ones(1), group=topo.group)
    except RuntimeError as e:
        return peer_failure(e), str(e)
    return None


@pytest.mark.distributed
@pytest.mark.timeout(120)
def test_a_collective_that_times_out_is_told_apart_from_other_errors():
    from distributed import run_ranks

    from hybridrec.cli.outcome import peer_failure

    (why, message), _ = run_ranks(_a_collective_without_its_peer, 2, timeout_s=1.0)
    assert why is not None and why.startswith("Timed out waiting 1000ms"), message
    # Errors that are not about the ranks' connections keep their traceback.
    assert peer_failure(RuntimeError("shape mismatch")) is None
    assert peer_failure(ValueError("Connection reset by peer")) is None


def test_error_classes_mark_what_every_rank_raises():
    assert ConfigError("x").same_on_every_rank and not DataError("x").same_on_every_rank


# -- closed pipes ---------------------------------------------------------------------------
@pytest.mark.parametrize("argv", [["train", "--list-keys"], ["plan", "--nproc", "2", "--tables", "26x1000x16"]])
def test_a_closed_pipe_ends_quietly(argv):
    read, write = os.pipe()
    os.close(read)  # the reader is gone before anything is written, as after `| head` exits
    try:
        proc = subprocess.run([sys.executable, "-m", "hybridrec", *argv], stdout=write,
                              stderr=subprocess.PIPE, text=True, check=False, timeout=120)
    finally:
        os.close(write)
    assert proc.returncode == BROKEN_PIPE == 141 and proc.stderr == ""


@pytest.mark.slow
def test_a_pipeline_into_head_ends_quietly():
    cmd = (f"{sys.executable} -m hybridrec train --list-keys | head -n 1; "
           f"{sys.executable} -m hybridrec plan --nproc 2 --tables 26x1000x16 | head -c 10")
    proc = subprocess.run(["bash", "-c", cmd], capture_output=True, text=True, check=False, timeout=120)
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr
    assert proc.stdout.startswith("[data]\n")


def test_an_error_caused_by_a_peer_that_went_away_is_a_lost_peer(monkeypatch, capsys):
    """A rank's own error whose cause is a collective that lost its peer (the shadow sync
    thread's round with a rank that was killed) exits as a lost peer, so the launcher names the
    rank that died; the same error without that cause is this rank's to report."""
    from hybridrec.cli import main as cli_main
    from hybridrec.cli.launch import LAUNCHED_ENV, PEER_LOST
    from hybridrec.errors import USER_ERROR, HybridrecError

    def failing(cause):
        def run(_args):
            try:
                raise cause
            except RuntimeError as e:
                raise HybridrecError("the shadow sync thread died at step 6 after 2 round(s)") from e
        return run

    lost = RuntimeError("[gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:11655: Connection reset by peer")
    other = RuntimeError("shape mismatch in a round")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv(LAUNCHED_ENV, "1")
    for cause, status in ((lost, PEER_LOST), (other, USER_ERROR)):
        parser = cli_main.build_parser()
        monkeypatch.setattr(cli_main, "build_parser", lambda p=parser: p)
        args = parser.parse_args(["train", "--list-keys"])
        monkeypatch.setattr(parser, "parse_args", lambda *a, args=args, cause=cause, **k: (
            setattr(args, "func", failing(cause)) or args))
        assert cli_main.main(["train", "--list-keys"]) == status
    err = capsys.readouterr().err
    assert err.count("shadow sync thread died") == 1  # (only the error of another cause is said)
