"""table_row_wise's hop inside the host: the members' partial pooled sums are reduced
before anything crosses hosts.

A table_row_wise (TRW) table's rows are split over the ``L`` ranks of one host group
(:attr:`Topology.host_group`), so every member pools a partial sum for every sample of
the world. Member ``j`` is responsible for the samples of the ranks ``d`` with
``d % L == j`` (:meth:`EmbeddingLayout.served`): forward, one ``all_to_all_single`` over
the host group gives every member the other members' partials of its samples, which it
adds up (a reduce-scatter, with uneven parts: the same bytes per rank as a ring
reduce-scatter, and it runs on gloo and NCCL alike); backward, the gradients of member
``j``'s samples go to every member (an all-gather, the same way), and each backprops
into its own rows. Only then, and only the sums, cross hosts (the output all-to-all,
:mod:`hybridrec.parallel.coded_dist`).

Float32 both ways: a codec of the table codes the cross-host hop, not this one.
Group-relative: the host group's member ``k`` is the group's rank ``k`` (hosts are
consecutive ranks of ``topo.group``), and nothing here reads the world's ranks.

Bytes counted in the ledger under ``trw_intra`` (per table; the FM piece under table
None), direction ``fwd`` for the reduce-scatter and ``bwd`` for the all-gather: float32,
to and from the other members (a rank's part for itself is not counted).

Worked example, 4 ranks in hosts of 2, local batches ``[3, 3, 3, 3]``, one TRW table of
dim 4 on host 0: rank 0 pools ``[12, 4]`` partials and serves ranks 0 and 2; it sends rank
1 the rows of ranks 1 and 3 (``6 x 4 x 4 = 96`` bytes) and receives rank 1's rows of
ranks 0 and 2 (96 bytes), then holds ``[6, 4]`` sums.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from hybridrec.comm.ledger import CommLedger
from hybridrec.parallel.layout import EmbeddingLayout
from hybridrec.parallel.topology import Topology


def member_rows(layout: EmbeddingLayout, batch_sizes: list[int]) -> list[int]:
    """Rows of samples every member of a host serves (``L`` entries, local rank order)."""
    lw = layout.local_world_size
    return [sum(batch_sizes[d] for d in range(k, layout.world_size, lw)) for k in range(lw)]


def _member_order(layout: EmbeddingLayout, batch_sizes: list[int]) -> torch.Tensor:
    """Row indices of the partials ``[total_B]`` grouped by the member serving them
    (member 0's ranks' samples first, each rank's in rank order)."""
    lw, starts = layout.local_world_size, [0]
    for b in batch_sizes:
        starts.append(starts[-1] + b)
    parts = [torch.arange(starts[d], starts[d + 1]) for k in range(lw)
             for d in range(k, layout.world_size, lw)]
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.long)


def _record(ledger: CommLedger | None, layout: EmbeddingLayout, host: int, direction: str,
            sent_rows: int, received_rows: int) -> None:
    if ledger is None:
        return
    block = layout.host_blocks[host]
    sent, received = block.orig_by_table(sent_rows), block.orig_by_table(received_rows)
    for table in sorted(sent, key=lambda t: t or ""):
        ledger.record("trw_intra", table=table, direction=direction, sent=sent[table],
                      received=received[table])


class HostReduceScatter(torch.autograd.Function):
    """Member partials ``[total_B, W_t]`` (rows: rank 0's samples, then rank 1's, ...) ->
    this member's sums ``[rows, W_t]`` of the samples of the ranks it serves, in rank
    order (``rows = sum(batch_sizes[d] for d in layout.served(rank))``). Backward: the
    all-gather of every member's gradient rows, back in the partials' row order."""

    @staticmethod
    def forward(ctx, partials: torch.Tensor, layout: EmbeddingLayout, batch_sizes: list[int],
                topo: Topology, ledger: CommLedger | None) -> torch.Tensor:
        lw, width = layout.local_world_size, partials.shape[1]
        me, host = topo.rank % lw, topo.rank // lw
        rows = member_rows(layout, batch_sizes)
        order = _member_order(layout, batch_sizes).to(partials.device)
        send = partials.index_select(0, order).reshape(-1)
        recv = partials.new_empty(lw * rows[me] * width)
        dist.all_to_all_single(recv, send, [rows[me] * width] * lw, [n * width for n in rows],
                               group=topo.host_group)
        _record(ledger, layout, host, "fwd", sum(rows) - rows[me], (lw - 1) * rows[me])
        ctx.meta = (layout, topo, ledger, rows, order)
        # Members' partials added in local-rank order: the same sum on every run.
        return recv.view(lw, rows[me], width).sum(0)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        layout, topo, ledger, rows, order = ctx.meta
        lw, width = layout.local_world_size, grad.shape[1]
        me, host = topo.rank % lw, topo.rank // lw
        send = grad.contiguous().reshape(-1).repeat(lw)  # the same rows to every member
        recv = grad.new_empty(sum(rows) * width)
        dist.all_to_all_single(recv, send, [n * width for n in rows], [rows[me] * width] * lw,
                               group=topo.host_group)
        _record(ledger, layout, host, "bwd", (lw - 1) * rows[me], sum(rows) - rows[me])
        out = torch.empty_like(recv.view(sum(rows), width))
        out.index_copy_(0, order, recv.view(sum(rows), width))
        return out, None, None, None, None


def host_reduce(partials: torch.Tensor, layout: EmbeddingLayout, batch_sizes: list[int],
                topo: Topology, ledger: CommLedger | None) -> torch.Tensor:
    """This member's in-host sums (:class:`HostReduceScatter`); a host of one rank holds
    the whole table, its partials are the sums and nothing moves."""
    if layout.local_world_size == 1:
        return partials
    return HostReduceScatter.apply(partials, layout, batch_sizes, topo, ledger)
