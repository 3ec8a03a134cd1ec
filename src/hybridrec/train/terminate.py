"""A SIGTERM to a training: one line, no unfinished save left behind, exit status 143.

``kill PID`` of ``hybridrec train`` (or a scheduler's stop, ``timeout``): the process
removes the directories of the saves it was writing (a checkpoint's ``step-N.tmp-PID``:
:func:`~hybridrec.parallel.checkpoint_io.stop_saves`, which also keeps any save from making
or publishing one from then on; a snapshot's or a shard delta's ``.tmp-...-PID``:
:func:`hybridrec.train.run_files.remove_leftovers`), says in one line where the run stands
and how to go on (:func:`line`), and exits with 128 + 15, the status the signal gives. It
acts from a thread (:class:`~hybridrec.train.checkpointing.sigterm.SigtermWatch`), so also
while the main thread is inside a save or a collective, where a Python signal handler
would wait.

Who says the line: the process the user started (one process; rank 0 under torchrun).
Under hybridrec's own launcher the ranks stay quiet (its agent stops them with SIGTERM
after any rank's failure too) and the launcher says it once for the run, after its ranks
ended (without the step, which only the ranks know).

The main thread is stopped first (:func:`~hybridrec.train.checkpointing.sigterm.park_main`:
it waits in SIGTERM's handler), so that the save it was writing does not make its
directory again once removed. Simplification: a background save's writer thread
(``train.async_checkpoint``) is not stopped, and may make it again before the process
ends; the next start of the run removes what a process that is gone left
(``remove_leftovers``, with the lock held).
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
from collections.abc import Iterator
from pathlib import Path

from hybridrec.parallel.checkpoint_io import stop_saves
from hybridrec.train import run_files
from hybridrec.train.checkpointing import checkpoint as ckpt
from hybridrec.train.checkpointing.sigterm import SigtermWatch, park_main


class Terminating:
    """What the SIGTERM line needs: the run, and the trainer once there is one (its step)."""

    def __init__(self, run_dir: Path, shown: str, *, say: bool, resume: bool) -> None:
        self.run_dir, self.shown, self.say, self.resume = run_dir, shown, say, resume
        self.trainer = None

    def stop(self) -> None:
        """At the signal (in the watching thread): no save goes on, this process's unfinished
        saves go, then the line (the process ends right after)."""
        stop_saves()  # (waits for a checkpoint being published: the line names it)
        park_main()  # (a save of the main thread's may have made its directory again since)
        text = line(self.run_dir, self.shown, step=getattr(self.trainer, "step", None), resume=self.resume)
        stop_saves()  # (again, now that the main thread writes nothing)
        run_files.remove_leftovers(self.run_dir, pid=os.getpid())  # (snapshots', deltas')
        if self.say:
            print(text, file=sys.stderr, flush=True)


def line(run_dir: str | Path, shown: str | None = None, *, step: int | None = None, resume: bool = True) -> str:
    """``hybridrec: terminated at step 37; the newest checkpoint is RUN/checkpoints/step-00000036
    (step 36); run the same command to resume``."""
    shown = shown or str(run_dir)
    at = f" at step {step:,}" if step is not None else ""
    again = "run the same command" if resume else "run the same command without train.resume=false"
    newest = ckpt.latest_checkpoint(run_dir)
    if newest is None:
        return f"hybridrec: terminated{at}; {shown} has no checkpoint yet: {again} to start it again"
    where = os.path.join(shown, ckpt.checkpoint_dir("").name, newest.name)
    return f"hybridrec: terminated{at}; the newest checkpoint is {where} (step {int(newest.name[5:]):,}); {again} to resume"


@contextlib.contextmanager
def on_sigterm(run_dir: str | Path, shown: str, *, say: bool, resume: bool) -> Iterator[Terminating]:
    """While the block runs, SIGTERM ends the process as the module docstring says (set
    ``.trainer`` on what it yields for the step). Only where SIGTERM has its default action
    and in the main thread: a program that handles SIGTERM itself keeps its handling."""
    state = Terminating(Path(run_dir), shown, say=say, resume=resume)
    watch = SigtermWatch()
    if signal.getsignal(signal.SIGTERM) in (signal.SIG_DFL, None):
        watch.start(state.stop)  # (does nothing outside the main thread)
    try:
        yield state
    finally:
        watch.stop()
