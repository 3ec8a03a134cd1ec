"""The output all-to-all of pooled partials through codecs (:mod:`hybridrec.comm.codecs`).

Every owner's partial results are ``[total_B, W]``: its pieces (one per slot, width
``C``) side by side, rows = the samples of rank 0, then rank 1, ... Each piece has a
codec (uncompressed pieces: the float32 identity, bit-exact); a run of neighbouring
pieces with the same codec and width is coded at once as ``[rows, n, C]``.

Wire layout: the encoded row of an owner is its groups' encoded rows side by side,
``R`` bytes (``R = sum n * codec.row_bytes(C)``), so what the owner sends rank ``r`` is
``b_r * R`` bytes: the rows of ``r``'s samples, one uint8 buffer, one
``all_to_all_single`` with uneven splits for every owner and piece. Backward is the
same with ``codec.grad_row_bytes``. Every rank knows every owner's layout and every
rank's batch size (from input_dist), so both sides compute all split sizes; no size
is exchanged.

Row-wise shards: every shard's partial sum is a piece of its own, encoded by its
owner; the receiver decodes each piece then adds them (sparse partials exchanged,
then summed). For DCT the sum holds up to ``shards * k`` nonzeros per row and the
backward sends each shard the gradient at its own kept positions.

Bytes counted in the ledger (category ``output_dist``, this rank's traffic to and
from others; what a rank sends itself is not counted): ``sent`` and ``received`` are
the encoded bytes, ``original`` the float32 bytes the same rows would have been.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from hybridrec.comm.codecs import Codec
from hybridrec.comm.ledger import CommLedger

VALUE_BYTES = 4  # uncompressed pooled partials and gradients are float32


@dataclass(frozen=True)
class PieceGroup:
    """``n`` neighbouring pieces of width ``cols`` coded by ``codec``, starting at
    column ``start`` of the owner's partials and at byte ``fwd_at`` / ``bwd_at`` of
    its encoded rows."""

    codec: Codec
    start: int
    n: int
    cols: int
    fwd_at: int
    bwd_at: int

    @property
    def width(self) -> int:
        return self.n * self.cols

    @property
    def fwd_bytes(self) -> int:
        return self.n * self.codec.row_bytes(self.cols)

    @property
    def bwd_bytes(self) -> int:
        return self.n * self.codec.grad_row_bytes(self.cols)


@dataclass(frozen=True)
class OwnerLayout:
    """How one owner's encoded rows are laid out: groups, and bytes per row both ways."""

    groups: tuple[PieceGroup, ...]
    width: int  # float32 columns of the owner's partials
    fwd_bytes: int
    bwd_bytes: int


def owner_layout(pieces: list[tuple[int, Codec]]) -> OwnerLayout:
    """``pieces`` = ``(width, codec)`` of an owner's slots in its output order."""
    groups: list[PieceGroup] = []
    col = fwd = bwd = 0
    for cols, codec in pieces:
        last = groups[-1] if groups else None
        if last is not None and last.codec is codec and last.cols == cols:
            groups[-1] = PieceGroup(codec, last.start, last.n + 1, cols, last.fwd_at, last.bwd_at)
        else:
            groups.append(PieceGroup(codec, col, 1, cols, fwd, bwd))
        col += cols
        fwd += codec.row_bytes(cols)
        bwd += codec.grad_row_bytes(cols)
    return OwnerLayout(tuple(groups), col, fwd, bwd)


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


def _all_to_all_bytes(send: torch.Tensor, out_splits: list[int], in_splits: list[int], topo,
                      ledger: CommLedger | None, direction: str, original: int) -> torch.Tensor:
    out = send.new_empty(sum(out_splits))
    topo.all_to_all(out, send, out_splits, in_splits)
    if ledger is not None:
        rank = topo.rank
        ledger.record("output_dist", direction=direction, original=original,
                      sent=sum(in_splits) - in_splits[rank],
                      received=sum(out_splits) - out_splits[rank])
    return out


class CodedAllToAll(torch.autograd.Function):
    """Owner partials ``[total_B, W_own]`` -> this rank's decoded blocks side by side,
    ``[b, sum_d W_d]`` (owners in rank order); backward codes the gradients the same way."""

    @staticmethod
    def forward(ctx, pooled, layouts: list[OwnerLayout], batch_sizes: list[int], topo,
                ledger: CommLedger | None):
        rank = topo.rank
        mine, b = layouts[rank], batch_sizes[rank]
        send, sent_states = _encode(pooled, mine, grad=False)
        others = sum(batch_sizes) - b
        recv = _all_to_all_bytes(send.reshape(-1), [b * lay.fwd_bytes for lay in layouts],
                                 [n * mine.fwd_bytes for n in batch_sizes], topo, ledger, "fwd",
                                 original=others * mine.width * VALUE_BYTES)
        blocks, recv_states = [], []
        for lay, part in zip(layouts, torch.split(recv, [b * lay.fwd_bytes for lay in layouts])):
            rows, states = _decode(part.view(b, lay.fwd_bytes), lay, grad=False)
            blocks.append(rows)
            recv_states.append(states)
        ctx.meta = (layouts, batch_sizes, topo, ledger, sent_states, recv_states)
        return torch.cat(blocks, dim=1)

    @staticmethod
    def backward(ctx, grad):
        layouts, batch_sizes, topo, ledger, sent_states, recv_states = ctx.meta
        rank = topo.rank
        mine, b = layouts[rank], batch_sizes[rank]
        parts = torch.split(grad, [lay.width for lay in layouts], dim=1)
        send = torch.cat([_encode(g, lay, grad=True, states=s)[0].reshape(-1)
                          for g, lay, s in zip(parts, layouts, recv_states)])
        original = sum(b * lay.width for d, lay in enumerate(layouts) if d != rank) * VALUE_BYTES
        recv = _all_to_all_bytes(send, [n * mine.bwd_bytes for n in batch_sizes],
                                 [b * lay.bwd_bytes for lay in layouts], topo, ledger, "bwd",
                                 original=original)
        rows, _ = _decode(recv.view(sum(batch_sizes), mine.bwd_bytes), mine, grad=True,
                          states=sent_states)
        return rows, None, None, None, None


def coded_all_to_all(pooled: torch.Tensor, layouts: list[OwnerLayout], batch_sizes: list[int],
                     topo, ledger: CommLedger | None) -> torch.Tensor:
    """See :class:`CodedAllToAll` (``topo``: a :class:`~hybridrec.parallel.topology.Topology`,
    whose ``all_to_all`` moves the bytes); returns ``[b, sum_d layouts[d].width]``."""
    return CodedAllToAll.apply(pooled, layouts, batch_sizes, topo, ledger)
