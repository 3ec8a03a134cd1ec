"""Errors a user can cause end `hybridrec` with one line, ``hybridrec: error: PATH: what``,
and status 2; a traceback only with ``--debug`` / ``HYBRIDREC_DEBUG=1``; a closed pipe
ends quietly."""

from __future__ import annotations

import io
import os
import pickle
import re
import subprocess
import sys
from pathlib import Path

import pytest
from synth_data import synth_dataset

from hybridrec.cli.main import BROKEN_PIPE, DEBUG_ENV, main
from hybridrec.errors import ConfigError, DataError

ROOT = os.geteuid() == 0


@pytest.fixture(autouse=True)
def _no_debug_no_ranks(monkeypatch):
    for name in (DEBUG_ENV, "RANK", "WORLD_SIZE", "TORCHELASTIC_ERROR_FILE"):
        monkeypatch.setenv(name, "")  # remembers the value before, restored after the test,
        monkeypatch.delenv(name)  # so HYBRIDREC_DEBUG set by `main(["--debug", ...])` goes


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return synth_dataset(tmp_path_factory.mktemp("cli_errors"), days=2, rows=400)


@pytest.fixture(scope="module")
def trained(data, tmp_path_factory):
    """A finished run directory with one checkpoint."""
    run = tmp_path_factory.mktemp("trained") / "run"
    assert main(train_args(data, run)) == 0
    return run


def train_args(data: Path, run: Path) -> list[str]:
    return ["train", "--recipe", "demo", f"data.path={data}", f"train.run_dir={run}",
            "data.batch_size=64", "train.max_steps=2"]


def error_of(capsys, code: int) -> str:
    """The one error line (without the prefix) after checking the status and that nothing
    else looks like an error or a traceback."""
    assert code == 2, code
    err = capsys.readouterr().err
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
def test_two_torchrun_ranks_with_the_same_error_print_it_once(data, tmp_path):
    (tmp_path / "f").write_text("x")
    proc = subprocess.run([sys.executable, "-m", "hybridrec", *train_args(data, tmp_path / "f"), "dist.nproc=2"],
                          capture_output=True, text=True, check=False, timeout=170)
    assert proc.returncode != 0
    lines = [line for line in proc.stderr.splitlines() if "hybridrec: error:" in line]
    assert lines == [f"hybridrec: error: {tmp_path / 'f'}: is a file, not a directory"], proc.stderr


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


def test_a_pipeline_into_head_ends_quietly():
    cmd = (f"{sys.executable} -m hybridrec train --list-keys | head -n 1; "
           f"{sys.executable} -m hybridrec plan --nproc 2 --tables 26x1000x16 | head -c 10")
    proc = subprocess.run(["bash", "-c", cmd], capture_output=True, text=True, check=False, timeout=120)
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr
    assert proc.stdout.startswith("[data]\n")
