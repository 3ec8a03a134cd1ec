"""Every id inside its table, checked once per shard file before any step reads it.

An id at or past its table's size, or a negative one, does not fail where it is read:
the fused embedding storage holds the tables one after the other, so the id would read
and update another table's rows and train to the end; a very large one fails deep in
torch with no file or feature named, and in the eval split only after all of training.
So the id files of every part are checked when a loader opens the part:

- the scan: the smallest and largest id of each feature, per file (``onehot.npy``'s
  columns, each ``mh-<feature>.values.npy``), vectorised over blocks of rows;
- the cache: ``part-XXXXX/id_ranges.json`` keeps them, keyed by each file's inode,
  size, mtime and ctime (a content hash would cost the scan itself), so a later start
  reads a small JSON file instead of the shards. Preprocessing writes it as it writes the
  part. A cache that cannot be written (a read-only dataset) only means the next start
  scans again; one that cannot be read, or is stale, is ignored;
- the check: those ranges against the table sizes of ``meta.json``, on every start
  (a meta.json whose ``num_embeddings`` was lowered is caught with the cache too).

Size and mtime alone were not enough: a same-size rewrite whose mtime was put back
(``touch -r``, ``cp -p``, ``rsync -t``) kept its key and the stale ranges, and an id past
its table then failed deep in torch. The ctime cannot be set back (``utime`` itself moves
it to now) and a new file has another inode, so any write or replacement changes the key.
The price: what changes the ctime without the contents (``chmod``, ``chown``, a hard link)
or the inode (a copy) costs one more scan, after which the cache holds the new key; where
the part directory cannot be written then (``chmod -R a-w`` after preprocessing), at every
start. A read-only mount keeps the ctime: mount a finished dataset read-only rather than
``chmod`` it.

Limits: a file rewritten in place within one tick of the file system's clock after the
cache was written, at the same size, can keep its key (shards are written once, by
preprocessing); on a first start every rank of a run scans the parts it opens (the page
cache shares the reads) and writes the same cache.

The first bad feature of a file is one line: ``DIR/part-00003/onehot.npy: feature C7
holds id 1000000000, past its table of 100,000 rows (meta.json num_embeddings)``.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np

from hybridrec.errors import DataError

CACHE_NAME = "id_ranges.json"
"""The cache file in each part directory."""

CACHE_VERSION = 2
"""2: files keyed by inode, size, mtime and ctime (1: size and mtime)."""

SCAN_BYTES = 1 << 20
"""Bytes of ids reduced at a time (1 MiB: a block stays in the cache between its min and
max passes, 2-3x faster than 32 MiB blocks); the scan's memory, whatever the shard's size."""

FOLD = 16
"""Rows reduced side by side (see :func:`column_ranges`)."""

Range = tuple[int, int] | None
"""``(smallest, largest)`` id of a feature in a file; None when it holds none."""


# -- the scan ---------------------------------------------------------------------------
def column_ranges(ids: np.ndarray) -> list[Range]:
    """``(min, max)`` of each column of a ``[rows, columns]`` id array (a 1-D array is
    one column), in blocks of rows of about :data:`SCAN_BYTES`."""
    cols = ids if ids.ndim == 2 else ids.reshape(-1, 1)
    if cols.shape[0] == 0 or cols.shape[1] == 0:
        return [None] * cols.shape[1]
    c = cols.shape[1]
    step = max(FOLD, SCAN_BYTES // max(1, c * cols.itemsize) // FOLD * FOLD)
    lo = hi = None
    for start in range(0, cols.shape[0], step):
        block = np.asarray(cols[start:start + step])
        whole = block.shape[0] // FOLD * FOLD
        # FOLD rows side by side: numpy's reduction runs over rows FOLD times as wide,
        # twice as fast for Criteo's 26 columns; the FOLD partial results are folded after.
        for part in (block[:whole].reshape(-1, FOLD * c), block[whole:]):
            if part.shape[0] == 0:
                continue
            b_lo = part.min(axis=0).reshape(-1, c).min(axis=0)
            b_hi = part.max(axis=0).reshape(-1, c).max(axis=0)
            lo = b_lo if lo is None else np.minimum(lo, b_lo)
            hi = b_hi if hi is None else np.maximum(hi, b_hi)
    return [(int(a), int(b)) for a, b in zip(lo, hi)]


def merge(a: Range, b: Range) -> Range:
    """The range of two ranges' ids together."""
    if a is None or b is None:
        return b if a is None else a
    return min(a[0], b[0]), max(a[1], b[1])


# -- the check --------------------------------------------------------------------------
def range_problem(feature: str, found: Range, num_embeddings: int) -> str | None:
    """What is wrong with ``feature``'s ids spanning ``found`` for a table of
    ``num_embeddings`` rows (None: nothing)."""
    if found is None:
        return None
    lo, hi = found
    if hi >= num_embeddings:
        return f"feature {feature} holds id {hi}, past its table of {num_embeddings:,} rows"
    if lo < 0:
        return (f"feature {feature} holds id {lo}, a negative id (its table's rows are "
                f"0 to {num_embeddings - 1:,})")
    return None


def check_part_ids(directory: Path, files: Mapping[str, tuple[np.ndarray, Sequence[str]]],
                   num_embeddings: Mapping[str, int]) -> None:
    """Raise :class:`DataError` naming the file, the feature, the id and the table size
    when a file of the part holds an id outside its feature's table.

    ``files``: ``{file name: (its opened id array, the feature of each column)}``.
    """
    for name, found in part_ranges(directory, files).items():
        for feature, rng in found.items():
            problem = range_problem(feature, rng, num_embeddings[feature])
            if problem:
                raise DataError(f"{directory / name}: {problem} (meta.json num_embeddings)")


def part_ranges(directory: Path, files: Mapping[str, tuple[np.ndarray, Sequence[str]]]
                ) -> dict[str, dict[str, Range]]:
    """``{file name: {feature: range}}`` of a part: from the cache where it still
    describes the file, else scanned (and the cache rewritten)."""
    cache = read_cache(directory)
    out: dict[str, dict[str, Range]] = {}
    stale = False
    for name, (array, features) in files.items():
        key = file_key(directory / name)
        cached = _cached(cache.get(name), key, features)
        if cached is not None:
            out[name] = cached
            continue
        out[name] = dict(zip(features, column_ranges(array)))
        stale = True
    if stale:
        write_cache(directory, out)
    return out


# -- the cache --------------------------------------------------------------------------
def file_key(path: Path) -> list[int]:
    """What says a file is unchanged: its inode, size, modification and change times (ns)
    (see the module's docstring)."""
    st = path.stat()
    return [st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns]


def read_cache(directory: Path) -> dict[str, dict]:
    """The cache's entries by file name; empty when it is absent, unreadable or of
    another version (it is only ever an optimisation)."""
    try:
        d = json.loads((directory / CACHE_NAME).read_text())
        if d.get("version") != CACHE_VERSION or not isinstance(d.get("files"), dict):
            return {}
        return {k: v for k, v in d["files"].items()
                if isinstance(v, dict) and isinstance(v.get("ranges"), dict)}
    except (OSError, ValueError, AttributeError):
        return {}


def write_cache(directory: Path, ranges: Mapping[str, Mapping[str, Range]]) -> bool:
    """Write the cache (through a temporary file: ranks may write it at once); False when
    the directory is not writable, which is fine: the next start scans again."""
    try:
        files = {name: {"key": file_key(directory / name),
                        "ranges": {f: list(r) if r else None for f, r in found.items()}}
                 for name, found in ranges.items()}
    except OSError:
        return False
    tmp = directory / f"{CACHE_NAME}.tmp-{os.getpid()}"
    try:
        tmp.write_text(json.dumps({"version": CACHE_VERSION, "files": files}) + "\n")
        os.replace(tmp, directory / CACHE_NAME)
        return True
    except OSError:
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)
        return False


def _cached(entry: dict | None, key: list[int], features: Sequence[str]) -> dict[str, Range] | None:
    """A cache entry's ranges if it describes this very file and these features."""
    if entry is None or entry.get("key") != key or list(entry["ranges"]) != list(features):
        return None
    try:
        return {f: None if r is None else (int(r[0]), int(r[1])) for f, r in entry["ranges"].items()}
    except (TypeError, ValueError, IndexError):
        return None
