"""A dataset's embedding tables and where they live: the tables a config makes of a
dataset's schema, and the sharding plan (a plan file, the planner, or one sharding type for
every table). The run builder (:mod:`hybridrec.train.build`), the memory check
(:mod:`hybridrec.train.setup.memory`) and the parameter servers (:mod:`hybridrec.train.ps_run`)
read them."""

from __future__ import annotations

from pathlib import Path

from hybridrec.data.schema import DatasetMeta
from hybridrec.data.stream import stream_meta
from hybridrec.errors import ConfigError
from hybridrec.model.embedding import WEIGHT_DTYPES, TableConfig
from hybridrec.parallel import plan as plan_lib
from hybridrec.parallel.plan import ShardingPlan
from hybridrec.parallel.planner import plan_sharding
from hybridrec.parallel.topology import Topology
from hybridrec.train.setup.config import Config


def load_dataset(cfg: Config) -> DatasetMeta:
    """The run's dataset: ``data.path``'s, or a stream's (``data.stream``: its schema and
    tables, no parts: :func:`hybridrec.data.stream.stream_meta`)."""
    if cfg.data.stream:
        return stream_meta(cfg.data.stream, cfg.model.tables, cfg.model.table_rows,
                           schema_file=cfg.data.stream_schema or None)
    if not cfg.data.path:
        raise ConfigError("data.path is not set: point it at a preprocessed dataset directory")
    return DatasetMeta.load(cfg.data.path)


def build_tables(meta: DatasetMeta, cfg: Config) -> list[TableConfig]:
    """One table per categorical feature, sized from the dataset's schema. DeepFM: FM
    tables with one more column, the ids' first-order weights."""
    k, fm = cfg.model.embedding_dim, cfg.model.arch == "deepfm"
    return [
        TableConfig(name=f.name, num_embeddings=f.num_embeddings, embedding_dim=k + fm,
                    pooling=cfg.model.pooling, fm_cols=k if fm else None)
        for f in meta.schema.features
    ]


# Link bandwidth the automatic plan assumes (bytes/s): 10 Gbit/s, a common data-centre
# NIC; use `hybridrec plan --bandwidth ... --out plan.json` and dist.plan for another.
AUTO_PLAN_BANDWIDTH = 10e9 / 8


def build_plan(cfg: Config, tables: list[TableConfig], topo: Topology,
               meta: DatasetMeta | None = None) -> ShardingPlan:
    if cfg.dist.plan:
        from hybridrec.train.setup.rules import plan_file_problem

        if problem := plan_file_problem(cfg, topo.group_size, topo.job_size):
            raise ConfigError(problem)
        return ShardingPlan.from_json(Path(cfg.dist.plan).read_text())
    if cfg.dist.sharding == "auto":
        return plan_sharding(tables, world_size=topo.group_size, local_world_size=topo.local_world_size,
                             stats=meta.stats if meta else None, batch_size_per_rank=cfg.data.batch_size,
                             bandwidth_bytes_per_s=AUTO_PLAN_BANDWIDTH, optimizer=cfg.optim.sparse,
                             weight_bytes=WEIGHT_DTYPES[cfg.model.embedding_dtype].itemsize)
    return uniform_plan(cfg.dist.sharding, tables, topo.group_size, topo.local_world_size)


def uniform_plan(kind: str, tables: list[TableConfig], world: int, local_world: int) -> ShardingPlan:
    """Every table sharded the same way; table-wise tables go, largest first, to the
    rank with the fewest rows so far (table-row-wise: to the host group likewise)."""
    load = [0] * (world if kind == "table_wise" else world // local_world)
    out = {}
    for t in sorted(tables, key=lambda t: (-t.num_embeddings * t.embedding_dim, t.name)):
        args = (t.name, t.num_embeddings, t.embedding_dim)
        if kind in ("table_wise", "table_row_wise"):
            i = min(range(len(load)), key=lambda r: (load[r], r))
            load[i] += t.num_embeddings * t.embedding_dim
            out[t.name] = (plan_lib.table_wise(*args, i) if kind == "table_wise" else
                           plan_lib.table_row_wise(*args, list(range(i * local_world, (i + 1) * local_world))))
        elif kind == "row_wise":
            out[t.name] = plan_lib.row_wise(*args, list(range(world)))
        elif kind == "column_wise":
            out[t.name] = plan_lib.column_wise(*args, list(range(min(world, t.embedding_dim))))
        else:
            out[t.name] = plan_lib.data_parallel(t.name, t.num_embeddings, t.embedding_dim, world)
    plan = ShardingPlan(world_size=world, local_world_size=local_world,
                        tables={t.name: out[t.name] for t in tables})
    plan.validate()
    return plan
