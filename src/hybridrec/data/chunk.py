"""What every input reader yields: a block of parsed rows, plus the parse report.

Readers (Criteo TSV, CSV, Parquet) turn text into :class:`RowChunk` s of *raw*
categorical keys (a hex hash as an int, a hashed string, a Parquet integer);
preprocessing then maps raw keys to table ids (modulo or vocabulary) and writes
shards. Keeping the readers ignorant of table sizes lets the vocabulary pass and
the writing pass share them.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np

from hybridrec.errors import ConfigError

MISSING = -1
"""Raw key of a missing one-hot value (maps to id 0 in every encoding)."""

ON_BAD_LINE = ("error", "skip")
DENSE_TRANSFORMS = ("log1p", "none")
MAX_BAD_EXAMPLES = 5


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
