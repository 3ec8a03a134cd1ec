"""The sharding planner: tables + world + budget -> :class:`ShardingPlan`. Pure, no processes.

Cost model (per training step, per rank; :mod:`hybridrec.parallel.cost_model`):

- memory: weights + sparse optimizer state of the shards a rank holds
  (sgd: none; rowwise_adagrad: one float per row; lazy_adam: twice the weights);
- traffic: the bytes the mechanism puts on the wire, from the layout the mechanism
  runs (:func:`~hybridrec.parallel.cost_model.table_traffic`, the flows
  :func:`~hybridrec.parallel.cost_model.predict_step_bytes` sums; pooling factor
  from the dataset's ``mean_ids_per_sample``, default 1), all local batches
  ``batch_size_per_rank``; time = (sent + received) / bandwidth;
- lookups: ids x columns gathered by the rank's shards, read forward and
  written backward: time = 2 x 4 bytes x values / ``lookup_bytes_per_s``.

A rank's *load* is its memory over the ideal per-rank memory plus its time over
the ideal per-rank time (the ideal: every table table_wise, spread perfectly),
so memory and communication weigh the same. Tables are placed greedily, pinned
ones first, then largest first. Each takes, among the candidates that keep every
rank within the memory cap, the one with the smallest estimated final load: the
larger of its most loaded rank and the even spread of everything (the tables
placed, this one, and the rest at their table_wise cost). So a split that costs
more bytes in total wins only when it keeps a rank from standing out (a big
table), and small tables go whole to the least loaded rank. Ties go to the
sorted rank loads (balance), then to the earlier candidate: the output is
deterministic.

Candidates per table: table_wise on each rank; column_wise over the k least
loaded ranks (k = 2, 4, ... up to the world, shards at least
``COLUMN_MIN_WIDTH`` wide); row_wise over all ranks; table_row_wise over each
host group (with more than one group); data_parallel for tables of at most
``dp_max_rows`` rows. A table that does not fit whole on one rank gets only
row_wise / table_row_wise candidates: column shards still hold every row and
each receives every id. With row-wise Adagrad column_wise is a candidate only when
pinned (its per-shard accumulators differ from one process's per-row accumulator).
:class:`TableConstraint` narrows the candidates.

The dense part (``dist.partition_dense=auto``, :func:`choose_dense`): each dense MLP's
widest layer is partitioned over the group's ranks when, per rank per step (bytes sent
plus received, float32), the activations that exchanges on its most loaded rank
(:func:`~hybridrec.parallel.placement.activation_bytes`, forward and backward) are fewer
than the layer's gradient bytes the ring all-reduce no longer moves (twice
:func:`~hybridrec.comm.ledger.ring_allreduce_bytes` of its weight and bias); else it stays
replicated. A byte count, not a time: the exchanges are synchronous while DDP's all-reduce
overlaps the backward, and memory (the block is 1/G of the layer and of its optimizer
state) is not weighed.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from hybridrec.model.embedding import TableConfig
from hybridrec.parallel import plan as P
from hybridrec.parallel.cost_model import (  # noqa: F401 - the byte model is public here too
    OPTIMIZERS,
    VALUE_BYTES,
    describe_plan,
    ids_per_sample,
    lookup_work,
    predict_step_bytes,
    table_memory,
    table_traffic,
)
from hybridrec.parallel.placement import AUTO, choose_dense, dense_cost  # noqa: F401 - the dense part's choice
from hybridrec.parallel.plan import SHARDING_TYPES, ShardingPlan, TablePlan

DP_MAX_ROWS = 10_000
"""Tables of at most this many rows are also tried data-parallel (replicated)."""
LOOKUP_BYTES_PER_S = 10e9
"""Effective memory bandwidth of row gathers and scatters (rows are read at random)."""
COLUMN_MIN_WIDTH = 4
"""Narrowest column shard the planner proposes on its own: narrower shards make
tiny lookups and all-to-all pieces, and every shard still receives every id."""


@dataclass(kw_only=True)
class TableConstraint:
    """A user's pin on one table."""

    sharding_types: list[str] | None = None
    """Sharding types allowed for the table (None: any the planner proposes)."""
    ranks: list[int] | None = None
    """Ranks the table may live on (None: any). table_wise picks one of them;
    row_wise, column_wise and table_row_wise split over exactly these ranks;
    data_parallel needs every rank."""


@dataclass
class _Loads:
    """Per-rank running totals of the tables placed so far."""

    memory: list[float]
    time: list[float]


def plan_sharding(tables: list[TableConfig], *, world_size: int, local_world_size: int,
                  stats: Mapping | None = None, batch_size_per_rank: int,
                  memory_per_rank_bytes: int | None = None, bandwidth_bytes_per_s: float,
                  optimizer: str = "sgd", constraints: Mapping[str, TableConstraint] | None = None,
                  dp_max_rows: int = DP_MAX_ROWS,
                  lookup_bytes_per_s: float = LOOKUP_BYTES_PER_S,
                  weight_bytes: int = VALUE_BYTES) -> ShardingPlan:
    """A validated plan for ``tables`` on ``world_size`` ranks (see the module docstring).

    Args:
        tables: the model's embedding tables.
        world_size: ranks in all.
        local_world_size: ranks per host group (table_row_wise stays inside one).
        stats: a dataset's per-feature stats (``DatasetMeta.stats``); only
            ``mean_ids_per_sample`` is read. None: one id per bag.
        batch_size_per_rank: local batch of every rank.
        memory_per_rank_bytes: embedding memory cap per rank (None: no cap).
        bandwidth_bytes_per_s: network bandwidth of one rank.
        optimizer: sparse optimizer (its state counts as memory).
        constraints: ``{table: TableConstraint}`` pins.
        dp_max_rows: largest table tried data-parallel.
        lookup_bytes_per_s: see :data:`LOOKUP_BYTES_PER_S`.
        weight_bytes: of a table's value (2 for bf16 tables; their state stays float32).

    Raises:
        ValueError: bad arguments or constraints, or a table that fits nowhere
            (the message names it).
    """
    _check_args(tables, world_size, local_world_size, batch_size_per_rank, bandwidth_bytes_per_s,
                optimizer)
    constraints = dict(constraints or {})
    _check_constraints(constraints, tables, world_size, local_world_size)
    model = _CostModel(batch=[batch_size_per_rank] * world_size, ids=ids_per_sample(tables, stats),
                       optimizer=optimizer, bandwidth=bandwidth_bytes_per_s,
                       lookup_bytes_per_s=lookup_bytes_per_s, weight_bytes=weight_bytes)
    # Pinned tables first (the others then balance around them), then largest first.
    order = sorted(tables, key=lambda t: (t.name not in constraints,
                                          -t.num_embeddings * t.embedding_dim, t.name))
    refs, baseline = _ideal_share(order, model)
    remaining = sum(baseline)
    loads = _Loads(memory=[0.0] * world_size, time=[0.0] * world_size)
    chosen: dict[str, TablePlan] = {}
    for t, base in zip(order, baseline):
        remaining -= base
        c = constraints.get(t.name, TableConstraint())
        cands = list(_candidates(t, c, loads, world_size, local_world_size, optimizer,
                                 memory_per_rank_bytes, dp_max_rows, refs, weight_bytes))
        best = _best_candidate(t, cands, loads, model, refs, remaining, memory_per_rank_bytes)
        if best is None:
            raise ValueError(_no_fit_message(t, c, len(cands), optimizer, memory_per_rank_bytes,
                                             loads, weight_bytes))
        chosen[t.name], loads = best
    plan = ShardingPlan(world_size=world_size, local_world_size=local_world_size,
                        tables={t.name: chosen[t.name] for t in tables})
    plan.validate()
    return plan


@dataclass(frozen=True, kw_only=True)
class _CostModel:
    """Per-rank memory and time of one table's placement (see the module docstring)."""

    batch: list[int]
    ids: dict[str, float]
    optimizer: str
    bandwidth: float
    lookup_bytes_per_s: float
    weight_bytes: int = VALUE_BYTES

    def cost(self, tp: TablePlan, t: TableConfig) -> tuple[list[int], list[float]]:
        sent, received = table_traffic(tp, t, self.batch, self.ids)
        work = lookup_work(tp, t, self.batch, self.ids)
        time = [(s + r) / self.bandwidth + 2 * VALUE_BYTES * w / self.lookup_bytes_per_s
                for s, r, w in zip(sent, received, work)]
        return table_memory(tp, self.optimizer, len(self.batch), self.weight_bytes), time


def _ideal_share(tables: list[TableConfig],
                 model: _CostModel) -> tuple[tuple[float, float], list[float]]:
    """The units of a rank's load, ``(memory, time)`` per rank if every table were
    table_wise and spread perfectly; and every table's table_wise load summed over
    ranks (what the tables not yet placed will add, at least roughly)."""
    world = len(model.batch)
    costs = [model.cost(_whole(t), t) for t in tables]
    mem_ref = max(sum(sum(m) for m, _ in costs) / world, 1.0)
    time_ref = max(sum(sum(x) for _, x in costs) / world, 1e-12)
    return (mem_ref, time_ref), [sum(m) / mem_ref + sum(x) / time_ref for m, x in costs]


def _best_candidate(t, candidates, loads: _Loads, model: _CostModel, refs, remaining: float,
                    cap: int | None) -> tuple[TablePlan, _Loads] | None:
    """The candidate with the smallest key, among those within the memory cap.

    Key: first the step's estimated final load, the larger of the most loaded rank
    and the even spread of all loads (placed so far, this candidate, and
    ``remaining`` for the tables to come): a candidate that costs more in total
    loses unless it keeps some rank from standing out. Then the rank loads sorted
    in decreasing order (balance), then candidate order.
    """
    mem_ref, time_ref = refs
    world = len(loads.memory)
    best, best_key = None, None
    for tp in candidates:
        mem, time = model.cost(tp, t)
        new_mem = [a + b for a, b in zip(loads.memory, mem)]
        if cap is not None and max(new_mem) > cap:
            continue
        new_time = [a + b for a, b in zip(loads.time, time)]
        rank_load = sorted((m / mem_ref + x / time_ref for m, x in zip(new_mem, new_time)),
                           reverse=True)
        key = (max(rank_load[0], (sum(rank_load) + remaining) / world), rank_load)
        if best_key is None or key < best_key:
            best, best_key = (tp, _Loads(new_mem, new_time)), key
    return best


def _whole(t: TableConfig) -> TablePlan:
    """The table whole on rank 0: the reference for sizes and ideal shares."""
    return P.table_wise(t.name, t.num_embeddings, t.embedding_dim, 0)


def _check_args(tables, world, local_world, batch, bandwidth, optimizer) -> None:
    if world < 1 or local_world < 1 or world % local_world:
        raise ValueError(f"world_size {world} must be a positive multiple of "
                         f"local_world_size {local_world}")
    if batch < 1:
        raise ValueError(f"batch_size_per_rank must be >= 1, got {batch}")
    if not bandwidth > 0:
        raise ValueError(f"bandwidth_bytes_per_s must be > 0, got {bandwidth}")
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"unknown optimizer {optimizer!r}; choose from {OPTIMIZERS}")
    names = [t.name for t in tables]
    if len(set(names)) != len(names):
        raise ValueError("duplicate table names")


def _check_constraints(constraints, tables, world, local_world) -> None:
    names = {t.name for t in tables}
    for name, c in constraints.items():
        where = f"constraint on table {name!r}"
        if name not in names:
            raise ValueError(f"{where}: no such table (tables: {sorted(names)})")
        bad = [k for k in c.sharding_types or [] if k not in SHARDING_TYPES]
        if bad or c.sharding_types == []:
            raise ValueError(f"{where}: sharding types {bad or '[]'} not among {SHARDING_TYPES}")
        if c.ranks is None:
            continue
        if not c.ranks or len(set(c.ranks)) != len(c.ranks):
            raise ValueError(f"{where}: ranks {c.ranks} must be a non-empty list without repeats")
        if any(not 0 <= r < world for r in c.ranks):
            raise ValueError(f"{where}: ranks {c.ranks} outside world of {world}")
        if c.sharding_types == ["table_row_wise"] and len({r // local_world for r in c.ranks}) > 1:
            raise ValueError(f"{where}: table_row_wise ranks {c.ranks} span several host groups "
                             f"of {local_world} ranks")


def _candidates(t: TableConfig, c: TableConstraint, loads: _Loads, world: int, local_world: int,
                optimizer: str, cap: int | None, dp_max_rows: int, refs: tuple[float, float],
                weight_bytes: int = VALUE_BYTES):
    """Candidate placements of one table, in a fixed order (earlier wins ties)."""
    n, d = t.num_embeddings, t.embedding_dim
    types = set(c.sharding_types or SHARDING_TYPES)
    if cap is not None and sum(table_memory(_whole(t), optimizer, 1, weight_bytes)) > cap:
        types &= {"row_wise", "table_row_wise"}  # too big for one rank: split the rows
    ranks = sorted(c.ranks) if c.ranks is not None else list(range(world))
    pinned_type = c.sharding_types is not None
    if optimizer == "rowwise_adagrad" and not pinned_type:
        # Column shards would keep one accumulator per shard (each its own columns' mean
        # square), so training would not equal one process: only when asked for.
        types.discard("column_wise")
    if "table_wise" in types:
        for r in ranks:
            yield P.table_wise(t.name, n, d, r)
    if "column_wise" in types:
        for group in _column_groups(ranks, d, loads, refs, explicit=c.ranks is not None,
                                    pinned_type=pinned_type):
            yield P.column_wise(t.name, n, d, group)
    if "row_wise" in types and (len(ranks) > 1 or pinned_type):
        yield P.row_wise(t.name, n, d, ranks)
    if "table_row_wise" in types:
        for host in _host_groups(ranks, world, local_world, explicit=c.ranks is not None,
                                 pinned_type=pinned_type):
            if len(host) > 1 or pinned_type:
                yield P.table_row_wise(t.name, n, d, host)
    if "data_parallel" in types and len(ranks) == world and (n <= dp_max_rows or pinned_type):
        yield P.data_parallel(t.name, n, d, world)


def _column_groups(ranks: list[int], dim: int, loads: _Loads, refs, *, explicit: bool,
                   pinned_type: bool):
    """Rank lists for column_wise: exactly the pinned ranks, else the k least loaded."""
    if explicit:
        if (len(ranks) > 1 or pinned_type) and len(ranks) <= dim:
            yield ranks
        return
    mem_ref, time_ref = refs
    by_load = sorted(ranks, key=lambda r: (loads.memory[r] / mem_ref + loads.time[r] / time_ref, r))
    for k in sorted(_powers_of_two(len(ranks)) | {len(ranks)}):
        if k >= 2 and (dim // k >= COLUMN_MIN_WIDTH or (pinned_type and k <= dim)):
            yield sorted(by_load[:k])


def _powers_of_two(limit: int) -> set[int]:
    out, k = set(), 2
    while k <= limit:
        out.add(k)
        k *= 2
    return out


def _host_groups(ranks: list[int], world: int, local_world: int, *, explicit: bool,
                 pinned_type: bool):
    """Rank lists for table_row_wise: the pinned ranks (one whole host group: the mechanism
    reduces over every rank of the host), else each host group; unless pinned, nothing when
    the world is one host group (= row_wise)."""
    if explicit:
        hosts = {r // local_world for r in ranks}
        if len(hosts) == 1:
            h = hosts.pop()
            if sorted(ranks) == list(range(h * local_world, (h + 1) * local_world)):
                yield sorted(ranks)
        return
    if world // local_world < 2 and not pinned_type:
        return
    for h in range(world // local_world):
        yield list(range(h * local_world, (h + 1) * local_world))


def _no_fit_message(t, c, tried, optimizer, cap, loads, weight_bytes=VALUE_BYTES) -> str:
    whole = sum(table_memory(_whole(t), optimizer, 1, weight_bytes))
    what = (f"table {t.name!r} ({t.num_embeddings:,} x {t.embedding_dim}, {whole:,} bytes with "
            f"{optimizer} state)")
    pins = f" under {c}" if (c.sharding_types or c.ranks) else ""
    cap_s = "" if cap is None else f"; memory cap {cap:,} bytes per rank"
    if tried == 0:
        too_big = (" (too big for one rank, so only row_wise/table_row_wise apply)"
                   if cap and whole > cap else "")
        return f"{what}: no sharding candidate{pins}{too_big}{cap_s}"
    return (f"{what} fits on no rank{pins}{cap_s}, the least used rank already holds "
            f"{min(loads.memory):,.0f} bytes: raise the cap, add ranks or relax the constraint")

