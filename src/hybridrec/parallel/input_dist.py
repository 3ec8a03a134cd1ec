"""input_dist: every slot's ids travel from the samples' rank to the shard's owner.

Two collectives per batch: an all-to-all of counts (two int64 per rank pair: the local
batch size and the buffer size; tiny and synchronous, both sides need them to size
the ids), then one of lengths+ids in one buffer per rank pair (asynchronous), int32 when
every sharded table has at most 2^31 rows (``layout.id_dtype``; both sides derive it from
the layout), else int64. The owner's batch holds int64 ids again.
Row-wise slots carry only the ids in the shard's row range, rebased (table_row_wise slots
too: they differ from row-wise only on the way back, :mod:`hybridrec.parallel.host_reduce`).

:func:`start_input_dist` returns a :class:`PendingInput`; its :meth:`~PendingInput.wait`
yields the owner's batch. The handle records the bytes of both collectives in the
ledger when it is waited on, so an input_dist started one step ahead (the training
pipeline) is counted in the step whose forward consumes it, like its prediction.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.distributed as dist

from hybridrec.comm.ledger import CommLedger
from hybridrec.parallel.layout import EmbeddingLayout
from hybridrec.parallel.topology import Topology
from hybridrec.sparse.keyed_jagged import KeyedJagged


def bucketize(values: torch.Tensor, lengths: torch.Tensor, rows: tuple[int, int]):
    """The ids of a bag list that fall in ``[rows)``, rebased, and the new bag lengths
    (``values [nnz]``, ``lengths [B]`` -> ``[nnz']``, ``[B]`` int64)."""
    keep = (values >= rows[0]) & (values < rows[1])
    kept = torch.zeros(keep.numel() + 1, dtype=torch.int64, device=values.device)
    torch.cumsum(keep, 0, out=kept[1:])
    ends = torch.cumsum(lengths.to(torch.int64), 0)
    new_lengths = kept[ends] - kept[ends - lengths.to(torch.int64)]
    return values[keep] - rows[0], new_lengths


@dataclass(frozen=True)
class OwnerInput:
    """What this rank's shards look up, and what the step's byte prediction needs.

    ``kjt``: keys = this rank's slot names, bags of rank 0's samples, then rank 1's, ...
    ``batch_sizes``: every source rank's local batch. ``ids``: ``{(source, owner, slot
    position): ids}`` for the pairs this rank is part of (the ids it sent to every owner,
    the ids every source sent it)."""

    kjt: KeyedJagged
    batch_sizes: tuple[int, ...]
    ids: Mapping[tuple[int, int, int], int]


class PendingInput:
    """An input_dist under way. :meth:`wait` (once) blocks until the ids have arrived,
    records the bytes of the whole input_dist and returns the :class:`OwnerInput`."""

    def __init__(self, *, layout: EmbeddingLayout, rank: int, ledger: CommLedger | None,
                 local_batch: int, batch_sizes: list[int], sizes: list[int], recv: torch.Tensor,
                 work, sent_ids: dict[tuple[int, int, int], int], sent_bytes: dict[str, int],
                 count_bytes: int) -> None:
        self.layout, self.rank, self.ledger = layout, rank, ledger
        self.local_batch = local_batch  # this rank's batch size (checked by the consumer)
        self.batch_sizes, self.sizes, self.recv, self.work = batch_sizes, sizes, recv, work
        self.sent_ids, self.sent_bytes, self.count_bytes = sent_ids, sent_bytes, count_bytes
        self.consumed = False

    @classmethod
    def idle(cls, layout: EmbeddingLayout, rank: int, local_batch: int) -> PendingInput:
        """The handle of a layout without shards: nothing travels, nothing is recorded."""
        world = layout.world_size
        return cls(layout=layout, rank=rank, ledger=None, local_batch=local_batch,
                   batch_sizes=[0] * world, sizes=[0] * world, recv=torch.empty(0, dtype=layout.id_dtype),
                   work=None, sent_ids={}, sent_bytes={}, count_bytes=0)

    def discard(self) -> None:
        """Let the ids arrive without using them (a pipeline stopped before this batch,
        e.g. by early stopping): every rank started this all-to-all, so every rank
        finishes it before its next collective. Nothing is recorded."""
        if not self.consumed and self.work is not None:
            self.work.wait()
        self.consumed = True

    def wait(self) -> OwnerInput:
        if self.consumed:
            raise RuntimeError("this input_dist was already consumed by a forward")
        self.consumed = True
        if self.work is not None:
            self.work.wait()  # the ids all-to-all; blocks until this rank's part has arrived
        kjt, per_slot = owner_kjt(self.recv, self.sizes, self.batch_sizes, self.layout.slots[self.rank])
        ids = dict(self.sent_ids)
        for r, counts in enumerate(per_slot.tolist()):
            ids.update({(r, self.rank, j): n for j, n in enumerate(counts)})
        if self.ledger is not None:
            self._record(per_slot)
        return OwnerInput(kjt, tuple(self.batch_sizes), ids)

    def _record(self, per_slot: torch.Tensor) -> None:
        """Bytes to and from other ranks, per table: as sent (the buffers built at the
        start) and as received (bag lengths and ids found in the received buffer)."""
        led, me = self.ledger, self.rank
        led.record("input_dist_counts", direction="fwd", sent=self.count_bytes, received=self.count_bytes)
        received: dict[str, int] = {}
        from_others = (per_slot.sum(0) - per_slot[me]).tolist()
        bags = sum(self.batch_sizes) - self.batch_sizes[me]
        item = self.recv.element_size()
        for j, s in enumerate(self.layout.slots[me]):
            received[s.table] = received.get(s.table, 0) + (bags + from_others[j]) * item
        for table in sorted(set(received) | set(self.sent_bytes)):
            led.record("input_dist", table=table, direction="fwd", sent=self.sent_bytes.get(table, 0),
                       received=received.get(table, 0))


def start_input_dist(kjt: KeyedJagged, layout: EmbeddingLayout, topo: Topology,
                     ledger: CommLedger | None) -> PendingInput:
    """Send every slot's ids of ``kjt`` (this rank's batch) to the slot's owner: the
    counts now, the ids asynchronously. Every rank must call it for the same steps in
    the same order (the collectives are matched in call order)."""
    parts = kjt.split_by_key()
    b, world, me = kjt.batch_size, topo.group_size, topo.rank
    wire = layout.id_dtype
    item = wire.itemsize
    bufs, counts, sent_ids, sent_bytes = [], [], {}, {}
    for d in range(world):
        lengths, values = [], []
        for j, s in enumerate(layout.slots[d]):
            v, ln = parts[s.feature]
            if s.row_split:
                v, ln = bucketize(v, ln, s.shard.rows)
            lengths.append(ln.to(wire))
            values.append(v.to(wire))
            sent_ids[(me, d, j)] = v.numel()
            if d != me:
                sent_bytes[s.table] = sent_bytes.get(s.table, 0) + (ln.numel() + v.numel()) * item
        bufs.append(torch.cat(lengths + values) if lengths else torch.empty(0, dtype=wire, device=kjt.values.device))
        counts += [b, bufs[-1].numel()]
    send_counts = torch.tensor(counts, dtype=torch.int64, device=topo.comm_device)
    recv_counts = send_counts.new_empty(2 * world)
    topo.all_to_all(recv_counts, send_counts, [2] * world, [2] * world)
    recv_counts = recv_counts.view(world, 2)
    # Host sync (NCCL only; gloo's counts are on the CPU): the receive buffer's size and the
    # splits of the ids all-to-all are host values.
    batch_sizes, sizes = recv_counts[:, 0].tolist(), recv_counts[:, 1].tolist()
    send = torch.cat(bufs)
    recv = send.new_empty(sum(sizes))
    work = dist.all_to_all_single(recv, send, sizes, [x.numel() for x in bufs], group=topo.group,
                                  async_op=True)
    count_bytes = (send_counts.numel() - 2) * send_counts.element_size()  # to every rank but me
    return PendingInput(layout=layout, rank=me, ledger=ledger, local_batch=b, batch_sizes=batch_sizes,
                        sizes=sizes, recv=recv, work=work, sent_ids=sent_ids, sent_bytes=sent_bytes,
                        count_bytes=count_bytes)


def owner_kjt(recv: torch.Tensor, sizes: list[int], batch_sizes: list[int],
              mine) -> tuple[KeyedJagged, torch.Tensor]:
    """Regroup what every source rank sent (its lengths, then its ids, slot after slot)
    into one key-major KJT over this rank's slots ``mine``: one concatenation for the
    lengths and one gather for the ids, whatever the number of slots and ranks.

    Returns the KJT and the ids per (source rank, slot), ``[world, len(mine)]``."""
    k, dev = len(mine), recv.device
    starts = [0, *itertools.accumulate(sizes)][:-1]
    lengths = [recv[s0 : s0 + k * b].view(k, b) for s0, b in zip(starts, batch_sizes)]
    # Host sync on a GPU, the owner side's one: the ids per (source rank, slot) size the
    # gather below and feed the step's byte prediction and the ledger (PendingInput.wait).
    per_slot = torch.stack([ln.sum(1) for ln in lengths]).cpu()  # [world, k] ids per (rank, slot)
    # Start of each (rank, slot) run of ids inside recv, then reorder slot-major (host ints).
    first = torch.tensor([s0 + k * b for s0, b in zip(starts, batch_sizes)], device="cpu").unsqueeze(1)
    run_start = first + torch.cumsum(per_slot, 1) - per_slot
    run_start, run_len = run_start.t().reshape(-1), per_slot.t().reshape(-1)
    out_start = torch.cumsum(run_len, 0) - run_len
    total = int(run_len.sum())
    src = (torch.repeat_interleave((run_start - out_start).to(dev), run_len.to(dev), output_size=total)
           + torch.arange(total, device=dev))
    kjt = KeyedJagged([s.name for s in mine], recv.index_select(0, src).to(torch.int64),
                      torch.cat(lengths, dim=1).reshape(-1).to(torch.int32))
    return kjt, per_slot
