"""Training rows from raw files as they land in a directory (``data.stream=DIR``).

A stream is a step source like :class:`~hybridrec.data.loader.ShardedLoader`, with no
preprocessing pass: it reads Criteo TSV files (plain or ``.gz``) in *name order* as they
appear, parses them with the preprocessing readers (:class:`~hybridrec.data.criteo.CriteoReader`;
with ``data.stream_schema``, CSV's and Parquet's of :mod:`hybridrec.data.tabular`)
and turns each global batch into this rank's :class:`~hybridrec.sparse.keyed_jagged.Batch`.

(Criteo, or CSV/Parquet with a schema file; one-hot features only.) Dense values: Criteo's
``log1p``; a schema file's ``dense_transform``, except that with no preprocessing pass to
measure the columns ``auto`` is ``log1p`` and ``standardize`` needs its mean and std in the
schema file (:func:`stream_dense`). **When a file counts as landed.** The convention of object-store drops and of Hadoop's
writers: a producer writes a file under a temporary name and renames it when it is complete.
Names that begin with ``.``, ``_`` or ``~``, or end in ``.tmp``, ``.part``, ``.partial``,
``._COPYING_``, ``.crdownload`` or ``.inprogress``, and ``*.json`` files, are never taken;
any other regular file is a complete file. A file is fingerprinted (size, modification
time, inode) when it is picked up; one that differs when its end is read, or when a resumed
run reopens it, is refused in one line (a stream file must not change once it has landed).
A file whose name sorts before one already picked up arrived out of order: it is skipped
with a warning and listed in summary.json (``late``).

**Ranks.** Global batch ``t`` is the stream's next ``G = batch_size * world`` rows and rank
``r`` takes those of them numbered ``i % world == r`` (``i`` counts the stream's rows since it,
or its resume, started; G is a multiple of world): the ranks train disjoint rows and N ranks
see what one process with batch G sees. Rank 0 alone looks at the directory and tells the
others which file comes next (a broadcast of a few JSON bytes, never pickled); while it waits
for a file the ranks meet every ``data.stream_poll_s``, so a quiet stream never trips a
collective's timeout. Each rank parses only its own rows of a Criteo file (every rank splits
the text into lines and fields, and the field values of its rows alone are parsed:
:attr:`~hybridrec.data.criteo.CriteoReader.rows_of`), when every line must be good
(``data.on_bad_line=error``: a bad line stops the run from the rank that parses it). With
``skip``, a dropped line would shift the numbers, and CSV/Parquet files have no such
reader: there every rank parses every row and keeps its own (a simplification).

**Position.** The state is the list of files picked up, each with its fingerprint, landing
time and rows trained; every file but the last is trained whole. A checkpoint saves the
position after the last *trained* batch (the pipeline's rule), so a run killed at any moment
and started again with the same command trains every row exactly once: it reopens the last
file and skips the rows already trained (the same bad lines are skipped again). The last
global batch before the stream stops may be partial; while the stream only waits, rows stay
buffered until a full batch is there.

**Ends** (``data.stream_stop``): ``idle:S`` once no new file has landed for S seconds (and
every buffered row trained), ``files:N`` once N files have been picked up and trained in
all (over every invocation), ``never``.
"""

from __future__ import annotations

import os
import re
import sys
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from hybridrec.broadcast import rank0_value
from hybridrec.data import dense as dense_transforms
from hybridrec.data.chunk import ParseReport, RowChunk
from hybridrec.data.criteo import CATEGORICAL, DENSE, CriteoReader
from hybridrec.data.loader import keyed_ids
from hybridrec.data.schema import DatasetMeta, FeatureSpec, Schema
from hybridrec.data.tabular import CsvReader, ParquetReader, TabularSpec
from hybridrec.errors import ConfigError, DataError
from hybridrec.sparse.keyed_jagged import Batch

TEMP_SUFFIXES = (".tmp", ".part", ".partial", "._COPYING_", ".crdownload", ".inprogress")
"""Names a producer writes under before the rename that lands a file."""


def is_stream_file(name: str) -> bool:
    """Whether a directory entry named ``name`` is a landed data file (not a temporary or
    hidden file, not a JSON side file)."""
    return not (name.startswith((".", "_", "~")) or name.endswith(TEMP_SUFFIXES) or name.endswith(".json"))


@dataclass(frozen=True)
class StreamStop:
    """``data.stream_stop`` parsed."""
    kind: str  # idle | files | never
    value: float = 0.0

    @staticmethod
    def parse(text: str) -> StreamStop:
        m = re.fullmatch(r"(idle|files):([0-9]+(?:\.[0-9]+)?)|never", text.strip())
        if not m:
            raise ConfigError(f"data.stream_stop {text!r}: idle:SECONDS, files:N or never")
        return StreamStop("never") if text.strip() == "never" else StreamStop(m.group(1), float(m.group(2)))


def stream_schema(num_embeddings: dict[str, int], spec: TabularSpec | None = None) -> Schema:
    """A stream's schema: Criteo's (13 dense columns, 26 one-hot features), or a CSV/Parquet
    schema file's (``spec``; one-hot features only); each table has ``num_embeddings[name]``
    rows."""
    label, dense, names = ("label", list(DENSE), list(CATEGORICAL)) if spec is None else \
        (spec.label, list(spec.dense), list(spec.categorical))
    return Schema(label=label, dense=dense,
                  features=[FeatureSpec(name=n, kind="onehot", num_embeddings=num_embeddings[n]) for n in names])


def stream_meta(directory: str | os.PathLike, tables: str, table_rows: str, *,
                schema_file: str | os.PathLike | None = None) -> DatasetMeta:
    """The :class:`DatasetMeta` a stream run builds its model from: no parts, the stream's
    schema (Criteo, or ``schema_file``'s) with each table's rows (``model.table_rows`` plus
    the shared row 0), and a ``preprocessing`` entry that says how raw keys become rows
    (``modulo``: ``key % rows``, the preprocessing's own modulo encoding; ``dynamic``: the
    run's key maps)."""
    from hybridrec.data.encode import resolve_table_sizes

    spec = TabularSpec.load(schema_file) if schema_file else None
    if spec is not None and spec.multihot:
        raise DataError(f"{schema_file}: multi-hot columns {spec.multihot} in a stream: not supported yet")
    names = list(CATEGORICAL) if spec is None else list(spec.categorical)
    sizes = resolve_table_sizes(table_rows, names)
    rows = {n: s + 1 for n, s in sizes.items()}
    pre = {"categorical": "modulo" if tables == "modulo" else "dynamic", "table_size": rows,
           "dense_transform": "log1p" if spec is None else
           dense_transforms.to_meta(stream_dense(spec), spec.dense),
           "format": "criteo" if spec is None else "tabular", "stream": str(directory),
           **({"schema_file": str(schema_file)} if spec is not None else {})}
    return DatasetMeta(path=None, schema=stream_schema(rows, spec), parts=[], splits={"train": [], "eval": []},
                       preprocessing=pre)


def stream_dense(spec: TabularSpec) -> list[dense_transforms.Column]:
    """A CSV/Parquet stream's dense transforms, set on ``spec``: a stream has no
    preprocessing pass to measure its columns, so ``auto`` is ``log1p`` and ``standardize``
    takes its mean and std from the schema file (:func:`hybridrec.data.dense.without_stats`)."""
    spec.dense_columns = dense_transforms.without_stats(spec.dense_plan, spec.dense, spec.source)
    return spec.dense_columns


def stream_reader(path: Path, *, spec: TabularSpec | None, on_bad_line: str):
    """The reader of one stream file: Criteo's, or with a schema file's ``spec`` CSV's or
    (``.parquet``, ``.pq``) Parquet's."""
    if spec is None:
        return CriteoReader(on_bad_line=on_bad_line)
    if path.suffix in (".parquet", ".pq"):
        return ParquetReader(spec=spec, on_bad_line=on_bad_line)
    return CsvReader(spec=spec, on_bad_line=on_bad_line)


def _fingerprint(path: Path) -> dict:
    st = path.stat()
    return {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "ino": st.st_ino}


class _Buffer:
    """Parsed rows not trained yet, counted in the stream's rows (``rows``): pieces
    ``[file index, chunk, rows, first]``, a piece of ``rows`` stream rows numbered from
    ``first`` (since the stream or its resume started) whose chunk holds this rank's of them
    only (``rank``/``world``: rows numbered ``i % world == rank``), or all (``world`` 1)."""

    def __init__(self, rank: int = 0, world: int = 1) -> None:
        self.items: list[list] = []
        self.rows = 0
        self.rank, self.world = rank, world

    def _held(self, first: int, n: int) -> int:
        """This rank's rows among the stream's rows ``[first, first + n)``."""
        if self.world == 1:
            return n
        below = lambda x: max(0, (x - self.rank + self.world - 1) // self.world)
        return below(first + n) - below(first)

    def add(self, index: int, chunk: RowChunk, rows: int, first: int) -> None:
        if rows:
            self.items.append([index, chunk, rows, first])
            self.rows += rows

    def take(self, n: int) -> list[tuple[int, RowChunk, int]]:
        """The next ``n`` stream rows: ``(file index, the chunk held of them, stream rows)``."""
        out = []
        while n > 0:
            index, chunk, rows, first = self.items[0]
            if rows <= n:
                out.append((index, chunk, rows))
                self.items.pop(0)
            else:
                held = self._held(first, n)
                out.append((index, _rows(chunk, 0, held), n))
                self.items[0] = [index, _rows(chunk, held, len(chunk)), rows - n, first + n]
                rows = n
            n -= rows
            self.rows -= rows
        return out


def _rows(chunk: RowChunk, lo: int, hi: int | None, step: int = 1) -> RowChunk:
    """Rows ``lo:hi:step`` of ``chunk`` (one-hot features only)."""
    if chunk.multihot:
        raise DataError("a stream of multi-hot features is not supported")
    at = slice(lo, hi, step)
    return RowChunk(labels=chunk.labels[at], dense=chunk.dense[at], onehot=chunk.onehot[at])


def _concat(chunks: list[RowChunk]) -> RowChunk:
    if len(chunks) == 1:
        return chunks[0]
    return RowChunk(labels=np.concatenate([c.labels for c in chunks]),
                    dense=np.concatenate([c.dense for c in chunks]),
                    onehot=np.concatenate([c.onehot for c in chunks]))


class StreamLoader:
    """This rank's batches of the stream in ``directory`` (see the module's docstring).

    Args:
        directory: the directory files land in.
        schema: the stream's schema (:func:`stream_schema`).
        encode: raw one-hot keys ``[n, features]`` (int64, -1 missing) -> the ids the
            batch carries (int64); None: the raw keys themselves (dynamic tables map them).
        batch_size, rank, world_size: as the dataset loader's.
        stop: ``data.stream_stop``; poll_s: seconds between two looks while waiting.
        group: the ranks' process group (None: one process); device: its collectives'.
        on_bad_line: ``error`` or ``skip``.
        schema_file: a CSV/Parquet stream's schema file (None: Criteo TSV).
    """

    def __init__(self, directory: str | os.PathLike, *, schema: Schema,
                 encode: Callable[[np.ndarray], np.ndarray] | None, batch_size: int, rank: int = 0,
                 world_size: int = 1, stop: str = "idle:60", poll_s: float = 1.0, group=None,
                 device: torch.device | str = "cpu", on_bad_line: str = "error", show=None,
                 schema_file: str | os.PathLike | None = None) -> None:
        self.directory = Path(directory)
        if not self.directory.is_dir():
            raise DataError(f"data.stream {self.directory}: not a directory")
        self.schema, self.encode = schema, encode
        self.batch_size, self.rank, self.world_size = batch_size, rank, world_size
        self.stop, self.poll_s = StreamStop.parse(stop), poll_s
        self.group, self.device, self.on_bad_line = group, device, on_bad_line
        self.spec = TabularSpec.load(schema_file) if schema_file else None  # (read once, not per file)
        if self.spec is not None:
            stream_dense(self.spec)
        self.show = show if show is not None else (lambda msg: print(msg, file=sys.stderr, flush=True))
        self.files: list[dict] = []  # every file picked up, in order (the state)
        self.late: list[str] = []
        self.waiting = 0  # files landed and not picked up yet, at the last look
        self.stopped: str | None = None  # why the stream ended
        self._chunks: Iterator | None = None
        self._report: ParseReport | None = None
        self._reading: int | None = None  # the index of the file being parsed
        self._read = 0  # its good rows parsed so far
        self._skip = 0  # its rows a resumed run trained already
        # Criteo text that must be good (on_bad_line=error): each rank parses only its own rows
        # (numbered i % world == rank); else every rank parses every row and keeps its own
        self._own_rows = world_size > 1 and on_bad_line == "error" and self.spec is None
        self._seq = 0  # rows buffered since the stream (or its resume) started: their numbers
        self._pending = (0, 0)  # the block being parsed: (its rows past the skip, its first number)
        self._buffer = self._new_buffer()
        self._idle_since = time.time()

    def __len__(self) -> int:
        """Steps per epoch: a stream has no epochs (0; the stream ends the run)."""
        return 0

    def ready(self) -> int:
        """Whole batches parsed and waiting: the next this many come without reading a file
        (the same on every rank: every rank parses the same blocks)."""
        return self._buffer.rows // (self.batch_size * self.world_size)

    # -- the state ---------------------------------------------------------------
    def state_dict(self) -> dict:
        return {"directory": str(self.directory), "files": [dict(f) for f in self.files], "late": list(self.late),
                "global_batch_size": self.batch_size * self.world_size}

    def load_state_dict(self, state: dict) -> None:
        if state.get("directory") not in (None, str(self.directory)):
            raise ConfigError(f"stream state: it trained on {state['directory']}, this run streams "
                              f"{self.directory}")
        self.files = [dict(f) for f in state.get("files", [])]
        self.late = list(state.get("late", []))
        self._chunks, self._reading, self._buffer, self._seq = None, None, self._new_buffer(), 0

    def _new_buffer(self) -> _Buffer:
        return _Buffer(self.rank, self.world_size) if self._own_rows else _Buffer()

    def summary(self, files: list[dict] | None = None) -> dict:
        """summary.json's ``stream``: of ``files`` (a position's; None: the files as read)."""
        files = self.files if files is None else files
        return {"directory": str(self.directory), "rows": sum(int(f["rows"]) for f in files),
                "files_done": sum(1 for f in files if f["done"]), "files_waiting": self.waiting,
                "stopped": self.stopped, "late": list(self.late),
                "files": [{k: f.get(k) for k in ("name", "rows", "bad_lines", "done", "landed")} for f in files]}

    # -- batches -----------------------------------------------------------------
    def __iter__(self) -> Iterator[Batch]:
        g = self.batch_size * self.world_size
        while True:
            while self._buffer.rows < g and self.stopped is None:
                if self._chunks is None and not self._open_next():
                    break
                item = next(self._chunks, None)
                if item is None:
                    self._end_of_file()
                    continue
                self._add(item[0])
            if self._buffer.rows == 0:
                return
            if self._buffer.rows < g and self.stopped is None:
                continue
            yield self._batch(self._buffer.take(min(g, self._buffer.rows)))

    def _add(self, chunk: RowChunk) -> None:
        if self._own_rows:  # (the reader parsed this rank's rows of the block: _rows_of)
            rows, first = self._pending
            self._buffer.add(self._reading, chunk, rows, first)
            return
        n = len(chunk)
        if self._skip:  # rows a checkpoint says were trained
            drop = min(self._skip, n)
            self._skip -= drop
            chunk = _rows(chunk, drop, n) if drop < n else None
        self._read += n
        if chunk is not None:
            self._buffer.add(self._reading, chunk, len(chunk), self._seq)
            self._seq += len(chunk)

    def _rows_of(self, n: int) -> np.ndarray:
        """The reader's ``rows_of``: which of a block's ``n`` lines this rank parses (those
        past the rows a checkpoint says were trained, numbered ``i % world == rank``)."""
        drop = min(self._skip, n)
        self._skip -= drop
        self._read += n
        kept = n - drop
        self._pending = (kept, self._seq)
        first = (self.rank - self._seq) % self.world_size  # (the first of this rank's numbers)
        self._seq += kept
        return drop + np.arange(first, kept, self.world_size, dtype=np.int64)

    def _batch(self, pieces: list[tuple[int, RowChunk, int]]) -> Batch:
        for index, _, rows in pieces:
            f = self.files[index]
            f["rows"] += rows
            if f.get("total") is not None and f["rows"] >= f["total"]:
                f["done"] = True
        mine = _concat([c for _, c, _ in pieces])
        if not self._own_rows and self.world_size > 1:  # (a batch starts at a number divisible by world)
            mine = _rows(mine, self.rank, None, self.world_size)
        ids = mine.onehot if self.encode is None else self.encode(mine.onehot)
        return Batch(dense=torch.from_numpy(np.ascontiguousarray(mine.dense, dtype=np.float32)),
                     sparse=keyed_ids(self.schema, ids, {}),
                     labels=torch.from_numpy(mine.labels.astype(np.float32)))

    # -- files ---------------------------------------------------------------------
    def _open_next(self) -> bool:
        """Open the next file to parse (a resumed run's unfinished one first); False: the
        stream ended (``self.stopped`` says why)."""
        unfinished = [i for i, f in enumerate(self.files) if not f.get("eof_read") and not f["done"]]
        if unfinished and self._reading is None:
            return self._open(unfinished[0], resume=True)
        record = self._next_record()
        if record is None:
            return False
        self.files.append({**record, "rows": 0, "done": False, "total": None, "bad_lines": 0})
        return self._open(len(self.files) - 1, resume=False)

    def _open(self, index: int, *, resume: bool) -> bool:
        f = self.files[index]
        path = self.directory / f["name"]
        try:
            now = _fingerprint(path)
        except FileNotFoundError:
            raise DataError(f"{path}: gone, but the stream has trained only {f['rows']:,} of its rows "
                            "(a stream file must stay until it is trained)") from None
        if any(now[k] != f[k] for k in ("size", "mtime_ns", "ino")):
            raise DataError(f"{path}: changed after it was picked up (size {f['size']:,} -> {now['size']:,} "
                            "bytes); a stream file must not change once it has landed")
        self._reading, self._read, self._skip = index, 0, int(f["rows"]) if resume else 0
        self._report = ParseReport()
        reader = stream_reader(path, spec=self.spec, on_bad_line=self.on_bad_line)
        if self._own_rows:
            reader.rows_of = self._rows_of
        self._chunks = reader.read(path, self._report)
        return True

    def _end_of_file(self) -> None:
        f = self.files[self._reading]
        path = self.directory / f["name"]
        try:
            now = _fingerprint(path)
        except FileNotFoundError:
            now = {}
        if any(now.get(k) != f[k] for k in ("size", "mtime_ns", "ino")):
            raise DataError(f"{path}: changed while it was read (size {f['size']:,} -> "
                            f"{now.get('size', 0):,} bytes); a stream file must not change once it has landed")
        f["total"] = self._read
        f["bad_lines"] = self._report.bad_lines_skipped
        f["eof_read"] = True
        if self._report.bad_lines_skipped:
            self.show(f"{path}: skipped {self._report.bad_lines_skipped:,} malformed line(s), e.g. "
                      f"{self._report.bad_line_examples[0]}")
        if f["rows"] >= f["total"]:
            f["done"] = True
        self._chunks, self._reading = None, None

    def _next_record(self) -> dict | None:
        """The next file to read, as rank 0 sees the directory (every rank gets its record),
        waiting for one as ``data.stream_stop`` allows; None: the stream ended."""
        while True:
            decision = rank0_value(self._look() if self.rank == 0 else None, self.group, device=self.device)
            self.waiting = int(decision.get("waiting", 0))
            if decision["what"] == "file":
                self._idle_since = time.time()
                return decision["file"]
            if decision["what"] == "stop":
                self.stopped = decision["why"]
                return None
            time.sleep(self.poll_s)

    def _look(self) -> dict:
        """Rank 0's decision: the next file, stop, or wait."""
        if self.stop.kind == "files" and len(self.files) >= self.stop.value:
            return {"what": "stop", "why": f"files:{int(self.stop.value)}"}
        last = self.files[-1]["name"] if self.files else None
        known = {f["name"] for f in self.files} | set(self.late)
        try:
            names = sorted(e.name for e in os.scandir(self.directory) if e.is_file() and is_stream_file(e.name))
        except OSError as e:
            raise DataError(f"data.stream {self.directory}: cannot list it ({e.strerror})") from None
        for name in names:
            if name not in known and last is not None and name < last:
                warnings.warn(f"{self.directory / name}: landed after {last}, which sorts after it; "
                              "skipped (a stream is read in name order)", stacklevel=2)
                self.late.append(name)
        fresh = [n for n in names if n not in known and (last is None or n > last)]
        if fresh:
            path = self.directory / fresh[0]
            try:
                st = path.stat()
            except FileNotFoundError:
                return {"what": "wait", "waiting": len(fresh) - 1}
            record = {"name": fresh[0], "size": st.st_size, "mtime_ns": st.st_mtime_ns, "ino": st.st_ino,
                      "landed": st.st_ctime}  # (a rename sets the ctime: when the file landed)
            return {"what": "file", "file": record, "waiting": len(fresh) - 1}
        if self.stop.kind == "idle" and time.time() - self._idle_since >= self.stop.value:
            return {"what": "stop", "why": f"idle:{self.stop.value:g}"}
        return {"what": "wait", "waiting": 0}
