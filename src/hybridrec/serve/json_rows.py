"""A request's JSON values straight to a :class:`~hybridrec.data.chunk.RowChunk` (``hybridrec serve``).

The rows of a request are already values (numbers, strings, lists, null), column by column.
:func:`json_chunk` turns them into the chunk the dataset's reader would make of the same rows
written to its raw format (:func:`hybridrec.serve.inputs.table_chunks`, which writes them as
Criteo or CSV text and parses that again), without the text: labels zero, dense values
transformed as preprocessing did, raw categorical keys as the reader derives them. The two
give bit-identical chunks for every input the text path accepts (tests/test_serve_rows.py
holds them to it on random rows). A whole group of fields (all dense, all one-hot) is
converted at once with numpy; a value of an unusual type (a bool, a float in a Criteo
field, a list) is turned into the text it would have in the file
(:func:`~hybridrec.serve.inputs.value_text`) and parsed with the reader's own rules.

- **Criteo**: a dense value is an integer (at most 18 characters as text, sign included);
  a categorical value a hexadecimal id of at most 8 digits (its int value; an integer id in
  [0, 2^32) as it is), a multi-hot value a comma-separated string or a list of such ids.
  Strings are parsed by :func:`hybridrec.data.criteo.parse_values`, the reader's passes.
- **CSV**: every value is a cell's text: numbers as numbers (a whole float as its integer,
  so ``-0.0`` is 0), strings and everything else through
  :func:`hybridrec.data.tabular.csv_column`, the reader's conversion (a categorical
  string's key is its BLAKE2b-64 hash, a number's the hash of its text).
- **Parquet**: dense values are numbers (booleans 0/1); an id is an integer (its low 63
  bits) or a string (hashed); a multi-hot value a list of ids (null ids dropped). Where
  the text path (pyarrow's type inference over the column) refused a column whose values
  are all null, or mixed integer and string ids, or integers past 2^53 in a dense column,
  these take them: missing values, each id as its type says, the number rounded.

A bad value raises one :class:`~hybridrec.errors.DataError` naming the first bad row
(0-based), its field and the field's column (CSV and Parquet: the field's position in the
request's columns; Criteo: its column in a Criteo line, the label first), with the
reader's reason, as the text path says it.
"""

from __future__ import annotations

import itertools
from typing import Any

import numpy as np

from hybridrec.data import dense as dense_transforms
from hybridrec.data.chunk import MISSING, RowChunk, show, transform_dense
from hybridrec.data.criteo import CATEGORICAL, DENSE, FIELDS, CriteoReader, parse_values
from hybridrec.data.schema import DatasetMeta
from hybridrec.data.tabular import KEY_MASK, csv_column, hash_strings
from hybridrec.errors import DataError
from hybridrec.serve.inputs import dataset_format, predict_spec, value_text

_NONE = type(None)
_DENSE_MAX, _DENSE_MIN = 10**18 - 1, -(10**17 - 1)  # at most 18 characters, a sign included
_HEX_IDS = 1 << 32  # integers of at most 8 hex digits


def json_chunk(columns: dict[str, list], n: int, meta: DatasetMeta) -> RowChunk:
    """``{column: n values}`` (the raw columns of ``meta``'s dataset, the label not needed)
    as the chunk of the dataset's reader (see the module docstring)."""
    fmt = dataset_format(meta)
    if fmt == "criteo":
        return _criteo(columns, n, meta)
    try:
        return _tabular(columns, n, meta, fmt)
    except UnicodeEncodeError:  # (a string is hashed as UTF-8; JSON can spell a lone surrogate)
        raise _not_unicode(columns, n, predict_spec(meta).columns[1:]) from None


def _not_unicode(columns: dict[str, list], n: int, names: list[str]) -> DataError:
    for r in range(n):
        for c, name in enumerate(names):
            try:
                value_text(columns[name][r]).encode()
            except UnicodeEncodeError:
                return _bad(f"row {r}", name, c + 1, "not Unicode text (a lone surrogate)")
    return DataError("a value is not Unicode text (a lone surrogate)")


def _flat(columns: dict[str, list], names) -> list:
    """The values of ``names``, column after column."""
    return list(itertools.chain.from_iterable(columns[c] for c in names))


def _bad(where: str, name: str, column: int, reason: str) -> DataError:
    return DataError(f"{where}: field {name} (column {column}): {reason}")


def _first_bad(bad: np.ndarray) -> tuple[int, int]:
    """(row, column) of the first bad value in row order (``bad``: [rows, columns])."""
    r = int(np.flatnonzero(bad.any(axis=1))[0])
    return r, int(np.argmax(bad[r]))


def _many(value: Any) -> str | None:
    """Why a list is not one value (None: it is not a list of two or more)."""
    if isinstance(value, (list, tuple)) and len(value) > 1:
        return f"{len(value)} values where the field takes one: {show(value_text(value))}"
    return None


# ---------------------------------------------------------------- Criteo


def _utf8(texts: list[str]) -> tuple[bytes, np.ndarray]:
    """Strings as one run of UTF-8 bytes and each one's count of bytes (a lone surrogate,
    which JSON can spell, kept as bytes no id or number is made of)."""
    joined = "".join(texts)
    data = joined.encode("utf-8", "surrogatepass")
    if len(data) == len(joined):
        return data, np.fromiter(map(len, texts), np.int64, len(texts))
    return data, np.fromiter((len(t.encode("utf-8", "surrogatepass")) for t in texts), np.int64, len(texts))


def _criteo_texts(kind: str, values: list, hex_id: bool):
    texts = [value_text(v, hex_id) for v in values]
    return parse_values(kind, *_utf8(texts))


def _criteo_dense(values: list) -> tuple[np.ndarray, np.ndarray]:
    """int64 values and bad, of integers (and nulls) at numpy's speed, else as text."""
    types = set(map(type, values))
    if types <= {int, _NONE}:
        if _NONE in types:
            values = [0 if v is None else v for v in values]
        try:
            a = np.array(values, dtype=np.int64)
        except OverflowError:  # (past int64: too many digits; the text says so)
            return _criteo_texts("dense", values, False)
        return a, (a > _DENSE_MAX) | (a < _DENSE_MIN)
    return _criteo_texts("dense", values, False)


def _criteo_onehot(values: list) -> tuple[np.ndarray, np.ndarray]:
    """int64 keys and bad of hex strings (or integer ids, and nulls)."""
    types = set(map(type, values))
    if types <= {str, _NONE}:
        texts = ["" if v is None else v for v in values] if _NONE in types else values
        return parse_values("onehot", *_utf8(texts))
    if types <= {int, _NONE}:
        none = np.fromiter((v is None for v in values), bool, len(values))
        try:
            a = np.array([0 if v is None else v for v in values], dtype=np.int64)
        except OverflowError:
            return _criteo_texts("onehot", values, True)
        bad = ~none & ((a < 0) | (a >= _HEX_IDS))
        return np.where(none | bad, MISSING, a), bad
    return _criteo_texts("onehot", values, True)


def _criteo(columns: dict[str, list], n: int, meta: DatasetMeta) -> RowChunk:
    multi = [f.name for f in meta.schema.multihot]
    reader = CriteoReader(multihot=tuple(multi))  # (its reasons)
    onehot_names = [c for c in CATEGORICAL if c not in multi]
    at = {name: i for i, name in enumerate(FIELDS)}
    bad = np.zeros((n, len(FIELDS)), bool)
    dense, b = _criteo_dense(_flat(columns, DENSE))
    dense, bad[:, 1:1 + len(DENSE)] = dense.reshape(len(DENSE), n).T.copy(), b.reshape(len(DENSE), n).T
    keys, b = _criteo_onehot(_flat(columns, onehot_names))
    cols = [at[c] for c in onehot_names]
    onehot, bad[:, cols] = keys.reshape(len(cols), n).T, b.reshape(len(cols), n).T
    mh = {}
    for name in multi:
        keys, lengths, bad[:, at[name]] = _criteo_texts("multihot", columns[name], True)
        mh[name] = (keys, lengths)
    if bad.any():
        r, c = _first_bad(bad)
        value = columns[FIELDS[c]][r]
        text = value_text(value, c > len(DENSE)).encode("utf-8", "surrogatepass")
        why = (_many(value) if FIELDS[c] not in multi else None) or reader.reason(c, text)
        raise _bad(f"row {r}", FIELDS[c], c + 1, why)
    return RowChunk(labels=np.zeros(n, np.uint8), dense=transform_dense(dense, "log1p"),
                    onehot=np.ascontiguousarray(onehot), multihot=mh)


# ---------------------------------------------------------------- CSV and Parquet


def _kind(value: Any) -> str:
    return {str: "a string", list: "a list", bool: "a boolean", dict: "an object",
            float: "a number"}.get(type(value), "a number" if isinstance(value, int) else type(value).__name__)


class _Tabular:
    """One request's columns converted group by group; ``bad`` [rows, columns] (the
    request's columns in order) and, per column, why a row's value is bad."""

    def __init__(self, n: int, names: list[str]) -> None:
        self.n, self.names = n, names
        self.bad = np.zeros((n, len(names)), bool)
        self.reasons: dict[int, Any] = {}

    def mark(self, first: int, bad: np.ndarray, reason) -> None:
        """``bad`` of the columns ``first...`` (column after column); ``reason(k)`` of the
        flat index ``k`` into them."""
        width = bad.size // self.n if self.n else 0
        self.bad[:, first:first + width] = bad.reshape(width, self.n).T
        for j in range(width):
            self.reasons[first + j] = (reason, j * self.n)

    def check(self) -> None:
        if self.bad.any():
            r, c = _first_bad(self.bad)
            reason, offset = self.reasons[c]
            raise _bad(f"row {r}", self.names[c], c + 1, reason(offset + r))


def _csv_dense(values: list, delim: str):
    """float64 values, bad and reasons: numbers at numpy's speed (NaN missing, -0.0 is
    the 0 its text says), anything else as the cells' text."""
    types = set(map(type, values))
    if types <= {int, float, _NONE}:
        try:
            a = np.array([np.nan if v is None else v for v in values], dtype=np.float64)
        except OverflowError:  # (an integer past float64: its text is infinite)
            a = None
        if a is not None:
            bad = np.isinf(a)
            a[bad] = 0.0  # (NaN stays: a missing value)
            a += 0.0  # (-0.0 -> 0.0: its text is "0")

            def why(k: int) -> str:
                return csv_column("dense", np.array([value_text(values[k], sep=delim)], dtype=str))[2](0)

            return a, bad, why
    return csv_column("dense", np.array([value_text(v, sep=delim) for v in values], dtype=str), delim)


def _csv_texts(values: list, delim: str) -> np.ndarray:
    types = set(map(type, values))
    if types <= {str}:
        return np.array(values, dtype=str)
    return np.array([value_text(v, sep=delim) for v in values], dtype=str)


def _number(v: Any) -> float:
    return np.nan if v is None else float(v)


def _parquet_dense(values: list):
    """float64 values, bad and reasons: numbers and booleans (null, NaN: missing, NaN; bad: infinite,
    out of range, or not a number)."""
    types = set(map(type, values))
    if types <= {int, float, bool, _NONE}:
        try:
            a = np.array([np.nan if v is None else v for v in values], dtype=np.float64)
            wrong = np.zeros(a.size, bool)
        except OverflowError:
            a = None
    else:
        a = None
    if a is None:
        a = np.zeros(len(values))
        wrong = np.zeros(len(values), bool)
        for k, v in enumerate(values):
            try:
                a[k] = _number(v) if isinstance(v, (int, float, _NONE)) else np.nan
                wrong[k] = not isinstance(v, (int, float, _NONE))
            except OverflowError:
                wrong[k] = True
    inf = np.isinf(a)
    a[inf | wrong] = 0.0  # (NaN stays: a missing value)

    def why(k: int) -> str:
        v = values[k]
        if isinstance(v, (int, float)) and not isinstance(v, float):
            return f"an integer out of range: {show(str(v))}"
        if isinstance(v, (int, float)):
            return "not a finite number"
        return f"expected a number, got {_kind(v)}: {show(value_text(v))}"

    return a, inf | wrong, why


def _parquet_id(v: Any) -> int | str | None:
    """An id as its key's source: an int (masked), a str (hashed), None; else raises TypeError."""
    if v is None or type(v) is str:
        return v
    if type(v) is int:
        if not -(1 << 63) <= v < (1 << 63):
            raise OverflowError
        return v
    raise TypeError


def _parquet_keys(ids: list) -> np.ndarray:
    """int64 keys of ints, strs and Nones (each checked by :func:`_parquet_id`)."""
    keys = np.full(len(ids), MISSING, np.int64)
    ints = [k for k, v in enumerate(ids) if type(v) is int]
    if ints:
        keys[ints] = np.array([ids[k] for k in ints], dtype=np.int64) & KEY_MASK
    strs = [k for k, v in enumerate(ids) if type(v) is str]
    if strs:
        unique, inverse = np.unique(np.array([ids[k] for k in strs], dtype=object), return_inverse=True)
        keys[strs] = hash_strings(unique)[inverse.reshape(-1)]
    return keys


def _parquet_onehot(values: list):
    """int64 keys, bad and reasons of integer and string ids (and nulls)."""
    types = set(map(type, values))
    wrong = np.zeros(len(values), bool)
    if not types <= {int, str, _NONE} or int in types:
        for k, v in enumerate(values):
            try:
                _parquet_id(v)
            except (TypeError, OverflowError):
                wrong[k] = True
    clean = [None if w else v for v, w in zip(values, wrong.tolist())] if wrong.any() else values

    def why(k: int) -> str:
        v = values[k]
        if type(v) is int:
            return f"an integer id out of range (64 bits, signed): {show(str(v))}"
        return f"expected an integer or a string id, got {_kind(v)}: {show(value_text(v))}"

    return _parquet_keys(clean), wrong, why


def _parquet_multihot(values: list):
    """``(keys, ids per row)``, bad and reasons of lists of ids (null: an empty list; null
    ids dropped)."""
    n = len(values)
    lengths = np.zeros(n, np.int64)
    bad = np.zeros(n, bool)
    ids: list = []
    for k, v in enumerate(values):
        if v is None:
            continue
        if type(v) is not list:
            bad[k] = True
            continue
        try:
            row = [_parquet_id(i) for i in v if i is not None]
        except (TypeError, OverflowError):
            bad[k] = True
            continue
        ids += row
        lengths[k] = len(row)

    def why(k: int) -> str:
        v = values[k]
        if type(v) is not list:
            return f"expected a list of ids, got {_kind(v)}: {show(value_text(v))}"
        return f"expected a list of integer or string ids: {show(repr(v))}"

    return (_parquet_keys(ids), lengths), bad, why


def _tabular(columns: dict[str, list], n: int, meta: DatasetMeta, fmt: str) -> RowChunk:
    spec = predict_spec(meta)
    delim = spec.list_delimiter
    names = spec.columns[1:]
    nd, nc = len(spec.dense), len(spec.categorical)
    t = _Tabular(n, names)
    flat = _flat(columns, spec.dense)
    dense, bad, why = _csv_dense(flat, delim) if fmt == "csv" else _parquet_dense(flat)
    t.mark(0, bad, why)
    flat = _flat(columns, spec.categorical)
    if fmt == "csv":
        keys, bad, why = csv_column("categorical", _csv_texts(flat, delim), delim)
    else:
        keys, bad, why = _parquet_onehot(flat)
    t.mark(nd, bad, why)
    mh = {}
    for j, name in enumerate(spec.multihot):
        if fmt == "csv":
            mh[name], bad, why = csv_column("multihot", _csv_texts(columns[name], delim), delim)
        else:
            mh[name], bad, why = _parquet_multihot(columns[name])
        t.mark(nd + nc + j, bad, why)
    t.check()
    return RowChunk(labels=np.zeros(n, np.uint8),
                    dense=dense_transforms.apply(dense.reshape(nd, n).T.copy(), spec.dense_columns),
                    onehot=np.ascontiguousarray(keys.reshape(nc, n).T), multihot=mh)
