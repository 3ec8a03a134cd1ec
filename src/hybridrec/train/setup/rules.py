"""Which options combine: every rule about a run's options, in one module.

A rule is a condition and the one line that says what is wrong when it does not hold
(naming the options and what to do). Three tables, checked in this order, each before
anything that depends on it is built:

- :func:`config_rules`: the config alone (values, and options that exclude each other),
  checked whenever a config is made or read (:func:`hybridrec.train.setup.configure.validate`);
- :data:`RUN_RULES`: the config against what only the run knows (:class:`RunFacts`: its
  ranks, this machine's GPUs, the dataset), checked by the launcher before it starts
  ranks (:func:`hybridrec.train.run.preflight`) and by every rank before it builds
  anything (:func:`hybridrec.train.build.build_trainer`);
- :data:`PLAN_RULES`: the config against the sharding plan, checked when the plan is
  made, before the model is built.

Resource checks (memory, a server's memory) and data checks (ids past a table) are not
option rules: they live with what they measure (:mod:`hybridrec.train.setup.memory`,
:mod:`hybridrec.data.id_ranges`).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from hybridrec.data.loader import steps_per_epoch
from hybridrec.errors import ConfigError
from hybridrec.sync.algorithms import ALGORITHMS, either
from hybridrec.train.setup.config import Config, TrainConfig


def check_config(cfg: Config) -> None:
    """The first rule of the config alone that does not hold: a ConfigError."""
    for ok, msg in config_rules(cfg):
        if not ok:
            raise ConfigError(msg)


@dataclass(frozen=True)
class RunFacts:
    """What the run rules need beyond the config: the job's trainer ranks (``world``), those
    on this machine, the device they train on (``"cpu"`` or ``"cuda"``), this machine's
    GPUs, the dataset (None: not opened where checked), and whether the trainer is being
    built (a run directory is then needed)."""

    world: int = 1
    local_world: int = 1
    device: str = "cpu"
    gpus: int = 0
    meta: object | None = None
    building: bool = False


Rule = Callable[[Config, RunFacts], "str | None"]


def check_run(cfg: Config, facts: RunFacts) -> None:
    """The first of :data:`RUN_RULES` that does not hold: a ConfigError."""
    for rule in RUN_RULES:
        if problem := rule(cfg, facts):
            raise ConfigError(problem)


def check_plan(cfg: Config, plan, *, hierarchical: bool = False) -> None:
    """The first of :data:`PLAN_RULES` that does not hold for ``plan`` (one group's, of
    several when ``hierarchical``): a ConfigError."""
    for rule in PLAN_RULES:
        if problem := rule(cfg, plan, hierarchical):
            raise ConfigError(problem)


# -- the config alone ------------------------------------------------------------------
def _ps_checks(cfg: Config) -> list[tuple[bool, str]]:
    d = cfg.dist
    if d.num_ps == 0:
        return []
    return [
        (d.num_ps > 0, f"dist.num_ps must be >= 0, got {d.num_ps}"),
        (d.ps_sharding in ("row_wise", "table_wise"), f"dist.ps_sharding {d.ps_sharding!r}: row_wise or table_wise"),
        (d.ps_max_staleness >= -1, f"dist.ps_max_staleness must be >= -1 (-1: unbounded), got {d.ps_max_staleness}"),
        (cfg.model.arch == "dlrm", ("dist.num_ps: parameter servers serve ordinary tables; model.arch=deepfm's "
          "FM tables need DES (dist.num_ps=0)")),
        (cfg.compress.embedding == "none", ("dist.num_ps: compress.embedding compresses DES's pooled-embedding "
          "hops, which a parameter-server run does not have")),
        (not d.plan, "dist.plan is a DES sharding plan; parameter servers place tables by dist.ps_sharding"),
    ]


def workers_problem(cfg: Config, world_size: int) -> str | None:
    """Why ``train.workers`` cannot run with ``world_size`` trainer ranks, or None."""
    n, d = cfg.train.workers, cfg.dist
    if n < 1:
        return f"train.workers must be >= 1, got {n}"
    if n == 1 or world_size == 1:
        return None
    if not d.num_ps:
        return (f"train.workers={n} with {world_size} ranks: the embedding all-to-alls (DES) are collectives "
                f"on one process group that several threads cannot each run; use one rank, or dist.num_ps")
    if d.dense_sync != "none" and cfg.sync.algorithm == "none":
        why = ("DDP does not support concurrent backward passes" if d.dense_sync == "ddp" else
               "its all-reduce is one collective per step, which several threads cannot each run")
        return (f"train.workers={n} with dist.dense_sync={d.dense_sync}: {why}; use dist.dense_sync=none "
                f"or a synchronizer (sync.algorithm)")
    return None


def _early_stop_checks(t: TrainConfig) -> list[tuple[bool, str]]:
    """``train.early_stop`` (held-out rows are checked with the dataset, in train.run)."""
    return [
        (t.early_stop >= 0, (f"train.early_stop must be >= 0 (evaluations without an AUC "
          f"improvement before stopping; 0 = off), got {t.early_stop}")),
        (t.early_stop_min_delta >= 0, f"train.early_stop_min_delta must be >= 0, got {t.early_stop_min_delta}"),
        (t.early_stop <= 0 or t.eval_every > 0, (f"train.early_stop={t.early_stop} counts the evaluations of "
          "train.eval_every, which is 0 (only at the end): set train.eval_every=N")),
    ]


def _checkpoint_checks(t: TrainConfig) -> list[tuple[bool, str]]:
    """``train.checkpoint_every`` (a number or ``auto``), ``train.mtbf_hours``,
    ``train.inject_failure`` (its rank against the world size: in train.run, where that is known)."""
    from hybridrec.train.checkpointing.faults import parse_inject_failure

    every = t.checkpoint_every
    parse_inject_failure(t.inject_failure)  # a ConfigError that says what is wrong
    return [
        (every == "auto" or (isinstance(every, int) and every >= 0),
         f"train.checkpoint_every {every!r}: a number of steps >= 0 (0 = only at the end) or auto"),
        (t.mtbf_hours > 0, f"train.mtbf_hours must be positive, got {t.mtbf_hours}"),
        (every != "auto" or t.save_checkpoints,
         "train.checkpoint_every=auto chooses when to save, but train.save_checkpoints=false saves nothing"),
        (t.recovery in ("full", "partial"), f"train.recovery {t.recovery!r}: full or partial"),
        (0 < t.lost_fraction < 1, f"train.lost_fraction must be in (0, 1), got {t.lost_fraction}"),
        (t.shard_delta_every >= 0, f"train.shard_delta_every must be >= 0 (0 = off), got {t.shard_delta_every}"),
        (t.shard_delta_rows in ("touched", "hot"), f"train.shard_delta_rows {t.shard_delta_rows!r}: touched or hot"),
        (0 < t.shard_delta_hot <= 1, f"train.shard_delta_hot must be in (0, 1], got {t.shard_delta_hot}"),
        (not (t.shard_delta_every and t.async_checkpoint),
         ("train.shard_delta_every follows the newest checkpoint on disk, which train.async_checkpoint=true "
          "writes later: use one of them")),
        (not t.shard_delta_every or t.recovery == "partial",
         (f"train.shard_delta_every={t.shard_delta_every}: the shards' incremental saves serve partial recovery; "
          "set train.recovery=partial")),
    ]


def steps_problem(cfg: Config, last_step: int) -> str | None:
    """A setting that can never take effect in a run whose last step is ``last_step``
    (``train.eval_every`` past it: no evaluation before the end; a ``train.inject_failure``
    step past it: no failure), or None. Checked where the run's length is known, once the
    dataset is open (train.build, and the launcher's preflight), before anything is written."""
    from hybridrec.train.checkpointing.faults import parse_inject_failure

    t = cfg.train
    if last_step < 1:  # (no step at all: the training loader says why)
        return None
    if t.eval_every > last_step:
        return (f"train.eval_every={t.eval_every} is past the run's last step ({last_step:,}): it would "
                f"never evaluate before the end; set train.eval_every <= {last_step}, or 0 (only at the end)")
    for rank, step in parse_inject_failure(t.inject_failure):
        if step > last_step:
            return (f"train.inject_failure={t.inject_failure}: step {step} (rank {rank}) is past the run's "
                    f"last step ({last_step:,}): that failure would never happen")
    return None


def _bf16_tables_conflict(cfg: Config) -> str | None:
    """What keeps bf16 tables out of ``cfg`` (None: nothing)."""
    return ("model.arch=deepfm (its FM tables are float32)" if cfg.model.arch == "deepfm" else
            "dist.num_ps (the servers' tables are float32)" if cfg.dist.num_ps else
            f"sync.algorithm={cfg.sync.algorithm} (it averages float32 replicas)"
            if cfg.sync.algorithm != "none" else None)


def recovery_problem(cfg: Config) -> str | None:
    """Why ``train.recovery=partial`` cannot run with ``cfg`` (None: it can, or it is ``full``)."""
    t, d = cfg.train, cfg.dist
    if t.recovery != "partial":
        return None
    why = ("train.save_checkpoints=false: the failed rank's shards have no checkpoint to roll back to"
           if not t.save_checkpoints else
           f"sync.algorithm={cfg.sync.algorithm}: the replicas differ between synchronizations"
           if cfg.sync.algorithm != "none" else
           "dist.num_ps with train.shard_delta_every: the servers' shards have no incremental saves"
           if d.num_ps and t.shard_delta_every else
           "dist.num_ps with dist.group_size: hierarchical groups of trainers" if d.num_ps and d.group_size
           and d.group_size < d.nproc else
           f"train.workers={t.workers}: Hogwild threads update the tables between steps" if t.workers > 1 else
           "dist.partition_dense: a failed rank's column blocks have no copy on the other ranks"
           if d.partition_dense else None)
    return None if why is None else (f"train.recovery=partial needs synchronous DES training with "
                                     f"checkpoints: {why}; use train.recovery=full")


def _sync_checks(cfg: Config) -> list[tuple[bool, str]]:
    s = cfg.sync
    return [
        (s.algorithm in ("none", *ALGORITHMS), f"sync.algorithm {s.algorithm!r}: {either(('none', *ALGORITHMS))}"),
        (s.mode in ("background", "foreground"), f"sync.mode {s.mode!r}: background or foreground"),
        (s.every >= 1, "sync.every must be >= 1"),
        (s.interval_s >= 0, f"sync.interval_s must be >= 0, got {s.interval_s}"),
        (0 < s.duty <= 1, f"sync.duty must be in (0, 1], got {s.duty}"),
        (s.alpha == "auto" or (isinstance(s.alpha, float) and 0 <= s.alpha <= 1),
         f"sync.alpha must be auto or in [0, 1], got {s.alpha!r}"),
        (s.block_momentum == "auto" or (isinstance(s.block_momentum, float) and 0 <= s.block_momentum < 1),
         f"sync.block_momentum must be auto or in [0, 1), got {s.block_momentum!r}"),
        (s.block_lr > 0, "sync.block_lr must be positive"),
        (s.write_back in ("delta", "overwrite"), f"sync.write_back {s.write_back!r}: delta or overwrite"),
        (s.algorithm == "none" or cfg.compress.dense == "none" or cfg.dist.group_size > 0,
         (f"sync.algorithm={s.algorithm} averages replicas, not gradients: compress.dense must be none "
          "(or groups, dist.group_size, whose members average gradients)")),
        (s.compress in ("none", "fp16", "bf16", "dct"), f"sync.compress {s.compress!r}: none, fp16, bf16 or dct"),
        (0 < s.compress_ratio <= 1, f"sync.compress_ratio must be in (0, 1], got {s.compress_ratio}"),
        (cfg.dist.group_size >= 0, f"dist.group_size must be >= 0 (0: automatic), got {cfg.dist.group_size}"),
    ]


def _width_checks(m) -> list[tuple[bool, str]]:
    """Every layer width a positive integer: a width of 0 or below is a layer torch cannot
    build (or builds empty, failing later with a shape error far from the option)."""
    checks = [(m.embedding_dim > 0, f"model.embedding_dim must be a positive integer, got {m.embedding_dim}")]
    for key, widths in (("model.bottom_mlp", m.bottom_mlp), ("model.top_mlp", m.top_mlp)):
        bad = next(((i, w) for i, w in enumerate(widths) if w <= 0), None)
        checks.append((bad is None, f"{key}: every width must be a positive integer, got {bad[1]} "
                                    f"(entry {bad[0] + 1} of {','.join(map(str, widths))})" if bad else ""))
    return checks


def _nodes_checks(cfg: Config) -> list[tuple[bool, str]]:
    """``dist.nnodes`` > 1: what a launch of several machines needs."""
    d = cfg.dist
    if d.nnodes == 1:
        return [(d.node_rank == 0, f"dist.node_rank={d.node_rank} needs dist.nnodes > 1")]
    host, _, port = d.master.rpartition(":")
    return [
        (d.nnodes >= 1, f"dist.nnodes must be >= 1, got {d.nnodes}"),
        (0 <= d.node_rank < d.nnodes, f"dist.node_rank must be in [0, dist.nnodes={d.nnodes}), got {d.node_rank}"),
        (bool(host) and port.isdigit() and 0 < int(port) < 65536,
         f"dist.master {d.master!r}: HOST:PORT of machine 0's rendezvous (dist.nnodes={d.nnodes})"),
        (bool(d.interface), (f"dist.nnodes={d.nnodes} needs dist.interface: the network interface its sockets "
                             "bind (e.g. eth0: a private network's)")),
        (bool(cfg.train.run_dir), (f"dist.nnodes={d.nnodes}: name the run directory (train.run_dir, on a file "
                                   "system every machine shares)")),
        (d.num_ps == 0, ("dist.num_ps with dist.nnodes > 1: launch parameter servers across machines with "
                         "torchrun (README), not yet with dist.nnodes")),
        (d.port == 0, "dist.port is the local launch's port; across machines the rendezvous is at dist.master"),
        (d.join_timeout_s >= 1, f"dist.join_timeout_s must be at least 1 (seconds), got {d.join_timeout_s}"),
    ]


def config_rules(cfg: Config) -> list[tuple[bool, str]]:
    """Every rule of the config alone, as ``(holds, its one line)``."""
    # The one list of sparse optimizer names (the cost model prices their state); imported
    # here, not at the top, so that reading a config does not import torch.
    from hybridrec.parallel.cost_model import OPTIMIZERS as SPARSE_OPTIMIZERS

    m, o, d, t, c = cfg.model, cfg.optim, cfg.data, cfg.train, cfg.compress
    bf16_conflict = _bf16_tables_conflict(cfg) if m.embedding_dtype == "bf16" else None
    checks = [
        (d.batch_size > 0, "data.batch_size must be positive"),
        (d.eval_batch_size > 0, "data.eval_batch_size must be positive"),
        (d.workers >= 0, f"data.workers must be >= 0 (0: automatic), got {d.workers}"),
        (m.arch in ("dlrm", "deepfm"), f"model.arch {m.arch!r}: dlrm or deepfm"),
        (m.interaction in ("dot", "cat", "dcn"), f"model.interaction {m.interaction!r}: dot, cat or dcn"),
        (m.dcn_layers >= 1, f"model.dcn_layers must be at least 1 (cross layers), got {m.dcn_layers}"),
        (m.dcn_rank >= 1, f"model.dcn_rank must be at least 1 (the cross layers' rank), got {m.dcn_rank}"),
        (m.pooling in ("sum", "mean"), f"model.pooling {m.pooling!r}: sum or mean"),
        (m.embedding_dtype in ("fp32", "bf16"), f"model.embedding_dtype {m.embedding_dtype!r}: fp32 or bf16"),
        (not bf16_conflict,
         f"model.embedding_dtype=bf16 is not supported with {bf16_conflict}; use model.embedding_dtype=fp32"),
        (m.arch != "deepfm" or m.pooling == "sum", "model.arch=deepfm needs model.pooling=sum (the FM term)"),
        *_width_checks(m),
        (bool(m.top_mlp) and m.top_mlp[-1] == 1, f"model.top_mlp must end in 1, got {m.top_mlp}"),
        (bool(m.bottom_mlp) and m.bottom_mlp[-1] == m.embedding_dim,
         f"model.bottom_mlp must end in model.embedding_dim ({m.embedding_dim}), got {m.bottom_mlp}"),
        (o.dense in ("sgd", "adagrad", "adam"), f"optim.dense {o.dense!r}: sgd, adagrad or adam"),
        (o.sparse in SPARSE_OPTIMIZERS,
         f"optim.sparse {o.sparse!r}: {', '.join(SPARSE_OPTIMIZERS[:-1])} or {SPARSE_OPTIMIZERS[-1]}"),
        (o.dense_lr > 0 and o.sparse_lr > 0, "learning rates must be positive"),
        (o.decay in ("none", "linear", "cosine", "poly2"), f"optim.decay {o.decay!r}: none, linear, cosine or poly2"),
        (o.warmup_steps >= 0, "optim.warmup_steps must be >= 0"),
        (t.epochs > 0, "train.epochs must be positive"),
        (t.max_steps >= 0 and t.eval_every >= 0 and t.log_every >= 0, "step counts must be >= 0"),
        *_checkpoint_checks(t),
        *_early_stop_checks(t),
        (t.keep_checkpoints >= 1, "train.keep_checkpoints must be >= 1"),
        (bool(t.init_from) or not t.init_optimizer, "train.init_optimizer=true needs train.init_from=RUN"),
        (not t.init_from or not cfg.dist.num_ps,
         "train.init_from with dist.num_ps: the tables live on the parameter servers, which do not load it"),
        (t.log_interval_s >= 0, f"train.log_interval_s must be >= 0, got {t.log_interval_s}"),
        (t.precision in ("fp32", "bf16"), f"train.precision {t.precision!r}: fp32 or bf16"),
        (t.allocator in ("retain", "system"), f"train.allocator {t.allocator!r}: retain or system"),
        (t.kernels in ("auto", "measure", "torch", "onednn"),
         f"train.kernels {t.kernels!r}: auto, measure, torch or onednn"),
        (t.memory_limit_gb >= 0,
         f"train.memory_limit_gb must be >= 0 (0 = the machine's), got {t.memory_limit_gb}"),
        (cfg.dist.nproc >= 1, "dist.nproc must be >= 1"),
        (cfg.dist.max_restarts >= 0, f"dist.max_restarts must be >= 0, got {cfg.dist.max_restarts}"),
        (0 <= cfg.dist.port < 65536, f"dist.port must be a port number (0: a free one), got {cfg.dist.port}"),
        *_nodes_checks(cfg),
        (cfg.dist.sharding in ("auto", "table_wise", "row_wise", "column_wise", "table_row_wise",
                               "data_parallel"), f"dist.sharding {cfg.dist.sharding!r}: auto or a sharding type"),
        (cfg.dist.backend in ("auto", "gloo", "nccl"), f"dist.backend {cfg.dist.backend!r}: auto, gloo or nccl"),
        (cfg.dist.timeout_s > 0, "dist.timeout_s must be positive"),
        (cfg.dist.exchange in ("collective", "pairwise"), f"dist.exchange {cfg.dist.exchange!r}: collective or pairwise"),
        (cfg.dist.dense_sync in ("ddp", "allreduce", "none"),
         f"dist.dense_sync {cfg.dist.dense_sync!r}: ddp, allreduce or none"),
        *_ps_checks(cfg),
        (c.dense != "powersgd" or cfg.dist.dense_sync == "ddp",
         "compress.dense=powersgd runs as a DDP comm hook: it needs dist.dense_sync=ddp"),
        (c.dense == "none" or cfg.dist.dense_sync != "none",
         f"compress.dense={c.dense} compresses the dense all-reduce, which dist.dense_sync=none does not run"),
        (c.dense in ("none", "dct", "topk", "fp16", "bf16", "powersgd"),
         f"compress.dense {c.dense!r}: none, dct, topk, fp16, bf16 or powersgd"),
        (0 < c.dense_ratio <= 1, f"compress.dense_ratio must be in (0, 1], got {c.dense_ratio}"),
        (c.dense_refresh_every >= 0, "compress.dense_refresh_every must be >= 0 (0: auto)"),
        (c.dense_warmup_steps >= 0, "compress.dense_warmup_steps must be >= 0"),
        (c.dense_min_numel >= 0, f"compress.dense_min_numel must be >= 0, got {c.dense_min_numel}"),
        (c.dense_cap == 0 or c.dense_cap >= 1, f"compress.dense_cap must be 0 (no cap) or >= 1, got {c.dense_cap}"),
        (c.dense_when in ("always", "pays"), f"compress.dense_when {c.dense_when!r}: always or pays"),
        (c.dense_when == "always" or (c.dense in ("dct", "topk") and c.dense_ratio < 1
                                      and (c.dense == "topk" or c.dense_cap >= 1)),
         ("compress.dense_when=pays measures the bounded messages of compress.dense=dct (dense_cap >= 1) "
          "or topk, dense_ratio below 1")),
        (c.dense_when == "always" or not cfg.dist.num_ps,
         "compress.dense_when=pays is not measured with parameter servers (dist.num_ps)"),
        *_sync_checks(cfg),
        (not (problem := workers_problem(cfg, cfg.dist.nproc)), problem),
        (not (problem := recovery_problem(cfg)), problem),
        # (torchrun across machines: dist.nproc is 1, and train.run checks the real world size)
        (not (injected := injection_problem(t.inject_failure, cfg.dist.nproc, cfg.dist.num_ps)
                       if cfg.dist.nproc > 1 or cfg.dist.num_ps else None),
         injected),
        (c.powersgd_rank >= 1, "compress.powersgd_rank must be >= 1"),
        (c.embedding in ("none", "dct", "fp16", "bf16", "int8"),
         f"compress.embedding {c.embedding!r}: none, dct, fp16, bf16 or int8"),
        (0 < c.embedding_ratio <= 1, f"compress.embedding_ratio must be in (0, 1], got {c.embedding_ratio}"),
        (c.embedding_values in ("fp32", "fp16", "bf16"),
         f"compress.embedding_values {c.embedding_values!r}: fp32, fp16 or bf16"),
        (c.embedding_min_rows >= 0, "compress.embedding_min_rows must be >= 0"),
        (c.embedding_chunks >= 0, f"compress.embedding_chunks must be >= 0 (0: auto), got {c.embedding_chunks}"),
        (c.embedding_chunks <= 1 or (c.embedding != "none" and not (c.embedding == "dct"
                                                                   and c.embedding_select == "threshold")),
         ("compress.embedding_chunks splits the codecs' hop (compress.embedding=dct with embedding_select=topk, "
          "fp16, bf16 or int8); the float32 and the threshold hops travel in one exchange")),
        (c.embedding_select in ("topk", "threshold"),
         f"compress.embedding_select {c.embedding_select!r}: topk or threshold"),
        (c.embedding_refresh_every >= 0, "compress.embedding_refresh_every must be >= 0 (0: auto)"),
        (c.embedding_cap >= 1, f"compress.embedding_cap must be >= 1, got {c.embedding_cap}"),
        (c.embedding_when in ("always", "pays"), f"compress.embedding_when {c.embedding_when!r}: always or pays"),
        (c.embedding_when == "always" or c.embedding_select == "topk" or c.embedding != "dct",
         ("compress.embedding_when=pays measures the top-k DCT-MP and the casting codecs, not "
          "compress.embedding_select=threshold")),
        *_threshold_checks(cfg),
        *_stream_checks(cfg),
    ]
    return checks


STREAM_STOP = re.compile(r"^(idle:[0-9]+(\.[0-9]+)?|files:[0-9]+|never)$")
PUBLISH_EVERY = re.compile(r"^[0-9]+(\.[0-9]+)?s$|^[0-9]+$")


def _stream_checks(cfg: Config) -> list[tuple[bool, str]]:
    """A stream (``data.stream``) and the tables that read raw keys (``model.tables``)."""
    d, m, t = cfg.data, cfg.model, cfg.train
    stream, raw = bool(d.stream), m.tables in ("dynamic", "modulo")
    return [
        (m.tables in ("static", "dynamic", "modulo"), f"model.tables {m.tables!r}: static, dynamic or modulo"),
        (m.evict in ("lru", "lfu", "ttl"), f"model.evict {m.evict!r}: lru, lfu or ttl"),
        (m.evict != "ttl" or m.ttl_steps > 0, "model.evict=ttl needs model.ttl_steps > 0"),
        (m.admit_after >= 1, f"model.admit_after must be >= 1, got {m.admit_after}"),
        (not (stream and d.path), "data.stream and data.path are both set: train on one of them"),
        (not stream or raw, ("data.stream reads raw keys, which a static table has no ids for: "
                            "model.tables=dynamic (a row per key) or modulo")),
        (stream or not raw, (f"model.tables={m.tables} reads raw keys: it needs data.stream=DIR "
                            "(a preprocessed dataset's ids are already table rows)")),
        (bool(STREAM_STOP.match(d.stream_stop)),
         f"data.stream_stop {d.stream_stop!r}: idle:SECONDS, files:N or never"),
        (d.stream_poll_s > 0, f"data.stream_poll_s must be positive, got {d.stream_poll_s}"),
        (d.on_bad_line in ("error", "skip"), f"data.on_bad_line {d.on_bad_line!r}: error or skip"),
        (not t.publish_every or bool(PUBLISH_EVERY.match(t.publish_every)),
         f"train.publish_every {t.publish_every!r}: STEPS or SECONDSs (e.g. 500 or 30s)"),
        (t.publish_keep >= 1, f"train.publish_keep must be >= 1, got {t.publish_keep}"),
        (t.progressive_window >= 1, f"train.progressive_window must be >= 1, got {t.progressive_window}"),
        (not (stream and t.workers > 1), ("data.stream with train.workers > 1: Hogwild threads share one loader "
                                         "position per step; use train.workers=1")),
        (not (stream and (t.eval_every or t.early_stop)),
         ("data.stream has no held-out split: train.eval_every and train.early_stop are off for a stream "
         "(its metrics are test-then-train: each batch scored before it trains)")),
        (not (stream and cfg.dist.group_size), "data.stream with dist.group_size: not with hierarchical groups yet"),
        (not (stream and t.recovery == "partial" and cfg.dist.num_ps),
         ("data.stream with dist.num_ps and train.recovery=partial: not yet (the servers' rows and the "
         "trainers' key maps are restored from the last checkpoint); use train.recovery=full")),
        (not (stream and cfg.optim.decay != "none" and not t.max_steps),
         f"optim.decay={cfg.optim.decay} needs a last step: a stream has none unless train.max_steps is set"),
    ]


def _threshold_checks(cfg: Config) -> list[tuple[bool, str]]:
    """DCT-MP's threshold selection (``compress.embedding_select=threshold``)."""
    c = cfg.compress
    if c.embedding != "dct" or c.embedding_select != "threshold":
        return []
    return [
        (not (c.embedding_tables or c.embedding_min_rows),
         ("compress.embedding_select=threshold codes every sharded table: leave compress.embedding_tables "
          "and compress.embedding_min_rows unset")),
        (cfg.model.arch == "dlrm", (f"compress.embedding_select=threshold needs model.arch=dlrm (got "
          f"{cfg.model.arch}: its FM piece is not an activation to threshold)")),
    ]


def injection_problem(spec: str, world_size: int, num_ps: int = 0) -> str | None:
    """Why ``train.inject_failure`` cannot run with ``world_size`` (trainer) ranks and
    ``num_ps`` parameter servers, or None."""
    from hybridrec.train.checkpointing.faults import parse_inject_failure

    for rank, _ in parse_inject_failure(spec):
        if isinstance(rank, str):
            if int(rank[2:]) >= num_ps:
                return (f"train.inject_failure={spec}: parameter server {rank} does not exist: this run has "
                        + (f"{num_ps} (ps0..ps{num_ps - 1})" if num_ps else "none (dist.num_ps=0)"))
        elif rank >= world_size:
            return (f"train.inject_failure={spec}: rank {rank} does not exist: this run has "
                    f"{world_size} rank{'s' if world_size != 1 else ''} (0..{world_size - 1})")
    return None


def group_size(cfg: Config, world: int, local_world: int) -> int:
    """Ranks per group of ``dist.group_size`` (0: the ranks of one machine when a
    synchronizer joins the groups and the run spans several machines, else every rank)."""
    if cfg.dist.group_size:
        return cfg.dist.group_size
    return local_world if cfg.sync.algorithm != "none" and world > local_world else world


def hierarchy_problem(cfg: Config, world: int, local_world: int) -> str | None:
    """Why ``dist.group_size`` cannot run with the rest of ``cfg`` on ``world`` ranks
    (None: it can, or the run is flat). Checked before any process group is made."""
    from hybridrec.parallel.topology import group_problem

    m = group_size(cfg, world, local_world)
    if problem := group_problem(world, m, min(local_world, world)):
        return problem
    if m == world:
        if cfg.sync.algorithm != "none" and cfg.compress.dense != "none":
            return (f"sync.algorithm={cfg.sync.algorithm} with one group of all {world} ranks averages "
                    "replicas, not gradients: compress.dense must be none")
        return None
    what = f"dist.group_size={m} makes {world // m} groups of the {world} ranks"
    if cfg.sync.algorithm == "none":
        return f"{what}, but nothing keeps them together: set sync.algorithm ({either(ALGORITHMS)})"
    if cfg.train.workers > 1:
        return f"{what}; train.workers > 1 runs on one rank only"
    return None


def plan_file_problem(cfg: Config, group: int, world: int) -> str | None:
    """Why ``dist.plan`` cannot run on groups of ``group`` of the ``world`` ranks (None: no
    file, or it can): unreadable, invalid (a shard or a column block on a rank that does
    not exist), or made for another number of ranks."""
    from hybridrec.parallel.plan import ShardingPlan

    if not cfg.dist.plan:
        return None
    try:
        plan = ShardingPlan.from_json(Path(cfg.dist.plan).read_text())
    except (OSError, ValueError, KeyError, TypeError) as e:
        return f"dist.plan {cfg.dist.plan}: {e}"
    if plan.world_size != group:
        has = "each group of this run has" if group < world else "this run has"
        return f"dist.plan {cfg.dist.plan} is for {plan.world_size} ranks, {has} {group}"
    return None


# -- the config against the run ----------------------------------------------------------
def _run_dir(cfg: Config, f: RunFacts) -> str | None:
    if f.building and not cfg.train.run_dir:
        return "train.run_dir is not set (hybridrec train picks a new runs/<time> itself)"
    return None


def _held_out(cfg: Config, f: RunFacts) -> str | None:
    """``train.early_stop`` needs held-out rows."""
    if f.meta is not None and cfg.train.early_stop > 0 and f.meta.split_rows("eval") == 0:
        return (f"train.early_stop={cfg.train.early_stop}: the dataset {f.meta.path} has no held-out "
                "rows (its eval split is empty), so there is no AUC to watch; preprocess with a "
                "held-out part (--eval-parts), or train.early_stop=0")
    return None


def _injection(cfg: Config, f: RunFacts) -> str | None:
    return injection_problem(cfg.train.inject_failure, f.world, cfg.dist.num_ps)


def _batches(cfg: Config, f: RunFacts) -> str | None:
    """A global batch no larger than the training rows."""
    if f.meta is None or cfg.data.stream:
        return None
    rows = f.meta.split_rows("train")
    if steps_per_epoch(rows, cfg.data.batch_size, f.world) == 0:
        return (f"data.batch_size={cfg.data.batch_size} x {f.world} rank(s) is larger than the "
                f"{rows} training rows of {f.meta.path}")
    return None


def _steps(cfg: Config, f: RunFacts) -> str | None:
    if f.meta is None or cfg.data.stream:
        return None
    per_epoch = steps_per_epoch(f.meta.split_rows("train"), cfg.data.batch_size, f.world)
    return steps_problem(cfg, planned_steps(cfg, per_epoch))


STREAM_STEPS = 1 << 62
"""A stream run's planned steps when ``train.max_steps`` sets none: the stream decides."""


def planned_steps(cfg: Config, per_epoch: int) -> int:
    """The steps a run takes: ``train.epochs`` epochs of ``per_epoch`` steps
    (:func:`~hybridrec.data.loader.steps_per_epoch`), capped by ``train.max_steps``; a
    stream's: ``train.max_steps``, else :data:`STREAM_STEPS` (the stream ends it)."""
    if cfg.data.stream:
        return cfg.train.max_steps or STREAM_STEPS
    total = cfg.train.epochs * per_epoch
    return min(total, cfg.train.max_steps) if cfg.train.max_steps else total


def _workers(cfg: Config, f: RunFacts) -> str | None:
    if problem := workers_problem(cfg, f.world):
        return problem
    if cfg.train.workers > 1 and f.device != "cpu":
        return (f"train.workers={cfg.train.workers} on {f.device}: Hogwild threads share CPU cores "
                "and are not supported on a GPU; use train.workers=1, or dist.backend=gloo for the CPU")
    return None


def _precision(cfg: Config, f: RunFacts) -> str | None:
    from hybridrec.model.kernels import precision_problem

    return precision_problem(cfg.train.precision, f.device)


def _backend(cfg: Config, f: RunFacts) -> str | None:
    if cfg.dist.backend == "nccl" and f.world == 1 and not f.gpus:
        return "dist.backend=nccl: CUDA is not available here; use dist.backend=auto or gloo"
    return None


def _exchange(cfg: Config, f: RunFacts) -> str | None:
    """The pairwise exchange is gloo's point-to-point send/recv, which takes CPU tensors only."""
    if cfg.dist.exchange == "pairwise" and f.device != "cpu" and f.world > 1:
        return (f"dist.exchange=pairwise on {f.device}: gloo's point-to-point sends take CPU tensors "
                "only; use dist.exchange=collective on GPUs")
    return None


def _groups(cfg: Config, f: RunFacts) -> str | None:
    if f.world == 1:
        return None
    return hierarchy_problem(cfg, f.world, f.local_world)


def _plan_file(cfg: Config, f: RunFacts) -> str | None:
    if f.world == 1 or cfg.dist.num_ps:
        return None
    return plan_file_problem(cfg, group_size(cfg, f.world, f.local_world), f.world)


def _partitioned(cfg: Config, f: RunFacts) -> str | None:
    """Dense modules partitioned over a group's ranks (``dist.partition_dense``)."""
    parts = cfg.dist.partition_dense
    if not parts or f.world == 1:
        return None
    what = f"dist.partition_dense={','.join(parts)}: dense modules partitioned over the group's ranks"
    if cfg.sync.algorithm != "none" and group_size(cfg, f.world, f.local_world) == f.world:
        return (f"{what}: sync.algorithm={cfg.sync.algorithm} would average different column blocks; "
                "partition inside groups (dist.group_size) instead")
    if cfg.train.init_from:  # (its reader fills each rank's tensors whole: a block is part of one)
        return f"{what}: train.init_from cannot load into column blocks yet; train replicated (no dist.partition_dense)"
    return None


RUN_RULES: tuple[Rule, ...] = (
    _run_dir, _held_out, _injection, _batches, _steps, _workers, _precision, _backend, _exchange, _groups,
    _plan_file, _partitioned,
)
"""The config against the run (:func:`check_run`), in the order they are checked."""


# -- the config against the sharding plan ---------------------------------------------------
def _plan_partitioned(cfg: Config, plan, hierarchical: bool) -> str | None:
    """A plan file's partitioned dense modules, as ``dist.partition_dense``'s."""
    parts = [n for n, d in plan.dense.items() if d.placement == "partitioned"]
    what = f"dist.plan partitions {', '.join(parts)} over the group's ranks"
    if parts and cfg.sync.algorithm != "none" and not hierarchical:
        return (f"{what}: sync.algorithm={cfg.sync.algorithm} would average different column blocks; "
                "partition inside groups (dist.group_size) instead")
    return None


def _threshold_tables(cfg: Config, plan, hierarchical: bool) -> str | None:
    c = cfg.compress
    trw = sorted(n for n, tp in plan.tables.items() if tp.sharding_type == "table_row_wise")
    if trw and c.embedding == "dct" and c.embedding_select == "threshold":
        return (f"compress.embedding_select=threshold takes no table_row_wise tables "
                f"({', '.join(trw[:3])}): use dist.sharding=row_wise or the top-k selection")
    if trw and c.embedding != "none" and c.embedding_when == "pays":
        return ("compress.embedding_when=pays: not measured with table_row_wise tables "
                "(their in-host sums take a second hop); use compress.embedding_when=always")
    return None


def _embedding_tables(cfg: Config, plan, hierarchical: bool) -> str | None:
    """``compress.embedding_tables`` names tables of the model."""
    c = cfg.compress
    if not c.embedding_tables or c.embedding == "none":
        return None
    unknown = sorted(set(c.embedding_tables) - set(plan.tables))
    return f"compress.embedding_tables: no tables named {unknown}" if unknown else None


PLAN_RULES: tuple[Callable, ...] = (_plan_partitioned, _threshold_tables, _embedding_tables)
"""The config against the sharding plan (:func:`check_plan`)."""


def dense_plan(cfg: Config, plan, model, group: int) -> dict:
    """The run's dense part (``dist.partition_dense`` or the plan file's) resolved on
    ``model`` for groups of ``group`` ranks; what does not fit the model is a ConfigError
    (:func:`hybridrec.parallel.placement.resolve_dense`)."""
    from hybridrec.parallel.placement import resolve_dense

    try:
        return resolve_dense(cfg.dist.partition_dense, plan.dense, model, group, batch=cfg.data.batch_size)
    except ValueError as e:
        raise ConfigError(str(e)) from None
