"""This process's place among the ranks of a launch, as its launcher's environment says it:
the one place ``WORLD_SIZE``, ``RANK``, ``LOCAL_WORLD_SIZE`` and ``LOCAL_RANK`` are read.

torchrun and hybridrec's own launcher (:mod:`hybridrec.cli.launch`, through torch's elastic
agent) set them for every rank; a process started alone has none of them and is rank 0 of
1. A variable that is unset, empty or not a whole number reads as its default (a malformed
one makes torch's own process-group start-up fail, with its message). Imports nothing but
``os``: the command line's error handling reads it too.
"""

from __future__ import annotations

import os


def _read(name: str, default: int) -> int:
    value = os.environ.get(name, "").strip()
    return int(value) if value.isdecimal() else default


def started_as_rank() -> bool:
    """Whether a launcher started this process as one rank of a job (``RANK`` is set),
    rather than a user as the command itself."""
    return "RANK" in os.environ


def world_size() -> int:
    """Every process of the job (``WORLD_SIZE``; 1 when alone)."""
    return _read("WORLD_SIZE", 1)


def rank() -> int:
    """This process's rank in the job (``RANK``; 0 when alone)."""
    return _read("RANK", 0)


def local_world_size(default: int | None = None) -> int:
    """The job's processes on this machine (``LOCAL_WORLD_SIZE``); without it ``default``,
    else :func:`world_size` (every process on this one machine)."""
    return _read("LOCAL_WORLD_SIZE", world_size() if default is None else default)


def local_rank() -> int:
    """This process's rank among those of its machine (``LOCAL_RANK``; 0 when alone)."""
    return _read("LOCAL_RANK", 0)
