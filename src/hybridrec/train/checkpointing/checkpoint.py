"""Checkpoint directories of a run: ``RUN/checkpoints/step-00001234/``.

Each is a torch.distributed.checkpoint directory written by
:class:`hybridrec.train.checkpointing.checkpointer.Checkpointer` (one process or many), renamed into
place only when complete; a crash mid-write never leaves a directory that looks like a
checkpoint (:func:`hybridrec.parallel.checkpoint_io.is_complete`).

Integrity: :func:`problem` checks a checkpoint's files without loading a tensor (manifest,
DCP's index, every data file present and as long as the index says, and the CRC-32 of every
file against the manifest's, :mod:`hybridrec.parallel.checkpoint_io`); :func:`load_newest`
loads the newest checkpoint that passes those checks and loads, every rank agreeing, and
names the ones it skipped: a flipped byte, a missing ``.metadata`` or a truncated file are
skipped alike. A resumed run renames those aside (``step-N.bad``: no longer a
checkpoint to list, prune or resume, but kept for inspection); nothing is ever deleted
because it failed to load.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TypeVar

from hybridrec.errors import os_error_message
from hybridrec.parallel.checkpoint_io import (
    CHECKSUMS,
    FORMAT,
    MANIFEST,
    CheckpointError,
    SafeFileSystemReader,
    checksum_problem,
    gather,
    is_complete,
    relative_cause,
)
from hybridrec.parallel.topology import Topology

T = TypeVar("T")
LOADING = "loading the checkpoint failed"
BAD = ".bad"
PS_PART = "ps"  # a parameter-server run's own checkpoint inside step-N/ (train/ps_run.py: PS_DIR)

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


def resume_candidates(run_dir: str | Path) -> list[Path]:
    """Every ``step-N`` directory, newest first, complete or not: a save publishes a
    directory under that name only once it is complete, so one without ``.metadata`` or its
    manifest lost them since. A resume checks it like any other (:func:`load_newest`) and
    sets it aside, instead of passing over it and then overwriting it with the next save of
    its step."""
    d = checkpoint_dir(run_dir)
    if not d.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in d.iterdir() if (m := _NAME.match(p.name)) and p.is_dir()]
    return [p for _, p in sorted(found, reverse=True)]


def latest_checkpoint(run_dir: str | Path) -> Path | None:
    found = list_checkpoints(run_dir)
    return found[-1][1] if found else None


# -- integrity -------------------------------------------------------------------------------
def problem(path: str | Path, *, share: tuple[int, int] | None = (0, 1)) -> str | None:
    """What is wrong with the files of the checkpoint ``path`` (None: nothing found), read
    without loading a tensor: a complete directory, a manifest of this format, DCP's index
    readable by the safe reader, every file the index names present and at least as long
    as the index says (a truncated file), then the checksums the manifest records
    (:func:`~hybridrec.parallel.checkpoint_io.checksum_problem`: the manifest's own, every
    file's size, and the contents of ``share``, ``(rank, ranks)``: this rank's share of the
    files; None reads no file, for listing a run's checkpoints). The words name the file,
    relative to ``path`` (``__0_0.distcp: truncated (1,000 of 9,876 bytes)``,
    ``__0_0.distcp: corrupt (crc32 ...)``); a parameter-server run's ``ps/`` part is
    checked alike."""
    path = Path(path)
    try:
        if (why := _files_problem(path, share)) is not None:
            return why
    except CheckpointError as e:
        return relative_cause(str(e), path)
    except OSError as e:
        return relative_cause(os_error_message(e), path)
    if (path / PS_PART).is_dir() and (why := problem(path / PS_PART, share=share)) is not None:
        return f"{PS_PART}/{why}"
    return None


def _files_problem(path: Path, share: tuple[int, int] | None) -> str | None:
    """:func:`problem` of this directory's own files (raises CheckpointError, OSError)."""
    if not path.is_dir():
        os.listdir(path)  # the file system's words: No such file, Not a directory
    if not is_complete(path):
        missing = [n for n in (".metadata", MANIFEST) if not (path / n).is_file()]
        return f"not a complete checkpoint (no {' or '.join(missing)})"
    try:
        meta = json.loads((path / MANIFEST).read_text())
    except ValueError as e:
        return f"{MANIFEST}: unreadable ({e})"
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        found = meta.get("format") if isinstance(meta, dict) else None
        return f"{MANIFEST}: format {found!r}, expected {FORMAT!r}"
    md = SafeFileSystemReader(path).read_metadata()
    needed: dict[str, int] = {}
    for info in md.storage_data.values():
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    for name, size in sorted(needed.items()):
        f = path / name
        if not f.is_file():
            return f"{name}: missing"
        if (have := f.stat().st_size) < size:
            return f"{name}: truncated ({have:,} of {size:,} bytes)"
    if (why := checksum_problem(path, meta, share)) is not None:
        return why
    listed = (meta.get(CHECKSUMS) or {}).get("files")
    unlisted = sorted(set(needed) - set(listed)) if listed is not None else []
    return f"{unlisted[0]}: not among the files the manifest's checksums cover" if unlisted else None


def latest_sound(run_dir: str | Path) -> Path | None:
    """The newest checkpoint whose files pass :func:`problem` without reading their
    contents (None: there is none); what it is read for is its manifest. A load reads
    them (:func:`load_newest`)."""
    for _, path in reversed(list_checkpoints(run_dir)):
        if problem(path, share=None) is None:
            return path
    return None


def load_newest(candidates: list[Path], load: Callable[[Path], T], topo: Topology) -> tuple[Path, T, list[tuple[Path, str]]]:
    """Collective: ``load`` the first of ``candidates`` (newest first) that passes
    :func:`problem` on every rank and loads; returns ``(path, what load returned,
    [(skipped path, why), ...])``. The candidates are rank 0's list, and a checkpoint is
    skipped when any rank finds a problem or ``load`` raises a :class:`CheckpointError`
    that every rank raised (:func:`hybridrec.parallel.checkpoint_io.agree`), so every rank
    loads the same one. When none loads: one :class:`CheckpointError`, the newest one's
    ``PATH: loading the checkpoint failed: WHY``, then why each older one failed."""
    candidates = [Path(p) for p in gather(topo, [str(p) for p in candidates])[0]]
    skipped: list[tuple[Path, str]] = []
    for path in candidates:  # (each rank reads its share of the files' contents)
        found = [w for w in gather(topo, problem(path, share=(topo.rank, topo.group_size))) if w is not None]
        why = found[0] if found else None
        if why is None:
            try:
                return path, load(path), skipped
            except CheckpointError as e:
                if topo.group_size > 1 and not getattr(e, "same_on_every_rank", False):
                    raise
                why = relative_cause(_cause(str(e), path), path)
        skipped.append((path, why))
    if not skipped:
        raise CheckpointError("no checkpoint to load")
    (first, why), older = skipped[0], skipped[1:]
    text = f"{first}: {LOADING}: {why}"
    if older:
        text += "; no older checkpoint loads either: " + "; ".join(f"{p.name}: {w}" for p, w in older)
    err = CheckpointError(text)
    err.same_on_every_rank = True
    raise err


def _cause(message: str, path: Path) -> str:
    """``PATH: loading the checkpoint failed: WHY`` -> ``WHY``."""
    for head in (f"{path}: {LOADING}: ", f"{path}: {LOADING} "):
        if message.startswith(head):
            return message[len(head):]
    return message


def set_aside(path: str | Path) -> Path:
    """Rename the checkpoint ``path`` to ``step-N.bad`` (``.bad-2``, ... when taken): no
    longer listed, pruned or resumed, but kept. Returns the new path (OSError: it stays)."""
    path = Path(path)
    for i in range(1, 1000):
        dest = path.with_name(f"{path.name}{BAD}" + (f"-{i}" if i > 1 else ""))
        if not dest.exists():
            os.replace(path, dest)
            return dest
    raise FileExistsError(f"{path}{BAD}: too many checkpoints set aside")
