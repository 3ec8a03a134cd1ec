"""output_dist: the all-to-all of pooled partials, float32 or through codecs; it counts
the bytes it moves.

Every owner's partial results are ``[total_B, W]``: its block (pieces side by side,
:mod:`hybridrec.parallel.layout`), rows = the samples of rank 0, then rank 1, ...
:func:`output_all_to_all` returns, on every rank, every owner's block for the rank's
own samples, ``[b, W_d]`` each; backward runs the same exchange in reverse.

Without codecs (``layout.coded`` None) the blocks travel as one float32 buffer
(:class:`PlainAllToAll`). With codecs (:class:`CodedAllToAll`) each piece has a codec
(uncompressed pieces: the float32 identity, bit-exact); a run of neighbouring pieces
with the same codec and width is coded at once as ``[rows, n, C]``.

Wire layout of the coded hop: the encoded row of an owner is its groups' encoded rows
side by side, ``R`` bytes (``R = sum n * codec.row_bytes(C)``), so what the owner sends
rank ``r`` is ``b_r * R`` bytes: the rows of ``r``'s samples, one uint8 buffer, one
``all_to_all_single`` with uneven splits for every owner and piece. Backward is the same
with ``codec.grad_row_bytes``. Every rank knows every owner's layout and every rank's
batch size (from input_dist), so both sides compute all split sizes; no size is exchanged.

Row-wise shards: every shard's partial sum is a piece of its own, encoded by its
owner; the receiver decodes each piece then adds them (sparse partials exchanged,
then summed). For DCT the sum holds up to ``shards * k`` nonzeros per row and the
backward sends each shard the gradient at its own kept positions.

Bytes counted in the ledger (category ``output_dist``, per table, DeepFM's FM piece
under table None; this rank's traffic to and from others, what a rank sends itself is
not counted): each exchange, forward and backward, records the bytes of the buffers it
moved, split by table along the rows' layout (:meth:`BlockLayout.bytes_by_table`);
``sent`` and ``received`` are the encoded bytes, ``original`` the float32 bytes of the
rows sent.
"""

from __future__ import annotations

import torch

from hybridrec.comm.ledger import CommLedger
from hybridrec.parallel.layout import (  # noqa: F401 - owner layouts are part of this hop's API
    EmbeddingLayout,
    OwnerLayout,
    PieceGroup,
    owner_layout,
)
from hybridrec.parallel.topology import Topology


def output_all_to_all(pooled: torch.Tensor, layout: EmbeddingLayout, batch_sizes: list[int],
                      topo: Topology, ledger: CommLedger | None) -> list[torch.Tensor]:
    """This rank's owner partials ``pooled`` ``[sum(batch_sizes), W_rank]`` -> every owner's
    block for this rank's samples, ``[b, W_d]`` per owner ``d`` (autograd: the reverse hop)."""
    b, widths = batch_sizes[topo.rank], layout.widths
    if layout.coded is not None:
        recv = CodedAllToAll.apply(pooled, layout, batch_sizes, topo, ledger)
        return list(torch.split(recv, list(widths), dim=1))
    recv = PlainAllToAll.apply(pooled.reshape(-1), layout, batch_sizes, topo, ledger)
    return [x.view(b, w) for x, w in zip(torch.split(recv, [b * w for w in widths]), widths)]


def record_hop(ledger: CommLedger | None, layout: EmbeddingLayout, direction: str, rank: int,
               sent: list[int], received: list[int]) -> None:
    """Ledger entries of one exchange: ``sent[r]`` / ``received[r]`` bytes moved to / from
    rank ``r``. Forward a rank sends rows of its own block and receives the owners'
    blocks; backward the reverse. Every table of the blocks gets an entry."""
    if ledger is None:
        return
    acc: dict[str | None, list[int]] = {}
    for r in range(layout.world_size):
        if r == rank:
            continue
        out_block, in_block = (rank, r) if direction == "fwd" else (r, rank)
        for table, (enc, orig) in layout.blocks[out_block].bytes_by_table(sent[r], direction).items():
            a = acc.setdefault(table, [0, 0, 0])
            a[0], a[2] = a[0] + enc, a[2] + orig
        for table, (enc, _) in layout.blocks[in_block].bytes_by_table(received[r], direction).items():
            acc.setdefault(table, [0, 0, 0])[1] += enc
    for table in sorted(acc, key=lambda t: t or ""):
        s, r, o = acc[table]
        ledger.record("output_dist", table=table, direction=direction, sent=s, received=r, original=o)


def _exchange(send: torch.Tensor, out_splits: list[int], in_splits: list[int], topo: Topology,
              layout: EmbeddingLayout, ledger: CommLedger | None, direction: str) -> torch.Tensor:
    """One ``all_to_all_single`` of a flat buffer (``in_splits[r]`` elements to rank ``r``,
    ``out_splits[r]`` from it), recorded as moved."""
    out = send.new_empty(sum(out_splits))
    topo.all_to_all(out, send, out_splits, in_splits)
    item = send.element_size()
    record_hop(ledger, layout, direction, topo.rank, [n * item for n in in_splits],
               [n * item for n in out_splits])
    return out


class PlainAllToAll(torch.autograd.Function):
    """Flat owner partials ``[total_B * W_rank]`` -> this rank's blocks, flat, owner-major
    (``b * W_d`` floats per owner); backward sends the gradients back the same way."""

    @staticmethod
    def forward(ctx, flat, layout: EmbeddingLayout, batch_sizes: list[int], topo: Topology, ledger):
        b, mine = batch_sizes[topo.rank], layout.widths[topo.rank]
        out_splits, in_splits = [b * w for w in layout.widths], [n * mine for n in batch_sizes]
        ctx.meta = (out_splits, in_splits, layout, topo, ledger)
        return _exchange(flat, out_splits, in_splits, topo, layout, ledger, "fwd")

    @staticmethod
    def backward(ctx, grad):
        out_splits, in_splits, layout, topo, ledger = ctx.meta
        g = _exchange(grad.contiguous(), in_splits, out_splits, topo, layout, ledger, "bwd")
        return g, None, None, None, None


def _encode(x: torch.Tensor, layout: OwnerLayout, grad: bool, states=None):
    """Rows ``[B, W]`` -> uint8 ``[B, R]`` (and the codecs' states when not ``grad``)."""
    out, kept = [], []
    for i, g in enumerate(layout.groups):
        piece = x[:, g.start : g.start + g.width].reshape(x.shape[0], g.n, g.cols)
        if grad:
            out.append(g.codec.encode_grad(piece, states[i]))
        else:
            payload, state = g.codec.encode(piece)
            out.append(payload)
            kept.append(state)
    out = [p.reshape(x.shape[0], g.bwd_bytes if grad else g.fwd_bytes)
           for p, g in zip(out, layout.groups)]
    buf = torch.cat(out, dim=1) if out else x.new_empty(x.shape[0], 0, dtype=torch.uint8)
    return buf, kept


def _decode(buf: torch.Tensor, layout: OwnerLayout, grad: bool, states=None):
    """uint8 ``[B, R]`` -> rows ``[B, W]`` float32 (and the codecs' states when not ``grad``)."""
    out, kept = [], []
    for i, g in enumerate(layout.groups):
        at, size = (g.bwd_at, g.bwd_bytes) if grad else (g.fwd_at, g.fwd_bytes)
        payload = buf[:, at : at + size].reshape(buf.shape[0], g.n, size // g.n)
        if grad:
            out.append(g.codec.decode_grad(payload, g.cols, states[i]))
        else:
            piece, state = g.codec.decode(payload, g.cols)
            out.append(piece)
            kept.append(state)
    out = [p.reshape(buf.shape[0], g.width) for p, g in zip(out, layout.groups)]
    rows = torch.cat(out, dim=1) if out else torch.zeros(buf.shape[0], 0)
    return rows, kept


class CodedAllToAll(torch.autograd.Function):
    """Owner partials ``[total_B, W_own]`` -> this rank's decoded blocks side by side,
    ``[b, sum_d W_d]`` (owners in rank order); backward codes the gradients the same way."""

    @staticmethod
    def forward(ctx, pooled, layout: EmbeddingLayout, batch_sizes: list[int], topo: Topology, ledger):
        owners, rank = layout.coded, topo.rank
        mine, b = owners[rank], batch_sizes[rank]
        send, sent_states = _encode(pooled, mine, grad=False)
        recv = _exchange(send.reshape(-1), [b * lay.fwd_bytes for lay in owners],
                         [n * mine.fwd_bytes for n in batch_sizes], topo, layout, ledger, "fwd")
        blocks, recv_states = [], []
        for lay, part in zip(owners, torch.split(recv, [b * lay.fwd_bytes for lay in owners])):
            rows, states = _decode(part.view(b, lay.fwd_bytes), lay, grad=False)
            blocks.append(rows)
            recv_states.append(states)
        ctx.meta = (layout, batch_sizes, topo, ledger, sent_states, recv_states)
        return torch.cat(blocks, dim=1)

    @staticmethod
    def backward(ctx, grad):
        layout, batch_sizes, topo, ledger, sent_states, recv_states = ctx.meta
        owners, rank = layout.coded, topo.rank
        mine, b = owners[rank], batch_sizes[rank]
        parts = torch.split(grad, [lay.width for lay in owners], dim=1)
        send = torch.cat([_encode(g, lay, grad=True, states=s)[0].reshape(-1)
                          for g, lay, s in zip(parts, owners, recv_states)])
        recv = _exchange(send, [n * mine.bwd_bytes for n in batch_sizes],
                         [b * lay.bwd_bytes for lay in owners], topo, layout, ledger, "bwd")
        rows, _ = _decode(recv.view(sum(batch_sizes), mine.bwd_bytes), mine, grad=True,
                          states=sent_states)
        return rows, None, None, None, None
