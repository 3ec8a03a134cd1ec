"""Generic CSV and Parquet click logs with a declared schema (a JSON file).

Schema file (all keys but ``label`` optional)::

    {
      "label": "clicked",                  0/1 (CSV also: true/false, 0.0/1.0), unless mapped:
      "label_positive": [">50K"],          the label's values that are 1 ...
      "label_negative": ["<=50K"],         ... and those that are 0 (both lists, disjoint)
      "label_threshold": 4,                or: a number >= 4 is 1, below is 0 (e.g. ratings)
      "dense": ["price", "age"],           numbers; empty/null/NaN = missing (0 after the transform)
      "categorical": ["city", "device"],   one id per row; empty/null = missing -> id 0
      "multihot": ["tags"],                a list of ids per row
      "table_size": 100000,                or {"city": 1000, "*": 100000}; ids = key % size
      "min_count": null,                   or K: vocabulary of keys seen >= K times in train
      "dense_transform": "auto",           or log1p, standardize, none, or per column:
                                           {"age": "standardize", "*": "auto"} (data/dense.py)
      "list_delimiter": "|",               CSV only: separator inside a multi-hot cell
      "csv_delimiter": ","                 CSV only: the field separator
    }

Features are ordered categorical then multihot. Keys: Parquet integer values are
used as they are (masked to 63 bits); every string (every CSV cell) is hashed with
BLAKE2b-64, which is stable across runs and machines (Python's ``hash()`` is
salted per process). In CSV a multi-hot cell is a ``list_delimiter``-separated
string (``"a|b|c"``; empty cell = empty bag); in Parquet a ``list<int>`` or
``list<string>`` column (null list = empty bag, null elements dropped).

Label mapping: with ``label_positive`` and ``label_negative`` the label column holds
classes, matched as text without surrounding whitespace (a number in the lists is its text:
``4`` matches the CSV cell ``4`` and the Parquet value ``4`` or ``4.0``); with
``label_threshold`` it holds numbers (Parquet: a numeric column, or strings of numbers). A value
that maps to neither (a class in no list, an empty/null/NaN label, a non-number under a
threshold) is a bad row: ``FILE:LINE`` (CSV) or ``FILE: row N`` (Parquet), the column and
the value, like any other bad field.
"""

from __future__ import annotations

import csv
import hashlib
import io
import itertools
import math
import os
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from hybridrec.data import dense as dense_transforms
from hybridrec.data.chunk import (
    MAX_LINE_BYTES,
    MISSING,
    ParseReport,
    RowChunk,
    capped_lines,
    check_on_bad_line,
    show,
)
from hybridrec.data.inputs import open_input
from hybridrec.errors import DataError

_TRUE = ("1", "1.0", "true", "True", "TRUE")
_FALSE = ("0", "0.0", "false", "False", "FALSE")
KEY_MASK = np.int64(0x7FFF_FFFF_FFFF_FFFF)
"""What an integer id keeps as its key (63 bits: keys are non-negative; -1 means missing)."""


@dataclass(kw_only=True)
class TabularSpec:
    """The declared schema of a CSV / Parquet input (see the module docstring)."""

    label: str
    """Label column (0/1, unless mapped by the three keys below)."""
    label_positive: Any = None
    """Label values that mean 1 (a string or number, or a list of them), e.g. ``">50K"``;
    with ``label_negative``, which must be given too."""
    label_negative: Any = None
    """Label values that mean 0; every label must be in one of the two lists."""
    label_threshold: Any = None
    """A numeric label: ``value >= label_threshold`` is 1, below is 0 (e.g. a 1-5 rating and 4)."""
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
    dense_transform: Any = "auto"
    """Per column ``auto`` (counts ``log1p``, others ``standardize``), ``log1p``, ``standardize``
    or ``none``: one for every column or ``{column: choice, "*": default}``
    (:mod:`hybridrec.data.dense`)."""
    list_delimiter: str = "|"
    """CSV: separator of the ids inside a multi-hot cell."""
    csv_delimiter: str = ","
    """CSV: the field separator."""
    source: str = "schema"
    """Where the spec came from (for error messages)."""

    def __post_init__(self) -> None:
        self.dense_plan = dense_transforms.parse(self.dense_transform, self.dense, self.source)
        self.dense_columns: list[dense_transforms.Column] | None = dense_transforms.resolved(self.dense_plan)
        """The transforms the readers apply; None: choices left to the values, which
        preprocessing makes in a pass of its own and sets here (a reader without them reads
        as a stream does: :meth:`reader_columns`)."""
        self.raw_dense = False
        """Readers yield the raw values, NaN missing (preprocessing's statistics pass)."""
        if len(self.list_delimiter) != 1 or len(self.csv_delimiter) != 1:
            raise DataError(f"{self.source}: list_delimiter and csv_delimiter must be 1 character")
        self._check_label_map()

    def _check_label_map(self) -> None:
        src, pos, neg, thr = self.source, self.label_positive, self.label_negative, self.label_threshold
        if thr is not None:
            if pos is not None or neg is not None:
                raise DataError(f"{src}: label_threshold and label_positive/label_negative are two "
                                "ways to map the label; give one")
            if isinstance(thr, bool) or not isinstance(thr, (int, float)) or not math.isfinite(thr):
                raise DataError(f"{src}: label_threshold must be a finite number, got {thr!r}")
            return
        if pos is None and neg is None:
            return
        if pos is None or neg is None:
            given, missing = ("label_positive", "label_negative") if neg is None else \
                ("label_negative", "label_positive")
            raise DataError(f"{src}: {given} needs {missing} as well (every label value must be "
                            "listed as 1 or 0, so a typo is an error, not a silent 0)")
        self._positive = _class_texts(pos, "label_positive", src)
        self._negative = _class_texts(neg, "label_negative", src)
        both = sorted(set(self._positive) & set(self._negative))
        if both:
            raise DataError(f"{src}: {', '.join(map(repr, both))} is in both label_positive and "
                            "label_negative")

    def reader_columns(self) -> list[dense_transforms.Column] | None:
        """What the readers apply: :attr:`dense_columns`, or with none chosen yet the
        choices made without statistics (``auto`` is ``log1p``; ``standardize`` needs its
        numbers), or None for the raw values (:attr:`raw_dense`)."""
        if self.raw_dense:
            return None
        if self.dense_columns is None:
            return dense_transforms.without_stats(self.dense_plan, self.dense, self.source)
        return self.dense_columns

    @property
    def label_map(self) -> dict[str, Any] | None:
        """How raw label values become 0/1 (None: they are 0/1 already); for meta.json."""
        if self.label_threshold is not None:
            return {"threshold": self.label_threshold}
        if self.label_positive is not None:
            return {"positive": list(self._positive), "negative": list(self._negative)}
        return None

    @property
    def feature_names(self) -> list[str]:
        return [*self.categorical, *self.multihot]

    @property
    def columns(self) -> list[str]:
        return [self.label, *self.dense, *self.categorical, *self.multihot]

    @staticmethod
    def load(path: str | os.PathLike) -> TabularSpec:
        from hybridrec.data.schema import parse_json

        path = Path(path)
        if not path.is_file():
            raise DataError(f"{path}: schema file does not exist")
        d = parse_json(path.read_text(), str(path))
        known = {f for f in TabularSpec.__dataclass_fields__ if f != "source"}
        unknown = sorted(set(d) - known)
        if unknown:
            raise DataError(f"{path}: unknown schema keys {unknown} (known: {sorted(known)})")
        if "label" not in d:
            raise DataError(f"{path}: the schema must name the 'label' column")
        return TabularSpec(**d, source=str(path))


def _class_texts(values: Any, key: str, source: str) -> tuple[str, ...]:
    """A ``label_positive`` / ``label_negative`` value as the texts it matches (numbers as
    their shortest text: ``4`` and ``4.0`` match ``"4"``)."""
    items = values if isinstance(values, list) else [values]
    out = []
    for v in items:
        if isinstance(v, bool):
            out.append(str(v).lower())
        elif isinstance(v, int):
            out.append(str(v))
        elif isinstance(v, float) and math.isfinite(v):
            out.append(str(int(v)) if v.is_integer() else repr(v))
        elif isinstance(v, str) and v.strip():
            out.append(v.strip())
        else:
            raise DataError(f"{source}: {key} must be a non-empty string or a number, or a list of "
                            f"them; got {v!r}")
    if not out:
        raise DataError(f"{source}: {key} is an empty list")
    return tuple(dict.fromkeys(out))


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
        dense=dense_transforms.apply(dense[keep], spec.reader_columns()),
        onehot=onehot[keep],
        multihot=mh,
    )


# ---------------------------------------------------------------- the label

LabelColumn = tuple[np.ndarray, np.ndarray, Callable[[int], str]]
"""0/1 labels (uint8), the mask of bad rows, and the reason a bad row is bad."""


def _map_classes(spec: TabularSpec, texts: np.ndarray, missing: np.ndarray) -> LabelColumn:
    """Label texts (object array, stripped; ``missing``: empty or null) through
    ``label_positive`` / ``label_negative``."""
    one = np.isin(texts, spec._positive) & ~missing
    zero = np.isin(texts, spec._negative) & ~missing

    def reason(r: int) -> str:
        if missing[r]:
            return "missing label (label_positive/label_negative need one of their values)"
        return (f"label {show(texts[r])} is neither a positive class (label_positive: "
                f"{', '.join(spec._positive)}) nor a negative one (label_negative: "
                f"{', '.join(spec._negative)})")

    return one.astype(np.uint8), ~(one | zero), reason


def _map_threshold(spec: TabularSpec, values: np.ndarray, bad: np.ndarray,
                   reason_of: Callable[[int], str]) -> LabelColumn:
    """Numeric labels (float64; ``bad``: not a finite number, ``reason_of`` says why)
    against ``label_threshold``."""
    bad = bad | ~np.isfinite(values)
    with np.errstate(invalid="ignore"):
        one = (values >= spec.label_threshold) & ~bad
    return one.astype(np.uint8), bad, reason_of


def _csv_label(col: np.ndarray, spec: TabularSpec) -> LabelColumn:
    if spec.label_threshold is not None:
        text = np.char.strip(col)
        values = np.full(col.size, np.nan)
        for i, t in enumerate(text.tolist()):
            try:
                values[i] = float(t) if t else np.nan
            except ValueError:
                pass

        def why(r: int) -> str:
            if not text[r]:
                return f"missing label (label_threshold={spec.label_threshold} needs a number)"
            return f"label {show(col[r])} is not a finite number (label_threshold={spec.label_threshold})"

        return _map_threshold(spec, values, np.zeros(col.size, bool), why)
    if spec.label_positive is not None:
        text = np.char.strip(col).astype(object)
        return _map_classes(spec, text, text == "")
    one, zero = np.isin(col, _TRUE), np.isin(col, _FALSE)
    return one.astype(np.uint8), ~(one | zero), lambda r: f"label must be 0 or 1, got {show(col[r])}"


# ---------------------------------------------------------------- CSV


def csv_column(kind: str, cells: np.ndarray,
               list_delimiter: str = "|") -> tuple[Any, np.ndarray, Callable[[int], str]]:
    """One column's cells (a ``str`` array, a file's text as :class:`CsvReader` holds it)
    converted as the reader converts them: ``(values, bad, reason)``, ``reason(row)`` saying
    why a bad one is bad. ``kind`` ``"dense"``: float64 values (empty, NaN -> 0; bad: not a
    finite number); ``"categorical"``: int64 keys (the text hashed; empty -> missing; never
    bad); ``"multihot"``: ``(keys, ids per row)`` of ``list_delimiter``-separated texts
    (empty -> no ids; bad: an empty id)."""
    if kind == "dense":
        return (*_csv_dense(cells), lambda r: f"not a finite number: {show(cells[r])}")
    if kind == "categorical":
        return _csv_keys(cells), np.zeros(cells.size, bool), lambda r: show(cells[r])
    if kind == "multihot":
        return (*_csv_lists(cells, list_delimiter), lambda r: f"empty id in list {show(cells[r])}")
    raise ValueError(f"csv_column: kind {kind!r} is not dense, categorical or multihot")


def _csv_dense(col: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    present = col != ""
    out = np.full(col.size, np.nan)
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
    out[bad] = 0.0  # (NaN stays: a missing value)
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
    max_line_bytes: int = MAX_LINE_BYTES
    """The longest line taken, in characters (:data:`~hybridrec.data.chunk.MAX_LINE_BYTES`):
    a longer one is a DataError naming the file and line, read no further than that."""

    def __post_init__(self) -> None:
        check_on_bad_line(self.on_bad_line)

    def read(self, path: str | os.PathLike, report: ParseReport, *,
             rows: Callable[[Any], Any] | None = None) -> Iterator[tuple[RowChunk, int]]:
        """Yield ``(chunk, on-disk bytes consumed)``. ``rows``: given the file's
        ``csv.reader``, the rows to read instead (header first; with its ``line_num``), e.g.
        a view that edits cells or records them as they are read."""
        with open_input(path) as f:
            text = io.TextIOWrapper(f.stream, encoding="utf-8", newline="")
            lines = capped_lines(text, f.path, self.max_line_bytes, "a CSV file")
            reader = csv.reader(lines, delimiter=self.spec.csv_delimiter)
            try:
                yield from self.read_rows(rows(reader) if rows else reader, f.path, report,
                                          lambda: f.position)
            except (EOFError, OSError, zlib.error) as e:
                raise DataError(f"{f.path}: truncated or corrupt input ({e})") from None
            except UnicodeDecodeError:
                raise DataError(f"{f.path}:{reader.line_num + 1}: not UTF-8 text") from None
            except csv.Error as e:
                raise DataError(f"{f.path}:{reader.line_num}: {e}") from None

    def read_rows(self, reader, path: Path, report: ParseReport, position: Callable[[], int]):
        """Yield ``(chunk, position())`` of the rows of ``reader`` (a ``csv.reader``, or rows
        with its ``line_num``: the header first, then the rows; blank ones skipped), e.g. CSV
        text in memory; ``path`` names them in messages."""
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

        cols.add(*_csv_label(arr[0], spec))
        nd, nc = len(spec.dense), len(spec.categorical)
        for k, a in enumerate(arr[1:]):
            kind = "dense" if k < nd else "categorical" if k < nd + nc else "multihot"
            cols.add(*csv_column(kind, a, spec.list_delimiter))
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


def import_pyarrow():
    """``(pyarrow, pyarrow.compute, pyarrow.parquet)``, imported when Parquet is first read
    (an optional dependency), or a one-line DataError saying how to install it."""
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
    pa, pc, _ = import_pyarrow()
    t = arr.type
    if pa.types.is_dictionary(t):
        arr, t = arr.cast(t.value_type), t.value_type
    if pa.types.is_integer(t):
        keys = pc.fill_null(arr.cast(pa.int64()), 0).to_numpy(zero_copy_only=False) & KEY_MASK
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
    pa, pc, _ = import_pyarrow()
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
    pa, pc, _ = import_pyarrow()
    if not (
        pa.types.is_integer(arr.type)
        or pa.types.is_floating(arr.type)
        or pa.types.is_boolean(arr.type)
    ):
        raise DataError(f"{path}: column {name!r} has type {arr.type}; expected numbers")
    null = arr.is_null().to_numpy(zero_copy_only=False)
    values = pc.fill_null(arr.cast(pa.float64()), 0.0).to_numpy(zero_copy_only=False)
    return np.array(values, dtype=np.float64), null


def _pa_label(arr, spec: TabularSpec, path: Path) -> LabelColumn:
    pa, pc, _ = import_pyarrow()
    name = spec.label
    if pa.types.is_dictionary(arr.type):
        arr = arr.cast(arr.type.value_type)
    is_text = pa.types.is_string(arr.type) or pa.types.is_large_string(arr.type)
    if spec.label_positive is not None:
        if not (is_text or pa.types.is_integer(arr.type) or pa.types.is_floating(arr.type)
                or pa.types.is_boolean(arr.type)):
            raise DataError(f"{path}: label column {name!r} has type {arr.type}; label_positive/"
                            "label_negative match strings, numbers or booleans")
        texts = pc.utf8_trim_whitespace(arr if is_text else pc.cast(arr, pa.string()))
        texts = np.array(texts.to_pylist(), dtype=object)
        return _map_classes(spec, texts, np.array([t is None or t == "" for t in texts], dtype=bool))
    if spec.label_threshold is not None:
        thr = spec.label_threshold
        if is_text:
            raw = arr.to_pylist()
            values = np.full(len(raw), np.nan)
            for i, t in enumerate(raw):
                try:
                    values[i] = float(t) if t is not None and t.strip() else np.nan
                except ValueError:
                    pass
        else:
            values, null = _pa_numbers(arr, name, path)
            values[null] = np.nan
            raw = [None if n else v for n, v in zip(null.tolist(), values.tolist())]

        def why(r: int) -> str:
            v = raw[r]
            if v is None or (isinstance(v, str) and not v.strip()):
                return f"missing label ({'null' if v is None else 'empty'}; label_threshold={thr} needs a number)"
            return f"label {show(v) if isinstance(v, str) else repr(v)} is not a finite number (label_threshold={thr})"

        return _map_threshold(spec, values, np.zeros(len(values), bool), why)
    label, null = _pa_numbers(arr, name, path)
    bad = null | ((label != 0) & (label != 1))
    return (label.astype(np.uint8), bad,
            lambda r: f"label must be 0 or 1, got {'null' if null[r] else label[r]!r}")


@dataclass(kw_only=True)
class ParquetReader:
    """Parquet files via pyarrow, read in record batches."""

    spec: TabularSpec
    on_bad_line: str = "error"
    batch_rows: int = 1 << 16

    def __post_init__(self) -> None:
        check_on_bad_line(self.on_bad_line)

    def read(self, path: str | os.PathLike, report: ParseReport) -> Iterator[tuple[RowChunk, int]]:
        pa, _, pq = import_pyarrow()
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
                chunk = self.convert(batch, done, index, path, report)
                done += batch.num_rows
                yield chunk, size * done // total
        except (pa.ArrowException, OSError) as e:
            raise DataError(f"{path}: corrupt Parquet data after row {done} ({e})") from None
        if done == 0:
            raise DataError(f"{path}: empty file (no rows)")

    def convert(self, batch, first_row: int, index: dict[str, int], path: Path,
                report: ParseReport) -> RowChunk:
        """One record batch (its first row row ``first_row + 1`` of ``path``; ``index``: each
        column's position, for messages) as a chunk, e.g. a batch made in memory."""
        spec = self.spec
        n = batch.num_rows
        report.lines_read += n
        col = {name: batch.column(i) for i, name in enumerate(batch.schema.names)}
        cols = _Columns(n, len(spec.columns))
        cols.add(*_pa_label(col[spec.label], spec, path))
        for name in spec.dense:
            values, null = _pa_numbers(col[name], name, path)
            bad = np.isinf(values)
            values[bad] = 0.0
            values[null] = np.nan  # null and NaN are missing values
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
