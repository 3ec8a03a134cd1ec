"""How a checkpoint directory is written and read: safely, atomically, every rank agreeing.

Nothing is unpickled from a checkpoint: tensors load with ``torch.load(weights_only=True)``
(DCP's reader), non-tensor data is JSON (:func:`encode_skeleton`: a skeleton whose tensors
are moved out to DCP keys), and DCP's pickled ``.metadata`` is read by an unpickler that
only builds DCP's own metadata classes and refuses an entry DCP would unpickle, a bytes
entry (:class:`SafeFileSystemReader`).

Atomicity: ranks write into ``PATH.tmp-<pid of rank 0>``; after every rank reported
success, rank 0 renames it to ``PATH``. After each phase the ranks exchange their outcome
(:func:`agree`), so a failure on one rank makes every rank raise instead of waiting in a
collective; a rank that dies is caught by the process-group timeout. :func:`is_complete`
is what readers check.

Checksums: after DCP's write every rank computes the CRC-32 of the files it wrote
(``__<r>_*.distcp``; rank 0 also ``.metadata``, and any file no rank claimed), rank 0 gathers
them into the manifest's ``checksums`` entry (``{"algorithm": "crc32", "files": {name:
[bytes, crc]}, "manifest": crc}``, the last the CRC of the manifest's own JSON) and only
then is the directory renamed into place, so a published checkpoint vouches for every
file in it. :func:`checksum_problem` checks them before a load reads a tensor, each rank a
share of the files. CRC-32 (zlib) because it was the fastest of zlib.crc32, sha1, sha256
and blake2b here (1.3-1.7 GB/s on one core, docs/benchmarks.md "Checkpoint checksums"):
it finds accidental damage (flipped bits, a block of another file, a short or long file),
not a forgery, which the safe readers above are for. Checkpoints saved before the
checksums have no such entry and load without that check.
"""

from __future__ import annotations

import contextlib
import json
import os
import pickle
import re
import shutil
import threading
import warnings
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import ClassVar

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException as DCPException
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, StorageMeta
from torch.distributed.checkpoint.planner import LoadItemType

from hybridrec.errors import HybridrecError, os_error_message
from hybridrec.parallel.topology import Topology

FORMAT = "hybridrec-dcp/2"
MANIFEST = "manifest.json"
TMP_MARK = ".tmp-"
CHECKSUMS = "checksums"  # the manifest's entry (see the module docstring)
CHECKSUM_ALGORITHM = "crc32"
_CHUNK = 8 << 20  # bytes read at a time to checksum a file
_RANK_FILE = re.compile(r"^__(\d+)_")  # DCP's name for a file rank r wrote: __<r>_<i>.distcp

class CheckpointError(HybridrecError):
    """A sharded checkpoint could not be saved or loaded; says which rank and why."""


def is_complete(path: str | Path) -> bool:
    """A finished checkpoint: not a tmp dir, DCP's index and the manifest present."""
    p = Path(path)
    return TMP_MARK not in p.name and (p / ".metadata").is_file() and (p / MANIFEST).is_file()


_UNFINISHED = re.compile(r"^(?:.+\.tmp-(\d+)|\.tmp-.+-(\d+))$")
"""A save's directory before it is renamed into place, named for the process writing it:
``step-N.tmp-PID`` (checkpoints), ``.tmp-NAME-PID`` (recovery snapshots, shard deltas)."""


def remove_unfinished(directory: str | Path, *, pid: int | None = None) -> list[Path]:
    """Remove the unfinished saves in ``directory`` (not below it; see :data:`_UNFINISHED`):
    those of process ``pid`` (a process ending mid-save removes its own), or, with None,
    those of every process that is gone (a killed save's leftovers, removed by the next run
    with the run directory's lock held; one whose pid is alive is left, as it might still
    be written). Symbolic links are not followed (a link is removed, not its target).
    Returns what was removed."""
    directory, removed = Path(directory), []
    try:
        entries = list(os.scandir(directory))
    except OSError:  # (not there: nothing left)
        return removed
    for entry in entries:
        m = _UNFINISHED.match(entry.name)
        if m is None:
            continue
        owner = int(m.group(1) or m.group(2))
        if (owner != pid) if pid is not None else _alive(owner):
            continue
        path = Path(entry.path)
        for _ in range(3):  # (a writer thread still adding files: once more)
            if entry.is_dir(follow_symlinks=False):
                shutil.rmtree(path, ignore_errors=True)
            else:
                with contextlib.suppress(OSError):
                    path.unlink()
            if not os.path.lexists(path):
                removed.append(path)
                break
    return removed


_SAVES = threading.Lock()  # (held for good by stop_saves)
_writing: set[Path] = set()  # the unpublished directories this process's saves write into
_stopped = False


def save_begun(tmp: Path, *, make: bool = False) -> None:
    """This process writes into the unpublished checkpoint directory ``tmp`` (``make``: it
    makes it, afresh: rank 0). Once :func:`stop_saves` ran, it blocks until the process
    ends, so that no save directory appears after the last one was removed."""
    with _SAVES:
        _writing.add(Path(tmp))
        if make:
            shutil.rmtree(tmp, ignore_errors=True)
            Path(tmp).mkdir(parents=True)


def save_ended(tmp: Path | None, *, discard: bool = False, publish: Path | None = None) -> None:
    """This process no longer writes into ``tmp``: ``publish`` renames it to that path
    (replacing what is there), ``discard`` removes it (rank 0)."""
    if tmp is None:
        return
    with _SAVES:
        _writing.discard(Path(tmp))
        if publish is not None:
            if publish.exists():
                shutil.rmtree(publish)
            os.replace(tmp, publish)
        elif discard:
            shutil.rmtree(tmp, ignore_errors=True)


def stop_saves() -> list[Path]:
    """For a process about to end mid-run (SIGTERM): remove the unpublished directories its
    saves write into, and let no save make or publish one from now on (it waits for a
    save doing so to finish first). Returns what was removed. Another rank writing into the
    same directory may make it again before it ends: it removes it too when it stops, and
    what a process that is gone left is removed when the run starts again
    (:func:`remove_unfinished`). Called again, it removes them again."""
    global _stopped
    if not _stopped:
        _SAVES.acquire()  # (never released: the process ends)
        _stopped = True
    removed = []
    for tmp in sorted(_writing):
        for _ in range(3):  # (a writer thread still adding files: once more)
            shutil.rmtree(tmp, ignore_errors=True)
            if not os.path.lexists(tmp):
                removed.append(tmp)
                break
    return removed


def _alive(pid: int) -> bool:
    """Whether process ``pid`` exists on this machine (this one included)."""
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # (EPERM: another user's)
        return True
    return True


# -- ranks agree on every outcome ------------------------------------------------------
def gather(topo: Topology, obj) -> list:
    """Collective: every rank's ``obj`` (small, picklable: our own live processes, never
    a file), in rank order."""
    if topo.group is None or topo.group_size == 1:
        return [obj]
    out = [None] * topo.group_size
    dist.all_gather_object(out, obj, group=topo.group)
    return out


def describe(error: BaseException | None) -> list[tuple[tuple[int, ...] | None, str]] | None:
    """What went wrong, picklable for :func:`gather`: ``[(ranks, cause), ...]``, where ranks
    are those DCP reported the cause for (None: this rank). Causes are root causes: DCP's
    per-rank failures without their tracebacks, and the error of the file system under
    torch's wrapping (a full disk shows as ``No space left on device``, not as torch's
    ``unexpected pos``)."""
    if error is None:
        return None
    if isinstance(error, DCPException):
        by_cause: dict[str, list[int]] = {}
        for r, failure in sorted(error.failures.items()):
            e = failure[0] if isinstance(failure, tuple) else failure
            by_cause.setdefault(root_cause(e), []).append(r)
        return [(tuple(rs), text) for text, rs in by_cause.items()]
    return [(None, root_cause(error))]


def root_cause(error: BaseException) -> str:
    """The words for what failed: our own message, else the first error of the file system
    in the chain of causes, else refusals and truncations in plain words."""
    if isinstance(error, HybridrecError):
        return str(error)
    chain, e = [], error
    while e is not None and e not in chain:
        chain.append(e)
        e = e.__cause__ or e.__context__
    for e in chain:
        if isinstance(e, HybridrecError):
            return str(e)
        if isinstance(e, OSError):
            return os_error_message(e)
    text = str(error)
    if isinstance(error, pickle.UnpicklingError) or "Weights only load failed" in text:
        return _refused(text)
    if isinstance(error, EOFError) or "PytorchStreamReader" in text:
        return f"truncated or corrupt ({type(error).__name__}{': ' + text if text else ''})"
    return f"{type(error).__name__}: {text}" if text else type(error).__name__


def _refused(text: str) -> str:
    """torch.load(weights_only=True) refused a pickle: say so, without torch's advice to
    load it with weights_only=False."""
    found = re.search(r"GLOBAL ([\w.]+)", text)
    what = f" ({found[1]})" if found else ""
    return f"refused: it holds objects other than tensors{what}, which are never unpickled"


def raise_failures(messages: list, path: str | Path, action: str, error: BaseException | None) -> None:
    """Raise one :class:`CheckpointError` (the same on every rank) from every rank's
    :func:`describe`: ``PATH: ACTION failed[ on rank R]: CAUSE``."""
    by_cause: dict[str, set[int]] = {}
    for r, described in enumerate(messages):
        for ranks, cause in described or ():
            by_cause.setdefault(relative_cause(cause, path), set()).update((r,) if ranks is None else ranks)
    if not by_cause:
        return
    single = len(messages) == 1 and all(rs == {0} for rs in by_cause.values())
    if single:
        text = "; ".join(by_cause)
    else:
        text = "; ".join(f"on rank{'s' if len(rs) > 1 else ''} {', '.join(map(str, sorted(rs)))}: {cause}"
                         for cause, rs in by_cause.items())
    sep = ": " if single else " "
    err = CheckpointError(f"{path}: {action} failed{sep}{text}")
    err.same_on_every_rank = True  # every rank gathered the same messages
    raise err from error


def relative_cause(cause: str, path: str | Path) -> str:
    """``PATH/x: ...`` -> ``x: ...`` and ``PATH: ...`` -> ``...`` (the message names PATH)."""
    p = str(path)
    if cause.startswith(p + ": "):
        return cause[len(p) + 2:]
    if cause.startswith(p + os.sep):
        return cause[len(p) + 1:]
    return cause


def agree(topo: Topology, error: BaseException | None, path: str | Path, action: str) -> None:
    """Collective: raise on every rank if any rank failed ``action`` on ``path``, so that no
    rank goes on into a collective its peers will never join."""
    raise_failures(gather(topo, describe(error)), path, action, error)


def dist_kwargs(topo: Topology) -> dict:
    return {"process_group": topo.group, "no_dist": topo.group is None}


# -- non-tensor data: JSON, with tensors moved out to DCP keys ----------------------------
_MARKS = ("__tensor__", "__tuple__", "__dict__")


def encode_skeleton(obj, key: str, tensors: dict[str, torch.Tensor]) -> object:
    """JSON-able skeleton of ``obj``; each tensor goes to ``tensors[<its path>]``,
    e.g. ``extra.rng`` or ``dense_opt.state.top.layers.0.weight.exp_avg``."""
    if isinstance(obj, torch.Tensor):
        if key in tensors:
            raise CheckpointError(f"two tensors would be stored as {key!r}")
        tensors[key] = obj
        return {"__tensor__": key, "dtype": str(obj.dtype).removeprefix("torch."), "shape": list(obj.shape)}
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    if isinstance(obj, (list, tuple)):
        items = [encode_skeleton(v, f"{key}.{i}", tensors) for i, v in enumerate(obj)]
        return items if isinstance(obj, list) else {"__tuple__": items}
    if isinstance(obj, dict):
        if all(isinstance(k, str) for k in obj) and not any(k in _MARKS for k in obj):
            return {k: encode_skeleton(v, f"{key}.{k}", tensors) for k, v in obj.items()}
        return {"__dict__": [[encode_skeleton(k, f"{key}.{k}#key", tensors), encode_skeleton(v, f"{key}.{k}", tensors)]
                             for k, v in obj.items()]}
    raise CheckpointError(f"{key}: cannot store a {type(obj).__name__} "
                          "(use tensors, numbers, strings, None, lists, tuples, dicts)")


def decode_skeleton(obj, tensors: dict[str, torch.Tensor]):
    if isinstance(obj, list):
        return [decode_skeleton(v, tensors) for v in obj]
    if not isinstance(obj, dict):
        return obj
    if "__tensor__" in obj:
        return tensors[obj["__tensor__"]]
    if "__tuple__" in obj:
        return tuple(decode_skeleton(v, tensors) for v in obj["__tuple__"])
    if "__dict__" in obj:
        return {decode_skeleton(k, tensors): decode_skeleton(v, tensors) for k, v in obj["__dict__"]}
    return {k: decode_skeleton(v, tensors) for k, v in obj.items()}


def tensor_slots(obj, out: dict[str, torch.Tensor]) -> None:
    """Empty tensors for every tensor placeholder in a skeleton (what ``dcp.load`` fills)."""
    if isinstance(obj, list):
        for v in obj:
            tensor_slots(v, out)
    elif isinstance(obj, dict):
        if "__tensor__" in obj:
            dtype = getattr(torch, obj["dtype"], None)
            if not isinstance(dtype, torch.dtype):
                raise CheckpointError(f"{obj['__tensor__']}: unknown dtype {obj['dtype']!r}")
            out[obj["__tensor__"]] = torch.empty(obj["shape"], dtype=dtype)
        else:
            for v in obj.values():
                tensor_slots(v, out)


# -- DCP's .metadata without arbitrary unpickling ---------------------------------------------
class _MetadataUnpickler(pickle.Unpickler):
    """Builds only DCP's metadata types, torch.Size, dtypes, layouts and paths."""

    _ALLOWED: ClassVar[set[tuple[str, str]]] = {
        *(("torch.distributed.checkpoint.metadata", n) for n in (
            "Metadata", "MetadataIndex", "StorageMeta", "TensorProperties", "TensorStorageMetadata",
            "ChunkStorageMetadata", "BytesStorageMetadata", "_MEM_FORMAT_ENCODING")),
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
        ("torch", "Size"), ("torch.serialization", "_get_layout"), ("collections", "OrderedDict"),
        ("pathlib", "PosixPath"), ("pathlib", "WindowsPath"), ("pathlib", "PurePosixPath"),
    }

    def find_class(self, module: str, name: str):
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        if (module, name) in self._ALLOWED:
            return super().find_class(module, name)
        raise _Refused(f"{module}.{name}")


class _Refused(pickle.UnpicklingError):
    """The metadata names a class outside :attr:`_MetadataUnpickler._ALLOWED`."""


class SafeFileSystemReader(dcp.FileSystemReader):
    """DCP's file reader with :class:`_MetadataUnpickler` for ``.metadata``; its errors
    name the file (refused, truncated or corrupt) instead of torch's advice to unpickle.

    Every DCP load of hybridrec goes through it (checkpoints, recovery snapshots, shard
    deltas, the parameter servers' checkpoints and snapshots). It also refuses a bytes
    entry (``BytesStorageMetadata``): DCP's load planner reads one with
    ``torch.load(weights_only=False)``, which runs whatever the pickle names. hybridrec
    never saves one (non-tensor data is JSON in the manifest), so the metadata's entries
    must all be tensors (:meth:`_check_entries`), and :meth:`read_data` refuses a bytes
    read item again before DCP reads it, whoever made the plan."""

    def __init__(self, path, *args, **kwargs) -> None:
        super().__init__(path, *args, **kwargs)
        self._metadata = self._read_metadata()

    def reset(self, checkpoint_id=None) -> None:
        super().reset(checkpoint_id)
        if checkpoint_id is not None:  # (another directory)
            self._metadata = self._read_metadata()

    def read_metadata(self, *args, **kwargs) -> Metadata:
        """What :meth:`_read_metadata` read when the reader was made. Read then, not when
        ``dcp.load`` asks, so that a refusal is a :class:`CheckpointError` where the reader
        is made: from ``dcp.load`` it would come wrapped in DCP's exception (a
        BaseException, which ``except Exception`` misses), after DCP tried rank-local
        ``__<r>.metadata`` files instead (hybridrec writes none; none is read here)."""
        self._metadata.storage_meta.load_id = self.load_id
        return self._metadata

    def _read_metadata(self) -> Metadata:
        where = Path(self.path) / ".metadata"
        with open(where, "rb") as f:
            try:
                metadata = _MetadataUnpickler(f).load()
            except _Refused as e:
                raise CheckpointError(f"{where}: refused: it references {e}; checkpoint metadata "
                                      "may hold only DCP's metadata types") from None
            except Exception as e:  # noqa: BLE001 - any unpickling failure: a damaged file
                raise CheckpointError(f"{where}: truncated or corrupt ({type(e).__name__}: {e})") from None
        if not isinstance(metadata, Metadata):
            raise CheckpointError(f"{where}: not DCP metadata")
        _check_entries(metadata, where)
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        return metadata

    def _slice_file(self, file, sinfo):
        self._reading = sinfo.relative_path  # the file a failure of read_data is about
        return super()._slice_file(file, sinfo)

    def read_data(self, plan, planner):
        self._reading = None
        for item in plan.items:
            if item.type == LoadItemType.BYTE_IO:  # (never planned from metadata read above)
                info = self.storage_data.get(item.storage_index)
                where = Path(self.path) / (info.relative_path if info is not None else ".metadata")
                raise CheckpointError(f"{where}: refused: {item.dest_index.fqn!r} is a pickled object, "
                                      "which is never unpickled (a checkpoint holds tensors only)")
        try:
            return super().read_data(plan, planner)
        except Exception as e:
            if self._reading is None or isinstance(e, (OSError, HybridrecError)):
                raise
            where = Path(self.path) / self._reading
            raise CheckpointError(f"{where}: {self._read_failure(e, where)}") from e

    def _read_failure(self, error: Exception, where: Path) -> str:
        """A file shorter than the metadata says is truncated; else the root cause."""
        needed = max((i.offset + i.length for i in self.storage_data.values()
                      if i.relative_path == self._reading), default=0)
        with contextlib.suppress(OSError):
            size = where.stat().st_size
            if size < needed:
                return f"truncated ({size:,} of {needed:,} bytes)"
        return root_cause(error)


def _check_entries(metadata: Metadata, where: Path) -> None:
    """Refuse DCP metadata that would make a load unpickle (a bytes entry) or read outside
    its directory (a file name with a path), naming the entry and its file."""
    entries, storage = metadata.state_dict_metadata, metadata.storage_data or {}
    if not isinstance(entries, dict) or not isinstance(storage, dict):
        raise CheckpointError(f"{where}: not DCP metadata (its index is not a dict)")
    files: dict[str, set[str]] = {}
    for index, info in storage.items():
        name, fqn = getattr(info, "relative_path", None), getattr(index, "fqn", None)
        if not isinstance(name, str) or not _plain_name(name):
            raise CheckpointError(f"{where}: refused: {fqn!r} is stored in {name!r}, not a file of "
                                  "the checkpoint directory")
        files.setdefault(fqn, set()).add(name)
    for key, md in entries.items():
        if isinstance(md, BytesStorageMetadata):
            held = ", ".join(sorted(files.get(key, ()))) or "no file"
            raise CheckpointError(f"{where}: refused: {key!r} is a pickled object (bytes in {held}), "
                                  "which is never unpickled (a checkpoint holds tensors only)")


def _plain_name(name: str) -> bool:
    return name not in ("", ".", "..") and "/" not in name and os.sep not in name


@contextlib.contextmanager
def quiet():
    """DCP warns that ShardedTensor is deprecated and that a single process has no process
    group; both are expected here."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*deprecating ShardedTensor")
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def write_and_publish(final: Path, tmp: Path, state: dict, meta: dict, topo: Topology,
                      attach: Callable[[Path], None] | None = None, background: bool = False) -> None:
    """``attach(tmp)``: collective, after the ranks' chunks and before the manifest, e.g.
    the parameter servers' own checkpoint inside this one (published with it).
    ``background``: in a thread of its own (no :func:`quiet`: ``catch_warnings`` is not
    thread-safe; the caller silenced the same warnings)."""
    err, sums = None, {}
    try:  # phase 2: every rank writes its chunks (DCP reports a rank's failure to all ranks)
        with contextlib.nullcontext() if background else quiet():
            dcp.save(state, storage_writer=dcp.FileSystemWriter(tmp), **dist_kwargs(topo))
        if attach is not None:
            attach(tmp)
        # (dcp.save returns once every rank's files and rank 0's .metadata are written)
        sums = checksum_files(tmp, [n for n in checked_files(tmp) if _writer(n, topo.group_size) == topo.rank])
    except (Exception, DCPException) as e:  # noqa: BLE001 - DCP's is a BaseException
        err = e
    every = gather(topo, (describe(err), sums))
    raise_failures([d for d, _ in every], final, "saving the checkpoint", err)
    try:  # phase 3: rank 0 writes the manifest, with every rank's checksums
        if topo.rank == 0:
            files = {name: s for _, part in every for name, s in part.items()}
            files.update(checksum_files(tmp, [n for n in checked_files(tmp) if n not in files]))
            write_json(tmp / MANIFEST, seal(meta, files))
    except Exception as e:  # noqa: BLE001
        err = e
    agree(topo, err, final, "saving the checkpoint")
    try:  # phase 4: every rank's part is on disk; rank 0 publishes the directory
        if topo.rank == 0:
            save_ended(tmp, publish=final)  # (not while a SIGTERM removes it: stop_saves)
            fsync_dir(final.parent)
    except Exception as e:  # noqa: BLE001
        err = e
    agree(topo, err, final, "publishing the checkpoint")
    save_ended(tmp)


# -- checksums -------------------------------------------------------------------------------
def checked_files(d: Path) -> list[str]:
    """The files of the checkpoint directory ``d`` its manifest vouches for: every regular
    file at its top level but the manifest (a part in a subdirectory, a parameter-server
    run's ``ps/``, is a checkpoint with a manifest of its own)."""
    with os.scandir(d) as entries:
        return sorted(e.name for e in entries if e.is_file(follow_symlinks=False) and e.name != MANIFEST)


def _writer(name: str, world_size: int) -> int:
    """The rank that wrote the file ``name`` (DCP's ``__<r>_<i>.distcp``), so it checksums
    it while the file is in its page cache; rank 0 for the rest (``.metadata``)."""
    m = _RANK_FILE.match(name)
    return int(m[1]) if m and int(m[1]) < world_size else 0


def file_checksum(path: Path) -> list:
    """``[bytes, crc]`` of the file ``path`` (crc: CRC-32, 8 hex digits), read in chunks."""
    crc, size, buf = 0, 0, bytearray(_CHUNK)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            crc = zlib.crc32(view[:n], crc)
            size += n
    return [size, f"{crc:08x}"]


def checksum_files(d: Path, names: list[str]) -> dict[str, list]:
    return {n: file_checksum(d / n) for n in names}


def _manifest_crc(meta: dict) -> str:
    """CRC-32 of a manifest but its own checksum, as canonical JSON (the same after a round
    trip through the file)."""
    body = {**meta, CHECKSUMS: {k: v for k, v in meta[CHECKSUMS].items() if k != "manifest"}}
    return f"{zlib.crc32(json.dumps(body, sort_keys=True).encode()):08x}"


def seal(meta: dict, files: dict[str, list]) -> dict:
    """``meta`` with its ``checksums`` entry: the files' and its own."""
    sums = {"algorithm": CHECKSUM_ALGORITHM, "files": dict(sorted(files.items()))}
    sealed = {**meta, CHECKSUMS: sums}
    sums["manifest"] = _manifest_crc(sealed)
    return sealed


def checksum_problem(path: Path, meta: dict, share: tuple[int, int] | None = (0, 1)) -> str | None:
    """What the manifest ``meta`` of the checkpoint ``path`` says is wrong with its files
    (None: nothing; also for a manifest without checksums, saved before them): the
    manifest's own checksum, every file it lists present and of its size, and, with
    ``share`` ``(rank, ranks)``, the contents of this rank's share of the files (the
    ranks together read each file once; None: no contents read)."""
    sums = meta.get(CHECKSUMS)
    if sums is None:
        return None
    files = sums.get("files") if isinstance(sums, dict) else None
    if (not isinstance(files, dict) or sums.get("algorithm") != CHECKSUM_ALGORITHM
            or not all(_valid_entry(n, e) for n, e in files.items())):
        return f"{MANIFEST}: its {CHECKSUMS} entry is unreadable (expected {CHECKSUM_ALGORITHM} of each file)"
    if (crc := _manifest_crc(meta)) != sums.get("manifest"):
        return f"{MANIFEST}: corrupt (crc32 {crc}, it records {sums.get('manifest')})"
    for name, (size, _) in sorted(files.items()):
        if not (path / name).is_file():
            return f"{name}: missing"
        if (have := (path / name).stat().st_size) != size:
            return f"{name}: {have:,} bytes, the manifest records {size:,}"
    for name in _share(files, *share) if share is not None else ():
        if (crc := file_checksum(path / name)[1]) != files[name][1]:
            return f"{name}: corrupt (crc32 {crc}, the manifest records {files[name][1]})"
    return None


def _valid_entry(name, entry) -> bool:
    """A plain file name of the directory, ``[bytes, 8 hex digits]``."""
    return (isinstance(name, str) and "/" not in name and name not in ("", ".", "..")
            and isinstance(entry, list) and len(entry) == 2 and isinstance(entry[0], int)
            and isinstance(entry[1], str) and re.fullmatch(r"[0-9a-f]{8}", entry[1]) is not None)


def _share(files: dict[str, list], rank: int, ranks: int) -> list[str]:
    """Rank ``rank``'s files to read of ``ranks``: largest first, each to the rank with the
    fewest bytes so far (the same split on every rank)."""
    load, mine = [0] * ranks, []
    for name, (size, _) in sorted(files.items(), key=lambda kv: (-kv[1][0], kv[0])):
        r = min(range(ranks), key=lambda i: (load[i], i))
        load[r] += size
        if r == rank:
            mine.append(name)
    return mine


def write_json(path: Path, obj) -> None:
    with open(path, "w") as f:
        json.dump(obj, f)
        f.flush()
        os.fsync(f.fileno())


def fsync_dir(d: Path) -> None:
    fd = os.open(d, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
