"""Writing files durably: whole or not at all, and fsynced.

The one home of the helpers every writer shares (run directories, checkpoints, data
outputs, reports): a whole file written through a temporary file beside it and renamed
(:func:`write_text_atomic`, :func:`write_json_atomic`), a closed file's data and a
directory's entries flushed to the disk (:func:`fsync_file`, :func:`fsync_dir`,
:func:`fsync_tree`), and the mode a file written through a temporary file gets
(:func:`file_mode`). Below every layer: it imports only the standard library, so any
module may use it. The rules for outputs streamed into a file or replacing a directory
(never over an input, only what a command wrote) are :mod:`hybridrec.data.outputs`'.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import tempfile
from pathlib import Path
from typing import Any


def to_jsonable(obj: Any) -> Any:
    """Recursively converts ``obj`` to what ``json.dumps(allow_nan=False)`` accepts.

    Non-finite floats become ``None``; numpy and torch scalars, arrays and tensors (anything
    with ``tolist()``) become Python numbers and (nested) lists; tuples become lists and
    paths strings. Anything else is returned unchanged (json then rejects it).
    """
    if isinstance(obj, dict):
        return {k: to_jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [to_jsonable(v) for v in obj]
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, os.PathLike):
        return os.fspath(obj)
    if not isinstance(obj, (str, bytes, int)) and callable(getattr(obj, "tolist", None)):
        return to_jsonable(obj.tolist())  # numpy / torch: duck-typed, so this module needs neither
    return obj


def write_json_atomic(path: str | os.PathLike[str], obj: Any, *, indent: int | None = 2) -> None:
    """Writes ``obj`` as JSON to ``path`` so readers see the old file or the new, never half
    (:func:`write_text_atomic`). NaN and ±inf are written as ``null`` (see :func:`to_jsonable`).
    """
    write_text_atomic(path, json.dumps(to_jsonable(obj), indent=indent, allow_nan=False) + "\n")


def write_text_atomic(path: str | Path, text: str) -> None:
    """Readers see the old file or the new one, never half of it: a temporary file in the
    destination directory (``os.replace`` is only atomic within one file system), fsynced
    (a crash cannot leave an empty file under the final name), renamed over ``path``,
    removed on error. A file system error names ``path`` (not the temporary file), e.g.
    ``RUN/summary.json: No space left on device``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = None
    try:
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        os.fchmod(fd, file_mode())  # mkstemp's 0600 -> what open() would give (0644)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as e:
        if tmp is not None:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
        if isinstance(e, OSError) and e.errno is not None:
            raise type(e)(e.errno, e.strerror, os.fspath(path)) from e
        raise
    fsync_dir(path.parent)


def file_mode() -> int:
    """The mode a newly created file gets from ``open()``: 0666 less the umask (0644
    with the usual 022), so files written through a temporary file match the others."""
    return 0o666 & ~_umask()


def _umask() -> int:
    try:  # Linux >= 4.7 reports it without changing it
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)  # elsewhere: read by setting it, then put it back
    os.umask(mask)
    return mask


def fsync_dir(directory: Path) -> None:
    """Makes a rename in ``directory`` durable (POSIX); a no-op where unsupported."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def fsync_file(path: Path) -> None:
    """Flush a closed file's data to the disk (a rename after it then never shows an empty
    or short file after a crash)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(directory: Path) -> None:
    """:func:`fsync_file` for every file under ``directory``, then every directory's entries."""
    for root, _, files in os.walk(directory):
        for name in files:
            fsync_file(Path(root) / name)
        fsync_dir(Path(root))
