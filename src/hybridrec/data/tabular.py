"""Generic CSV and Parquet click logs with a declared schema (a JSON file).

Schema file (all keys but ``label`` optional)::

    {
      "label": "clicked",                  0/1 (CSV also: true/false, 0.0/1.0)
      "dense": ["price", "age"],           numbers; empty/null/NaN = missing -> 0
      "categorical": ["city", "device"],   one id per row; empty/null = missing -> id 0
      "multihot": ["tags"],                a list of ids per row
      "table_size": 100000,                or {"city": 1000, "*": 100000}; ids = key % size
      "min_count": null,                   or K: vocabulary of keys seen >= K times in train
      "dense_transform": "log1p",          or "none"
      "list_delimiter": "|",               CSV only: separator inside a multi-hot cell
      "csv_delimiter": ","                 CSV only: the field separator
    }

Features are ordered categorical then multihot. Keys: Parquet integer values are
used as they are (masked to 63 bits); every string (every CSV cell) is hashed with
BLAKE2b-64, which is stable across runs and machines (Python's ``hash()`` is
salted per process). In CSV a multi-hot cell is a ``list_delimiter``-separated
string (``"a|b|c"``; empty cell = empty bag); in Parquet a ``list<int>`` or
``list<string>`` column (null list = empty bag, null elements dropped).
"""

from __future__ import annotations

import csv
import hashlib
import io
import itertools
import os
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from hybridrec.data.chunk import (
    DENSE_TRANSFORMS,
    MISSING,
    ParseReport,
    RowChunk,
    check_on_bad_line,
    show,
    transform_dense,
)
from hybridrec.data.inputs import open_input
from hybridrec.errors import DataError

_TRUE = ("1", "1.0", "true", "True", "TRUE")
_FALSE = ("0", "0.0", "false", "False", "FALSE")
_KEY_MASK = np.int64(0x7FFF_FFFF_FFFF_FFFF)  # keys are non-negative; -1 means missing


@dataclass(kw_only=True)
class TabularSpec:
    """The declared schema of a CSV / Parquet input (see the module docstring)."""

    label: str
    """Label column (0/1)."""
    dense: list[str] = field(default_factory=list)
    """Numeric columns, in output order."""
    categorical: list[str] = field(default_factory=list)
    """One-id-per-row columns (int or string)."""
    multihot: list[str] = field(default_factory=list)
    """List columns (Parquet list<int|string>; CSV delimiter-separated cells)."""
    table_size: Any = None
    """int, ``{feature: size, "*": default}``, or None (then min_count decides)."""
    min_count: int | None = None
    """Vocabulary threshold; None: modulo the table size only."""
    dense_transform: str = "log1p"
    """``log1p`` (negative -> 0, then log(x+1)) or ``none``."""
    list_delimiter: str = "|"
    """CSV: separator of the ids inside a multi-hot cell."""
    csv_delimiter: str = ","
    """CSV: the field separator."""
    source: str = "schema"
    """Where the spec came from (for error messages)."""

    def __post_init__(self) -> None:
        if self.dense_transform not in DENSE_TRANSFORMS:
            raise DataError(
                f"{self.source}: dense_transform {self.dense_transform!r} is not one of "
                f"{DENSE_TRANSFORMS}"
            )
        if len(self.list_delimiter) != 1 or len(self.csv_delimiter) != 1:
            raise DataError(f"{self.source}: list_delimiter and csv_delimiter must be 1 character")

    @property
    def feature_names(self) -> list[str]:
        return [*self.categorical, *self.multihot]

    @property
    def columns(self) -> list[str]:
        return [self.label, *self.dense, *self.categorical, *self.multihot]

    @staticmethod
    def load(path: str | os.PathLike) -> TabularSpec:
        from hybridrec.data.schema import _parse_json

        path = Path(path)
        if not path.is_file():
            raise DataError(f"{path}: schema file does not exist")
        d = _parse_json(path.read_text(), str(path))
        known = {f for f in TabularSpec.__dataclass_fields__ if f != "source"}
        unknown = sorted(set(d) - known)
        if unknown:
            raise DataError(f"{path}: unknown schema keys {unknown} (known: {sorted(known)})")
        if "label" not in d:
            raise DataError(f"{path}: the schema must name the 'label' column")
        return TabularSpec(**d, source=str(path))


def hash_strings(values: np.ndarray) -> np.ndarray:
    """Stable 63-bit keys of strings (BLAKE2b, 8 bytes): same input, same key, everywhere."""
    return np.fromiter(
        (
            int.from_bytes(hashlib.blake2b(str(s).encode(), digest_size=8).digest(), "little") >> 1
            for s in values
        ),
        dtype=np.int64,
        count=len(values),
    )


def _hash_column(strings: np.ndarray) -> np.ndarray:
    """Hash each distinct string once."""
    if strings.size == 0:
        return np.zeros(0, np.int64)
    u, inv = np.unique(strings, return_inverse=True)
    return hash_strings(u)[inv.reshape(-1)]


class _Columns:
    """Converted columns of one block and, per row, the first bad field (for messages)."""

    def __init__(self, n: int, n_cols: int) -> None:
        self.n = n
        self.bad = np.zeros((n, n_cols), dtype=bool)
        self.reasons: list[Callable[[int], str]] = []
        self.values: list[Any] = []

    def add(self, value: Any, bad: np.ndarray, reason: Callable[[int], str]) -> None:
        self.bad[:, len(self.values)] = bad
        self.reasons.append(reason)
        self.values.append(value)


def _finish(
    spec: TabularSpec,
    cols: _Columns,
    where: Callable[[int], str],
    col_no: list[int],
    on_bad_line: str,
    report: ParseReport,
) -> RowChunk:
    """Raise for / skip the bad rows, then assemble the chunk."""
    names = spec.columns
    keep = ~cols.bad.any(axis=1)
    if not keep.all():

        def message(r: int) -> str:
            c = int(np.argmax(cols.bad[r]))
            return f"{where(r)}: field {names[c]} (column {col_no[c]}): {cols.reasons[c](r)}"

        bad_rows = np.flatnonzero(~keep)
        if on_bad_line == "error":
            raise DataError(message(int(bad_rows[0])))
        report.skipped(len(bad_rows), (message(int(r)) for r in bad_rows))
    nd, nc = len(spec.dense), len(spec.categorical)
    v = cols.values
    dense = np.stack(v[1 : 1 + nd], axis=1) if nd else np.zeros((cols.n, 0))
    onehot = np.stack(v[1 + nd : 1 + nd + nc], axis=1) if nc else np.zeros((cols.n, 0), np.int64)
    mh = {}
    for name, (keys, lengths) in zip(spec.multihot, v[1 + nd + nc :]):
        row_of = np.repeat(np.arange(cols.n), lengths)
        mh[name] = (keys[keep[row_of]], lengths[keep])
    return RowChunk(
        labels=v[0][keep],
        dense=transform_dense(dense[keep], spec.dense_transform),
        onehot=onehot[keep],
        multihot=mh,
    )


# ---------------------------------------------------------------- CSV


def _csv_label(col: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    one, zero = np.isin(col, _TRUE), np.isin(col, _FALSE)
    return one.astype(np.uint8), ~(one | zero)


def _csv_dense(col: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    present = col != ""
    out = np.zeros(col.size, np.float64)
    bad = np.zeros(col.size, bool)
    try:
        out[present] = col[present].astype(np.float64)
    except ValueError:  # locate the bad cells (rare: only blocks with an error get here)
        for i in np.flatnonzero(present):
            try:
                out[i] = float(col[i])
            except ValueError:
                bad[i] = True
    bad |= np.isinf(out)
    out[np.isnan(out) | bad] = 0.0  # NaN is a missing value
    return out, bad


def _csv_keys(col: np.ndarray) -> np.ndarray:
    keys = _hash_column(col)
    keys[col == ""] = MISSING
    return keys


def _csv_lists(col: np.ndarray, delim: str):
    parts = [s.split(delim) if s else [] for s in col.tolist()]
    lengths = np.fromiter(map(len, parts), dtype=np.int64, count=len(parts))
    tokens = np.array(list(itertools.chain.from_iterable(parts)), dtype=str)
    row_of = np.repeat(np.arange(col.size), lengths)
    bad = np.zeros(col.size, bool)
    bad[row_of[tokens == ""]] = True  # "a||b" or a trailing delimiter
    return (_hash_column(tokens), lengths), bad


@dataclass(kw_only=True)
class CsvReader:
    """CSV with a header row; blank lines are ignored. Plain or gzip."""

    spec: TabularSpec
    on_bad_line: str = "error"
    chunk_rows: int = 1 << 16

    def __post_init__(self) -> None:
        check_on_bad_line(self.on_bad_line)

    def read(self, path: str | os.PathLike, report: ParseReport) -> Iterator[tuple[RowChunk, int]]:
        with open_input(path) as f:
            text = io.TextIOWrapper(f.stream, encoding="utf-8", newline="")
            reader = csv.reader(text, delimiter=self.spec.csv_delimiter)
            try:
                yield from self._read_rows(reader, f.path, report, lambda: f.position)
            except (EOFError, OSError, zlib.error) as e:
                raise DataError(f"{f.path}: truncated or corrupt input ({e})") from None
            except UnicodeDecodeError:
                raise DataError(f"{f.path}:{reader.line_num + 1}: not UTF-8 text") from None
            except csv.Error as e:
                raise DataError(f"{f.path}:{reader.line_num}: {e}") from None

    def _read_rows(self, reader, path: Path, report: ParseReport, position):
        header = next(reader, None)
        if header is None:
            raise DataError(f"{path}: empty file (no header line)")
        index = _column_index(self.spec, header, path)
        rows: list[list[str]] = []
        lines: list[int] = []
        for row in reader:
            if not row:
                continue
            rows.append(row)
            lines.append(reader.line_num)
            if len(rows) == self.chunk_rows:
                yield self._convert(rows, lines, len(header), index, path, report), position()
                rows, lines = [], []
        if rows:
            yield self._convert(rows, lines, len(header), index, path, report), position()

    def _convert(self, rows, lines, width, index, path, report) -> RowChunk:
        report.lines_read += len(rows)
        short = [i for i, r in enumerate(rows) if len(r) != width]
        if short:
            msgs = (
                f"{path}:{lines[i]}: expected {width} fields, got {len(rows[i])}" for i in short
            )
            if self.on_bad_line == "error":
                # A bad value before the first short row is the first error of the file.
                self._convert(rows[: short[0]], lines[: short[0]], width, index, path, report)
                raise DataError(next(msgs))
            report.skipped(len(short), msgs)
            drop = set(short)
            lines = [ln for i, ln in enumerate(lines) if i not in drop]
            rows = [r for i, r in enumerate(rows) if i not in drop]
        by_col = list(zip(*rows)) if rows else [()] * width
        spec = self.spec
        cols = _Columns(len(rows), len(spec.columns))
        arr = [np.array(by_col[index[c]], dtype=str) for c in spec.columns]

        def text(a: np.ndarray) -> Callable[[int], str]:
            return lambda r: show(a[r])

        label = arr[0]
        cols.add(*_csv_label(label), lambda r: f"label must be 0 or 1, got {show(label[r])}")
        for a in arr[1 : 1 + len(spec.dense)]:
            cols.add(*_csv_dense(a), lambda r, a=a: f"not a finite number: {show(a[r])}")
        for a in arr[1 + len(spec.dense) : 1 + len(spec.dense) + len(spec.categorical)]:
            cols.add(_csv_keys(a), np.zeros(a.size, bool), text(a))
        for a in arr[1 + len(spec.dense) + len(spec.categorical) :]:
            cols.add(
                *_csv_lists(a, spec.list_delimiter), lambda r, a=a: f"empty id in list {show(a[r])}"
            )
        col_no = [index[c] + 1 for c in spec.columns]
        return _finish(spec, cols, lambda r: f"{path}:{lines[r]}", col_no, self.on_bad_line, report)


def _column_index(spec: TabularSpec, names: list[str], path: Path) -> dict[str, int]:
    index = {n: i for i, n in enumerate(names)}
    for c in spec.columns:
        if c not in index:
            raise DataError(
                f"{path}: column {c!r} named in {spec.source} is not in the file "
                f"(columns: {', '.join(names[:20])}{' ...' if len(names) > 20 else ''})"
            )
    return index


# ---------------------------------------------------------------- Parquet


def _pyarrow():
    try:
        import pyarrow as pa
        import pyarrow.compute as pc
        import pyarrow.parquet as pq
    except ImportError:
        raise DataError(
            "reading Parquet needs pyarrow: pip install pyarrow "
            "(or pip install 'hybridrec[parquet]')"
        ) from None
    return pa, pc, pq


def _pa_keys(arr, name: str, path: Path) -> np.ndarray:
    """Integer columns as keys (63-bit mask), strings hashed; null -> MISSING."""
    pa, pc, _ = _pyarrow()
    t = arr.type
    if pa.types.is_dictionary(t):
        arr, t = arr.cast(t.value_type), t.value_type
    if pa.types.is_integer(t):
        keys = pc.fill_null(arr.cast(pa.int64()), 0).to_numpy(zero_copy_only=False) & _KEY_MASK
    elif pa.types.is_string(t) or pa.types.is_large_string(t):
        enc = arr.dictionary_encode()
        keys = (
            hash_strings(enc.dictionary.to_pylist())[
                pc.fill_null(enc.indices, 0).to_numpy(zero_copy_only=False)
            ]
            if len(enc.dictionary)
            else np.zeros(len(arr), np.int64)
        )
    else:
        raise DataError(f"{path}: column {name!r} has type {t}; ids must be integers or strings")
    keys = np.array(keys, dtype=np.int64)
    if arr.null_count:
        keys[arr.is_null().to_numpy(zero_copy_only=False)] = MISSING
    return keys


def _pa_lists(arr, name: str, path: Path):
    pa, pc, _ = _pyarrow()
    if not (pa.types.is_list(arr.type) or pa.types.is_large_list(arr.type)):
        raise DataError(f"{path}: multi-hot column {name!r} has type {arr.type}; expected a list")
    lengths = pc.fill_null(pc.list_value_length(arr), 0).to_numpy(zero_copy_only=False)
    lengths = lengths.astype(np.int64)
    flat = arr.flatten()
    keys = _pa_keys(flat, name, path)
    if flat.null_count:  # null elements inside a list are dropped
        present = keys != MISSING
        row_of = np.repeat(np.arange(len(arr)), lengths)
        lengths = np.bincount(row_of[present], minlength=len(arr)).astype(np.int64)
        keys = keys[present]
    return keys, lengths


def _pa_numbers(arr, name: str, path: Path) -> tuple[np.ndarray, np.ndarray]:
    """Float64 values and null mask of a numeric (or boolean) column."""
    pa, pc, _ = _pyarrow()
    if not (
        pa.types.is_integer(arr.type)
        or pa.types.is_floating(arr.type)
        or pa.types.is_boolean(arr.type)
    ):
        raise DataError(f"{path}: column {name!r} has type {arr.type}; expected numbers")
    null = arr.is_null().to_numpy(zero_copy_only=False)
    values = pc.fill_null(arr.cast(pa.float64()), 0.0).to_numpy(zero_copy_only=False)
    return np.array(values, dtype=np.float64), null


@dataclass(kw_only=True)
class ParquetReader:
    """Parquet files via pyarrow, read in record batches."""

    spec: TabularSpec
    on_bad_line: str = "error"
    batch_rows: int = 1 << 16

    def __post_init__(self) -> None:
        check_on_bad_line(self.on_bad_line)

    def read(self, path: str | os.PathLike, report: ParseReport) -> Iterator[tuple[RowChunk, int]]:
        pa, _, pq = _pyarrow()
        path = Path(path)
        try:
            pf = pq.ParquetFile(path)
        except (pa.ArrowException, OSError) as e:
            raise DataError(f"{path}: not a readable Parquet file ({e})") from None
        names = pf.schema_arrow.names
        index = _column_index(self.spec, names, path)
        total = max(pf.metadata.num_rows, 1)
        size = path.stat().st_size
        done = 0
        try:
            for batch in pf.iter_batches(batch_size=self.batch_rows, columns=self.spec.columns):
                chunk = self._convert(batch, done, index, path, report)
                done += batch.num_rows
                yield chunk, size * done // total
        except (pa.ArrowException, OSError) as e:
            raise DataError(f"{path}: corrupt Parquet data after row {done} ({e})") from None
        if done == 0:
            raise DataError(f"{path}: empty file (no rows)")

    def _convert(self, batch, first_row: int, index, path: Path, report: ParseReport) -> RowChunk:
        spec = self.spec
        n = batch.num_rows
        report.lines_read += n
        col = {name: batch.column(i) for i, name in enumerate(batch.schema.names)}
        cols = _Columns(n, len(spec.columns))
        label, null = _pa_numbers(col[spec.label], spec.label, path)
        bad = null | ((label != 0) & (label != 1))
        cols.add(
            label.astype(np.uint8),
            bad,
            lambda r: f"label must be 0 or 1, got {'null' if null[r] else label[r]!r}",
        )
        for name in spec.dense:
            values, _ = _pa_numbers(col[name], name, path)
            bad = np.isinf(values)
            values[np.isnan(values) | bad] = 0.0  # null and NaN are missing values
            cols.add(values, bad, lambda r: "not a finite number")
        for name in spec.categorical:
            cols.add(_pa_keys(col[name], name, path), np.zeros(n, bool), lambda r: "")
        for name in spec.multihot:
            cols.add(_pa_lists(col[name], name, path), np.zeros(n, bool), lambda r: "")
        col_no = [index[c] + 1 for c in spec.columns]
        return _finish(
            spec,
            cols,
            lambda r: f"{path}: row {first_row + r + 1}",
            col_no,
            self.on_bad_line,
            report,
        )
