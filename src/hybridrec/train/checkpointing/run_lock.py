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

from hybridrec.errors import ConfigError

LOCK_NAME = ".lock"


@contextlib.contextmanager
def holding(run_dir: str | Path, shown: str | None = None) -> Iterator[Path]:
    """Hold the run directory's lock (creating the directory if needed) while the block
    runs; raises :class:`ConfigError` when another process holds it. A directory this call
    created is removed again if the block fails and left it otherwise empty."""
    run_dir = Path(run_dir)
    shown = shown or str(run_dir)
    created = not run_dir.exists()
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
    the lock). Raises :class:`ConfigError` naming the holder when another process has it."""
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / LOCK_NAME
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        holder = _holder(fd)
        os.close(fd)
        if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
            raise
        raise ConfigError(f"{shown} is being trained by another process ({holder}): wait for it to end "
                          "or stop it, or train another run (train.run_dir=DIR)") from None
    record = {"pid": os.getpid(), "host": socket.gethostname(),
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
