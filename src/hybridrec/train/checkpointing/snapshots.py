"""The survivors' snapshot store of partial recovery: where a rank's (or a parameter
server's) snapshot and its record of the run's stop go, how a snapshot is written, checked,
read and cleared (:mod:`hybridrec.train.checkpointing.recovery` for a rank's side,
:mod:`hybridrec.train.checkpointing.server_recovery` for a server's).

- ``RUN/recovery/rank-R/`` (``ps-J/`` a server's): a torch.distributed.checkpoint
  directory written by one process alone, with a manifest (``format``, ``kind``, what wrote
  it, the state's JSON skeleton); written beside it and renamed into place
  (:func:`save_snapshot`). Then ``RUN/recovery/rank-R.json`` (:func:`progress_file`) says
  which step it holds and where (written last: a snapshot without it is not used).
- Under the local launcher the snapshots go to a directory of ``/dev/shm`` named for the
  run instead (:func:`fast_snapshots`), this user's alone (:func:`private_dir`); what is
  left there when the launch ends moves into ``RUN/recovery/``.
- A snapshot is not synced to disk: its record holds the kernel's boot id
  (:func:`boot_id`), and one written before the machine restarted is not used
  (:func:`check_snapshot_dir`).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import stat
import sys
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException as DCPException

from hybridrec.errors import os_error_message
from hybridrec.parallel.checkpoint_io import (
    FORMAT,
    MANIFEST,
    CheckpointError,
    SafeFileSystemReader,
    decode_skeleton,
    describe,
    is_complete,
    quiet,
    tensor_slots,
    write_json,
)
from hybridrec.parallel.checkpoint_layout import own_storage

RECOVERY_DIR = "recovery"
RESIDENT_DIR = "resident"  # (in a snapshot: its shards' files, see hybridrec.train.checkpointing.resident)
SHM = Path("/dev/shm")
SNAPSHOT_KIND = "survivor-snapshot"
BOOT_ID = Path("/proc/sys/kernel/random/boot_id")


def recovery_dir(run_dir: str | Path) -> Path:
    return Path(run_dir) / RECOVERY_DIR


def progress_file(run_dir: Path, rank: int, role: str = "rank") -> Path:
    """``role``: ``rank`` (a trainer) or ``ps`` (a parameter server: ``rank`` its index)."""
    return recovery_dir(run_dir) / f"{role}-{rank:05d}.json"


def _snapshot_dir(run_dir: Path, rank: int, role: str = "rank") -> Path:
    return recovery_dir(run_dir) / f"{role}-{rank:05d}"


def usable_fast_dir(d: str | Path | None) -> Path | None:
    """The launcher's directory for snapshots on local memory, handed to every rank on its
    command line (``hybridrec train --snapshot-dir``; :func:`fast_snapshots`): ``d`` when it
    is this user's alone, else None (not launched so, or :func:`not_private` finds a
    problem, which the launcher said once): the snapshots stay in ``RUN/recovery/``."""
    return Path(d) if d and not_private(Path(d)) is None else None


def private_dir(d: Path) -> str | None:
    """Make ``d``, a directory of a file system every user may write (``/dev/shm``), this
    user's alone: created with mode 0700, or, when it exists, taken only if
    :func:`not_private` finds nothing. Returns why it cannot be used (None: it can)."""
    try:
        d.mkdir(mode=0o700)  # (the umask can only take bits away)
    except FileExistsError:
        pass
    except OSError as e:
        return os_error_message(e)
    return not_private(d)


def not_private(d: Path) -> str | None:
    """Why the directory ``d`` is not this user's alone (None: it is): a symlink or not a
    directory, another owner, or open to others (a mode other than 0700): another user
    could rename or replace the run's live files in it. The path itself is examined
    (``lstat``), not what a link points to."""
    try:
        st = os.lstat(d)
    except OSError as e:
        return os_error_message(e)
    if stat.S_ISLNK(st.st_mode):
        return f"{d}: a symbolic link, not a directory"
    if not stat.S_ISDIR(st.st_mode):
        return f"{d}: not a directory"
    if st.st_uid != os.getuid():
        return f"{d}: owned by uid {st.st_uid}, not this user (uid {os.getuid()})"
    if st.st_mode & 0o077:
        return f"{d}: mode {stat.S_IMODE(st.st_mode):04o}, open to other users (expected 0700)"
    return None


def snapshot_written_at(progress: dict, run_dir: Path, rank: int, role: str = "rank") -> Path:
    """Where the snapshot ``progress`` speaks of is: where it was written, or in
    ``RUN/recovery/`` once the launcher moved it there (see :func:`fast_snapshots`)."""
    where = progress.get("path")
    if isinstance(where, str) and Path(where).is_dir():
        return Path(where)
    return _snapshot_dir(run_dir, rank, role)


@contextlib.contextmanager
def fast_snapshots(run_dir: str | Path):
    """Around a local launch of partial recovery (every rank on this machine): the
    survivors write their snapshots to a directory of ``/dev/shm`` (memory: 0.24 s for a
    rank's 318 MB where ``RUN/recovery/`` on disk took 0.8 s), named for the run and handed
    to the ranks on their command line (``--snapshot-dir``; it yields the directory, or None). When the launch ends, the snapshots still there (the
    run failed for good) move into ``RUN/recovery/``, so the same command again still
    recovers partially, and the directory goes: nothing is left in memory. Without a
    writable ``/dev/shm`` the snapshots go to ``RUN/recovery/``, and likewise, with one
    warning line, when the directory is not this user's alone (:func:`private_dir`: made
    0700; one that exists as a symlink, of another owner or with another mode is not used,
    nor touched: another user could rename the run's live shard files in it)."""
    import hashlib

    key = hashlib.sha256(str(Path(run_dir).resolve()).encode()).hexdigest()[:16]
    d = SHM / f"hybridrec-{key}"
    if (why := private_dir(d)) is not None:
        if SHM.is_dir() and os.access(SHM, os.W_OK):  # (else the usual case: no /dev/shm to use)
            print(f"hybridrec: warning: partial recovery's snapshots go to {recovery_dir(run_dir)}, "
                  f"not {d} ({why})", file=sys.stderr, flush=True)
        yield None
        return
    try:
        yield d
    finally:
        try:
            for p in sorted([*d.glob("rank-*"), *d.glob("ps-*")]):  # (trainers' and servers')
                if p.is_dir() and is_complete(p):
                    target = recovery_dir(run_dir) / p.name
                    target.parent.mkdir(parents=True, exist_ok=True)
                    shutil.rmtree(target, ignore_errors=True)
                    shutil.move(str(p), str(target))
        finally:
            shutil.rmtree(d, ignore_errors=True)




def read_progress(run_dir: str | Path, rank: int, role: str = "rank") -> dict | None:
    """What rank ``rank`` (``role`` ``ps``: parameter server ``rank``) wrote when the run
    last stopped under it (None: nothing readable)."""
    try:
        data = json.loads(progress_file(Path(run_dir), rank, role).read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) and isinstance(data.get("step"), int) else None


def survivors_step(run_dir: str | Path) -> int | None:
    """The newest step a survivor's snapshot holds (None: none): the metrics of steps up
    to it stay in metrics.jsonl when the run resumes with partial recovery."""
    d = recovery_dir(run_dir)
    steps = []
    for p in d.glob("rank-*.json") if d.is_dir() else []:
        with contextlib.suppress(OSError, ValueError):
            data = json.loads(p.read_text())
            if isinstance(data, dict) and data.get("snapshot") and isinstance(data.get("step"), int):
                steps.append(data["step"])
    return max(steps) if steps else None


def boot_id() -> str | None:
    """This boot of the machine's kernel (None: not known, e.g. not Linux)."""
    try:
        return BOOT_ID.read_text().strip() or None
    except OSError:
        return None


def clear_snapshots(run_dir: Path, fast_dir: str | Path | None = None) -> None:
    """Every rank's and parameter server's snapshot and record of the run's stop
    (``RUN/recovery/rank-*``, ``ps-*``, the launcher's local-memory directory's snapshots,
    and any left half-written), not the shards' incremental saves (``RUN/recovery/deltas/``)."""
    d, fast = recovery_dir(run_dir), usable_fast_dir(fast_dir)
    found = []
    for where in (d, fast) if fast is not None else (d,):  # (none when the directory is not there)
        for role in ("rank", "ps"):  # (trainers' and parameter servers')
            found += [*where.glob(f"{role}-*"), *where.glob(f".tmp-{role}-*")]
    for p in found:
        if p.is_dir():
            shutil.rmtree(p, ignore_errors=True)
        else:
            with contextlib.suppress(OSError):
                p.unlink()


def read_snapshot(path: Path, meta: dict, parts: tuple[str, ...], weights=None, sparse_opt=None,
                  into: dict[str, torch.Tensor] | None = None) -> dict:
    """The parts of a snapshot's state (``weights``: which of its weights, ``sparse_opt``:
    whose tensors of the sparse optimizers; None: all). The sparse optimizers' steps and
    learning rates are read in any case. ``into``: live weights (by name) that the saved
    ones of the same shape and dtype are read into in place, with no copy in between."""
    skeleton = {k: meta["state"][k] for k in parts}
    if weights is not None:
        skeleton["weights"] = {k: v for k, v in skeleton["weights"].items() if weights(k)}
    if sparse_opt is not None and "sparse_opt" in skeleton:
        skeleton["sparse_opt"] = {k: (v if sparse_opt(k) else {**v, "tables": {}})
                                  for k, v in skeleton["sparse_opt"].items()}
    targets: dict[str, torch.Tensor] = {}
    tensor_slots(skeleton, targets)
    for name, slot in (skeleton.get("weights") or {}).items() if into else ():
        t, key = into.get(name), slot["__tensor__"]
        if t is not None and t.is_contiguous() and t.shape == targets[key].shape and t.dtype == targets[key].dtype:
            targets[key] = t
    if targets:
        try:
            with quiet():
                dcp.load(targets, storage_reader=SafeFileSystemReader(path), no_dist=True)
        except DCPException as e:  # (a BaseException: the callers that roll back catch Exception)
            raise CheckpointError(f"{path}: {'; '.join(cause for _, cause in describe(e))}") from None
    return decode_skeleton(skeleton, targets)


def snapshot_root(fast: Path | None, run_recovery: Path, tensors: dict[str, torch.Tensor]) -> Path:
    """Where a snapshot of ``tensors`` goes: the launcher's local-memory directory ``fast``
    when it has room for them (and a quarter more), else ``RUN/recovery/``."""
    nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
    if fast is not None:
        with contextlib.suppress(OSError):
            if fast.is_dir() and shutil.disk_usage(fast).free > nbytes * 1.25:
                return fast
    return run_recovery


def save_snapshot(final: Path, skeleton: dict, tensors: dict[str, torch.Tensor], meta: dict, *, sync: bool,
                  more=None) -> Path:
    """A snapshot directory ``final``: ``tensors`` (DCP, this process alone; ``sync``: synced
    to disk) and a manifest of ``meta`` and the state's ``skeleton`` (``more(tmp)``: more
    manifest entries, e.g. files moved into the directory). Written beside it and renamed:
    complete, or absent."""
    tmp = final.parent / f".tmp-{final.name}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        with quiet():
            dcp.save({k: own_storage(v) for k, v in tensors.items()},
                     storage_writer=dcp.FileSystemWriter(tmp, sync_files=sync), no_dist=True)
        extra = more(tmp) if more is not None else {}
        write_json(tmp / MANIFEST, {"format": FORMAT, "kind": SNAPSHOT_KIND, **meta, "state": skeleton, **extra})
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
    return final


def check_snapshot_dir(progress: dict, path: Path) -> dict:
    """The manifest of the snapshot ``progress`` speaks of, at ``path``, if it can be used
    on this machine now (written since the machine's kernel booted, or synced; complete; a
    recovery snapshot, its ``.metadata`` safe to read); else :class:`CheckpointError` saying
    why, so that the rank or server rolls back rather than the recovery failing."""
    if progress.get("boot") is not None and progress["boot"] != boot_id():
        raise CheckpointError(f"{path}: written before the machine restarted, and not synced to disk")
    if not is_complete(path):
        raise CheckpointError(f"{path}: not a complete snapshot")
    meta = json.loads((path / MANIFEST).read_text())
    if meta.get("format") != FORMAT or meta.get("kind") != SNAPSHOT_KIND:
        raise CheckpointError(f"{path}: not a recovery snapshot")
    SafeFileSystemReader(path)  # (reads and checks .metadata: a refusal is raised here)
    return meta
