"""DCT-MP with a threshold: the output_dist hop sends, for every sample, the entries of its
whole boundary vector at or above a magnitude threshold refreshed every few steps.

``compress.embedding=dct`` with ``compress.embedding_select=threshold``. Beside the per-piece
top-k codec (:class:`~hybridrec.comm.codecs.TopKCodec`: every piece of every sample keeps
``ceil(eta C)`` entries, fixed bytes, no size exchange), this is the paper's rule:

- **What is selected.** An owner's row for a sample is its *boundary vector* there: all the
  pieces it sends that sample, side by side (``W`` = the owner's block width, e.g. 13 tables
  x 64 on 2 ranks of the 26-table model). Entries with ``|x| >= tau`` and ``x != 0`` are kept,
  so a field whose pooled vector is large keeps more entries than a small one, and a sample
  with large activations keeps more than one with small ones.
- **The threshold.** One ``tau`` per owner (its :class:`ThresholdMP`), the ``K``-th largest
  ``|x|`` of the owner's whole block of a training step, ``K = ceil(eta * rows * W)``,
  recomputed at training steps 0, 1, 3, 7, ... then every L (the DCT-DP schedule,
  :func:`~hybridrec.comm.compress.refresh_due` with its ramp) and held in between; so ``eta``
  of the entries pass on average at a refresh, and the count varies in between. L =
  ``compress.embedding_refresh_every``, or 1% of the run (``auto_refresh_every``). Evaluation
  uses the held threshold and never refreshes it. The threshold is not checkpointed: after a
  resume it is recomputed at the first step.
- **The per-sample budget.** A sample sends at most ``cap_k = ceil(embedding_cap * eta * W)``
  entries of an owner's ``W`` (the largest of those passing): with ``embedding_cap = 2`` no
  sample costs more than twice the average, whatever its activations.
- **Message** from an owner to rank ``d`` (``b_d`` rows of ``d``'s samples)::

      [b_d counts: uint8 (cap_k < 256) / int16 / int32][nnz values: fp32/fp16/bf16][nnz indices: uint8/int16/int32]

  counts per row, then the kept values row after row (in column order), then their column
  positions in the owner's block (the smallest integer type holding ``W - 1``). The sizes vary
  per step, so every forward first exchanges them: one all-to-all of one int64 per rank pair.
- **Backward.** The receiver sends each owner the gradients at the positions it received
  (values dtype, same order); the owner knows the sizes, so no size is exchanged, and
  scatters them: ``dL/dx = mask * dL/dx_hat``, exact by the chain rule. No residual: the
  activations belong to one step's samples.

Scope (refused in ``train/build.py`` with a one-line error): every sharded table's pieces go
through it (no ``embedding_tables`` / ``embedding_min_rows`` subset), no table_row_wise tables
(their in-host sums travel in a second segment), DLRM only (DeepFM's FM piece is not an
activation to threshold). Table-wise, column-wise and row-wise shards work: row shards'
partials are thresholded by their owners and summed by the receiver after decoding.

Bytes (ledger category ``output_dist``): per table, the kept entries' value and index bytes
(exact: entries are counted per table from their columns) with ``original`` the float32 bytes
of that table's pieces of the rows; the counts and the size exchange under ``table=None``
with ``original = 0``. Totals are exactly what the collectives moved to and from other ranks.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from hybridrec.comm.codecs import VALUE_DTYPES, from_bytes, index_dtype, to_bytes
from hybridrec.comm.compress import keep_count, refresh_due
from hybridrec.comm.ledger import CommLedger
from hybridrec.parallel.layout import EmbeddingLayout
from hybridrec.parallel.topology import Topology
from hybridrec.phases import phase

SIZE_BYTES = 8
"""One int64 per rank pair in the size exchange."""


def count_dtype(cap: int) -> torch.dtype:
    """Smallest type holding a per-row count ``0 .. cap``."""
    if cap < 256:
        return torch.uint8
    if cap < 2**15:
        return torch.int16
    return torch.int32


def _item(dtype: torch.dtype) -> int:
    return torch.empty(0, dtype=dtype).element_size()


class ThresholdMP:
    """One owner's DCT-MP threshold state and policy (see the module docstring).

    Args:
        eta: share of the block's entries kept at a refresh (``compress.embedding_ratio``).
        refresh_every: L, training steps between refreshes (>= 1).
        cap: per-sample budget as a multiple of ``eta * W`` (>= 1).
        values: dtype name of the values on the wire (fp32, fp16, bf16).
    """

    def __init__(self, eta: float, refresh_every: int, *, cap: float = 2.0, values: str = "fp32") -> None:
        if not 0 < eta <= 1:
            raise ValueError(f"eta must be in (0, 1], got {eta}")
        if refresh_every < 1:
            raise ValueError(f"refresh_every must be >= 1, got {refresh_every}")
        if cap < 1:
            raise ValueError(f"cap must be >= 1, got {cap}")
        if values not in VALUE_DTYPES:
            raise ValueError(f"values {values!r}: one of {sorted(VALUE_DTYPES)}")
        self.eta, self.refresh_every, self.cap, self.values = eta, refresh_every, cap, values
        self.dtype = VALUE_DTYPES[values]
        self.tau: torch.Tensor | None = None
        self.step = 0  # training forwards seen
        self.refreshes = 0

    def budget(self, width: int) -> int:
        """Entries a sample may send of an owner's ``width``: ``ceil(cap * eta * width)``,
        at least 1 and at most ``width`` (0 for an empty block)."""
        if width == 0:
            return 0
        return min(width, max(1, math.ceil(self.cap * self.eta * width - 1e-9)))

    def threshold(self) -> float | None:
        return None if self.tau is None else float(self.tau)

    def select(self, x: torch.Tensor, training: bool) -> torch.Tensor:
        """``x [rows, W]`` -> ``keep [rows, W]`` bool: the entries each row sends. Every
        entry with ``|x| >= tau`` and ``x != 0``; a row with more than its budget keeps the
        budget's largest (a top-k of those rows only: most rows are under it, so the common
        case is one comparison and no sort)."""
        rows, width = x.shape
        kc = self.budget(width)
        if rows == 0 or kc == 0:
            return x.new_zeros(rows, width, dtype=torch.bool)
        mag = x.detach().abs()
        thr = self.tau
        if training and (thr is None or refresh_due(self.step, self.refresh_every, ramp=True)):
            thr = kth_largest(mag.reshape(-1), keep_count(self.eta, mag.numel()))
            self.refreshes += 1
            self.tau = thr if float(thr) > 0 else None  # a zero threshold is not held
        elif thr is None:  # evaluation before any training step: this batch's own threshold
            thr = kth_largest(mag.reshape(-1), keep_count(self.eta, mag.numel()))
        if training:
            self.step += 1
        keep = mag >= thr if float(thr) > 0 else mag > 0  # exact zeros are never sent
        over = (keep.sum(1) > kc).nonzero().squeeze(1)
        if over.numel():  # over the budget: the largest passing entries
            passing = torch.where(keep[over], mag[over], mag.new_zeros(()))
            top = passing.topk(kc, dim=1)
            capped = keep.new_zeros(over.numel(), width)
            capped.scatter_(1, top.indices, top.values > 0)
            keep[over] = capped
        return keep


def kth_largest(values: torch.Tensor, k: int) -> torch.Tensor:
    """The ``k``-th largest of 1-D ``values`` (a 0-d tensor). On a CPU, float32: numpy's
    ``partition``, a values-only selection (9 ms for the 3.4M magnitudes of the benchmark's
    block on a Zen 3, where ``topk`` of the 170k largest took 166 ms and ``kthvalue`` 81);
    elsewhere ``topk``."""
    n = values.numel()
    if values.device.type == "cpu" and values.dtype == torch.float32:
        return torch.tensor(np.partition(values.numpy(), n - k)[n - k])
    return values.topk(k, sorted=False).values.min()


def _col_tables(layout: EmbeddingLayout, owner: int) -> tuple[list[str | None], torch.Tensor]:
    """``(tables, col_to_table [W])`` of an owner's block: which table every column is of."""
    pieces = layout.blocks[owner].pieces
    tables = [p.table for p in pieces]
    ids = torch.repeat_interleave(torch.arange(len(pieces)), torch.tensor([p.width for p in pieces],
                                                                          dtype=torch.int64))
    return tables, ids


def _table_entries(layout: EmbeddingLayout, owner: int, cols: torch.Tensor) -> dict[str | None, int]:
    """Kept entries per table of ``owner``'s block, from their columns."""
    tables, ids = _col_tables(layout, owner)
    if not tables:
        return {}
    n = torch.bincount(ids.to(cols.device)[cols], minlength=len(tables)).tolist()
    out: dict[str | None, int] = {}
    for t, k in zip(tables, n):
        out[t] = out.get(t, 0) + k
    return out


def _table_widths(layout: EmbeddingLayout, owner: int) -> dict[str | None, int]:
    out: dict[str | None, int] = {}
    for p in layout.blocks[owner].pieces:
        out[p.table] = out.get(p.table, 0) + p.width
    return out


class _Ledger:
    """Accumulates one hop's per-table bytes, then records them."""

    def __init__(self) -> None:
        self.acc: dict[str | None, list[int]] = {}

    def add(self, table, *, sent=0, received=0, original=0) -> None:
        a = self.acc.setdefault(table, [0, 0, 0])
        a[0] += sent
        a[1] += received
        a[2] += original

    def record(self, ledger: CommLedger | None, direction: str) -> None:
        if ledger is None:
            return
        for table in sorted(self.acc, key=lambda t: t or ""):
            s, r, o = self.acc[table]
            ledger.record("output_dist", table=table, direction=direction, sent=s, received=r, original=o)


class ThresholdAllToAll(torch.autograd.Function):
    """``pooled [total_B, W_rank]`` -> every owner's decoded block for this rank's samples,
    side by side ``[b, sum W_o]`` (owners in rank order); backward sends the gradients of the
    kept entries back. See the module docstring.

    Positions are kept as flat indices (``row * width + column``), ascending: one
    ``nonzero`` of the whole mask finds every destination's entries in row-major order, and
    each side gathers and scatters with one ``index_select`` / ``index_copy_`` per owner."""

    @staticmethod
    def forward(ctx, pooled, layout: EmbeddingLayout, batch_sizes: list[int], topo: Topology,
                ledger, state: ThresholdMP, training: bool):
        me, world, b = topo.rank, topo.group_size, batch_sizes[topo.rank]
        x = pooled.detach().contiguous()
        dev = x.device  # (on a GPU the hop waits for the device at its sizes and byte counts:
        # the sizes travel before the entries, by design; see the module docstring)
        width = x.shape[1]
        vb = _item(state.dtype)
        with phase("mp_select"):
            keep = state.select(x, training)
        cdt, idt = count_dtype(state.budget(width)), index_dtype(max(width, 1))
        cb, ib = _item(cdt), _item(idt)
        counts = keep.sum(1)  # [total_B]
        flat = keep.reshape(-1).nonzero().squeeze(1)  # ascending: row after row, columns in order
        per_dest = [int(c.sum()) for c in torch.split(counts, batch_sizes)]  # entries per destination
        vals_all = x.reshape(-1).index_select(0, flat).to(state.dtype)
        cols_all = flat % max(width, 1)
        msgs, book = [], _Ledger()
        widths = _table_widths(layout, me)
        for d, (n, cnt, vals, cols) in enumerate(zip(batch_sizes, torch.split(counts, batch_sizes),
                                                     torch.split(vals_all, per_dest),
                                                     torch.split(cols_all, per_dest))):
            if width == 0:
                msgs.append(torch.empty(0, dtype=torch.uint8, device=dev))
                continue
            msgs.append(torch.cat([to_bytes(cnt.to(cdt)), to_bytes(vals), to_bytes(cols.to(idt))]))
            if d != me:
                for t, k in _table_entries(layout, me, cols).items():
                    book.add(t, sent=k * (vb + ib), original=n * widths[t] * 4)
                book.add(None, sent=n * cb + SIZE_BYTES)
        in_splits = [m.numel() for m in msgs]
        with phase("mp_wait"):
            sizes = torch.empty(world, dtype=torch.int64, device=topo.comm_device)
            topo.all_to_all(sizes, torch.tensor(in_splits, dtype=torch.int64, device=topo.comm_device),
                            [1] * world, [1] * world)
            out_splits = sizes.tolist()
            recv = torch.empty(sum(out_splits), dtype=torch.uint8, device=dev)
            topo.all_to_all(recv, torch.cat(msgs), out_splits, in_splits)
        total_w = sum(layout.blocks[o].width for o in range(world))
        out = torch.zeros(b * total_w, device=dev)
        recv_pos, at_col = [], 0
        for o, part in enumerate(torch.split(recv, out_splits)):
            w_o = layout.blocks[o].width
            if w_o == 0:
                recv_pos.append(torch.empty(0, dtype=torch.int64, device=dev))
                continue
            kc_o = state.budget(w_o)
            cdt_o, idt_o = count_dtype(kc_o), index_dtype(w_o)
            cnt = from_bytes(part[: b * _item(cdt_o)], cdt_o).to(torch.int64)
            nnz = int(cnt.sum())
            at = b * _item(cdt_o)
            vals = from_bytes(part[at: at + nnz * vb], state.dtype).to(torch.float32)
            cols = from_bytes(part[at + nnz * vb:], idt_o).to(torch.int64)
            if cols.numel() != nnz:
                raise ValueError(f"threshold hop: rank {o} sent {cols.numel()} positions for {nnz} values")
            rows = torch.repeat_interleave(torch.arange(b, device=dev), cnt, output_size=nnz)
            pos = rows * total_w + (cols + at_col)  # flat positions in the received [b, total_w]
            out.index_copy_(0, pos, vals)
            recv_pos.append(pos)
            at_col += w_o
            if o != me:
                for t, k in _table_entries(layout, o, cols).items():
                    book.add(t, received=k * (vb + _item(idt_o)))
                book.add(None, received=b * _item(cdt_o) + SIZE_BYTES)
        book.record(ledger, "fwd")
        sent_pos = (flat, per_dest)
        ctx.meta = (layout, batch_sizes, topo, ledger, state.dtype, width, sent_pos, recv_pos)
        return out.view(b, total_w)

    @staticmethod
    def backward(ctx, grad):
        layout, batch_sizes, topo, ledger, dtype, width, (flat, per_dest), recv_pos = ctx.meta
        me = topo.rank
        vb = _item(dtype)
        g_flat = grad.contiguous().reshape(-1)
        book = _Ledger()
        msgs = []
        at_col = 0
        for o, pos in enumerate(recv_pos):
            msgs.append(to_bytes(g_flat.index_select(0, pos).to(dtype)))
            if o != me and pos.numel():
                for t, k in _table_entries(layout, o, pos % grad.shape[1] - at_col).items():
                    book.add(t, sent=k * vb, original=grad.shape[0] * _table_widths(layout, o)[t] * 4)
            at_col += layout.blocks[o].width
        in_splits = [m.numel() for m in msgs]
        out_splits = [n * vb for n in per_dest]
        recv = torch.empty(sum(out_splits), dtype=torch.uint8, device=grad.device)
        with phase("mp_grad_wait"):
            topo.all_to_all(recv, torch.cat(msgs), out_splits, in_splits)
        gx = grad.new_zeros(sum(batch_sizes) * width)
        if flat.numel():
            gx.index_copy_(0, flat, from_bytes(recv, dtype).to(grad.dtype))
        if width:
            for d, pos in enumerate(torch.split(flat, per_dest)):
                if d != me:
                    for t, k in _table_entries(layout, me, pos % width).items():
                        book.add(t, received=k * vb)
        book.record(ledger, "bwd")
        return gx.view(sum(batch_sizes), width), None, None, None, None, None, None
