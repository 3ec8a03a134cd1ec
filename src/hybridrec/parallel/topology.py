"""Topology: the one place process groups are made.

Everything distributed receives a :class:`Topology` and uses its groups; no
module calls ``dist.get_rank()`` or creates groups of its own.

Hierarchical training (``dist.group_size=M``) splits the ``W`` ranks into ``G = W / M``
groups of consecutive ranks. A rank's Topology then describes *its group*: ``rank``,
``group_size`` and ``group`` are the rank inside the group, ``M`` and the group's process
group, so every synchronous component (sharded embeddings, dense sync, checkpoints) runs
over the group unchanged. What spans groups is separate: ``cross_group`` (the ranks
with this rank's index in every group: they hold the same shards), ``job_group``,
``job_rank`` and ``job_size`` (every rank of the job: the data split, evaluation, run-level
decisions). "World" is left to torch's meaning (``dist.get_world_size()``: the job) and to
torchrun's ``LOCAL_WORLD_SIZE`` (:attr:`local_world_size`: the ranks per machine).
Worked example, W = 4, M = 2::

    global rank:   0  1 | 2  3
    group_index:   0  0 | 1  1
    rank (in it):  0  1 | 0  1
    cross groups:  {0, 2} and {1, 3}
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass

import torch
import torch.distributed as dist

from hybridrec import launch_env
from hybridrec.comm.exchange import PairwiseExchange
from hybridrec.parallel.devices import choose_backend


@dataclass
class Topology:
    rank: int
    """This rank inside its group (the job's rank is :attr:`job_rank`)."""
    group_size: int
    """Ranks in this rank's group (the job's ranks: :attr:`job_size`)."""
    local_rank: int
    local_world_size: int
    """Ranks per host group (ranks that share a machine / fast link; torchrun's LOCAL_WORLD_SIZE)."""
    device: torch.device
    backend: str
    group: dist.ProcessGroup | None
    """All ranks (None in a single process without a process group)."""
    host_group: dist.ProcessGroup | None
    """The ranks of this rank's host group."""
    num_groups: int = 1
    """Hierarchical training: the number of groups (1: flat, the group is the world)."""
    group_index: int = 0
    """This rank's group."""
    cross_group: dist.ProcessGroup | None = None
    """The ranks with this rank's index in every group (None: one group)."""
    job_group: dist.ProcessGroup | None = None
    """Every rank of every group (None: one process); equal to :attr:`group` when flat."""
    group_ranks: tuple[tuple[int, ...], ...] = ()
    """Every group's global ranks (collective group creation needs all of them)."""
    exchange: str = "collective"
    """How :meth:`all_to_all` moves data: ``collective`` (the backend's all_to_all_single) or
    ``pairwise`` (:class:`~hybridrec.comm.exchange.PairwiseExchange`: receives posted first,
    so both directions of a gloo/TCP link run at once)."""

    def all_to_all(self, out: torch.Tensor, inp: torch.Tensor, out_splits: list[int],
                   in_splits: list[int]) -> None:
        """``all_to_all_single`` over :attr:`group`, synchronous, by :attr:`exchange`."""
        self.all_to_all_start(out, inp, out_splits, in_splits).wait()

    def all_to_all_start(self, out: torch.Tensor, inp: torch.Tensor, out_splits: list[int],
                         in_splits: list[int]):
        """:meth:`all_to_all` under way: returns a handle whose ``wait()`` must come before
        ``out`` is read or ``inp`` changed."""
        if self.exchange == "pairwise":
            return PairwiseExchange([self.group], rank=self.rank, world_size=self.group_size).all_to_all_single(
                out, inp, out_splits, in_splits)
        if self.exchange == "collective":
            return dist.all_to_all_single(out, inp, out_splits, in_splits, group=self.group, async_op=True)
        raise ValueError(f"unknown exchange {self.exchange!r}: collective or pairwise")

    @property
    def comm_device(self) -> torch.device:
        """Where small host-made tensors of a collective live (input_dist's counts, the
        threshold's sizes): the rank's GPU with NCCL (it takes CUDA tensors only), else the
        CPU (gloo takes them there without a copy, and the host reads them anyway)."""
        return self.device if self.backend == "nccl" else torch.device("cpu")

    @property
    def job_rank(self) -> int:
        return self.group_index * self.group_size + self.rank

    @property
    def job_size(self) -> int:
        return self.num_groups * self.group_size

    @property
    def hierarchical(self) -> bool:
        return self.num_groups > 1

    def global_of(self, rank: int) -> int:
        """The global rank of rank ``rank`` of this rank's group."""
        return self.group_ranks[self.group_index][rank] if self.group_ranks else rank

    @property
    def run_group(self) -> dist.ProcessGroup | None:
        """Every rank that trains this run: :attr:`group` when flat, every group's ranks in
        hierarchical training (evaluation's gather, the run's decisions)."""
        return self.job_group if self.hierarchical else self.group

    @property
    def lead(self) -> bool:
        """The one rank that writes run-level files and prints (global rank 0)."""
        return self.job_rank == 0

    @staticmethod
    def single(device: torch.device | str = "cpu") -> Topology:
        return Topology(0, 1, 0, 1, torch.device(device), "none", None, None)

    @staticmethod
    def init(*, backend: str | None = None, timeout_s: float = 300.0,
             local_world_size: int | None = None, store: dist.Store | None = None,
             rank: int | None = None, world_size: int | None = None,
             group_size: int | None = None, ranks_per_machine: int | None = None) -> Topology:
        """Join (or start) the default process group from torchrun's environment
        (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT), or
        with ``store``, ``rank`` and ``world_size`` given (a group of some of torchrun's
        processes, e.g. a parameter-server run's trainers).

        Backend and device: ``backend`` is the ``dist.backend`` setting (None: ``auto``),
        resolved by :func:`~hybridrec.parallel.devices.choose_backend` from the ranks per
        machine (``ranks_per_machine``, else LOCAL_WORLD_SIZE) and the GPUs here: NCCL and
        ``cuda:LOCAL_RANK`` with a GPU per rank, gloo on shared GPUs with fewer, gloo on the
        CPU without. ``timeout_s`` bounds every collective, so a dead peer ends in an error
        instead of a hang. ``group_size``: ranks per group of hierarchical training (None: one group).
        """
        local_rank = launch_env.local_rank()
        per_machine = ranks_per_machine or launch_env.local_world_size(world_size or None)
        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        choice = choose_backend(backend or "auto", per_machine, gpus)
        backend, device = choice.backend, torch.device(choice.device(local_rank))
        if device.type == "cuda":  # (the current device: kernels and NCCL's communicator use it)
            torch.cuda.set_device(device)
        if not dist.is_initialized():
            dist.init_process_group(backend=backend, timeout=datetime.timedelta(seconds=timeout_s),
                                    store=store, rank=-1 if rank is None else rank,
                                    world_size=-1 if world_size is None else world_size)
        rank, world = dist.get_rank(), dist.get_world_size()
        lws = local_world_size or launch_env.local_world_size(world)
        m = group_size or world
        if problem := group_problem(world, m, lws):
            raise ValueError(problem)
        if m == world:
            host_group = _host_groups(range(world), lws, rank)
            return Topology(rank, world, rank % lws, lws, device, backend, dist.group.WORLD, host_group,
                            job_group=dist.group.WORLD, group_ranks=(tuple(range(world)),))
        return _grouped(rank, world, m, min(lws, m), device, backend)

    def cross_groups(self, count: int) -> list[dist.ProcessGroup]:
        """``count`` new gloo groups of this rank's cross group (the ranks with its index in
        every group). Collective: every rank calls it with the same ``count``, in the same order."""
        return [_cross_group(self.rank, self.group_size, self.num_groups, backend="gloo") for _ in range(count)]

    def job_gloo_group(self) -> dist.ProcessGroup:
        """A new gloo group of every rank of every group (collective)."""
        return dist.new_group(list(range(self.job_size)), backend="gloo")

    def parallel_groups(self, count: int) -> list[dist.ProcessGroup]:
        """``count`` new gloo groups of all ranks: each has its own connection per pair, so
        messages split over them travel side by side (comm.exchange.PairwiseExchange).
        Collective: every rank calls it with the same ``count``, in the same order."""
        if count < 1:
            raise ValueError(f"count must be >= 1, got {count}")
        out = []
        for _ in range(count):  # every rank makes every group's, in the same order
            made = [dist.new_group(list(ranks), backend="gloo") for ranks in self.group_ranks]
            out.append(made[self.group_index])
        return out


def group_problem(world: int, group_size: int, local_world_size: int) -> str | None:
    """Why ``group_size`` cannot split ``world`` ranks (None: it can). Checked before any
    process group is made (``hybridrec train`` runs it at launch)."""
    if group_size < 1 or world % group_size:
        return f"dist.group_size={group_size} does not divide the {world} ranks of this run into equal groups"
    if world % local_world_size:
        return f"world size {world} is not a multiple of the host group size {local_world_size}"
    if group_size % local_world_size and local_world_size % group_size:
        return (f"dist.group_size={group_size} and the {local_world_size} ranks per machine: one must "
                "divide the other (a group is part of one machine, or whole machines)")
    return None


def _host_groups(ranks, lws: int, rank: int) -> dist.ProcessGroup | None:
    """Groups of ``lws`` consecutive ``ranks`` (global ids); returns this rank's. Every rank
    makes every group, in the same order."""
    ranks, mine = list(ranks), None
    for h in range(0, len(ranks), lws):
        g = dist.new_group(ranks[h : h + lws])
        if rank in ranks[h : h + lws]:
            mine = g
    return mine


def _cross_group(member: int, m: int, num_groups: int, backend: str | None = None) -> dist.ProcessGroup:
    """Member ``member``'s cross group: rank ``member`` of each of ``num_groups`` groups of
    ``m``. Every rank makes every member's, in the same order (collective)."""
    made = [dist.new_group([g * m + j for g in range(num_groups)], backend=backend) for j in range(m)]
    return made[member]


def _grouped(rank: int, world: int, m: int, lws: int, device, backend) -> Topology:
    """This rank's Topology among ``world / m`` groups of ``m`` consecutive ranks."""
    groups = tuple(tuple(range(g * m, (g + 1) * m)) for g in range(world // m))
    index = rank // m
    made = [dist.new_group(list(r)) for r in groups]  # every rank: every group, same order
    host = None
    for r in groups:
        h = _host_groups(r, lws, rank)
        host = h if rank in r else host
    return Topology(rank % m, m, rank % lws, lws, device, backend, made[index], host,
                    num_groups=len(groups), group_index=index, cross_group=_cross_group(rank % m, m, len(groups)),
                    job_group=dist.group.WORLD, group_ranks=groups)
