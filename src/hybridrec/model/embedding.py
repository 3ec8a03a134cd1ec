"""Embedding-bag collection over many tables, single device.

Tables with the same dim and pooling are stored fused in one weight tensor
(one ``embedding_bag`` call looks them all up), but the state dict shows one
tensor per table (``tables.<name>.weight``), so checkpoints do not depend on
the grouping and a sharder can split the collection table by table.

Gradients never materialise a dense ``[rows, dim]`` table gradient. The pooled
output is an autograd leaf; after ``backward`` its gradient, together with the
ids the forward recorded, is what :meth:`pop_sparse_grads` hands to a sparse
optimizer, which updates only the touched rows (hybridrec.train.loop.sparse_optim).

Storage dtype (``weight_dtype``, ``model.embedding_dtype``): float32, or bfloat16 for half
the memory of the tables and of the lookups' reads. A bf16 table is read as it is (the
bags are pooled by ``embedding_bag`` in bf16 and cast to ``output_dtype``) and updated in
float32: the optimizers add their float32 deltas to the touched rows in float32 and store
the sums with :func:`stochastic_round` (an update far below a bf16 step is kept in
expectation, where rounding to nearest would drop it every time). The optimizer state
(row-wise Adagrad's sums, Adam's moments) stays float32.
"""

from __future__ import annotations

import math
import threading
import zlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from hybridrec.model import triton_kernels
from hybridrec.model.id_groups import group_ids
from hybridrec.model.kernels import Choice, Timing, choose, race_checked
from hybridrec.phases import phase
from hybridrec.sparse.keyed_jagged import KeyedJagged


@dataclass(kw_only=True)
class TableConfig:
    """One embedding table."""

    name: str
    """Table name (state-dict key ``tables.<name>.weight``)."""
    num_embeddings: int
    """Rows."""
    embedding_dim: int
    """Columns."""
    features: list[str] = field(default_factory=list)
    """Features that read this table (default: one feature named like the table)."""
    pooling: str = "sum"
    """How the ids of one bag combine: ``sum`` or ``mean``."""
    fm_cols: int | None = None
    """FM tables (DeepFM): the leading columns that form the id's embedding; the column
    after them, when the table has one, is the id's first-order (LR) weight. The
    collection also returns each bag's sum of squared embedding norms over these columns.
    None: an ordinary table."""

    def __post_init__(self) -> None:
        if not self.features:
            self.features = [self.name]
        if self.pooling not in ("sum", "mean"):
            raise ValueError(f"table {self.name}: pooling must be sum or mean, got {self.pooling!r}")
        if self.num_embeddings <= 0 or self.embedding_dim <= 0:
            raise ValueError(f"table {self.name}: sizes must be positive")
        if self.fm_cols is not None:
            if not 0 <= self.embedding_dim - self.fm_cols <= 1:
                raise ValueError(f"table {self.name}: an FM table has fm_cols embedding columns and at "
                                 f"most one first-order column, got dim {self.embedding_dim}, fm_cols {self.fm_cols}")
            if self.pooling != "sum":
                raise ValueError(f"table {self.name}: FM tables need sum pooling")

    @property
    def first_order_col(self) -> int | None:
        """Column of the first-order weight, if this (FM) table holds it."""
        fm = self.fm_cols
        return fm if fm is not None and fm < self.embedding_dim else None


def group_tables(tables: list[TableConfig]) -> dict[tuple[int, str, int | None], list[TableConfig]]:
    """Tables fused together: same (dim, pooling, fm_cols), in first-seen order. The pooled
    output lists features group by group, in this order."""
    groups: dict[tuple[int, str, int | None], list[TableConfig]] = {}
    for t in tables:
        groups.setdefault((t.embedding_dim, t.pooling, t.fm_cols), []).append(t)
    return groups


def output_features(tables: list[TableConfig]) -> list[tuple[str, int]]:
    """``(feature, dim)`` in the column order of the collection's pooled output."""
    return [(f, t.embedding_dim) for ts in group_tables(tables).values() for t in ts for f in t.features]


_INIT_BLOCK = 1 << 14


def init_table_block(
    table: TableConfig, seed: int, rows: tuple[int, int] | None = None,
    cols: tuple[int, int] | None = None, *, out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Initial values of a block of a table: U(-sqrt(1/n), sqrt(1/n)) (the DLRM reference).

    Drawn in fixed row blocks from generators seeded by ``(seed, table name, block)``,
    so any shard of the table (rows and columns) gets exactly the values the whole
    table would have: initialisation does not depend on the sharding plan. Writes
    into ``out`` when given (no second copy of a large shard).
    """
    r0, r1 = rows or (0, table.num_embeddings)
    c0, c1 = cols or (0, table.embedding_dim)
    a = math.sqrt(1.0 / table.num_embeddings)
    out = torch.empty(r1 - r0, c1 - c0) if out is None else out
    name_key = zlib.crc32(table.name.encode())
    for b in range(r0 // _INIT_BLOCK, (r1 + _INIT_BLOCK - 1) // _INIT_BLOCK):
        lo = b * _INIT_BLOCK
        hi = min(lo + _INIT_BLOCK, table.num_embeddings)
        g = torch.Generator().manual_seed((seed * 1_000_003 + name_key) * 1_000_003 + b)
        block = torch.empty(hi - lo, table.embedding_dim).uniform_(-a, a, generator=g)
        s0, s1 = max(lo, r0), min(hi, r1)
        out[s0 - r0 : s1 - r0] = block[s0 - lo : s1 - lo, c0:c1]
    return out


WEIGHT_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
"""``model.embedding_dtype``: the storage dtype of the embedding tables."""


NOISE_SIZE = 1 << 16
"""Random 16-bit numbers drawn per :func:`stochastic_round` call: entries this far apart
(in flat order) share one; any one entry gets a fresh one at every call."""


def stochastic_round(x: torch.Tensor, dtype: torch.dtype = torch.bfloat16,
                     generator: torch.Generator | None = None) -> torch.Tensor:
    """float32 ``x`` -> bfloat16, rounded up or down to a neighbour with the probability
    that makes the result unbiased (``E[out] = x``): a random 16-bit integer is added to
    the bits that bf16 drops, then they are cut. Sign-magnitude bits make this the same
    for negative values (the magnitude is rounded); a value within a step of the largest
    float32 may round to infinity, NaN stays NaN.

    The random numbers come from ``generator`` (default: torch's global generator, which
    checkpoints save per rank): :data:`NOISE_SIZE` of them per call, shared by entries that
    far apart (drawing one per entry cost ~6 ms for the 3.4M entries one step of the
    benchmark DLRM updates). Each entry's rounding is still unbiased at every call; entries
    that share a number round up or down together, which adds variance to sums over them
    and nothing to their expectation."""
    if dtype != torch.bfloat16:
        raise ValueError(f"stochastic rounding to {dtype}: only torch.bfloat16")
    if x.dtype != torch.float32:
        raise ValueError(f"stochastic rounding of {x.dtype}: float32 only")
    bits = x.contiguous().view(torch.int32).view(-1)
    n = bits.numel()
    k = min(n, NOISE_SIZE)
    raw = torch.randint(-2**31, 2**31 - 1, ((k + 1) // 2,), dtype=torch.int32, device=x.device,
                        generator=generator)  # 32 random bits: two 16-bit numbers
    noise = raw.view(torch.int16)[:k].to(torch.int32).bitwise_and_(0xFFFF)
    cut = torch.empty_like(bits)
    full = n // k * k
    torch.add(bits[:full].view(-1, k), noise, out=cut[:full].view(-1, k))
    torch.add(bits[full:], noise[: n - full], out=cut[full:])
    cut.bitwise_and_(-65536)  # the low 16 bits (what bf16 drops) cleared
    # (NaN payloads could carry into the sign.) On a GPU always masked: looking first would
    # make the host wait for it.
    if x.device.type != "cpu" or not bool(torch.isfinite(x.sum())):
        cut = torch.where(torch.isnan(x.view(-1)), bits, cut)
    return cut.view(torch.float32).view(x.shape).to(torch.bfloat16)  # exact: nothing left to round


class KeyedTensor:
    """Pooled embeddings: ``values`` ``[B, sum(dims)]``, one column block per key.

    ``square_sums`` (collections with FM tables): ``[B, len(keys)]``, for every bag the
    sum over its ids of the squared norm of the id's embedding, ``sum_i ||v_i||^2`` (the
    FM term's ``q``; unlike the pooled vector's norm it adds up over row shards; zeros
    for ordinary tables). ``fm``: ``[B, 2 + k]`` = ``[z, q, s]`` already added up over
    shard owners by a sharded collection, see :mod:`hybridrec.model.deepfm`.

    Or, instead of ``values``, ``parts``: ``[B, F_i, D]`` tensors whose features, side by
    side, are the keys in ``order`` (``order[k]``: the index in ``keys`` of the ``k``-th), as
    a sharded collection receives them from their owners (:meth:`as_parts`). A consumer
    that does not care in which order the features come (the DLRM's dot interaction) takes
    them as they are; ``values`` puts them in the keys' order on first use (one copy).
    """

    def __init__(self, keys: list[str], dims: list[int], values: torch.Tensor | None = None,
                 square_sums: torch.Tensor | None = None, fm: torch.Tensor | None = None, *,
                 parts: Sequence[torch.Tensor] | None = None, order: Sequence[int] | None = None) -> None:
        if (values is None) == (parts is None):
            raise ValueError("KeyedTensor: give values or parts (with their order), not both")
        if parts is not None:
            if order is None or sorted(order) != list(range(len(keys))):
                raise ValueError(f"KeyedTensor: parts need an order of the {len(keys)} keys, got {order}")
            if sum(p.shape[1] for p in parts) != len(keys) or any(p.dim() != 3 for p in parts):
                raise ValueError(f"KeyedTensor: parts [B, F_i, D] of {len(keys)} features in all, got "
                                 f"{[tuple(p.shape) for p in parts]}")
        self.keys, self.dims, self.square_sums, self.fm = keys, dims, square_sums, fm
        self._values = values
        self._parts = tuple(parts) if parts is not None else None
        self._order = tuple(order) if order is not None else None

    @property
    def values(self) -> torch.Tensor:
        if self._values is None:  # (one copy: every feature's slice, in the keys' order)
            slices = [x for p in self._parts for x in p.split(1, dim=1)]
            at = sorted(range(len(self._order)), key=self._order.__getitem__)
            z = torch.cat([slices[k] for k in at], dim=1)
            self._values = z.view(z.shape[0], -1)
        return self._values

    def as_3d(self) -> torch.Tensor:
        """``[B, F, D]`` view; all dims must be equal."""
        d = self.dims[0]
        if any(x != d for x in self.dims):
            raise ValueError(f"as_3d needs equal embedding dims, got {sorted(set(self.dims))}")
        return self.values.view(self.values.shape[0], len(self.keys), d)

    def as_parts(self) -> tuple[tuple[torch.Tensor, ...], tuple[int, ...] | None]:
        """``(parts, order)``: the ``[B, F_i, D]`` parts and their features' order as
        given, or ``((as_3d(),), None)`` (the keys' order)."""
        if self._parts is not None:
            return self._parts, self._order
        return (self.as_3d(),), None


@dataclass
class _Group:
    """Tables fused into one weight: same dim and pooling."""

    dim: int
    pooling: str
    fm_cols: int | None  # square sums over the first fm_cols columns (FM tables)
    tables: list[TableConfig]
    features: list[str]  # in output order
    feature_row_offset: list[int]  # row of the feature's table inside the fused weight
    col_start: int  # first output column of this group's block


@dataclass
class _Lookup:
    """What backward needs to turn the pooled gradient into per-id gradients."""

    group: int
    ids: torch.Tensor  # [nnz] rows of the fused weight
    lengths: torch.Tensor | None  # [B * F_g] int64 bag sizes, sample-major; None if all 1
    pooled: torch.Tensor  # the autograd leaf, [B, total_dim]
    batch_size: int
    square_sums: torch.Tensor | None = None  # the autograd leaf, [B, num_features]
    feature_start: int = 0  # first column of the group in square_sums


class EmbeddingCollection(Protocol):
    """What the step, the optimizers and the checkpointer ask of a model's embedding
    collection, whichever kind it is: this module's single-device
    :class:`EmbeddingBagCollection`, a rank's shards
    (:class:`~hybridrec.parallel.sharded_embedding.ShardedEmbeddingBagCollection`), or
    rows pulled from parameter servers (:class:`~hybridrec.ps.client.RemoteEmbeddingCollection`).
    Only the builders (:mod:`hybridrec.train.build`) choose a kind; everyone else calls this."""

    spans_ranks: bool  # made for several ranks (sharded, or served): a checkpoint of several ranks can hold it
    holds_tables: bool  # its tables are in this process (not a parameter server's)
    tables: dict[str, TableConfig]

    def step_grads(self) -> dict[str, list]:
        """The step's row gradients by the name of the collection that applies them
        (:meth:`updated_collections`' keys; ``"ps"``: pushed to the servers)."""

    def updated_collections(self) -> dict[str, EmbeddingBagCollection]:
        """The single-device collections a rank's sparse optimizers update, by name."""

    def local_weights(self) -> dict[str, torch.Tensor]:
        """This process's table weights by local name (``table``, or ``table@i`` for shard i)."""

    def shard_of(self, local_name: str) -> tuple[object, list] | None:
        """A local name's shard and all shards of its table (:class:`hybridrec.parallel.plan.Shard`);
        None: the whole table."""

    def plan_dict(self) -> dict | None:
        """The sharding plan (JSON-ready); None: not sharded."""


class EmbeddingBagCollection(nn.Module):
    """Pooled embedding lookup for many features.

    ``forward(kjt)`` takes a :class:`KeyedJagged` whose keys include every
    feature of the collection and returns a :class:`KeyedTensor` with the
    features in :attr:`feature_names` order (``[B, sum(feature_dims)]``).

    State across a training step: a forward in training mode with gradients enabled
    parks its lookups (the ids per fused group and the pooled output, an autograd leaf)
    in ``self._pending``, because the row gradients exist only after ``backward``.
    :meth:`pop_sparse_grads` is their one consumer: it turns them into row gradients
    and clears them, so call it once per step after ``backward`` (a forward whose
    lookups are never popped keeps them, and their tensors, until the next pop).
    Evaluation (``eval()`` or ``torch.no_grad()``) parks nothing. The parked lookups are
    the calling thread's: training threads sharing the collection (``train.workers``,
    :mod:`hybridrec.train.loop.hogwild`) each pop their own forward's.
    """

    def __init__(
        self, tables: list[TableConfig], *, device: torch.device | None = None, seed: int = 0,
        init=None, weight_dtype: torch.dtype = torch.float32, output_dtype: torch.dtype = torch.float32,
        init_values: bool | None = True,
    ) -> None:
        """``init(table, weight)`` fills a table's weight in place (default: the seeded
        :func:`init_table_block` of that table). With FM tables (``fm_cols``) the output
        also carries every bag's sum of squared embedding norms, with its gradient.
        ``weight_dtype``: float32 or bfloat16 storage (module docstring; FM tables: float32
        only); ``output_dtype``: of the pooled output and so of its gradient.
        ``init_values`` False: the tables start as zeros (a checkpoint about to be restored
        overwrites them; :meth:`reset_parameters` draws them); None: as allocated, untouched
        (their caller gives them other memory, see :mod:`hybridrec.train.checkpointing.resident`)."""
        super().__init__()
        if weight_dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"embedding weight dtype {weight_dtype}: torch.float32 or torch.bfloat16")
        if weight_dtype != torch.float32 and any(t.fm_cols is not None for t in tables):
            raise ValueError("FM tables (model.arch=deepfm) are stored in float32 only")
        self.seed = seed
        self._init = init
        self.weight_dtype, self.output_dtype = weight_dtype, output_dtype
        self.tables = {t.name: t for t in tables}
        if len(self.tables) != len(tables):
            raise ValueError("duplicate table names")
        self._groups: list[_Group] = []
        self._table_rows: dict[str, tuple[int, int]] = {}  # name -> (group, first row)
        self._pending_by_thread: dict[int, list[_Lookup]] = {}  # lookups not popped yet, see the class
        self._row_off_cache: dict = {}  # (group, device) -> its features' first rows, _row_offsets
        self._build_groups(tables, device)
        self.lookups = ["embedding_bag"] * len(self._groups)
        """Each fused group's lookup of one id per bag (:data:`LOOKUPS`), set by :func:`tune_lookups`."""
        if init_values:
            self.reset_parameters()
        elif init_values is not None:  # (a checkpoint overwrites them; its caller resets them if none does)
            with torch.no_grad():
                for gi in range(self.num_groups):
                    self.group_weight(gi).zero_()

    def _build_groups(self, tables: list[TableConfig], device) -> None:
        col = 0
        for gi, ((dim, pooling, fm_cols), ts) in enumerate(group_tables(tables).items()):
            rows, feats, offs = 0, [], []
            for t in ts:
                self._table_rows[t.name] = (gi, rows)
                feats += t.features
                offs += [rows] * len(t.features)
                rows += t.num_embeddings
            weight = torch.empty(rows, dim, device=device, dtype=self.weight_dtype)
            self.register_parameter(f"_fused_{gi}", nn.Parameter(weight, requires_grad=False))
            self._groups.append(_Group(dim, pooling, fm_cols, ts, feats, offs, col))
            col += dim * len(feats)
        self.total_dim = col
        self.has_fm = any(g.fm_cols is not None for g in self._groups)
        sizes = [len(g.features) for g in self._groups]
        self._group_feature_starts = [sum(sizes[:i]) for i in range(len(sizes))]  # (of the output's features)
        self.feature_names = [f for g in self._groups for f in g.features]
        self.feature_dims = [g.dim for g in self._groups for _ in g.features]
        if len(set(self.feature_names)) != len(self.feature_names):
            raise ValueError("a feature may read only one table")

    def reset_parameters(self) -> None:
        """Every table's initial values (:func:`init_table_block`, or the collection's ``init``)."""
        with torch.no_grad():
            for name, t in self.tables.items():
                if self._init is None:
                    init_table_block(t, self.seed, out=self.table_weight(name))
                else:
                    self._init(t, self.table_weight(name))

    # -- storage -------------------------------------------------------------
    def group_weight(self, group: int) -> torch.Tensor:
        return getattr(self, f"_fused_{group}")

    @property
    def num_groups(self) -> int:
        return len(self._groups)

    def group_features(self, group: int) -> list[str]:
        """The features looked up in fused weight ``group``."""
        return list(self._groups[group].features)

    def table_slice(self, name: str) -> tuple[int, int, int]:
        """``(group, first_row, rows)`` of a table inside its fused weight."""
        g, start = self._table_rows[name]
        return g, start, self.tables[name].num_embeddings

    # -- the EmbeddingCollection interface ---------------------------------------
    spans_ranks = False
    holds_tables = True

    def step_grads(self) -> dict[str, list]:
        return {"tables": self.pop_sparse_grads()}

    def updated_collections(self) -> dict[str, EmbeddingBagCollection]:
        return {"tables": self}

    def local_weights(self) -> dict[str, torch.Tensor]:
        return {n: self.table_weight(n) for n in self.tables}

    def shard_of(self, local_name: str) -> None:
        return None

    def plan_dict(self) -> None:
        return None

    def table_weight(self, name: str) -> torch.Tensor:
        """The table's ``[rows, dim]`` weight (a view into the fused storage)."""
        g, start, n = self.table_slice(name)
        return self.group_weight(g)[start : start + n]

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        for name in self.tables:
            w = self.table_weight(name)
            destination[f"{prefix}tables.{name}.weight"] = w if keep_vars else w.detach()

    def _load_from_state_dict(
        self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
    ):
        for name in self.tables:
            key = f"{prefix}tables.{name}.weight"
            if key not in state_dict:
                missing_keys.append(key)
                continue
            src, dst = state_dict[key], self.table_weight(name)
            if src.shape != dst.shape:
                error_msgs.append(f"{key}: shape {tuple(src.shape)} != {tuple(dst.shape)}")
                continue
            with torch.no_grad():
                dst.copy_(src)
        ours = {f"{prefix}tables.{n}.weight" for n in self.tables}
        for key in state_dict:
            if key.startswith(f"{prefix}tables.") and key not in ours:
                unexpected_keys.append(key)

    # -- lookup --------------------------------------------------------------
    def forward(self, kjt: KeyedJagged) -> KeyedTensor:
        b = kjt.batch_size
        blocks, lookups, squares = [], [], []
        for gi, g in enumerate(self._groups):
            ids, lengths, offsets = self._group_ids(g, kjt)
            weight = self.group_weight(gi)
            if lengths is None and self.lookups[gi] != "embedding_bag":  # (one id per bag: its row)
                pooled = lookup_rows(weight, ids, self.lookups[gi])
            else:
                pooled = F.embedding_bag(ids, weight, offsets, mode=g.pooling, include_last_offset=True)
            if pooled.dtype != self.output_dtype:  # (bf16 storage, float32 output)
                pooled = pooled.to(self.output_dtype)
            blocks.append(pooled.view(b, len(g.features) * g.dim))
            lookups.append((gi, ids, lengths))
            if self.has_fm:  # ordinary tables' features get zeros (they are not in the FM term)
                squares.append(_bag_square_sums(weight[:, : g.fm_cols], ids, offsets, lengths).view(b, -1)
                               if g.fm_cols is not None else pooled.new_zeros(b, len(g.features)))
        # One group (the common case) needs no copy: the bags are sample-major.
        out = blocks[0] if len(blocks) == 1 else torch.cat(blocks, dim=1)
        sq = (squares[0] if len(squares) == 1 else torch.cat(squares, dim=1)) if squares else None
        if self.training and torch.is_grad_enabled():
            out.requires_grad_()
            if sq is not None:
                sq.requires_grad_()
            starts = self._group_feature_starts
            self._pending.extend(_Lookup(gi, ids, ln, out, b, sq, starts[gi]) for gi, ids, ln in lookups)
        return KeyedTensor(self.feature_names, self.feature_dims, out, square_sums=sq)

    def _group_ids(self, g: _Group, kjt: KeyedJagged):
        """Ids of the group's features offset into the fused weight, in sample-major
        bag order (sample 0's features, then sample 1's...), so that the pooled
        output is ``[B, F_g, D]`` without a transpose.

        Returns ``(ids [nnz], lengths [B*F_g] or None when every bag has one id,
        offsets [B*F_g + 1])``.
        """
        if kjt.keys != g.features:
            missing = [f for f in g.features if f not in kjt.keys]
            if missing:
                raise KeyError(f"input has no feature(s) {missing}")
            kjt = kjt.select_keys(g.features)
        b, nf = kjt.batch_size, len(g.features)
        dev, nnz = kjt.values.device, kjt.values.numel()
        row_off = self._row_offsets(g, dev)
        if kjt.one_id_per_bag():  # (a host-side fact: no GPU sync, KeyedJagged.to)
            ids = (kjt.values.view(nf, b) + row_off.unsqueeze(1)).t().reshape(-1)
            return ids, None, torch.arange(nf * b + 1, device=dev)
        # (output sizes given: nothing here waits for a GPU)
        counts = kjt.lengths.view(nf, b).sum(1)
        ids_km = kjt.values + torch.repeat_interleave(row_off, counts, output_size=nnz)
        # Reorder values from key-major to sample-major bags (an int gather).
        lengths = kjt.lengths.view(nf, b).t().reshape(-1).to(torch.int64)
        starts = kjt.offsets()[:-1].view(nf, b).t().reshape(-1)
        offsets = torch.zeros(nf * b + 1, dtype=torch.int64, device=dev)
        torch.cumsum(lengths, 0, out=offsets[1:])
        src = torch.repeat_interleave(starts - offsets[:-1], lengths, output_size=nnz) + torch.arange(
            nnz, device=dev
        )
        return ids_km.index_select(0, src), lengths, offsets

    def _row_offsets(self, g: _Group, device: torch.device) -> torch.Tensor:
        """The first row of each of ``g``'s features inside its fused weight, int64 on
        ``device`` (made once per device: a copy from the host would wait for a GPU)."""
        key = (id(g), device)
        off = self._row_off_cache.get(key)
        if off is None:
            off = self._row_off_cache[key] = torch.tensor(g.feature_row_offset, dtype=torch.int64, device=device)
        return off

    # -- gradients -----------------------------------------------------------
    @property
    def _pending(self) -> list[_Lookup]:
        """The calling thread's lookups not popped yet."""
        return self._pending_by_thread.setdefault(threading.get_ident(), [])

    def pop_sparse_grads(self) -> list[tuple[int, torch.Tensor, torch.Tensor, bool]]:
        """Row gradients of the calling thread's lookups since its last call.

        Returns ``[(group, ids [n], grad_rows [n, dim], unique)]``, float32 whatever
        the output's dtype. With one id per
        bag (``unique=False``) these are the bags' gradients, one row per occurrence,
        and an id may repeat (optimizers add them up). With multi-id bags the rows are
        already summed per distinct id (``unique=True``, ids ascending), so no
        ``[nnz, dim]`` per-occurrence gradient is ever built. ``grad_rows`` may alias
        the pooled output's gradient buffer: the caller owns it and may overwrite it.
        """
        out = []
        for lk in self._pending_by_thread.pop(threading.get_ident(), []):
            if lk.pooled.grad is None:
                continue  # forward without backward (e.g. a skipped step)
            out.append((lk.group, *self._row_grads(lk)))
        return out

    def _row_grads(self, lk: _Lookup) -> tuple[torch.Tensor, torch.Tensor, bool]:
        g = self._groups[lk.group]
        b, nf = lk.batch_size, len(g.features)
        block = lk.pooled.grad[:, g.col_start : g.col_start + g.dim * nf]
        bag_grads = block.reshape(b * nf, g.dim)  # sample-major bags, like the ids
        if bag_grads.dtype != torch.float32:  # (a bf16 output): the updates are float32
            bag_grads = bag_grads.float()
        sq_grads = None  # d loss / d (bag's sum of squared norms), [B * F_g]
        if g.fm_cols and lk.square_sums is not None and lk.square_sums.grad is not None:
            sq_grads = lk.square_sums.grad[:, lk.feature_start : lk.feature_start + nf].reshape(-1)
        weight = self.group_weight(lk.group)
        if lk.lengths is None:
            if sq_grads is not None:  # d ||v||^2 / dv = 2v, per occurrence, on the FM columns
                bag_grads = bag_grads.clone()
                bag_grads[:, : g.fm_cols] += 2 * sq_grads.unsqueeze(1) * weight[:, : g.fm_cols].index_select(0, lk.ids)
            return lk.ids, bag_grads, False
        # The gradient of row r is the sum of the gradients of the bags holding r:
        # an embedding_bag over the bags, grouped by id (stable sort: deterministic).
        bag_of_id = torch.repeat_interleave(torch.arange(nf * b, device=bag_grads.device), lk.lengths,
                                            output_size=lk.ids.numel())
        unique, offsets, perm = group_ids(lk.ids, bound=weight.shape[0])
        bags = bag_of_id.index_select(0, perm)
        weights = None
        if g.pooling == "mean":
            weights = 1.0 / lk.lengths.clamp(min=1).to(bag_grads.dtype).index_select(0, bags)
        rows = F.embedding_bag(bags, bag_grads, offsets, mode="sum", per_sample_weights=weights,
                               include_last_offset=True)
        if sq_grads is not None:  # 2 v_r times the summed square-sum gradients of r's bags
            coef = F.embedding_bag(bags, sq_grads.unsqueeze(1), offsets, mode="sum", include_last_offset=True)
            rows[:, : g.fm_cols] += 2 * coef * weight[:, : g.fm_cols].index_select(0, unique)
        return unique, rows, True


LOOKUPS = ("embedding_bag", "index_select", "triton")
"""The lookup of one id per bag (every pooling gives the id's row): ``F.embedding_bag``, the
row gather ``index_select``, or on a GPU :func:`~hybridrec.model.triton_kernels.gather_rows`.
The same values (copies of the rows; ``embedding_bag`` adds them to zero, which only turns a
-0.0 into +0.0); which is fastest depends on the device, chosen by :func:`tune_lookups`."""


def lookup_impls(device: torch.device | str) -> list[str]:
    """The lookups that run on ``device``."""
    return [i for i in LOOKUPS if i != "triton" or triton_kernels.available(device)]


def lookup_rows(weight: torch.Tensor, ids: torch.Tensor, impl: str) -> torch.Tensor:
    """``weight[ids]`` by ``impl`` (``index_select`` or ``triton``)."""
    if impl == "triton":
        return triton_kernels.gather_rows(weight, ids)
    return weight.index_select(0, ids)


def time_lookups(weight: torch.Tensor, n: int, impls: list[str], *, budget_s: float = 0.1) -> Timing:
    """Seconds of looking up ``n`` random rows of ``weight`` (one per bag) with each of ``impls``
    (:func:`~hybridrec.model.kernels.race_checked`: one that does not run here, or looks up
    other values, is never chosen)."""
    gen = torch.Generator(device=weight.device).manual_seed(0)
    ids = torch.randint(0, weight.shape[0], (n,), generator=gen, device=weight.device)
    offsets = torch.arange(n + 1, device=weight.device)

    def run(impl: str) -> torch.Tensor:
        with torch.no_grad():
            if impl == "embedding_bag":
                return F.embedding_bag(ids, weight, offsets, mode="sum", include_last_offset=True)
            return lookup_rows(weight, ids, impl)

    return race_checked(impls, run, device=weight.device, what="lookup", budget_s=budget_s)


def tune_lookups(collections, ids_per_feature: int, *, mode: str = "auto") -> list[Choice]:
    """Each fused group's lookup of one id per bag in ``collections``, timed at the ids of a
    step (``ids_per_feature`` per feature) on the group's table (cached like every choice;
    ``mode`` ``torch``/``onednn`` concern the linears and leave this measured)."""
    mode = mode if mode in ("auto", "measure") else "auto"
    items = {}
    for c in collections:
        for gi in range(c.num_groups):
            w, n = c.group_weight(gi), ids_per_feature * len(c.group_features(gi))
            if w.numel() and n:
                key = f"lookup {w.device.type} {str(w.dtype).removeprefix('torch.')} {w.shape[0]}x{w.shape[1]} +{n}"
                items.setdefault(key, (w, n, []))[2].append((c, gi))
    got = choose([(k, lookup_impls(w.device), None) for k, (w, _, _) in items.items()],
                 lambda key, cands, budget: time_lookups(items[key][0], items[key][1], cands, budget_s=budget),
                 mode=mode, budget_s=0.3)
    for key, (_, _, users) in items.items():
        for c, gi in users:
            c.lookups[gi] = got[key].impl
    return list(got.values())


def lookup_during(collection, kjt: KeyedJagged, sparse_input, work):
    """``(collection's KeyedTensor for kjt, work())``, with ``work`` (the bottom MLP) run while
    the lookup's output travels when the collection can start it (a sharded collection's
    ``start_forward``: forward, and in backward its gradients, overlap ``work``); else the
    lookup first. ``sparse_input``: the collection's pending input_dist, or None."""
    args = () if sparse_input is None else (sparse_input,)
    start = getattr(collection, "start_forward", None)
    with phase("embeddings"):
        pooled = start(kjt, *args) if start is not None else collection(kjt, *args)
    done = work()
    if start is not None:
        with phase("embeddings"):
            pooled = pooled.wait()
    return pooled, done


def _bag_square_sums(weight: torch.Tensor, ids: torch.Tensor, offsets: torch.Tensor,
                     lengths: torch.Tensor | None) -> torch.Tensor:
    """``sum_i ||weight[i]||^2`` over the ids of every bag: ``[num_bags]`` (no autograd;
    the gradient is added to the row gradients in ``_row_grads``)."""
    sq = weight.index_select(0, ids).pow(2).sum(1)
    if lengths is None:  # one id per bag
        return sq
    return F.embedding_bag(torch.arange(ids.numel(), device=ids.device), sq.unsqueeze(1), offsets,
                           mode="sum", include_last_offset=True).squeeze(1)
