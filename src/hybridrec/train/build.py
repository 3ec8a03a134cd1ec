"""``build_*``: turn a :class:`Config` into objects. Multi-step construction lives here,
so the classes themselves only store what they are given."""

from __future__ import annotations

import os
import platform
import warnings
from pathlib import Path

import numpy as np
import torch

import hybridrec
from hybridrec.comm.codecs import Codec, make_codec
from hybridrec.comm.compress import (
    CastCompressor,
    DCTCompressor,
    GradientCompressor,
    NoCompression,
    TopKCompressor,
)
from hybridrec.comm.ddp_hooks import CompressedAllReduce, HookFactory, PowerSGDHooks
from hybridrec.comm.ledger import CommLedger
from hybridrec.data.loader import ShardedLoader
from hybridrec.data.schema import DatasetMeta
from hybridrec.errors import ConfigError
from hybridrec.metrics.logger import MetricLogger
from hybridrec.model.deepfm import DeepFM
from hybridrec.model.dlrm import DLRM
from hybridrec.model.embedding import EmbeddingBagCollection, TableConfig
from hybridrec.train.config import CompressConfig, Config
from hybridrec.train.optim import (
    LRSchedule,
    LRScheduler,
    build_dense_optimizer,
    dense_parameters,
)
from hybridrec.parallel import plan as plan_lib
from hybridrec.parallel.dense_sync import AllReduceSync, DDPSync, DenseSync, NoSync
from hybridrec.parallel.parallelize import parallelize_dlrm
from hybridrec.parallel.plan import ShardingPlan
from hybridrec.parallel.planner import plan_sharding
from hybridrec.parallel.sharded_embedding import ShardedEmbeddingBagCollection
from hybridrec.parallel.topology import Topology
from hybridrec.train.sparse_optim import CombinedSparseOptimizer, combined_sparse_optimizer
from hybridrec.train.checkpointer import Checkpointer, Component, TorchRNG
from hybridrec.train.pipeline import TrainPipeline
from hybridrec.train.trainer import Trainer


def load_dataset(cfg: Config) -> DatasetMeta:
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


def build_model(cfg: Config, meta: DatasetMeta, *, plan: ShardingPlan | None = None,
                topo: Topology | None = None, ledger: CommLedger | None = None) -> DLRM:
    """The single-device DLRM, or with ``plan`` one whose embedding collection holds only
    this rank's shards (the whole tables are never materialised on a rank)."""
    torch.manual_seed(cfg.train.seed)
    tables = build_tables(meta, cfg)
    if plan is None:
        ebc = EmbeddingBagCollection(tables, seed=cfg.train.seed)
    else:
        ebc = ShardedEmbeddingBagCollection(tables, plan, topo, seed=cfg.train.seed, ledger=ledger,
                                            codecs=build_embedding_codecs(cfg, tables, plan))
    arch = DeepFM if cfg.model.arch == "deepfm" else DLRM
    try:
        return arch(num_dense=len(meta.schema.dense), sparse=ebc, bottom_mlp=cfg.model.bottom_mlp,
                    top_mlp=cfg.model.top_mlp, interaction=cfg.model.interaction)
    except ValueError as e:
        raise ConfigError(str(e)) from None


def build_embedding_codecs(cfg: Config, tables: list[TableConfig],
                           plan: ShardingPlan) -> dict[str, Codec]:
    """The per-table policy of ``compress.embedding*``: table -> codec of its output_dist
    hop. One codec for every chosen table: the sharded ones (data-parallel tables have
    no hop) named in ``embedding_tables`` (empty: all) with at least
    ``embedding_min_rows`` rows. Tables left out travel as float32."""
    c = cfg.compress
    codec = make_codec(c.embedding, eta=c.embedding_ratio, values=c.embedding_values)
    if codec is None:
        return {}
    names = {t.name for t in tables}
    unknown = sorted(set(c.embedding_tables) - names)
    if unknown:
        raise ConfigError(f"compress.embedding_tables: no tables named {unknown}")
    return {t.name: codec for t in tables
            if plan.tables[t.name].sharding_type != "data_parallel"
            and (not c.embedding_tables or t.name in c.embedding_tables)
            and t.num_embeddings >= c.embedding_min_rows}


def build_loaders(cfg: Config, meta: DatasetMeta, *, rank: int = 0, world_size: int = 1):
    d = cfg.data
    train = ShardedLoader(meta, split="train", batch_size=d.batch_size, rank=rank,
                          world_size=world_size, shuffle=d.shuffle, shuffle_window=d.shuffle_window,
                          seed=cfg.train.seed, drop_last=True, prefetch=d.prefetch)
    if len(train) == 0:
        raise ConfigError(
            f"data.batch_size={d.batch_size} x {world_size} rank(s) is larger than the "
            f"{meta.split_rows('train')} training rows of {meta.path}"
        )
    evals = ShardedLoader(meta, split="eval", batch_size=d.eval_batch_size, rank=rank,
                          world_size=world_size, shuffle=False, drop_last=False, prefetch=d.prefetch)
    return train, evals


# Link bandwidth the automatic plan assumes (bytes/s): 10 Gbit/s, a common data-centre
# NIC; use `hybridrec plan --bandwidth ... --out plan.json` and dist.plan for another.
AUTO_PLAN_BANDWIDTH = 10e9 / 8


def build_topology(cfg: Config) -> Topology:
    """A process group when launched by torchrun with several ranks, else one process."""
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return Topology.single()
    backend = None if cfg.dist.backend == "auto" else cfg.dist.backend
    topo = Topology.init(backend=backend, timeout_s=cfg.dist.timeout_s)
    topo.exchange = cfg.dist.exchange
    return topo


def build_plan(cfg: Config, tables: list[TableConfig], topo: Topology,
               meta: DatasetMeta | None = None) -> ShardingPlan:
    if cfg.dist.plan:
        try:
            plan = ShardingPlan.from_json(Path(cfg.dist.plan).read_text())
        except (OSError, ValueError, KeyError) as e:
            raise ConfigError(f"dist.plan {cfg.dist.plan}: {e}") from None
        if plan.world_size != topo.world_size:
            raise ConfigError(f"dist.plan {cfg.dist.plan} is for {plan.world_size} ranks, "
                              f"this run has {topo.world_size}")
        return plan
    if cfg.dist.sharding == "auto":
        return plan_sharding(tables, world_size=topo.world_size, local_world_size=topo.local_world_size,
                             stats=meta.stats if meta else None, batch_size_per_rank=cfg.data.batch_size,
                             bandwidth_bytes_per_s=AUTO_PLAN_BANDWIDTH, optimizer=cfg.optim.sparse)
    return uniform_plan(cfg.dist.sharding, tables, topo.world_size, topo.local_world_size)


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


def build_sparse_optimizers(cfg: Config, sparse) -> CombinedSparseOptimizer:
    """One sparse optimizer per local collection (a sharded model: its shards and its
    replicated tables), behind one interface."""
    kwargs = {} if cfg.optim.sparse == "sgd" else {"eps": cfg.optim.eps}
    return combined_sparse_optimizer(cfg.optim.sparse, sparse, lr=cfg.optim.sparse_lr, **kwargs)


def build_dense_compressor(c: CompressConfig) -> GradientCompressor:
    """The payload compressor of ``compress.dense`` (dct, topk, fp16 or bf16)."""
    if c.dense == "dct":
        return DCTCompressor(c.dense_ratio, c.dense_refresh_every, error_feedback=c.dense_error_feedback,
                             warmup_steps=c.dense_warmup_steps)
    if c.dense == "topk":
        return TopKCompressor(c.dense_ratio, error_feedback=c.dense_error_feedback,
                              warmup_steps=c.dense_warmup_steps)
    if c.dense in ("fp16", "bf16"):
        return CastCompressor(c.dense, warmup_steps=c.dense_warmup_steps)
    raise ConfigError(f"compress.dense={c.dense!r} is not a payload compressor")


def build_dense_hooks(c: CompressConfig, ledger: CommLedger, *, seed: int = 0) -> HookFactory | None:
    """The DDP comm hooks of the dense arches from ``compress.dense`` (None: the plain
    all-reduce). PowerSGD starts after at least 2 steps: DDP rebuilds its buckets after
    the first, and PyTorch's PowerSGD keys its error by bucket index."""
    if c.dense == "none":
        return None
    if c.dense == "powersgd":
        return PowerSGDHooks(rank=c.powersgd_rank, warmup_steps=max(2, c.dense_warmup_steps),
                             error_feedback=c.dense_error_feedback, seed=seed, ledger=ledger)
    return CompressedAllReduce(build_dense_compressor(c), ledger)


def build_dense_sync(cfg: Config, topo: Topology, ledger: CommLedger) -> DenseSync:
    """The dense-synchronization strategy of ``dist.dense_sync`` (one process: none)."""
    kind = cfg.dist.dense_sync
    if topo.world_size == 1 or kind == "none":
        return NoSync()
    if kind == "ddp":
        return DDPSync(topo, hooks=build_dense_hooks(cfg.compress, ledger, seed=cfg.train.seed),
                       ledger=ledger)
    if cfg.compress.dense == "powersgd":
        raise ConfigError("compress.dense=powersgd runs as a DDP comm hook: use dist.dense_sync=ddp")
    plain = cfg.compress.dense == "none"
    compressor = NoCompression() if plain else build_dense_compressor(cfg.compress)
    return AllReduceSync(topo, CompressedAllReduce(compressor, ledger), ledger=ledger, predict=plain)


def build_parallel_model(cfg: Config, meta: DatasetMeta, topo: Topology, ledger: CommLedger,
                         dense_sync: DenseSync, run_dir: Path) -> torch.nn.Module:
    """Several ranks: plan the sharding, build this rank's shards and apply parallelism;
    rank 0 writes the plan into the run directory."""
    plan = build_plan(cfg, build_tables(meta, cfg), topo, meta)
    cw = [n for n, tp in plan.tables.items() if tp.sharding_type == "column_wise"]
    if cw and cfg.optim.sparse == "rowwise_adagrad" and topo.rank == 0:
        warnings.warn(f"column-wise tables {cw[:3]} with row-wise Adagrad keep one accumulator per "
                      "column shard: training will not equal one process exactly", stacklevel=1)
    model = parallelize_dlrm(build_model(cfg, meta, plan=plan, topo=topo, ledger=ledger),
                             plan, topo, ledger=ledger, dense_sync=dense_sync)
    if topo.rank == 0:
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "plan.json").write_text(plan.to_json())
    return model


def build_trainer(cfg: Config, *, meta: DatasetMeta | None = None, topo: Topology | None = None) -> Trainer:
    if cfg.train.threads:
        torch.set_num_threads(cfg.train.threads)
    meta = meta or load_dataset(cfg)
    topo = topo or build_topology(cfg)
    ledger = CommLedger()
    run_dir = Path(cfg.train.run_dir)
    dense_sync = build_dense_sync(cfg, topo, ledger)
    if topo.world_size == 1:
        model = build_model(cfg, meta)
    else:
        model = build_parallel_model(cfg, meta, topo, ledger, dense_sync, run_dir)
    dense_opt = build_dense_optimizer(dense_parameters(model), cfg.optim)
    sparse_opt = build_sparse_optimizers(cfg, model.sparse)
    train_loader, eval_loader = build_loaders(cfg, meta, rank=topo.rank, world_size=topo.world_size)
    pipeline = TrainPipeline(train_loader, model.sparse, enabled=cfg.dist.pipeline)
    total_steps = planned_steps(cfg, len(train_loader))
    schedule = LRSchedule(cfg.optim.warmup_steps, cfg.optim.decay, cfg.optim.decay_start, total_steps)
    scheduler = LRScheduler(schedule, dense_opt, sparse_opt,
                            dense_lr=cfg.optim.dense_lr, sparse_lr=cfg.optim.sparse_lr)
    checkpointer = Checkpointer(run_dir, topo, model=model, dense_opt=dense_opt, sparse_opt=sparse_opt,
                                components=[Component("loader", pipeline),
                                            Component("dense_sync", dense_sync, per_rank=True),
                                            Component("rng", TorchRNG(), per_rank=True)],
                                keep=cfg.train.keep_checkpoints)
    run_dir.mkdir(parents=True, exist_ok=True)
    logger = MetricLogger(run_dir, tensorboard=cfg.train.tensorboard) if topo.rank == 0 else None
    return Trainer(cfg=cfg, model=model, dense_opt=dense_opt, sparse_opt=sparse_opt, dense_sync=dense_sync,
                   scheduler=scheduler, pipeline=pipeline, eval_loader=eval_loader,
                   checkpointer=checkpointer, logger=logger, ledger=ledger, run_dir=run_dir,
                   total_steps=total_steps, topo=topo)


def planned_steps(cfg: Config, per_epoch: int) -> int:
    total = cfg.train.epochs * per_epoch
    return min(total, cfg.train.max_steps) if cfg.train.max_steps else total


def versions() -> dict:
    return {"hybridrec": hybridrec.__version__, "torch": torch.__version__, "numpy": np.__version__,
            "python": platform.python_version(), "platform": platform.platform(),
            "threads": torch.get_num_threads()}
