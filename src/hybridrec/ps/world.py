"""Who is who in a parameter-server run, and the process groups and RPC agent they join.

A PS run is one torchrun job of ``N + P`` processes of the same command
(``hybridrec train dist.nproc=N dist.num_ps=P``): global ranks ``0 .. N-1`` are the
trainers, ``N .. N+P-1`` the servers. Each role gets a gloo process group of its own
(the trainers' carries the dense synchronization, evaluation and checkpoints; the
servers' their sharded checkpoints), made on torchrun's store under a prefix per role so
their keys never meet. Everyone joins one RPC agent (TensorPipe) of ``N + P`` workers,
named ``trainer<i>`` and ``ps<j>``: pulls and pushes travel there.

Addresses: the store is torchrun's (``MASTER_ADDR:MASTER_PORT``); the RPC agent listens
on the network interface ``dist.rpc_interface`` (TensorPipe's ``TP_SOCKET_IFNAME``), by
default the loopback interface when every process is on this machine, so a local run
accepts no connection from elsewhere. Every RPC and collective is bounded by
``dist.timeout_s``: a dead server or trainer ends the others with an error.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import warnings
from dataclasses import dataclass

import torch.distributed as dist
from torch.distributed import rpc

from hybridrec import launch_env
from hybridrec.errors import ConfigError
from hybridrec.parallel.topology import Topology


@dataclass(frozen=True)
class Roles:
    """The shape of a PS run, from torchrun's environment."""

    rank: int  # global rank
    num_trainers: int
    num_ps: int
    all_local: bool  # every process on this machine

    @property
    def is_server(self) -> bool:
        return self.rank >= self.num_trainers

    @property
    def name(self) -> str:
        return server_name(self.rank - self.num_trainers) if self.is_server else f"trainer{self.rank}"


def server_name(j: int) -> str:
    return f"ps{j}"


def roles(num_ps: int) -> Roles:
    """This process's role; torchrun's WORLD_SIZE counts trainers and servers."""
    world = launch_env.world_size()
    if world <= num_ps:
        raise ConfigError(f"dist.num_ps={num_ps} servers leave no trainer in {world} process(es): "
                          f"start them with hybridrec train dist.nproc=N dist.num_ps={num_ps}")
    return Roles(launch_env.rank(), world - num_ps, num_ps, launch_env.local_world_size(world) == world)


def init_world(r: Roles, *, timeout_s: float, backend: str | None = None,
               group_size: int | None = None) -> Topology:
    """Join this role's process group; returns the role's topology (trainers: over the
    trainers, in groups of ``group_size`` for hierarchical training; servers: over the
    servers). Then :func:`join_rpc`."""
    timeout = datetime.timedelta(seconds=timeout_s)
    store, _, _ = next(dist.rendezvous("env://", r.rank, r.num_trainers + r.num_ps, timeout=timeout))
    if r.is_server:
        return Topology.init(backend="gloo", timeout_s=timeout_s, store=dist.PrefixStore("hybridrec-ps", store),
                             rank=r.rank - r.num_trainers, world_size=r.num_ps,
                             local_world_size=r.num_ps if r.all_local else 1)
    return Topology.init(backend=backend, timeout_s=timeout_s, store=dist.PrefixStore("hybridrec-trainers", store),
                         rank=r.rank, world_size=r.num_trainers,
                         local_world_size=r.num_trainers if r.all_local else 1, group_size=group_size,
                         ranks_per_machine=r.num_trainers if r.all_local else None)  # (servers: no GPU)


def join_rpc(r: Roles, *, timeout_s: float, interface: str = "") -> None:
    """Join the RPC agent of every trainer and server (a barrier: returns once all have)."""
    if interface or r.all_local:
        os.environ["TP_SOCKET_IFNAME"] = interface or "lo"
    options = rpc.TensorPipeRpcBackendOptions(init_method="env://", rpc_timeout=timeout_s)
    with _quiet():
        rpc.init_rpc(r.name, rank=r.rank, world_size=r.num_trainers + r.num_ps, rpc_backend_options=options)


def shutdown(*, graceful: bool = True) -> None:
    """Leave the RPC agent (graceful: once every worker has, so no server leaves while a
    trainer still needs it) and the role's process group."""
    with _quiet(), contextlib.suppress(RuntimeError):
        rpc.shutdown(graceful=graceful)
    if dist.is_initialized():
        dist.destroy_process_group()


@contextlib.contextmanager
def _quiet():
    """The RPC agent's own all-gather warns that it uses a gloo backend as a group."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="You are using a Backend")
        yield
