"""Fault injection (``train.inject_failure=RANK:STEP[,RANK:STEP...]``): rank RANK kills
itself with SIGKILL right after it finishes step STEP, each entry once per run directory.

One entry (``1:100``) is one failure; a schedule (``1:100,0:250,1:400``, steps strictly
increasing) is several in one run, e.g. an emulated failure trace carried through by the
launcher's ``dist.max_restarts`` (benchmarks/failure_schedule.py). Just before a kill the
rank writes ``RUN/failure_injected.json`` (written atomically and fsynced, so it is either
complete or absent): the last injection at the top level (rank, step, pid, spec, time: what
the launcher reads to name the kill as injected) and every injection done so far under
``injected``. A run of the same directory started again (by hand, or by the launcher's
``dist.max_restarts``) finds the entries done there and does not kill for them again; it
resumes from the last checkpoint and goes on to the next entry of the schedule, or
completes. The marker is the only record: checkpoints cannot hold it, since the step being
killed is never saved. An entry the marker does not record injects (another ``RANK:STEP``
injects again); ``train.resume=false`` deletes the marker with the rest of the old run.
An entry whose step the resumed run never trains (it resumed past it) does not fire.

The kill comes before anything else of that step (logging, evaluation, its checkpoint), so
the steps since the last checkpoint are lost, as in a real crash. Nor does it wait for work
of earlier steps still running in the background: a shard delta being written
(``train.shard_delta_every``) is cut off as a crash would cut it, and the recovery uses the
rank's newest complete delta (a delta is renamed into place only when whole; the restart
deletes the cut-off one). So which delta a failed rank holds can depend on the machine's
load; the recovery's record says which it was. With parameter servers,
RANK is a trainer's rank, or ``psJ`` for server J: it kills itself once every trainer's
push of step STEP has reached it (and been applied), before it answers anything else.
"""

from __future__ import annotations

import datetime
import json
import os
import signal
import sys
import time
from pathlib import Path

from hybridrec.errors import ConfigError

MARKER = "failure_injected.json"
"""In the run directory: the injections that happened: the last one at the top level
(``{"rank", "step", "pid", "spec", "at", "time"}``) and all of them, oldest first, under
``"injected"`` (a list of ``{"rank", "step", "pid", "at", "time"}``; ``at``: local time,
ISO 8601; ``time``: Unix seconds, for measuring how long the restart took)."""

_EXPECTED = ("expected RANK:STEP or a schedule RANK:STEP,RANK:STEP,... with increasing steps, e.g. "
             "1:100 (rank 1 kills itself after step 100) or 1:100,0:250, or psJ:STEP for parameter "
             "server J; empty = off")


def elastic_restarts() -> int:
    """How many times the launcher's agent has started the ranks again after a failure
    (``dist.max_restarts``)."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)


def parse_inject_failure(text: str) -> list[tuple[int | str, int]]:
    """``"RANK:STEP,RANK:STEP,..."`` -> ``[(rank, step), ...]`` (steps strictly
    increasing; RANK an int, or ``"psJ"`` for parameter server J); ``""`` -> ``[]`` (off).
    A bad value is a :class:`ConfigError` that names the bad entry and says what is
    expected."""
    text = text.strip()
    if not text:
        return []
    out: list[tuple[int, int]] = []
    for entry in text.split(","):
        entry = entry.strip()
        # One entry: the value names it; in a schedule, the entry too.
        where = repr(text) if entry == text else f"{text!r}, entry {entry!r}"
        rank_s, sep, step_s = entry.partition(":")
        try:
            if not sep:
                raise ValueError
            server = rank_s.strip().startswith("ps")
            rank, step = int(rank_s.strip()[2:] if server else rank_s), int(step_s)
        except ValueError:
            raise ConfigError(f"train.inject_failure {where}: {_EXPECTED}") from None
        if server and rank >= 0:
            rank = f"ps{rank}"
        elif rank < 0:
            raise ConfigError(f"train.inject_failure {where}: RANK must be >= 0, got {rank}")
        if step < 1:
            raise ConfigError(f"train.inject_failure {where}: STEP must be >= 1 (the step after which "
                              f"the rank dies), got {step}")
        if out and step <= out[-1][1]:
            raise ConfigError(f"train.inject_failure {text!r}: steps must increase strictly (one "
                              f"failure at a time), but entry {entry!r} (step {step}) follows step "
                              f"{out[-1][1]}")
        out.append((rank, step))
    return out


def read_marker(run_dir: str | Path) -> dict | None:
    """The injections recorded in ``run_dir`` (None: none, or an unreadable file); the
    top level is the last one (see :data:`MARKER`)."""
    try:
        data = json.loads((Path(run_dir) / MARKER).read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def injections(marker: dict | None) -> list[dict]:
    """Every injection a marker records, oldest first: its ``injected`` list, or for a
    marker written before schedules (one injection, no list) its top level."""
    if not marker:
        return []
    done = marker.get("injected")
    if isinstance(done, list):
        return [d for d in done if isinstance(d, dict)]
    return [marker] if "rank" in marker and "step" in marker else []


def last_injected_pid(run_dir: str | Path) -> int | None:
    """The pid the newest injection in ``run_dir`` killed (None: none recorded)."""
    done = injections(read_marker(run_dir))
    pid = done[-1].get("pid") if done else None
    return pid if isinstance(pid, int) else None


class FailureInjector:
    """Armed on rank RANK when ``run_dir``'s marker does not record one of this rank's
    entries of the schedule; :meth:`after_step` kills the process after such an entry's
    STEP. ``steps``: this rank's entries still to inject; ``step``: the first of them."""

    def __init__(self, spec: str, *, rank: int | str, run_dir: str | Path) -> None:
        """``rank``: a trainer's rank, or a parameter server's name (``"psJ"``)."""
        schedule = parse_inject_failure(spec)
        self.spec, self.rank, self.run_dir = spec, rank, Path(run_dir)
        done = {(d.get("rank"), d.get("step")) for d in injections(read_marker(self.run_dir))}
        # Entries injected once already: a restarted run goes on past them.
        self.steps = tuple(s for r, s in schedule if r == rank and (r, s) not in done)

    @property
    def step(self) -> int | None:
        return self.steps[0] if self.steps else None

    @property
    def armed(self) -> bool:
        return bool(self.steps)

    def after_step(self, step: int) -> None:
        if step not in self.steps:
            return
        from hybridrec.files import write_json_atomic

        path = self.run_dir / MARKER
        at = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
        this = {"rank": self.rank, "step": step, "pid": os.getpid(), "at": at, "time": time.time()}
        write_json_atomic(path, {**this, "spec": self.spec,
                                 "injected": [*injections(read_marker(self.run_dir)), this]})
        who = f"parameter server {self.rank}" if isinstance(self.rank, str) else f"rank {self.rank}"
        print(f"hybridrec: injecting a failure: {who} kills itself (SIGKILL) after step "
              f"{step} (train.inject_failure={self.spec}; recorded in {path})",
              file=sys.stderr, flush=True)
        sys.stdout.flush()
        os.kill(os.getpid(), signal.SIGKILL)
