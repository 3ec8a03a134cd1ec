"""Writing part directories (streamed ``.npy`` arrays) and the per-feature statistics.

Row counts are unknown until a file has been read, so arrays are appended to an
``.npy`` whose header reserves room for any shape and is rewritten on close: one
pass, no temporary copy.
"""

from __future__ import annotations

import math
import os
import shutil
import warnings
from collections.abc import Callable
from pathlib import Path

import numpy as np

from hybridrec.data.encode import KeyCounter
from hybridrec.data.id_ranges import Range, column_ranges, merge, range_problem, write_cache
from hybridrec.data.schema import Schema
from hybridrec.errors import DataError, HybridrecWarning

ID_COUNTS_SUFFIX = ".id_counts.npy"
"""``stats/<feature>.id_counts.npy``: int64 ``[distinct, 2]``, (id, count) rows by id."""

COUNTS_FILE_MAX_ROWS = 50_000_000
"""Datasets written before the sparse counts had a dense ``stats/<feature>.counts.npy``
for tables up to this size only."""

TMP_MARK = ".tmp-"
"""Outputs are written as ``NAME.tmp-<pid>`` and renamed to ``NAME`` when complete."""

_NPY_MAGIC = b"\x93NUMPY\x01\x00"
_NPY_ALIGN = 64


def _npy_header(dtype: np.dtype, shape: tuple[int, ...], total: int | None = None) -> bytes:
    """A version-1.0 ``.npy`` header, space-padded to ``total`` bytes (or to 64-alignment)."""
    d = {"descr": np.lib.format.dtype_to_descr(dtype), "fortran_order": False, "shape": shape}
    text = repr(d).encode("latin1")
    if total is None:
        total = -(-(len(_NPY_MAGIC) + 2 + len(text) + 1) // _NPY_ALIGN) * _NPY_ALIGN
    pad = total - len(_NPY_MAGIC) - 2 - len(text) - 1
    if pad < 0:
        raise ValueError("npy header does not fit the reserved space")
    body = text + b" " * pad + b"\n"
    return _NPY_MAGIC + len(body).to_bytes(2, "little") + body


class NpyAppender:
    """An ``.npy`` file of ``[rows, *inner]`` written by appending blocks of rows."""

    def __init__(self, path: Path, dtype: np.dtype | str, inner: tuple[int, ...] = ()) -> None:
        self.path = Path(path)
        self.dtype = np.dtype(dtype).newbyteorder("<")
        self.inner = tuple(inner)
        self.rows = 0
        # Reserve the header size of the largest shape we could ever write.
        self._header_size = len(_npy_header(self.dtype, (10**18, *self.inner)))
        self._f = open(self.path, "wb")  # noqa: SIM115 (closed in close())
        self._f.write(_npy_header(self.dtype, (0, *self.inner), self._header_size))

    def append(self, block: np.ndarray) -> None:
        block = np.ascontiguousarray(block, dtype=self.dtype)
        if block.shape[1:] != self.inner:
            raise ValueError(f"{self.path.name}: block shape {block.shape} vs inner {self.inner}")
        if block.size:  # memoryview.cast refuses zero-sized shapes
            self._f.write(memoryview(block).cast("B"))
        self.rows += block.shape[0]

    def close(self) -> None:
        if self._f.closed:
            return
        self._f.seek(0)
        self._f.write(_npy_header(self.dtype, (self.rows, *self.inner), self._header_size))
        self._f.close()

    def abort(self) -> None:
        self._f.close()


class PartWriter:
    """Writes one ``part-XXXXX/`` directory (docs/data-format.md)."""

    def __init__(self, directory: Path, schema: Schema, source: str = "") -> None:
        self.directory = Path(directory)
        self.directory.mkdir(parents=True)
        self.source = source or str(self.directory)
        self.num_embeddings = schema.num_embeddings
        self.onehot_names = [f.name for f in schema.onehot]
        self.ranges: dict[str, Range] = dict.fromkeys(schema.feature_names)
        d = self.directory
        self.labels = NpyAppender(d / "labels.npy", np.uint8)
        self.dense = NpyAppender(d / "dense.npy", np.float32, (len(schema.dense),))
        self.onehot = NpyAppender(d / "onehot.npy", np.int32, (len(schema.onehot),))
        self.mh: dict[str, tuple[NpyAppender, NpyAppender]] = {}
        for f in schema.multihot:
            values = NpyAppender(d / f"mh-{f.name}.values.npy", np.int32)
            offsets = NpyAppender(d / f"mh-{f.name}.offsets.npy", np.int64)
            offsets.append(np.zeros(1, np.int64))
            self.mh[f.name] = (values, offsets)
        self._nnz = dict.fromkeys(self.mh, 0)

    @property
    def rows(self) -> int:
        return self.labels.rows

    def append(
        self,
        labels: np.ndarray,
        dense: np.ndarray,
        onehot: np.ndarray,
        multihot: dict[str, tuple[np.ndarray, np.ndarray]],
    ) -> None:
        """One block: ids already encoded (int32); ``multihot[name] = (ids, lengths)``."""
        self._check_ids(zip(self.onehot_names, column_ranges(onehot)))
        self._check_ids((name, column_ranges(ids)[0]) for name, (ids, _) in multihot.items())
        self.labels.append(labels)
        self.dense.append(dense)
        self.onehot.append(onehot)
        for name, (values, offsets) in self.mh.items():
            ids, lengths = multihot[name]
            values.append(ids)
            offsets.append(self._nnz[name] + np.cumsum(lengths, dtype=np.int64))
            self._nnz[name] += int(ids.size)

    def _check_ids(self, found) -> None:
        """An encoder writes ids below its table's size; one that did not is a bug,
        stopped here rather than trained on."""
        for name, rng in found:
            problem = range_problem(name, rng, self.num_embeddings[name])
            if problem:
                raise DataError(f"{self.source}: the encoding wrote an id out of its table: "
                                f"{problem} (a bug in hybridrec's preprocessing)")
            self.ranges[name] = merge(self.ranges[name], rng)

    def _files(self) -> list[NpyAppender]:
        return [
            self.labels,
            self.dense,
            self.onehot,
            *(a for pair in self.mh.values() for a in pair),
        ]

    def close(self) -> int:
        """Finish the arrays, and the id ranges' cache that spares training a scan."""
        for f in self._files():
            f.close()
        cache = {"onehot.npy": {n: self.ranges[n] for n in self.onehot_names}}
        cache.update({f"mh-{n}.values.npy": {n: self.ranges[n]} for n in self.mh})
        write_cache(self.directory, cache)
        return self.rows

    def abort(self) -> None:
        for f in self._files():
            f.abort()


class FeatureStats:
    """Id frequencies of one feature over the train split, and the summary for the planner.

    Kept sparse (:class:`~hybridrec.data.encode.KeyCounter`: the distinct ids and their
    counts), so memory and ``stats/<feature>.id_counts.npy`` grow with the ids seen, not
    with the table: a table of 40,000,000 rows seen on 4,000 samples holds 4,000 counts
    (a dense count per row was 320 MB a table).
    """

    def __init__(self, name: str, num_embeddings: int, stats_dir: Path) -> None:
        self.name = name
        self.num_embeddings = num_embeddings
        self.rows = 0
        self.counts_file = stats_dir / f"{name}{ID_COUNTS_SUFFIX}"
        self._counter = KeyCounter()

    def add(self, ids: np.ndarray, rows: int) -> None:
        """Ids of ``rows`` samples (all ids of a multi-hot bag count)."""
        self.rows += rows
        self._counter.add(ids)

    def finish(self, dataset_dir: Path) -> dict:
        """Write the counts file and return the stats entry of meta.json."""
        ids, counts = self._counter.result()
        self.counts_file.parent.mkdir(exist_ok=True)
        np.save(self.counts_file, np.stack([ids, counts], axis=1).astype(np.int64))
        out = summarize_counts(counts, self.num_embeddings, self.rows)
        out["id_counts_file"] = os.path.relpath(self.counts_file, dataset_dir)
        return out


def read_id_counts(dataset_dir: Path, stats: dict) -> tuple[np.ndarray, np.ndarray]:
    """``(ids, counts)`` of a feature's stats entry in meta.json: the ids seen (sorted) and
    how often. Reads ``id_counts_file`` and the dense ``counts_file`` of datasets written
    before it (one count per table row)."""
    if "id_counts_file" in stats:
        pairs = np.load(Path(dataset_dir) / stats["id_counts_file"])
        return pairs[:, 0], pairs[:, 1]
    if "counts_file" in stats:
        dense = np.load(Path(dataset_dir) / stats["counts_file"], mmap_mode="r")
        ids = np.flatnonzero(dense)
        return ids, np.asarray(dense[ids])
    raise DataError(f"{dataset_dir}: the stats entry has no counts file (a table over "
                    f"{COUNTS_FILE_MAX_ROWS:,} rows of an older dataset)")


def summarize_counts(counts: np.ndarray, num_embeddings: int, rows: int) -> dict:
    """distinct, total_ids, mean_ids_per_sample and the share of accesses to the hottest rows.

    ``top1pct_share``: fraction of all id accesses that hit the ``ceil(1%)`` most
    frequent rows of the table (likewise 10%); a skew measure for caching and sharding.
    """
    total = int(counts.sum())
    out = {
        "num_embeddings": int(num_embeddings),
        "distinct": int(np.count_nonzero(counts)),
        "total_ids": total,
        "mean_ids_per_sample": total / rows if rows else 0.0,
    }
    for key, frac in (("top1pct_share", 0.01), ("top10pct_share", 0.10)):
        k = max(1, math.ceil(frac * num_embeddings))
        if total == 0:
            share = 0.0
        elif k >= counts.size:
            share = 1.0
        else:
            share = int(np.partition(counts, counts.size - k)[counts.size - k :].sum()) / total
        out[key] = share
    return out


# -- leftovers of interrupted runs ---------------------------------------------------------
def tmp_path(path: Path) -> Path:
    """Where this process writes ``path`` before renaming it into place."""
    return path.with_name(f"{path.name}{TMP_MARK}{os.getpid()}")


def clear_stale_tmp(directory: Path, owned: Callable[[str], bool]) -> list[Path]:
    """Remove ``NAME.tmp-<pid>`` in ``directory`` (for names ``owned(NAME)`` is true) whose
    process is gone: what a killed run left. One warning names what was removed, another
    the files of processes still running (another run writing the same output). Returns
    the removed paths."""
    if not directory.is_dir():
        return []
    removed, running = [], []
    for p in sorted(directory.iterdir()):
        name, mark, pid = p.name.rpartition(TMP_MARK)
        if not mark or not pid.isdigit() or not 0 < int(pid) < 2**31 or not owned(name):
            continue
        if int(pid) == os.getpid():
            continue  # this process's own: its writer replaces it
        if _process_alive(int(pid)):
            running.append(p)
            continue
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p)
        else:
            p.unlink()
        removed.append(p)
    if removed:
        warnings.warn(f"removed what an interrupted run left: {', '.join(map(str, removed))}",
                      HybridrecWarning, stacklevel=2)
    if running:
        warnings.warn(f"{', '.join(map(str, running))}: being written by another process that is "
                      "still running (the pid after .tmp-); the run that finishes last wins",
                      HybridrecWarning, stacklevel=2)
    return removed


def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # PermissionError: alive, another user's
        return True
    return True
