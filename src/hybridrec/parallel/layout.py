"""The layout of a sharded embedding collection, as data: :func:`build_layout`.

A pure function of the tables, the plan and the codecs (no process group, no rank):
every rank builds the same :class:`EmbeddingLayout`, and so does the cost model
(:mod:`hybridrec.parallel.cost_model`), so the bytes the mechanism moves and the bytes
predicted for it are read from the same pieces.

Terms, for a world of ``W`` ranks:

- *slot*: (feature, shard of the feature's table); every owner rank's slots in one order.
- *piece*: one column block of what an owner sends per sample. A slot's piece is its
  pooled partial: the shard's columns, less an FM table's first-order column (it stays
  with its owner and is summed into ``z_p``). With FM tables a block ends in the *FM
  piece* ``[z_p, q_p]`` (DES, :mod:`hybridrec.model.deepfm`), followed by ``s_p`` (the
  owner's FM columns summed, ``k`` floats) when the owner's FM pieces are coded.
- *block*: an owner's pieces side by side, ``[rows, width]``; blocks ``0..W-1`` are the
  owners', block ``W`` the replicated tables' (looked up locally, no hop).
- *assembly*: for every output feature, its pieces among the blocks.
- *TRW block* (``table_row_wise`` tables, rows split over the ranks of one host group of
  ``L = plan.local_world_size`` ranks): an owner's TRW slots are not in its block but in a
  block of their own (:attr:`EmbeddingLayout.trw_blocks`), in one order every member of the
  host shares, so the members' partials add up column by column inside the host
  (:mod:`hybridrec.parallel.host_reduce`). Member ``j`` then holds the sums for the samples
  of the ranks ``d`` with ``d % L == j`` (:meth:`EmbeddingLayout.served`) and sends them
  on; the receivers see one *host block* per host (:attr:`EmbeddingLayout.host_blocks`,
  ``all_blocks[W + 1 + h]``), one vector per sample and feature instead of one per shard.
- *segments*: what owner ``o`` sends rank ``d``, in wire order: block ``o``'s rows of ``d``'s
  samples, then, when ``o`` serves ``d``, its host block's rows
  (:meth:`EmbeddingLayout.segments`).

Bytes per row of a piece, both directions, come from its codec (the float32 identity
when the table has none): ``codec.row_bytes(width)`` forward, ``codec.grad_row_bytes``
backward, ``4 * width`` as float32 (:attr:`Piece.fwd_bytes` ...). Nothing else in the
package writes these formulas.

Example, 2 ranks, table ``t`` (dim 4) row-wise, one feature ``f``: slots
``((f@0,), (f@1,))``; each owner's block is one piece of width 4 (16 bytes per row
float32); feature ``f`` is assembled from ``((0, 0, 0), (1, 0, 0))`` and its partials
are added (``row_split``). The same table ``table_row_wise`` on 4 ranks in hosts of 2,
on host 0: the slots are the same (``f@0`` on rank 0, ``f@1`` on rank 1), blocks 0 and 1
are empty, ``trw_blocks[0]`` and ``trw_blocks[1]`` hold one piece of width 4 each; rank 0
serves ranks 0 and 2, rank 1 ranks 1 and 3; ``f`` is assembled from host block 0
(``((5, 0, 0),)``: ``all_blocks`` 0-3 the owners', 4 the replicated tables', 5 host 0's).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property

import torch

from hybridrec.comm.codecs import CastCodec, Codec
from hybridrec.model.embedding import KeyedTensor, TableConfig, group_tables, output_features
from hybridrec.parallel.plan import Shard, ShardingPlan

VALUE_BYTES = 4
"""Pooled partials and their gradients are float32."""
IDENTITY: Codec = CastCodec(torch.float32)
"""The codec of every piece whose table has none: float32, bit-exact."""
ROW_SPLIT = ("row_wise", "table_row_wise")
HOST_REDUCED = "table_row_wise"
"""Its row shards' partials are summed inside the host before they cross hosts."""


@dataclass(frozen=True)
class Slot:
    feature: str
    table: str
    index: int  # shard index within the table's plan
    shard: Shard
    row_split: bool  # ids are bucketized by row range
    table_rows: int  # rows of the whole table
    trw: bool = False  # table_row_wise: summed inside the host (a TRW block), not sent as it is

    @property
    def name(self) -> str:
        return f"{self.feature}@{self.index}"

    @property
    def shard_table(self) -> str:
        return f"{self.table}@{self.index}"


@dataclass(frozen=True)
class Piece:
    """One column block of a block (see the module docstring)."""

    name: str  # slot name "f@i"; the feature for a replicated table; "fm" for the FM piece
    feature: str | None  # None: the FM piece
    table: str | None  # None: the FM piece (it belongs to no table)
    width: int  # float32 columns per row
    col: int  # first column of the feature's output (and of s) that it fills
    fm: bool  # embedding columns of an FM table: they add up into s
    codec: Codec

    @property
    def fwd_bytes(self) -> int:
        """Bytes per row forward, as encoded."""
        return self.codec.row_bytes(self.width)

    @property
    def bwd_bytes(self) -> int:
        """Bytes per row of the gradient, as encoded."""
        return self.codec.grad_row_bytes(self.width)

    @property
    def orig_bytes(self) -> int:
        """Bytes per row as float32 (uncompressed)."""
        return VALUE_BYTES * self.width


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


def owner_layout(pieces: Sequence[tuple[int, Codec]]) -> OwnerLayout:
    """``pieces`` = ``(width, codec)`` of an owner's pieces in its output order; a run of
    neighbours with the same codec object and width becomes one group."""
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


@dataclass(frozen=True)
class BlockLayout:
    """What one collection (an owner's shards, or the replicated tables) sends per sample."""

    pieces: tuple[Piece, ...]  # the slots' pieces, then the FM piece when there are FM tables
    field_cols: tuple[int, ...]  # columns of the local output sent as they are
    lr_cols: tuple[int, ...]  # first-order columns of the local output, summed into z_p
    fm_dim: int  # width of s (the FM tables' k); 0 without FM tables
    s_at_owner: bool  # the FM piece carries s_p: the owner's FM pieces are coded
    sq_cols: tuple[int, ...] | None = None  # features whose square sums add up into q_p; None: all
    whole: bool = False  # field_cols are every column of the local output, in order: no copy

    @property
    def has_fm(self) -> bool:
        return bool(self.pieces) and self.pieces[-1].feature is None

    @property
    def field_pieces(self) -> tuple[Piece, ...]:
        return self.pieces[:-1] if self.has_fm else self.pieces

    @property
    def widths(self) -> tuple[int, ...]:
        return tuple(p.width for p in self.pieces)

    @property
    def width(self) -> int:
        return sum(self.widths)

    def row_bytes(self, direction: str) -> int:
        """Bytes of one row as encoded, ``"fwd"`` or ``"bwd"``."""
        return sum(p.fwd_bytes if direction == "fwd" else p.bwd_bytes for p in self.pieces)

    def bytes_by_table(self, nbytes: int, direction: str) -> dict[str | None, tuple[int, int]]:
        """``nbytes`` of this block's rows, moved in ``direction`` -> ``{table: (bytes as
        encoded, bytes as float32)}`` (table None: the FM piece). ``nbytes`` must be whole rows."""
        per_row = self.row_bytes(direction)
        rows, rest = divmod(nbytes, per_row) if per_row else (0, nbytes)
        if rest:
            raise ValueError(f"{nbytes} bytes are not whole rows of {per_row} bytes")
        out: dict[str | None, tuple[int, int]] = {}
        for p in self.pieces:
            enc, orig = out.get(p.table, (0, 0))
            out[p.table] = (enc + rows * (p.fwd_bytes if direction == "fwd" else p.bwd_bytes),
                            orig + rows * p.orig_bytes)
        return out

    def orig_by_table(self, rows: int) -> dict[str | None, int]:
        """``{table: bytes}`` of ``rows`` rows of this block as float32 (table None: the FM
        piece); what the in-host reduce of a TRW block moves, codecs or not."""
        out: dict[str | None, int] = {}
        for p in self.pieces:
            out[p.table] = out.get(p.table, 0) + rows * p.orig_bytes
        return out

    @cached_property
    def _index(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        # Column indices as tensors, built once per layout (the hot path reuses them).
        sq = None if self.sq_cols is None else torch.tensor(self.sq_cols, dtype=torch.long, device="cpu")
        return (torch.tensor(self.field_cols, dtype=torch.long, device="cpu"),
                torch.tensor(self.lr_cols, dtype=torch.long, device="cpu"), sq)

    @cached_property
    def _indexes(self) -> dict:
        return {}

    def _index_on(self, device: torch.device) -> tuple:
        """:attr:`_index` on ``device``, copied there once (a copy per step from pageable
        host memory would make the host wait for the GPU)."""
        got = self._indexes.get(device)
        if got is None:
            got = self._indexes[device] = tuple(None if i is None else i.to(device) for i in self._index)
        return got

    def encode(self, kt: KeyedTensor) -> torch.Tensor:
        """A local collection's output -> this block, ``[rows, width]`` (a view of the
        output when the block is all of it)."""
        v = kt.values
        fields_idx, lr_idx, sq_idx = self._index_on(v.device)
        fields = v if self.whole else v.index_select(1, fields_idx)
        if not self.has_fm:
            return fields
        z = v.index_select(1, lr_idx).sum(1, keepdim=True) if self.lr_cols else v.new_zeros(v.shape[0], 1)
        sq = kt.square_sums if sq_idx is None else kt.square_sums.index_select(1, sq_idx)
        parts = [fields, z, sq.sum(1, keepdim=True)]
        if self.s_at_owner:
            widths = [p.width for p in self.field_pieces]
            parts.append(self.fm_sum(torch.split(fields, widths, dim=1), v.shape[0]))
        return torch.cat(parts, dim=1)

    def fm_sum(self, parts: Sequence[torch.Tensor], rows: int) -> torch.Tensor:
        """``S = sum`` of the FM field pieces ``parts`` (``[rows, width]`` each, in piece
        order), each at its columns: ``[rows, fm_dim]``. The same function runs at the
        owner (``s_p``, coded blocks) or at the receiver (on the float32 pieces), so both
        give the same bits."""
        s = parts[0].new_zeros(rows, self.fm_dim) if parts else torch.zeros(rows, self.fm_dim)
        for p, x in zip(self.field_pieces, parts):
            if p.fm and p.width:
                s[:, p.col : p.col + p.width] += x
        return s


def id_dtype(max_rows: int) -> torch.dtype:
    """input_dist's wire type for bag lengths and ids when the largest sharded table has
    ``max_rows`` rows: int32 (4 bytes) when every id fits, else int64 (``.itemsize``: bytes)."""
    return torch.int32 if max_rows <= 2**31 else torch.int64


@dataclass(frozen=True)
class EmbeddingLayout:
    """Everything a :class:`~hybridrec.parallel.sharded_embedding.ShardedEmbeddingBagCollection`
    derives from its tables, plan and codecs (see the module docstring)."""

    world_size: int
    local_world_size: int  # ranks per host group: TRW tables are reduced inside one
    feature_names: tuple[str, ...]  # the output's features, in the single-device order
    feature_dims: tuple[int, ...]  # FM features: k (the first-order column never travels)
    slots: tuple[tuple[Slot, ...], ...]  # per owner rank
    blocks: tuple[BlockLayout, ...]  # per owner rank, then the replicated tables' block
    host_blocks: tuple[BlockLayout, ...]  # per host: its TRW sums, as received (empty: no TRW)
    trw_blocks: tuple[BlockLayout, ...]  # per owner rank: its TRW partials, before the in-host sum
    assembly: tuple[tuple[tuple[int, int, int], ...], ...]  # per feature: (all_blocks index, piece, column)
    row_split: tuple[bool, ...]  # per feature: its partials are added (row shards)
    mean_features: tuple[int, ...]  # sharded mean-pooled features: divided after the sum
    replicated_tables: tuple[str, ...]  # data-parallel tables
    dp_groups: tuple[tuple[int, int], ...]  # (rows, dim) of every fused replicated group
    fm_dim: int  # k of the FM tables; 0 without
    coded: tuple[OwnerLayout, ...] | None  # per owner; None: no codec, the float32 hop
    coded_hosts: tuple[OwnerLayout, ...] | None  # per host, its TRW block's; None with ``coded``

    @property
    def has_shards(self) -> bool:
        return any(self.slots)

    @cached_property
    def id_dtype(self) -> torch.dtype:
        """input_dist's wire type for bag lengths and ids (:func:`id_dtype`)."""
        return id_dtype(max((s.table_rows for slots in self.slots for s in slots), default=0))

    @property
    def widths(self) -> tuple[int, ...]:
        """Width of every owner's block (the output all-to-all's columns)."""
        return tuple(b.width for b in self.blocks[: self.world_size])

    @property
    def replicated(self) -> BlockLayout:
        return self.blocks[self.world_size]

    @cached_property
    def all_blocks(self) -> tuple[BlockLayout, ...]:
        """What a rank assembles its output from: the owners' blocks, the replicated
        tables' block, the hosts' TRW blocks."""
        return self.blocks + self.host_blocks

    @property
    def num_hosts(self) -> int:
        return self.world_size // self.local_world_size

    def host_index(self, host: int) -> int:
        """Index in :attr:`all_blocks` of ``host``'s TRW block."""
        return self.world_size + 1 + host

    def has_trw(self, host: int) -> bool:
        """``host`` holds table_row_wise shards (then every member holds one of each)."""
        return any(s.trw for s in self.slots[host * self.local_world_size])

    def served(self, owner: int) -> tuple[int, ...]:
        """The ranks whose samples' in-host TRW sums ``owner`` holds and sends, in rank
        order: ``d % L == owner % L`` (the same local rank on every host; on its own host
        only ``owner`` itself). Empty when its host has no TRW tables."""
        lw = self.local_world_size
        return tuple(range(owner % lw, self.world_size, lw)) if self.has_trw(owner // lw) else ()

    def segments(self, owner: int, dest: int) -> tuple[int, ...]:
        """Indices in :attr:`all_blocks` of what ``owner`` sends ``dest`` per sample of ``dest``,
        in wire order: ``owner``'s block, then its host's TRW block when it serves ``dest``."""
        lw = self.local_world_size
        if owner % lw == dest % lw and self.has_trw(owner // lw):
            return owner, self.host_index(owner // lw)
        return (owner,)

    def coded_of(self, block: int) -> OwnerLayout:
        """The coded layout of block ``block`` (an owner's or a host's); needs codecs."""
        if block < self.world_size:
            return self.coded[block]
        return self.coded_hosts[block - self.world_size - 1]

    def table_shards(self, table: str) -> tuple[Shard, ...]:
        """Every shard of a sharded table, in the plan's order, from every owner's slots
        (what a checkpoint needs to place this rank's blocks in the global table)."""
        found = {s.index: s.shard for slots in self.slots for s in slots if s.table == table}
        return tuple(found[i] for i in sorted(found))

    @cached_property
    def block_order(self) -> tuple[int, ...] | None:
        """The features in the order :attr:`all_blocks` hold them, piece by piece, where
        every feature is one whole piece of one block and all have one dim: a rank's output
        can then stay as its blocks arrived (:class:`~hybridrec.model.embedding.KeyedTensor`
        ``parts``, which the dot interaction stacks as they are). None where the blocks must
        be assembled: row shards to add, column shards to join, FM pieces, sharded mean
        pooling, several dims."""
        if self.fm_dim or self.mean_features or any(self.row_split) or len(set(self.feature_dims)) > 1:
            return None
        index = {f: i for i, f in enumerate(self.feature_names)}
        order = []
        for block in self.all_blocks:
            for p in block.pieces:
                if p.feature is None or p.col != 0 or p.width != self.feature_dims[index[p.feature]]:
                    return None
                order.append(index[p.feature])
        return tuple(order) if sorted(order) == list(range(len(index))) else None

    @property
    def feature_cols(self) -> tuple[int, ...]:
        """First output column of every feature."""
        starts, col = [], 0
        for d in self.feature_dims:
            starts.append(col)
            col += d
        return tuple(starts)


@dataclass(frozen=True)
class _ShardTable:
    """A local table of one shard, as the block layout needs it (a shard may have no
    rows, which a :class:`TableConfig` refuses, and the cost model lays out any plan)."""

    name: str  # "table@i"
    num_embeddings: int
    embedding_dim: int
    features: tuple[str, ...]  # slot names
    fm_cols: int | None
    pooling: str = "sum"  # always: mean is applied after the sum

    @property
    def first_order_col(self) -> int | None:
        fm = self.fm_cols
        return fm if fm is not None and fm < self.embedding_dim else None


def _shard_tables(slots: Sequence[Slot], tables: Mapping[str, TableConfig]) -> list[_ShardTable]:
    features: dict[str, list[str]] = {}
    shards: dict[str, Slot] = {}
    for s in slots:
        features.setdefault(s.shard_table, []).append(s.name)
        shards[s.shard_table] = s
    out = []
    for n, f in features.items():
        sh, fm = shards[n].shard, tables[shards[n].table].fm_cols
        out.append(_ShardTable(n, sh.num_rows, sh.num_cols, tuple(f),
                               None if fm is None else max(0, min(sh.cols[1], fm) - sh.cols[0])))
    return out


def local_tables(slots: Sequence[Slot], tables: Mapping[str, TableConfig]) -> list[TableConfig]:
    """One local table per shard (named ``table@i``, features named by slot); always sum
    pooling (mean is applied after the sum). A shard of an FM table keeps the FM columns
    it holds (and the first-order column if it holds it)."""
    return [TableConfig(name=t.name, num_embeddings=t.num_embeddings, embedding_dim=t.embedding_dim,
                        features=list(t.features), pooling=t.pooling, fm_cols=t.fm_cols)
            for t in _shard_tables(slots, tables)]


def build_layout(tables: Sequence[TableConfig], plan: ShardingPlan,
                 codecs: Mapping[str, Codec] | None = None) -> EmbeddingLayout:
    """The layout of ``tables`` sharded by ``plan``, with ``codecs`` (table -> codec of its
    output_dist hop; tables without one travel as float32; a TRW table's codec codes its
    cross-host hop). Pure; raises ValueError for tables the plan lacks, codecs of unknown
    tables, FM tables of different ``fm_cols``, or a table_row_wise table not on exactly
    the ranks of one host group."""
    by_name = {t.name: t for t in tables}
    codecs = dict(codecs or {})
    _check(by_name, plan, codecs)
    slots = _slots(tables, plan)
    dp = [t for t in tables if plan.tables[t.name].sharding_type == "data_parallel"]
    fm_dims = {t.fm_cols for t in tables if t.fm_cols is not None}
    if len(fm_dims) > 1:
        raise ValueError(f"FM tables must share fm_cols, got {sorted(fm_dims)}")
    fm_dim = fm_dims.pop() if fm_dims else 0
    owners = [_owner_blocks(s, by_name, codecs, fm_dim) for s in slots]
    trw_blocks = tuple(t for _, t in owners)
    lw = plan.local_world_size
    # Every member of a host has the same TRW pieces in the same order: member 0's stand
    # for the host's sums.
    hosts = tuple(trw_blocks[h * lw] for h in range(plan.world_size // lw))
    blocks = tuple(b for b, _ in owners) + (_replicated_block(dp, fm_dim),)
    features = output_features(list(tables))
    names = tuple(f for f, _ in features)
    table_of = {f: t for t in tables for f in t.features}
    row_split = {s.feature for owner in slots for s in owner if s.row_split and not s.trw}
    coded = coded_hosts = None
    if any(codecs.get(s.table) is not None for owner in slots for s in owner):
        coded, coded_hosts = (tuple(owner_layout([(p.width, p.codec) for p in b.pieces]) for b in group)
                              for group in (blocks[:-1], hosts))
    return EmbeddingLayout(
        world_size=plan.world_size, local_world_size=lw, feature_names=names,
        feature_dims=tuple(d if table_of[f].fm_cols is None else table_of[f].fm_cols for f, d in features),
        slots=slots, blocks=blocks, host_blocks=hosts, trw_blocks=trw_blocks,
        assembly=_assembly(names, blocks + hosts),
        row_split=tuple(f in row_split for f in names),
        mean_features=tuple(i for i, f in enumerate(names) if table_of[f].pooling == "mean"
                            and plan.tables[table_of[f].name].sharding_type != "data_parallel"),
        replicated_tables=tuple(t.name for t in dp),
        dp_groups=tuple((sum(t.num_embeddings for t in ts), dim)
                        for (dim, *_), ts in group_tables(dp).items()),
        fm_dim=fm_dim, coded=coded, coded_hosts=coded_hosts)


def _check(tables: Mapping[str, TableConfig], plan: ShardingPlan, codecs: Mapping[str, Codec]) -> None:
    missing = [n for n in tables if n not in plan.tables]
    if missing:
        raise ValueError(f"the sharding plan has no entry for tables {missing}")
    unknown = sorted(set(codecs) - set(tables))
    if unknown:
        raise ValueError(f"codecs for unknown tables {unknown}")
    lw = plan.local_world_size
    for name in tables:
        tp = plan.tables[name]
        if tp.sharding_type != HOST_REDUCED:
            continue
        # The in-host sum runs over the whole host group, member j serving the ranks
        # d % L == j: every member must hold one shard (possibly of no rows).
        ranks = sorted(s.rank for s in tp.shards)
        host = ranks[0] // lw if lw > 0 else 0
        if lw < 1 or plan.world_size % lw or ranks != list(range(host * lw, (host + 1) * lw)):
            raise ValueError(
                f"table {name!r}: table_row_wise needs one shard on every rank of one host group "
                f"(hosts of local_world_size={lw} consecutive ranks in a world of "
                f"{plan.world_size}), got ranks {ranks}; use row_wise for other rank sets")


def _slots(tables: Sequence[TableConfig], plan: ShardingPlan) -> tuple[tuple[Slot, ...], ...]:
    """Slots grouped by owner rank, in one order every rank computes identically."""
    by_rank: list[list[Slot]] = [[] for _ in range(plan.world_size)]
    for t in tables:
        tp = plan.tables[t.name]
        if tp.sharding_type == "data_parallel":
            continue
        for i, sh in enumerate(tp.shards):
            for f in t.features:
                row_split = tp.sharding_type in ROW_SPLIT
                by_rank[sh.rank].append(Slot(f, t.name, i, sh, row_split, t.num_embeddings,
                                             tp.sharding_type == HOST_REDUCED))
    return tuple(tuple(s) for s in by_rank)


def _block(local: Sequence[TableConfig | _ShardTable], features: Sequence[str] | None, piece_of,
           fm_dim: int, s_at_owner: bool) -> BlockLayout:
    """The block of ``features`` (in this order; None: every output feature of the
    collection of ``local`` tables, in its output order), taken from that collection's
    output; ``piece_of(feature, table, width)`` makes the piece of one feature (``width``
    without the first-order column)."""
    table_of = {f: t for t in local for f in t.features}
    where, col = {}, 0  # feature -> (index, first column, width) in the local output
    for i, (name, width) in enumerate(output_features(list(local))):
        where[name] = (i, col, width)
        col += width
    names = list(where) if features is None else list(features)
    pieces, field_cols, lr_cols, sq_cols = [], [], [], []
    for name in names:
        i, start, width = where[name]
        lr = table_of[name].first_order_col
        pieces.append(piece_of(name, table_of[name], width - (lr is not None)))
        field_cols += [start + c for c in range(width) if c != lr]
        lr_cols += [start + lr] if lr is not None else []
        sq_cols += [i] if table_of[name].fm_cols is not None else []
    if any(table_of[n].fm_cols is not None for n in names):
        pieces.append(Piece("fm", None, None, 2 + (fm_dim if s_at_owner else 0), 0, False, IDENTITY))
    return BlockLayout(tuple(pieces), tuple(field_cols), tuple(lr_cols), fm_dim, s_at_owner,
                       sq_cols=None if features is None else tuple(sq_cols),
                       whole=tuple(field_cols) == tuple(range(col)))


def _owner_blocks(slots: Sequence[Slot], tables: Mapping[str, TableConfig], codecs: Mapping[str, Codec],
                  fm_dim: int) -> tuple[BlockLayout, BlockLayout]:
    """``(block, TRW block)`` of one owner: both read the output of its one local collection.
    The TRW block lists its features in the order of the TRW shard tables alone, which every
    member of the host shares (the whole collection's fused-group order may differ)."""
    slot_of = {s.name: s for s in slots}
    local = _shard_tables(slots, tables)
    trw = [s for s in slots if s.trw]

    def piece(name: str, table: _ShardTable, width: int) -> Piece:
        s = slot_of[name]
        return Piece(name, s.feature, s.table, width, s.shard.cols[0], table.fm_cols is not None,
                     codecs.get(s.table) or IDENTITY)

    def s_at_owner(group: Sequence[Slot]) -> bool:
        # s_p travels when a coded FM piece would make the receiver's s differ from the
        # owner's vectors (see hybridrec.model.deepfm).
        return any(codecs.get(s.table) is not None and tables[s.table].fm_cols is not None for s in group)

    own = None if not trw else [n for n, _ in output_features(local) if not slot_of[n].trw]
    trw_order = [n for n, _ in output_features(_shard_tables(trw, tables))]
    return (_block(local, own, piece, fm_dim, s_at_owner([s for s in slots if not s.trw])),
            _block(local, trw_order, piece, fm_dim, s_at_owner(trw)))


def _replicated_block(dp: Sequence[TableConfig], fm_dim: int) -> BlockLayout:
    table_of = {f: t for t in dp for f in t.features}

    def piece(name: str, table: TableConfig, width: int) -> Piece:
        return Piece(name, name, table_of[name].name, width, 0, table.fm_cols is not None, IDENTITY)

    return _block(list(dp), None, piece, fm_dim, False)


def _assembly(features: Sequence[str],
              blocks: Sequence[BlockLayout]) -> tuple[tuple[tuple[int, int, int], ...], ...]:
    """For every feature, ``(block, piece, first column)`` of its pieces, column shards in
    column order (a TRW feature: its one piece in its host's block)."""
    found: dict[str, list[tuple[int, int, int]]] = {f: [] for f in features}
    for d, block in enumerate(blocks):
        for j, p in enumerate(block.field_pieces):
            found[p.feature].append((d, j, p.col))
    return tuple(tuple(sorted(found[f], key=lambda x: x[2])) for f in features)
