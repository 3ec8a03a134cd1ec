"""Sharded embedding-bag collection: input_dist -> lookup -> output_dist.

Every sharding type of :mod:`hybridrec.parallel.plan` is handled by one
mechanism. A *slot* is (feature, shard of the feature's table). For every slot
the rank that owns the samples sends the ids the shard needs (row-wise: only the
ids in its row range, rebased; column-wise and table-wise: all of them); the
shard's owner pools them into a *partial result* of the shard's width; the
partial results go back to the samples' ranks, where they are added (row
shards: DES's sum of partial results) or placed side by side (column shards).
Only pooled partial results travel, never embedding rows.

Everything derived from the tables, the plan and the codecs (slots per owner, the
owners' blocks and pieces, the assembly of the output, bytes per row) is one frozen
:class:`~hybridrec.parallel.layout.EmbeddingLayout` (``self.layout``), which the cost
model reads too. The pieces of one step:

- input_dist (:mod:`hybridrec.parallel.input_dist`): counts (tiny), then lengths+ids in
  one int64 buffer; :meth:`start_input_dist` returns the handle the forward waits on.
- lookup: this rank's own :class:`EmbeddingBagCollection` over its shards (``self.local``).
- output_dist (:mod:`hybridrec.parallel.coded_dist`): the pooled partials forward and
  their gradients backward, float32 or through codecs (``codecs={table: codec}``), or
  bf16 (``wire_dtype``, below). The
  row-wise reduce-scatter is this all-to-all of partials followed by a local sum (the
  same bytes per rank as a reduce-scatter, and one collective carries every table); its
  backward sends every row shard the pooled gradient (the all-gather).
- table_row_wise (:mod:`hybridrec.parallel.host_reduce`): the same input_dist and lookup
  as row-wise, but the shards' partials are summed inside the host first (a reduce-scatter
  over ``topo.host_group``), and only the sums travel on, in the same output all-to-all,
  from the member that serves the samples' rank: one vector per sample and feature crosses
  hosts instead of one per shard. Backward: that hop's gradients, then an all-gather
  inside the host.

The helpers that move bytes record them in the ledger; every training forward also
tells the ledger its predicted bytes (:func:`~hybridrec.parallel.cost_model.step_bytes`
from the layout, the step's batch sizes and id counts), so the two are compared step
by step. Inside ``ledger.suspended()`` (evaluation) neither is recorded.

Data-parallel tables are replicated (``self.replicated``): looked up locally; their row
gradients are summed over ranks by :meth:`reduce_sparse_grads`, an explicit collective,
before the (identical) sparse update on every rank.

bf16 on the wire (``wire_dtype=torch.bfloat16``, what ``train.precision=bf16`` passes):
the dense arches compute in bf16 and cast the pooled embeddings to it first, so the
owners cast their blocks before the all-to-all instead (half the bytes, and the output is
assembled in bf16); the gradients come back in bf16, which they already were. Taken only
where the receiver just places the values (no codecs or threshold, no row-wise partials
to add, no FM pieces, no mean pooling): there, what the dense arches see is bit for bit
what they see with float32 on the wire (with a world size that is not a power of two the
gradients' ``1/world`` scale rounds once more, in bf16). Elsewhere ``self.wire_dtype`` is
None and the hop stays float32.

Gradient scale: each rank's loss is a mean over its local batch, so gradients
reaching a shard owner are divided by the world size: N ranks compute what one
process computes with the global batch.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.distributed as dist
from torch import nn

from hybridrec.comm.codecs import Codec
from hybridrec.comm.ddp_hooks import CompressedAllReduce
from hybridrec.comm.ledger import CommLedger, ring_allreduce_bytes, tensor_nbytes
from hybridrec.model.embedding import (
    EmbeddingBagCollection,
    KeyedTensor,
    TableConfig,
    init_table_block,
)
from hybridrec.parallel.coded_dist import Pending, output_all_to_all_start
from hybridrec.parallel.cost_model import dp_allreduce_bytes, step_bytes
from hybridrec.parallel.grad_scale import scale_grad
from hybridrec.parallel.host_reduce import host_reduce
from hybridrec.parallel.input_dist import OwnerInput, PendingInput, start_input_dist
from hybridrec.parallel.layout import EmbeddingLayout, Slot, build_layout, local_tables
from hybridrec.parallel.plan import Shard, ShardingPlan
from hybridrec.parallel.threshold_dist import ThresholdMP
from hybridrec.parallel.topology import Topology
from hybridrec.sparse.keyed_jagged import KeyedJagged

__all__ = ["OwnerInput", "PendingInput", "ShardedEmbeddingBagCollection"]

RowGrads = list[tuple[int, torch.Tensor, torch.Tensor, bool]]
"""``[(group, ids [n], rows [n, dim], unique)]``, as :meth:`EmbeddingBagCollection.pop_sparse_grads`."""


def _shard_collection(slots: tuple[Slot, ...], tables: Mapping[str, TableConfig],
                      seed: int, **kwargs) -> EmbeddingBagCollection | None:
    """The lookup of one rank's shards (one local table ``table@i`` per shard)."""
    if not slots:
        return None
    shard_of = {s.shard_table: s for s in slots}

    def init(shard_table: TableConfig, weight: torch.Tensor) -> None:
        # A shard holds exactly the values of its block of the whole table.
        s = shard_of[shard_table.name]
        init_table_block(tables[s.table], seed, s.shard.rows, s.shard.cols, out=weight)

    return EmbeddingBagCollection(local_tables(slots, tables), seed=seed, init=init, **kwargs)


def _check_hosts(layout: EmbeddingLayout, topo: Topology) -> None:
    """table_row_wise sums over ``topo.host_group``: the plan's host groups must be the
    topology's."""
    if not any(layout.has_trw(h) for h in range(layout.num_hosts)):
        return
    if topo.local_world_size != layout.local_world_size:
        raise ValueError(f"the plan's table_row_wise tables are for host groups of {layout.local_world_size} "
                         f"ranks, the topology's host groups have {topo.local_world_size}")
    if layout.local_world_size > 1 and topo.host_group is None:
        raise ValueError("table_row_wise tables need the topology's host group (topo.host_group is None)")


SHARDS = "shards"
"""The name of a rank's own shards among its row gradients and sparse optimizers."""
REPLICATED = "replicated"
"""The name of a rank's replicated (data-parallel) tables among them."""


class ShardedEmbeddingBagCollection(nn.Module):
    """Drop-in for :class:`EmbeddingBagCollection` across ranks (same output layout).

    ``forward(kjt, pending=None)`` takes this rank's local batch (``B`` samples) and
    returns its pooled embeddings ``[B, sum(feature_dims)]`` in the single-device
    collection's feature order (with FM tables also ``fm`` ``[B, 2 + k]``, see
    :mod:`hybridrec.model.deepfm`).

    ``codecs`` maps table names to the codec of their output_dist hop (both
    directions, :mod:`hybridrec.parallel.coded_dist`); tables not in it, and all
    tables when it is empty, travel as float32 exactly as without codecs.

    The training step's API: :meth:`start_input_dist` (optional, ahead of time),
    ``forward``, backward, :meth:`pop_sparse_grads` (local, no communication), then
    :meth:`reduce_sparse_grads` (the replicated tables' all-reduce, every rank, every step).
    """

    def __init__(self, tables: list[TableConfig], plan: ShardingPlan, topo: Topology, *,
                 seed: int = 0, ledger: CommLedger | None = None,
                 codecs: Mapping[str, Codec] | None = None, threshold: ThresholdMP | None = None,
                 dp_reducer: CompressedAllReduce | None = None,
                 wire_dtype: torch.dtype | None = None, weight_dtype: torch.dtype = torch.float32,
                 init_values: bool | None = True, coded_chunks: int = 1) -> None:
        """``init_values`` False: the tables start as zeros, for a checkpoint to overwrite
        (:meth:`reset_parameters` draws their initial values if none does); None: this
        rank's shards as allocated, untouched (given other memory by the caller, see
        :mod:`hybridrec.train.checkpointing.resident`), the replicated tables as zeros.
        ``coded_chunks``: the coded hop's row chunks (1: one exchange; 0: by its size,
        :func:`~hybridrec.parallel.coded_dist.coded_chunks`)."""
        super().__init__()
        if plan.world_size != topo.group_size:
            raise ValueError(f"plan is for {plan.world_size} ranks, the world has {topo.group_size}")
        self.topo, self.plan, self.ledger, self.seed = topo, plan, ledger, seed
        self.tables = {t.name: t for t in tables}
        self.codecs = dict(codecs or {})
        if threshold is not None and self.codecs:
            raise ValueError("a threshold hop codes every table: give codecs or a threshold, not both")
        self.threshold = threshold  # DCT-MP with a threshold (parallel/threshold_dist.py)
        self.coded_chunks = coded_chunks  # the coded hop's row chunks (compress.embedding_chunks)
        self.compression: dict | None = None  # compress.embedding_when=pays: what was measured
        # Replicated tables' gradients through a sparsifying compressor instead of the dense
        # all-reduce (compress.dense_replicated); its state is per rank (checkpointed by the run).
        self.dp_reducer = dp_reducer
        self.layout: EmbeddingLayout = build_layout(tables, plan, self.codecs)
        if threshold is not None and (any(b.width for b in self.layout.host_blocks)
                                      or any(b.has_fm for b in self.layout.blocks)):
            raise ValueError("the threshold hop takes no table_row_wise tables and no FM pieces")
        _check_hosts(self.layout, topo)
        self.wire_dtype = wire_dtype if wire_dtype not in (None, torch.float32) and self._places_only() else None
        # bf16 tables pool into the wire's dtype directly (no float32 copy between)
        dtypes = {"weight_dtype": weight_dtype,
                  "output_dtype": self.wire_dtype if weight_dtype != torch.float32 and self.wire_dtype else torch.float32}
        self.local = _shard_collection(self.layout.slots[topo.rank], self.tables, seed, init_values=init_values,
                                       **dtypes)
        dp = [self.tables[n] for n in self.layout.replicated_tables]
        self.replicated = EmbeddingBagCollection(dp, seed=seed, init_values=bool(init_values), **dtypes) if dp else None

    def drop_codecs(self) -> None:
        """The hop uncompressed from now on (``compress.embedding_when=pays`` measured that
        compressing does not pay); before the first step, on every rank alike."""
        self.codecs = {}
        self.layout = build_layout(list(self.tables.values()), self.plan, self.codecs)

    def reset_parameters(self) -> None:
        """This rank's shards and replicas: their initial values (those of the whole tables)."""
        for part in (self.local, self.replicated):
            if part is not None:
                part.reset_parameters()

    def _places_only(self) -> bool:
        """Whether the receiver only places the blocks' values (nothing added, scaled or
        coded on the way): the condition for a low-precision wire (module docstring)."""
        layout = self.layout
        return (not self.codecs and self.threshold is None and not any(layout.row_split)
                and not layout.mean_features
                and not any(b.has_fm for b in (*layout.blocks, *layout.host_blocks)))

    @property
    def feature_names(self) -> list[str]:
        return list(self.layout.feature_names)

    @property
    def feature_dims(self) -> list[int]:
        """Dims of the output features (FM tables: ``k``, the first-order column stays home)."""
        return list(self.layout.feature_dims)

    # -- input_dist ------------------------------------------------------------
    def start_input_dist(self, kjt: KeyedJagged) -> PendingInput:
        """Send every slot's ids of ``kjt`` to their owners: the counts now, the ids
        asynchronously. Pass the handle to :meth:`forward` of the same ``kjt``. Every
        rank must start the same input_dists in the same order. With replicated tables
        only, nothing travels and the handle is idle."""
        if not self.layout.has_shards:
            return PendingInput.idle(self.layout, self.topo.rank, kjt.batch_size)
        return start_input_dist(kjt, self.layout, self.topo, self.ledger)

    def input_dist(self, kjt: KeyedJagged) -> OwnerInput:
        """:meth:`start_input_dist` and wait: the owner-side batch of this rank's slots."""
        return self.start_input_dist(kjt).wait()

    # -- lookup + output_dist ----------------------------------------------------
    def forward(self, kjt: KeyedJagged, pending: PendingInput | None = None) -> KeyedTensor:
        """``kjt``: this rank's batch of ``B`` samples; ``pending``: its input_dist already
        under way (:meth:`start_input_dist`), or None to run it now."""
        return self.start_forward(kjt, pending).wait()

    def start_forward(self, kjt: KeyedJagged, pending: PendingInput | None = None) -> Pending:
        """:meth:`forward` with its output exchange under way: ``wait()`` gives the
        :class:`KeyedTensor`. Work that does not need it (the DLRM's bottom MLP) runs
        between the two while the pooled rows travel, and in backward while their
        gradients travel back (:func:`~hybridrec.parallel.coded_dist.output_all_to_all_start`)."""
        layout, world, b = self.layout, self.topo.group_size, kjt.batch_size
        if pending is not None and pending.local_batch != b:
            raise ValueError(f"the pending input_dist is of a batch of {pending.local_batch}, not {b}")
        exchange = None
        if layout.has_shards:
            owner = pending.wait() if pending is not None else self.input_dist(kjt)
            exchange = self._sharded_blocks(owner)
        if self.replicated is not None:  # (looked up while the exchange travels)
            local = self.replicated(kjt.select_keys(self.replicated.feature_names))
            replicated = layout.replicated.encode(local)
        else:
            replicated = torch.empty(b, 0, device=self.topo.device)
        if self.wire_dtype is not None:  # the output is assembled in the wire's dtype
            replicated = replicated.to(self.wire_dtype)

        def finish() -> KeyedTensor:
            if exchange is not None:
                blocks, hosts = exchange.wait()
            else:  # replicated tables only: nothing is distributed
                none = torch.empty(b, 0, device=self.topo.device)
                blocks, hosts = [none] * world, [none] * layout.num_hosts
            return self._output([*blocks, replicated, *hosts], kjt)

        return Pending(finish)

    def _output(self, blocks: list[torch.Tensor], kjt: KeyedJagged) -> KeyedTensor:
        """Every block ``[B, W_d]`` (``layout.all_blocks``) -> this rank's output, gradients
        scaled by 1/world: the blocks as they came, with their features' order, where every
        feature is one whole piece (``layout.block_order``), else assembled (:meth:`_combine`)."""
        layout, world, b = self.layout, self.topo.group_size, kjt.batch_size
        if layout.block_order is not None:  # whole features: left as they came (no copy)
            d = layout.feature_dims[0]
            parts = [scale_grad(x, 1.0 / world).unflatten(1, (-1, d))
                     for x, blk in zip(blocks, layout.all_blocks) if blk.width]
            return KeyedTensor(self.feature_names, self.feature_dims, parts=parts, order=layout.block_order)
        out, fm = self._combine(blocks, b)
        out = scale_grad(out, 1.0 / world)
        if fm is not None:
            fm = scale_grad(fm, 1.0 / world)
        if layout.mean_features:
            out = self._apply_mean(out, kjt)
        return KeyedTensor(self.feature_names, self.feature_dims, out, fm=fm)

    def _sharded_blocks(self, owner: OwnerInput) -> Pending:
        """Lookup, the in-host sum of TRW partials, output_dist under way: its ``wait()``
        gives every owner's block for this rank's samples, ``[B, W_d]``, and every host's TRW
        block, ``[B, W_h]``."""
        layout, rank, sizes = self.layout, self.topo.rank, list(owner.batch_sizes)
        reduced = None  # this rank's in-host TRW sums (none without TRW tables on its host)
        if self.local is not None:
            kt = self.local(owner.kjt)
            pooled = layout.blocks[rank].encode(kt)
            if layout.served(rank):  # every member of the host joins the in-host sum
                reduced = host_reduce(layout.trw_blocks[rank].encode(kt), layout, sizes, self.topo,
                                      self.ledger)
        else:  # still joins the collectives, forward and backward
            pooled = torch.zeros(sum(sizes), 0, device=self.topo.device,
                                 requires_grad=self.training and torch.is_grad_enabled())
        reduced = pooled.new_zeros(0, 0) if reduced is None else reduced
        if self.wire_dtype is not None:  # cast where the dense arches would (module docstring)
            pooled, reduced = pooled.to(self.wire_dtype), reduced.to(self.wire_dtype)
        exchange = output_all_to_all_start(pooled, reduced, layout, sizes, self.topo, self.ledger,
                                           threshold=self.threshold, training=self.training,
                                           chunks=self.coded_chunks)
        if self.ledger is not None:  # the formula's bytes of this step, beside the counted ones
            pred = step_bytes(layout, rank, list(owner.batch_sizes), owner.ids,
                              backward=pooled.requires_grad)
            item = pooled.element_size()  # the layout counts float32 values
            for (category, table, direction), (sent, received) in pred.items():
                if self.threshold is not None and category == "output_dist":
                    continue  # the threshold's bytes depend on the activations: not predicted
                if category == "output_dist":
                    sent, received = sent * item // 4, received * item // 4
                self.ledger.predict(category, table=table, direction=direction, sent=sent, received=received)
        return exchange

    def _combine(self, blocks: list[torch.Tensor], b: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Every block ``[B, W_d]`` (owners, the replicated tables, then the hosts' TRW
        sums: ``layout.all_blocks``) -> ``[B, sum(dims)]`` and, with FM tables,
        ``[B, 2 + k]`` = ``[z, q, s]``: row shards' partials are added,
        column shards' placed side by side, the FM pieces' ``[z_p, q_p]`` and every block's
        ``s_d`` added up in block order. One split per block and one concatenation, so
        backward is one concatenation per block (no per-slice zero-filled grads)."""
        layout = self.layout
        split = [torch.split(x, list(blk.widths), dim=1) if blk.pieces else ()
                 for x, blk in zip(blocks, layout.all_blocks)]
        out = []
        for pieces, row_split in zip(layout.assembly, layout.row_split):
            parts = [split[d][j] for d, j, _ in pieces]
            if row_split:
                total = parts[0]
                for p in parts[1:]:
                    total = total + p
                out.append(total)
            else:
                out.extend(parts)
        zq = s = None
        for parts, blk in zip(split, layout.all_blocks):
            if blk.has_fm:
                fm = parts[-1]
                s_d = fm[:, 2:] if blk.s_at_owner else blk.fm_sum(parts[:-1], b)
                zq = fm[:, :2] if zq is None else zq + fm[:, :2]
                s = s_d if s is None else s + s_d
        return torch.cat(out, dim=1), None if zq is None else torch.cat([zq, s], dim=1)

    def _apply_mean(self, out: torch.Tensor, kjt: KeyedJagged) -> torch.Tensor:
        """Shards pool by sum (partial means would not add up): divide by the bag sizes."""
        layout, parts = self.layout, kjt.split_by_key()
        scale = torch.ones_like(out[:1]).expand(out.shape[0], -1).clone()
        for i in layout.mean_features:
            n = parts[layout.feature_names[i]][1].clamp(min=1).to(out.dtype).unsqueeze(1)
            c = layout.feature_cols[i]
            scale[:, c : c + layout.feature_dims[i]] = 1.0 / n
        return out * scale

    # -- row gradients ------------------------------------------------------------
    def pop_sparse_grads(self) -> dict[str, RowGrads]:
        """This rank's row gradients of the lookups since the last call, no communication:
        ``{"shards": ..., "replicated": ...}`` (only the collections that exist). The
        replicated rows are this rank's own, not yet summed over ranks."""
        out = {}
        if self.local is not None:
            out[SHARDS] = self.local.pop_sparse_grads()
        if self.replicated is not None:
            out[REPLICATED] = self.replicated.pop_sparse_grads()
        return out

    def reduce_sparse_grads(self, grads: dict[str, RowGrads]) -> dict[str, RowGrads]:
        """``grads`` with ``"replicated"`` summed over ranks: per fused group a dense
        ``[rows, dim + 1]`` all-reduce (the last column counts touched rows, so lazy
        optimizers see exactly the rows the global batch touched), then the touched rows,
        ``unique=True``. Summed, not averaged: the forward already scaled these gradients
        by 1/world. A collective: every rank calls it every step (it runs with no rows
        too); without replicated tables it returns ``grads``.

        With ``dp_reducer`` (``compress.dense_replicated`` with a sparsifying
        ``compress.dense``): per group the ``[rows, dim]`` gradient is compressed (error
        feedback keyed ``replicated.<group>``) and the ranks' sparse messages are summed; the
        touched rows are those with a nonzero entry in the sum (a row held back in a residual
        is updated at the step it is sent; ``eta = 1`` gives the rows of the dense path, but
        for rows whose gradient is exactly 0). Ledger: ``dp_table_allreduce``, ``original``
        the dense ``[rows, dim + 1]`` all-reduce it replaces."""
        rep = self.replicated
        if rep is None:
            return grads
        entries: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {g: [] for g in range(rep.num_groups)}
        for group, ids, rows, _ in grads.get(REPLICATED, []):
            entries[group].append((ids, rows))
        reduced = []
        if self.dp_reducer is not None:
            for group, parts in entries.items():
                weight = rep.group_weight(group)
                dense = weight.new_zeros(weight.shape, dtype=torch.float32)  # (gradients: float32)
                for ids, rows in parts:
                    dense.index_add_(0, ids, rows)
                # original: the dense [rows, dim + 1] all-reduce this exchange replaces.
                plain = ring_allreduce_bytes(dense.shape[0] * (dense.shape[1] + 1) * dense.element_size(),
                                             self.topo.group_size)
                total = self.dp_reducer.sum_sparse(self.topo.group, f"replicated.{group}",
                                                   dense.reshape(-1), original=plain).view_as(dense)
                # Touched: rows with a nonzero entry in the sum (rows held back in the residual
                # are updated at a later step, when they are sent).
                touched = total.ne(0).any(1).nonzero().squeeze(1)
                reduced.append((group, touched, total[touched], True))
            return {**grads, REPLICATED: reduced}
        for group, parts in entries.items():
            weight = rep.group_weight(group)
            d = weight.shape[1]
            dense = weight.new_zeros(weight.shape[0], d + 1, dtype=torch.float32)  # (bf16 tables too)
            for ids, rows in parts:
                dense[:, :d].index_add_(0, ids, rows)
                dense[:, d].index_add_(0, ids, torch.ones_like(ids, dtype=rows.dtype))
            dist.all_reduce(dense, group=self.topo.group)
            if self.ledger is not None:
                ring = ring_allreduce_bytes(tensor_nbytes(dense), self.topo.group_size)
                self.ledger.record("dp_table_allreduce", sent=ring, received=ring, direction="bwd")
            touched = dense[:, d].nonzero().squeeze(1)
            reduced.append((group, touched, dense[touched, :d], True))
        if self.ledger is not None:  # the formula's bytes, from the layout
            for ring in dp_allreduce_bytes(self.layout):
                self.ledger.predict("dp_table_allreduce", sent=ring, received=ring, direction="bwd")
        return {**grads, REPLICATED: reduced}

    # -- optimizer and state plumbing ------------------------------------------------
    # -- the EmbeddingCollection interface (hybridrec.model.embedding) -------------
    spans_ranks = True
    holds_tables = True

    def step_grads(self) -> dict[str, RowGrads]:
        """This rank's row gradients, the replicated tables' all-reduced (a collective
        every rank runs every step)."""
        return self.reduce_sparse_grads(self.pop_sparse_grads())

    def updated_collections(self) -> dict[str, EmbeddingBagCollection]:
        return {k: c for k, c in ((SHARDS, self.local), (REPLICATED, self.replicated)) if c is not None}

    def local_weights(self) -> dict[str, torch.Tensor]:
        return {k: w for k, (_, w) in self.local_shards().items()}

    def shard_of(self, local_name: str) -> tuple[Shard, list[Shard]] | None:
        base, _, idx = local_name.partition("@")
        if idx in ("", "*"):
            return None
        shards = list(self.layout.table_shards(base))
        return shards[int(idx)], shards

    def plan_dict(self) -> dict:
        return self.plan.to_dict()

    def local_shards(self) -> dict[str, tuple[Shard, torch.Tensor]]:
        """``{"table@i": (shard, weight)}`` of the shards held here (replicated: ``table@*``)."""
        out = {}
        if self.local is not None:
            for s in {s.shard_table: s for s in self.layout.slots[self.topo.rank]}.values():
                out[s.shard_table] = (s.shard, self.local.table_weight(s.shard_table))
        if self.replicated is not None:
            for name, t in self.replicated.tables.items():
                out[f"{name}@*"] = (Shard(self.topo.rank, (0, t.num_embeddings), (0, t.embedding_dim)),
                                    self.replicated.table_weight(name))
        return out
