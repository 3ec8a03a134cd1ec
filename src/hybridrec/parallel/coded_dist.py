"""output_dist: the all-to-all of pooled partials, float32 or through codecs; it counts
the bytes it moves.

Every owner's partial results are ``[total_B, W]``: its block (pieces side by side,
:mod:`hybridrec.parallel.layout`), rows = the samples of rank 0, then rank 1, ...
:func:`output_all_to_all_start` returns, on every rank, every owner's block for the rank's
own samples, ``[b, W_d]`` each, and every host's TRW block (below); backward runs the
same exchange in reverse.

Without codecs (``layout.coded`` None) the blocks travel as one float32 buffer,
asynchronously (:func:`output_all_to_all_start`: :class:`_PlainStart` and
:class:`_PlainFinish`). With codecs (:class:`_CodedStart` and :class:`_CodedFinish`, as
asynchronous: encoded and sent at the start, decoded at the wait) each piece has a codec
(uncompressed pieces: the float32 identity, bit-exact); a run of neighbouring pieces
with the same codec and width is coded at once as ``[rows, n, C]``.

What is coded is what travels: a rank's own samples' rows of its own block (and, with
table_row_wise tables, the in-host sums it serves itself, below) never cross a link, so
they are not coded. :class:`_CodedStart` hands them to the wait as float32 views, exact,
and their gradients come back exact too; the owner encodes only its rows of the *other*
ranks' samples, and the receiver decodes only the other owners' segments. The DCT paper's
DCT-MP compresses what the all-to-all communicates; these rows are not communicated, so
they are not compressed, and the codec's time and error fall only on the rows that cross
(with ``P`` ranks and even batches, ``(P - 1) / P`` of them). The rows kept are the
uncompressed hop's.

Wire layout of the coded hop: the encoded row of an owner is its groups' encoded rows
side by side, ``R`` bytes (``R = sum n * codec.row_bytes(C)``), so what the owner sends
rank ``r != owner`` is ``b_r * R`` bytes: the rows of ``r``'s samples, one uint8 buffer,
one ``all_to_all_single`` with uneven splits for every owner and piece; its split to
itself is empty, both ways. Backward is the same with ``codec.grad_row_bytes``. Every rank
knows every owner's layout and every rank's batch size (from input_dist), so both sides
compute all split sizes; no size is exchanged. In a world of one rank nothing crosses: no
exchange, no codec.

Row chunks: the coded hop travels as ``K`` exchanges (``chunks``, :func:`coded_chunks`;
``compress.embedding_chunks``), chunk ``i`` holding, of every rank ``d``'s ``b_d``
samples, rows ``b_d * i // K`` to ``b_d * (i + 1) // K``: each chunk is the hop above for
batch sizes ``b_d / K`` (its split sizes computed alike on both sides). The owner encodes
chunk ``i + 1`` while chunk ``i`` travels, the receiver decodes chunk ``i`` while the
later ones travel, and backward the same (the receiver encodes, the owner decodes). Every
codec codes a row on its own, so the chunked hop gives the bits of the unchunked one
(``tests/test_coded_chunks.py``). Example, 2 ranks, batches ``[5, 3]``, ``K = 2``:
chunk 0 carries rank 0's samples 0-1 and rank 1's sample 0, chunk 1 the rest; rank 0
encodes its block's row 5 (rank 1's sample 0), then rows 6-7, and rank 1 its rows 0-1,
then 2-4 (its own samples' rows, 5-7, stay float32). Rows, not field
groups: a chunk keeps every codec group whole, so it is the same whatever the tables'
codecs and widths (the benchmark's 26 tables are one group per owner), and the
receiver's blocks are joined along rows.

Row-wise shards: every shard's partial sum is a piece of its own, encoded by its
owner; the receiver decodes each piece then adds them (sparse partials exchanged,
then summed). For DCT the sum holds up to ``shards * k`` nonzeros per row and the
backward sends each shard the gradient at its own kept positions.

table_row_wise shards: their partials are first summed inside the host
(:mod:`hybridrec.parallel.host_reduce`, float32); member ``j`` of a host then holds the
sums for the samples of the ranks it serves (``d % L == j``) and sends them in the same
exchange, after its own block's rows: what owner ``o`` sends rank ``d`` is
``layout.segments(o, d)`` side by side, ``b_d`` rows of each. The codec of a TRW table
codes this cross-host hop of the sums (encoded once by the serving member, decoded by
the receiver; gradients coded back the same way), so a DCT sum keeps ``k`` nonzeros. The
sums a member serves itself (its own samples') stay float32, as its block's own rows.

Bytes counted in the ledger (category ``output_dist``, per table, DeepFM's FM piece
under table None; this rank's traffic to and from others: a rank's own rows, which the
coded hop does not send and the float32 hop copies within the rank, are not counted):
each exchange, forward and backward, records the bytes of the buffers it moved (a
chunked hop: each chunk's, whole rows, so they add up to the unchunked hop's),
split by table along the segments' layouts (:meth:`BlockLayout.bytes_by_table`); a TRW
table's entries here are the sums that cross hosts (its in-host bytes are ``trw_intra``'s);
``sent`` and ``received`` are the encoded bytes, ``original`` the float32 bytes of the
rows sent.
"""

from __future__ import annotations

import torch

from hybridrec.comm.ledger import CommLedger
from hybridrec.parallel.layout import (  # noqa: F401 - owner layouts are part of this hop's API
    VALUE_BYTES,
    EmbeddingLayout,
    OwnerLayout,
    PieceGroup,
    owner_layout,
)
from hybridrec.parallel.threshold_dist import ThresholdAllToAll
from hybridrec.parallel.topology import Topology
from hybridrec.phases import phase

AUTO = 0
"""``chunks`` of :func:`output_all_to_all_start` (``compress.embedding_chunks``): chosen by
:func:`coded_chunks` from the hop's size. Not the default (1): on a loaded 2-core Zen 3 the
benchmark trained no faster in chunks (docs/benchmarks.md, "DCT-MP: the codec of one chunk
beside another's exchange"); the rule below awaits a quiet measurement."""
CHUNK_BYTES = 4 << 20
"""Auto: one chunk per this many float32 bytes a rank codes forward in a step."""
MAX_AUTO_CHUNKS = 4
"""Auto: at most this many chunks."""


class Pending:
    """Work under way: ``wait()`` finishes it and returns its result (an output exchange of
    :func:`output_all_to_all_start`: ``(owners, hosts)``; a sharded lookup of
    ``ShardedEmbeddingBagCollection.start_forward``: its ``KeyedTensor``). Wait exactly once."""

    def __init__(self, finish) -> None:
        self._finish = finish

    def wait(self):
        finish, self._finish = self._finish, None
        if finish is None:
            raise RuntimeError("already waited for")
        return finish()


def output_all_to_all_start(pooled: torch.Tensor, reduced: torch.Tensor, layout: EmbeddingLayout,
                            batch_sizes: list[int], topo: Topology, ledger: CommLedger | None, *,
                            threshold=None, training: bool = True, chunks: int = 1) -> Pending:
    """One exchange of every rank's pooled rows (autograd: the reverse hop), under way.

    Args:
        pooled: this rank's block for every rank's samples, ``[sum(batch_sizes), W_rank]``.
        reduced: its host's in-host TRW sums for the samples of ``layout.served(rank)``
            (:mod:`hybridrec.parallel.host_reduce`), ``[rows, W_t]``; ``[0, 0]`` when its
            host has no table_row_wise tables.

        threshold: a :class:`~hybridrec.parallel.threshold_dist.ThresholdMP`: DCT-MP with a
            threshold over every sample's whole boundary vector instead of codecs (no TRW
            tables); ``training``: whether this forward may refresh it.
        chunks: the coded hop's row chunks (module docstring; :func:`coded_chunks`: >= 1, or
            :data:`AUTO`); ignored by the plain and the threshold hops.

    Its ``wait()`` returns ``(owners, hosts)``: every owner's block for this rank's samples,
    ``[b, W_d]`` per owner ``d``, and every host's TRW block, ``[b, W_h]`` per host (``[b, 0]``
    without). Work that does not need them (the bottom MLP) may run before ``wait()``. The
    plain exchange (:class:`_PlainStart`, :class:`_PlainFinish`) and the coded one
    (:class:`_CodedStart`, :class:`_CodedFinish`) travel meanwhile; the threshold's is done
    on return (its sizes are exchanged first). In backward the gradients' exchange likewise
    travels while the autograd nodes created between the start and the wait run.
    """
    me, b = topo.rank, batch_sizes[topo.rank]
    order = recv_order(layout, me)
    widths = [layout.all_blocks[i].width for _, i in order]

    def assemble(parts) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        owners: list[torch.Tensor] = [pooled.new_zeros(b, 0)] * layout.world_size
        hosts: list[torch.Tensor] = [pooled.new_zeros(b, 0)] * layout.num_hosts
        for (o, i), x in zip(order, parts):
            if i == o:
                owners[o] = x
            else:
                hosts[i - layout.host_index(0)] = x
        return owners, hosts

    if threshold is not None:
        recv = ThresholdAllToAll.apply(pooled, layout, batch_sizes, topo, ledger, threshold, training)
        done = assemble(torch.split(recv, widths, dim=1))
        return Pending(lambda: done)
    if layout.coded is not None:
        alone = layout.world_size == 1  # (nothing crosses: no exchange, no codec)
        coded = _CodedFlight(batch_sizes, 0 if alone else coded_chunks(chunks, layout, batch_sizes))
        token, *kept = _CodedStart.apply(pooled, reduced, coded, layout, batch_sizes, topo, ledger)

        def finish_coded():
            # What this rank keeps (its block's rows, then its TRW sums, for its samples:
            # segments(me, me) in wire order) as float32; every other owner's, decoded.
            mine, others = iter(kept), iter(() if alone else _CodedFinish.apply(token, coded, layout, batch_sizes,
                                                                                 topo, ledger))
            return assemble([next(mine) if o == me else next(others) for o, _ in order])

        return Pending(finish_coded)
    flight = _InFlight()
    buf = _PlainStart.apply(pooled, reduced, flight, layout, batch_sizes, topo, ledger)

    def finish():
        recv = _PlainFinish.apply(buf, flight, layout, topo, ledger)
        return assemble([x.view(b, w) for x, w in zip(torch.split(recv, [b * w for w in widths]), widths)])

    return Pending(finish)


def recv_order(layout: EmbeddingLayout, rank: int) -> list[tuple[int, int]]:
    """``(owner, all_blocks index)`` of what ``rank`` receives, in wire order."""
    return [(o, i) for o in range(layout.world_size) for i in layout.segments(o, rank)]


def exchange_splits(layout: EmbeddingLayout, batch_sizes: list[int], rank: int,
                    per_row) -> tuple[list[int], list[int]]:
    """``(to, from)``: the units ``rank`` sends every rank and receives from it forward,
    ``per_row(block)`` units per sample and block (floats or encoded bytes)."""
    b = batch_sizes[rank]
    to = [n * sum(per_row(i) for i in layout.segments(rank, d)) for d, n in enumerate(batch_sizes)]
    frm = [b * sum(per_row(i) for i in layout.segments(o, rank)) for o in range(layout.world_size)]
    return to, frm


def peer_splits(layout: EmbeddingLayout, batch_sizes: list[int], rank: int,
                per_row) -> tuple[list[int], list[int]]:
    """:func:`exchange_splits` of the coded hop: nothing to ``rank`` itself (what a rank keeps for
    its own samples does not travel, nor is it coded: :class:`_CodedStart`)."""
    to, frm = exchange_splits(layout, batch_sizes, rank, per_row)
    to[rank] = frm[rank] = 0
    return to, frm


def _by_peer(own: torch.Tensor, reduced: torch.Tensor, layout: EmbeddingLayout, batch_sizes: list[int],
             rank: int) -> torch.Tensor:
    """Rows ``own`` ``[total_B, X]`` and ``reduced`` ``[rows, Y]`` (floats or encoded
    bytes) -> one flat buffer in wire order: per rank ``d``, ``own``'s rows of ``d``'s
    samples, then ``reduced``'s when ``rank`` serves ``d``. Without TRW rows, ``own`` as it is."""
    served = layout.served(rank)
    if not served:
        return own.reshape(-1)
    mine = dict(zip(served, torch.split(reduced, [batch_sizes[d] for d in served])))
    parts = []
    for d, x in enumerate(torch.split(own, batch_sizes)):
        parts.append(x.reshape(-1))
        if d in mine:
            parts.append(mine[d].reshape(-1))
    return torch.cat(parts)


def _from_peers(flat: torch.Tensor, own_cols: int, red_cols: int, layout: EmbeddingLayout,
                batch_sizes: list[int], rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The inverse of :func:`_by_peer`: ``(own [total_B, own_cols], reduced [rows, red_cols])``.
    Without TRW rows, ``own`` is a view of ``flat`` (its peers' rows lie one after another)."""
    served = set(layout.served(rank))
    if not served:
        return flat.view(sum(batch_sizes), own_cols), flat.new_empty(0, red_cols)
    sizes = [n * c for d, n in enumerate(batch_sizes)
             for c in ((own_cols, red_cols) if d in served else (own_cols,))]
    parts = iter(torch.split(flat, sizes))
    own, red = [], []
    for d, n in enumerate(batch_sizes):
        own.append(next(parts).view(n, own_cols))
        if d in served:
            red.append(next(parts).view(n, red_cols))
    return torch.cat(own), torch.cat(red) if red else flat.new_empty(0, red_cols)


def _bytes_by_table(layout: EmbeddingLayout, segments: tuple[int, ...], nbytes: int,
                    direction: str, value_bytes: int = 4) -> dict[str | None, tuple[int, int]]:
    """``nbytes`` moved between two ranks, whole rows of ``segments`` side by side ->
    ``{table: (bytes as encoded, bytes as float32)}``. ``value_bytes``: of an uncoded
    value on the wire (2 for the bf16 wire); the layout counts 4."""
    blocks = [layout.all_blocks[i] for i in segments]
    per_row = sum(blk.row_bytes(direction) for blk in blocks) * value_bytes // 4
    rows, rest = divmod(nbytes, per_row) if per_row else (0, nbytes)
    if rest:
        raise ValueError(f"{nbytes} bytes are not whole rows of {per_row} bytes")
    out: dict[str | None, tuple[int, int]] = {}
    for blk in blocks:
        for table, (enc, orig) in blk.bytes_by_table(rows * blk.row_bytes(direction), direction).items():
            e, o = out.get(table, (0, 0))
            out[table] = (e + enc * value_bytes // 4, o + orig)
    return out


def record_hop(ledger: CommLedger | None, layout: EmbeddingLayout, direction: str, rank: int,
               sent: list[int], received: list[int], value_bytes: int = 4) -> None:
    """Ledger entries of one exchange: ``sent[r]`` / ``received[r]`` bytes moved to / from
    rank ``r``. Forward a rank sends ``segments(rank, r)`` and receives ``segments(r,
    rank)``; backward the reverse. Every table of the segments gets an entry.
    ``value_bytes``: as :func:`_bytes_by_table`."""
    if ledger is None:
        return
    acc: dict[str | None, list[int]] = {}
    for r in range(layout.world_size):
        if r == rank:
            continue
        out_segs, in_segs = layout.segments(rank, r), layout.segments(r, rank)
        if direction != "fwd":
            out_segs, in_segs = in_segs, out_segs
        for table, (enc, orig) in _bytes_by_table(layout, out_segs, sent[r], direction, value_bytes).items():
            a = acc.setdefault(table, [0, 0, 0])
            a[0], a[2] = a[0] + enc, a[2] + orig
        for table, (enc, _) in _bytes_by_table(layout, in_segs, received[r], direction, value_bytes).items():
            acc.setdefault(table, [0, 0, 0])[1] += enc
    for table in sorted(acc, key=lambda t: t or ""):
        s, r, o = acc[table]
        ledger.record("output_dist", table=table, direction=direction, sent=s, received=r, original=o)


def _exchange_start(send: torch.Tensor, out_splits: list[int], in_splits: list[int], topo: Topology,
                    layout: EmbeddingLayout, ledger: CommLedger | None, direction: str):
    """One ``all_to_all_single`` of a flat buffer under way (``in_splits[r]`` elements to rank
    ``r``, ``out_splits[r]`` from it), recorded as moved: encoded bytes (uint8), or values of
    the buffer's dtype (float32, or bf16 on the bf16 wire). Returns ``(out, handle)``: call
    ``handle.wait()`` before reading ``out`` or changing ``send``."""
    out = send.new_empty(sum(out_splits))
    handle = topo.all_to_all_start(out, send, out_splits, in_splits)
    item = send.element_size()
    record_hop(ledger, layout, direction, topo.rank, [n * item for n in in_splits],
               [n * item for n in out_splits], value_bytes=4 if send.dtype == torch.uint8 else item)
    return out, handle


def _exchange(send: torch.Tensor, out_splits: list[int], in_splits: list[int], topo: Topology,
              layout: EmbeddingLayout, ledger: CommLedger | None, direction: str) -> torch.Tensor:
    """:func:`_exchange_start`, waited for."""
    out, handle = _exchange_start(send, out_splits, in_splits, topo, layout, ledger, direction)
    handle.wait()
    return out


class _InFlight:
    """The plain exchange between :class:`_PlainStart` and :class:`_PlainFinish`: the
    forward's handle and send buffer, then the backward's (kept alive until waited for)."""

    __slots__ = ("grad_handle", "grad_out", "grad_send", "handle", "recv", "send", "splits")

    def __init__(self) -> None:
        self.splits = self.handle = self.send = self.recv = None
        self.grad_out = self.grad_handle = self.grad_send = None


class _PlainStart(torch.autograd.Function):
    """``pooled`` ``[total_B, W_rank]`` and ``reduced`` ``[rows, W_t]`` (see
    :func:`output_all_to_all_start`) -> the receive buffer of this rank's segments, flat, in wire
    order (``b * W`` floats each, :func:`recv_order`), *being filled*: only
    :class:`_PlainFinish` reads it, after the wait. Backward waits for the gradients'
    exchange that :class:`_PlainFinish`'s backward started, and hands them on."""

    @staticmethod
    def forward(ctx, pooled, reduced, flight: _InFlight, layout: EmbeddingLayout, batch_sizes: list[int],
                topo: Topology, ledger):
        to, frm = flight.splits = exchange_splits(layout, batch_sizes, topo.rank, lambda i: layout.all_blocks[i].width)
        ctx.meta = (layout, batch_sizes, topo, pooled.shape[1], reduced.shape[1])
        ctx.flight = flight
        flight.send = _by_peer(pooled, reduced, layout, batch_sizes, topo.rank)
        out, flight.handle = _exchange_start(flight.send, frm, to, topo, layout, ledger, "fwd")
        return out

    @staticmethod
    def backward(ctx, grad):  # (grad: what _PlainFinish sends; its exchange's result is flight.grad_out)
        layout, batch_sizes, topo, own_cols, red_cols = ctx.meta
        flight = ctx.flight
        flight.grad_handle.wait()
        g = flight.grad_out
        flight.grad_out = flight.grad_handle = flight.grad_send = None
        own, red = _from_peers(g, own_cols, red_cols, layout, batch_sizes, topo.rank)
        return own, red, None, None, None, None, None


class _PlainFinish(torch.autograd.Function):
    """Waits for :class:`_PlainStart`'s exchange and passes its buffer on. Backward starts
    the gradients' exchange and returns at once: the autograd nodes between the two (the
    bottom MLP's backward, created between them in forward) run while it travels."""

    @staticmethod
    def forward(ctx, recv, flight: _InFlight, layout: EmbeddingLayout, topo: Topology, ledger):
        flight.handle.wait()
        flight.handle = flight.send = None
        ctx.meta = (layout, topo, ledger)
        ctx.flight = flight
        return recv.view_as(recv)

    @staticmethod
    def backward(ctx, grad):
        layout, topo, ledger = ctx.meta
        flight = ctx.flight
        to, frm = flight.splits
        flight.grad_send = grad.contiguous()
        flight.grad_out, flight.grad_handle = _exchange_start(flight.grad_send, to, frm, topo, layout, ledger,
                                                              "bwd")
        # What _PlainStart's backward gets is not read: it takes flight.grad_out once waited for.
        return flight.grad_send, None, None, None, None


def encode_rows(x: torch.Tensor, layout: OwnerLayout, grad: bool, states=None):
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
    return _side_by_side(out, x.new_empty(x.shape[0], 0, dtype=torch.uint8)), kept


def _side_by_side(parts: list[torch.Tensor], empty: torch.Tensor) -> torch.Tensor:
    """``parts`` ``[B, w_i]`` concatenated along the columns; one part as it is (no copy: a
    block of one codec group, the common case, is its group's tensor)."""
    if len(parts) == 1:
        return parts[0]
    return torch.cat(parts, dim=1) if parts else empty


def decode_rows(buf: torch.Tensor, layout: OwnerLayout, grad: bool, states=None, into: torch.Tensor | None = None):
    """uint8 ``[B, R]`` -> rows ``[B, W]`` float32 (and the codecs' states when not ``grad``);
    gradients written into ``into`` (``[B, W]``, returned) when given."""
    out, kept = [], []
    for i, g in enumerate(layout.groups):
        at, size = (g.bwd_at, g.bwd_bytes) if grad else (g.fwd_at, g.fwd_bytes)
        payload = buf[:, at : at + size].reshape(buf.shape[0], g.n, size // g.n)
        if grad:
            dst = None if into is None else into[:, g.start : g.start + g.width].view(buf.shape[0], g.n, g.cols)
            out.append(g.codec.decode_grad(payload, g.cols, states[i], out=dst))
        else:
            piece, state = g.codec.decode(payload, g.cols)
            out.append(piece)
            kept.append(state)
    if into is not None:
        return into, kept
    out = [p.reshape(buf.shape[0], g.width) for p, g in zip(out, layout.groups)]
    return _side_by_side(out, torch.zeros(buf.shape[0], 0, device=buf.device)), kept


class _CodedFlight:
    """The coded exchange between :class:`_CodedStart` and :class:`_CodedFinish`, in row
    chunks: ``rows[i][d]``, the rows ``[lo, hi)`` of rank ``d``'s samples in chunk ``i``
    (:func:`_chunk_rows`; no chunk in a world of one rank: nothing crosses); per chunk the
    forward's send and receive buffers and handle, then the backward's (each kept alive
    until waited for)."""

    __slots__ = ("bwd_splits", "grad_handles", "grad_outs", "grad_sends", "handles", "recvs", "rows", "sends")

    def __init__(self, batch_sizes: list[int], chunks: int) -> None:
        self.rows = [_chunk_rows(batch_sizes, chunks, i) for i in range(chunks)]
        self.bwd_splits: list[tuple[list[int], list[int]]] = []
        self.sends: list = []
        self.recvs: list = []
        self.handles: list = []
        self.grad_sends: list = [None] * chunks
        self.grad_outs: list = [None] * chunks
        self.grad_handles: list = [None] * chunks


def coded_chunks(setting: int, layout: EmbeddingLayout, batch_sizes: list[int]) -> int:
    """The number of row chunks the coded hop travels in (module docstring): ``setting`` when
    >= 1; :data:`AUTO` (0): one per :data:`CHUNK_BYTES` of the float32 rows a rank codes
    forward (every owner's and host's block for the other ranks' samples, shared by the
    ranks: ``sum(batch_sizes) * cols * (P - 1) / P**2`` floats in a world of ``P``), at most
    :data:`MAX_AUTO_CHUNKS`. Never more than the largest batch. A function of the layout and
    the batch sizes alone: every rank finds the same number."""
    if setting < 0:
        raise ValueError(f"the coded hop's chunks must be >= 0 (0: auto), got {setting}")
    if setting == AUTO:
        cols = sum(lay.width for lay in (*layout.coded, *layout.coded_hosts))
        world = layout.world_size
        share = sum(batch_sizes) * cols * VALUE_BYTES * (world - 1) // world**2
        setting = min(MAX_AUTO_CHUNKS, max(1, share // CHUNK_BYTES))
    return max(1, min(setting, max(batch_sizes, default=1)))


def _chunk_rows(batch_sizes: list[int], chunks: int, i: int) -> list[tuple[int, int]]:
    """Chunk ``i`` of ``chunks``: per rank ``d`` of ``n`` samples, the rows ``[lo, hi)`` of
    them in the chunk, ``lo = n * i // chunks``, ``hi = n * (i + 1) // chunks``. E.g. batches
    ``[5, 3]`` in 2 chunks: ``[(0, 2), (0, 1)]`` then ``[(2, 5), (1, 3)]``."""
    return [(n * i // chunks, n * (i + 1) // chunks) for n in batch_sizes]


def _ranges(sizes: list[int], rows: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """A chunk's rows in a buffer of several ranks' samples one after another (``sizes[j]``
    rows of the ``j``-th, of which ``rows[j]``), as ``[a, b)`` ranges of the buffer,
    neighbours merged, empty ones left out: one chunk is one range, the whole buffer; no
    rows, no range."""
    out: list[tuple[int, int]] = []
    at = 0
    for n, (lo, hi) in zip(sizes, rows):
        if lo == hi:
            pass
        elif out and out[-1][1] == at + lo:
            out[-1] = (out[-1][0], at + hi)
        else:
            out.append((at + lo, at + hi))
        at += n
    return out


def _own_ranges(layout: EmbeddingLayout, batch_sizes: list[int], rank: int,
                rows: list[tuple[int, int]]) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """The rows ``rank`` codes in a chunk: of the other ranks' samples (its own stay
    float32), in its block (every rank's samples) and in its in-host TRW sums (the samples
    of the ranks it serves): :func:`_ranges` of each."""
    rows = [(lo, lo) if d == rank else (lo, hi) for d, (lo, hi) in enumerate(rows)]
    served = layout.served(rank)
    return (_ranges(batch_sizes, rows),
            _ranges([batch_sizes[d] for d in served], [rows[d] for d in served]))


def _encode_ranges(x: torch.Tensor, ranges: list[tuple[int, int]], layout: OwnerLayout):
    """Rows ``ranges`` of ``x`` ``[B, W]``, forward-encoded range by range -> (uint8
    ``[rows, R]``, the ranges' codec states). Every codec codes a row on its own, so the
    bytes are those of the rows encoded with the whole block. No range: no codec call."""
    parts, states = [], []
    for a, b in ranges:
        payload, state = encode_rows(x[a:b], layout, grad=False)
        parts.append(payload)
        states.append(state)
    if not parts:
        return x.new_empty(0, layout.fwd_bytes, dtype=torch.uint8), states
    return (parts[0] if len(parts) == 1 else torch.cat(parts)), states


def _decode_ranges(buf: torch.Tensor, ranges: list[tuple[int, int]], layout: OwnerLayout,
                   states, into: torch.Tensor) -> None:
    """The gradients' bytes of rows ``ranges`` (one after another in ``buf``), decoded range
    by range into those rows of ``into``."""
    parts = torch.split(buf, [b - a for a, b in ranges]) if ranges else []
    for (a, b), part, st in zip(ranges, parts, states):
        decode_rows(part, layout, grad=True, states=st, into=into[a:b])


def _kept_rows(layout: EmbeddingLayout, batch_sizes: list[int], rank: int) -> tuple[int, int | None]:
    """Where ``rank``'s own samples' rows lie: their first row in its block (every rank's
    samples) and in its in-host TRW sums (None when it does not serve itself)."""
    served = layout.served(rank)
    red = sum(batch_sizes[d] for d in served[: served.index(rank)]) if rank in served else None
    return sum(batch_sizes[:rank]), red


class _CodedStart(torch.autograd.Function):
    """``pooled`` ``[total_B, W_rank]`` and ``reduced`` ``[rows, W_t]`` (see
    :func:`output_all_to_all_start`) -> ``(token, own, red)``: a token (an empty float tensor
    that links the graph: the wire buffers are uint8, which carry no gradient), and what this
    rank keeps for its own samples, float32 and exact: its block's rows ``[b, W_rank]`` and
    its TRW sums ``[b, W_t]`` (``[0, W_t]`` when it does not serve itself), views. Encodes
    this rank's rows of the *other* ranks' samples chunk by chunk (its own never cross a
    link: its split to itself is empty), starting each chunk's exchange as soon as it is
    encoded (the next chunk is encoded while it travels); :class:`_CodedFinish` waits and
    decodes. Backward waits for the gradients' exchanges that :class:`_CodedFinish`'s
    backward started, chunk by chunk, decoding each while the later ones travel (what ran
    in between, the bottom MLP forward and backward, overlapped the hop, as in the plain
    exchange), each into its rows of one gradient buffer that also holds the kept rows'
    gradients, exact."""

    @staticmethod
    def forward(ctx, pooled, reduced, flight: _CodedFlight, layout: EmbeddingLayout, batch_sizes: list[int],
                topo: Topology, ledger):
        me, b = topo.rank, batch_sizes[topo.rank]
        own_at, red_at = _kept_rows(layout, batch_sizes, me)
        kept_own = pooled[own_at : own_at + b]  # (views: nothing writes into them)
        kept_red = reduced[red_at : red_at + b] if red_at is not None else reduced[:0]
        mine, host = layout.coded_of(me), layout.coded_of(layout.host_index(me // layout.local_world_size))
        chunks = []  # per chunk: (own ranges, TRW ranges, their codec states)
        for rows in flight.rows:
            sizes = [hi - lo for lo, hi in rows]
            sent = [0 if d == me else n for d, n in enumerate(sizes)]  # rows per rank on the wire: none of its own
            own_ranges, red_ranges = _own_ranges(layout, batch_sizes, me, rows)
            with phase("mp_encode"):
                own, own_states = _encode_ranges(pooled, own_ranges, mine)
                red, red_states = _encode_ranges(reduced, red_ranges, host)
            to, frm = peer_splits(layout, sizes, me, lambda i: layout.coded_of(i).fwd_bytes)
            flight.bwd_splits.append(peer_splits(layout, sizes, me, lambda i: layout.coded_of(i).bwd_bytes))
            send = _by_peer(own, red, layout, sent, me)
            recv, handle = _exchange_start(send, frm, to, topo, layout, ledger, "fwd")
            flight.sends.append(send)
            flight.recvs.append(recv)
            flight.handles.append(handle)
            chunks.append((sent, own_ranges, red_ranges, own_states, red_states))
        ctx.meta = (layout, topo, mine, host, chunks, own_at, red_at, tuple(pooled.shape), tuple(reduced.shape))
        ctx.flight = flight
        return pooled.new_empty(0), kept_own, kept_red

    @staticmethod
    def backward(ctx, _token_grad, kept_own_grad, kept_red_grad):
        layout, topo, mine, host, chunks, own_at, red_at, own_shape, red_shape = ctx.meta
        flight = ctx.flight
        # Every row of the gradients is written: the kept rows' here, the others' decoded
        # (the chunks' ranges tile them).
        own = kept_own_grad.new_empty(own_shape)
        own[own_at : own_at + kept_own_grad.shape[0]] = kept_own_grad
        red = kept_own_grad.new_zeros(red_shape)
        if red_at is not None:
            red[red_at : red_at + kept_red_grad.shape[0]] = kept_red_grad
        for i, (sent, own_ranges, red_ranges, own_states, red_states) in enumerate(chunks):
            with phase("mp_grad_wait"):
                flight.grad_handles[i].wait()
            recv = flight.grad_outs[i]
            flight.grad_outs[i] = flight.grad_handles[i] = flight.grad_sends[i] = None
            own_bytes, red_bytes = _from_peers(recv, mine.bwd_bytes, host.bwd_bytes, layout, sent, topo.rank)
            with phase("mp_grad_decode"):
                _decode_ranges(own_bytes, own_ranges, mine, own_states, own)
                _decode_ranges(red_bytes, red_ranges, host, red_states, red)
        return own, red, None, None, None, None, None


class _CodedFinish(torch.autograd.Function):
    """Waits for :class:`_CodedStart`'s exchanges chunk by chunk, decoding each while the
    later ones travel, and returns this rank's segments from the *other* owners, ``[b, W]``
    each, in wire order (:func:`recv_order` without the rank's own; a world of 2 ranks or
    more: at least one), as separate tensors (side by side they would be copied once
    forward and once backward, only to be split again). Backward encodes their gradients at
    the positions received, chunk by chunk, starting each chunk's exchange as soon as it is
    encoded, and returns at once."""

    @staticmethod
    def forward(ctx, _token, flight: _CodedFlight, layout: EmbeddingLayout, batch_sizes: list[int],
                topo: Topology, ledger):
        me = topo.rank
        lays = [layout.coded_of(i) for o, i in recv_order(layout, me) if o != me]
        decoded: list[list[torch.Tensor]] = [[] for _ in lays]
        recv_states = []  # per chunk, per segment
        for i, rows in enumerate(flight.rows):
            with phase("mp_wait"):
                flight.handles[i].wait()
            recv = flight.recvs[i]
            flight.recvs[i] = flight.handles[i] = flight.sends[i] = None
            b = rows[me][1] - rows[me][0]
            states = []
            with phase("mp_decode"):
                for lay, part, out in zip(lays, torch.split(recv, [b * lay.fwd_bytes for lay in lays]), decoded):
                    x, state = decode_rows(part.view(b, lay.fwd_bytes), lay, grad=False)
                    out.append(x)
                    states.append(state)
            recv_states.append(states)
        ctx.meta = (layout, topo, ledger, lays, recv_states)
        ctx.flight = flight
        return tuple(parts[0] if len(parts) == 1 else torch.cat(parts) for parts in decoded)

    @staticmethod
    def backward(ctx, *parts):
        layout, topo, ledger, lays, recv_states = ctx.meta
        flight = ctx.flight
        for i, (rows, states) in enumerate(zip(flight.rows, recv_states)):
            lo, hi = rows[topo.rank]
            with phase("mp_grad_encode"):
                coded = [encode_rows(g[lo:hi], lay, grad=True, states=s)[0].reshape(-1)
                         for g, lay, s in zip(parts, lays, states)]
                send = coded[0] if len(coded) == 1 else torch.cat(coded)
            to, frm = flight.bwd_splits[i]
            flight.grad_sends[i] = send
            flight.grad_outs[i], flight.grad_handles[i] = _exchange_start(send, to, frm, topo, layout, ledger, "bwd")
        return parts[0].new_empty(0), None, None, None, None, None
