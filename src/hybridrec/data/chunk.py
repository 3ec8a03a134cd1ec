"""What every input reader yields: a block of parsed rows, plus the parse report.

Readers (Criteo TSV, CSV, Parquet) turn text into :class:`RowChunk` s of *raw*
categorical keys (a hex hash as an int, a hashed string, a Parquet integer);
preprocessing then maps raw keys to table ids (modulo or vocabulary) and writes
shards. Keeping the readers ignorant of table sizes lets the vocabulary pass and
the writing pass share them.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np

from hybridrec.errors import ConfigError, DataError

MISSING = -1
"""Raw key of a missing one-hot value (maps to id 0 in every encoding)."""

ON_BAD_LINE = ("error", "skip")
DENSE_TRANSFORMS = ("log1p", "none")
MAX_BAD_EXAMPLES = 5

MAX_LINE_BYTES = 1 << 20
"""The longest input line the text readers take: 1 MiB (a Criteo line is 150-500 bytes, a
wide CSV row a few KiB). A longer one ends the read in one line naming the file and the
line number, found having read at most this much of it plus one block: without the cap, a
file without newlines (a 2 MB ``.gz`` holding one 500 MB line) was gathered whole in
memory, 2.7 GB and a minute, before its first field was refused."""


@dataclass
class RowChunk:
    """A block of ``n`` parsed rows.

    Attributes:
        labels: uint8 ``[n]``, 0 or 1.
        dense: float32 ``[n, n_dense]``, already transformed.
        onehot: int64 ``[n, n_onehot]`` raw keys (>= 0), :data:`MISSING` where empty.
        multihot: ``{feature: (keys, lengths)}``: int64 raw keys ``[nnz]`` row-major and
            int64 bag sizes ``[n]`` (an empty field is an empty bag).
    """

    labels: np.ndarray
    dense: np.ndarray
    onehot: np.ndarray
    multihot: dict[str, tuple[np.ndarray, np.ndarray]] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.labels)


@dataclass
class ParseReport:
    """Counts shared by the readers of one preprocessing run."""

    lines_read: int = 0
    """Input lines (or rows) seen, good or bad."""
    bad_lines_skipped: int = 0
    """Malformed lines dropped with ``on_bad_line="skip"``."""
    bad_line_examples: list[str] = field(default_factory=list)
    """The first few skipped lines' error messages (file:line: field: reason)."""

    def skipped(self, count: int, messages: Iterable[str]) -> None:
        """Count ``count`` skipped lines; keep the first few of their (lazy) messages."""
        self.bad_lines_skipped += count
        room = MAX_BAD_EXAMPLES - len(self.bad_line_examples)
        if room > 0:
            self.bad_line_examples.extend(itertools.islice(messages, room))


def line_too_long(path: os.PathLike | str, line: int, cap: int, what: str, unit: str = "bytes") -> DataError:
    """The error of line ``line`` (1-based) of ``path`` running past ``cap`` bytes (or
    characters: ``unit``)."""
    return DataError(f"{path}:{line}: line longer than {cap:,} {unit}, the most a line of {what} may hold "
                     "(is this the right file and format?)")


def capped_lines(text, path: os.PathLike | str, cap: int, what: str) -> Iterable[str]:
    """The lines of text stream ``text`` (newlines kept), each read ``cap`` characters at
    most past its end: a longer one is :func:`line_too_long`, not gathered whole."""
    number = 0
    while True:
        line = text.readline(cap + 2)  # (room for CR LF after cap characters)
        if not line:
            return
        number += 1
        if len(line) > cap and len(line.rstrip("\r\n")) > cap:
            raise line_too_long(path, number, cap, what, "characters")
        yield line


def first_long_line(data: bytes, cap: int) -> int | None:
    """Where the first of ``data``'s lines (each ending in a newline, the last one too)
    longer than ``cap`` bytes begins (its newline, and a CR before it, not counted); None
    when there is none."""
    if len(data) <= cap:
        return None
    ends = np.flatnonzero(np.frombuffer(data, dtype=np.uint8) == 10)
    starts = np.concatenate(([0], ends[:-1] + 1))
    for i in np.flatnonzero(ends - starts > cap).tolist():
        if ends[i] - starts[i] - (data[ends[i] - 1] == 13) > cap:
            return int(starts[i])
    return None


def check_on_bad_line(value: str) -> str:
    if value not in ON_BAD_LINE:
        raise ConfigError(f"on_bad_line: {value!r} is not one of {ON_BAD_LINE}")
    return value


def transform_dense(values: np.ndarray, transform: str = "log1p") -> np.ndarray:
    """Missing must already be 0. ``log1p``: negative -> 0, then log(x+1). Returns float32."""
    x = np.asarray(values, dtype=np.float64)
    if transform == "log1p":
        # Criteo's negative counts carry no usable magnitude; the reference clamps them to 0.
        x = np.log1p(np.maximum(x, 0.0))
    elif transform != "none":
        raise ConfigError(f"dense_transform: {transform!r} is not one of {DENSE_TRANSFORMS}")
    return x.astype(np.float32)


def show(raw: bytes | str, limit: int = 40) -> str:
    """A field's text for an error message, shortened."""
    text = raw.decode("utf-8", "replace") if isinstance(raw, bytes) else str(raw)
    return repr(text if len(text) <= limit else text[:limit] + "...")
