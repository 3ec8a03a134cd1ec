"""Checkpoint directories of a run: ``RUN/checkpoints/step-00001234/``.

Each is a torch.distributed.checkpoint directory written by
:class:`hybridrec.train.checkpointer.Checkpointer` (one process or many), renamed into
place only when complete; a crash mid-write never leaves a directory that looks like a
checkpoint (:func:`hybridrec.parallel.checkpoint_io.is_complete`).
"""

from __future__ import annotations

import re
import shutil
from collections.abc import Iterable
from pathlib import Path

from hybridrec.parallel.checkpoint_io import is_complete

_NAME = re.compile(r"^step-(\d{8})$")


def checkpoint_dir(run_dir: str | Path) -> Path:
    return Path(run_dir) / "checkpoints"


def step_dir(run_dir: str | Path, step: int) -> Path:
    """Where the checkpoint of ``step`` goes: ``RUN/checkpoints/step-00001234``."""
    return checkpoint_dir(run_dir) / f"step-{step:08d}"


def list_checkpoints(run_dir: str | Path) -> list[tuple[int, Path]]:
    """Complete checkpoints, oldest first."""
    d = checkpoint_dir(run_dir)
    if not d.is_dir():
        return []
    found = []
    for p in d.iterdir():
        m = _NAME.match(p.name)
        if m and is_complete(p):
            found.append((int(m.group(1)), p))
    return sorted(found)


def prune(run_dir: str | Path, *, keep: int, keep_also: Iterable[int] = ()) -> None:
    """Delete all but the newest ``keep`` checkpoints and those of the steps in
    ``keep_also`` (e.g. the best one of early stopping)."""
    pinned = set(keep_also)
    for step, old in list_checkpoints(run_dir)[:-keep]:
        if step not in pinned:
            shutil.rmtree(old, ignore_errors=True)


def latest_checkpoint(run_dir: str | Path) -> Path | None:
    found = list_checkpoints(run_dir)
    return found[-1][1] if found else None
