"""A local launch that listens on this machine's loopback interface only.

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

Across machines (torchrun), torchrun's own store listens on every interface of the host
named in ``--rdzv-endpoint``, and torch offers no way to bind it to one: such a run belongs
on a private network (README, "Trust"). ``GLOO_SOCKET_IFNAME`` and ``dist.rpc_interface``
name the interface the ranks' own sockets use there.

Every attempt of a launch gets a new store (``dist.max_restarts``): the previous attempt's
keys would lead the restarted ranks to their dead peers' addresses (pytorch/pytorch#135712).
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
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import DynamicRendezvousHandler, create_handler

LOOPBACK = "127.0.0.1"
BACKEND = "hybridrec-loopback"
"""The rendezvous backend's name in torch's registry (see :func:`loopback_rendezvous`)."""

_IFF_LOOPBACK = 0x8  # (linux/if.h)


def loopback_rendezvous() -> str:
    """Register (once) and name the rendezvous backend of a local launch: torch's dynamic
    rendezvous over a FileStore at the endpoint path, sharing with the ranks a store on
    loopback at the ``store_port`` of the rendezvous config (0: a free port)."""
    rendezvous_handler_registry.register(BACKEND, _create_handler)
    return BACKEND


def _create_handler(params) -> LoopbackRendezvousHandler:
    store = FileStore(params.endpoint)
    handler = create_handler(store, C10dRendezvousBackend(store, params.run_id), params)
    handler.__class__ = LoopbackRendezvousHandler  # (torch's factory builds the base class; same fields)
    handler.store_port = params.get_as_int("store_port", 0) or 0
    return handler


class LoopbackRendezvousHandler(DynamicRendezvousHandler):
    """torch's dynamic rendezvous handler, whose store shared with the ranks binds loopback
    and is new every round."""

    store_port = 0

    def get_backend(self) -> str:
        return BACKEND

    def _create_tcp_store_server(self, master_addr, master_port) -> dist.TCPStore:
        return loopback_store(self.store_port)

    def next_rendezvous(self):
        if hasattr(self, "_shared_tcp_store_server"):  # (a restart: the old store goes first)
            self._shared_tcp_store_server = None
            self._bootstrap_store_info = None
        return super().next_rendezvous()


def loopback_store(port: int = 0, *, timeout_s: float = 300.0):
    """A TCPStore server listening on 127.0.0.1 only (``port`` 0: a free one)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((LOOPBACK, port))
        sock.listen(socket.SOMAXCONN)
        store = dist.TCPStore(LOOPBACK, sock.getsockname()[1], is_master=True, multi_tenant=True,
                              wait_for_workers=False, timeout=datetime.timedelta(seconds=timeout_s),
                              master_listen_fd=sock.fileno())
    except BaseException:
        sock.close()
        raise
    sock.detach()  # the store's server owns (and closes) the descriptor now
    return store


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


def loopback_interfaces() -> dict[str, str]:
    """The ranks' environment that puts gloo's and TensorPipe's sockets on loopback (the
    user's own setting of either is kept)."""
    name = loopback_interface()
    if name is None:
        return {}
    return {k: name for k in ("GLOO_SOCKET_IFNAME", "TP_SOCKET_IFNAME") if k not in os.environ}
