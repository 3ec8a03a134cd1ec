"""Opening raw input files: plain or gzip, with errors that name the file."""

from __future__ import annotations

import contextlib
import gzip
import os
import re
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

from hybridrec.errors import DataError

_GZIP_MAGIC = b"\x1f\x8b"


class InputStream:
    """A binary input, decompressed if it is gzip; ``position`` is in on-disk bytes.

    Reads raise :class:`DataError` naming the file (a truncated ``.gz`` otherwise
    surfaces as a bare ``EOFError`` deep inside ``gzip``).
    """

    def __init__(self, path: Path, raw: BinaryIO) -> None:
        self.path = path
        self.raw = raw
        self.size = os.fstat(raw.fileno()).st_size
        self.compressed = raw.read(2) == _GZIP_MAGIC  # by content, not by suffix
        raw.seek(0)
        self.stream: BinaryIO = gzip.GzipFile(fileobj=raw, mode="rb") if self.compressed else raw

    @property
    def position(self) -> int:
        """On-disk bytes consumed so far (for progress bars)."""
        return self.raw.tell()

    def read(self, n: int) -> bytes:
        try:
            return self.stream.read(n)
        except (EOFError, OSError, zlib.error) as e:
            kind = "gzip" if self.compressed else "file"
            raise DataError(f"{self.path}: truncated or corrupt {kind} ({e})") from None


@contextlib.contextmanager
def open_input(path: str | os.PathLike) -> Iterator[InputStream]:
    path = Path(path)
    try:
        raw = open(path, "rb")  # noqa: SIM115 (closed below)
    except OSError as e:
        raise DataError(f"{path}: cannot open input ({e.strerror})") from None
    try:
        yield InputStream(path, raw)
    finally:
        raw.close()


def check_inputs(inputs: list[str | os.PathLike]) -> list[Path]:
    """Input paths exist and are files; at least one is given."""
    if not inputs:
        raise DataError("no input files given")
    paths = [Path(p) for p in inputs]
    for p in paths:
        if not p.exists():
            raise DataError(f"{p}: input file does not exist")
        if not p.is_file():
            raise DataError(f"{p}: input is not a file")
    return paths


_NUMBERED = re.compile(r"^(.*?)(\d+)(\D*)$")


def text_order_note(inputs: list[Path]) -> str | None:
    """A note when numbered inputs (``day_0.tsv`` .. ``day_10.tsv``) are given in text order
    rather than by number, as a shell glob lists them: the order decides which input is last
    (the default eval split) and the order of the parts. ``None`` when they are in numeric
    order, not all numbered alike, or fewer than two."""
    if len(inputs) < 2:
        return None
    keys = []
    for p in inputs:
        m = _NUMBERED.match(p.name)
        if m is None:
            return None
        keys.append((m.group(1), int(m.group(2)), m.group(3)))
    if len({(a, c) for a, _, c in keys}) != 1:  # not one stem with a varying number
        return None
    numbers = [n for _, n, _ in keys]
    if numbers == sorted(numbers):
        return None
    last = max(range(len(inputs)), key=lambda i: numbers[i])
    return (f"inputs are not in numeric order ({inputs[-1].name} is last, {inputs[last].name} "
            f"has the highest number); a shell glob sorts them as text. The last input is the "
            f"default eval split: pass the files in day order, or --eval-parts {inputs[last].name}")
