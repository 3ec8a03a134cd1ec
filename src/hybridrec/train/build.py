"""``build_*``: turn a :class:`Config` into objects. Multi-step construction lives here,
so the classes themselves only store what they are given."""

from __future__ import annotations

import sys
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from hybridrec import launch_env, threads
from hybridrec.broadcast import rank0_value
from hybridrec.comm.codecs import TopKCodec, tune_topk
from hybridrec.comm.compress import (
    NoCompression,
)
from hybridrec.comm.ddp_hooks import CompressedAllReduce, HookFactory, PowerSGDHooks
from hybridrec.comm.ledger import CommLedger
from hybridrec.data.encode import ModuloEncoder
from hybridrec.data.loader import ShardedLoader
from hybridrec.data.schema import DatasetMeta
from hybridrec.data.stream import StreamLoader
from hybridrec.errors import HybridrecWarning
from hybridrec.metrics.logger import MetricLogger
from hybridrec.metrics.throughput import RunTotals
from hybridrec.model.deepfm import DeepFM
from hybridrec.model.dlrm import DLRM
from hybridrec.model.embedding import (
    tune_lookups,
)
from hybridrec.model.interaction import tune_interactions
from hybridrec.model.kernels import cache_path, machine_id
from hybridrec.model.mlp import tune_mlps
from hybridrec.parallel.dense_sync import (
    AllReduceSync,
    DDPSync,
    DenseSync,
    NoSync,
    dense_arches,
    synced_parameters,
)
from hybridrec.parallel.devices import choose_backend
from hybridrec.parallel.sharded_embedding import SHARDS, ShardedEmbeddingBagCollection
from hybridrec.parallel.topology import Topology
from hybridrec.sync import (
    BackgroundRunner,
    ForegroundRunner,
    RankReplica,
    SyncRunner,
    make_synchronizer,
)
from hybridrec.sync.algorithms import CATEGORY as SYNC_CATEGORY
from hybridrec.sync.algorithms import GroupMean
from hybridrec.sync.compressed import CompressedMean
from hybridrec.sync.grouped import GroupedBackgroundRunner
from hybridrec.train import init_from, run_files
from hybridrec.train.backends import (
    SparseBackend,
    build_dense_compressor,
    local_embeddings,
    sparse_backend,
)
from hybridrec.train.checkpointing import checkpoint as ckpt
from hybridrec.train.checkpointing.checkpointer import Attachment, Checkpointer, Component, TorchRNG
from hybridrec.train.checkpointing.deltas import ShardDeltas, deltas_dir, plan_json
from hybridrec.train.checkpointing.recovery import Recovery
from hybridrec.train.checkpointing.resident import shards_go_resident
from hybridrec.train.checkpointing.snapshots import clear_snapshots, recovery_dir, survivors_step
from hybridrec.train.loop.allocator import configure_allocator
from hybridrec.train.loop.checkpoint_policy import Checkpoints
from hybridrec.train.loop.early_stop import COMPONENT as EARLY_STOP
from hybridrec.train.loop.early_stop import EarlyStopping
from hybridrec.train.loop.optim import (
    LRSchedule,
    LRScheduler,
    build_dense_optimizer,
    dense_parameters,
)
from hybridrec.train.loop.parts import (
    Evaluation,
    FailureInjection,
    Part,
    Progress,
    StepSource,
    StopEarly,
    Sync,
    ThreadTiming,
)
from hybridrec.train.loop.pipeline import TrainPipeline
from hybridrec.train.loop.recovery_part import RecoveryPart, nothing_updating
from hybridrec.train.loop.sparse_optim import CombinedSparseOptimizer
from hybridrec.train.loop.stream import DynamicTables, OwnSlots, Progressive, StreamFeed
from hybridrec.train.loop.thread_governor import thread_governor
from hybridrec.train.loop.trainer import Optimizers, Trainer
from hybridrec.train.setup.config import CompressConfig, Config
from hybridrec.train.setup.rules import (
    RunFacts,
    check_run,
    group_size,
    planned_steps,
)
from hybridrec.train.setup.tables import build_tables, load_dataset


def build_model(cfg: Config, meta: DatasetMeta, *, embeddings=None, init_tables: bool | None = True) -> DLRM:
    """The DLRM around ``embeddings(tables)`` (a sparse backend's collection:
    :meth:`~hybridrec.train.backends.SparseBackend.embeddings`), by default one process's
    collection of every table. ``init_tables`` False: the tables start as zeros, for a
    checkpoint to overwrite (their ``reset_parameters()`` draws the initial values)."""
    torch.manual_seed(cfg.train.seed)
    tables = build_tables(meta, cfg)
    ebc = embeddings(tables) if embeddings is not None else local_embeddings(cfg, tables, init_tables=init_tables)
    arch = DeepFM if cfg.model.arch == "deepfm" else DLRM
    return arch(num_dense=len(meta.schema.dense), sparse=ebc, bottom_mlp=cfg.model.bottom_mlp,
                top_mlp=cfg.model.top_mlp, interaction=cfg.model.interaction, precision=cfg.train.precision,
                dcn_layers=cfg.model.dcn_layers, dcn_rank=cfg.model.dcn_rank)


def build_loaders(cfg: Config, meta: DatasetMeta, *, rank: int = 0, world_size: int = 1,
                  pin_memory: bool = False, topo: Topology | None = None):
    """The training and evaluation loaders of this rank (``pin_memory``: for a GPU, batches
    pinned by the loaders' prefetch threads; hierarchical training: every rank of every group
    its own part of the data); a stream's: its loader and no evaluation
    (``topo``: the ranks that agree on its files)."""
    d = cfg.data
    if d.stream:
        encode = None
        if cfg.model.tables == "modulo":
            sizes = meta.preprocessing["table_size"]
            encoders = [ModuloEncoder(sizes[f.name]) for f in meta.schema.onehot]

            def encode(keys):  # (the preprocessing's modulo encoding, column by column)
                return np.stack([e(keys[:, j]) for j, e in enumerate(encoders)], axis=1)
        # (a group of its own: the stream's thread agrees on files beside the step's collectives)
        group = topo.parallel_groups(1)[0] if topo is not None and topo.job_size > 1 else None
        return StreamLoader(d.stream, schema=meta.schema, encode=encode, batch_size=d.batch_size, rank=rank,
                            world_size=world_size, stop=d.stream_stop, poll_s=d.stream_poll_s, group=group,
                            device="cpu",
                            on_bad_line=d.on_bad_line, schema_file=d.stream_schema or None), None
    train = ShardedLoader(meta, split="train", batch_size=d.batch_size, rank=rank,
                          world_size=world_size, shuffle=d.shuffle, shuffle_window=d.shuffle_window,
                          seed=cfg.train.seed, drop_last=True, prefetch=d.prefetch, pin_memory=pin_memory,
                          workers=d.workers or None)
    evals = ShardedLoader(meta, split="eval", batch_size=d.eval_batch_size, rank=rank,
                          world_size=world_size, shuffle=False, drop_last=False, prefetch=d.prefetch,
                          pin_memory=pin_memory, workers=d.workers or None)
    return train, evals


def build_topology(cfg: Config) -> Topology:
    """A process group when launched by torchrun with several ranks, else one process;
    with ``dist.group_size`` below the world, this rank's group (hierarchical training)."""
    world = launch_env.world_size()
    if world <= 1:
        return Topology.single(single_device(cfg))
    local = launch_env.local_world_size(world)
    topo = Topology.init(backend=ranks_backend(cfg), timeout_s=cfg.dist.timeout_s,
                         group_size=group_size(cfg, world, local))
    topo.exchange = cfg.dist.exchange
    return topo


def run_facts(cfg: Config, meta: DatasetMeta | None, topo: Topology | None, *, building: bool = False) -> RunFacts:
    """What the run rules (:mod:`hybridrec.train.setup.rules`) check the config against: the
    ranks of ``topo``, or else of torchrun's environment, and the device they will train
    on (chosen as :func:`build_topology` chooses it, before any process group is made)."""
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if topo is not None:
        return RunFacts(world=topo.job_size, local_world=topo.local_world_size,
                        device=topo.device.type, gpus=gpus, meta=meta, building=building)
    world = launch_env.world_size()
    local = launch_env.local_world_size(world)
    device = (single_device(cfg).type if world <= 1 else
              "cuda" if choose_backend(cfg.dist.backend, local, gpus).gpus else "cpu")
    return RunFacts(world=world, local_world=local, device=device, gpus=gpus, meta=meta, building=building)


def single_device(cfg: Config) -> torch.device:
    """One process's device: the current GPU when CUDA is available and ``dist.backend`` is
    not ``gloo``, else the CPU (``nccl`` without CUDA: refused by the run rules)."""
    if cfg.dist.backend != "gloo" and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def ranks_backend(cfg: Config) -> str:
    """Several ranks' ``dist.backend`` setting, checked against this machine's GPUs before any
    process group is made (``nccl`` without a GPU per rank: ConfigError); rank 0 says once
    when the ranks share GPUs over gloo. :meth:`Topology.init` makes the same choice
    (:func:`~hybridrec.parallel.devices.choose_backend`) and places the rank."""
    ranks = launch_env.local_world_size()
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    choice = choose_backend(cfg.dist.backend, ranks, gpus)
    if (note := choice.note(ranks)) and launch_env.rank() == 0:
        print(note, file=sys.stderr, flush=True)
    return cfg.dist.backend


def build_dense_hooks(c: CompressConfig, ledger: CommLedger, *, seed: int = 0,
                      total_steps: int = 0, pairwise: bool = False) -> HookFactory | None:
    """The DDP comm hooks of the dense arches from ``compress.dense`` (None: the plain
    all-reduce). PowerSGD starts after at least 2 steps: DDP rebuilds its buckets after
    the first, and PyTorch's PowerSGD keys its error by bucket index."""
    if c.dense == "none":
        return None
    if c.dense == "powersgd":
        return PowerSGDHooks(rank=c.powersgd_rank, warmup_steps=max(2, c.dense_warmup_steps),
                             error_feedback=c.dense_error_feedback, seed=seed, ledger=ledger)
    return CompressedAllReduce(build_dense_compressor(c, total_steps=total_steps), ledger, pairwise=pairwise)


def build_dense_sync(cfg: Config, topo: Topology, ledger: CommLedger, *, total_steps: int = 0) -> DenseSync:
    """The dense-synchronization strategy of ``dist.dense_sync`` (one process, or a
    synchronizer of replicas (``sync.algorithm``): none)."""
    kind = cfg.dist.dense_sync
    pairwise = cfg.dist.exchange == "pairwise"
    if topo.group_size == 1 or kind == "none" or (cfg.sync.algorithm != "none" and not topo.hierarchical):
        return NoSync()  # (hierarchical: the synchronizer works across groups, DDP inside one)
    if kind == "ddp":
        return DDPSync(topo, hooks=build_dense_hooks(cfg.compress, ledger, seed=cfg.train.seed,
                                                     total_steps=total_steps, pairwise=pairwise), ledger=ledger)
    plain = cfg.compress.dense == "none"
    compressor = NoCompression() if plain else build_dense_compressor(cfg.compress, total_steps=total_steps)
    return AllReduceSync(topo, CompressedAllReduce(compressor, ledger, pairwise=pairwise), ledger=ledger,
                         predict=plain)


def build_sync_runner(cfg: Config, topo: Topology, model: torch.nn.Module, ledger: CommLedger) -> SyncRunner | None:
    """The runner of ``sync.algorithm``, on a process group of its own (None: no
    synchronizer, or one process). Flat: over every rank's dense replica. Hierarchical
    (several groups): over the cross group, of the whole replica: the dense part, then
    the member's embedding shards (:mod:`hybridrec.sync.grouped`)."""
    s = cfg.sync
    if s.algorithm == "none" or topo.job_size == 1:
        return None
    sync = make_synchronizer(s.algorithm, alpha=s.alpha, block_momentum=s.block_momentum,
                             block_lr=s.block_lr, nesterov=s.nesterov)
    dense = dense_parameters(model)
    if not topo.hierarchical:
        params, parts = dense, ()
        group = topo.parallel_groups(1)[0]  # collective: every rank, same order
    else:
        # Equal on every member first (the dense sync's parameters), then the member's own:
        # column blocks of partitioned layers, embedding shards.
        synced = {id(p) for _, m in dense_arches(model).items() for _, p in synced_parameters(m)}
        same = [p for p in dense if id(p) in synced]
        own = [p for p in dense if id(p) not in synced] + list(model.sparse.parameters())
        params, parts = same + own, (sum(p.numel() for p in same),)
        group = topo.cross_groups(1)[0]
    mean = build_sync_mean(cfg, group, ledger, parts)
    # The tables' rows move by the mean change of the groups that touched them; SGD's plain
    # mean of values is exact (sync/rows.py).
    rows = "all" if cfg.optim.sparse == "sgd" else "touched"
    if s.mode == "foreground":
        return ForegroundRunner(sync, params, group, ledger=ledger, every=s.every, mean=mean, rows=rows)
    kw = {"ledger": ledger, "write_back": s.write_back, "every": s.every, "interval_s": s.interval_s,
          "duty": s.duty, "mean": mean, "rows": rows}
    if not topo.hierarchical:  # (a checkpoint's ranks agree on its rounds over the training group)
        return BackgroundRunner(sync, params, group, train_group=topo.group, **kw)
    return GroupedBackgroundRunner(sync, params, group, members=topo.group,
                                   flag_group=topo.job_gloo_group(), **kw)


def build_sync_mean(cfg: Config, group, ledger: CommLedger, parts: tuple[int, ...]):
    """``sync.compress``: the rounds' mean, exact (``none``) or compressed."""
    s = cfg.sync
    if s.compress == "none":
        return GroupMean(group, ledger, parts)
    compressor = build_dense_compressor(CompressConfig(dense=s.compress, dense_ratio=s.compress_ratio,
                                                       dense_refresh_every=SYNC_REFRESH_EVERY))
    reducer = CompressedAllReduce(compressor, ledger, category=SYNC_CATEGORY, direction="sync")
    return CompressedMean(group, reducer, ledger, parts)


# sync.compress=dct: rounds between recomputations of the threshold. Rounds are far fewer
# than steps, so the top-k behind it is cheap to run often.
SYNC_REFRESH_EVERY = 10


def build_trainer(cfg: Config, *, meta: DatasetMeta | None = None, topo: Topology | None = None,
                  started_at: str | None = None, snapshot_dir: str | None = None,
                  extra_parts: Sequence[Part] = ()) -> Trainer:
    """The run's trainer, built in this order (each step a ``build_*`` of one job);
    ``started_at``: when this invocation started (the run's start, unless its checkpoint
    knows an earlier one); ``snapshot_dir``: the local launcher's directory on local memory
    for partial recovery's snapshots (``hybridrec train --snapshot-dir``; None:
    ``RUN/recovery/``); ``extra_parts``: more parts of the loop, after the run's own
    (:func:`hybridrec.train.run.train`)."""
    allocator = prepare_process(cfg)  # before the model and the loaders allocate
    meta = meta or load_dataset(cfg)
    check_run(cfg, run_facts(cfg, meta, topo, building=True))  # every option rule, before anything is built
    topo = topo or build_topology(cfg)
    backend = sparse_backend(cfg, topo)  # where the tables live: the one choice
    backend.check_memory(meta)  # before the model is allocated
    ledger, run_dir, start = CommLedger(), Path(cfg.train.run_dir), run_start(cfg, topo, snapshot_dir, backend)
    train_loader, eval_loader = build_loaders(cfg, meta, rank=topo.job_rank, world_size=topo.job_size,
                                              pin_memory=topo.device.type == "cuda", topo=topo)
    total_steps = planned_steps(cfg, len(train_loader))
    dense_sync = build_dense_sync(cfg, topo, ledger, total_steps=total_steps)
    model = build_run_model(cfg, meta, backend, ledger, dense_sync, run_dir, total_steps=total_steps,
                            init_tables=start.init_tables)
    sync_runner = build_sync_runner(cfg, topo, model, ledger)
    dense_opt, sparse_opt = build_optimizers(cfg, model, backend)
    kernels = kernels_record(cfg, model, topo, sparse_opt, dense_sync, allocator)
    pipeline, keymaps = build_pipeline(cfg, meta, train_loader, model, sparse_opt, topo, backend.row_reset(model))
    scheduler = build_scheduler(cfg, dense_opt, sparse_opt, total_steps, warn=topo.lead)
    totals, early_stop = build_run_totals(started_at), build_early_stop(cfg)
    components = checkpoint_components(topo, model, dense_opt, pipeline=pipeline, totals=totals,
                                       dense_sync=dense_sync, sync_runner=sync_runner, early_stop=early_stop,
                                       keymaps=keymaps, recovery=cfg.train.recovery)
    checkpointer = build_checkpointer(cfg, topo, run_dir, model, dense_opt, sparse_opt, components=components,
                                      attachment=backend.attachment, early_stop=early_stop)
    recovery = (build_recovery(cfg, topo, checkpointer, model, sparse_opt, run_dir, snapshot_dir)
                if start.recovering else None)
    run_dir.mkdir(parents=True, exist_ok=True)
    # train.init_from: another run's weights, only when this run has no checkpoint to resume.
    init_from.apply(cfg, meta, model=model, dense_opt=dense_opt, sparse_opt=sparse_opt, topo=topo,
                    run_dir=run_dir, resuming=start.resuming)
    logger = MetricLogger(run_dir, tensorboard=cfg.train.tensorboard, keep_until=start.keep_until) if topo.lead else None
    optim = Optimizers(dense_opt, sparse_opt, dense_sync, scheduler, nothing_updating)  # (recovery's part: its own)
    recovery_part = RecoveryPart(recovery, cfg.train, optim=optim, logger=logger) if recovery is not None else None
    checkpoints = Checkpoints(checkpointer, cfg.train, total_steps=total_steps, tables_drawn=start.init_tables,
                              hooks=recovery_part)
    parts = loop_parts(cfg, topo, total_steps=total_steps, run_dir=run_dir, logger=logger, totals=totals,
                       schedule=scheduler.schedule, eval_loader=eval_loader, early_stop=early_stop,
                       sync_runner=sync_runner, backend=backend, checkpoints=checkpoints, recovery=recovery_part)
    return Trainer(model=model, optim=optim, source=build_step_source(cfg, pipeline, model, backend, keymaps, logger),
                   checkpoints=checkpoints, parts=[*parts, *extra_parts], logger=logger, ledger=ledger,
                   total_steps=total_steps, topo=topo, kernels=kernels)


def prepare_process(cfg: Config) -> dict:
    """This process before anything allocates: ``train.threads``'s thread count and
    ``train.allocator`` (its record, summary.json's ``kernels.allocator``)."""
    if cfg.train.threads:
        torch.set_num_threads(cfg.train.threads)
    return configure_allocator(cfg.train.allocator)


@dataclass(frozen=True)
class RunStart:
    """What this invocation starts from, decided from the run directory before anything
    is built."""
    resuming: bool  # a checkpoint to resume from
    keep_until: int  # metrics of later steps are trained (and logged) again
    recovering: bool  # a failure of a rank (or a server) is recovered: train.recovery
    init_tables: bool | None  # True drawn, False zeros (a checkpoint overwrites them), None not even zeroed


def run_start(cfg: Config, topo: Topology, snapshot_dir: str | None, backend: SparseBackend) -> RunStart:
    """:class:`RunStart`. Metrics of steps after the checkpoint it resumes from are trained
    (and logged) again; with ``train.recovery=partial`` kept up to the survivors' step. A
    checkpoint to resume from overwrites the tables: they start as zeros rather than drawn
    (0.3 s per 330 MB of a restart); the trainer draws them if none is restored
    (``backend.initial_tables``: synchronizers take the tables' values when built, parameter
    servers hold their own: drawn). Recovery: when a failure can hit several processes
    (``backend.processes``: several ranks, or a parameter server, even under a single
    trainer), not groups or Hogwild threads."""
    run_dir = Path(cfg.train.run_dir)
    latest = ckpt.list_checkpoints(run_dir) if cfg.train.resume else []
    keep_until = latest[-1][0] if latest else 0
    if cfg.train.resume and cfg.train.recovery == "partial":
        keep_until = max(keep_until, survivors_step(run_dir) or 0)
    init_tables = backend.initial_tables(bool(latest))
    recovering = (cfg.train.save_checkpoints and backend.processes() > 1
                  and not (topo.hierarchical or cfg.train.workers > 1))
    if not init_tables and recovering and shards_go_resident(cfg, snapshot_dir) and topo.device.type == "cpu":
        init_tables = None  # (not even zeroed: the trainer moves them into files of local memory first)
    return RunStart(bool(latest), keep_until, recovering, init_tables)


def build_run_model(cfg: Config, meta: DatasetMeta, backend: SparseBackend, ledger: CommLedger,
                    dense_sync: DenseSync, run_dir: Path, *, total_steps: int,
                    init_tables: bool | None) -> torch.nn.Module:
    """The run's model: the DLRM around the backend's embeddings (one process's tables,
    this rank's shards, or the parameter servers' rows), placed by the backend
    (:mod:`hybridrec.train.backends`)."""
    def embeddings(tables):
        return backend.embeddings(meta, tables, ledger=ledger, total_steps=total_steps, init_tables=init_tables)

    return backend.place(build_model(cfg, meta, embeddings=embeddings), ledger=ledger, dense_sync=dense_sync,
                         run_dir=run_dir, total_steps=total_steps)


def build_optimizers(cfg: Config, model: torch.nn.Module, backend: SparseBackend) -> tuple[torch.optim.Optimizer,
                                                                                           CombinedSparseOptimizer]:
    """The dense optimizer and the backend's sparse one (parameter servers: pushes to them)."""
    return build_dense_optimizer(dense_parameters(model), cfg.optim), backend.sparse_optimizer(model)


def kernels_record(cfg: Config, model: torch.nn.Module, topo: Topology, sparse_opt, dense_sync: DenseSync,
                   allocator: dict) -> dict:
    """summary.json's ``kernels``: :func:`tune_kernels` (timed here, before training), the
    allocator, the helper threads and ``compress.dense_when=pays``'s record."""
    kernels = {**tune_kernels(cfg, model, topo, sparse_opt), "allocator": allocator,
               "helper_threads": threads.status()}
    if (dense_record := getattr(dense_sync, "compression", None)) is not None:
        kernels["dense_compression"] = dense_record
    return kernels


def warmup_problem(warmup_steps: int, total_steps: int) -> str | None:
    """What is wrong with a warm-up of ``warmup_steps`` over a run of ``total_steps`` (0:
    unknown), or None: more than half of the run (a small dataset's few steps) leaves the
    learning rates under their peak for most of it. Measured: a 16,000-row table at batch 1024
    had 48 steps in 3 epochs, all inside a 100-step warm-up, and lost 0.023 AUC
    (docs/experiments/defaults.md)."""
    if not warmup_steps or not total_steps or 2 * warmup_steps <= total_steps:
        return None
    where = "never reach their peak" if warmup_steps >= total_steps else "reach their peak only in its second half"
    return (f"optim.warmup_steps={warmup_steps:,} is {warmup_steps / total_steps:.0%} of this run's {total_steps:,} "
            f"steps: the learning rates {where}; on a small dataset set a shorter warm-up "
            "(optim.warmup_steps=N) or more train.epochs")


def build_scheduler(cfg: Config, dense_opt, sparse_opt, total_steps: int, *, warn: bool = True) -> LRScheduler:
    """The learning rates' schedule (``warn``: say so where :func:`warmup_problem` finds one:
    global rank 0 alone)."""
    o = cfg.optim
    if warn and (problem := warmup_problem(o.warmup_steps, total_steps)) is not None:
        warnings.warn(problem, HybridrecWarning, stacklevel=2)
    schedule = LRSchedule(o.warmup_steps, o.decay, o.decay_start, total_steps)
    return LRScheduler(schedule, dense_opt, sparse_opt, dense_lr=o.dense_lr, sparse_lr=o.sparse_lr)


def build_run_totals(started_at: str | None) -> RunTotals:
    totals = RunTotals()
    if started_at is not None:
        totals.begin(started_at)
    return totals


def build_early_stop(cfg: Config) -> EarlyStopping | None:
    return EarlyStopping(cfg.train.early_stop, cfg.train.early_stop_min_delta) if cfg.train.early_stop else None


def checkpoint_components(topo: Topology, model: torch.nn.Module, dense_opt, *, pipeline, totals: RunTotals,
                          dense_sync: DenseSync, sync_runner, early_stop: EarlyStopping | None,
                          keymaps: DynamicTables | None = None, recovery: str = "full") -> list[Component]:
    """Everything a checkpoint holds besides the model and the optimizers (``recovery``:
    ``train.recovery``; partial: each rank's own slots of the key maps too, for its
    snapshot)."""
    components = [Component("loader", pipeline), Component("run_totals", totals),
                  Component("dense_sync", dense_sync, per_rank=True), Component("rng", TorchRNG(), per_rank=True)]
    if keymaps is not None:  # (the dynamic tables' maps: every rank's slots, merged)
        components.append(Component("keymaps", keymaps))
        if recovery == "partial":  # (a snapshot's: this rank's slots, without a collective)
            components.append(Component("keymaps_own", OwnSlots(keymaps), per_rank=True,
                                        snapshot_only=True))
    if (reducer := getattr(model.sparse, "dp_reducer", None)) is not None:
        components.append(Component("replicated_compressor", reducer, per_rank=True))
    if sync_runner is not None:
        # (hierarchical: member j's replica holds its own shards: saved per rank)
        components.append(Component("sync", sync_runner, per_rank=topo.hierarchical))
        if not topo.hierarchical:  # each rank's replica and dense optimizer (group 0 saves alone)
            components.append(Component("sync_replica", RankReplica(sync_runner, dense_opt), per_rank=True))
    if early_stop is not None:  # its state (the best step) in every checkpoint
        components.append(Component(EARLY_STOP, early_stop))
    return components


def build_checkpointer(cfg: Config, topo: Topology, run_dir: Path, model, dense_opt, sparse_opt, *,
                       components: list[Component], attachment: Attachment,
                       early_stop: EarlyStopping | None) -> Checkpointer:
    """The run's checkpointer (``attachment``: the backend's); with ``train.early_stop``, the
    best step's checkpoint kept too."""
    return Checkpointer(run_dir, topo, model=model, dense_opt=dense_opt, sparse_opt=sparse_opt,
                        components=components, keep=cfg.train.keep_checkpoints, attachment=attachment,
                        keep_also=early_stop.kept_steps if early_stop is not None else None,
                        background=cfg.train.async_checkpoint)


def build_recovery(cfg: Config, topo: Topology, checkpointer: Checkpointer, model, sparse_opt, run_dir: Path,
                   snapshot_dir: str | None) -> Recovery:
    """What a failure lost, and with ``train.recovery=partial`` the survivors' snapshots (not
    for one process, which nobody survives, nor groups or Hogwild threads:
    rules.recovery_problem; parameter servers: their side is
    :mod:`hybridrec.train.checkpointing.server_recovery`)."""
    return Recovery(checkpointer, mode=cfg.train.recovery, global_batch=cfg.data.batch_size * topo.group_size,
                    deltas=build_shard_deltas(cfg, topo, model, sparse_opt, run_dir), fast_dir=snapshot_dir)


def build_pipeline(cfg: Config, meta: DatasetMeta, loader, model, sparse_opt, topo: Topology, reset=None):
    """The pipeline over the training batches and, for dynamic tables, their key maps (the
    stream's raw keys mapped to rows before the pipeline takes a batch; ``reset``: where their
    fresh rows go when the tables are held elsewhere, the backend's ``row_reset``)."""
    keymaps = None
    if cfg.model.tables == "dynamic":
        m, tables = cfg.model, build_tables(meta, cfg)
        keymaps = DynamicTables({t.name: t.num_embeddings for t in tables}, admit_after=m.admit_after,
                                evict=m.evict, ttl_steps=m.ttl_steps, seed=cfg.train.seed, model_sparse=model.sparse,
                                sparse_opt=sparse_opt, topo=topo, dims={t.name: t.embedding_dim for t in tables},
                                reset=reset)
    if cfg.data.stream:  # (read, parsed and key-mapped ahead on a thread)
        loader = StreamFeed(loader, keymaps)
    return TrainPipeline(loader, model.sparse, enabled=cfg.dist.pipeline, device=topo.device), keymaps


def build_step_source(cfg: Config, pipeline, model, backend: SparseBackend, keymaps: DynamicTables | None = None,
                      logger: MetricLogger | None = None) -> StepSource:
    """The loop's steps: a stream's, else the backend's (a parameter-server trainer's,
    Hogwild's threads', or one thread's)."""
    if cfg.data.stream:
        return backend.stream_steps(pipeline, model, keymaps, log_every=cfg.train.log_every, logger=logger)
    return backend.step_source(pipeline, model)


def loop_parts(cfg: Config, topo: Topology, *, total_steps: int, run_dir: Path, logger, totals, schedule,
               eval_loader, early_stop, sync_runner, backend: SparseBackend, checkpoints: Checkpoints,
               recovery: RecoveryPart | None) -> list[Part]:
    """The training loop's parts besides its step source, in the order of their hooks
    (:mod:`hybridrec.train.loop.parts`): failure injection, the thread count, the
    synchronizer, progress, evaluation (and early stopping), checkpoints, recovery."""
    t = cfg.train
    parts: list[Part] = [FailureInjection(t.inject_failure, rank=topo.job_rank, run_dir=run_dir)]
    governor = thread_governor(t.threads, world_size=topo.job_size, workers=t.workers, device=topo.device)
    if governor is not None:
        parts.append(ThreadTiming(governor))
    if sync_runner is not None:
        parts.append(Sync(sync_runner))
    parts.append(Progress(total_steps=total_steps, log_every=t.log_every, show=t.progress and topo.lead,
                          tty=sys.stderr.isatty(), log_interval_s=t.log_interval_s, logger=logger, totals=totals,
                          lr_factor=schedule.factor))
    if eval_loader is not None:  # (a stream has none: its metrics are test-then-train)
        parts.append(Evaluation(eval_loader, eval_every=t.eval_every, total_steps=total_steps,
                                early_stop=early_stop, save_best=t.save_checkpoints,
                                changes_after_stop=sync_runner is not None or backend.changes_after_stop,
                                logger=logger))
    else:
        parts.append(Progressive(t.progressive_window, log_every=t.log_every, logger=logger, topo=topo))
    if early_stop is not None:
        parts.append(StopEarly(early_stop, total_steps=total_steps, run_dir=run_dir, saved=t.save_checkpoints))
    parts.append(checkpoints)
    if recovery is not None:
        parts.append(recovery)
    return parts


def build_shard_deltas(cfg: Config, topo: Topology, model, sparse_opt, run_dir: Path) -> ShardDeltas | None:
    """``train.shard_delta_every``: this rank's incremental saves of its shards (None: off,
    one process, or no shard here)."""
    t, ebc = cfg.train, model.sparse
    shards = ebc.updated_collections().get(SHARDS)
    if not t.shard_delta_every or shards is None or SHARDS not in sparse_opt.optimizers:
        return None
    return ShardDeltas(shards, sparse_opt.optimizers[SHARDS], directory=deltas_dir(recovery_dir(run_dir), topo.rank),
                       plan=plan_json(ebc), every=t.shard_delta_every,
                       rows=t.shard_delta_rows, hot=t.shard_delta_hot)


def tune_kernels(cfg: Config, model: torch.nn.Module, topo: Topology,
                 sparse_opt: CombinedSparseOptimizer | None = None) -> dict:
    """Every MLP layer's linear implementation, timed on this machine at the training batch
    (``train.kernels``); with several ranks, rank 0's choices (timed while every rank
    times, as they will train). With ``sparse_opt``, each local fused table's row update
    too (timed at the ids of a one-hot global batch per feature, each rank for its own
    tables). What ``summary.json`` records under ``kernels``."""
    device = next(p.device for p in dense_parameters(model)).type
    dtype = "bfloat16" if cfg.train.precision == "bf16" else "float32"

    agree = (lambda picks: rank0_value(picks, topo.run_group, device=topo.comm_device)) if topo.job_size > 1 else None
    choices = tune_mlps(model, cfg.data.batch_size, mode=cfg.train.kernels, device=device, dtype=dtype,
                        agree=agree)
    dots = tune_interactions(model, cfg.data.batch_size, mode=cfg.train.kernels, device=device, dtype=dtype,
                             agree=agree)
    rows = (sparse_opt.tune_kernels(cfg.data.batch_size * topo.group_size, mode=cfg.train.kernels)
            if sparse_opt is not None else [])
    ebc = getattr(model, "sparse", None)
    local = list(ebc.updated_collections().values()) if ebc is not None else []
    lookups = tune_lookups(local, cfg.data.batch_size * topo.group_size, mode=cfg.train.kernels)
    out = {"mode": cfg.train.kernels, "machine": machine_id(), "cache": str(cache_path()),
           "linear": [c.to_dict() for c in choices], "interaction": [c.to_dict() for c in dots],
           "embedding_update": [c.to_dict() for c in rows], "embedding_lookup": [c.to_dict() for c in lookups]}
    if getattr(ebc, "compression", None) is not None:  # (compress.embedding_when=pays)
        out["embedding_compression"] = ebc.compression
    if isinstance(ebc, ShardedEmbeddingBagCollection) and ebc.layout.coded is not None:
        # DCT-MP's codec over this rank's pieces, the other ranks' samples at once (its own
        # samples' rows do not travel and are not coded: coded_dist)
        crossing = cfg.data.batch_size * (ebc.layout.world_size - 1)
        uses = [(g.codec, crossing * g.n, g.cols) for g in ebc.layout.coded_of(topo.rank).groups
                if isinstance(g.codec, TopKCodec) and crossing]
        if uses:
            out["dct_topk"] = [c.to_dict() for c in tune_topk(uses, mode=cfg.train.kernels, device=device)]
    return out


def start_over(run_dir: Path, snapshot_dir: str | None = None) -> None:
    """``train.resume=false``: the previous run's files go (config, checkpoints, metrics,
    summary, events, report: :data:`hybridrec.train.run_files.FILES` and ``DIRS``), so that
    nothing of it is resumed or mixed into the new run's files later; anything else in the
    directory is refused first, in one line, and nothing is deleted
    (:func:`~hybridrec.train.run_files.check_start_over`). Called by
    :func:`hybridrec.train.run.train` (rank 0) before the trainer is built: building deletes
    nothing."""
    run_files.check_start_over(run_dir)
    clear_snapshots(run_dir, snapshot_dir)  # (also those on the launcher's local memory)
    run_files.clear(run_dir)
