"""Where a launch of hybridrec listens: loopback on one machine, the named interface across
machines.

torch's store and RPC have no authentication: whoever reaches their sockets can write the
rendezvous state, which torch's c10d rendezvous unpickles, and a parameter server's RPC
runs what it is sent. ``torchrun --standalone`` hosts its rendezvous store (and the store it
shares with the ranks) on every interface, IPv4 and IPv6, so a process on another machine
of the network could run code as the user who trained. A run of one machine needs none of
that reach; here every socket of a local launch binds loopback:

- the rendezvous state lives in a :class:`~torch.distributed.FileStore` inside the launch's
  private directory (``mkdtemp``: mode 0700), not on a socket;
- the store the ranks join (``MASTER_ADDR:MASTER_PORT``) is a
  :class:`~torch.distributed.TCPStore` given a socket already bound to 127.0.0.1
  (``master_listen_fd``: torch's store otherwise binds every interface, whatever host it is
  given); ``dist.port`` is that store's port;
- gloo's pairs and TensorPipe's RPC listen on the loopback interface
  (``GLOO_SOCKET_IFNAME`` / ``TP_SOCKET_IFNAME``, unless the user set them).

A launch of several machines (``dist.nnodes``, ``dist.master``, ``dist.interface``) binds the
interface the user names instead: machine 0 hosts the rendezvous state in a TCPStore bound to
that interface's address (the others join it at ``dist.master``), every machine's shared
store binds it too, and gloo and TensorPipe use it. Under torchrun, torchrun's own store
listens on every interface of its host and torch offers no way to bind it to one: such a run
belongs on a private network (README, "Trust").

Every attempt of a launch gets a new shared store (``dist.max_restarts``): the previous
attempt's keys would lead the restarted ranks to their dead peers' addresses
(pytorch/pytorch#135712).

A machine of a launch of several waits for the others in torch's rendezvous (its join
operation, polled every second), bounded by torch's own ``join_timeout``
(``dist.join_timeout_s``); a machine other than 0 first waits for machine 0's store to be
reachable, bounded as long. Either wait says so every :data:`JOIN_REPORT_EVERY_S` seconds
(``waiting for machines ...: N of M joined, T s``) and ends in one line naming the machines
(``dist.node_rank``) that did not come (:class:`MachinesMissing`): each launcher writes its
node rank under its rendezvous node's name in the store, so that the participants torch
lists can be named as the user numbered them.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import socket
import sys
import threading
import time
from pathlib import Path

import torch.distributed as dist
from torch.distributed import FileStore
from torch.distributed.elastic.rendezvous import (
    RendezvousClosedError,
    RendezvousConnectionError,
    RendezvousTimeoutError,
    rendezvous_handler_registry,
)
from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (
    DynamicRendezvousHandler,
    create_handler,
)

from hybridrec.errors import HybridrecError

LOOPBACK = "127.0.0.1"
LOCAL_BACKEND = "hybridrec-loopback"
NETWORK_BACKEND = "hybridrec-network"
"""The rendezvous backends' names in torch's registry."""

JOIN_REPORT_EVERY_S = 30.0
"""How often a machine waiting for the others of its launch says so."""

HOST_LINGER_S = 5.0
"""How long machine 0's launcher waits at its end for the other machines to close their side
of the rendezvous (see :meth:`BoundRendezvousHandler.shutdown`)."""

_IFF_LOOPBACK = 0x8  # (linux/if.h)
_SIOCGIFADDR = 0x8915  # (linux/sockios.h)


def local_rendezvous() -> str:
    """Register (once) and name the rendezvous backend of a launch on one machine: torch's
    dynamic rendezvous over a FileStore at the endpoint path, sharing with the ranks a store
    on loopback at the ``store_port`` of the rendezvous config (0: a free port)."""
    rendezvous_handler_registry.register(LOCAL_BACKEND, _local_handler)
    return LOCAL_BACKEND


def network_rendezvous() -> str:
    """Register (once) and name the rendezvous backend of a launch of several machines:
    torch's dynamic rendezvous over a TCPStore at the endpoint (``HOST:PORT``), hosted by the
    machine whose rendezvous config says ``is_host=1`` on its ``bind_addr``, and a shared
    store on ``bind_addr`` too."""
    rendezvous_handler_registry.register(NETWORK_BACKEND, _network_handler)
    return NETWORK_BACKEND


def _local_handler(params) -> BoundRendezvousHandler:
    return _handler(FileStore(params.endpoint), params, LOCAL_BACKEND, LOOPBACK,
                    params.get_as_int("store_port", 0) or 0)


def _network_handler(params) -> BoundRendezvousHandler:
    host, _, port = params.endpoint.rpartition(":")
    bind = params.get("bind_addr")
    timeout_s = float(params.get_as_int("read_timeout", 300) or 300)
    report = JoinReport(params.min_nodes, params.endpoint, float(params.get_as_int("join_timeout", 600) or 600),
                        start=time.monotonic())
    if params.get_as_bool("is_host", False):
        store = bound_store(bind, int(port), timeout_s=timeout_s)
    else:
        store = _host_store(host, int(port), timeout_s, report)
    handler = _handler(store, params, NETWORK_BACKEND, bind, 0)
    handler.node_rank, handler.rdzv_store, handler.master = params.get_as_int("node_rank", 0) or 0, store, \
        params.endpoint
    handler.first_report = report
    return handler


def _host_store(host: str, port: int, timeout_s: float, report: JoinReport) -> dist.TCPStore:
    """A client of machine 0's rendezvous store, once its port accepts connections: tried
    (a plain connection, which torch's store, retrying, would log in C++ at every failure)
    every second until ``report.timeout_s`` after ``report.start``, with a line every
    :data:`JOIN_REPORT_EVERY_S`; then the store's operations wait ``timeout_s``."""
    while True:
        try:
            socket.create_connection((host, port), timeout=5).close()
            break
        except OSError as e:
            now = time.monotonic()
            if now >= report.deadline:
                raise MachinesMissing(report.host_unreachable(e)) from None
            _say(report.progress(0, now, host_unreachable=True))
            time.sleep(min(1.0, report.deadline - now))
    return dist.TCPStore(host, port, is_master=False, timeout=datetime.timedelta(seconds=timeout_s))


def _handler(store, params, backend: str, bind: str, port: int) -> BoundRendezvousHandler:
    handler = create_handler(store, C10dRendezvousBackend(store, params.run_id), params)
    handler.__class__ = BoundRendezvousHandler  # (torch's factory builds the base class; same fields)
    handler.backend, handler.bind_addr, handler.store_port = backend, bind, port
    return handler


class MachinesMissing(HybridrecError):
    """A launch of several machines gave up waiting for some of them (``dist.join_timeout_s``),
    or lost the rendezvous machine 0 hosts."""


class BoundRendezvousHandler(DynamicRendezvousHandler):
    """torch's dynamic rendezvous handler, whose store shared with the ranks binds one
    address (and port) and is new every round. Across machines (``rdzv_store`` set), its
    wait for the others says so and ends in a line naming who did not come (see the
    module's docstring)."""

    backend, bind_addr, store_port = LOCAL_BACKEND, LOOPBACK, 0
    node_rank, rdzv_store, master, first_report = 0, None, "", None
    _joining: tuple[int, float] | None = None  # (the thread that joins, the join's deadline)

    def get_backend(self) -> str:
        return self.backend

    def _create_tcp_store_server(self, master_addr, master_port) -> dist.TCPStore:
        return bound_store(self.bind_addr, self.store_port)

    def next_rendezvous(self):
        if hasattr(self, "_shared_tcp_store_server"):  # (a restart: the old store goes first)
            self._shared_tcp_store_server = None
            self._bootstrap_store_info = None
        if self.rdzv_store is None or not _JOIN_OP_KNOWN:
            return super().next_rendezvous()
        return self._watched_rendezvous()

    def _watched_rendezvous(self):
        """torch's rendezvous, its join operation watched (:class:`_JoinWatch`); the first
        round's deadline counts from when this machine began waiting (for machine 0's store
        too), later rounds' from their start."""
        settings = self._settings
        report = self.first_report or JoinReport(settings.min_nodes, self.master,
                                                 settings.timeout.join.total_seconds(), start=time.monotonic())
        self.first_report = None
        watch = _JoinWatch(report)
        self.rdzv_store.set(self._node_key(self._this_node), str(self.node_rank))
        ops = self._op_executor
        self._op_executor, self._joining = _WatchedOps(ops, watch), (threading.get_ident(), report.deadline)
        try:
            return super().next_rendezvous()
        except RendezvousTimeoutError:
            raise MachinesMissing(report.gave_up(watch.joined, self._node_ranks(watch.joined))) from None
        except RendezvousConnectionError:
            raise MachinesMissing(report.host_lost()) from None
        except RendezvousClosedError:
            raise MachinesMissing(report.closed(watch.joined, self._node_ranks(watch.joined))) from None
        finally:
            self._op_executor, self._joining = ops, None

    def _get_deadline(self, timeout: datetime.timedelta) -> float:
        joining = self._joining  # (torch asks for the join's deadline from the thread that joins)
        if joining is not None and joining[0] == threading.get_ident() and timeout == self._settings.timeout.join:
            return joining[1]
        return super()._get_deadline(timeout)

    def shutdown(self) -> bool:
        """torch's shutdown (the rendezvous marked closed), then, across machines, the
        store's host waits (:data:`HOST_LINGER_S` at most) until the other machines of the
        rendezvous have closed their side: gone sooner, its store would fail their last
        reads, which torch's C++ logs with a stack trace."""
        closed = super().shutdown()
        if self.rdzv_store is not None:
            with contextlib.suppress(dist.DistError, RuntimeError, ValueError):
                if self.node_rank != 0:
                    self.rdzv_store.set(self._node_key(self._this_node, "closed"), "1")
                else:
                    state = self._state_holder.state
                    others = [n for n in (*state.participants, *state.wait_list) if n != self._this_node]
                    if others:
                        self.rdzv_store.wait([self._node_key(n, "closed") for n in others],
                                             datetime.timedelta(seconds=HOST_LINGER_S))
        return closed

    def _node_key(self, node, what: str = "node_rank") -> str:
        return f"hybridrec.{what}.{self._settings.run_id}.{node}"

    def _node_ranks(self, nodes) -> set[int]:
        """The ``dist.node_rank`` of each of torch's rendezvous ``nodes`` that wrote one."""
        ranks = set()
        for node in nodes:
            key = self._node_key(node)
            with contextlib.suppress(dist.DistError, RuntimeError, ValueError):
                if self.rdzv_store.check([key]):
                    ranks.add(int(self.rdzv_store.get(key)))
        return ranks


try:  # (torch's private join operation: without it, the wait is torch's own, unreported)
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import _RendezvousJoinOp

    _JOIN_OP_KNOWN = True
except ImportError:  # pragma: no cover - another version of torch
    _RendezvousJoinOp, _JOIN_OP_KNOWN = None, False


class JoinReport:
    """The lines of a machine waiting, from ``start``, for the ``nnodes`` machines of its
    launch at ``master``, for at most ``timeout_s``: :meth:`progress` one every ``every_s``
    seconds, then the line it gives up with. Times are ``time.monotonic()`` seconds, given
    by the caller."""

    def __init__(self, nnodes: int, master: str, timeout_s: float, *, start: float,
                 every_s: float = JOIN_REPORT_EVERY_S):
        self.nnodes, self.master, self.timeout_s, self.every_s = nnodes, master, timeout_s, every_s
        self.start, self.next_at = start, start + every_s

    @property
    def deadline(self) -> float:
        return self.start + self.timeout_s

    def progress(self, joined: int, now: float, *, host_unreachable: bool = False) -> str | None:
        """The line due at ``now`` with ``joined`` machines in (None: none due)."""
        if now < self.next_at:
            return None
        while self.next_at <= now:
            self.next_at += self.every_s
        why = " (machine 0, which hosts it, is not reachable yet)" if host_unreachable else ""
        return (f"waiting for machines (dist.nnodes={self.nnodes}, rendezvous at {self.master}): "
                f"{joined} of {self.nnodes} joined, {now - self.start:.0f} s{why}")

    def gave_up(self, joined: list, ranks: set[int]) -> str:
        """This machine's deadline passed with ``joined`` (torch's nodes, of ``dist.node_rank``
        ``ranks``) in the round."""
        return f"gave up after dist.join_timeout_s={self.timeout_s:g} s: {self._missing(joined, ranks)}"

    def closed(self, joined: list, ranks: set[int]) -> str:
        """Another machine closed the rendezvous (it gave up, or the run ended)."""
        if not joined:
            return (f"the launch at {self.master} is closed: a machine gave up waiting or the run ended; "
                    "start every machine again")
        return (f"another machine closed the launch (it gave up waiting, dist.join_timeout_s, or its run ended): "
                f"{self._missing(joined, ranks)}")

    def _missing(self, joined: list, ranks: set[int]) -> str:
        missing = [r for r in range(self.nnodes) if r not in ranks]
        if not joined or len(missing) != self.nnodes - len(joined):  # (a round began without this machine)
            return f"could not join the launch at {self.master} ({len(joined)} of {self.nnodes} machines in its round)"
        return (f"machine{'s' if len(missing) > 1 else ''} with dist.node_rank {', '.join(map(str, missing))} "
                f"did not join the launch at {self.master} ({len(joined)} of {self.nnodes} joined)")

    def host_unreachable(self, e: OSError) -> str:
        why = e.strerror or str(e) or type(e).__name__
        return (f"gave up after dist.join_timeout_s={self.timeout_s:g} s: machine 0 (dist.node_rank 0), which "
                f"hosts the launch's rendezvous at {self.master}, was not reachable ({why})")

    def host_lost(self) -> str:
        return (f"lost the launch's rendezvous at {self.master}: machine 0 (dist.node_rank 0), which hosts it, "
                "stopped or is no longer reachable")


class _JoinWatch:
    """Around torch's join operation (called about once a second while it waits): every
    participant it saw in the round (one that gave up first and left it still joined), and
    a progress line when one is due."""

    def __init__(self, report: JoinReport):
        self.report, self._seen = report, {}

    @property
    def joined(self) -> list:
        return list(self._seen)

    def watching(self, op):
        def join(ctx, deadline: float):
            self._seen.update(dict.fromkeys(ctx.state.participants))
            _say(self.report.progress(len(ctx.state.participants), time.monotonic()))
            return op(ctx, deadline)

        return join


class _WatchedOps:
    """torch's rendezvous operation executor, whose join operations run watched."""

    def __init__(self, inner, watch: _JoinWatch):
        self.inner, self.watch = inner, watch

    def run(self, state_handler, deadline, update_deadline=None):
        if isinstance(state_handler, _RendezvousJoinOp):
            state_handler = self.watch.watching(state_handler)
        return self.inner.run(state_handler, deadline, update_deadline)


def _say(line: str | None) -> None:
    if line:
        with contextlib.suppress(OSError, ValueError):
            print(line, file=sys.stderr, flush=True)


def bound_store(host: str = LOOPBACK, port: int = 0, *, timeout_s: float = 300.0) -> dist.TCPStore:
    """A TCPStore server listening on ``host``'s address only (``port`` 0: a free one)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(socket.SOMAXCONN)
        store = dist.TCPStore(host, sock.getsockname()[1], is_master=True, multi_tenant=True,
                              wait_for_workers=False, timeout=datetime.timedelta(seconds=timeout_s),
                              master_listen_fd=sock.fileno())
    except BaseException:
        sock.close()
        raise
    sock.detach()  # the store's server owns (and closes) the descriptor now
    return store


def interface_address(name: str) -> str:
    """The IPv4 address of network interface ``name`` (raises OSError where it has none)."""
    import fcntl
    import struct

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        packed = fcntl.ioctl(s.fileno(), _SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
    return socket.inet_ntoa(packed[20:24])


def loopback_interface() -> str | None:
    """The name of this machine's loopback network interface (``lo`` on Linux), or None."""
    try:
        names = sorted(p.name for p in Path("/sys/class/net").iterdir())
    except OSError:
        names = []
    for name in names:
        try:
            if int((Path("/sys/class/net") / name / "flags").read_text(), 16) & _IFF_LOOPBACK:
                return name
        except (OSError, ValueError):
            continue
    return None


def interface_env(name: str | None) -> dict[str, str]:
    """The ranks' environment that puts gloo's and TensorPipe's sockets on interface
    ``name`` (the user's own setting of either is kept; None: nothing)."""
    if name is None:
        return {}
    return {k: name for k in ("GLOO_SOCKET_IFNAME", "TP_SOCKET_IFNAME") if k not in os.environ}
