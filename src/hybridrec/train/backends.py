"""The sparse backends: where a run's embedding tables live, and everything that follows from it.

A run's tables live in one of three places, chosen once from the config and the topology
(:func:`sparse_backend`):

=====================  ================================  ====================================
backend                the tables                        the sparse optimizer
=====================  ================================  ====================================
:class:`LocalBackend`  one process's collection          row updates here
:class:`ShardedBackend`  several ranks' shards (the plan)  row updates of each rank's shards
:class:`ServerBackend`   the parameter servers             pushes to the servers
=====================  ================================  ====================================

Each supplies: the model's embeddings (and its placement around them:
:func:`hybridrec.train.build.build_run_model` builds the DLRM between the two), the sparse
optimizer, the loop's step source, the checkpoint attachment (what the trainers' checkpoint
carries besides their own state: the servers' part ``step-N/ps/``; a no-op for the others,
:data:`~hybridrec.train.checkpointing.checkpointer.NO_ATTACHMENT`), the memory check (in the
ranks, and at a local launch), whether resumed tables start drawn, the processes a failure
can hit (recovery), and whether the tables change after the loop stops. A checkpoint's
weights are read by the backend that wrote it, told by its layout (:func:`stored_backend`).

Here too: the sharded model's construction (the plan, the codecs of its pooled-embedding
hop, the dense part's placement and parallelism) and :func:`build_dense_compressor`, which
the sharded model and the dense synchronization (:mod:`hybridrec.train.build`) share.
"""

from __future__ import annotations

import json
import sys
import warnings
from pathlib import Path
from typing import ClassVar

import torch

from hybridrec.comm.codecs import Codec, make_codec
from hybridrec.comm.compress import (
    CastCompressor,
    DCTCompressor,
    GradientCompressor,
    TopKCompressor,
    auto_refresh_every,
)
from hybridrec.comm.ddp_hooks import CompressedAllReduce
from hybridrec.comm.ledger import CommLedger
from hybridrec.data.schema import DatasetMeta
from hybridrec.files import write_text_atomic
from hybridrec.model.embedding import WEIGHT_DTYPES, EmbeddingBagCollection, TableConfig
from hybridrec.model.kernels import PRECISIONS
from hybridrec.parallel.checkpoint import load_sharded, load_state
from hybridrec.parallel.dense_sync import DenseSync, NoSync, dense_arches, synced_parameters
from hybridrec.parallel.parallelize import parallelize_dlrm
from hybridrec.parallel.plan import ShardingPlan
from hybridrec.parallel.sharded_embedding import ShardedEmbeddingBagCollection
from hybridrec.parallel.threshold_dist import ThresholdMP
from hybridrec.parallel.topology import Topology
from hybridrec.ps.client import PushOptimizer, RemoteEmbeddingCollection
from hybridrec.train.checkpointing.checkpointer import NO_ATTACHMENT, Attachment
from hybridrec.train.loop.hogwild import HogwildSteps
from hybridrec.train.loop.parts import ServerSteps, StepSource
from hybridrec.train.loop.sparse_optim import CombinedSparseOptimizer, combined_sparse_optimizer
from hybridrec.train.loop.stream import StreamSteps
from hybridrec.train.ps_run import PS_DIR, ServerCheckpoints, local_servers_memory_problem, ps_plan
from hybridrec.train.setup.config import CompressConfig, Config
from hybridrec.train.setup.memory import check_memory, memory_problem
from hybridrec.train.setup.rules import check_plan, dense_plan
from hybridrec.train.setup.tables import build_plan


class SparseBackend:
    """Where the tables live (the trainers, in one process or several): the base of the three
    backends; the trainers hold every table, so what is theirs is here. Built once per run,
    for this rank (``topo``), by :func:`sparse_backend`."""

    attachment: Attachment = NO_ATTACHMENT
    """What the trainers' checkpoints carry besides their own state (a no-op: nothing)."""
    changes_after_stop = False
    """Whether the tables change after the loop stops (the evaluation that stopped training
    is then done again)."""

    def __init__(self, cfg: Config, topo: Topology) -> None:
        self.cfg, self.topo = cfg, topo

    # -- before anything is built ------------------------------------------------------------
    def check_memory(self, meta: DatasetMeta) -> None:
        """Refuse tables this rank's machine cannot hold, before the model is allocated
        (collective with several ranks)."""
        check_memory(self.cfg, meta, self.topo)

    @classmethod
    def launch_memory_problem(cls, cfg: Config, meta: DatasetMeta, *, world_size: int, group: int) -> str | None:
        """A local launch's check of this machine, before any rank starts: ``world_size``
        ranks in groups of ``group`` (hierarchical: every group holds every table)."""
        return memory_problem(cfg, meta, world_size=group, local_world_size=group, groups=world_size // group,
                              hierarchical=group < world_size)

    def initial_tables(self, resuming: bool) -> bool:
        """Whether the tables start drawn (False: zeros, a checkpoint to resume overwrites
        them); a synchronizer takes the tables' values when it is built: drawn."""
        return not resuming or self.cfg.sync.algorithm != "none"

    def processes(self) -> int:
        """The processes a failure can hit: the trainers, and whatever the attachment adds."""
        return self.attachment.processes(self.topo.group_size)

    # -- the model ---------------------------------------------------------------------------
    def embeddings(self, meta: DatasetMeta, tables: list[TableConfig], *, ledger: CommLedger, total_steps: int,
                   init_tables: bool | None) -> torch.nn.Module:
        """The model's embedding collection (called by
        :func:`~hybridrec.train.build.build_model`, seeded, with the run's tables)."""
        raise NotImplementedError

    def place(self, model: torch.nn.Module, *, ledger: CommLedger, dense_sync: DenseSync, run_dir: Path,
              total_steps: int) -> torch.nn.Module:
        """The model around :meth:`embeddings`, placed for training."""
        raise NotImplementedError

    def sparse_optimizer(self, model: torch.nn.Module) -> CombinedSparseOptimizer:
        """The optimizer of the tables' rows."""
        return build_sparse_optimizers(self.cfg, model.sparse)

    def step_source(self, pipeline, model: torch.nn.Module) -> StepSource:
        """The loop's steps (a stream's come first: :func:`~hybridrec.train.build.build_step_source`):
        Hogwild's threads' (``train.workers``), or one thread's."""
        workers = self.cfg.train.workers
        return HogwildSteps(pipeline, workers) if workers > 1 else StepSource(pipeline)

    def stream_steps(self, pipeline, model: torch.nn.Module, keymaps, *, log_every: int, logger) -> StepSource:
        """A stream's steps (``data.stream``: the pipeline's loader is its feed)."""
        return StreamSteps(pipeline, pipeline.loader, keymaps, log_every=log_every, logger=logger)

    def row_reset(self, model: torch.nn.Module):
        """What a dynamic table's fresh rows go to (:class:`~hybridrec.train.loop.stream.DynamicTables`'s
        ``reset``); None: the trainers hold the rows and reset them in place."""

    # -- a checkpoint's weights --------------------------------------------------------------
    @classmethod
    def load_weights(cls, path: Path, model: torch.nn.Module) -> dict:
        """The weights of the checkpoint ``path`` into ``model`` (one process); its ``extra``."""
        return load_sharded(path, model=model, dense_opt=None, sparse_opts=None, topo=Topology.single())

    @classmethod
    def tables_dir(cls, path: Path) -> Path:
        """The checkpoint (``path`` or a part of it) that holds the tables."""
        return path


class LocalBackend(SparseBackend):
    """One process holds every table."""

    def embeddings(self, meta, tables, *, ledger, total_steps, init_tables):
        return local_embeddings(self.cfg, tables, init_tables=init_tables)

    def place(self, model, *, ledger, dense_sync, run_dir, total_steps):
        return model.to(self.topo.device)


class ShardedBackend(SparseBackend):
    """Several ranks, each holding its shards of the tables (:func:`build_plan`); the dense
    part placed by ``dist.partition_dense`` or the plan file; rank 0 writes the plan into the
    run directory."""

    plan: ShardingPlan | None = None

    def embeddings(self, meta, tables, *, ledger, total_steps, init_tables):
        cfg, topo = self.cfg, self.topo
        plan = self.plan = build_plan(cfg, tables, topo, meta)
        check_plan(cfg, plan, hierarchical=topo.hierarchical)  # (before the model is built)
        cw = [n for n, tp in plan.tables.items() if tp.sharding_type == "column_wise"]
        if cw and cfg.optim.sparse == "rowwise_adagrad" and topo.lead:
            warnings.warn(f"column-wise tables {cw[:3]} with row-wise Adagrad keep one accumulator per "
                          "column shard: training will not equal one process exactly", stacklevel=1)
        return ShardedEmbeddingBagCollection(tables, plan, topo, seed=cfg.train.seed, ledger=ledger,
                                             codecs=build_embedding_codecs(cfg, tables, plan),
                                             threshold=build_threshold_mp(cfg, plan, total_steps),
                                             dp_reducer=build_replicated_reducer(cfg, plan, ledger, total_steps),
                                             wire_dtype=PRECISIONS[cfg.train.precision],
                                             weight_dtype=WEIGHT_DTYPES[cfg.model.embedding_dtype],
                                             init_values=init_tables,
                                             coded_chunks=cfg.compress.embedding_chunks)

    def place(self, model, *, ledger, dense_sync, run_dir, total_steps):
        from hybridrec.parallel.placement import place_dense

        cfg, topo, plan = self.cfg, self.topo, self.plan
        if cfg.compress.embedding_when == "pays" and model.sparse.codecs:
            decide_embedding_compression(cfg, model)
        # (checked on every rank alike, before any collective of the dense part: a ConfigError)
        plan.dense = dense_plan(cfg, plan, model, topo.group_size)
        if any(d.placement == "partitioned" for d in plan.dense.values()):
            model = place_dense(model, plan.dense, topo, ledger=ledger)
        if cfg.compress.dense_when == "pays" and not isinstance(dense_sync, NoSync):  # (before DDP is built)
            decide_dense_compression(cfg, model, topo, dense_sync, total_steps=total_steps)
        model = parallelize_dlrm(model, plan, topo, ledger=ledger, dense_sync=dense_sync)
        if topo.lead:
            run_dir.mkdir(parents=True, exist_ok=True)
            # (hierarchical: the plan is one group's; "groups" says how many, for a later resume check)
            doc = {"groups": topo.num_groups, **plan.to_dict()} if topo.hierarchical else plan.to_dict()
            write_text_atomic(run_dir / "plan.json", json.dumps(doc, indent=2))
        return model


class ServerBackend(SparseBackend):
    """``dist.num_ps=P``: the parameter servers hold the tables (:mod:`hybridrec.train.ps_run`
    runs them); a trainer's DLRM pulls rows from them and pushes its gradients (no table
    here), its dense arches go to the dense synchronization; rank 0 writes the servers'
    plan. The servers' tables are drawn by the servers (a checkpoint overwrites them
    there), and saved, loaded and recovered through the attachment
    (:class:`~hybridrec.train.ps_run.ServerCheckpoints`); a server can fail under a single
    trainer too."""

    changes_after_stop = True  # (pushes landing on the servers)

    def __init__(self, cfg: Config, topo: Topology) -> None:
        super().__init__(cfg, topo)
        self.attachment = ServerCheckpoints(topo, cfg.dist.num_ps, cfg.dist.timeout_s)
        self.plan: ShardingPlan | None = None

    def check_memory(self, meta):
        pass  # (the trainers hold no table; each server checks its own: ps_run.run_server)

    @classmethod
    def launch_memory_problem(cls, cfg, meta, *, world_size, group):
        return local_servers_memory_problem(cfg, meta)

    def initial_tables(self, resuming):
        return True

    def embeddings(self, meta, tables, *, ledger, total_steps, init_tables):
        cfg, topo = self.cfg, self.topo
        self.plan = ps_plan(cfg, tables, cfg.dist.num_ps)
        return RemoteEmbeddingCollection(tables, self.plan, trainer=topo.job_rank, num_trainers=topo.job_size,
                                         ledger=ledger, timeout_s=cfg.dist.timeout_s)

    def place(self, model, *, ledger, dense_sync, run_dir, total_steps):
        model = dense_sync.wrap(model)
        if self.topo.lead:
            run_dir.mkdir(parents=True, exist_ok=True)
            write_text_atomic(run_dir / "plan.json", self.plan.to_json())
        return model

    def sparse_optimizer(self, model):
        o = self.cfg.optim
        return CombinedSparseOptimizer({"ps": PushOptimizer(model.sparse, name=o.sparse, lr=o.sparse_lr)})

    def step_source(self, pipeline, model):
        return ServerSteps(pipeline, model.sparse)

    def stream_steps(self, pipeline, model, keymaps, *, log_every, logger):
        return ServerStreamSteps(pipeline, pipeline.loader, keymaps, model.sparse, log_every=log_every, logger=logger)

    def row_reset(self, model):
        return model.sparse.reset_rows  # (sent to the servers before the trainer's next pull)

    @classmethod
    def load_weights(cls, path, model):
        # the dense arches from the trainers' checkpoint, the tables from the servers' part
        extra = load_state(path, model=model, dense_opt=None, sparse_opts=None, topo=Topology.single(),
                           parts="dense").extra
        load_state(path / PS_DIR, model=model, dense_opt=None, sparse_opts=None, topo=Topology.single(),
                   parts="tables")
        return extra

    @classmethod
    def tables_dir(cls, path):
        return path / PS_DIR


class ServerStreamSteps(StreamSteps):
    """A stream's steps on a parameter-server trainer: the stream's (its files, rows and
    dynamic tables in the summary), ending as :class:`ServerSteps` do (every trainer's last
    push and reset landed before anyone goes on; the pushes, their staleness and the rows
    this trainer sent to be reset in the summary)."""

    absent: ClassVar[dict] = {**StreamSteps.absent, **ServerSteps.absent}

    def __init__(self, pipeline, stream, tables, remote, *, log_every: int = 0, logger=None) -> None:
        super().__init__(pipeline, stream, tables, log_every=log_every, logger=logger)
        self.remote = remote

    def finish(self, loop, end) -> None:
        super().finish(loop, end)
        if loop.topo.job_size > 1:
            torch.distributed.barrier(group=loop.topo.run_group)

    def summary(self) -> dict:
        return {**super().summary(), "ps": {**self.remote.summary(), "rows_reset": self.remote.rows_reset}}


def backend_class(cfg: Config, group_size: int) -> type[SparseBackend]:
    """The backend of a run of ``group_size`` trainers per group: the one choice."""
    if cfg.dist.num_ps:
        return ServerBackend
    return LocalBackend if group_size == 1 else ShardedBackend


def sparse_backend(cfg: Config, topo: Topology) -> SparseBackend:
    """This rank's backend (:func:`backend_class`)."""
    return backend_class(cfg, topo.group_size)(cfg, topo)


def stored_backend(path: Path) -> type[SparseBackend]:
    """The backend that wrote the checkpoint ``path``, told by its layout: the servers'
    (the tables in its part ``ps/``) or the trainers'."""
    return ServerBackend if (path / PS_DIR).is_dir() else SparseBackend


# ---------------------------------------------------------------- the embeddings' parts


def local_embeddings(cfg: Config, tables: list[TableConfig], *, init_tables: bool | None = True) -> EmbeddingBagCollection:
    """One process's collection of every table (bf16 tables pool into bf16 for a bf16
    model: no cast between). ``init_tables`` False: zeros, for a checkpoint to overwrite."""
    weight = WEIGHT_DTYPES[cfg.model.embedding_dtype]
    out = weight if PRECISIONS[cfg.train.precision] == weight else torch.float32
    return EmbeddingBagCollection(tables, seed=cfg.train.seed, weight_dtype=weight, output_dtype=out,
                                  init_values=init_tables)


def build_sparse_optimizers(cfg: Config, sparse) -> CombinedSparseOptimizer:
    """One sparse optimizer per local collection (a sharded model: its shards and its
    replicated tables), behind one interface."""
    kwargs = {} if cfg.optim.sparse == "sgd" else {"eps": cfg.optim.eps}
    return combined_sparse_optimizer(cfg.optim.sparse, sparse, lr=cfg.optim.sparse_lr, **kwargs)


def build_embedding_codecs(cfg: Config, tables: list[TableConfig],
                           plan: ShardingPlan) -> dict[str, Codec]:
    """The per-table policy of ``compress.embedding*``: table -> codec of its output_dist
    hop. One codec for every chosen table: the sharded ones (data-parallel tables have
    no hop) named in ``embedding_tables`` (empty: all) with at least
    ``embedding_min_rows`` rows. Tables left out travel as float32."""
    c = cfg.compress
    if c.embedding == "dct" and c.embedding_select == "threshold":
        return {}  # (build_threshold_mp)
    codec = make_codec(c.embedding, eta=c.embedding_ratio, values=c.embedding_values)
    if codec is None:
        return {}
    return {t.name: codec for t in tables
            if plan.tables[t.name].sharding_type != "data_parallel"
            and (not c.embedding_tables or t.name in c.embedding_tables)
            and t.num_embeddings >= c.embedding_min_rows}


def build_replicated_reducer(cfg: Config, plan: ShardingPlan, ledger: CommLedger | None,
                             total_steps: int) -> CompressedAllReduce | None:
    """``compress.dense_replicated`` with ``compress.dense=dct|topk`` and replicated tables: the
    compressor their gradients go through (its own instance: its state is per group), counted
    as ``dp_table_allreduce``; None otherwise (the dense all-reduce)."""
    c = cfg.compress
    if not c.dense_replicated or c.dense not in ("dct", "topk"):
        return None
    if not any(tp.sharding_type == "data_parallel" for tp in plan.tables.values()):
        return None
    return CompressedAllReduce(build_dense_compressor(c, total_steps=total_steps), ledger,
                               category="dp_table_allreduce", pairwise=cfg.dist.exchange == "pairwise")


def build_threshold_mp(cfg: Config, plan: ShardingPlan, total_steps: int) -> ThresholdMP | None:
    """``compress.embedding=dct`` with ``embedding_select=threshold``: DCT-MP's threshold over
    every sample's whole boundary vector (:mod:`hybridrec.parallel.threshold_dist`), for every
    sharded table; None otherwise (what that hop does not take: :mod:`hybridrec.train.setup.rules`)."""
    c = cfg.compress
    if c.embedding != "dct" or c.embedding_select != "threshold":
        return None
    every = c.embedding_refresh_every or auto_refresh_every(total_steps)
    return ThresholdMP(c.embedding_ratio, every, cap=c.embedding_cap, values=c.embedding_values)


def build_dense_compressor(c: CompressConfig, *, total_steps: int = 0) -> GradientCompressor:
    """The payload compressor of ``compress.dense`` (dct, topk, fp16 or bf16). ``dct``'s L is
    ``compress.dense_refresh_every``, or with 0 chosen from ``total_steps`` (the run's
    planned steps), and its first refreshes ramp up to it."""
    if c.dense == "dct":
        every = c.dense_refresh_every or auto_refresh_every(total_steps)
        return DCTCompressor(c.dense_ratio, every, error_feedback=c.dense_error_feedback,
                             warmup_steps=c.dense_warmup_steps, ramp=True, cap=c.dense_cap or None,
                             min_numel=c.dense_min_numel)
    if c.dense == "topk":
        return TopKCompressor(c.dense_ratio, error_feedback=c.dense_error_feedback,
                              warmup_steps=c.dense_warmup_steps, min_numel=c.dense_min_numel)
    if c.dense in ("fp16", "bf16"):
        return CastCompressor(c.dense, warmup_steps=c.dense_warmup_steps)
    raise ValueError(f"compress.dense={c.dense!r} is not a payload compressor")  # (the config rules refuse it)


def decide_embedding_compression(cfg: Config, model: torch.nn.Module) -> None:
    """``compress.embedding_when=pays``: measure whether the codecs of ``model.sparse`` pay
    here, the hop travelling behind ``model.bottom`` (:mod:`hybridrec.parallel.codec_pays`),
    and drop them where they do not; the record goes to ``ebc.compression`` (summary.json
    ``kernels.embedding_compression``)."""
    from hybridrec.parallel.codec_pays import measure

    ebc = model.sparse
    record = measure(ebc, cfg.data.batch_size, model.bottom)
    if not record["pays"]:
        ebc.drop_codecs()
    ebc.compression = {**record, "compressed": bool(ebc.codecs)}
    if ebc.topo.job_rank == 0:
        verdict = "compressed" if ebc.codecs else "sent uncompressed: compressing does not pay here"
        print(f"compress.embedding={cfg.compress.embedding}: the codecs take {record['codec_ms']:.1f} ms a step, "
              f"the wire time they save {record['saved_ms']:.1f} ms: {verdict}", file=sys.stderr, flush=True)


def decide_dense_compression(cfg: Config, model: torch.nn.Module, topo: Topology, dense_sync: DenseSync, *,
                             total_steps: int = 0) -> None:
    """``compress.dense_when=pays``: measure whether ``compress.dense``'s compressor pays on
    the dense arches' gradients here (:func:`hybridrec.parallel.codec_pays.measure_dense`,
    the slowest rank of the run decides, so every rank alike); where it does not,
    ``dense_sync`` (not wrapped yet) sends the plain all-reduce. The record goes to
    ``dense_sync.compression`` (summary.json ``kernels.dense_compression``)."""
    from hybridrec.parallel.codec_pays import measure_dense

    def make() -> GradientCompressor:  # (its warm-up steps left out: they send everything)
        compressor = build_dense_compressor(cfg.compress, total_steps=total_steps)
        compressor.warmup_steps = 0
        return compressor

    sizes = [[p.numel() for _, p in synced_parameters(m)] for m in dense_arches(model).values()]
    pairwise = cfg.dist.exchange == "pairwise"
    record = measure_dense(make, [s for s in sizes if s], topo.group, device=topo.device,
                           slowest_over=topo.run_group, pairwise=pairwise)
    if not record["pays"]:
        dense_sync.send_plain()
    dense_sync.compression = {**record, "compressed": record["pays"]}
    if topo.job_rank == 0:
        verdict = "compressed" if record["pays"] else "sent uncompressed: compressing does not pay here"
        print(f"compress.dense={cfg.compress.dense}: the compressor takes {record['codec_ms']:.1f} ms a step, "
              f"the wire time it saves {record['saved_ms']:.1f} ms: {verdict}", file=sys.stderr, flush=True)
