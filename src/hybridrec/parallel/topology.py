"""Topology: the one place process groups are made.

Everything distributed receives a :class:`Topology` and uses its groups; no
module calls ``dist.get_rank()`` or creates groups of its own.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from hybridrec.comm.exchange import PairwiseExchange


@dataclass
class Topology:
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    """Ranks per host group (ranks that share a machine / fast link)."""
    device: torch.device
    backend: str
    group: dist.ProcessGroup | None
    """All ranks (None in a single process without a process group)."""
    host_group: dist.ProcessGroup | None
    """The ranks of this rank's host group."""
    exchange: str = "collective"
    """How :meth:`all_to_all` moves data: ``collective`` (the backend's all_to_all_single) or
    ``pairwise`` (:class:`~hybridrec.comm.exchange.PairwiseExchange`: receives posted first,
    so both directions of a gloo/TCP link run at once)."""

    def all_to_all(self, out: torch.Tensor, inp: torch.Tensor, out_splits: list[int],
                   in_splits: list[int]) -> None:
        """``all_to_all_single`` over :attr:`group`, synchronous, by :attr:`exchange`."""
        if self.exchange == "pairwise":
            PairwiseExchange([self.group], rank=self.rank, world_size=self.world_size).all_to_all_single(
                out, inp, out_splits, in_splits).wait()
        elif self.exchange == "collective":
            dist.all_to_all_single(out, inp, out_splits, in_splits, group=self.group)
        else:
            raise ValueError(f"unknown exchange {self.exchange!r}: collective or pairwise")

    @staticmethod
    def single(device: torch.device | str = "cpu") -> Topology:
        return Topology(0, 1, 0, 1, torch.device(device), "none", None, None)

    @staticmethod
    def init(*, backend: str | None = None, timeout_s: float = 300.0,
             local_world_size: int | None = None, store: dist.Store | None = None,
             rank: int | None = None, world_size: int | None = None) -> Topology:
        """Join (or start) the default process group from torchrun's environment
        (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT), or
        with ``store``, ``rank`` and ``world_size`` given (a group of some of torchrun's
        processes, e.g. a parameter-server run's trainers).

        Backend: NCCL when CUDA is available, gloo otherwise. ``timeout_s`` bounds
        every collective, so a dead peer ends in an error instead of a hang.
        """
        use_cuda = torch.cuda.is_available() and backend != "gloo"
        backend = backend or ("nccl" if use_cuda else "gloo")
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        device = torch.device("cuda", local_rank) if backend == "nccl" else torch.device("cpu")
        if backend == "nccl":
            torch.cuda.set_device(device)
        if not dist.is_initialized():
            dist.init_process_group(backend=backend, timeout=datetime.timedelta(seconds=timeout_s),
                                    store=store, rank=-1 if rank is None else rank,
                                    world_size=-1 if world_size is None else world_size)
        rank, world = dist.get_rank(), dist.get_world_size()
        lws = local_world_size or int(os.environ.get("LOCAL_WORLD_SIZE", world))
        if world % lws:
            raise ValueError(f"world size {world} is not a multiple of the host group size {lws}")
        host_group = None
        for h in range(world // lws):  # every rank must create every group, in the same order
            g = dist.new_group(list(range(h * lws, (h + 1) * lws)))
            if h == rank // lws:
                host_group = g
        return Topology(rank, world, rank % lws, lws, device, backend, dist.group.WORLD, host_group)

    def parallel_groups(self, count: int) -> list[dist.ProcessGroup]:
        """``count`` new gloo groups of all ranks: each has its own connection per pair, so
        messages split over them travel side by side (comm.exchange.PairwiseExchange).
        Collective: every rank calls it with the same ``count``, in the same order."""
        if count < 1:
            raise ValueError(f"count must be >= 1, got {count}")
        return [dist.new_group(list(range(self.world_size)), backend="gloo")
                for _ in range(count)]
