"""No rank outlives its launcher.

A rank whose launcher is gone (``kill -9`` of ``hybridrec train dist.nproc=N``, a closed
terminal, an OOM kill) has nobody to report to: it would keep training, write checkpoints
into a run directory that a new launch may already hold, and wait out ``dist.timeout_s`` at
the end. Two mechanisms end it:

- the kernel's: the ranks are forked from multiprocessing's fork server, a child of the
  launcher; both ask Linux to SIGKILL them when their parent dies (``PR_SET_PDEATHSIG``):
  the server when the launcher dies (this module is the first of its preloaded modules, see
  ``launch.PRELOAD``), a rank when the server dies. Neither needs the rank's Python to run,
  so a rank blocked in a collective holding the GIL dies as promptly;
- a thread of each rank waiting on the launcher's pidfd (:func:`end_with`), which says so in
  one line; under torchrun, where no fork server stands between, the thread waits on
  torchrun's agent, the rank's parent.

A checkpoint a killed rank was writing stays an unfinished save (``*.tmp-PID``), never
loaded, and removed when the run starts again; a SIGTERM'd one removes it itself.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys
import threading
import time

_PR_SET_PDEATHSIG = 1  # (linux/prctl.h)


def die_with_parent() -> bool:
    """Have the kernel SIGKILL this process the moment its parent process ends; if the
    parent ended already, end now. Returns whether the kernel took the request (Linux)."""
    parent = os.getppid()
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        ok = libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False
    if ok and os.getppid() != parent:  # it died before the request: nobody would send the signal
        os.kill(os.getpid(), signal.SIGKILL)
    return ok


def end_with(pid: int, what: str) -> None:
    """End this process (SIGKILL) as soon as process ``pid`` ends, however it ended, after
    one line saying so: a daemon thread waits on the process's pidfd (Linux 5.3+; elsewhere
    it polls the parent pid twice a second)."""
    def die() -> None:
        with contextlib.suppress(OSError, ValueError):
            print(f"hybridrec: error: {what} (pid {pid}) is gone; stopping this process ({os.getpid()})",
                  file=sys.stderr, flush=True)
        os.kill(os.getpid(), signal.SIGKILL)

    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:  # gone already
        die()
    except (AttributeError, OSError):
        fd = None
    if fd is None:
        parent = os.getppid()

        def watch() -> None:
            while os.getppid() == parent:
                time.sleep(0.5)
            die()
    else:
        def watch() -> None:
            import select

            select.select([fd], [], [])  # readable once the process has ended
            die()

    threading.Thread(target=watch, name="hybridrec-lifeline", daemon=True).start()


def _in_fork_server() -> bool:
    """Whether this import runs in multiprocessing's fork server (its preload)."""
    frame = sys._getframe()
    while frame is not None:
        if frame.f_code.co_name == "main" and frame.f_code.co_filename.endswith(
                os.path.join("multiprocessing", "forkserver.py")):
            return True
        frame = frame.f_back
    return False


if _in_fork_server():  # the launcher's fork server: it dies with the launcher, and its ranks with it
    die_with_parent()
    # A SIGTERM to the whole process group (a scheduler's stop) is for the launcher and the
    # ranks to act on (hybridrec.train.terminate); killed by it, the server would take the
    # ranks with it (SIGKILL) mid-save. It ignores it, as it ignores SIGINT, and ends with
    # the launcher; a rank puts SIGTERM's default back first thing (cli.launch.rank_main).
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
