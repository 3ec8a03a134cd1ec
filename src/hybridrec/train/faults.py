"""Fault injection (``train.inject_failure=RANK:STEP``): rank RANK kills itself with
SIGKILL right after it finishes step STEP, once per run directory.

Just before the kill the rank writes ``RUN/failure_injected.json`` (rank, step, pid, time;
written atomically and fsynced, so it is either complete or absent). A run of the same
directory started again (by hand, or by the launcher's ``dist.max_restarts``) finds it and
does not kill again, so it resumes from the last checkpoint and completes. The marker is
the only record: checkpoints cannot hold it, since the step being killed is never saved.
Another ``RANK:STEP`` injects again (the marker then names the new one);
``train.resume=false`` deletes it with the rest of the old run.

The kill comes before anything else of that step (logging, evaluation, its checkpoint), so
the steps since the last checkpoint are lost, as in a real crash. With parameter servers,
RANK is a trainer's rank (servers run no steps).
"""

from __future__ import annotations

import datetime
import json
import os
import signal
import sys
from pathlib import Path

from hybridrec.errors import ConfigError

MARKER = "failure_injected.json"
"""In the run directory: the injection that happened (``{"rank", "step", "pid", "at"}``)."""


def parse_inject_failure(text: str) -> tuple[int, int] | None:
    """``"RANK:STEP"`` -> ``(rank, step)``; ``""`` -> None (off). A bad value is a
    :class:`ConfigError` that says what is expected."""
    text = text.strip()
    if not text:
        return None
    rank_s, sep, step_s = text.partition(":")
    try:
        if not sep:
            raise ValueError
        rank, step = int(rank_s), int(step_s)
    except ValueError:
        raise ConfigError(f"train.inject_failure {text!r}: expected RANK:STEP, e.g. 1:100 "
                          f"(rank 1 kills itself after step 100; empty = off)") from None
    if rank < 0:
        raise ConfigError(f"train.inject_failure {text!r}: RANK must be >= 0, got {rank}")
    if step < 1:
        raise ConfigError(f"train.inject_failure {text!r}: STEP must be >= 1 (the step after which "
                          f"the rank dies), got {step}")
    return rank, step


def injection_problem(spec: str, world_size: int) -> str | None:
    """Why ``train.inject_failure`` cannot run with ``world_size`` (trainer) ranks, or None."""
    parsed = parse_inject_failure(spec)
    if parsed is not None and parsed[0] >= world_size:
        return (f"train.inject_failure={spec}: rank {parsed[0]} does not exist: this run has "
                f"{world_size} rank{'s' if world_size != 1 else ''} (0..{world_size - 1})")
    return None


def read_marker(run_dir: str | Path) -> dict | None:
    """The injection recorded in ``run_dir`` (None: none, or an unreadable file)."""
    try:
        data = json.loads((Path(run_dir) / MARKER).read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


class FailureInjector:
    """Armed on rank RANK when ``run_dir`` has no record of this ``RANK:STEP``;
    :meth:`after_step` kills the process after step STEP."""

    def __init__(self, spec: str, *, rank: int, run_dir: str | Path) -> None:
        parsed = parse_inject_failure(spec)
        self.spec, self.run_dir = spec, Path(run_dir)
        self.step: int | None = None
        if parsed is None or parsed[0] != rank:
            return
        done = read_marker(self.run_dir)
        if done is not None and (done.get("rank"), done.get("step")) == parsed:
            return  # injected once already: a restarted run goes on
        self.rank, self.step = parsed

    @property
    def armed(self) -> bool:
        return self.step is not None

    def after_step(self, step: int) -> None:
        if self.step is None or step != self.step:
            return
        from hybridrec.metrics.logger import write_json_atomic

        write_json_atomic(self.run_dir / MARKER, {
            "rank": self.rank, "step": step, "pid": os.getpid(), "spec": self.spec,
            "at": datetime.datetime.now().astimezone().isoformat(timespec="seconds")})
        print(f"hybridrec: injecting a failure: rank {self.rank} kills itself (SIGKILL) after step "
              f"{step} (train.inject_failure={self.spec}; recorded in {self.run_dir / MARKER})",
              file=sys.stderr, flush=True)
        sys.stdout.flush()
        os.kill(os.getpid(), signal.SIGKILL)
