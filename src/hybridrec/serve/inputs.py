"""Raw rows to predict on, read as the run's dataset was made: Criteo TSV, CSV, Parquet.

Prediction reads new rows with the readers preprocessing used (:mod:`hybridrec.data.criteo`,
:mod:`hybridrec.data.tabular`): the same parsing, string hashing, dense transform and bad-line
policy and messages. What differs is the label, which a row to predict on may lack:

- Criteo: a file whose first line has 39 fields (no label, like Criteo's own ``test.txt``)
  gets a ``0`` label put in front of every line before parsing; a file of 40 fields is
  parsed as preprocessing parses it (its label must be 0 or 1 there too). In a file without
  labels, the column numbers of messages count the inserted label.
- CSV / Parquet: the label column is replaced by zeros (added when absent), so it is never
  read or mapped; the tabular spec is rebuilt from the dataset's ``meta.json`` (columns,
  kinds, dense transform) with the default delimiters (``,`` and ``|``).

Each reader yields ``(chunk, kept, rows_in, position)``: the parsed :class:`RowChunk`, the
``--keep-columns`` values of its rows, the input rows it was made from (bad rows skipped
included) and the on-disk bytes consumed (for the progress bar).

In-memory data (:func:`table_chunks`, the Python API) is turned into the text of the
dataset's raw format (Criteo, CSV) or Arrow record batches (Parquet) and goes through the
same readers, so a value means what it would mean in a file: a CSV dataset hashes a
categorical cell's text, a Parquet dataset takes integers as they are.
"""

from __future__ import annotations

import csv
import io
import math
import os
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from hybridrec.data.chunk import ParseReport, RowChunk
from hybridrec.data.criteo import CATEGORICAL, DENSE, FIELDS, CriteoReader
from hybridrec.data.dense import from_meta as dense_from_meta
from hybridrec.data.inputs import open_input
from hybridrec.data.schema import DatasetMeta
from hybridrec.data.tabular import CsvReader, ParquetReader, TabularSpec, import_pyarrow
from hybridrec.errors import ConfigError, DataError

FORMATS = ("criteo", "csv", "parquet")
CRITEO_CHUNK_BYTES = 1 << 21
"""Bytes of Criteo text parsed per chunk (about 9,000 rows): each chunk is one or more
forward passes, whose fixed cost per pass a larger chunk spreads (preprocessing's 512 KiB
suit parsing alone)."""
Chunk = tuple[RowChunk, dict[str, Any], int, int]
"""``(chunk, kept columns, input rows, bytes consumed)``."""


def dataset_format(meta: DatasetMeta) -> str:
    """The raw format ``meta``'s dataset was made from: Criteo's columns make it Criteo,
    else its first part's source file names CSV or Parquet."""
    s = meta.schema
    if s.label == "label" and s.dense == list(DENSE) and s.feature_names == list(CATEGORICAL):
        return "criteo"
    source = meta.parts[0].source if meta.parts else ""
    return "parquet" if _is_parquet(source) else "csv"


def _is_parquet(path: str | os.PathLike) -> bool:
    return Path(path).suffix in (".parquet", ".pq")


def file_format(path: Path, meta: DatasetMeta) -> str:
    """How to read the input ``path`` for ``meta``'s dataset: Parquet and CSV by their
    suffix (CSV and Parquet datasets only), anything else as the dataset's format."""
    fmt = dataset_format(meta)
    if fmt == "criteo":
        if _is_parquet(path) or ".csv" in path.suffixes:
            raise ConfigError(f"{path}: {meta.path} was made from Criteo TSV files; give TSV "
                              "files (plain or .gz)")
        return fmt
    return "parquet" if _is_parquet(path) else "csv"


def predict_spec(meta: DatasetMeta) -> TabularSpec:
    """The tabular spec of ``meta``'s dataset, its label unmapped (prediction zeroes it)."""
    s = meta.schema
    where = str(meta.path / "meta.json") if meta.path else "meta.json"
    spec = TabularSpec(label=s.label, dense=list(s.dense),
                       categorical=[f.name for f in s.onehot], multihot=[f.name for f in s.multihot],
                       dense_transform=meta.preprocessing.get("dense_transform", "log1p"), source=where)
    spec.dense_columns = dense_from_meta(spec.dense_transform, s.dense, where)
    return spec


def read_file(path: Path, meta: DatasetMeta, *, on_bad_line: str, report: ParseReport,
              keep: Sequence[str] = ()) -> Iterator[Chunk]:
    """The chunks of one input file (see the module docstring)."""
    fmt = file_format(path, meta)
    if fmt == "criteo":
        yield from _criteo_file(path, meta, on_bad_line, report, keep)
    elif fmt == "csv":
        yield from _aligned(_csv_file(path, meta, on_bad_line, report, keep), keep, path)
    else:
        yield from _aligned(_parquet_file(path, meta, on_bad_line, report, keep), keep, path)


def _aligned(chunks: Iterator[Chunk], keep: Sequence[str], path) -> Iterator[Chunk]:
    """Kept columns hold every input row; a chunk that lost bad rows cannot be matched."""
    for chunk, kept, rows_in, pos in chunks:
        if keep and len(chunk) != rows_in:
            raise DataError(f"{path}: --keep-columns with bad lines skipped ({rows_in - len(chunk)} "
                            "here) cannot match the kept values to the rows; fix those lines or "
                            "drop --keep-columns")
        yield chunk, kept, rows_in, pos


# ---------------------------------------------------------------- Criteo


def _labelled(path: Path) -> bool:
    """Whether the Criteo file's first line has the label (40 fields, not 39)."""
    with open_input(path) as f:
        head = f.read(1 << 16)
    return head.split(b"\n", 1)[0].count(b"\t") != len(FIELDS) - 2


def _criteo_reader(meta: DatasetMeta, on_bad_line: str, keep: Sequence[str]) -> CriteoReader:
    other = [c for c in keep if c != "label"]
    if other:
        raise ConfigError(f"--keep-columns {','.join(other)}: from Criteo inputs only the label "
                          "can be kept (the other fields are the model's inputs)")
    return CriteoReader(multihot=tuple(f.name for f in meta.schema.multihot), on_bad_line=on_bad_line,
                        chunk_bytes=CRITEO_CHUNK_BYTES)


def _criteo_file(path, meta, on_bad_line, report, keep) -> Iterator[Chunk]:
    reader = _criteo_reader(meta, on_bad_line, keep)
    reader.labelled = _labelled(path)
    if keep and not reader.labelled:
        raise DataError(f"{path}: --keep-columns label, but the file has no label (39 fields)")
    lines = report.lines_read
    for chunk, pos in reader.read(path, report):
        yield chunk, {"label": chunk.labels} if keep else {}, report.lines_read - lines, pos
        lines = report.lines_read


# ---------------------------------------------------------------- CSV


class _CsvRows:
    """A ``csv.reader`` seen through: the label cell set to ``0`` (a column appended where
    the file has none), the kept columns' cells recorded, and the rows counted."""

    def __init__(self, rows, label: str, keep: Sequence[str], path: Path) -> None:
        self.rows, self.label, self.keep, self.path = rows, label, list(keep), path
        self.kept: dict[str, list[str]] = {c: [] for c in keep}
        self.count = 0
        self._it = self._iterate()

    @property
    def line_num(self) -> int:
        return self.rows.line_num

    def __iter__(self):
        return self

    def __next__(self) -> list[str]:
        return next(self._it)

    def take(self) -> tuple[dict[str, list[str]], int]:
        """The kept cells and number of rows since the last call."""
        out, n = self.kept, self.count
        self.kept, self.count = {c: [] for c in self.keep}, 0
        return out, n

    def _iterate(self):
        header = next(self.rows, None)
        if header is None:
            return  # (the reader says: empty file)
        at = {n: i for i, n in enumerate(header)}
        missing = [c for c in self.keep if c not in at]
        if missing:
            raise DataError(f"{self.path}: --keep-columns {', '.join(missing)}: not a column of the "
                            f"file (columns: {', '.join(header[:20])})")
        li = at.get(self.label)
        yield header if li is not None else [*header, self.label]
        cols = [(c, at[c]) for c in self.keep]
        for row in self.rows:
            if not row:  # (blank lines are no rows, as the reader has it)
                continue
            self.count += 1
            for c, i in cols:
                self.kept[c].append(row[i] if i < len(row) else "")
            if li is None:
                row.append("0")
            elif li < len(row):
                row[li] = "0"
            yield row


def _csv_file(path: Path, meta, on_bad_line, report, keep) -> Iterator[Chunk]:
    """The file's rows through :class:`_CsvRows` and :class:`CsvReader`."""
    reader = CsvReader(spec=predict_spec(meta), on_bad_line=on_bad_line)
    views: list[_CsvRows] = []

    def rows(csv_reader) -> _CsvRows:
        views.append(_CsvRows(csv_reader, reader.spec.label, keep, path))
        return views[0]

    for chunk, pos in reader.read(path, report, rows=rows):
        kept, n = views[0].take()
        yield chunk, kept, n, pos


# ---------------------------------------------------------------- Parquet


def _zero_label(batch, label: str):
    """``batch`` with the label column all zeros (added when absent)."""
    pa, _, _ = import_pyarrow()
    names = list(batch.schema.names)
    cols = [batch.column(i) for i in range(len(names))]
    zeros = pa.array(np.zeros(batch.num_rows, np.int8))
    if label in names:
        cols[names.index(label)] = zeros
    else:
        names.append(label)
        cols.append(zeros)
    return pa.RecordBatch.from_arrays(cols, names=names)


def _arrow_chunks(batches, spec: TabularSpec, on_bad_line: str, report: ParseReport,
                  keep: Sequence[str], path, position) -> Iterator[Chunk]:
    """Record batches through :class:`ParquetReader`'s conversion."""
    reader = ParquetReader(spec=spec, on_bad_line=on_bad_line)
    done = 0
    for batch in batches:
        names = batch.schema.names
        missing = [c for c in [*spec.columns[1:], *keep] if c not in names]
        if missing:
            raise DataError(f"{path}: no column {', '.join(map(repr, missing))} (columns: "
                            f"{', '.join(names[:20])}{' ...' if len(names) > 20 else ''})")
        kept = {c: batch.column(names.index(c)) for c in keep}
        batch = _zero_label(batch, spec.label)
        index = {n: i for i, n in enumerate(batch.schema.names)}
        chunk = reader.convert(batch, done, index, path, report)
        done += batch.num_rows
        yield chunk, kept, batch.num_rows, position(done)


def _parquet_file(path: Path, meta, on_bad_line, report, keep) -> Iterator[Chunk]:
    pa, _, pq = import_pyarrow()
    spec = predict_spec(meta)
    try:
        pf = pq.ParquetFile(path)
    except (pa.ArrowException, OSError) as e:
        raise DataError(f"{path}: not a readable Parquet file ({e})") from None
    names = pf.schema_arrow.names
    wanted = [c for c in dict.fromkeys([*spec.columns, *keep]) if c in names]
    total, size = max(pf.metadata.num_rows, 1), path.stat().st_size
    try:
        yield from _arrow_chunks(pf.iter_batches(batch_size=1 << 16, columns=wanted), spec,
                                 on_bad_line, report, keep, path, lambda done: size * done // total)
    except (pa.ArrowException, OSError) as e:
        raise DataError(f"{path}: corrupt Parquet data ({e})") from None


# ---------------------------------------------------------------- in memory

BLOCK_ROWS = 1 << 15
"""Rows of in-memory data turned into text (or a record batch) at a time."""


def table_chunks(data: Any, meta: DatasetMeta, report: ParseReport) -> Iterator[Chunk]:
    """The chunks of in-memory rows: a pandas DataFrame, a pyarrow Table or a dict of
    column arrays, in the raw columns of ``meta``'s dataset. A bad row is an error."""
    fmt = dataset_format(meta)
    if fmt == "parquet":
        table = _arrow_table(data)
        return _arrow_chunks(table.to_batches(max_chunksize=BLOCK_ROWS), predict_spec(meta),
                             "error", report, (), "input", lambda done: 0)
    columns, n = _columns(data)
    if fmt == "criteo":
        return _criteo_memory(columns, n, meta, report)
    return _csv_memory(columns, n, meta, report)


def _columns(data: Any) -> tuple[dict[str, list], int]:
    """``{name: Python list}`` of a DataFrame, Arrow table or dict of arrays, and the rows."""
    if type(data).__module__.startswith("pyarrow"):
        cols = {n: data.column(n).to_pylist() for n in data.column_names}
    elif hasattr(data, "columns") and hasattr(data, "to_dict"):  # a pandas DataFrame
        cols = {str(n): data[n].tolist() for n in data.columns}
    elif isinstance(data, dict):
        cols = {str(n): (v.tolist() if hasattr(v, "tolist") else list(v)) for n, v in data.items()}
    else:
        raise DataError(f"predict: expected a pandas DataFrame, a pyarrow Table or a dict of "
                        f"column arrays, got {type(data).__name__}")
    sizes = {len(v) for v in cols.values()}
    if len(sizes) > 1:
        raise DataError(f"predict: the columns have different lengths {sorted(sizes)}")
    return cols, sizes.pop() if sizes else 0


def _arrow_table(data: Any):
    pa, _, _ = import_pyarrow()
    if isinstance(data, pa.Table):
        return data
    if hasattr(data, "columns") and hasattr(data, "to_dict"):
        return pa.Table.from_pandas(data, preserve_index=False)
    if isinstance(data, dict):
        return pa.table({n: (v if isinstance(v, (list, pa.Array)) else np.asarray(v))
                         for n, v in data.items()})
    raise DataError(f"predict: expected a pandas DataFrame, a pyarrow Table or a dict of column "
                    f"arrays, got {type(data).__name__}")


def value_text(value: Any, hex_id: bool = False, sep: str = ",") -> str:
    """A value as its raw file would hold it: missing (None, NaN) empty, a whole float as an
    integer, a Criteo id given as an integer in 8 hex digits, a list (a bag) ``sep``-joined
    (a list inside it ``,``-joined). What the text of in-memory rows is made of here, and what
    :mod:`hybridrec.serve.json_rows` falls back on (and shows in messages)."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return ""
    if isinstance(value, (list, tuple, np.ndarray)):
        return sep.join(value_text(v, hex_id) for v in value)
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    if isinstance(value, bool):
        return "1" if value else "0"
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, int):
        return f"{value:08x}" if hex_id else str(value)
    return str(value)


def _need(columns: dict, names: Sequence[str], meta: DatasetMeta) -> None:
    missing = [n for n in names if n not in columns]
    if missing:
        raise DataError(f"predict: no column {', '.join(missing[:5])}{' ...' if len(missing) > 5 else ''} "
                        f"(the columns of {meta.path}'s raw rows)")


def _criteo_memory(columns, n, meta, report) -> Iterator[Chunk]:
    _need(columns, FIELDS[1:], meta)
    reader = _criteo_reader(meta, "error", ())
    reader.labelled = "label" in columns
    names = list(FIELDS if reader.labelled else FIELDS[1:])
    cats = set(CATEGORICAL)
    for lo in range(0, n, BLOCK_ROWS):
        hi = min(n, lo + BLOCK_ROWS)
        cells = [[value_text(v, name in cats) for v in columns[name][lo:hi]] for name in names]
        data = "".join("\t".join(row) + "\n" for row in zip(*cells)).encode()
        chunk, _ = reader.parse_block(data, lo, Path("input"), report)
        yield chunk, {}, hi - lo, 0


def _csv_memory(columns, n, meta, report) -> Iterator[Chunk]:
    spec = predict_spec(meta)
    names = spec.columns[1:]
    _need(columns, names, meta)
    text = io.StringIO()
    out = csv.writer(text)
    out.writerow(names)
    out.writerows(zip(*[[value_text(v, sep=spec.list_delimiter) for v in columns[name]] for name in names]))
    text.seek(0)
    rows = _CsvRows(csv.reader(text), spec.label, (), Path("input"))
    for chunk, _ in CsvReader(spec=spec, on_bad_line="error").read_rows(rows, Path("input"), report,
                                                                        lambda: 0):
        yield chunk, *rows.take(), 0
