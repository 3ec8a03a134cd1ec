"""A rank's shards kept in files of local memory while it trains (partial recovery, local launcher).

Partial recovery keeps a survivor's shards across a restart. Without this module the
survivor, stopped by the launcher, writes its shards and their sparse optimizer state into
a snapshot on ``/dev/shm`` (0.12-0.2 s for a rank's 333 MB, inside every restart), and its
restarted process reads them back. Here those tensors live all along in files of the
launcher's local-memory directory (:func:`~hybridrec.train.checkpointing.snapshots.fast_snapshots`), mapped
shared into the process (:func:`torch.from_file`): training updates the files' pages
themselves. A survivor's snapshot takes the files by a rename, writing none of their
bytes; its restarted process maps the same pages again, reading none.

What is kept so: each fused group's weight of the rank's shards and the shards' sparse
optimizer's per-row state (named as the shards' incremental saves name them,
``g0.weight``, ``g0.state.sum``). Replicated tables, the dense part and everything else
go into the snapshot as before. The files' space is reserved when they are made
(``posix_fallocate``): a full ``/dev/shm`` is an error then, not a crash at the first
write. Where the directory lacks the room, the rank trains as before (snapshot written).
A survivor uses its files only while every tensor still has its file's memory
(:meth:`ResidentShards.intact`); otherwise its snapshot writes them.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from pathlib import Path

import torch

from hybridrec.train.checkpointing.snapshots import usable_fast_dir

ROOM = 1.25
"""The free space a rank's files need in the directory, times their size (every rank of
the machine makes its own at about the same time: each asks for the machine's share)."""

DIR_PREFIX = "live-rank-"


def shards_go_resident(cfg, fast_dir: str | Path | None) -> bool:
    """Whether a run's ranks keep their shards in files of local memory (partial recovery
    under the local launcher, which gave ``fast_dir``; see :meth:`Recovery.start_resident`)."""
    return cfg.train.recovery == "partial" and usable_fast_dir(fast_dir) is not None


def shard_tensors(collection, optimizer) -> dict[str, torch.Tensor]:
    """The tensors of a rank's shards: each fused group's weight and its per-row sparse
    optimizer state, by name."""
    out = {}
    for g in range(collection.num_groups):
        out[f"g{g}.weight"] = collection.group_weight(g)
        for k, v in optimizer.row_state(g).items():
            out[f"g{g}.state.{k}"] = v
    return out


def describe(tensors: dict[str, torch.Tensor]) -> dict[str, dict]:
    """What a snapshot's manifest records of them: dtype, shape and the file each is in."""
    return {k: {"dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape), "file": f"{k}.bin"}
            for k, t in tensors.items()}


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _map(path: Path, like: torch.Tensor) -> torch.Tensor:
    """``path``'s bytes as a tensor of ``like``'s dtype and shape, shared with the file."""
    return torch.from_file(str(path), shared=True, size=like.numel(), dtype=like.dtype).view(like.shape)


def _put(t: torch.Tensor, mapped: torch.Tensor) -> None:
    """``t`` (a parameter or a plain tensor: every holder of this object sees it) now uses
    ``mapped``'s memory."""
    with torch.no_grad():
        if isinstance(t, torch.nn.Parameter):
            t.data = mapped
        else:
            t.set_(mapped)


def files_fit(directory: Path, entries: dict[str, dict], tensors: dict[str, torch.Tensor]) -> str | None:
    """Why the files ``entries`` (a manifest's) in ``directory`` cannot stand for ``tensors``
    (None: they can): other names, dtypes or shapes, or a file missing or of another size."""
    if sorted(entries) != sorted(tensors):
        return f"its shards' tensors are {sorted(entries)}, this rank's {sorted(tensors)}"
    for k, t in tensors.items():
        e = entries[k]
        if e.get("dtype") != str(t.dtype).removeprefix("torch.") or list(e.get("shape", ())) != list(t.shape):
            return f"{k} is {e.get('dtype')} {e.get('shape')}, this rank's {t.dtype} {list(t.shape)}"
        f = directory / str(e.get("file"))
        try:
            size = f.stat().st_size
        except OSError:
            return f"{f} is missing"
        if size != _nbytes(t):
            return f"{f} has {size} bytes, not {_nbytes(t)}"
    return None


def read_into(directory: Path, entries: dict[str, dict], tensors: dict[str, torch.Tensor]) -> None:
    """Copy the files ``entries`` (checked with :func:`files_fit`) into ``tensors``."""
    with torch.no_grad():
        for k, t in tensors.items():
            saved = torch.from_file(str(directory / entries[k]["file"]), shared=False, size=t.numel(), dtype=t.dtype)
            t.copy_(saved.view(t.shape))


class ResidentShards:
    """This rank's shard tensors in files of ``root/live-rank-R/`` (see the module)."""

    def __init__(self, root: Path, rank: int, collection, optimizer) -> None:
        self.dir = Path(root) / f"{DIR_PREFIX}{rank:05d}"
        self.collection, self.optimizer = collection, optimizer
        self._mapped: dict[str, torch.Tensor] = {}  # the memory of each file, as mapped

    def tensors(self) -> dict[str, torch.Tensor]:
        return shard_tensors(self.collection, self.optimizer)

    def nbytes(self) -> int:
        return sum(_nbytes(t) for t in self.tensors().values())

    def room(self, ranks_here: int) -> bool:
        """Whether the directory has room for this many ranks' files like this one's."""
        try:
            free = shutil.disk_usage(self.dir.parent).free
        except OSError:
            return False
        return free > self.nbytes() * ROOM * max(1, ranks_here)

    def create(self, *, copy: bool) -> None:
        """New files for every tensor, their space reserved; the tensors move into them
        (``copy``: with their values; else they start as zeros, for a restore to fill)."""
        shutil.rmtree(self.dir, ignore_errors=True)  # (a killed process's files: torn)
        self.dir.mkdir(mode=0o700, parents=True)  # (in the launcher's private directory)
        for k, t in self.tensors().items():
            path = self.dir / f"{k}.bin"
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
            try:
                if _nbytes(t):
                    os.posix_fallocate(fd, 0, _nbytes(t))
            finally:
                os.close(fd)
            mapped = _map(path, t)
            if copy:
                with torch.no_grad():
                    mapped.copy_(t)
            _put(t, mapped)
            self._mapped[k] = mapped

    def adopt(self, snapshot: Path, entries: dict[str, dict]) -> None:
        """Take the files of a snapshot of this rank (``snapshot``, its manifest's
        ``entries``, checked with :func:`files_fit`) as this process's: linked under this
        rank's directory (the snapshot keeps its names until it is cleared) and mapped."""
        shutil.rmtree(self.dir, ignore_errors=True)
        self.dir.mkdir(mode=0o700, parents=True)
        tensors = self.tensors()
        for k in tensors:  # (every link first: a failure leaves no tensor on the snapshot's memory)
            os.link(snapshot / entries[k]["file"], self.dir / f"{k}.bin")
        for k, t in tensors.items():
            mapped = _map(self.dir / f"{k}.bin", t)
            _put(t, mapped)
            self._mapped[k] = mapped

    def release(self) -> None:
        """After a failure of :meth:`create` or :meth:`adopt`: the tensors already moved
        get process memory again, with their values, and the files go (nothing written to
        the tensors afterwards reaches a file, a snapshot's included)."""
        now = self.tensors()
        with torch.no_grad():
            for k, m in self._mapped.items():
                if k in now and now[k].data_ptr() == m.data_ptr():
                    _put(now[k], m.clone())
        self._mapped.clear()
        shutil.rmtree(self.dir, ignore_errors=True)

    def intact(self) -> bool:
        """Every tensor still uses its file's memory (nothing replaced its storage)."""
        now = self.tensors()
        return bool(self._mapped) and sorted(now) == sorted(self._mapped) and all(
            now[k].data_ptr() == m.data_ptr() and now[k].shape == m.shape for k, m in self._mapped.items())

    def hand_over(self, target: Path) -> dict[str, dict]:
        """Move the files into ``target`` (a snapshot being written, on the same file
        system); returns what its manifest records of them. No update may follow."""
        target.mkdir(parents=True, exist_ok=True)
        entries = describe(self.tensors())
        for e in entries.values():
            os.replace(self.dir / e["file"], target / e["file"])
        with contextlib.suppress(OSError):
            self.dir.rmdir()
        return entries
