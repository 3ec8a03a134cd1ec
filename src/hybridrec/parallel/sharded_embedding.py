"""Sharded embedding-bag collection: input_dist -> lookup -> output_dist.

Every sharding type of :mod:`hybridrec.parallel.plan` is handled by one
mechanism. A *slot* is (feature, shard of the feature's table). For every slot
the rank that owns the samples sends the ids the shard needs (row-wise: only the
ids in its row range, rebased; column-wise and table-wise: all of them); the
shard's owner pools them into a *partial result* of the shard's width; the
partial results go back to the samples' ranks, where they are added (row
shards: DES's sum of partial results) or placed side by side (column shards).
Only pooled partial results travel, never embedding rows.

Collectives per step, all ``all_to_all_single`` with uneven splits:
input_dist = counts (tiny), then lengths+ids in one int64 buffer; output_dist
= pooled partials forward and their gradients backward. The row-wise
reduce-scatter is this all-to-all of partials followed by a local sum (the same
bytes per rank as a reduce-scatter, and one collective carries every table);
its backward sends every row shard the pooled gradient (the all-gather).
With codecs (``codecs={table: codec}``) the output_dist is one uint8 all-to-all
of encoded rows instead (:mod:`hybridrec.parallel.coded_dist`); row shards'
partials are each encoded, then decoded and added on the samples' rank.

Data-parallel tables are replicated: looked up locally; their row gradients are
averaged over ranks before the (identical) sparse update on every rank.

Gradient scale: each rank's loss is a mean over its local batch, so gradients
reaching a shard owner are divided by the world size: N ranks compute what one
process computes with the global batch.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from hybridrec.comm.codecs import CastCodec, Codec
from hybridrec.comm.ledger import CommLedger, ring_allreduce_bytes
from hybridrec.model.embedding import (
    EmbeddingBagCollection,
    KeyedTensor,
    TableConfig,
    init_table_block,
    output_features,
)
from hybridrec.parallel.coded_dist import OwnerLayout, coded_all_to_all, owner_layout
from hybridrec.parallel.plan import Shard, ShardingPlan
from hybridrec.parallel.topology import Topology
from hybridrec.sparse.keyed_jagged import KeyedJagged


@dataclass(frozen=True)
class Slot:
    feature: str
    table: str
    index: int  # shard index within the table's plan
    shard: Shard
    row_split: bool  # ids are bucketized by row range

    @property
    def name(self) -> str:
        return f"{self.feature}@{self.index}"

    @property
    def shard_table(self) -> str:
        return f"{self.table}@{self.index}"


def _slots(tables: list[TableConfig], plan: ShardingPlan) -> dict[int, list[Slot]]:
    """Slots grouped by owner rank, in one order every rank computes identically."""
    by_rank: dict[int, list[Slot]] = {r: [] for r in range(plan.world_size)}
    for t in tables:
        tp = plan.tables[t.name]
        if tp.sharding_type == "data_parallel":
            continue
        row_split = tp.sharding_type in ("row_wise", "table_row_wise")
        for i, sh in enumerate(tp.shards):
            for f in t.features:
                by_rank[sh.rank].append(Slot(f, t.name, i, sh, row_split))
    return by_rank


def _local_tables(slots: list[Slot], tables: dict[str, TableConfig]) -> list[TableConfig]:
    """One local table per shard; always sum pooling (mean is applied after the sum).
    A shard of an FM table keeps the FM columns it holds (and the first-order column if
    it holds it)."""
    features: dict[str, list[str]] = {}
    shards: dict[str, Slot] = {}
    for s in slots:
        features.setdefault(s.shard_table, []).append(s.name)
        shards[s.shard_table] = s
    out = []
    for n, f in features.items():
        sh, fm = shards[n].shard, tables[shards[n].table].fm_cols
        out.append(TableConfig(name=n, num_embeddings=sh.num_rows, embedding_dim=sh.num_cols, features=f,
                               pooling="sum", fm_cols=None if fm is None else max(0, min(sh.cols[1], fm) - sh.cols[0])))
    return out


@dataclass
class _BlockLayout:
    """What one collection (an owner's shards, or the replicated tables) sends per sample:
    its pieces' embedding columns side by side, then, with FM tables, ``[z_p, q_p]``
    (its part of the first-order term and of the FM square sums, DES's partial results)."""

    pieces: list[tuple[str, int]]  # (output name, embedding columns sent)
    field_cols: list[int]  # columns of the local output that are sent as they are
    lr_cols: list[int]  # first-order columns of the local output, summed into z_p
    fm: bool  # an FM block [z_p, q_p] follows the pieces
    _index: tuple[torch.Tensor, torch.Tensor] | None = field(default=None, repr=False, compare=False)

    @property
    def width(self) -> int:
        return sum(w for _, w in self.pieces) + (2 if self.fm else 0)

    @classmethod
    def of(cls, tables: list[TableConfig]) -> _BlockLayout:
        table_of = {f: t for t in tables for f in t.features}
        pieces, field_cols, lr_cols, col = [], [], [], 0
        for name, width in output_features(tables):
            lr = table_of[name].first_order_col
            pieces.append((name, width - (lr is not None)))
            field_cols += [col + c for c in range(width) if c != lr]
            lr_cols += [col + lr] if lr is not None else []
            col += width
        return cls(pieces, field_cols, lr_cols, any(t.fm_cols is not None for t in tables))

    def encode(self, kt: KeyedTensor) -> torch.Tensor:
        """A collection's output -> the ``[B, width]`` block this layout sends."""
        if not self.fm:
            return kt.values
        v = kt.values
        if self._index is None:  # column indices as tensors, built once
            self._index = (torch.tensor(self.field_cols, dtype=torch.long),
                           torch.tensor(self.lr_cols, dtype=torch.long))
        fields, lr = self._index
        z = v.index_select(1, lr).sum(1, keepdim=True) if self.lr_cols else v.new_zeros(v.shape[0], 1)
        return torch.cat([v.index_select(1, fields), z, kt.square_sums.sum(1, keepdim=True)], dim=1)


class _AllToAll(torch.autograd.Function):
    """Differentiable ``all_to_all_single`` of a flat buffer; counts bytes both ways."""

    @staticmethod
    def forward(ctx, x, out_splits, in_splits, topo, ledger, category):
        ctx.meta = (out_splits, in_splits, topo, ledger, category)
        return _exchange(x, out_splits, in_splits, topo, ledger, category, "fwd")

    @staticmethod
    def backward(ctx, grad):
        out_splits, in_splits, topo, ledger, category = ctx.meta
        g = _exchange(grad.contiguous(), in_splits, out_splits, topo, ledger, category, "bwd")
        return g, None, None, None, None, None


def _exchange(x, out_splits, in_splits, topo: Topology, ledger, category, direction):
    out = x.new_empty(sum(out_splits))
    topo.all_to_all(out, x, out_splits, in_splits)
    if ledger is not None:
        rank = topo.rank
        item = x.element_size()
        ledger.record(category, direction=direction,
                      sent=(sum(in_splits) - in_splits[rank]) * item,
                      received=(sum(out_splits) - out_splits[rank]) * item)
    return out


class _ScaleGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, scale: float):
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.scale, None


def _bucketize(values: torch.Tensor, lengths: torch.Tensor, rows: tuple[int, int]):
    """The ids of a bag list that fall in ``[rows)``, rebased, and the new bag lengths."""
    keep = (values >= rows[0]) & (values < rows[1])
    kept = torch.zeros(keep.numel() + 1, dtype=torch.int64, device=values.device)
    torch.cumsum(keep, 0, out=kept[1:])
    ends = torch.cumsum(lengths.to(torch.int64), 0)
    new_lengths = kept[ends] - kept[ends - lengths.to(torch.int64)]
    return values[keep] - rows[0], new_lengths


class PendingInput:
    """An input_dist under way: ``wait()`` -> ``(owner-side KJT, batch size per source rank)``."""

    def __init__(self, coll: ShardedEmbeddingBagCollection, work, recv: torch.Tensor,
                 sizes: list[int], batch_sizes: list[int]) -> None:
        self.coll, self.work, self.recv, self.sizes, self.batch_sizes = coll, work, recv, sizes, batch_sizes

    def wait(self) -> tuple[KeyedJagged, list[int]]:
        self.work.wait()  # the ids all-to-all; blocks until this rank's part has arrived
        return self.coll._owner_kjt(self.recv, self.sizes, self.batch_sizes), self.batch_sizes


class ReplicatedEmbeddingBagCollection(EmbeddingBagCollection):
    """Data-parallel tables: every rank holds them whole; row gradients are summed
    over ranks (already scaled by 1/world in the forward) (a dense all-reduce of the small tables' gradients plus a touched-row
    count, so lazy optimizers see exactly the rows the global batch touched)."""

    def __init__(self, tables, *, topo: Topology, ledger: CommLedger | None, seed: int = 0):
        super().__init__(tables, seed=seed)
        self.topo, self.ledger = topo, ledger

    def pop_sparse_grads(self):
        out = []
        for group, ids, rows, _ in super().pop_sparse_grads():
            n, d = self.group_weight(group).shape
            dense = rows.new_zeros(n, d + 1)  # last column counts occurrences
            dense[:, :d].index_add_(0, ids, rows)
            dense[:, d].index_add_(0, ids, torch.ones_like(ids, dtype=rows.dtype))
            dist.all_reduce(dense, group=self.topo.group)
            if self.ledger is not None:
                ring = ring_allreduce_bytes(dense.numel() * dense.element_size(), self.topo.world_size)
                self.ledger.record("dp_table_allreduce", sent=ring, received=ring, direction="bwd")
            touched = dense[:, d].nonzero().squeeze(1)
            # Summed, not averaged: the forward already scaled these gradients by 1/world.
            out.append((group, touched, dense[touched, :d], True))
        return out


class ShardedEmbeddingBagCollection(nn.Module):
    """Drop-in for :class:`EmbeddingBagCollection` across ranks (same output layout).

    ``forward(kjt)`` takes this rank's local batch and returns its pooled
    embeddings ``[B, sum(dims)]`` in the single-device collection's feature order.

    ``codecs`` maps table names to the codec of their output_dist hop (both
    directions, :mod:`hybridrec.parallel.coded_dist`); tables not in it, and all
    tables when it is empty, travel as float32 exactly as without codecs.
    """

    def __init__(self, tables: list[TableConfig], plan: ShardingPlan, topo: Topology, *,
                 seed: int = 0, ledger: CommLedger | None = None,
                 codecs: Mapping[str, Codec] | None = None) -> None:
        super().__init__()
        missing = [t.name for t in tables if t.name not in plan.tables]
        if missing:
            raise ValueError(f"the sharding plan has no entry for tables {missing}")
        if plan.world_size != topo.world_size:
            raise ValueError(f"plan is for {plan.world_size} ranks, the world has {topo.world_size}")
        self.topo, self.plan, self.ledger, self.seed = topo, plan, ledger, seed
        self.tables = {t.name: t for t in tables}
        out = output_features(tables)
        self.feature_names = [f for f, _ in out]
        # FM tables' first-order column never travels as such (owners send z_p instead).
        fm_cols = {f: t.fm_cols for t in tables for f in t.features}
        self.feature_dims = [d if fm_cols[f] is None else fm_cols[f] for f, d in out]
        self.total_dim = sum(self.feature_dims)
        starts = torch.cumsum(torch.tensor([0] + self.feature_dims), 0).tolist()
        self._col = dict(zip(self.feature_names, starts))
        self._table_of = {f: t.name for t in tables for f in t.features}
        self.slots = _slots(tables, plan)
        self._slot_of = {s.name: s for slots in self.slots.values() for s in slots}
        self._has_shards = any(self.slots.values())
        dp = [t for t in tables if plan.tables[t.name].sharding_type == "data_parallel"]
        # What each rank's shards send per sample (the widths of the output all-to-all),
        # then what the replicated tables contribute locally.
        self._layouts = [_BlockLayout.of(_local_tables(self.slots[r], self.tables))
                         for r in range(topo.world_size)] + [_BlockLayout.of(dp)]
        self._widths = [lay.width for lay in self._layouts[:-1]]
        self.local = self._build_local(self.slots[topo.rank])
        self.replicated = ReplicatedEmbeddingBagCollection(dp, topo=topo, ledger=ledger, seed=seed) if dp else None
        self._pieces = self._assembly(dp)
        self.codecs = dict(codecs or {})
        self._coded = self._codec_layouts(self.codecs)
        self._piece_bytes = self._piece_byte_table()
        self._row_split = {f: any(s.row_split for slots in self.slots.values() for s in slots
                                  if s.feature == f) for f in self.feature_names}
        # Shards pool by sum (partial means would not add up); divide after the sum.
        # Replicated tables pool by their own mode already.
        self._prefetched: tuple[KeyedJagged, PendingInput] | None = None
        self._mean = [f for f in self.feature_names if self.tables[self._table_of[f]].pooling == "mean"
                      and plan.tables[self._table_of[f]].sharding_type != "data_parallel"]

    def _build_local(self, slots: list[Slot]) -> EmbeddingBagCollection | None:
        if not slots:
            return None
        shard_of = {s.shard_table: s for s in slots}

        def init(shard_table: TableConfig, weight: torch.Tensor) -> None:
            # A shard holds exactly the values of its block of the whole table.
            s = shard_of[shard_table.name]
            init_table_block(self.tables[s.table], self.seed, s.shard.rows, s.shard.cols, out=weight)

        return EmbeddingBagCollection(_local_tables(slots, self.tables), seed=self.seed, init=init)

    def _assembly(self, dp_tables) -> dict[str, list[tuple[int, int, int]]]:
        """For every output feature, its pieces among the received blocks:
        ``(block, piece, first column)``. Blocks are the owners' outputs in rank order
        (then the replicated tables'); pieces are their slots, in the owner's local order,
        followed by the block's ``[z_p, q_p]`` with FM tables."""
        pieces: dict[str, list[tuple[int, int, int]]] = {f: [] for f in self.feature_names}
        self._piece_widths = []
        for d, layout in enumerate(self._layouts):
            self._piece_widths.append([w for _, w in layout.pieces] + ([2] if layout.fm else []))
            for j, (name, _) in enumerate(layout.pieces):
                if d < self.topo.world_size:
                    s = self._slot_of[name]
                    pieces[s.feature].append((d, j, s.shard.cols[0]))
                else:  # replicated tables: whole
                    pieces[name].append((d, j, 0))
        for f in pieces:
            pieces[f].sort(key=lambda p: p[2])  # column shards in column order
        return pieces

    def _codec_layouts(self, codecs: Mapping[str, Codec]) -> list[OwnerLayout] | None:
        """Every owner's coded output layout (uncompressed pieces: the float32 identity,
        bit-exact); None when no sharded table has a codec (the plain float32 all-to-all)."""
        unknown = sorted(set(codecs) - set(self.tables))
        if unknown:
            raise ValueError(f"codecs for unknown tables {unknown}")
        if not any(codecs.get(s.table) is not None for s in self._slot_of.values()):
            return None
        identity = CastCodec(torch.float32)
        layouts = []
        for d in range(self.topo.world_size):
            block = self._layouts[d]
            fm = [(2, identity)] if block.fm else []  # DeepFM's [z_p, q_p] travel as they are
            layouts.append(owner_layout([(w, codecs.get(self._slot_of[n].table) or identity)
                                         for n, w in block.pieces] + fm))
        return layouts

    def _piece_byte_table(self) -> list[list[tuple[str | None, int, int, int]]]:
        """Per owner, per piece it sends: ``(table, forward bytes per row, backward bytes per
        row, float32 bytes per row)``; DeepFM's ``[z_p, q_p]`` belong to no table."""
        out = []
        for d in range(self.topo.world_size):
            block, rows = self._layouts[d], []
            for name, w in block.pieces:
                table = self._slot_of[name].table
                codec = self.codecs.get(table)
                rows.append((table, codec.row_bytes(w) if codec else 4 * w,
                             codec.grad_row_bytes(w) if codec else 4 * w, 4 * w))
            if block.fm:
                rows.append((None, 8, 8, 8))
            out.append(rows)
        return out

    def _combine(self, blocks: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Received partial results -> ``[B, sum(dims)]`` (and ``[B, 2]`` FM sums): row
        shards' partials are added, column shards' placed side by side, every block's
        ``[z_p, q_p]`` added up. One split per block and one concatenation, so backward is
        one concatenation per block (no per-slice zero-filled grads)."""
        split = [torch.split(b, w, dim=1) if w else () for b, w in zip(blocks, self._piece_widths)]
        out = []
        for f in self.feature_names:
            parts = [split[b][j] for b, j, _ in self._pieces[f]]
            if self._row_split[f]:
                total = parts[0]
                for p in parts[1:]:
                    total = total + p
                out.append(total)
            else:
                out.extend(parts)
        fm = None
        for parts, layout in zip(split, self._layouts):
            if layout.fm:
                fm = parts[-1] if fm is None else fm + parts[-1]
        return torch.cat(out, dim=1), fm

    # -- input_dist ------------------------------------------------------------
    def start_input_dist(self, kjt: KeyedJagged) -> PendingInput:
        """Send every slot's ids to its owner. The counts travel now (tiny, synchronous:
        both sides need them to size the ids); the ids travel asynchronously, and the
        returned handle's :meth:`PendingInput.wait` yields the owner-side batch."""
        parts = kjt.split_by_key()
        b, world = kjt.batch_size, self.topo.world_size
        bufs, counts, sent = [], [], {}
        for d in range(world):
            lengths, values = [], []
            for s in self.slots[d]:
                v, ln = parts[s.feature]
                if s.row_split:
                    v, ln = _bucketize(v, ln, s.shard.rows)
                lengths.append(ln.to(torch.int64))
                values.append(v)
                if d != self.topo.rank:
                    sent[s.table] = sent.get(s.table, 0) + (ln.numel() + v.numel()) * 8
            bufs.append(torch.cat(lengths + values) if lengths else torch.empty(0, dtype=torch.int64))
            counts += [b, bufs[-1].numel()]
        recv_counts = _exchange(torch.tensor(counts, dtype=torch.int64), [2] * world, [2] * world,
                                self.topo, self.ledger, "input_dist_counts", "fwd").view(world, 2)
        batch_sizes, sizes = recv_counts[:, 0].tolist(), recv_counts[:, 1].tolist()
        send = torch.cat(bufs)
        recv = send.new_empty(sum(sizes))
        work = dist.all_to_all_single(recv, send, sizes, [x.numel() for x in bufs],
                                      group=self.topo.group, async_op=True)
        if self.ledger is not None:  # what arrives is counted when it is unpacked
            for table, n in sent.items():
                self.ledger.record("input_dist", table=table, direction="fwd", sent=n, received=0)
        return PendingInput(self, work, recv, sizes, batch_sizes)

    def input_dist(self, kjt: KeyedJagged) -> tuple[KeyedJagged, list[int]]:
        """:meth:`start_input_dist` and wait: the owner-side KJT (keys = this rank's slots,
        samples of rank 0, then rank 1, ...) and the batch size of every source rank."""
        return self.start_input_dist(kjt).wait()

    def prefetch(self, kjt: KeyedJagged) -> None:
        """Start ``kjt``'s input_dist now; the ``forward`` that gets this very KJT object
        waits for it instead of starting its own. Every rank must prefetch the same steps
        (the collectives are matched in call order)."""
        if self._has_shards:
            self._prefetched = (kjt, self.start_input_dist(kjt))

    def _owner_kjt(self, recv: torch.Tensor, sizes: list[int], batch_sizes: list[int]) -> KeyedJagged:
        """Regroup what every source rank sent (its lengths, then its ids, slot after slot)
        into one key-major KJT over this rank's slots: one concatenation for the lengths
        and one gather for the ids, whatever the number of slots and ranks."""
        mine = self.slots[self.topo.rank]
        k = len(mine)
        starts = [0] + torch.tensor(sizes).cumsum(0).tolist()[:-1]
        lengths = [recv[s0 : s0 + k * b].view(k, b) for s0, b in zip(starts, batch_sizes)]
        per_slot = torch.stack([ln.sum(1) for ln in lengths])  # [world, k] ids per (rank, slot)
        # Start of each (rank, slot) run of ids inside recv, then reorder slot-major.
        first = torch.tensor([s0 + k * b for s0, b in zip(starts, batch_sizes)]).unsqueeze(1)
        run_start = first + torch.cumsum(per_slot, 1) - per_slot
        run_start, run_len = run_start.t().reshape(-1), per_slot.t().reshape(-1)
        out_start = torch.cumsum(run_len, 0) - run_len
        total = int(run_len.sum())
        src = torch.repeat_interleave(run_start - out_start, run_len) + torch.arange(total)
        if self.ledger is not None:  # per table: bag lengths and ids from every other rank
            me, received = self.topo.rank, {}
            from_others = (per_slot.sum(0) - per_slot[me]).tolist()
            for j, s in enumerate(mine):
                received[s.table] = received.get(s.table, 0) + (sum(batch_sizes) - batch_sizes[me]
                                                                 + from_others[j]) * 8
            for table, n in received.items():
                self.ledger.record("input_dist", table=table, direction="fwd", sent=0, received=n)
        return KeyedJagged([s.name for s in mine], recv.index_select(0, src),
                           torch.cat(lengths, dim=1).reshape(-1).to(torch.int32))

    # -- lookup + output_dist ----------------------------------------------------
    def forward(self, kjt: KeyedJagged) -> KeyedTensor:
        b, world = kjt.batch_size, self.topo.world_size
        # With replicated tables only, nothing is distributed at all.
        blocks = self._sharded_blocks(kjt) if self._has_shards else [torch.empty(b, 0)] * world
        blocks.append(self._layouts[-1].encode(self.replicated(kjt.select_keys(self.replicated.feature_names)))
                      if self.replicated is not None else torch.empty(b, 0))
        out, fm = self._combine(blocks)
        out = _ScaleGrad.apply(out, 1.0 / world)
        if fm is not None:
            fm = _ScaleGrad.apply(fm, 1.0 / world)
        if self._mean:
            out = self._apply_mean(out, kjt)
        return KeyedTensor(self.feature_names, self.feature_dims, out, fm=fm)

    def _sharded_blocks(self, kjt: KeyedJagged) -> list[torch.Tensor]:
        """input_dist, lookup, output_dist: the partial results of every owner, ``[B, C_d]``."""
        b = kjt.batch_size
        if self._prefetched is not None and self._prefetched[0] is kjt:
            owner_kjt, batch_sizes = self._prefetched[1].wait()
            self._prefetched = None
        else:  # not prefetched (e.g. evaluation): a pending prefetch stays for its own batch
            owner_kjt, batch_sizes = self.input_dist(kjt)
        total = sum(batch_sizes)
        if self.local is not None:
            pooled = self._layouts[self.topo.rank].encode(self.local(owner_kjt))
        else:  # still joins the collectives, forward and backward
            pooled = torch.zeros(total, 0, requires_grad=torch.is_grad_enabled())
        if self._coded is not None:
            recv = coded_all_to_all(pooled, self._coded, batch_sizes, self.topo, None)
            blocks = list(torch.split(recv, self._widths, dim=1))
        else:
            width = pooled.shape[1]
            sizes = [b * w for w in self._widths]
            recv = _AllToAll.apply(pooled.reshape(-1), sizes, [n * width for n in batch_sizes],
                                   self.topo, None, "output_dist")
            blocks = [x.view(b, w) for x, w in zip(torch.split(recv, sizes), self._widths)]
        if self.ledger is not None:
            self._record_output("fwd", batch_sizes)
            if recv.requires_grad:  # runs right before the backward all-to-all
                recv.register_hook(lambda g: self._record_output("bwd", batch_sizes))
        return blocks

    def _record_output(self, direction: str, batch_sizes: list[int]) -> None:
        """Ledger entries of one output all-to-all, per table: forward, this rank sends its
        pieces' rows to every other rank and receives the other owners' pieces for its
        samples; backward the reverse. Bytes as encoded (see ``_piece_bytes``)."""
        me = self.topo.rank
        b = batch_sizes[me]
        others = sum(batch_sizes) - b
        per: dict[str | None, list[int]] = {}
        for d, pieces in enumerate(self._piece_bytes):
            for table, fwd, bwd, orig in pieces:
                acc = per.setdefault(table, [0, 0, 0])
                # My pieces leave me forward and come back backward; others' pieces the reverse.
                outgoing = (d == me) == (direction == "fwd")
                n = others if d == me else b
                row = fwd if direction == "fwd" else bwd
                if outgoing:
                    acc[0] += row * n
                    acc[2] += orig * n
                else:
                    acc[1] += row * n
        for table, (sent, received, original) in per.items():
            self.ledger.record("output_dist", table=table, direction=direction, sent=sent,
                               received=received, original=original)

    def _apply_mean(self, out: torch.Tensor, kjt: KeyedJagged) -> torch.Tensor:
        parts = kjt.split_by_key()
        scale = torch.ones_like(out[:1]).expand(out.shape[0], -1).clone()
        for f in self._mean:
            n = parts[f][1].clamp(min=1).to(out.dtype).unsqueeze(1)
            c = self._col[f]
            scale[:, c : c + self.feature_dims[self.feature_names.index(f)]] = 1.0 / n
        return out * scale

    # -- optimizer and state plumbing ------------------------------------------------
    def collections(self) -> list[EmbeddingBagCollection]:
        """The local collections a sparse optimizer updates (shards, replicated)."""
        return [c for c in (self.local, self.replicated) if c is not None]

    def local_shards(self) -> dict[str, tuple[Shard, torch.Tensor]]:
        """``{"table@i": (shard, weight)}`` of the shards held here (replicated: ``table@*``)."""
        out = {}
        if self.local is not None:
            for s in {s.shard_table: s for s in self.slots[self.topo.rank]}.values():
                out[s.shard_table] = (s.shard, self.local.table_weight(s.shard_table))
        if self.replicated is not None:
            for name, t in self.replicated.tables.items():
                out[f"{name}@*"] = (Shard(self.topo.rank, (0, t.num_embeddings), (0, t.embedding_dim)),
                                    self.replicated.table_weight(name))
        return out
