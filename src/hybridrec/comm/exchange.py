"""All-to-all as pairwise isend/irecv with every receive posted before any send.

Why: gloo (TCP transport) moves an unbound-buffer send only after the receiver has said
"recv ready" (a NOTIFY_RECV_READY message on the same connection). ``gloo::alltoall``, and
the usual isend-then-irecv loop, post the send first. When the peer's notification is
already there, the send goes onto the connection at once, and this rank's own "recv ready"
is queued *behind* that message: the peer starts its send only after the whole message has
crossed. The two directions of the link then take turns, and each gets half of the link
rate. Posting every receive first puts every notification on the wire before any payload,
so both directions run at once. Measured at 1 Gbit/s per direction in the namespace
cluster (``benchmarks/linkrate.py``, docs/benchmarks.md "Link rate of gloo collectives"):
``dist.all_to_all_single`` ~48-61%, this exchange ~82-96% of the link rate.

Optionally every peer's block is cut into ``len(groups)`` contiguous slices, slice ``g``
sent on group ``g`` (each gloo group has its own connection per pair). The benchmark found
no consistent gain from that over one group; it is kept for experiments on real networks.

Same result as ``dist.all_to_all_single`` (bit for bit: only copies), no extra copy of the
payload (slices are views of the caller's tensors).

Worked example, 2 ranks, rank 0 keeps rows [0:3) and sends rows [3:5) to rank 1::

    ex = PairwiseExchange([topo.group], rank=topo.rank, world_size=topo.group_size)
    out = torch.empty(4, 8)                                # 3 rows from rank 0, 1 from rank 1
    handle = ex.all_to_all_single(out, x, output_split_sizes=[3, 1],
                                  input_split_sizes=[3, 2])  # x: [5, 8]
    handle.wait()                                          # the caller names the wait
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import pairwise

import torch
import torch.distributed as dist


def collective_device(group: dist.ProcessGroup | None = None) -> torch.device:
    """Where a host-made tensor of a collective on ``group`` lives (sizes, flags): the
    current GPU when the group is NCCL's (it takes CUDA tensors only), else the CPU (gloo
    takes CPU tensors without a copy, whatever device the rank trains on)."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


class ExchangeHandle:
    """The pending receives and sends of one exchange; :meth:`wait` returns the output."""

    def __init__(self, works: list, output: torch.Tensor) -> None:
        self.works = works
        self.output = output

    def wait(self) -> torch.Tensor:
        for w in self.works:
            w.wait()
        self.works = []
        return self.output


class PairwiseExchange:
    """``all_to_all_single`` over ``groups``, receives first (see the module docstring).

    Args:
        groups: process groups of the same ``world_size`` ranks in the same order (e.g.
            ``[topo.group]``, or ``topo.parallel_groups(k)`` to spread slices over k
            connections per pair).
        rank: this process's rank in the groups.
        world_size: ranks in every group.
    """

    def __init__(self, groups: Sequence[dist.ProcessGroup], *, rank: int, world_size: int) -> None:
        if not groups:
            raise ValueError("PairwiseExchange needs at least one process group")
        for g in groups:
            if dist.get_world_size(g) != world_size or dist.get_rank(g) != rank:
                raise ValueError("every group must hold the same ranks in the same order")
        self.groups = list(groups)
        self.rank = rank
        self.world_size = world_size

    def all_to_all_single(self, output: torch.Tensor, input: torch.Tensor,
                          output_split_sizes: Sequence[int] | None = None,
                          input_split_sizes: Sequence[int] | None = None) -> ExchangeHandle:
        """Like ``dist.all_to_all_single(..., async_op=True)``: blocks along dim 0; rank ``p``
        gets ``input``'s block ``p`` into its ``output`` block ``rank``. Both tensors
        contiguous. Call the handle's ``wait()`` before reading ``output`` or changing
        ``input``."""
        if not (input.is_contiguous() and output.is_contiguous()):
            raise ValueError("PairwiseExchange needs contiguous input and output")
        send = _blocks(input, input_split_sizes, self.world_size)
        recv = _blocks(output, output_split_sizes, self.world_size)
        peers = [p for p in range(self.world_size) if p != self.rank]
        k = len(self.groups)
        works = [dist.irecv(piece, group=g, group_src=p)
                 for p in peers for g, piece in zip(self.groups, _slices(recv[p], k))]
        works += [dist.isend(piece, group=g, group_dst=p)
                  for p in peers for g, piece in zip(self.groups, _slices(send[p], k))]
        recv[self.rank].copy_(send[self.rank])  # while the slices travel
        return ExchangeHandle(works, output)


def _blocks(t: torch.Tensor, splits: Sequence[int] | None, world: int) -> list[torch.Tensor]:
    """Per-rank flat views of ``t`` split along dim 0."""
    rows = t.shape[0]
    if splits is None:
        if rows % world:
            raise ValueError(f"dim 0 ({rows}) is not divisible by the world size {world}")
        splits = [rows // world] * world
    if len(splits) != world or sum(splits) != rows:
        raise ValueError(f"split sizes {list(splits)} do not cover dim 0 ({rows}) "
                         f"for {world} ranks")
    return [b.reshape(-1) for b in torch.split(t, list(splits), dim=0)]


def _slices(flat: torch.Tensor, k: int) -> list[torch.Tensor]:
    """``k`` contiguous near-equal views of ``flat``, empty ones dropped (sender and
    receiver cut the same element count the same way, so slice g meets slice g)."""
    n = flat.numel()
    bounds = [n * g // k for g in range(k + 1)]
    return [flat[a:b] for a, b in pairwise(bounds) if b > a]
