"""How a command ends, shared by the command line (:mod:`hybridrec.cli.main`) and the local
launcher (:mod:`hybridrec.cli.launch`): exit statuses, debug mode, the mark of a rank that
hybridrec's own launcher started, and whether an error is a lost peer's. Imports nothing of
hybridrec: every command's error handling reads it.
"""

from __future__ import annotations

import os
import re
import sys

DEBUG_ENV = "HYBRIDREC_DEBUG"
"""``HYBRIDREC_DEBUG=1`` (or ``hybridrec --debug``): tracebacks instead of one-line errors."""

LAUNCHED_ENV = "HYBRIDREC_LAUNCHED"
"""Set in the ranks' environment: the launcher reports how the run ended, so a rank that
only lost its peers, or was interrupted, stays quiet."""

PEER_LOST = 3
"""The exit status of a rank that stopped because another rank went away."""

BROKEN_PIPE = 128 + 13
"""The shell's status for a command killed by SIGPIPE: output cut short by a closed pipe."""

INTERRUPTED = 130
"""The status of a command stopped by Ctrl-C (SIGINT)."""

_PEER_GONE = ("Connection reset by peer", "Connection closed by peer", "Broken pipe",
              "Socket closed", "Connection refused")
_TIMED_OUT = re.compile(r"Timed out waiting \d+ ?ms[^.\n]*|timed out after [^.\n]*|Socket Timeout",
                        re.IGNORECASE)
_COMM_MARKS = ("gloo", "c10d", "ProcessGroup", "TCPStore", "nccl", "NCCL")


def debug_enabled() -> bool:
    """Whether errors show their traceback (:data:`DEBUG_ENV` set to anything but 0/false/no/off)."""
    return os.environ.get(DEBUG_ENV, "").strip().lower() not in ("", "0", "false", "no", "off")


def peer_failure(e: BaseException) -> str | None:
    """For an error of a rank's collective (or a store operation) whose cause is another
    rank: ``"lost"`` when the peer's connection closed (it exited or was killed), the
    timeout's text when the peer stopped taking part, else None (any other error)."""
    seen: set[int] = set()
    x: BaseException | None = e
    while x is not None and id(x) not in seen:
        seen.add(id(x))
        if isinstance(x, RuntimeError) and not isinstance(x, NotImplementedError):
            msg = str(x)
            if _is_distributed_error(x) or any(m in msg for m in _COMM_MARKS):
                timed_out = _TIMED_OUT.search(msg)
                if timed_out:
                    return timed_out.group(0).strip()
                if any(p in msg for p in _PEER_GONE):
                    return "lost"
        x = x.__cause__ or x.__context__
    return None


def _is_distributed_error(e: BaseException) -> bool:
    dist = sys.modules.get("torch.distributed")
    cls = getattr(dist, "DistError", None) if dist is not None else None
    return cls is not None and isinstance(e, cls)
