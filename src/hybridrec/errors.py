"""Errors that reach the user as one clear line (no traceback).

``hybridrec`` prints :class:`HybridrecError` and :class:`OSError` as
``hybridrec: error: PATH: what happened`` (see :func:`os_error_message` for the file
system's errors); anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import contextlib
import errno
import os


class HybridrecError(Exception):
    """Base class: bad input, config or data. The message says what and where."""

    #: True when every rank of a multi-rank run raises this same message (a bad config,
    #: a checkpoint failure the ranks agreed on): one rank reports it for all.
    same_on_every_rank: bool = False


class ConfigError(HybridrecError):
    """An unknown config key or a bad value; the message names the key."""

    same_on_every_rank = True  # every rank builds the same config from the same arguments


class DataError(HybridrecError):
    """Malformed or missing input data; the message names file, line and field."""


class HybridrecWarning(UserWarning):
    """Something the user should know, e.g. a dataset without a held-out split; the CLI
    shows it as one line ``hybridrec: warning: ...``."""


def os_error_message(e: OSError) -> str:
    """``PATH: what happened`` for an error of the file system, e.g.
    ``runs/x: Read-only file system``, ``runs/x: is a file, not a directory``,
    ``runs/x/run: Not a directory (runs/x is a file)``."""
    what = e.strerror or (str(e) if e.args else type(e).__name__)
    if e.filename is None:
        return what
    path = os.fsdecode(e.filename)
    if e.errno in (errno.EEXIST, errno.ENOTDIR):  # mkdir over a file, or a file on the way
        blocker = _first_non_directory(path)
        if blocker == path:
            return f"{path}: {_not_a_directory(path)}"
        if blocker is not None:
            return f"{path}: {what} ({blocker} is {'a file' if os.path.isfile(blocker) else 'not a directory'})"
    if e.filename2 is not None:
        return f"{path} -> {os.fsdecode(e.filename2)}: {what}"
    return f"{path}: {what}"


def _not_a_directory(path: str) -> str:
    return "is a file, not a directory" if os.path.isfile(path) else "exists and is not a directory"


def _first_non_directory(path: str) -> str | None:
    """The first of ``path``'s prefixes that exists and is not a directory (None: none)."""
    parts = path.split(os.sep)
    for i in range(1, len(parts) + 1):
        prefix = os.sep.join(parts[:i])
        if prefix and os.path.lexists(prefix) and not os.path.isdir(prefix):
            return prefix
    return None


@contextlib.contextmanager
def naming(path: str | os.PathLike):
    """Give an :class:`OSError` raised inside without a file name the name ``path``, so
    that, e.g., a full disk while flushing a log says which file (a write or a flush of
    an open file raises ``No space left on device`` without one)."""
    try:
        yield
    except OSError as e:
        if e.filename is not None or e.errno is None:
            raise
        raise type(e)(e.errno, e.strerror, os.fspath(path)) from e
