"""Checkpoint directories of a run: ``RUN/checkpoints/step-00001234/``.

Each is a torch.distributed.checkpoint directory written by
:class:`hybridrec.train.checkpointer.Checkpointer` (one process or many), renamed into
place only when complete; a crash mid-write never leaves a directory that looks like a
checkpoint (:func:`hybridrec.parallel.checkpoint_io.is_complete`).
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

from hybridrec.parallel.checkpoint_io import is_complete

_NAME = re.compile(r"^step-(\d{8})$")


def checkpoint_dir(run_dir: str | Path) -> Path:
    return Path(run_dir) / "checkpoints"


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


def prune(run_dir: str | Path, *, keep: int) -> None:
    """Delete all but the newest ``keep`` checkpoints."""
    for _, old in list_checkpoints(run_dir)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)


def latest_checkpoint(run_dir: str | Path) -> Path | None:
    found = list_checkpoints(run_dir)
    return found[-1][1] if found else None
