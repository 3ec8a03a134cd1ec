"""Streaming reader of Criteo Kaggle / Terabyte click logs (TSV, plain or gzip).

One line is one sample, 40 tab-separated fields::

    label \\t I1 .. I13 \\t C1 .. C26 \\n

- ``label``: ``0`` or ``1``.
- ``I1..I13``: integers, possibly negative, possibly empty (missing).
- ``C1..C26``: hexadecimal hashes of at most 8 digits (Criteo writes exactly 8),
  possibly empty. A feature marked multi-hot holds a comma-separated list of such
  ids (``a1b2c3d4,0badf00d``; empty field = empty bag).

Parsing is vectorized per block of lines (a few MB): the whole block is one
``uint8`` array; delimiters are located with ``flatnonzero``, every field's bytes
are gathered into a padded matrix and converted with a few array passes (Horner's
rule over the digit columns). Validation is part of the same passes, so a bad
field is located (line and column) without a Python loop over lines; only the
error message of a bad line is built in Python.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from hybridrec.data.chunk import (
    MAX_LINE_BYTES,
    MISSING,
    ParseReport,
    RowChunk,
    check_on_bad_line,
    first_long_line,
    line_too_long,
    show,
    transform_dense,
)
from hybridrec.data.inputs import open_input
from hybridrec.errors import DataError

DENSE = tuple(f"I{i}" for i in range(1, 14))
CATEGORICAL = tuple(f"C{i}" for i in range(1, 27))
FIELDS = ("label", *DENSE, *CATEGORICAL)
N_FIELDS = len(FIELDS)
_FIRST_CAT = 1 + len(DENSE)

_TAB, _NL, _COMMA, _MINUS = 9, 10, 44, 45
_MAX_DECIMAL_DIGITS = 18  # fits int64 without overflow
_MAX_HEX_DIGITS = 8  # Criteo's 32-bit hashes
_PAD = 32
_HEX = np.full(256, 255, dtype=np.uint8)
for _i, _c in enumerate(b"0123456789abcdef"):
    _HEX[_c] = _i
for _i, _c in enumerate(b"ABCDEF"):
    _HEX[_c] = 10 + _i


@dataclass(kw_only=True)
class CriteoReader:
    """Reads Criteo files into :class:`RowChunk` s of raw keys (hex value as int)."""

    multihot: tuple[str, ...] = ()
    """Categorical fields holding comma-separated id lists (C1..C26 names)."""
    on_bad_line: str = "error"
    """``"error"``: a malformed line raises DataError; ``"skip"``: drop and count it."""
    chunk_bytes: int = 1 << 19
    """Bytes parsed per block; a few MB keeps the temporaries in cache."""
    max_line_bytes: int = MAX_LINE_BYTES
    """The longest line taken (:data:`~hybridrec.data.chunk.MAX_LINE_BYTES`): a longer one
    is a DataError naming the file and line, found with at most this plus one block read."""
    labelled: bool = True
    """False: lines without the label (39 fields, like Criteo's own ``test.txt``), each read
    with a ``0`` label put in front (so the column numbers of messages count it)."""
    rows_of: Callable[[int], np.ndarray] | None = None
    """Given a block's line count, the lines (indices) to parse; the others are split from
    the text and counted, not parsed (a stream's rank takes its own rows: with
    ``on_bad_line="error"``, where a line not parsed cannot be dropped). Every block's chunk
    is yielded, empty ones too. None: every line."""

    def __post_init__(self) -> None:
        check_on_bad_line(self.on_bad_line)
        unknown = sorted(set(self.multihot) - set(CATEGORICAL))
        if unknown:
            raise DataError(f"multi-hot fields {unknown} are not Criteo fields C1..C26")
        self._mh_cols = [_FIRST_CAT + CATEGORICAL.index(n) for n in self.multihot]
        self._oh_cols = [c for c in range(_FIRST_CAT, N_FIELDS) if c not in self._mh_cols]

    def read(self, path: str | os.PathLike, report: ParseReport) -> Iterator[tuple[RowChunk, int]]:
        """Yield ``(chunk, on-disk bytes consumed)``; the file's lines in order."""
        with open_input(path) as f:
            line = 0  # lines before the current block
            tail = b""
            while True:
                block = f.read(self.chunk_bytes)
                if not block:  # end of file: the tail is a last line without newline
                    if not tail:
                        break
                    data, tail = tail + b"\n", b""
                else:
                    data = tail + block
                    cut = data.rfind(b"\n") + 1
                    data, tail = data[:cut], data[cut:]
                long = first_long_line(data, self.max_line_bytes)
                if long is not None:  # (the lines before it first: their errors come first)
                    data, tail = data[:long], None
                if data:
                    chunk, n_lines = self.parse_block(data, line, f.path, report)
                    line += n_lines
                    report.lines_read += n_lines
                    if len(chunk) or self.rows_of is not None:
                        yield chunk, f.position
                if tail is None or len(tail) > self.max_line_bytes:
                    raise line_too_long(f.path, line + 1, self.max_line_bytes, "a Criteo file")
            if line == 0:
                raise DataError(f"{f.path}: empty file (no lines)")

    def parse_block(
        self, data: bytes, first_line: int, path: os.PathLike, report: ParseReport
    ) -> tuple[RowChunk, int]:
        """``(chunk, lines)`` of ``data``, whole lines each ending in a newline, the first of
        them line ``first_line + 1`` of ``path`` (for messages): what :meth:`read` does with
        each block of a file, for text already in memory."""
        if not self.labelled:
            data = b"0\t" + data[:-1].replace(b"\n", b"\n0\t") + b"\n"
        if b"\r" in data:  # tolerate CRLF files
            data = data.replace(b"\r\n", b"\n")
        # Zero padding: field windows of up to 19 bytes never run past the end (0 is no delimiter).
        buf = np.frombuffer(data + bytes(_PAD), dtype=np.uint8)
        lines = _split_fields(buf)
        if self.rows_of is not None and lines.ok.all():
            return self._parse_some(buf, data, first_line, path, lines), len(lines.ok)
        p = _parse_fields(
            buf, lines.starts, lines.ends - lines.starts, self._oh_cols, self._mh_cols
        )
        row_bad = p["bad"].any(axis=1)
        if row_bad.any() or not lines.ok.all():
            messages = _BadLines(self, data, first_line, path, lines, p["bad"])
            if self.on_bad_line == "error":
                raise DataError(messages.first())
            report.skipped(len(messages.lines), messages)
            p = _select_rows(p, ~row_bad)
        return self._chunk(p), len(lines.ok)

    def _chunk(self, p: dict) -> RowChunk:
        return RowChunk(
            labels=p["labels"],
            dense=transform_dense(p["dense"], "log1p"),
            onehot=p["onehot"],
            multihot={FIELDS[c]: (p["mh"][c][0], p["mh"][c][1]) for c in self._mh_cols},
        )

    def _parse_some(self, buf, data, first_line, path, lines: _Lines) -> RowChunk:
        """The lines ``rows_of`` picks of a block whose lines all have their fields (a bad
        field among them: the error, naming its line)."""
        if self.on_bad_line != "error":
            raise DataError("CriteoReader.rows_of needs on_bad_line='error' (a skipped line shifts the rows)")
        pick = np.asarray(self.rows_of(len(lines.ok)), dtype=np.int64)
        starts = lines.starts[pick]
        p = _parse_fields(buf, starts, lines.ends[pick] - starts, self._oh_cols, self._mh_cols)
        if p["bad"].any():
            bad = np.zeros((len(lines.ok), p["bad"].shape[1]), dtype=bool)
            bad[pick] = p["bad"]
            raise DataError(_BadLines(self, data, first_line, path, lines, bad).first())
        return self._chunk(p)

    def reason(self, col: int, text: bytes) -> str:
        """Why field ``col`` (0-based) with this text is malformed."""
        if col == 0:
            return f"label must be 0 or 1, got {show(text)}"
        if col < _FIRST_CAT:
            if len(text) > _MAX_DECIMAL_DIGITS:
                return f"integer with more than {_MAX_DECIMAL_DIGITS} digits: {show(text)}"
            return f"not an integer: {show(text)}"
        if col in self._mh_cols:
            return f"not a comma-separated list of hexadecimal ids: {show(text)}"
        return f"not a hexadecimal id of at most {_MAX_HEX_DIGITS} digits: {show(text)}"


@dataclass
class _Lines:
    """Field boundaries of a block: ``starts/ends`` are ``[rows, 40]`` for well-formed lines."""

    line_start: np.ndarray  # [lines] offset of each line
    line_end: np.ndarray  # [lines] offset of each line's newline
    nfields: np.ndarray  # [lines] tab count + 1
    ok: np.ndarray  # [lines] nfields == 40
    starts: np.ndarray  # [rows, 40] field start offsets, rows = ok.sum()
    ends: np.ndarray  # [rows, 40] field end offsets (the delimiter)


def _split_fields(buf: np.ndarray) -> _Lines:
    is_tab = buf == _TAB
    is_nl = buf == _NL
    nl = np.flatnonzero(is_nl)
    line_start = np.zeros(nl.size, dtype=np.int64)
    line_start[1:] = nl[:-1] + 1
    # searchsorted: the line of a delimiter is the first newline at or after it.
    nfields = np.bincount(np.searchsorted(nl, np.flatnonzero(is_tab)), minlength=nl.size) + 1
    ok = nfields == N_FIELDS
    delims = np.flatnonzero(is_tab | is_nl)
    if not ok.all():
        delims = delims[ok[np.searchsorted(nl, delims)]]
    ends = delims.reshape(-1, N_FIELDS)
    starts = np.empty_like(ends)
    starts[:, 0] = line_start[ok]
    starts[:, 1:] = ends[:, :-1] + 1
    return _Lines(line_start, nl, nfields, ok, starts, ends)


class _BadLines:
    """The bad lines of a block and (lazily) their error messages."""

    def __init__(self, reader, data, first_line, path, lines: _Lines, bad: np.ndarray) -> None:
        self.reader, self.data, self.first_line, self.path = reader, data, first_line, path
        self.lines_info, self.bad = lines, bad
        self.row_line = np.flatnonzero(lines.ok)  # block line index of each parsed row
        self.lines = np.union1d(np.flatnonzero(~lines.ok), self.row_line[bad.any(axis=1)])

    def first(self) -> str:
        return self.message(int(self.lines[0]))

    def __iter__(self) -> Iterator[str]:
        return (self.message(int(j)) for j in self.lines)

    def message(self, j: int) -> str:
        where = f"{self.path}:{self.first_line + j + 1}"
        info = self.lines_info
        if not info.ok[j]:
            if info.line_start[j] == info.line_end[j]:
                return f"{where}: empty line (expected {N_FIELDS} tab-separated fields)"
            return f"{where}: expected {N_FIELDS} tab-separated fields, got {info.nfields[j]}"
        r = int(np.searchsorted(self.row_line, j))
        col = int(np.argmax(self.bad[r]))
        text = self.data[info.starts[r, col] : info.ends[r, col]]
        return f"{where}: field {FIELDS[col]} (column {col + 1}): {self.reader.reason(col, text)}"


def _parse_fields(buf, starts, lengths, oh_cols, mh_cols) -> dict:
    """Convert every field of the well-formed rows; ``bad`` marks invalid fields."""
    n = starts.shape[0]
    bad = np.zeros((n, N_FIELDS), dtype=bool)
    c = buf[starts[:, 0]]
    bad[:, 0] = (lengths[:, 0] != 1) | ((c != ord("0")) & (c != ord("1")))
    labels = (c == ord("1")).astype(np.uint8)
    dense, bad[:, 1:_FIRST_CAT] = _parse_decimal(
        buf, starts[:, 1:_FIRST_CAT], lengths[:, 1:_FIRST_CAT]
    )
    onehot, bad[:, oh_cols] = _parse_hex(buf, starts[:, oh_cols], lengths[:, oh_cols])
    mh = {}
    if mh_cols:
        # All list columns at once, column-major: the keys of one column are contiguous.
        keys, per_field, bad_field = _parse_hex_lists(
            buf, starts[:, mh_cols].T.ravel(), lengths[:, mh_cols].T.ravel()
        )
        per_field = per_field.reshape(len(mh_cols), n)
        bad[:, mh_cols] = bad_field.reshape(len(mh_cols), n).T
        ends = np.cumsum(per_field.sum(axis=1))
        for j, col in enumerate(mh_cols):
            k = keys[ends[j] - per_field[j].sum() : ends[j]]
            mh[col] = (k, per_field[j], np.repeat(np.arange(n), per_field[j]))
    return {"labels": labels, "dense": dense, "onehot": onehot, "mh": mh, "bad": bad}


def _select_rows(p: dict, keep: np.ndarray) -> dict:
    mh = {}
    for col, (keys, per_row, tok_row) in p["mh"].items():
        mh[col] = (keys[keep[tok_row]], per_row[keep], None)
    return {
        "labels": p["labels"][keep],
        "dense": p["dense"][keep],
        "onehot": p["onehot"][keep],
        "mh": mh,
    }


def _gather(buf: np.ndarray, starts: np.ndarray, lengths: np.ndarray, width: int):
    """Bytes of each field, left-aligned in ``[..., width]``; ``valid`` marks real bytes.

    One row-gather from a sliding-window view (no per-byte index array); the
    block is zero-padded so windows never run past its end.
    """
    ch = sliding_window_view(buf, width)[starts]
    return ch, np.arange(width) < lengths[..., None]


def _parse_decimal(buf, starts, lengths) -> tuple[np.ndarray, np.ndarray]:
    """Optionally signed decimal integers; empty -> 0. Returns (int64 values, bad)."""
    width = min(int(lengths.max(initial=0)), _MAX_DECIMAL_DIGITS + 1)
    values = np.zeros(starts.shape, dtype=np.int64)
    if width == 0:
        return values, np.zeros(starts.shape, dtype=bool)
    ch, valid = _gather(buf, starts, lengths, width)
    digit = ch - np.uint8(ord("0"))  # wraps for bytes below '0', so one test suffices
    is_digit = digit < 10
    neg = (ch[..., 0] == _MINUS) & (lengths > 1)
    good = is_digit | ~valid
    good[..., 0] |= neg
    bad = ~good.all(axis=-1) | (lengths > _MAX_DECIMAL_DIGITS)
    digit = np.where(valid & is_digit, digit, 0).astype(np.int64)
    for k in range(width):  # Horner over digit columns; past a field's end nothing changes
        values = np.where(valid[..., k], values * 10 + digit[..., k], values)
    values = np.where(neg, -values, values)
    values[bad] = 0
    return values, bad


def _parse_hex(buf, starts, lengths) -> tuple[np.ndarray, np.ndarray]:
    """Hex ids of at most 8 digits; empty -> MISSING. Returns (int64 keys, bad)."""
    if lengths.size and ((lengths == 0) | (lengths == 8)).all():
        return _parse_hex8(buf, starts, lengths)
    width = min(int(lengths.max(initial=0)), _MAX_HEX_DIGITS + 1)
    keys = np.full(starts.shape, MISSING, dtype=np.int64)
    if width == 0:
        return keys, np.zeros(starts.shape, dtype=bool)
    ch, valid = _gather(buf, starts, lengths, width)
    nib = _HEX[ch]
    bad = (valid & (nib == 255)).any(axis=-1) | (lengths > _MAX_HEX_DIGITS)
    nib = np.where(valid, nib, 0).astype(np.int64)
    v = np.zeros(starts.shape, dtype=np.int64)
    for k in range(width):
        v = np.where(valid[..., k], (v << 4) | nib[..., k], v)
    keys = np.where((lengths > 0) & ~bad, v, MISSING)
    return keys, bad


def _parse_hex8(buf, starts, lengths) -> tuple[np.ndarray, np.ndarray]:
    """Fast path of :func:`_parse_hex` when every id has exactly 8 digits (Criteo's case).

    The 8 nibbles of a field sit in the 8 bytes of one uint64 (first digit in the
    lowest byte); three shift-and-mask steps pack them into the 32-bit value.
    """
    nib = _HEX[sliding_window_view(buf, 8)[starts]]  # [..., 8] uint8
    present = lengths == 8
    x = np.ascontiguousarray(nib).view("<u8")[..., 0]
    # A non-hex byte looks up to 255; valid nibbles are < 16, so the top bits flag errors.
    bad = ((x & np.uint64(0x8080808080808080)) != 0) & present
    m1, m2 = np.uint64(0x000F000F000F000F), np.uint64(0x000000FF000000FF)
    x = ((x & m1) << np.uint64(4)) | ((x >> np.uint64(8)) & m1)  # byte pairs -> 16-bit lanes
    x = ((x & m2) << np.uint64(8)) | ((x >> np.uint64(16)) & m2)  # -> 32-bit lanes
    x = ((x & np.uint64(0xFFFF)) << np.uint64(16)) | ((x >> np.uint64(32)) & np.uint64(0xFFFF))
    keys = np.where(present & ~bad, x.astype(np.int64), MISSING)
    return keys, bad


def _parse_hex_lists(buf, starts, lengths):
    """Comma-separated hex ids of ``m`` fields (any order of ``starts``).

    Works in the coordinates of the fields' bytes concatenated in the given order,
    where the tokens come out sorted by field. Returns (keys [nnz] field by field,
    ids per field [m], bad fields [m]).
    """
    m = starts.size
    nonempty = lengths > 0
    first = np.cumsum(lengths) - lengths  # each field's start, concatenated coordinates
    pos = np.repeat(starts - first, lengths) + np.arange(lengths.sum())  # -> buffer offsets
    seps = np.flatnonzero(buf[pos] == _COMMA)
    field_of_sep = np.searchsorted(first, seps, side="right") - 1
    per_field = np.bincount(field_of_sep, minlength=m) + nonempty
    # Within a field: start, comma, ..., comma, end; fields do not overlap.
    tok_start = np.sort(np.concatenate([first[nonempty], seps + 1]))
    tok_end = np.sort(np.concatenate([seps, (first + lengths)[nonempty]]))
    tok_field = np.repeat(np.arange(m), per_field)
    keys, bad = _parse_hex(buf, tok_start + (starts - first)[tok_field], tok_end - tok_start)
    bad |= tok_end == tok_start  # "a,,b" or a trailing comma
    bad_field = np.bincount(tok_field[bad], minlength=m) > 0
    return keys, per_field.astype(np.int64), bad_field


def parse_values(kind: str, data: bytes, lengths: np.ndarray):
    """Many values of one kind of field, parsed as a line's fields are (the same passes, the
    same rules): ``data`` the values' bytes one after another, ``lengths`` each one's count
    of bytes (int64). For rows that are not text (``hybridrec serve``'s JSON values).

    - ``"dense"``: ``(int64 values, bad)``; empty -> 0.
    - ``"onehot"``: ``(int64 keys, bad)``; empty -> :data:`~hybridrec.data.chunk.MISSING`.
    - ``"multihot"``: ``(keys [nnz] value by value, ids per value, bad)``; empty -> no ids.

    Why a bad value is bad: :meth:`CriteoReader.reason` with its field's column.
    """
    lengths = np.asarray(lengths, dtype=np.int64)
    buf = np.frombuffer(data + bytes(_PAD), dtype=np.uint8)  # (the windows never run past it)
    starts = np.cumsum(lengths) - lengths
    if kind == "dense":
        return _parse_decimal(buf, starts, lengths)
    if kind == "onehot":
        return _parse_hex(buf, starts, lengths)
    if kind == "multihot":
        return _parse_hex_lists(buf, starts, lengths)
    raise ValueError(f"parse_values: kind {kind!r} is not dense, onehot or multihot")


def read_criteo(
    path: str | os.PathLike,
    *,
    multihot: tuple[str, ...] = (),
    on_bad_line: str = "error",
    report: ParseReport | None = None,
) -> Iterator[RowChunk]:
    """Convenience: the chunks of one file (see :class:`CriteoReader`)."""
    reader = CriteoReader(multihot=tuple(multihot), on_bad_line=on_bad_line)
    for chunk, _ in reader.read(path, report if report is not None else ParseReport()):
        yield chunk
