"""SIGTERM acted on by a thread, for the recoveries: the launcher's agent stops every rank
(and parameter server) with SIGTERM after one failed, often while the main thread is blocked
in a collective or an RPC call, where a Python signal handler would not run.
:class:`SigtermWatch` reads :func:`signal.set_wakeup_fd`'s pipe in a thread instead, so a
survivor writes its snapshot (:mod:`hybridrec.train.checkpointing.recovery`,
:mod:`hybridrec.train.checkpointing.server_recovery`) and :mod:`hybridrec.train.terminate`
says its line whatever the main thread is doing; :func:`park_main` stops the main thread
meanwhile.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
from typing import ClassVar

LOCK_WAIT_S = 20.0
"""How long a SIGTERM'd rank waits for its step's update to finish (the agent's grace
period before SIGKILL is 30 s)."""


class SigtermWatch:
    """SIGTERM (the launcher's agent stopping the ranks after one failed) acted on by a
    thread: :meth:`start` arms it in the main thread; on the signal the thread runs
    ``on_stop`` and ends the process as the signal would have. The thread reads
    :func:`signal.set_wakeup_fd`'s pipe, so it acts even while the main thread is blocked
    inside a collective or an RPC call, where a Python signal handler would not run.

    Watches nest: while one armed inside another holds the pipe, the signal reaches it
    alone, so it runs the outer ones' ``on_stop`` after its own (innermost first; e.g.
    partial recovery's snapshot, then :mod:`hybridrec.train.terminate`'s line)."""

    _armed: ClassVar[list[SigtermWatch]] = []  # (the watches armed now, outermost first)

    def __init__(self) -> None:
        self._watcher: threading.Thread | None = None
        self._old: tuple | None = None  # (SIGTERM handler, wakeup fd) to put back
        self._pipe: tuple[int, int] | None = None
        self._on_stop = None

    def start(self, on_stop) -> None:
        if threading.current_thread() is not threading.main_thread() or self._old is not None:
            return  # (signals reach the main thread's process only; its error path records the step)
        r, w = os.pipe()
        os.set_blocking(w, False)
        try:
            old_fd = signal.set_wakeup_fd(w, warn_on_full_buffer=False)
            old_handler = signal.signal(signal.SIGTERM, _ignore)  # (the watcher acts on it)
        except (ValueError, OSError):
            os.close(r)
            os.close(w)
            return
        self._pipe, self._old, self._on_stop = (r, w), (old_handler, old_fd), on_stop
        outer = [w._on_stop for w in reversed(SigtermWatch._armed)]
        SigtermWatch._armed.append(self)
        self._watcher = threading.Thread(target=self._watch, args=(r, on_stop, outer), name="hybridrec-recovery",
                                         daemon=True)
        self._watcher.start()

    def stop(self) -> None:
        """Put SIGTERM's handling back."""
        if self._old is None:
            return
        handler, fd = self._old
        with contextlib.suppress(ValueError, OSError):
            signal.signal(signal.SIGTERM, handler)
            signal.set_wakeup_fd(fd)
        self._old = None
        with contextlib.suppress(ValueError):
            SigtermWatch._armed.remove(self)
        r, w = self._pipe
        os.close(w)  # the watcher's read ends (EOF) ...
        if self._watcher is not None:
            self._watcher.join(timeout=5)
        os.close(r)  # ... before its end of the pipe closes

    @staticmethod
    def _watch(fd: int, on_stop, outer: list) -> None:
        while True:
            try:
                data = os.read(fd, 64)
            except OSError:
                return
            if not data:
                return
            if signal.SIGTERM in data:
                on_stop()
                for then in outer:
                    with contextlib.suppress(Exception):
                        then()
                # End as the agent's SIGTERM would have (its status, 128 + 15). Not by
                # signalling this process again: from this thread SIGTERM's handler cannot be
                # put back, and the main thread would go on (training to its next
                # collective, or waiting to be stopped, see cli.launch.rank_main).
                with contextlib.suppress(OSError, ValueError):
                    sys.stdout.flush()
                    sys.stderr.flush()
                os._exit(128 + signal.SIGTERM)


_park = threading.Event()  # set by park_main: the main thread stops in SIGTERM's handler
_parked = threading.Event()


def park_main(timeout_s: float = 2.0) -> bool:
    """From a :class:`SigtermWatch`'s ``on_stop``: have the main thread wait in SIGTERM's
    handler until the process ends, so that it makes nothing more (a save's directory)
    while ``on_stop`` cleans up. Returns whether it got there within ``timeout_s`` (a main
    thread inside a collective or a long C call does not, and makes nothing meanwhile)."""
    _park.set()
    with contextlib.suppress(ValueError, OSError):
        signal.pthread_kill(threading.main_thread().ident, signal.SIGTERM)
    return _parked.wait(timeout_s)


def _ignore(signum, frame) -> None:
    """SIGTERM's Python-level handler: nothing; the recovery thread acts on it (the byte
    :func:`signal.set_wakeup_fd` writes), after the step's update. Once :func:`park_main`
    asked, the main thread waits here for the process to end."""
    if _park.is_set():
        _parked.set()
        threading.Event().wait()
