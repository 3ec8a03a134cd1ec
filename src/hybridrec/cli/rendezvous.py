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
"""

from __future__ import annotations

import datetime
import os
import socket
from pathlib import Path

import torch.distributed as dist
from torch.distributed import FileStore
from torch.distributed.elastic.rendezvous import rendezvous_handler_registry
from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (
    DynamicRendezvousHandler,
    create_handler,
)

LOOPBACK = "127.0.0.1"
LOCAL_BACKEND = "hybridrec-loopback"
NETWORK_BACKEND = "hybridrec-network"
"""The rendezvous backends' names in torch's registry."""

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
    if params.get_as_bool("is_host", False):
        store = bound_store(bind, int(port), timeout_s=timeout_s)
    else:
        store = dist.TCPStore(host, int(port), is_master=False, timeout=datetime.timedelta(seconds=timeout_s))
    return _handler(store, params, NETWORK_BACKEND, bind, 0)


def _handler(store, params, backend: str, bind: str, port: int) -> BoundRendezvousHandler:
    handler = create_handler(store, C10dRendezvousBackend(store, params.run_id), params)
    handler.__class__ = BoundRendezvousHandler  # (torch's factory builds the base class; same fields)
    handler.backend, handler.bind_addr, handler.store_port = backend, bind, port
    return handler


class BoundRendezvousHandler(DynamicRendezvousHandler):
    """torch's dynamic rendezvous handler, whose store shared with the ranks binds one
    address (and port) and is new every round."""

    backend, bind_addr, store_port = LOCAL_BACKEND, LOOPBACK, 0

    def get_backend(self) -> str:
        return self.backend

    def _create_tcp_store_server(self, master_addr, master_port) -> dist.TCPStore:
        return bound_store(self.bind_addr, self.store_port)

    def next_rendezvous(self):
        if hasattr(self, "_shared_tcp_store_server"):  # (a restart: the old store goes first)
            self._shared_tcp_store_server = None
            self._bootstrap_store_info = None
        return super().next_rendezvous()


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
