"""What a run directory may be, which of its files are the run's, and what a run deletes.

A run directory holds one hybridrec run and nothing of anyone else's:

- **Whose it is.** A run takes a directory that is new, empty (a lock file aside) or
  already a hybridrec run, recognised by its config.json as hybridrec writes it (a JSON
  object of config sections, ``train.run_dir`` among them) or, before that is written, by
  its lock file as the run lock writes it (``{"hybridrec": VERSION, "pid": ...}``; runs
  before that key: exactly ``pid``, ``host``, ``since``): the lock file, which every run
  makes first, is the run's marker, and no other file is added. The root directory, the
  user's home directory and any other non-empty directory are refused in one line before
  anything is written (:func:`check_claim`, called by the run lock's
  :func:`~hybridrec.train.run_lock.take` before it creates the lock file).
- **No links.** The names a run writes (:data:`FILES`, :data:`DIRS`, the lock), and the
  entries of its checkpoints/, recovery/ and recovery/deltas/, must not be symbolic links: a
  run writes and deletes inside its own directory only, never through a link to somewhere
  else (:func:`link_problem`, checked when the run takes the directory; the lock and
  recovery.jsonl are also opened with ``O_NOFOLLOW``).
- **What starting over deletes.** ``train.resume=false`` deletes the names a run writes
  (but the lock) and nothing else: :func:`foreign` lists whatever else the directory holds
  (a file of another name, a ``checkpoints/x`` that is no hybridrec checkpoint, a report/
  file of another name), and :func:`check_start_over` refuses, in one line, deleting
  nothing, while there is any.
- **Killed saves.** A save writes ``NAME.tmp-PID`` / ``.tmp-NAME-PID`` and renames it into
  place when complete; :func:`remove_leftovers` removes those of processes that are gone
  (the next run, holding the lock) or of this process (a SIGTERM, see
  :mod:`hybridrec.train.terminate`).

Simplification: what is inside recovery/'s snapshots and a checkpoint's data files is not
checked name by name (the names at recovery/'s top level and the checkpoint directories'
files are); and ``flock`` and these checks are per machine, like the lock.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import stat
from pathlib import Path

from hybridrec.errors import ConfigError
from hybridrec.metrics.logger import METRICS_FILE, TENSORBOARD_DIR
from hybridrec.parallel.checkpoint_io import FORMAT, MANIFEST, remove_unfinished
from hybridrec.train.checkpointing.checkpoint_interval import CHOICE_FILE
from hybridrec.train.checkpointing.faults import MARKER as INJECTED_FILE
from hybridrec.train.setup.config import SECTIONS

LOCK = ".lock"
"""The run lock's file (:mod:`hybridrec.train.run_lock`), also the run's marker."""
CONFIG = "config.json"
CHECKPOINTS = "checkpoints"  # (hybridrec.train.checkpointing.checkpoint.checkpoint_dir)
RECOVERY = "recovery"  # (hybridrec.train.checkpointing.snapshots.RECOVERY_DIR)
REPORT = "report"  # (hybridrec.bench.report.REPORT_DIR)

FILES = (CONFIG, "summary.json", "eval.json", "plan.json", METRICS_FILE, INJECTED_FILE,
         "recovery.jsonl", CHOICE_FILE, "init_from.json")
"""The files a run writes at its top level (recovery.jsonl: lost_work.EVENTS; init_from.json:
init_from.RECORD; eval.json: ``hybridrec eval``'s default output)."""

DIRS = (CHECKPOINTS, RECOVERY, TENSORBOARD_DIR, REPORT)
"""The directories a run writes at its top level."""

_STEP = r"step-\d{8}"
_CHECKPOINT_ENTRY = re.compile(rf"^{_STEP}(\.bad(-\d+)?|\.tmp-\d+)?$")  # (checkpoint.BAD, TMP_MARK)
_CHECKPOINT_FILE = re.compile(r"^(\.metadata(\.tmp)?|manifest\.json|__\d+_\d+\.distcp)$")
_CHECKPOINT_PART = re.compile(r"^ps(\.tmp-\d+)?$")  # a parameter-server run's part (ps_run.PS_DIR)
_RECOVERY_ENTRY = re.compile(r"^((rank|ps)-\d+(\.json)?|\.tmp-.+|\.(rank|ps)-\d+\.json\..+\.tmp|deltas)$")
_REPORT_FILE = re.compile(r"^([A-Za-z0-9_]+\.svg|index\.html|\..+\.tmp)$")
_TENSORBOARD_FILE = re.compile(r"^events\.out\.tfevents\..+$")


def _atomic_leftover(name: str, names) -> bool:
    """A temporary file of :func:`~hybridrec.files.write_text_atomic` for one of
    ``names`` (``.summary.json.k2j3.tmp``), left by a process killed mid-write."""
    return name.startswith(".") and name.endswith(".tmp") and any(name.startswith(f".{n}.") for n in names)


# -- whose directory -------------------------------------------------------------------------
def check_claim(run_dir: str | Path, shown: str | None = None) -> None:
    """Refuse (:class:`ConfigError`, one line naming the directory and the way out) a run
    directory a run must not take: the root, the home directory, a non-empty directory that
    is not a hybridrec run, or a run whose names are symbolic links (a path that is not a
    directory is left to making it, whose error names it). Reads only; nothing is created."""
    run_dir = Path(run_dir)
    shown = shown or str(run_dir)
    real = os.path.realpath(run_dir)
    elsewhere = "name a new or empty directory (train.run_dir=DIR)"
    if real == os.path.realpath(os.sep):
        raise ConfigError(f"train.run_dir={shown} is the root directory: a run directory holds one run's "
                          f"files alone; {elsewhere}")
    home = os.environ.get("HOME") or os.path.expanduser("~")
    if home and home != os.sep and real == os.path.realpath(home):
        raise ConfigError(f"train.run_dir={shown} is the home directory: a run directory holds one run's "
                          f"files alone; {elsewhere}")
    if not run_dir.is_dir():  # (nothing there yet; or not a directory: making it says so)
        return
    others = _entries(run_dir) - {LOCK}
    if others and not is_run(run_dir):
        raise ConfigError(f"{shown} is not empty and is not a hybridrec run (it holds {_some(others)}): "
                          f"hybridrec writes and deletes files in its run directory; {elsewhere}")
    if (why := link_problem(run_dir)) is not None:
        fix = "remove the link" if why.startswith(LOCK) else "replace the link with what it points to"
        raise ConfigError(f"{_join(shown, why)}: a run writes only inside its own directory; {fix}, or {elsewhere}")


def is_run(run_dir: str | Path) -> bool:
    """Whether ``run_dir`` is a hybridrec run: a config.json as hybridrec writes it, or
    a lock file as the run lock writes it."""
    run_dir = Path(run_dir)
    data = _json(run_dir / CONFIG)
    if (isinstance(data, dict) and set(data) <= set(SECTIONS)
            and all(isinstance(data.get(s), dict) for s in ("model", "data", "train")) and "run_dir" in data["train"]):
        return True
    record = _json(run_dir / LOCK)
    return (isinstance(record, dict) and isinstance(record.get("pid"), int)
            and ("hybridrec" in record or set(record) == {"pid", "host", "since"}))


def _json(path: Path):
    """The JSON in the regular file ``path`` (None: none there, or not JSON)."""
    if not _regular(path):
        return None
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def link_problem(run_dir: str | Path) -> str | None:
    """The first of the run's names that is a symbolic link, as ``NAME is a symbolic link
    (to TARGET)`` relative to ``run_dir``; None when there is none. Looked at: the lock,
    :data:`FILES`, :data:`DIRS`, and the entries of checkpoints/, recovery/ and
    recovery/deltas/."""
    run_dir = Path(run_dir)
    names = [LOCK, *FILES, *DIRS]
    for sub in (CHECKPOINTS, RECOVERY, f"{RECOVERY}/deltas"):
        if _real_dir(run_dir / sub):
            names += [f"{sub}/{n}" for n in sorted(_entries(run_dir / sub))]
    for name in names:
        if (run_dir / name).is_symlink():
            return f"{name} is a symbolic link (to {os.readlink(run_dir / name)})"
    return None


# -- what starting over deletes ----------------------------------------------------------------
def foreign(run_dir: str | Path) -> list[str]:
    """What ``run_dir`` holds that a run did not write (paths relative to it, directories
    with a trailing ``/``), sorted; symbolic links among the run's names count too."""
    run_dir = Path(run_dir)
    if not _real_dir(run_dir):
        return []
    out = []
    for name in sorted(_entries(run_dir)):
        p = run_dir / name
        if p.is_symlink():
            out.append(name)
        elif (name == LOCK and _regular(p)) or (name in FILES and _regular(p)) or _atomic_leftover(name, FILES):
            continue
        elif name in DIRS and _real_dir(p):
            out += [f"{name}/{x}" for x in _foreign_in(name, p)]
        else:
            out.append(name + ("/" if p.is_dir() else ""))
    return out


def _foreign_in(name: str, d: Path) -> list[str]:
    """The entries of the run's directory ``d`` (``name``: which) that are not the run's."""
    out = []
    for entry in sorted(_entries(d)):
        p = d / entry
        if p.is_symlink():
            out.append(entry)
        elif name == CHECKPOINTS:
            if not (_CHECKPOINT_ENTRY.match(entry) and _real_dir(p)):
                out.append(entry + ("/" if p.is_dir() else ""))
            elif not _hybridrec_checkpoint(p):
                out += [f"{entry}/{x}" for x in _checkpoint_foreign(p)]
        elif name == RECOVERY:
            if not _RECOVERY_ENTRY.match(entry):
                out.append(entry + ("/" if p.is_dir() else ""))
        elif name == REPORT:
            if not (_REPORT_FILE.match(entry) and _regular(p)):
                out.append(entry + ("/" if p.is_dir() else ""))
        elif name == TENSORBOARD_DIR and not (_TENSORBOARD_FILE.match(entry) and _regular(p)):
            out.append(entry + ("/" if p.is_dir() else ""))
    return out


def _hybridrec_checkpoint(p: Path) -> bool:
    """A checkpoint directory whose manifest says it is hybridrec's."""
    try:
        meta = json.loads((p / MANIFEST).read_text())
    except (OSError, ValueError):
        return False
    return isinstance(meta, dict) and meta.get("format") == FORMAT


def _checkpoint_foreign(d: Path) -> list[str]:
    """The files of an unpublished or incomplete checkpoint directory that no save writes."""
    out = []
    for entry in sorted(_entries(d)):
        p = d / entry
        if p.is_symlink():
            out.append(entry)
        elif _real_dir(p) and _CHECKPOINT_PART.match(entry):
            out += [f"{entry}/{x}" for x in _checkpoint_foreign(p)]
        elif not (_regular(p) and (_CHECKPOINT_FILE.match(entry) or _atomic_leftover(entry, [MANIFEST]))):
            out.append(entry + ("/" if p.is_dir() else ""))
    return out


def check_start_over(run_dir: str | Path, shown: str | None = None) -> None:
    """``train.resume=false`` deletes the run's own files only: refuse (:class:`ConfigError`,
    one line, nothing deleted) while ``run_dir`` holds anything else."""
    if found := foreign(run_dir):
        raise ConfigError(f"{shown or run_dir} holds what no hybridrec run wrote ({_some(found)}): "
                          "train.resume=false deletes only the run's own files; move those out of it, or "
                          "train another run in a new directory (train.run_dir=DIR)")


def clear(run_dir: str | Path) -> None:
    """Delete the run's own files (:data:`FILES`, :data:`DIRS` and what an interrupted
    atomic write left), keeping the lock; :func:`check_start_over` first.
    No link is followed (:func:`foreign` refused any)."""
    run_dir = Path(run_dir)
    for name in DIRS:
        if _real_dir(run_dir / name):
            shutil.rmtree(run_dir / name)
    for name in _entries(run_dir):
        if name in FILES or _atomic_leftover(name, FILES):
            with contextlib.suppress(FileNotFoundError):
                (run_dir / name).unlink()


# -- killed saves ---------------------------------------------------------------------------
def save_dirs(run_dir: str | Path) -> list[Path]:
    """Where saves write their ``*.tmp-PID`` directories: checkpoints/, recovery/ (the
    snapshots) and each rank's recovery/deltas/rank-R/."""
    run_dir = Path(run_dir)
    deltas = run_dir / RECOVERY / "deltas"
    ranks = sorted(p for p in deltas.glob("rank-*") if _real_dir(p)) if _real_dir(deltas) else []
    return [d for d in (run_dir / CHECKPOINTS, run_dir / RECOVERY) if _real_dir(d)] + ranks


def remove_leftovers(run_dir: str | Path, *, pid: int | None = None) -> list[Path]:
    """Remove unfinished saves in the run directory: this process's (``pid``, at a SIGTERM)
    or those of processes that are gone (None: when a run starts, with the lock held). See
    :func:`~hybridrec.parallel.checkpoint_io.remove_unfinished`."""
    return [p for d in save_dirs(run_dir) for p in remove_unfinished(d, pid=pid)]


# -- helpers ------------------------------------------------------------------------------------
def _entries(d: Path) -> set[str]:
    try:
        return set(os.listdir(d))
    except OSError:
        return set()


def _regular(p: Path) -> bool:
    try:
        return stat.S_ISREG(os.lstat(p).st_mode)
    except OSError:
        return False


def _real_dir(p: Path) -> bool:
    try:
        return stat.S_ISDIR(os.lstat(p).st_mode)
    except OSError:
        return False


def _join(shown: str, relative: str) -> str:
    return f"{shown.rstrip(os.sep)}{os.sep}{relative}"


def _some(names, shown: int = 3) -> str:
    """``a, b, c and 4 more``."""
    names = sorted(names)
    head = ", ".join(names[:shown])
    return head + (f" and {len(names) - shown} more" if len(names) > shown else "")
