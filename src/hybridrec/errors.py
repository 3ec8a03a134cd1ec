"""Errors that reach the user as one clear line (no traceback).

``hybridrec`` prints :class:`HybridrecError` and :class:`OSError` as
``hybridrec: error: PATH: what happened`` (see :func:`os_error_message` for the file
system's errors); anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import time
import traceback


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


class PeerGone(HybridrecError):
    """Another process of the run went away (it exited or was killed): not this process's
    fault; the process that failed, or the launcher's line for a killed one, says why. Not
    recorded as a rank's error (:func:`record_error`); the CLI exits quietly under its own
    launcher (``cli.main``)."""


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


# -- a rank's error, recorded for its launcher (hybridrec.cli.launch reads it) --------------
USER_ERROR = 2  # the exit status of an error reported in one line (cli.main's too)


def error_line(e: BaseException) -> str:
    """The one line an error shows the user (without the ``hybridrec: error:`` prefix)."""
    text = os_error_message(e) if isinstance(e, OSError) else str(e)
    return re.sub(r"\s*\n\s*", " ", text).strip() or type(e).__name__


def records_errors(fn):
    """``fn`` (the rank's training entry point) under torch's
    :func:`torch.distributed.elastic.multiprocessing.errors.record`, with an error handler
    that records what :func:`record_error` records: the error reaches this rank's error
    file before it leaves ``fn``, while the rank's process group still stands, so before
    anything that can abort the rank or make the agent stop it."""
    from torch.distributed.elastic.multiprocessing.errors import ErrorHandler, record

    class OneLineErrors(ErrorHandler):
        def initialize(self) -> None:
            """(torch's enables faulthandler, whose dump of every thread on SIGABRT in gloo's
            teardown would bury the one-line error.)"""

        def record_exception(self, e: BaseException) -> None:
            record_error(e)

    return record(fn, error_handler=OneLineErrors())  # (it keeps the name, doc)


def record_error(e: BaseException, status: int = USER_ERROR) -> bool:
    """In a rank of the elastic agent (``TORCHELASTIC_ERROR_FILE`` set), write the line
    ``hybridrec`` shows for ``e`` (an error reported in one line: :class:`HybridrecError`
    or :class:`OSError`; others are not recorded) and the ``status`` the rank exits with to
    the rank's error file, in the format torch's ``ErrorHandler`` writes and its
    ``ProcessFailure`` reads (``errorCode`` as torch's agent sets it). The file is written
    whole or not at all (renamed into place: a half-written one would make the agent fail
    parsing it) and fsynced. Returns whether it was recorded; a file that cannot be written
    changes nothing (the rank still prints its error)."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path or not isinstance(e, (HybridrecError, OSError)) or isinstance(e, (BrokenPipeError, PeerGone)):
        return False
    data = {"message": {"message": error_line(e), "errorCode": status, "extraInfo": {
        "py_callstack": "".join(traceback.format_exception(e)), "timestamp": str(int(time.time()))}}}
    tmp = f"{path}.{os.getpid()}.tmp"
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(json.dumps(data))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        return False
    return True
