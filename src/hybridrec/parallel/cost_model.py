"""What a sharding plan costs per training step: bytes on the wire, memory, lookups.

Pure arithmetic on a :class:`ShardingPlan`; no processes. The byte formulas
mirror how the mechanism counts bytes in the :class:`CommLedger`
(:mod:`hybridrec.parallel.sharded_embedding`, :mod:`hybridrec.parallel.parallelize`),
so :func:`predict_step_bytes` equals what one step records, category by
category and direction by direction. A *slot* is (feature, shard of its table);
for a slot on owner ``o`` and every source rank ``r`` with local batch ``b_r``:

- ``input_dist`` fwd: ``r`` sends ``o`` the slot's bag lengths and ids, int64:
  ``(b_r + ids_r) * 8`` bytes; ``ids_r = b_r * ids_per_bag`` (row shards: times the
  shard's share of the table's rows, see below).
- ``output_dist`` fwd: ``o`` sends ``r`` the pooled partials, float32:
  ``b_r * shard_cols * 4``; bwd: ``r`` sends ``o`` their gradients, the same bytes.
  With a codec for the table (:mod:`hybridrec.comm.codecs`): ``b_r *
  codec.row_bytes(shard_cols)`` fwd and ``b_r * codec.grad_row_bytes(shard_cols)`` bwd,
  exact (codecs spend a fixed number of bytes per row).
- ``input_dist_counts`` fwd: every rank sends every other rank two int64 counts.
- ``dense_allreduce`` bwd: per DDP bucket of ``n`` bytes, ``2 (W-1) n // W`` bytes
  sent and received (a ring all-reduce).
- ``dp_table_allreduce`` bwd: per fused group of data-parallel tables (same dim
  and pooling), a dense ``[rows, dim + 1]`` float32 all-reduce, counted as a ring.

Bytes a rank sends to itself are not counted. Row-wise assumption: the ids of
a bag are spread over the table's rows uniformly, so a row shard receives its
share ``shard_rows / table_rows`` of them. The prediction is exact when a
batch's ids are spread that way (e.g. rows divisible by the shards and each
shard hit by the same number of ids); with skewed ids it is an expectation.

Worked example, one table-wise table of dim 4 on rank 1, one-hot, 2 ranks with
local batch 3: rank 0 sends rank 1 ``(3 + 3) * 8 = 48`` input bytes and gets back
``3 * 4 * 4 = 48`` output bytes forward; it sends ``48`` gradient bytes backward.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

from hybridrec.comm.codecs import Codec
from hybridrec.comm.ledger import CommLedger, ring_allreduce_bytes
from hybridrec.model.embedding import TableConfig, group_tables
from hybridrec.parallel.plan import Shard, ShardingPlan, TablePlan

ID_BYTES = 8
"""input_dist ships bag lengths and ids as int64."""
VALUE_BYTES = 4
"""Weights, pooled partials and their gradients are float32."""

OPTIMIZERS = ("sgd", "rowwise_adagrad", "lazy_adam")

Key = tuple[str, str]
"""``(category, direction)`` of a ledger counter."""

ROW_SPLIT = ("row_wise", "table_row_wise")


# -- memory --------------------------------------------------------------------
def optimizer_state_bytes(optimizer: str, rows: int, cols: int) -> int:
    """Sparse optimizer state of a ``rows x cols`` shard (hybridrec.train.sparse_optim)."""
    if optimizer == "sgd":
        return 0
    if optimizer == "rowwise_adagrad":
        return rows * VALUE_BYTES  # one accumulator per row
    if optimizer == "lazy_adam":
        return 2 * rows * cols * VALUE_BYTES  # exp_avg and exp_avg_sq, like the weights
    raise ValueError(f"unknown optimizer {optimizer!r}; choose from {OPTIMIZERS}")


def shard_memory_bytes(shard: Shard, optimizer: str) -> int:
    """Weights plus optimizer state of one shard (activations and buffers not counted)."""
    return shard.num_rows * shard.num_cols * VALUE_BYTES + optimizer_state_bytes(
        optimizer, shard.num_rows, shard.num_cols)


def memory_by_rank(plan: ShardingPlan, optimizer: str) -> list[int]:
    """Embedding bytes every rank holds under ``plan`` (weights + optimizer state)."""
    out = [0] * plan.world_size
    for tp in plan.tables.values():
        for s in tp.shards:
            out[s.rank] += shard_memory_bytes(s, optimizer)
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


def _row_share(tp: TablePlan, shard: Shard) -> float:
    """Fraction of a bag's ids a shard receives (row shards: its share of the rows)."""
    return shard.num_rows / tp.num_embeddings if tp.sharding_type in ROW_SPLIT else 1.0


def table_flows(tp: TablePlan, table: TableConfig, batch_sizes: list[int],
                ids: Mapping[str, float],
                codec: Codec | None = None) -> Iterator[tuple[int, int, Key, float]]:
    """``(src, dst, key, bytes)`` of every all-to-all piece a sharded table causes
    (``codec``: of the table's output_dist hop; None = float32).

    Data-parallel tables cause none (their cost is an all-reduce, see
    :func:`dp_allreduce_bytes`). Pieces from a rank to itself are included;
    callers drop them.
    """
    if tp.sharding_type == "data_parallel":
        return
    for shard in tp.shards:
        share = _row_share(tp, shard)
        for f in table.features:
            for src, b in enumerate(batch_sizes):
                yield src, shard.rank, ("input_dist", "fwd"), (b + b * ids[f] * share) * ID_BYTES
                # An FM table's first-order column stays with its owner (summed into z_p).
                fo = table.first_order_col is not None and shard.cols[0] <= table.first_order_col < shard.cols[1]
                c = shard.num_cols - fo
                fwd = b * (codec.row_bytes(c) if codec else c * VALUE_BYTES)
                bwd = b * (codec.grad_row_bytes(c) if codec else c * VALUE_BYTES)
                yield shard.rank, src, ("output_dist", "fwd"), fwd
                yield src, shard.rank, ("output_dist", "bwd"), bwd


def dp_allreduce_bytes(dp_tables: list[TableConfig], world: int) -> list[int]:
    """Ring bytes per fused group of data-parallel tables: a dense ``[rows, dim + 1]``
    float32 tensor (the last column counts touched rows) per group and step."""
    return [ring_allreduce_bytes(sum(t.num_embeddings for t in ts) * (dim + 1) * VALUE_BYTES, world)
            for (dim, *_), ts in group_tables(dp_tables).items()]


def predict_all_ranks(plan: ShardingPlan, tables: list[TableConfig], *, batch_sizes: list[int],
                      ids_per_bag: Mapping[str, float] | float = 1.0,
                      dense_param_bytes: list[int] = (),
                      codecs: Mapping[str, Codec] | None = None,
                      ) -> list[dict[Key, tuple[int, int]]]:
    """:func:`predict_step_bytes` of every rank."""
    world = plan.world_size
    if len(batch_sizes) != world:
        raise ValueError(f"batch_sizes has {len(batch_sizes)} entries, the plan {world} ranks")
    ids = _ids_map(tables, ids_per_bag)
    counts = 2 * (world - 1) * ID_BYTES  # two int64 to every other rank, and from it
    sharded = any(tp.sharding_type != "data_parallel" for tp in plan.tables.values())
    # With only replicated tables the mechanism runs no input/output distribution at all.
    acc: list[dict[Key, list[float]]] = [
        {("input_dist_counts", "fwd"): [counts, counts], ("input_dist", "fwd"): [0, 0],
         ("output_dist", "fwd"): [0, 0], ("output_dist", "bwd"): [0, 0]} if sharded else {}
        for _ in range(world)]
    for t in tables:
        flows = table_flows(plan.tables[t.name], t, batch_sizes, ids, (codecs or {}).get(t.name))
        for src, dst, key, nbytes in flows:
            if src != dst:
                acc[src][key][0] += nbytes
                acc[dst][key][1] += nbytes
    # DES for DeepFM: every owner of FM shards sends each sample its [z_p, q_p].
    fm_owners = {sh.rank for t in tables if t.fm_cols is not None
                 for sh in plan.tables[t.name].shards if plan.tables[t.name].sharding_type != "data_parallel"}
    for o in fm_owners:
        for src, b in enumerate(batch_sizes):
            if src != o:
                for key, (a, z) in ((("output_dist", "fwd"), (o, src)), (("output_dist", "bwd"), (src, o))):
                    acc[a][key][0] += 2 * b * VALUE_BYTES
                    acc[z][key][1] += 2 * b * VALUE_BYTES
    if world > 1 and dense_param_bytes:  # DDP wraps the dense arches only with several ranks
        ring = sum(ring_allreduce_bytes(n, world) for n in dense_param_bytes)
        for a in acc:
            a[("dense_allreduce", "bwd")] = [ring, ring]
    dp = [t for t in tables if plan.tables[t.name].sharding_type == "data_parallel"]
    if dp:
        ring = sum(dp_allreduce_bytes(dp, world))
        for a in acc:
            a[("dp_table_allreduce", "bwd")] = [ring, ring]
    # Sums of integer-valued floats are exact; round fractional expectations once.
    return [{k: (round(s), round(r)) for k, (s, r) in a.items()} for a in acc]


def predict_step_bytes(plan: ShardingPlan, tables: list[TableConfig], *, rank: int,
                       batch_sizes: list[int], ids_per_bag: Mapping[str, float] | float = 1.0,
                       world_size: int | None = None, dense_param_bytes: list[int] = (),
                       codecs: Mapping[str, Codec] | None = None) -> dict[Key, tuple[int, int]]:
    """Bytes ``rank`` sends and receives in one training step, per (category, direction).

    Args:
        plan: the sharding plan the mechanism runs.
        tables: the model's tables (their features name the KJT keys).
        rank: the rank whose ledger is predicted.
        batch_sizes: local batch size of every rank, in rank order.
        ids_per_bag: mean ids per bag, per feature (missing features: 1) or for all;
            exact when every rank's batch holds ``b_r * ids_per_bag`` ids of the feature.
        world_size: checked against the plan when given.
        dense_param_bytes: bytes of every dense all-reduce of a step: one entry per
            DDP bucket (a DDP module whose gradients fit in one bucket is one entry,
            e.g. ``[bottom_bytes, top_bytes]``). With 2 ranks (or when the world
            divides ``2 (W-1) n``) per-module entries are exact however DDP buckets.
        codecs: table -> codec of its output_dist hop, as given to the collection.

    Returns ``{(category, direction): (sent, received)}`` with the keys the
    mechanism records in a step: ``input_dist_counts``/``input_dist`` (fwd),
    ``output_dist`` (fwd, bwd), ``dense_allreduce`` (bwd, when several ranks and
    ``dense_param_bytes``), ``dp_table_allreduce`` (bwd, when a table is data-parallel).
    """
    if world_size is not None and world_size != plan.world_size:
        raise ValueError(f"world_size {world_size} != the plan's {plan.world_size}")
    if not 0 <= rank < plan.world_size:
        raise ValueError(f"rank {rank} outside world of {plan.world_size}")
    return predict_all_ranks(plan, tables, batch_sizes=batch_sizes, ids_per_bag=ids_per_bag,
                             dense_param_bytes=dense_param_bytes, codecs=codecs)[rank]


def record_predictions(ledger: CommLedger, plan: ShardingPlan, tables: list[TableConfig], *,
                       rank: int, batch_sizes: list[int],
                       ids_per_bag: Mapping[str, float] | float = 1.0,
                       dense_param_bytes: list[int] = (),
                       codecs: Mapping[str, Codec] | None = None) -> dict[Key, tuple[int, int]]:
    """Tell ``ledger`` the bytes :func:`predict_step_bytes` expects per step; returns them.

    Call once: :meth:`CommLedger.predict` adds up repeated calls.
    """
    pred = predict_step_bytes(plan, tables, rank=rank, batch_sizes=batch_sizes,
                              ids_per_bag=ids_per_bag, dense_param_bytes=dense_param_bytes,
                              codecs=codecs)
    for (category, direction), (sent, received) in pred.items():
        ledger.predict(category, sent=sent, received=received, direction=direction)
    return pred


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
        share = _row_share(tp, shard)
        out[shard.rank] += sum(total * ids[f] * share for f in table.features) * shard.num_cols
    return out


def table_traffic(tp: TablePlan, table: TableConfig, batch_sizes: list[int],
                  ids: Mapping[str, float]) -> tuple[list[float], list[float]]:
    """``(sent, received)`` bytes per rank that one table adds to a step.

    Data-parallel: the ring all-reduce of the table alone (fused groups differ
    only by integer rounding).
    """
    world = len(batch_sizes)
    sent, received = [0.0] * world, [0.0] * world
    if tp.sharding_type == "data_parallel":
        ring = 2 * (world - 1) * tp.num_embeddings * (tp.embedding_dim + 1) * VALUE_BYTES / world
        return [ring] * world, [ring] * world
    for src, dst, _key, nbytes in table_flows(tp, table, batch_sizes, ids):
        if src != dst:
            sent[src] += nbytes
            received[dst] += nbytes
    return sent, received


def table_memory(tp: TablePlan, optimizer: str, world: int) -> list[int]:
    """Bytes each rank holds for one table (weights + optimizer state)."""
    out = [0] * world
    for s in tp.shards:
        out[s.rank] += shard_memory_bytes(s, optimizer)
    return out


# -- report --------------------------------------------------------------------
def describe_plan(plan: ShardingPlan, tables: list[TableConfig], *, batch_sizes: list[int],
                  ids_per_bag: Mapping[str, float] | float = 1.0, optimizer: str = "sgd",
                  dense_param_bytes: list[int] = ()) -> dict:
    """JSON-ready report: per rank memory, lookup work and predicted bytes per step
    (``"category/direction": {"sent", "received"}``); per table its sharding.

    Layout::

        {"world_size", "local_world_size", "batch_sizes", "optimizer",
         "ranks": [{"rank", "host", "memory_bytes", "lookup_values",
                    "bytes_per_step": {"output_dist/fwd": {"sent", "received"}, ...},
                    "sent_bytes", "received_bytes"}],
         "tables": [{"table", "sharding_type", "rows", "dim", "ranks", "memory_bytes"}]}
    """
    ids = _ids_map(tables, ids_per_bag)
    pred = predict_all_ranks(plan, tables, batch_sizes=batch_sizes, ids_per_bag=ids,
                             dense_param_bytes=dense_param_bytes)
    memory = memory_by_rank(plan, optimizer)
    work = [0.0] * plan.world_size
    for t in tables:
        for r, w in enumerate(lookup_work(plan.tables[t.name], t, batch_sizes, ids)):
            work[r] += w
    ranks = []
    for r in range(plan.world_size):
        by_key = {f"{c}/{d}": {"sent": s, "received": v}
                  for (c, d), (s, v) in sorted(pred[r].items())}
        ranks.append({"rank": r, "host": r // plan.local_world_size, "memory_bytes": memory[r],
                      "lookup_values": round(work[r]), "bytes_per_step": by_key,
                      "sent_bytes": sum(s for s, _ in pred[r].values()),
                      "received_bytes": sum(v for _, v in pred[r].values())})
    out_tables = []
    for t in tables:
        tp = plan.tables[t.name]
        out_tables.append({"table": t.name, "sharding_type": tp.sharding_type,
                           "rows": tp.num_embeddings, "dim": tp.embedding_dim,
                           "ranks": sorted({s.rank for s in tp.shards}),
                           "memory_bytes": sum(table_memory(tp, optimizer, plan.world_size))})
    return {"world_size": plan.world_size, "local_world_size": plan.local_world_size,
            "batch_sizes": list(batch_sizes), "optimizer": optimizer, "ranks": ranks,
            "tables": out_tables}
