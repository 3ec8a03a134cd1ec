"""What a sharding plan costs per training step: bytes on the wire, memory, lookups.

Pure arithmetic; no processes. The bytes come from the collection's
:class:`~hybridrec.parallel.layout.EmbeddingLayout` (the same object the mechanism
runs, built by :func:`~hybridrec.parallel.layout.build_layout`): its slots, its pieces
and their bytes per row. :func:`step_bytes` is one step of one rank, from the step's
batch sizes and id counts; the sharded collection calls it every training step and
tells the ledger (:meth:`CommLedger.predict`), so predicted and counted bytes are
compared step by step. :func:`predict_step_bytes` / :func:`predict_all_ranks` are the
static expectation for the planner and ``hybridrec plan`` (ids from a mean pooling
factor). A *slot* is (feature, shard of its table); for a slot on owner ``o`` and every
source rank ``r`` with local batch ``b_r`` and ``ids_r`` ids for the slot:

- ``input_dist`` fwd: ``r`` sends ``o`` the slot's bag lengths and ids, int32 (int64 when
  a sharded table has more than 2^31 rows, ``layout.id_dtype``): ``(b_r + ids_r) * 4``
  bytes (row shards: only the ids in the shard's row range).
- ``output_dist`` fwd: ``o`` sends ``r`` every piece of its block: ``b_r * piece.fwd_bytes``;
  bwd: ``r`` sends ``o`` their gradients, ``b_r * piece.bwd_bytes`` (float32: ``4 * width``;
  with a codec, :mod:`hybridrec.comm.codecs`, its fixed bytes per row). DeepFM's FM piece
  (``[z_p, q_p]``, and ``s_p`` when coded) belongs to no table. table_row_wise tables:
  the member ``o`` of their host with ``o % L == r % L`` sends ``r`` the pieces of the
  host's TRW block (the in-host sums), ``b_r * piece.fwd_bytes`` once per host instead of
  once per shard (``L`` = ``local_world_size``); between hosts only.
- ``trw_intra`` fwd, inside a host with table_row_wise tables: member ``j`` sends member
  ``k`` the float32 partials of the samples ``k`` serves, ``rows_k * 4 * width`` per piece
  (``rows_k`` = the local batches of the ranks ``d % L == k``); bwd: ``k`` sends ``j`` their
  gradients, the same bytes (the reduce-scatter, then the all-gather).
- ``input_dist_counts`` fwd: every rank sends every other rank two int64 counts.
- ``dense_allreduce`` bwd: per DDP bucket of ``n`` bytes, ``2 (W-1) n // W`` bytes
  sent and received (a ring all-reduce).
- ``dp_table_allreduce`` bwd: per fused group of data-parallel tables (same dim
  and pooling), a dense ``[rows, dim + 1]`` float32 all-reduce, counted as a ring.

Bytes a rank sends to itself are not counted. Static row-wise assumption: the ids of
a bag are spread over the table's rows uniformly, so a row shard receives its
share ``shard_rows / table_rows`` of them; exact when a batch's ids are spread that
way, an expectation otherwise (the per-step prediction uses the real counts).

Worked example, one table-wise table of dim 4 on rank 1, one-hot, 2 ranks with
local batch 3: rank 0 sends rank 1 ``(3 + 3) * 4 = 24`` input bytes and gets back
``3 * 4 * 4 = 48`` output bytes forward; it sends ``48`` gradient bytes backward.
The same table table_row_wise on host 0 of 4 ranks in hosts of 2, local batch 3: rank
0 sends rank 1 the partials of ranks 1 and 3 (``trw_intra``, ``6 * 16 = 96`` bytes) and
rank 2 the sums of its samples (``output_dist``, ``3 * 16 = 48``); row_wise over ranks 0
and 1 would send rank 2 and rank 3 ``48`` bytes from each of ranks 0 and 1 (192 bytes
across hosts forward instead of 96).
"""

from __future__ import annotations

from collections.abc import Collection, Iterator, Mapping

from hybridrec.comm.codecs import Codec
from hybridrec.comm.ledger import ring_allreduce_bytes
from hybridrec.model.embedding import TableConfig
from hybridrec.parallel.layout import ROW_SPLIT, EmbeddingLayout, build_layout
from hybridrec.parallel.plan import Shard, ShardingPlan, TablePlan

COUNT_BYTES = 16
"""input_dist's counts: two int64 per rank pair. Its bag lengths and ids travel as
``layout.id_dtype`` (int32 unless a sharded table has more than 2^31 rows)."""
VALUE_BYTES = 4
"""Weights, pooled partials and their gradients are float32."""

OPTIMIZERS = ("sgd", "rowwise_adagrad", "lazy_adam")

Key = tuple[str, str]
"""``(category, direction)`` of a ledger counter."""
TableKey = tuple[str, str | None, str]
"""``(category, table, direction)``: a ledger entry."""
IdCounts = Mapping[tuple[int, int, int], float]
"""``{(source rank, owner rank, slot position on the owner): ids}`` of one step."""
Flow = tuple[int, int, str, str | None, str, float]
"""``(src, dst, category, table, direction, bytes)``: one piece of an all-to-all."""


# -- memory --------------------------------------------------------------------
def optimizer_state_bytes(optimizer: str, rows: int, cols: int) -> int:
    """Sparse optimizer state of a ``rows x cols`` shard (hybridrec.train.loop.sparse_optim)."""
    if optimizer == "sgd":
        return 0
    if optimizer == "rowwise_adagrad":
        return rows * VALUE_BYTES  # one accumulator per row
    if optimizer == "lazy_adam":
        return 2 * rows * cols * VALUE_BYTES  # exp_avg and exp_avg_sq, like the weights
    raise ValueError(f"unknown optimizer {optimizer!r}; choose from {OPTIMIZERS}")


def shard_memory_bytes(shard: Shard, optimizer: str, weight_bytes: int = VALUE_BYTES) -> int:
    """Weights (``weight_bytes`` per value: 2 for bf16 tables) plus optimizer state (float32)
    of one shard (activations and buffers not counted)."""
    return shard.num_rows * shard.num_cols * weight_bytes + optimizer_state_bytes(
        optimizer, shard.num_rows, shard.num_cols)


def memory_by_rank(plan: ShardingPlan, optimizer: str, weight_bytes: int = VALUE_BYTES) -> list[int]:
    """Embedding bytes every rank holds under ``plan`` (weights + optimizer state)."""
    out = [0] * plan.world_size
    for tp in plan.tables.values():
        for s in tp.shards:
            out[s.rank] += shard_memory_bytes(s, optimizer, weight_bytes)
    return out


# -- traffic -------------------------------------------------------------------
def ids_per_sample(tables: list[TableConfig], stats: Mapping | None) -> dict[str, float]:
    """Pooling factor per feature from a dataset's stats (``mean_ids_per_sample``), default 1."""
    stats = stats or {}
    return {f: float(stats.get(f, {}).get("mean_ids_per_sample", 1.0))
            for t in tables for f in t.features}


def _ids_map(tables: list[TableConfig],
             ids_per_bag: Mapping[str, float] | float) -> dict[str, float]:
    if isinstance(ids_per_bag, Mapping):
        return {f: float(ids_per_bag.get(f, 1.0)) for t in tables for f in t.features}
    return {f: float(ids_per_bag) for t in tables for f in t.features}


def expected_ids(layout: EmbeddingLayout, batch_sizes: list[int],
                 ids_per_bag: Mapping[str, float]) -> dict[tuple[int, int, int], float]:
    """Static :data:`IdCounts`: ``b_src * ids_per_bag[feature]`` per slot, row shards their
    share of the rows."""
    out = {}
    for o, slots in enumerate(layout.slots):
        for j, s in enumerate(slots):
            share = s.shard.num_rows / s.table_rows if s.row_split else 1.0
            for src, b in enumerate(batch_sizes):
                out[(src, o, j)] = b * ids_per_bag.get(s.feature, 1.0) * share
    return out


def flows(layout: EmbeddingLayout, batch_sizes: list[int], ids: IdCounts, *,
          rank: int | None = None, backward: bool = True) -> Iterator[Flow]:
    """Every all-to-all piece of one step between two different ranks (``rank``: only
    those it sends or receives; ``backward``: include the output_dist's and the in-host
    reduce's backward). Nothing without sharded tables (no input or output distribution
    runs)."""
    if not layout.has_shards:
        return
    item = layout.id_dtype.itemsize
    for src, b in enumerate(batch_sizes):
        for o in range(layout.world_size):
            if src == o or (rank is not None and rank not in (src, o)):
                continue
            yield src, o, "input_dist_counts", None, "fwd", COUNT_BYTES
            for j, s in enumerate(layout.slots[o]):
                yield src, o, "input_dist", s.table, "fwd", (b + ids[(src, o, j)]) * item
            for i in layout.segments(o, src):
                for p in layout.all_blocks[i].pieces:
                    yield o, src, "output_dist", p.table, "fwd", b * p.fwd_bytes
                    if backward:
                        yield src, o, "output_dist", p.table, "bwd", b * p.bwd_bytes
    yield from _host_flows(layout, batch_sizes, rank=rank, backward=backward)


def _host_flows(layout: EmbeddingLayout, batch_sizes: list[int], *, rank: int | None,
                backward: bool) -> Iterator[Flow]:
    """``trw_intra``: inside every host with table_row_wise tables, member ``j`` sends
    member ``k`` the float32 partials of the samples ``k`` serves (fwd), ``k`` sends ``j``
    their gradients (bwd)."""
    lw = layout.local_world_size
    rows = [sum(batch_sizes[d] for d in range(k, layout.world_size, lw)) for k in range(lw)]
    for h in range(layout.num_hosts):
        if not layout.has_trw(h):
            continue
        pieces = layout.host_blocks[h].pieces
        for j in range(lw):
            for k in range(lw):
                src, dst = h * lw + j, h * lw + k
                if j == k or (rank is not None and rank not in (src, dst)):
                    continue
                for p in pieces:
                    yield src, dst, "trw_intra", p.table, "fwd", rows[k] * p.orig_bytes
                    if backward:
                        yield dst, src, "trw_intra", p.table, "bwd", rows[k] * p.orig_bytes


def cross_host_bytes(plan: ShardingPlan, tables: list[TableConfig], *, batch_sizes: list[int],
                     ids_per_bag: Mapping[str, float] | float = 1.0,
                     codecs: Mapping[str, Codec] | None = None,
                     categories: Collection[str] | None = None) -> list[tuple[int, int]]:
    """``(sent, received)`` bytes per rank, both directions, of the input and output
    distribution (``categories``: only those) that go between ranks of different host
    groups (``plan.local_world_size``): the static expectation, as
    :func:`predict_all_ranks`. What a rank moves inside its host is the rest
    (``trw_intra`` never leaves it)."""
    layout = build_layout(tables, plan, codecs)
    ids = expected_ids(layout, batch_sizes, _ids_map(tables, ids_per_bag))
    lw, acc = plan.local_world_size, [[0.0, 0.0] for _ in range(plan.world_size)]
    for src, dst, category, _table, _direction, nbytes in flows(layout, batch_sizes, ids):
        if src // lw != dst // lw and (categories is None or category in categories):
            acc[src][0] += nbytes
            acc[dst][1] += nbytes
    return [(round(s), round(r)) for s, r in acc]


def step_bytes(layout: EmbeddingLayout, rank: int, batch_sizes: list[int], ids: IdCounts, *,
               backward: bool = True) -> dict[TableKey, tuple[float, float]]:
    """``{(category, table, direction): (sent, received)}`` of ``rank`` in one step of
    input_dist and output_dist; ``ids`` needs only the pairs ``rank`` is part of."""
    out: dict[TableKey, list[float]] = {}
    for src, dst, category, table, direction, n in flows(layout, batch_sizes, ids, rank=rank,
                                                          backward=backward):
        acc = out.setdefault((category, table, direction), [0, 0])
        acc[0 if src == rank else 1] += n
    return {k: (s, r) for k, (s, r) in out.items()}


def dp_allreduce_bytes(layout: EmbeddingLayout) -> list[int]:
    """Ring bytes per fused group of data-parallel tables: a dense ``[rows, dim + 1]``
    float32 tensor (the last column counts touched rows) per group and step."""
    return [ring_allreduce_bytes(rows * (dim + 1) * VALUE_BYTES, layout.world_size)
            for rows, dim in layout.dp_groups]


def predict_all_ranks(plan: ShardingPlan, tables: list[TableConfig], *, batch_sizes: list[int],
                      ids_per_bag: Mapping[str, float] | float = 1.0,
                      dense_param_bytes: list[int] = (),
                      codecs: Mapping[str, Codec] | None = None,
                      ) -> list[dict[Key, tuple[int, int]]]:
    """:func:`predict_step_bytes` of every rank."""
    world = plan.world_size
    if len(batch_sizes) != world:
        raise ValueError(f"batch_sizes has {len(batch_sizes)} entries, the plan {world} ranks")
    layout = build_layout(tables, plan, codecs)
    ids = expected_ids(layout, batch_sizes, _ids_map(tables, ids_per_bag))
    # With only replicated tables the mechanism runs no input/output distribution at all.
    keys = [("input_dist_counts", "fwd"), ("input_dist", "fwd"), ("output_dist", "fwd"),
            ("output_dist", "bwd")]
    acc: list[dict[Key, list[float]]] = [{k: [0, 0] for k in keys} if layout.has_shards else {}
                                         for _ in range(world)]
    lw = layout.local_world_size
    if lw > 1 and any(layout.has_trw(h) for h in range(layout.num_hosts)):
        for a in acc:  # the same keys on every rank: (0, 0) on hosts without TRW tables
            a.update({("trw_intra", "fwd"): [0, 0], ("trw_intra", "bwd"): [0, 0]})
    for src, dst, category, _table, direction, nbytes in flows(layout, batch_sizes, ids):
        acc[src][(category, direction)][0] += nbytes
        acc[dst][(category, direction)][1] += nbytes
    if world > 1 and dense_param_bytes:  # DDP wraps the dense arches only with several ranks
        ring = sum(ring_allreduce_bytes(n, world) for n in dense_param_bytes)
        for a in acc:
            a[("dense_allreduce", "bwd")] = [ring, ring]
    if layout.dp_groups:
        ring = sum(dp_allreduce_bytes(layout))
        for a in acc:
            a[("dp_table_allreduce", "bwd")] = [ring, ring]
    # Sums of integer-valued floats are exact; round fractional expectations once.
    return [{k: (round(s), round(r)) for k, (s, r) in a.items()} for a in acc]


def predict_step_bytes(plan: ShardingPlan, tables: list[TableConfig], *, rank: int,
                       batch_sizes: list[int], ids_per_bag: Mapping[str, float] | float = 1.0,
                       world_size: int | None = None, dense_param_bytes: list[int] = (),
                       codecs: Mapping[str, Codec] | None = None) -> dict[Key, tuple[int, int]]:
    """Bytes ``rank`` is expected to send and receive in one training step, per
    (category, direction): the static expectation (the planner, ``hybridrec plan``).

    Args:
        plan: the sharding plan the mechanism runs.
        tables: the model's tables (their features name the KJT keys).
        rank: the rank whose ledger is predicted.
        batch_sizes: local batch size of every rank, in rank order.
        ids_per_bag: mean ids per bag, per feature (missing features: 1) or for all;
            exact when every rank's batch holds ``b_r * ids_per_bag`` ids of the feature
            (row shards: spread evenly over the rows).
        world_size: checked against the plan when given.
        dense_param_bytes: bytes of every dense all-reduce of a step: one entry per
            DDP bucket (a DDP module whose gradients fit in one bucket is one entry,
            e.g. ``[bottom_bytes, top_bytes]``). With 2 ranks (or when the world
            divides ``2 (W-1) n``) per-module entries are exact however DDP buckets.
        codecs: table -> codec of its output_dist hop, as given to the collection.

    Returns ``{(category, direction): (sent, received)}`` with the keys the
    mechanism records in a step: ``input_dist_counts``/``input_dist`` (fwd),
    ``output_dist`` (fwd, bwd), ``trw_intra`` (fwd, bwd; with table_row_wise tables in
    host groups of several ranks), ``dense_allreduce`` (bwd, when several ranks and
    ``dense_param_bytes``), ``dp_table_allreduce`` (bwd, when a table is data-parallel).
    Every rank gets the same keys; a rank that takes no part in one (``trw_intra`` on a
    host without table_row_wise tables) predicts ``(0, 0)`` and records nothing.
    """
    if world_size is not None and world_size != plan.world_size:
        raise ValueError(f"world_size {world_size} != the plan's {plan.world_size}")
    if not 0 <= rank < plan.world_size:
        raise ValueError(f"rank {rank} outside world of {plan.world_size}")
    return predict_all_ranks(plan, tables, batch_sizes=batch_sizes, ids_per_bag=ids_per_bag,
                             dense_param_bytes=dense_param_bytes, codecs=codecs)[rank]


# -- per-table loads, for the planner ------------------------------------------
def lookup_work(tp: TablePlan, table: TableConfig, batch_sizes: list[int],
                ids: Mapping[str, float]) -> list[float]:
    """Embedding values each rank gathers per step (ids x columns of its shards)."""
    world = len(batch_sizes)
    out = [0.0] * world
    if tp.sharding_type == "data_parallel":  # every rank looks up its own batch
        for r, b in enumerate(batch_sizes):
            out[r] += sum(b * ids[f] for f in table.features) * tp.embedding_dim
        return out
    total = sum(batch_sizes)
    for shard in tp.shards:
        share = shard.num_rows / tp.num_embeddings if tp.sharding_type in ROW_SPLIT else 1.0
        out[shard.rank] += sum(total * ids[f] * share for f in table.features) * shard.num_cols
    return out


def table_traffic(tp: TablePlan, table: TableConfig, batch_sizes: list[int],
                  ids: Mapping[str, float], *,
                  local_world_size: int | None = None) -> tuple[list[float], list[float]]:
    """``(sent, received)`` bytes per rank that one table adds to a step: the flows of
    a layout holding the table alone (its FM piece included; the per-step counts are not
    the table's; a table_row_wise table's ``trw_intra`` included).

    ``local_world_size``: ranks per host group; by default a table_row_wise table's host
    group is its ranks (one shard per member), other types do not depend on it.
    Data-parallel: the ring all-reduce of the table alone (fused groups differ
    only by integer rounding).
    """
    world = len(batch_sizes)
    sent, received = [0.0] * world, [0.0] * world
    if tp.sharding_type == "data_parallel":
        ring = 2 * (world - 1) * tp.num_embeddings * (tp.embedding_dim + 1) * VALUE_BYTES / world
        return [ring] * world, [ring] * world
    lw = local_world_size or (len(tp.shards) if tp.sharding_type == "table_row_wise" else world)
    plan = ShardingPlan(world_size=world, local_world_size=lw, tables={table.name: tp})
    layout = build_layout([table], plan)
    expected = expected_ids(layout, batch_sizes, ids)
    for src, dst, category, _t, _d, nbytes in flows(layout, batch_sizes, expected):
        if category != "input_dist_counts":
            sent[src] += nbytes
            received[dst] += nbytes
    return sent, received


def table_memory(tp: TablePlan, optimizer: str, world: int, weight_bytes: int = VALUE_BYTES) -> list[int]:
    """Bytes each rank holds for one table (weights + optimizer state)."""
    out = [0] * world
    for s in tp.shards:
        out[s.rank] += shard_memory_bytes(s, optimizer, weight_bytes)
    return out


# -- report --------------------------------------------------------------------
def describe_plan(plan: ShardingPlan, tables: list[TableConfig], *, batch_sizes: list[int],
                  ids_per_bag: Mapping[str, float] | float = 1.0, optimizer: str = "sgd",
                  dense_param_bytes: list[int] = (), weight_bytes: int = VALUE_BYTES) -> dict:
    """JSON-ready report: per rank memory, lookup work and predicted bytes per step
    (``"category/direction": {"sent", "received"}``); per table its sharding.

    Layout::

        {"world_size", "local_world_size", "batch_sizes", "optimizer",
         "ranks": [{"rank", "host", "memory_bytes", "lookup_values",
                    "bytes_per_step": {"output_dist/fwd": {"sent", "received"}, ...},
                    "sent_bytes", "received_bytes",
                    "cross_host_bytes": {"sent", "received"}}],  # embedding hops between hosts
         "tables": [{"table", "sharding_type", "rows", "dim", "ranks", "memory_bytes"}]}
    """
    ids = _ids_map(tables, ids_per_bag)
    pred = predict_all_ranks(plan, tables, batch_sizes=batch_sizes, ids_per_bag=ids,
                             dense_param_bytes=dense_param_bytes)
    memory = memory_by_rank(plan, optimizer, weight_bytes)
    work = [0.0] * plan.world_size
    for t in tables:
        for r, w in enumerate(lookup_work(plan.tables[t.name], t, batch_sizes, ids)):
            work[r] += w
    cross = cross_host_bytes(plan, tables, batch_sizes=batch_sizes, ids_per_bag=ids)
    ranks = []
    for r in range(plan.world_size):
        by_key = {f"{c}/{d}": {"sent": s, "received": v}
                  for (c, d), (s, v) in sorted(pred[r].items())}
        ranks.append({"rank": r, "host": r // plan.local_world_size, "memory_bytes": memory[r],
                      "lookup_values": round(work[r]), "bytes_per_step": by_key,
                      "sent_bytes": sum(s for s, _ in pred[r].values()),
                      "received_bytes": sum(v for _, v in pred[r].values()),
                      "cross_host_bytes": {"sent": cross[r][0], "received": cross[r][1]}})
    out_tables = []
    for t in tables:
        tp = plan.tables[t.name]
        out_tables.append({"table": t.name, "sharding_type": tp.sharding_type,
                           "rows": tp.num_embeddings, "dim": tp.embedding_dim,
                           "ranks": sorted({s.rank for s in tp.shards}),
                           "memory_bytes": sum(table_memory(tp, optimizer, plan.world_size, weight_bytes))})
    return {"world_size": plan.world_size, "local_world_size": plan.local_world_size,
            "batch_sizes": list(batch_sizes), "optimizer": optimizer, "ranks": ranks,
            "tables": out_tables}
