"""Local ranks of one command through torch's elastic agent (what ``torchrun --standalone``
runs), started in this process so that a failure ends in one line instead of torchrun's
report.

Each rank prints its own error once per machine (see ``cli.main``); a rank that only lost
its peers (their sockets closed under a collective) exits with :data:`PEER_LOST` and says
nothing, since the rank that failed first says why. When a rank fails, the agent stops the
others (SIGTERM) and :func:`run_local_ranks` prints one line naming the rank that failed
and how: ``hybridrec: error: rank 1 exited with code 2 (see above)``. The agent's own log
and tracebacks show only with ``--debug`` / ``HYBRIDREC_DEBUG=1``.

The ranks are forked from one server process that has imported torch and hybridrec's
training code once (multiprocessing's ``forkserver`` with a preload, torch's elastic agent
starting a function rather than a new interpreter): a restart after a failure
(``dist.max_restarts``) then costs no interpreter start-up and no imports, which were
most of a restart's seconds. ``hybridrec train`` starts that server first thing
(:func:`start_rank_server`), so that its imports run on another core while the launcher
checks the run directory (which imports torch too), rather than after. Each rank still
runs the command as ``python -m hybridrec`` would, with this launcher's environment under
the agent's own variables.

A rank's error line is also written, before the error leaves ``train`` (see
:func:`hybridrec.errors.records_errors`), to the error file torch's agent gives each rank
(``TORCHELASTIC_ERROR_FILE``, read back into ``ProcessFailure.error_file_data``). What
happens after that cannot hide it: the rank may still die in the process group's teardown
(gloo aborts it: SIGABRT), or be stopped by the agent (SIGTERM) because its peer, whose
collective lost it, exited first. A recorded error is the run's cause whatever the rank
then died of; a line no rank got to print, the launcher prints.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import math
import multiprocessing
import os
import signal
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

from hybridrec import launch_env
from hybridrec.cli.lifeline import die_with_parent, end_with
from hybridrec.cli.outcome import BROKEN_PIPE, INTERRUPTED, LAUNCHED_ENV, PEER_LOST, debug_enabled

PEER_LOST_WAIT_S = 10.0
"""How long a rank that lost its peer waits for the agent to stop it (see :func:`rank_main`)."""

PRELOAD = ("hybridrec.cli.lifeline", "torch", "torch.distributed.checkpoint", "torch.nn.parallel", "torch._dynamo",
           "numpy.random", "hybridrec.cli.launch", "hybridrec.cli.main", "hybridrec.cli.train", "hybridrec.train.run")
"""What the server the ranks are forked from imports once (see the module's docstring); this
module among them, so that :data:`_BASE_ENV` is the server's environment."""

_BASE_ENV = dict(os.environ)
"""The environment this module was imported with: in a forked rank, the fork server's."""


def run_local_ranks(nproc: int, argv: Sequence[str], *, entry: Callable[[list[str]], int],
                    servers: int = 0, port: int = 0, max_restarts: int = 0,
                    injection_marker: str | None = None, nnodes: int = 1, node_rank: int = 0,
                    master: str = "", interface: str = "", join_timeout_s: float = 600.0,
                    terminated: Callable[[], str] | None = None) -> int:
    """Run ``python -m hybridrec ARGV`` as ``nproc`` local ranks (a standalone c10d
    rendezvous, as ``torchrun --standalone --nproc-per-node=NPROC``); returns the exit
    status: 0, or the failing rank's (1 when it was killed by a signal) after printing
    one line that names it. The agent stops every rank when one fails.

    ``entry``: what each rank runs with ``ARGV`` and exits with, the command line's own
    :func:`hybridrec.cli.main.main`, handed down by the command that launches (the parsed
    arguments' ``entry``): the command line sits above its launcher, so this module does
    not import it.

    ``servers``: the last ranks are parameter servers (named so in that line; the RPC
    agent's own C++ warnings about closed connections stay quiet without --debug).
    ``port``: the rendezvous port on this machine (0: a free one); a port in use is a
    :class:`~hybridrec.errors.ConfigError` before anything starts.
    ``max_restarts``: after a failure the agent stops every rank and starts them all again,
    this many times at most (the ranks resume from the run's newest checkpoint).
    ``injection_marker``: where ``train.inject_failure`` records the pid it killed, so that
    the line says the kill was injected.
    ``nnodes`` > 1: this machine's ranks of a launch of several machines, which rendezvous at
    ``master`` (``HOST:PORT``, hosted by machine ``node_rank`` 0) over network interface
    ``interface``, the only one their sockets bind (see :mod:`hybridrec.cli.rendezvous`); it
    waits ``join_timeout_s`` at most for the other machines (then a
    :class:`~hybridrec.cli.rendezvous.MachinesMissing` names those that did not come).
    ``terminated``: the line to say when this launcher is stopped by SIGTERM (once its ranks
    ended; see :mod:`hybridrec.train.terminate`), instead of ``stopped by SIGTERM``."""
    import torch.distributed.run as torchrun
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import elastic_launch

    with tempfile.TemporaryDirectory(prefix="hybridrec-ranks-") as logs:  # (mode 0700)
        args = torchrun.parse_args([f"--nproc-per-node={nproc}", f"--log-dir={logs}", f"--nnodes={nnodes}",
                                    f"--max-restarts={max_restarts}", "-m", "hybridrec", *argv])
        interface = _rendezvous_args(args, logs, port, nnodes, node_rank, master, interface, join_timeout_s)
        env = _ranks_env(servers, interface)
        oom_kills = oom_kill_count()
        with _environ(env), _signal_handlers_kept(), _agent_quiet(not debug_enabled()), _one_agent_rendezvous():
            config, _, _ = torchrun.config_from_args(args)
            config.start_method = "forkserver"
            multiprocessing.get_context("forkserver").set_forkserver_preload(list(PRELOAD))
            try:
                elastic_launch(config=config, entrypoint=rank_main)(entry, list(argv), dict(os.environ), os.getpid())
            except ChildFailedError as e:
                if debug_enabled():
                    print(e, file=sys.stderr)
                line, status = failure_line(e.failures, servers_from=nproc - servers if servers else None,
                                            injected_pid=_injected_pid(injection_marker),
                                            oom_killed=_oom_killed(oom_kills))
                if status != BROKEN_PIPE:  # output cut short (`| head`): ends quietly, as one process does
                    for message in unprinted_errors(e.failures) if nproc > 1 else ():
                        _say(f"hybridrec: error: {message}")
                    _say(f"hybridrec: error: {line}")
                return status
            except SignalException as e:  # the agent was signalled; it stopped the ranks
                if e.sigval == signal.SIGINT:
                    _say("interrupted")
                elif e.sigval == signal.SIGTERM and terminated is not None:
                    _say(terminated())  # (the ranks, launched, said nothing)
                else:
                    _say(f"hybridrec: error: stopped by {signal.Signals(e.sigval).name}")
                return 128 + int(e.sigval)
    return 0


def start_rank_server(*, servers: int = 0, nnodes: int = 1, interface: str = "") -> None:
    """Start the server the ranks of :func:`run_local_ranks` (same ``servers``, ``nnodes``
    and ``interface``) are forked from, with their environment, and return without waiting
    for it: its imports (torch and the training code, seconds of CPU) then run while this
    process does its own work before the launch (the run directory's checks import torch
    too), on another core, instead of after it. :func:`run_local_ranks` uses the server
    started here; without this call it starts one itself. A server this process no longer
    needs (the launch was refused) dies with it (see :mod:`hybridrec.cli.lifeline`)."""
    from multiprocessing import forkserver

    from hybridrec.cli.rendezvous import loopback_interface

    with _environ(_ranks_env(servers, loopback_interface() if nnodes == 1 else interface)):
        multiprocessing.get_context("forkserver").set_forkserver_preload(list(PRELOAD))
        forkserver.ensure_running()


def _ranks_env(servers: int, interface: str | None) -> dict[str, str]:
    """What a launch adds to its ranks' environment (and its fork server's, whose imports
    read some of it: ``OMP_NUM_THREADS``, ``TORCH_CPP_LOG_LEVEL``)."""
    from hybridrec.cli.rendezvous import interface_env

    env = {LAUNCHED_ENV: "1", **interface_env(interface)}
    if servers and not debug_enabled() and "TORCH_CPP_LOG_LEVEL" not in os.environ:
        env["TORCH_CPP_LOG_LEVEL"] = "ERROR"
    if "OMP_NUM_THREADS" not in os.environ:  # torchrun's default for several ranks, silently
        env["OMP_NUM_THREADS"] = "1"
    return env


def _rendezvous_args(args, logs: str, port: int, nnodes: int, node_rank: int, master: str,
                     interface: str, join_timeout_s: float = 600.0) -> str | None:
    """Point torchrun's ``args`` at this launch's rendezvous (:mod:`hybridrec.cli.rendezvous`):
    as ``torchrun --standalone`` on one machine, but on loopback alone; across machines, at
    ``master`` over ``interface`` alone, waiting ``join_timeout_s`` (torch's ``join_timeout``,
    whole seconds) at most for the others. Returns the interface the ranks' sockets use."""
    from hybridrec.cli.rendezvous import (
        LOOPBACK,
        interface_address,
        local_rendezvous,
        loopback_interface,
        network_rendezvous,
    )

    if nnodes == 1:
        if port:
            check_port_free(port)
        args.rdzv_backend, args.rdzv_id = local_rendezvous(), str(uuid.uuid4())
        args.rdzv_endpoint, args.rdzv_conf = os.path.join(logs, "rendezvous"), f"store_port={port}"
        args.local_addr = LOOPBACK
        return loopback_interface()
    from hybridrec.errors import ConfigError

    try:
        address = interface_address(interface)
    except OSError as e:
        raise ConfigError(f"dist.interface={interface}: no IPv4 address on this machine ({e.strerror or e})") from None
    args.rdzv_backend, args.rdzv_id, args.rdzv_endpoint = network_rendezvous(), f"hybridrec-{master}", master
    args.rdzv_conf = (f"bind_addr={address},is_host={int(node_rank == 0)},node_rank={node_rank},"
                      f"join_timeout={max(1, math.ceil(join_timeout_s))}")
    args.local_addr = address
    return interface


def rank_main(entry: Callable[[list[str]], int], argv: list[str], environ: dict[str, str],
              launcher: int | None = None) -> None:
    """One rank of :func:`run_local_ranks`: ``python -m hybridrec ARGV`` (``entry(argv)``, the
    command line's main) in a process forked from the preloaded server. Its environment is the launcher's (``environ``, as a new
    interpreter would inherit it; the server's is the first launch's) with the variables
    the agent set for this rank on top; output is unbuffered, as ``python -u``. The
    process is named ``hybridrec-rRANK`` (what ``top`` and ``ps -o comm`` show). It ends
    the moment the launcher (pid ``launcher``) does, however that died (see
    :func:`end_with`)."""
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # (the fork server ignores it: see hybridrec.cli.lifeline)
    die_with_parent()  # (the fork server, which dies with the launcher: see hybridrec.cli.lifeline)
    if launcher is not None:
        end_with(launcher, "its launcher")
    agent = {k: v for k, v in os.environ.items() if _BASE_ENV.get(k) != v}
    os.environ.clear()
    os.environ.update(environ)
    os.environ.update(agent)
    _threads_as_a_new_interpreter()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(AttributeError, ValueError):
            stream.reconfigure(write_through=True)
    # multiprocessing's default start method as a new interpreter has it, not the server's
    # (named semaphores a killed rank would leave to the launcher's resource tracker)
    multiprocessing.set_start_method(None, force=True)
    with contextlib.suppress(OSError):  # Linux; at most 15 characters
        Path("/proc/self/comm").write_text(f"hybridrec-r{launch_env.rank()}"[:15])
    status = entry(argv)
    if status == PEER_LOST:
        # The agent reports the first failed rank it finds, one only, for ranks that are
        # functions: this one lost its peer, so the peer, dead or exiting with its own
        # error, is the one to find. The agent's SIGTERM ends the wait.
        time.sleep(PEER_LOST_WAIT_S)
    raise SystemExit(status)


def _threads_as_a_new_interpreter() -> None:
    """Give this rank the thread count a new interpreter would take from ``OMP_NUM_THREADS``
    (1 unless the user set it: :func:`_ranks_env`). OpenMP read the variable once, when the
    fork server imported torch, from that server's environment: a server another launch or
    another library started first (multiprocessing keeps one per process, and a later launch
    reuses it) may have had none, and its ranks would run torch's default, every core each: a
    2-rank run on 2 cores then ran 2 threads a rank, oversubscribed, and not bit for bit the
    run a new interpreter makes."""
    threads = os.environ.get("OMP_NUM_THREADS", "")
    if threads.isdigit() and int(threads) > 0:
        import torch

        torch.set_num_threads(int(threads))


def check_port_free(port: int) -> None:
    """Refuse a rendezvous port another process holds (``dist.port``), in one line."""
    import errno
    import socket

    from hybridrec.errors import ConfigError

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("localhost", port))
        except OSError as e:
            why = "address already in use" if e.errno == errno.EADDRINUSE else (e.strerror or str(e))
            raise ConfigError(f"localhost:{port}: {why} (dist.port; 0 picks a free port)") from None


def _injected_pid(marker: str | None) -> int | None:
    """The pid ``train.inject_failure`` killed last, from its marker file (None: none; a
    schedule of several records them all, the newest last)."""
    if not marker:
        return None
    from hybridrec.train.checkpointing.faults import last_injected_pid

    return last_injected_pid(os.path.dirname(marker))


def failure_line(failures: dict, servers_from: int | None = None,
                 injected_pid: int | None = None, oom_killed: bool | None = None) -> tuple[str, int]:
    """The line that says which rank ended the run and how, and the exit status to return,
    from the agent's ``{rank: ProcessFailure}``. A rank that recorded its error (see
    :func:`~hybridrec.errors.record_error`) is the cause, with the status it recorded, however it then died
    (SIGABRT in gloo's teardown, the agent's SIGTERM); only a kill by
    ``train.inject_failure`` comes before it. Without a recorded error, the ranks the agent
    stopped (SIGTERM) and those that only lost their peers (:data:`PEER_LOST`) are not the
    cause unless nothing else failed; a rank killed by a signal is named with it.
    ``servers_from``: the first rank that is a parameter server. ``injected_pid``: the
    process ``train.inject_failure`` killed (its SIGKILL is named as injected).
    ``oom_killed``: whether the kernel's out-of-memory killer killed a process of this
    machine's memory cgroup meanwhile (None: unknown; see :func:`oom_kill_count`)."""
    def label(r: int) -> str:
        return f"parameter server ps{r - servers_from} (rank {r})" if servers_from is not None and r >= servers_from \
            else f"rank {r}"

    def stopped(f) -> bool:  # (128 + 15: a survivor that ended itself after its snapshot)
        return f.exitcode in (PEER_LOST, -signal.SIGTERM, 128 + signal.SIGTERM)

    ranked = sorted(failures.items(), key=lambda kv: (kv[1].timestamp, kv[0]))
    recorded = [(r, rec[1]) for r, f in ranked if (rec := recorded_error(f)) is not None]
    injected = [(r, f) for r, f in ranked if injected_pid is not None and f.pid == injected_pid
                and f.exitcode == -signal.SIGKILL]
    if recorded and not injected:
        causes = recorded
    else:
        kept = injected or [(r, f) for r, f in ranked if not stopped(f)] or ranked
        rank, first = kept[0]
        if first.exitcode < 0:
            return _killed_line(label(rank), first, injected_pid, oom_killed), 1
        causes = [(r, f.exitcode) for r, f in kept]
    status = causes[0][1]
    same = sorted(r for r, s in causes if s == status)
    names = [str(r) for r in same]
    who = label(same[0]) if len(names) == 1 else f"ranks {', '.join(names[:-1])} and {names[-1]}"
    if status == INTERRUPTED:
        return f"{who} interrupted", INTERRUPTED
    return f"{who} exited with code {status} (see above)", status


def _killed_line(who: str, f, injected_pid: int | None, oom_killed: bool | None = None) -> str:
    try:
        name = signal.Signals(-f.exitcode).name
    except ValueError:
        name = f"signal {-f.exitcode}"
    line = f"{who} (pid {f.pid}) was killed by {name}"
    if f.exitcode == -signal.SIGKILL and injected_pid is not None and f.pid == injected_pid:
        line += " (injected: train.inject_failure)"
    elif f.exitcode == -signal.SIGKILL and oom_killed:
        line += " (the kernel's out-of-memory killer: this machine's memory cgroup counted a kill)"
    elif f.exitcode == -signal.SIGKILL and oom_killed is None:
        line += " (by another process, or by the kernel's out-of-memory killer)"
    elif f.exitcode == -signal.SIGKILL:
        line += " (by another process: not the out-of-memory killer, which counted no kill)"
    return line


def oom_kill_count() -> int | None:
    """How many processes the kernel's out-of-memory killer has killed in this process's
    memory cgroup (cgroup v2 ``memory.events``, v1 ``memory.oom_control``), or None where
    that cannot be read. Read before the ranks start and after one was killed, it says
    whether the OOM killer sent a SIGKILL."""
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None
    places = []
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":
            places.append(Path("/sys/fs/cgroup" + path) / "memory.events")
        elif "memory" in controllers.split(","):
            places += [Path("/sys/fs/cgroup/memory" + path) / "memory.oom_control",
                       Path("/sys/fs/cgroup/memory/memory.oom_control")]  # (a container's own view)
    for place in places:
        try:
            for row in place.read_text().splitlines():
                key, _, value = row.partition(" ")
                if key == "oom_kill":
                    return int(value)
        except (OSError, ValueError):
            continue
    return None


def _oom_killed(before: int | None) -> bool | None:
    after = oom_kill_count()
    return None if before is None or after is None else after > before


# -- a rank's error, recorded for the launcher ---------------------------------------------
def recorded_error(failure) -> tuple[str, int] | None:
    """``(line, status)`` a failed rank recorded with :func:`~hybridrec.errors.record_error`, from the agent's
    ``ProcessFailure`` (None: it recorded nothing). The status is the rank's exit status,
    or where a signal ended it after it recorded its error, the status it recorded."""
    data = getattr(failure, "error_file_data", None)
    message = data.get("message") if isinstance(data, dict) else None
    if not isinstance(message, dict) or not isinstance(message.get("message"), str):
        return None
    code = message.get("errorCode")
    if failure.exitcode > 0:
        return message["message"], failure.exitcode
    return message["message"], code if isinstance(code, int) and code > 0 else 1


def unprinted_errors(failures: dict) -> list[str]:
    """The recorded error lines (each once, the first recorded first) that no rank printed:
    a rank claims a line in its attempt's directory before printing it (``cli.main``'s
    ``_first_to_say``, for ranks of several), so an unclaimed one was recorded by a rank
    that died before it could print it."""
    out: list[str] = []
    for _, f in sorted(failures.items(), key=lambda kv: (kv[1].timestamp, kv[0])):
        rec = recorded_error(f)
        if rec is None or rec[0] in out:
            continue
        line = f"hybridrec: error: {rec[0]}"
        digest = hashlib.sha256(line.encode()).hexdigest()[:16]  # as _first_to_say names it
        if not (Path(f.error_file).parent.parent / f"hybridrec-error-{digest}").exists():
            out.append(rec[0])
    return out


def _say(line: str) -> None:
    with contextlib.suppress(OSError):
        print(line, file=sys.stderr, flush=True)


@contextlib.contextmanager
def _environ(values: dict[str, str]) -> Iterator[None]:
    """``values`` in os.environ (the agent passes its environment to the ranks), put back after."""
    before = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in before.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@contextlib.contextmanager
def _one_agent_rendezvous() -> Iterator[None]:
    """While this launch's agent runs, two costs of torch's c10d rendezvous that serve many
    machines' agents are left out, since here one agent rendezvouses with itself:

    - Before it joins the first round, an agent sleeps a random 0-0.3 s, so that many
      machines' first attempts spread out. Its state still says round 0 when it joins again
      after a failure, so every restart (``dist.max_restarts``) slept too: 0.15 s on
      average, a sixth of a partial recovery's restart here.
    - Every event the rendezvous records names its caller through ``inspect.stack()``,
      which reads the source of every frame on the stack (25 ms a call, a dozen calls a
      rendezvous). The same name is taken from the caller's frame instead.

    A fixed delay (a retry's) is kept; with another version of torch that lacks either
    function, nothing is changed."""
    try:
        from torch.distributed.elastic.rendezvous import dynamic_rendezvous as rdzv
    except ImportError:  # pragma: no cover - torch without the elastic rendezvous
        yield
        return
    saved = (getattr(rdzv, "_delay", None), getattr(rdzv, "get_method_name", None))
    if not all(callable(f) for f in saved):
        yield
        return
    delay, _ = saved

    def no_spread(seconds) -> None:
        if not isinstance(seconds, tuple):  # (a random spread is a (low, high) pair)
            delay(seconds)

    def method_name(depth: int = 2) -> str:
        try:  # (inspect.stack()[depth] is this frame's depth-th caller, as here)
            return sys._getframe(depth).f_code.co_name
        except ValueError:
            return "no_method_name"

    rdzv._delay, rdzv.get_method_name = no_spread, method_name
    try:
        yield
    finally:
        rdzv._delay, rdzv.get_method_name = saved


@contextlib.contextmanager
def _signal_handlers_kept() -> Iterator[None]:
    """The agent installs its own handlers for SIGTERM/SIGINT/SIGHUP/SIGQUIT; this
    process's are put back afterwards."""
    names = ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT")
    sigs = [getattr(signal, n) for n in names if hasattr(signal, n)]
    before = {s: signal.getsignal(s) for s in sigs}
    try:
        yield
    finally:
        for s, handler in before.items():
            if handler is not None:
                with contextlib.suppress(ValueError, OSError):
                    signal.signal(s, handler)


@contextlib.contextmanager
def _agent_quiet(quiet: bool) -> Iterator[None]:
    """Without --debug, the agent's log lines (workers started, SIGTERM sent, failed
    with exit code ...) are not shown: the line :func:`run_local_ranks` prints says it."""
    if not quiet:
        yield
        return
    before = logging.root.manager.disable
    logging.disable(logging.ERROR)
    try:
        yield
    finally:
        logging.disable(before)
