"""`hybridrec` command line: argument parsing only; the work lives in the library.

Every error a user can cause (a bad config or input, a file system error, a checkpoint
that cannot be saved or loaded) ends the command with one line on stderr,
``hybridrec: error: PATH: what happened``, and exit status 2. ``hybridrec --debug ...``
or ``HYBRIDREC_DEBUG=1`` shows the traceback instead. With several ranks each message
shows once per machine, and a rank whose collective failed because another rank went away
says so in one line, or nothing where that rank's error or the launcher's line shows (see
:mod:`hybridrec.cli.launch`). Output cut short by a closed pipe
(``hybridrec train --list-keys | head``) ends quietly with status 141, as a command
stopped by SIGPIPE does.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import os
import re
import sys
import warnings
from pathlib import Path

from hybridrec import __version__, launch_env
from hybridrec.cli.outcome import (
    BROKEN_PIPE,
    DEBUG_ENV,
    INTERRUPTED,
    LAUNCHED_ENV,
    PEER_LOST,
    debug_enabled,
    peer_failure,
)
from hybridrec.errors import USER_ERROR, HybridrecError, HybridrecWarning, PeerGone, error_line


def build_parser() -> argparse.ArgumentParser:
    from hybridrec.cli import bench as bench_cmd
    from hybridrec.cli import data as data_cmd
    from hybridrec.cli import plan as plan_cmd
    from hybridrec.cli import report as report_cmd
    from hybridrec.cli import train as train_cmd

    p = argparse.ArgumentParser(
        prog="hybridrec",
        description=(
            "Train DLRM-class recommendation models (sharded embeddings + dense MLPs) "
            "on click logs such as Criteo."
        ),
    )
    p.add_argument("--version", action="version", version=f"hybridrec {__version__}")
    p.add_argument("--debug", action="store_true",
                   help=f"show the full traceback of an error (also: {DEBUG_ENV}=1)")
    # What the ranks a command launches run (hybridrec.cli.launch.rank_main): this same entry.
    p.set_defaults(entry=main)
    sub = p.add_subparsers(dest="command", metavar="COMMAND", required=True)
    data_cmd.register(sub)
    train_cmd.register(sub)
    __import__("hybridrec.cli.predict", fromlist=["register"]).register(sub)
    __import__("hybridrec.cli.export", fromlist=["register"]).register(sub)
    __import__("hybridrec.cli.serve", fromlist=["register"]).register(sub)
    plan_cmd.register(sub)
    bench_cmd.register(sub)
    report_cmd.register(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    with warnings.catch_warnings():
        return _main(argv)


def _main(argv: list[str] | None) -> int:
    try:
        args = build_parser().parse_args(argv)
        if args.debug:  # ranks and subprocesses (torchrun workers, sweep runs) inherit it
            os.environ[DEBUG_ENV] = "1"
        if not debug_enabled():
            warnings.showwarning = _one_line_warnings(warnings.showwarning)
        status = int(args.func(args) or 0)
        sys.stdout.flush()  # a closed pipe shows here, not at interpreter exit
        return status
    except KeyboardInterrupt:
        if not os.environ.get(LAUNCHED_ENV):  # a rank of `hybridrec train`: its launcher says it
            print("interrupted", file=sys.stderr)
        return INTERRUPTED
    except BrokenPipeError:
        _silence_stdout()
        return BROKEN_PIPE
    except PeerGone as e:  # another process of the run went away: the launcher, or its own error, says why
        if debug_enabled():
            raise
        if not (os.environ.get(LAUNCHED_ENV) or _reported_on_this_machine()):
            report(e)
        return PEER_LOST
    except (HybridrecError, OSError) as e:
        if debug_enabled():
            raise
        if isinstance(e, HybridrecError) and _several_ranks() and peer_failure(e) == "lost":
            # (e.g. the shadow sync thread's round with a rank that was killed: that rank,
            # or the launcher's line for it, says why; this one only lost its peer)
            return _peer_failed("lost")
        report(e)
        return USER_ERROR
    except Exception as e:
        why = peer_failure(e) if _several_ranks() and not debug_enabled() else None
        if why is None:
            raise
        return _peer_failed(why)


def _one_line_warnings(show):
    """hybridrec's own warnings as ``hybridrec: warning: ...``, others as ``show`` does."""
    package = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep

    def show_warning(message, category, filename, lineno, file=None, line=None):
        if issubclass(category, HybridrecWarning) or (
                issubclass(category, UserWarning) and os.path.abspath(filename).startswith(package)):
            text = re.sub(r"\s*\n\s*", " ", str(message)).strip()
            with contextlib.suppress(OSError):
                print(f"hybridrec: warning: {text}", file=sys.stderr if file is None else file, flush=True)
        else:
            show(message, category, filename, lineno, file, line)

    return show_warning


def report(e: BaseException) -> None:
    """Print the error line; with several ranks, each message once (see :func:`_first_to_say`)."""
    line = f"hybridrec: error: {error_line(e)}"
    if not _first_to_say(line, getattr(e, "same_on_every_rank", False)):
        return
    try:
        print(line, file=sys.stderr, flush=True)
    except BrokenPipeError:  # stderr itself is gone: nobody to tell
        pass


def _first_to_say(line: str, same_on_every_rank: bool) -> bool:
    """Whether this process prints ``line``. One process: yes. Ranks of torchrun (which
    gives each a TORCHELASTIC_ERROR_FILE in one directory per attempt): the first local
    rank to claim the message in that directory prints it, so a message every rank raises
    shows once per machine and a message of one rank still shows. Other launchers: rank 0
    prints errors that every rank raises alike, every rank prints its other errors."""
    if launch_env.world_size() <= 1:
        return True
    error_file = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if error_file:
        digest = hashlib.sha256(line.encode()).hexdigest()[:16]
        marker = Path(error_file).parent.parent / f"hybridrec-error-{digest}"
        try:
            os.close(os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644))
        except FileExistsError:
            return False  # another local rank printed this same line
        except OSError:
            return True  # cannot tell: better twice than never
        return True
    return launch_env.rank() == 0 or not same_on_every_rank


def _several_ranks() -> bool:
    return launch_env.world_size() > 1


def _peer_failed(why: str) -> int:
    """A rank whose collective failed because of another rank. Its peer went away
    (``why == "lost"``): the rank that failed says why (its error, or the launcher's line
    for a killed rank), so this one says nothing where that shows: under `hybridrec
    train`'s launcher, or once a rank of this machine has reported an error; otherwise one
    line per machine. A peer that stopped taking part (a timeout) is this rank's error to
    report, once per machine."""
    if why != "lost":
        report(HybridrecError(f"a collective of the ranks failed: {why} (dist.timeout_s bounds "
                              "it): another rank stopped taking part (hung, or far slower)"))
        return USER_ERROR
    if os.environ.get(LAUNCHED_ENV) or _reported_on_this_machine():
        return PEER_LOST
    report(HybridrecError("lost the connection to another rank: it exited or was killed (its own "
                          "error, or its launcher's report, says why)"))
    return PEER_LOST


def _reported_on_this_machine() -> bool:
    """Whether a local rank of this torchrun attempt has printed an error (its marker,
    see :func:`_first_to_say`)."""
    error_file = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not error_file:
        return False
    try:
        return any(p.name.startswith("hybridrec-error-") for p in Path(error_file).parent.parent.iterdir())
    except OSError:
        return False


def _silence_stdout() -> None:
    """Point stdout at /dev/null, so that flushing it at exit raises nothing."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError, AttributeError):  # stdout replaced (e.g. captured in tests)
        pass
