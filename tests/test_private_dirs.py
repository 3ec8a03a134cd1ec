"""Partial recovery's directory in /dev/shm (a file system every user may write) is this
user's alone: made 0700, and one that exists as a symlink, of another owner or open to
others is neither used nor touched: the snapshots go to ``RUN/recovery/``, with one
warning line."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from hybridrec.train.checkpointing import snapshots


@pytest.fixture
def shm(tmp_path, monkeypatch):
    """A stand-in for /dev/shm: world-writable and sticky, as it is."""
    d = tmp_path / "shm"
    d.mkdir()
    d.chmod(0o1777)
    monkeypatch.setattr(snapshots, "SHM", d)
    return d


def _mode(p: Path) -> int:
    return stat.S_IMODE(os.lstat(p).st_mode)


def _launch(run: Path, capsys) -> tuple[Path | None, str | None, list[str]]:
    """What the launcher's context gives: the directory, the ranks' view of it, its warnings."""
    capsys.readouterr()
    with snapshots.fast_snapshots(run) as d:
        seen = None if d is None else str(snapshots.usable_fast_dir(d))
        if d is not None:
            assert _mode(d) == 0o700 and os.lstat(d).st_uid == os.getuid()
    return d, seen, capsys.readouterr().err.splitlines()


def _their_dir(shm: Path, run: Path) -> Path:
    """The name the launcher would use for ``run`` (made by the test, as another user would)."""
    with snapshots.fast_snapshots(run) as d:
        pass
    assert d is not None and not d.exists()  # (gone at the end)
    return d


def test_a_fresh_directory_is_0700_and_goes_at_the_end(shm, tmp_path, capsys):
    old = os.umask(0)  # even with no umask at all
    try:
        d, seen, err = _launch(tmp_path / "run", capsys)
    finally:
        os.umask(old)
    assert d is not None and d.parent == shm and seen == str(d) and err == []
    assert not d.exists()


@pytest.mark.parametrize("mode", [0o777, 0o755, 0o770], ids=["0777", "0755", "0770"])
def test_a_directory_open_to_others_is_avoided_and_left_alone(shm, tmp_path, capsys, mode):
    run = tmp_path / "run"
    d = _their_dir(shm, run)
    d.mkdir()
    d.chmod(mode)
    (d / "theirs").write_text("x")
    got, seen, err = _launch(run, capsys)
    assert got is None and seen is None
    assert err == [(f"hybridrec: warning: partial recovery's snapshots go to {run / 'recovery'}, not {d} "
                    f"({d}: mode {mode:04o}, open to other users (expected 0700))")]
    assert _mode(d) == mode and (d / "theirs").read_text() == "x"  # untouched


def test_a_symlink_is_refused_even_to_a_private_directory(shm, tmp_path, capsys):
    run = tmp_path / "run"
    d = _their_dir(shm, run)
    target = tmp_path / "elsewhere"
    target.mkdir(mode=0o700)
    d.symlink_to(target)
    got, _, err = _launch(run, capsys)
    assert got is None
    assert err == [(f"hybridrec: warning: partial recovery's snapshots go to {run / 'recovery'}, not {d} "
                    f"({d}: a symbolic link, not a directory)")]
    assert d.is_symlink() and target.is_dir()


def test_a_file_in_its_place_is_refused(shm, tmp_path, capsys):
    run = tmp_path / "run"
    d = _their_dir(shm, run)
    d.write_text("x")
    got, _, err = _launch(run, capsys)
    assert got is None and err[0].endswith(f"({d}: not a directory)"), err


@pytest.mark.skipif(os.getuid() != 0, reason="making a directory of another owner needs root")
def test_a_directory_of_another_owner_is_refused(shm, tmp_path, capsys):
    run = tmp_path / "run"
    d = _their_dir(shm, run)
    d.mkdir(mode=0o700)
    os.chown(d, 12345, 12345)
    got, _, err = _launch(run, capsys)
    assert got is None
    assert err[0].endswith(f"({d}: owned by uid 12345, not this user (uid {os.getuid()}))"), err
    assert os.lstat(d).st_uid == 12345


def test_its_own_0700_directory_is_taken_again(shm, tmp_path, capsys):
    """A launcher killed outright leaves its directory; the same command takes it again."""
    run = tmp_path / "run"
    d = _their_dir(shm, run)
    d.mkdir(mode=0o700)
    got, seen, err = _launch(run, capsys)
    assert got == d and seen == str(d) and err == []


def test_no_writable_shm_is_no_warning(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(snapshots, "SHM", tmp_path / "absent")
    got, _, err = _launch(tmp_path / "run", capsys)
    assert got is None and err == []


def test_the_ranks_ignore_a_directory_handed_to_them_that_is_open_to_others(tmp_path, monkeypatch):
    d = tmp_path / "fast"
    d.mkdir()
    d.chmod(0o777)
    assert snapshots.usable_fast_dir(d) is None  # (their snapshots and shards stay in the run directory)
    assert snapshots.usable_fast_dir(None) is None
    d.chmod(0o700)
    assert snapshots.usable_fast_dir(str(d)) == d


@pytest.mark.skipif(not os.access("/dev/shm", os.W_OK), reason="no writable /dev/shm")
def test_the_real_dev_shm_directory_is_0700(tmp_path, capsys):
    d, _, err = _launch(tmp_path / "run", capsys)
    assert d is not None and d.parent == Path("/dev/shm") and err == []
