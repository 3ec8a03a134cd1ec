"""Sharding plans: pure data, JSON round trip, no processes.

A plan says, for every embedding table, how it is split and where the pieces
live. Every sharding type is a list of :class:`Shard` s, each a block of rows
and columns of the table on one rank:

- ``table_wise``: one shard, the whole table, on one rank.
- ``row_wise``: rows split by range over a list of ranks (ids are bucketized to
  the owner of their row; partial pooled sums are added on the way back).
- ``column_wise``: columns split over ranks (every shard sees every id; outputs
  are concatenated).
- ``table_row_wise``: row-wise over the ranks of one host group, one shard on every
  rank of it (the mechanism refuses other rank sets); partial pooled sums are added
  inside the host first, and only the sums cross hosts (parallel/host_reduce.py).
- ``data_parallel``: the whole table replicated on every rank.

Worked example, table ``t`` of 10 rows x 8 columns, world of 2::

    row_wise:    [Shard(rank=0, rows=(0, 5), cols=(0, 8)), Shard(rank=1, rows=(5, 10), cols=(0, 8))]
    column_wise: [Shard(rank=0, rows=(0, 10), cols=(0, 4)), Shard(rank=1, rows=(0, 10), cols=(4, 8))]

The plan's *dense part* (:class:`DensePlan`, per dense module of the model; a module absent
from it is ``replicated``: every rank holds a copy and the dense sync averages its
gradients) may instead *partition* a module: its widest ``nn.Linear`` (``layer``, a path
inside the module) is split by output columns over the ranks of the group (ranks are
group-relative: the global ranks in a flat run). Worked example, the top MLP's first layer,
13 -> 10, over 3 ranks::

    DensePlan(module="top", placement="partitioned", layer="layers.0", in_features=13,
              out_features=10, shards=[ColumnShard(0, (0, 4)), ColumnShard(1, (4, 7)),
                                       ColumnShard(2, (7, 10))])

(:mod:`hybridrec.parallel.placement` applies it and computes what it exchanges.)
"""

from __future__ import annotations

import itertools
import json
from dataclasses import asdict, dataclass, field

SHARDING_TYPES = ("table_wise", "row_wise", "column_wise", "table_row_wise", "data_parallel")
DENSE_PLACEMENTS = ("replicated", "partitioned")


@dataclass(frozen=True)
class Shard:
    rank: int
    rows: tuple[int, int]
    """``[start, end)`` rows of the table held by this shard."""
    cols: tuple[int, int]
    """``[start, end)`` columns of the table held by this shard."""

    @property
    def num_rows(self) -> int:
        return self.rows[1] - self.rows[0]

    @property
    def num_cols(self) -> int:
        return self.cols[1] - self.cols[0]


@dataclass(kw_only=True)
class TablePlan:
    table: str
    sharding_type: str
    num_embeddings: int
    embedding_dim: int
    shards: list[Shard] = field(default_factory=list)


def split_evenly(n: int, parts: int) -> list[tuple[int, int]]:
    """``[start, end)`` ranges of ``n`` items over ``parts``, the first ones one larger."""
    base, extra = divmod(n, parts)
    out, start = [], 0
    for i in range(parts):
        end = start + base + (i < extra)
        out.append((start, end))
        start = end
    return out


def table_wise(name: str, rows: int, dim: int, rank: int) -> TablePlan:
    return TablePlan(table=name, sharding_type="table_wise", num_embeddings=rows, embedding_dim=dim,
                     shards=[Shard(rank, (0, rows), (0, dim))])


def row_wise(name: str, rows: int, dim: int, ranks: list[int], *, kind: str = "row_wise") -> TablePlan:
    return TablePlan(table=name, sharding_type=kind, num_embeddings=rows, embedding_dim=dim,
                     shards=[Shard(r, span, (0, dim)) for r, span in zip(ranks, split_evenly(rows, len(ranks)))])


def table_row_wise(name: str, rows: int, dim: int, host_ranks: list[int]) -> TablePlan:
    return row_wise(name, rows, dim, host_ranks, kind="table_row_wise")


def column_wise(name: str, rows: int, dim: int, ranks: list[int]) -> TablePlan:
    return TablePlan(table=name, sharding_type="column_wise", num_embeddings=rows, embedding_dim=dim,
                     shards=[Shard(r, (0, rows), span) for r, span in zip(ranks, split_evenly(dim, len(ranks)))])


def data_parallel(name: str, rows: int, dim: int, world_size: int) -> TablePlan:
    return TablePlan(table=name, sharding_type="data_parallel", num_embeddings=rows, embedding_dim=dim,
                     shards=[Shard(r, (0, rows), (0, dim)) for r in range(world_size)])


@dataclass(frozen=True)
class ColumnShard:
    rank: int
    """Group-relative rank holding the columns."""
    cols: tuple[int, int]
    """``[start, end)`` output columns (rows of the weight ``[out, in]``, entries of the bias)."""

    @property
    def num_cols(self) -> int:
        return self.cols[1] - self.cols[0]


@dataclass(kw_only=True)
class DensePlan:
    """Where one dense module's parameters live (see the module docstring)."""

    module: str
    """The model's attribute (``bottom``, ``top``)."""
    placement: str = "replicated"
    layer: str | None = None
    """``partitioned``: the split ``nn.Linear``'s path inside the module (``layers.0``)."""
    in_features: int = 0
    out_features: int = 0
    shards: list[ColumnShard] = field(default_factory=list)
    cost: dict | None = None
    """Why the planner chose this placement (``dist.partition_dense=auto``): bytes per rank
    per step (:func:`hybridrec.parallel.planner.choose_dense`); None when asked for by name.
    For people: the mechanism does not read it."""

    def problem(self, world_size: int) -> str | None:
        """Why this entry is not a valid placement on ``world_size`` ranks (None: it is)."""
        if self.placement not in DENSE_PLACEMENTS:
            return f"unknown placement {self.placement!r} (one of {', '.join(DENSE_PLACEMENTS)})"
        if self.placement == "replicated":
            return "a replicated module has no shards" if self.shards else None
        if not self.layer or not self.shards:
            return "a partitioned module needs its layer and shards"
        if bad := [s.rank for s in self.shards if not 0 <= s.rank < world_size]:
            return f"columns placed on rank(s) {bad}, which do not exist (ranks 0..{world_size - 1})"
        if len({s.rank for s in self.shards}) != len(self.shards):
            return f"a rank holds two column blocks: {[s.rank for s in self.shards]}"
        spans = sorted(s.cols for s in self.shards)
        if spans[0][0] != 0 or spans[-1][1] != self.out_features or any(
                a[1] != b[0] for a, b in itertools.pairwise(spans)) or any(a >= b for a, b in spans):
            return f"column blocks {spans} do not cover the {self.out_features} outputs once"
        return None


def partitioned(module: str, layer: str, in_features: int, out_features: int,
                ranks: list[int]) -> DensePlan:
    """``layer`` of ``module`` split by output columns over ``ranks``, evenly."""
    spans = split_evenly(out_features, len(ranks))
    return DensePlan(module=module, placement="partitioned", layer=layer, in_features=in_features,
                     out_features=out_features, shards=[ColumnShard(r, c) for r, c in zip(ranks, spans)])


@dataclass(kw_only=True)
class ShardingPlan:
    world_size: int
    local_world_size: int
    """Ranks per host group (ranks that share a fast link)."""
    tables: dict[str, TablePlan] = field(default_factory=dict)
    dense: dict[str, DensePlan] = field(default_factory=dict)
    """Dense part, by module; absent modules are replicated."""

    def validate(self) -> None:
        """Raise ValueError unless every table is covered exactly once per replica and
        every dense entry is a valid placement."""
        for name, dp in self.dense.items():
            problem = dp.problem(self.world_size) if name == dp.module else f"entry of module {dp.module!r}"
            if problem:
                raise ValueError(f"plan of dense module {name!r}: {problem}")
        for name, tp in self.tables.items():
            where = f"plan of table {name!r}"
            if tp.sharding_type not in SHARDING_TYPES:
                raise ValueError(f"{where}: unknown sharding type {tp.sharding_type!r}")
            if not tp.shards:
                raise ValueError(f"{where}: no shards")
            for s in tp.shards:
                if not 0 <= s.rank < self.world_size:
                    raise ValueError(f"{where}: rank {s.rank} outside world of {self.world_size}")
                if not (0 <= s.rows[0] <= s.rows[1] <= tp.num_embeddings and 0 <= s.cols[0] < s.cols[1] <= tp.embedding_dim):
                    raise ValueError(f"{where}: shard {s} outside {tp.num_embeddings}x{tp.embedding_dim}")
            cells = sum(s.num_rows * s.num_cols for s in tp.shards)
            copies = self.world_size if tp.sharding_type == "data_parallel" else 1
            if cells != copies * tp.num_embeddings * tp.embedding_dim:
                raise ValueError(f"{where}: shards cover {cells} cells, expected "
                                 f"{copies} x {tp.num_embeddings} x {tp.embedding_dim}")
            if tp.sharding_type == "table_row_wise":
                hosts = {s.rank // self.local_world_size for s in tp.shards}
                if len(hosts) != 1:
                    raise ValueError(f"{where}: table_row_wise shards span host groups {sorted(hosts)}")

    def to_dict(self) -> dict:
        d = {"world_size": self.world_size, "local_world_size": self.local_world_size,
             "tables": {n: asdict(t) for n, t in self.tables.items()}}
        if self.dense:  # (only when set: plans without one stay as they were)
            d["dense"] = {n: asdict(p) for n, p in self.dense.items()}
        return d

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    @staticmethod
    def from_dict(d: dict) -> ShardingPlan:
        tables = {}
        for name, t in d["tables"].items():
            shards = [Shard(int(s["rank"]), tuple(s["rows"]), tuple(s["cols"])) for s in t["shards"]]
            tables[name] = TablePlan(table=t["table"], sharding_type=t["sharding_type"],
                                     num_embeddings=int(t["num_embeddings"]),
                                     embedding_dim=int(t["embedding_dim"]), shards=shards)
        plan = ShardingPlan(world_size=int(d["world_size"]),
                            local_world_size=int(d["local_world_size"]), tables=tables,
                            dense={n: _dense_from_dict(p) for n, p in d.get("dense", {}).items()})
        plan.validate()
        return plan

    @staticmethod
    def from_json(text: str) -> ShardingPlan:
        return ShardingPlan.from_dict(json.loads(text))


def _dense_from_dict(p: dict) -> DensePlan:
    return DensePlan(module=p["module"], placement=p.get("placement", "replicated"), layer=p.get("layer"),
                     in_features=int(p.get("in_features", 0)), out_features=int(p.get("out_features", 0)),
                     shards=[ColumnShard(int(s["rank"]), (int(s["cols"][0]), int(s["cols"][1])))
                             for s in p.get("shards", [])], cost=p.get("cost"))
