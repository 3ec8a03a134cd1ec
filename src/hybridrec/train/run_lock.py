"""One training per run directory at a time.

Two trainings of one run directory would resume from each other's checkpoints while they
are being written and interleave their ``metrics.jsonl``. The process that owns a run (the
launcher of ``hybridrec train dist.nproc=N``, the one process of a single-process run, rank
0 under torchrun) holds an exclusive ``flock`` on ``RUN/.lock`` from before it looks at the
directory until the run ends; a second training of the directory is refused in one line
naming the holder's pid. The kernel releases the lock when its holder dies, however it died,
so a lock left by a dead run is simply taken (the file's stale contents only ever name a
holder in a refusal while the lock is held). The file stays: removing it on release would
let a waiting opener lock a file no longer in the directory.

Before the lock file is made, the directory is checked to be one a run may take (new,
empty, or a hybridrec run: :func:`hybridrec.train.run_files.check_claim`; a refusal writes
nothing), and the lock file is opened without following a symbolic link. Its record names
hybridrec: the lock file is also what makes the directory a hybridrec run before its
config.json is written.

``flock`` is per machine: on a network file system that does not pass it on, two machines
could still train one directory at once.
"""

from __future__ import annotations

import contextlib
import datetime
import errno
import fcntl
import json
import os
import socket
from collections.abc import Iterator
from pathlib import Path

import hybridrec
from hybridrec.errors import ConfigError
from hybridrec.train import run_files

LOCK_NAME = run_files.LOCK


@contextlib.contextmanager
def holding(run_dir: str | Path, shown: str | None = None) -> Iterator[Path]:
    """Hold the run directory's lock (creating the directory if needed) while the block
    runs; raises :class:`ConfigError` when another process holds it, or the directory is
    not one a run may take (:func:`take`). A directory this call created is removed again
    if the block fails and left it otherwise empty."""
    run_dir = Path(run_dir)
    shown = shown or str(run_dir)
    created = not os.path.lexists(run_dir)
    fd = take(run_dir, shown)
    ok = False
    try:
        yield run_dir
        ok = True
    finally:
        if not ok and created:
            remove_empty(run_dir)
        os.close(fd)


def remove_empty(run_dir: str | Path) -> None:
    """Remove a run directory that holds nothing but its lock (a run refused before it
    wrote anything); anything else in it keeps it."""
    run_dir = Path(run_dir)
    with contextlib.suppress(OSError):
        if {p.name for p in run_dir.iterdir()} <= {LOCK_NAME}:
            (run_dir / LOCK_NAME).unlink(missing_ok=True)
            run_dir.rmdir()


def take(run_dir: Path, shown: str) -> int:
    """Lock ``run_dir`` for this process; returns the lock's descriptor (closing it releases
    the lock). Raises :class:`ConfigError` naming the holder when another process has it,
    and, before anything is created, for a directory no run may take
    (:func:`~hybridrec.train.run_files.check_claim`)."""
    run_files.check_claim(run_dir, shown)
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / LOCK_NAME
    try:  # (never through a link: check_claim refused one, and one made since is refused here)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o644)
    except OSError as e:
        if e.errno != errno.ELOOP:
            raise
        raise ConfigError(f"{path} is a symbolic link: a run writes only inside its own directory; remove "
                          "the link, or name a new or empty directory (train.run_dir=DIR)") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        holder = _holder(fd)
        os.close(fd)
        if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
            raise
        raise ConfigError(f"{shown} is being trained by another process ({holder}): wait for it to end "
                          "or stop it, or train another run (train.run_dir=DIR)") from None
    record = {"hybridrec": hybridrec.__version__, "pid": os.getpid(), "host": socket.gethostname(),
              "since": datetime.datetime.now().astimezone().isoformat(timespec="seconds")}
    os.ftruncate(fd, 0)
    os.pwrite(fd, (json.dumps(record) + "\n").encode(), 0)
    return fd


def _holder(fd: int) -> str:
    """Who holds the lock, as its file says: ``pid 1234 on host, since ...``."""
    try:
        record = json.loads(os.pread(fd, 4096, 0) or b"{}")
        who = f"pid {int(record['pid'])}"
    except (OSError, ValueError, KeyError, TypeError):
        return "a process that has not yet said which"
    if record.get("host") and record["host"] != socket.gethostname():
        who += f" on {record['host']}"
    return who + (f", since {record['since']}" if record.get("since") else "")
