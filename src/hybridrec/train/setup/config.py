"""Typed training configuration: dataclasses, TOML/JSON files, ``key=value`` overrides.

Every field has a docstring; an unknown key or a value of the wrong type is a
:class:`ConfigError` that names the key (with a suggestion for typos).

A relative path in a config file (the keys of :data:`PATH_KEYS`) is relative to that
file's directory, so a file means the same from any working directory; one on the
command line (``data.path=...``) or in a recipe is relative to the working directory.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import os
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path

import tomllib

from hybridrec.errors import ConfigError


class ReadOnly:
    """A config (or one of its sections) that :func:`~hybridrec.train.setup.configure.validate`
    made read-only: the options checked are the options the run uses. A changed copy is
    :func:`~hybridrec.train.setup.configure.replace`'s."""

    def __setattr__(self, name: str, value) -> None:
        if self.__dict__.get("_read_only"):
            raise AttributeError(f"the config is read-only once validated (setting {name!r}): "
                                 "use replace(cfg, {\"SECTION.KEY\": value}) (hybridrec.train.setup.configure)")
        object.__setattr__(self, name, value)

    def _seal(self, read_only: bool) -> None:
        object.__setattr__(self, "_read_only", read_only)


@dataclass(kw_only=True)
class DataConfig(ReadOnly):
    path: str = ""
    """Preprocessed dataset directory (``hybridrec data preprocess`` output)."""
    batch_size: int = 512
    """Samples per step per rank. 512 by default, from the sweep in docs/benchmarks.md
    ("Defaults: the sweep"): with the default optimizers, batch 2048 trained 0.002-0.007
    AUC worse in one epoch (4x fewer steps), batch 1024 up to 0.005 worse."""
    eval_batch_size: int = 8192
    """Samples per evaluation batch per rank."""
    shuffle: bool = True
    """Shuffle training rows (deterministically, within windows)."""
    shuffle_window: int = 1 << 20
    """Rows per shuffle window: larger mixes more, reads less sequentially."""
    prefetch: int = 2
    """Batches prepared ahead by a background thread (0 = none)."""
    workers: int = 0
    """Loader threads making whole batches ahead of the step (with ``data.prefetch`` > 0);
    0 = automatic: one beside a CPU step, this rank's share of the machine's cores beside
    a GPU step (:func:`hybridrec.data.loader.default_workers`)."""
    stream: str = ""
    """Train on raw files as they land in this directory instead of a preprocessed dataset
    (``data.path``): Criteo TSV files (plain or ``.gz``), taken in name order once complete
    (written under a temporary name, ``.NAME`` or ``NAME.tmp``, then renamed), encoded on the
    fly for ``model.tables=dynamic`` or ``modulo``. See the guide, "Training on a stream"."""
    stream_schema: str = ""
    """A CSV or Parquet stream's schema file (the one ``data preprocess --schema`` takes: label,
    dense and categorical columns); empty: the stream is Criteo TSV."""
    stream_stop: str = "idle:60"
    """When a stream run ends: ``idle:SECONDS`` (no new file for that long), ``files:N`` (N
    files trained in all) or ``never``."""
    stream_poll_s: float = 1.0
    """Seconds between two looks at ``data.stream`` for a new file while waiting."""
    on_bad_line: str = "error"
    """A malformed line of a stream file: ``error`` (stop with one line naming the file and
    line) or ``skip`` (drop it and count it in summary.json)."""


@dataclass(kw_only=True)
class ModelConfig(ReadOnly):
    arch: str = "dlrm"
    """Model family: ``dlrm`` or ``deepfm`` (DLRM plus first-order and FM terms)."""
    embedding_dim: int = 16
    """Embedding dim of every table (DLRM: equals the bottom MLP output)."""
    bottom_mlp: list[int] = field(default_factory=lambda: [512, 256, 64, 16])
    """Bottom MLP widths after the dense input."""
    top_mlp: list[int] = field(default_factory=lambda: [512, 256, 1])
    """Top MLP widths, ending in 1."""
    interaction: str = "dot"
    """``dot`` (pairwise dot products), ``cat``, or ``dcn`` (DLRM-DCNv2: a low-rank cross
    network over the bottom-MLP output and the pooled embeddings side by side,
    ``model.dcn_layers`` layers at rank ``model.dcn_rank``)."""
    dcn_layers: int = 3
    """``model.interaction=dcn``: cross layers (the MLPerf DLRM-DCNv2's 3)."""
    dcn_rank: int = 512
    """``model.interaction=dcn``: the cross layers' low rank (the MLPerf DLRM-DCNv2's 512),
    capped at a quarter of their input width ``n = (F+1) x embedding_dim`` (F: the features)
    and at ``max(16, n**2 // 12288)``, which keeps a small model's step near the dot DLRM's
    (the demo: n = 432, rank 16: 1.03-1.08x in bf16, 1.32-1.43x in fp32 on a loaded machine;
    the MLPerf model: n = 3,456, 512 kept).
    docs/guide.md, "DLRM-DCNv2"."""
    pooling: str = "sum"
    """Pooling of multi-hot bags: ``sum`` or ``mean``."""
    embedding_dtype: str = "fp32"
    """Storage of the embedding tables: ``fp32``, or ``bf16`` (half the memory and the
    lookups' reads; updates computed in fp32 and stored with stochastic rounding, optimizer
    state fp32; not with DeepFM's FM tables, parameter servers or sync.algorithm).
    docs/design.md, "bf16 tables"."""
    tables: str = "static"
    """What a table row stands for. ``static``: the dataset's ids (its preprocessing made
    them); ``dynamic``: every raw key gets a row of its own once admitted (collisionless,
    with a row budget ``model.table_rows``, least-used rows evicted when it is full);
    ``modulo``: ``1 + key % table_rows`` (keys share rows, the baseline). The last two
    read raw keys: a stream (``data.stream``)."""
    table_rows: str = "100000"
    """Rows of each dynamic or modulo table besides its shared row 0 (missing and not yet
    admitted keys): one number for every table, or ``N,C3=M,...`` (a default and
    per-feature values)."""
    admit_after: int = 1
    """A dynamic table's key gets a row once seen this many times (counted in a fixed-size
    sketch per table); until then it shares row 0."""
    evict: str = "lru"
    """Which rows a full dynamic table frees for new keys: ``lru`` (least recently used),
    ``lfu`` (least often used) or ``ttl`` (unused for ``model.ttl_steps`` steps; none
    other)."""
    ttl_steps: int = 0
    """With ``model.evict=ttl``: steps without a use after which a key's row is freed."""


@dataclass(kw_only=True)
class OptimConfig(ReadOnly):
    dense: str = "adam"
    """Dense optimizer: ``sgd``, ``adagrad`` or ``adam``. The defaults (Adam 0.001, row-wise
    Adagrad 0.05 for the embeddings, batch 512, 50 warm-up steps) come from a sweep over a
    synthetic log with Criteo Kaggle's cardinalities, a multi-hot one and UCI Adult
    (docs/benchmarks.md, "Defaults: the sweep"): within 0.0012 AUC of the best setting on each,
    where plain SGD 0.1 at batch 2048 was 0.05-0.07 behind and dense Adagrad 0.05 sometimes
    diverged on the default MLPs."""
    dense_lr: float = 0.001
    """Dense learning rate (peak, after warm-up)."""
    sparse: str = "rowwise_adagrad"
    """Embedding optimizer: ``sgd``, ``rowwise_adagrad`` or ``lazy_adam``."""
    sparse_lr: float = 0.05
    """Embedding learning rate (peak, after warm-up)."""
    momentum: float = 0.0
    """SGD momentum (dense only)."""
    weight_decay: float = 0.0
    """Dense weight decay."""
    eps: float = 1e-8
    """Adagrad/Adam epsilon, dense and sparse."""
    warmup_steps: int = 50
    """Linear warm-up from 0 to the peak learning rates (0 = none)."""
    decay: str = "none"
    """After warm-up: ``none``, ``linear`` (to 0 at the last step), ``cosine`` or ``poly2``."""
    decay_start: int = 0
    """Step where decay begins (0 = right after warm-up)."""


@dataclass(kw_only=True)
class TrainConfig(ReadOnly):
    epochs: int = 1
    """Passes over the training split."""
    max_steps: int = 0
    """Stop after this many steps (0 = no limit)."""
    eval_every: int = 0
    """Evaluate every N steps (0 = only at the end; an N past the run's last step is refused)."""
    publish_every: str = ""
    """Publish the model every ``N`` steps or ``Ns`` seconds (e.g. ``30s``): an export (the
    format of ``hybridrec export``, with the dynamic tables' key maps) written atomically to
    ``RUN/published/vK/`` and named by ``RUN/published/LATEST`` (``hybridrec serve`` follows
    it). Empty: never."""
    publish_keep: int = 3
    """How many published versions to keep (the one LATEST names always stays)."""
    progressive_window: int = 100000
    """Test-then-train metrics (a stream run): every batch is scored before it is trained on;
    the AUC and log loss of the last this many samples are logged (``progressive_auc``,
    ``progressive_logloss``) and reported."""
    early_stop: int = 0
    """Early stopping (patience, as Keras'): stop after this many evaluations in a row
    (every ``train.eval_every`` steps) without an improvement of the held-out AUC; every
    improvement saves a checkpoint, kept as the run's best (``hybridrec eval RUN`` loads
    it). 0 = off."""
    early_stop_min_delta: float = 0.0
    """``train.early_stop``: an AUC must beat the best one by more than this to count as an
    improvement."""
    log_every: int = 50
    """Write train metrics to metrics.jsonl every N steps."""
    checkpoint_every: int | str = 0
    """Save a checkpoint every N steps (0 = only at the end), or ``auto``: after a measured
    first checkpoint, every N steps with N from the Young/Daly optimum
    ``sqrt(2 * save seconds * train.mtbf_hours)`` over the measured step time, clamped to
    [1, total steps] (printed, and in summary.json ``checkpoint_interval``); none less than
    half an interval before the final checkpoint."""
    mtbf_hours: float = 24.0
    """``train.checkpoint_every=auto``: the mean time between failures of the whole job, in
    hours (a job of many machines fails more often than one machine)."""
    inject_failure: str = ""
    """Fault injection for testing recovery: ``RANK:STEP`` makes rank RANK kill itself
    (SIGKILL) right after step STEP, once per run directory (``failure_injected.json``
    there records it, so a run started again resumes without dying). A schedule
    ``RANK:STEP,RANK:STEP,...`` (steps strictly increasing) injects each entry once: several
    failures in one run with ``dist.max_restarts``. Empty = off."""
    recovery: str = "full"
    """What a failure costs (a restart by ``dist.max_restarts``, or the same command again).
    ``full``: every rank resumes from the newest checkpoint, and the steps since it are
    trained again. ``partial`` (CPR): only the embedding shards of the rank that failed roll
    back to the newest checkpoint; the surviving ranks write a snapshot of their state when
    the run stops (``RUN/recovery/``) and resume from it, with the dense part, the optimizer
    and the loader of a survivor; training goes on from the step the survivors reached, and
    the failed shards' updates since the checkpoint are lost (summary.json ``recovery``
    counts them per shard). Needs checkpoints and synchronous DES training (no sync.algorithm,
    no parameter servers, one worker). Under ``hybridrec train``'s local launcher each rank's
    shards then live in files of ``/dev/shm/hybridrec-<run>/`` while it trains (where there is
    room), which a survivor's snapshot takes as they are; the launcher removes them when it
    ends. A launcher killed outright (``kill -9``) leaves them until the same command runs
    again (or ``rm -r /dev/shm/hybridrec-*``)."""
    lost_fraction: float = 0.02
    """``train.recovery=partial`` with ``train.checkpoint_every=auto``: the expected fraction of
    the embedding updates a run may lose to failures (CPR's portion of lost samples); the
    interval is the longest that keeps it, and at least Young/Daly's. With
    ``train.shard_delta_every`` the deltas bound the loss instead, and the interval weighs a
    save against replaying deltas, timed by reading one back
    (:mod:`hybridrec.train.checkpointing.checkpoint_interval`)."""
    shard_delta_every: int = 0
    """``train.recovery=partial``: besides the checkpoints, every N steps each rank saves the
    rows of its embedding shards touched since its previous save (weights and optimizer
    state; no collective, written in the background), so a failed rank's shards roll back
    only to its newest such delta. 0 = off."""
    shard_delta_rows: str = "touched"
    """``train.shard_delta_every``: ``touched`` saves every touched row; ``hot`` (CPR-MFU) only
    the most looked-up ``train.shard_delta_hot`` of them, the others at a later delta or
    the next checkpoint."""
    shard_delta_hot: float = 0.25
    """``train.shard_delta_rows=hot``: the share of the touched rows a delta saves (the most
    looked-up since their last save)."""
    async_checkpoint: bool = False
    """Write checkpoints in the background: a save stops training only while each rank copies
    its state, then a thread writes the files while training goes on. Costs a copy of every
    tensor a rank saves until it is written (1.66x the training peak in the row-wise
    benchmark), and where every core is training the write slows the steps instead (on 2
    cores it saved no time: docs/benchmarks.md). Parameter-server and hierarchical runs save
    in the foreground."""
    keep_checkpoints: int = 2
    """How many recent checkpoints to keep."""
    save_checkpoints: bool = True
    """false: write no checkpoint at all (e.g. throughput benchmarks); nothing to resume."""
    run_dir: str = ""
    """Where the run writes config, metrics, summary and checkpoints (empty: a new
    ``runs/<YYYYmmdd-HHMMSS>`` for every run). Naming a directory that holds a run
    resumes it; one that holds a run of an incompatible config is refused."""
    resume: bool = True
    """Resume from the newest checkpoint in run_dir if there is one; false: start over,
    deleting the directory's checkpoints, metrics and summary first. The ranks the
    launcher starts again after a failure (``dist.max_restarts``) resume the run this
    command started, either way."""
    init_from: str = ""
    """Warm start: a run directory (its best checkpoint when it recorded one, else its
    newest) or a checkpoint directory (``RUN/checkpoints/step-N``) whose weights this run
    starts from, whatever world size saved it; only when this run has no checkpoint of its
    own to resume. The step and the LR schedule start from 0. See
    :mod:`hybridrec.train.init_from`."""
    init_optimizer: bool = False
    """With ``train.init_from``: the optimizers' state too (dense state, per-row sparse
    state such as row-wise Adagrad's sums); the source must use the same optimizers."""
    reevaluate: bool = False
    """A finished run named again (its summary and final checkpoint at the planned step)
    is left alone; true: evaluate its final checkpoint again and rewrite its summary."""
    seed: int = 0
    """Seed for initialisation and data order."""
    tensorboard: bool = False
    """Also write TensorBoard events (needs the tensorboard package)."""
    progress: bool = True
    """Show progress on stderr: a bar on a terminal, else a line every ``log_interval_s``."""
    log_interval_s: float = 30.0
    """Seconds between two progress lines when stderr is not a terminal (0 = none): step,
    samples/s, loss, ETA."""
    memory_limit_gb: float = 0.0
    """Memory (GB, 10^9 bytes) the run may use on each machine (0 = what the machine has
    available): a plan whose tables, optimizer state and dense model need more is refused
    before anything is allocated."""
    threads: int = 0
    """torch intra-op threads of the training step. 0: chosen while the run trains, by timing
    steps at torch's default count (one per core) and at fewer, again and again (a machine
    whose cores another job takes trains faster on fewer; see
    :mod:`hybridrec.train.loop.thread_governor`); N: exactly N."""
    precision: str = "fp32"
    """Compute dtype of the dense arches (MLPs, interaction): ``fp32`` or ``bf16``
    (autocast: parameters, optimizer state, embeddings, the loss and the dense gradients'
    all-reduce stay fp32; with several ranks the pooled embeddings and their gradients
    travel in bf16 where the receiver only places them, see
    :mod:`hybridrec.parallel.sharded_embedding`)."""
    allocator: str = "retain"
    """``retain``: glibc's malloc keeps freed blocks up to 32 MiB for the next step instead
    of unmapping them (no page faults on the step's temporaries; 15-20% of a CPU step);
    ``system``: malloc as it is (:mod:`hybridrec.train.loop.allocator`)."""
    kernels: str = "auto"
    """Linear kernels of the MLPs: ``auto`` times the candidates (torch's F.linear, oneDNN)
    on each layer's shape at start-up and keeps the fastest, cached per machine in
    ~/.cache/hybridrec/kernels.json; ``measure`` times them again; ``torch`` or
    ``onednn`` everywhere. The choices are in summary.json (``kernels``)."""
    workers: int = 1
    """Training threads in this trainer process (Hogwild). N > 1: N threads each take the
    next batch from the shared loader and train the one model without locks (their own
    gradients, updates applied to the shared weights and optimizer state as they come;
    colliding updates are accepted, so runs are not reproducible bit for bit); evaluation
    and checkpoints wait until every thread has paused. One rank, or parameter-server
    trainers (dist.num_ps) without a per-step dense all-reduce. Default 1, from the
    measurement (docs/benchmarks.md): on 2 cores, 2 workers with train.threads=1 train
    0.99-1.14x the samples/s of one worker (1.2-1.4x before the helper threads ran
    single-threaded), at a small AUC cost (demo: -0.002 on average),
    which does not pay for losing reproducible, bit-exact runs and resumes."""


@dataclass(kw_only=True)
class DistConfig(ReadOnly):
    nproc: int = 1
    """Local ranks; > 1 starts them through torch's elastic launcher (torchrun)."""
    port: int = 0
    """The rendezvous port of a local launch (``dist.nproc`` > 1 or ``dist.num_ps`` > 0),
    where every process of the run meets on this machine, on loopback only (0: a free one)."""
    nnodes: int = 1
    """Machines of a launch of several by ``hybridrec train`` itself (each runs the same
    command with its own ``dist.node_rank``, ``dist.nproc`` ranks each): its sockets bind
    ``dist.interface`` alone (torchrun's listen on every interface). 1: this machine alone."""
    node_rank: int = 0
    """This machine's index among ``dist.nnodes``; machine 0 hosts the rendezvous at
    ``dist.master``."""
    master: str = ""
    """``HOST:PORT`` where machine 0 hosts the rendezvous (HOST: machine 0's address on
    ``dist.interface``); with ``dist.nnodes`` > 1."""
    interface: str = ""
    """The network interface every socket of a launch of several machines binds (the
    rendezvous, the ranks' store, gloo, TensorPipe), e.g. ``eth0``: a private network's, as
    torch's store and RPC have no authentication (README, "Trust")."""
    join_timeout_s: float = 600.0
    """A launch of several machines (``dist.nnodes`` > 1): how long each machine waits, from
    its start (on a machine other than 0, for machine 0 to be reachable too), for the others
    to join before it gives up in one line naming the machines (``dist.node_rank``) that did
    not come, and exits non-zero; the machines that came stop with it. While it waits it
    says so every 30 s."""
    max_restarts: int = 0
    """Local launch: when a process fails, torch's elastic agent stops the others and starts
    them all again, up to this many times; they resume from the newest checkpoint of the
    run directory (0: a failure ends the run). > 0 launches through the agent even with
    one process."""
    sharding: str = "auto"
    """Embedding sharding when several ranks train: ``auto`` (the planner), or one type for
    every table: table_wise, row_wise, column_wise, table_row_wise, data_parallel."""
    plan: str = ""
    """A sharding plan JSON file (``hybridrec plan --out``); overrides ``sharding``."""
    backend: str = "auto"
    """Where training runs. ``auto``: one process on the current GPU when CUDA is available,
    else on the CPU; several ranks: NCCL with one GPU per rank (``cuda:LOCAL_RANK``) when the
    machine has a GPU per rank, gloo on shared GPUs with fewer, gloo on the CPU without
    (``parallel/devices.py``). ``gloo``: the CPU always. ``nccl``: a GPU per rank (refused
    otherwise)."""
    timeout_s: float = 300.0
    """Bound on every collective: a dead peer ends the run with an error, not a hang."""
    pipeline: bool = False
    """Start the next batch's input distribution before the current step (same results).
    Off by default: on 2-core CPU ranks the extra communication thread cost more than the
    overlap saved (docs/benchmarks.md); turn it on where communication has its own engine."""
    exchange: str = "collective"
    """Pooled-embedding all-to-alls: ``collective`` (the backend's) or ``pairwise`` (receives
    posted first: on gloo over TCP both link directions run at once, about twice the rate)."""
    dense_sync: str = "ddp"
    """How the dense arches' gradients are averaged over ranks: ``ddp`` (torch DDP, bucketed
    all-reduce overlapped with backward, through ``compress.dense``), ``allreduce`` (one
    explicit step after backward, through ``compress.dense``, no DDP) or ``none`` (every rank
    keeps its own dense replica; for a synchronizer that averages replicas instead)."""
    num_ps: int = 0
    """Parameter-server mode: this many extra processes hold the embedding tables (0: DES,
    the tables sharded over the trainers). Trainers pull a batch's rows and push their
    gradients over RPC; ``hybridrec train dist.nproc=N dist.num_ps=P`` starts both."""
    ps_sharding: str = "row_wise"
    """How the tables are placed on the servers: ``row_wise`` (every table's rows split
    evenly over all servers) or ``table_wise`` (whole tables, largest first, to the server
    with the fewest rows so far)."""
    ps_max_staleness: int = -1
    """Parameter servers: how many steps a trainer may run ahead of the slowest trainer's
    pushes; -1: unbounded, fully asynchronous (each push is an update of its own); 0:
    synchronous (every trainer's push of a step is summed and applied as one update, as one
    process with the global batch would)."""
    rpc_interface: str = ""
    """Network interface the RPC agent of a parameter-server run listens on (empty: the
    loopback interface when every process is on this machine, else TensorPipe's choice)."""
    group_size: int = 0
    """Hierarchical training: ranks per group (consecutive ranks). Inside a group training is
    synchronous (embeddings sharded over the group's ranks, ``dist.dense_sync``); across
    groups the whole replica (dense part and embedding shards) is kept close by ``sync.algorithm``.
    0: the ranks of one machine when a synchronizer is set and the run spans several
    machines, else every rank (one group: flat)."""
    partition_dense: list[str] = field(default_factory=list)
    """Dense modules (e.g. ``top_mlp``) whose widest linear layer is split by output columns
    over the group's ranks instead of replicated (activations exchanged synchronously);
    written into the plan's dense part (``hybridrec plan --partition-dense``). ``auto``: the
    planner partitions each MLP whose activation bytes are fewer than the all-reduce bytes
    it saves (:func:`hybridrec.parallel.planner.choose_dense`)."""


@dataclass(kw_only=True)
class CompressConfig(ReadOnly):
    dense: str = "none"
    """Dense data-parallel gradients: ``none``, ``dct`` (threshold, refreshed every
    ``dense_refresh_every`` steps), ``topk`` (exact top-k every step), ``fp16``, ``bf16``
    or ``powersgd``."""
    dense_ratio: float = 0.01
    """Fraction of gradient entries kept (eta) by ``dct`` and ``topk``."""
    dense_refresh_every: int = 0
    """``dct``: steps between recomputations of the threshold (L); 0 (auto): 1% of the run's
    steps, at least 10 and at most 2000. Either way the first refreshes come sooner (after
    1, 2, 4, ... compressed steps, doubling up to L), while gradients shrink fastest."""
    dense_error_feedback: bool = True
    """Keep what was not sent as a residual added to the next step's gradient."""
    dense_warmup_steps: int = 0
    """Steps sent uncompressed before compression starts (``powersgd``: at least 2, as DDP
    rebuilds its buckets after the first step)."""
    dense_cap: float = 1.25
    """``dct``: a tensor's message holds at most ``ceil(dense_cap * eta * n)`` entries (the
    largest that pass the threshold; the others wait in the residual), in a buffer of fixed
    size, so no message sizes are exchanged in the middle of the backward; 0: the paper's
    pure threshold, a message of its own size, its size exchanged first. Else >= 1."""
    dense_min_numel: int = 0
    """``dct`` and ``topk``: tensors of fewer entries are sent whole every step (no residual,
    no threshold), beside the compressed ones in the same fixed-size message. Their bytes are
    few, and an eta share of a small tensor is one or two entries a step, each entry waiting
    about ``1 / eta`` steps in the residual. 0 (the default, the paper's): every tensor is
    compressed. With plain SGD over 291 steps of the bench DLRM, 8192 (the biases, the
    13-input layer and the output layer whole) halved DCT-DP's AUC loss at eta 0.004
    (docs/benchmarks.md, "DCT-DP under plain SGD")."""
    dense_when: str = "always"
    """``dct`` and ``topk``: ``always`` compress as configured; ``pays``: at start-up time the
    compressor's work of a step on the dense arches' gradients against the wire time it saves
    (the float32 all-reduce against the exchange of its fixed-size messages; both measured,
    the slowest rank's) and send the plain all-reduce when compressing does not pay;
    summary.json says which (``kernels.dense_compression``; :mod:`hybridrec.parallel.codec_pays`)."""
    dense_replicated: bool = True
    """With ``dct`` or ``topk``: compress the replicated (data-parallel) tables' gradients too,
    with the same eta and threshold schedule, instead of their dense all-reduce."""
    powersgd_rank: int = 1
    """``powersgd``: rank of the low-rank approximation."""
    embedding: str = "none"
    """Pooled-embedding hops (model-parallel, forward and backward): ``none``, ``dct``
    (keep the largest entries of every sample), ``fp16``, ``bf16`` or ``int8`` (per-row scale)."""
    embedding_ratio: float = 0.05
    """``dct``: fraction of each sample's pooled entries kept (eta)."""
    embedding_values: str = "fp32"
    """``dct``: dtype of the kept values on the wire: ``fp32``, ``fp16`` or ``bf16``."""
    embedding_select: str = "topk"
    """``dct``: ``topk`` keeps the ``eta`` largest entries of every piece of every sample (fixed
    bytes, no size exchange); ``threshold`` keeps every entry of a sample's whole boundary vector
    (all the pieces an owner sends it) whose magnitude is at least a threshold refreshed every
    ``embedding_refresh_every`` steps to keep ``eta`` of the entries on average, at most
    ``embedding_cap * eta`` of a sample's entries (its budget); sizes travel in one small
    all-to-all per step."""
    embedding_refresh_every: int = 0
    """``dct`` with ``threshold``: steps between refreshes of the threshold; 0 (auto): as
    ``dense_refresh_every``'s auto."""
    embedding_cap: float = 2.0
    """``dct`` with ``threshold``: a sample sends at most ``ceil(embedding_cap * eta * D)`` of the
    ``D`` entries an owner holds for it (the largest ones); >= 1."""
    embedding_tables: list[str] = field(default_factory=list)
    """Compress only these tables' hops (empty = every sharded table)."""
    embedding_when: str = "always"
    """``always``: compress as configured; ``pays``: at start-up time the codecs' work of a
    step against the wire time they save on this link (both measured, the slowest rank's) and
    send the hop uncompressed when compressing does not pay; summary.json says which
    (``kernels.embedding_compression``; :mod:`hybridrec.parallel.codec_pays`)."""
    embedding_min_rows: int = 0
    """Compress only the hops of tables with at least this many rows."""
    embedding_chunks: int = 1
    """Codecs of ``embedding`` (``dct`` with ``topk``, ``fp16``, ``bf16``, ``int8``): the hop
    travels in this many row chunks, one chunk coded while another travels (the same bits
    as one exchange); 1: one exchange (on a loaded 2-core Zen 3, chunks did not pay:
    docs/benchmarks.md); 0 (auto): one chunk per 4 MB of float32 rows a rank codes, at
    most 4 (:func:`hybridrec.parallel.coded_dist.coded_chunks`)."""


@dataclass(kw_only=True)
class SyncConfig(ReadOnly):
    algorithm: str = "none"
    """Synchronization of the dense replicas instead of averaging gradients (ShadowSync):
    ``none``, ``ma`` (model averaging), ``easgd`` (elastic averaging) or ``bmuf`` (block
    momentum). With one, every rank keeps its own dense replica (no DDP all-reduce); the
    embeddings stay sharded and synchronous."""
    mode: str = "background"
    """``background``: a shadow thread per rank synchronizes while training runs, as often as
    ``sync.every``, ``sync.interval_s`` and ``sync.duty`` let it; ``foreground``: a round every
    ``sync.every`` steps inside the loop."""
    every: int = 1
    """``foreground``: training steps between two rounds; ``background``: at least this many
    training steps between the starts of two rounds."""
    interval_s: float = 0.0
    """``background``: at least this many seconds between the starts of two rounds (0: no
    minimum)."""
    duty: float = 0.5
    """``background``: the largest share of the time the shadow thread spends in rounds:
    after a round of T seconds it rests T (1/duty - 1), so slow rounds (a slow link, a large
    dense part) are spaced out and quick ones are not (1: back to back). 0.5, measured
    (docs/benchmarks.md): back to back, the rounds' all-reduces took the link from the
    all-to-alls (100 Mbit/s, MLPerf-sized MLPs: 1.24x DDP's throughput; 0.5: 1.66x), while a
    quick round (1 Gbit/s, the bench model) still runs after every step."""
    alpha: float | str = "auto"
    """``easgd``: moving rate: each replica moves ``alpha`` of the way to the centre per round,
    the centre ``beta = N alpha`` of the way to the replicas' mean (N ranks; capped at 1).
    ``auto``: ``alpha = 0.9 / N``, so ``beta = 0.9`` for any N (Zhang et al. 2015's choice)."""
    block_momentum: float | str = "auto"
    """``bmuf``: block momentum (mu); ``auto``: ``1 - 1/N`` (N ranks; Chen and Huo 2016)."""
    block_lr: float = 1.0
    """``bmuf``: block learning rate (zeta)."""
    nesterov: bool = True
    """``bmuf``: hand the replicas the Nesterov look-ahead ``g + mu * delta``."""
    write_back: str = "delta"
    """``background``: ``delta`` keeps the steps a replica trained during a round
    (``w += new - snapshot``) or ``overwrite`` (``w = new``)."""
    compress: str = "none"
    """The synchronizer's hop (across groups in hierarchical training): ``none``, ``fp16``,
    ``bf16`` or ``dct`` (a magnitude threshold keeping ``sync.compress_ratio`` of the entries
    of the change since the last round, with error feedback)."""
    compress_ratio: float = 0.01
    """``sync.compress=dct``: fraction of the replica's entries sent per round."""


@dataclass(kw_only=True)
class Config(ReadOnly):
    data: DataConfig = field(default_factory=DataConfig)
    """Dataset and batching."""
    model: ModelConfig = field(default_factory=ModelConfig)
    """Architecture."""
    optim: OptimConfig = field(default_factory=OptimConfig)
    """Optimizers and schedule."""
    train: TrainConfig = field(default_factory=TrainConfig)
    """Loop, evaluation, checkpoints, run directory."""
    dist: DistConfig = field(default_factory=DistConfig)
    """Ranks, sharding, process groups."""
    compress: CompressConfig = field(default_factory=CompressConfig)
    """Communication compression (dense gradients, pooled embeddings)."""
    sync: SyncConfig = field(default_factory=SyncConfig)
    """Background / periodic synchronization of dense replicas (MA, EASGD, BMUF)."""

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def seal(self, read_only: bool = True) -> Config:
        """This config and its sections read-only (or writable again, on a copy)."""
        for f in dataclasses.fields(self):
            getattr(self, f.name)._seal(read_only)
        self._seal(read_only)
        return self


SECTIONS = {"data": DataConfig, "model": ModelConfig, "optim": OptimConfig, "train": TrainConfig,
            "dist": DistConfig, "compress": CompressConfig, "sync": SyncConfig}


def _section_fields(section: str) -> dict[str, dataclasses.Field]:
    return {f.name: f for f in dataclasses.fields(SECTIONS[section])}


def _suggest(word: str, options) -> str:
    close = difflib.get_close_matches(word, list(options), n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _resolve_key(key: str) -> tuple[str, str]:
    parts = key.split(".")
    if len(parts) != 2:
        raise ConfigError(f"config key {key!r}: expected SECTION.NAME, e.g. optim.dense_lr")
    section, name = parts
    if section not in SECTIONS:
        raise ConfigError(f"unknown config section {section!r} in {key!r}{_suggest(section, SECTIONS)}")
    fields = _section_fields(section)
    if name not in fields:
        raise ConfigError(f"unknown config key {key!r}{_suggest(name, fields)}")
    return section, name


def _field_type(section: str, name: str):
    return typing.get_type_hints(SECTIONS[section])[name]


def _coerce(key: str, value, typ):
    """Check/convert a value (from TOML/JSON or a command-line string) to ``typ``."""
    origin = typing.get_origin(typ)
    try:
        if typ is bool:
            if isinstance(value, bool):
                return value
            if isinstance(value, str) and value.lower() in ("true", "1", "yes", "on", "false", "0", "no", "off"):
                return value.lower() in ("true", "1", "yes", "on")
            raise ValueError
        if typ is int:
            if isinstance(value, bool):
                raise ValueError
            if isinstance(value, int):
                return value
            if isinstance(value, str):
                return int(value.replace("_", ""))
            raise ValueError
        if typ is float:
            if isinstance(value, bool):
                raise ValueError
            return float(value)
        if typ is str:
            if not isinstance(value, str):
                raise ValueError
            return value
        if origin in (typing.Union, types.UnionType):  # e.g. int | str: the first that fits
            for inner in typing.get_args(typ):
                try:
                    return _coerce(key, value, inner)
                except ConfigError:
                    continue
            raise ValueError
        if origin is list:
            (inner,) = typing.get_args(typ)
            if isinstance(value, str):
                text = value.strip()
                value = json.loads(text) if text.startswith("[") else [v for v in text.split(",") if v]
            if not isinstance(value, list):
                raise ValueError
            return [_coerce(key, v, inner) for v in value]
    except (ValueError, TypeError, json.JSONDecodeError):
        pass
    else:
        raise AssertionError(f"unsupported config type {typ} for {key}")
    raise ConfigError(f"config key {key!r}: {value!r} is not a valid {_type_name(typ)}")


def _type_name(typ) -> str:
    if typing.get_origin(typ) in (typing.Union, types.UnionType):
        return " or ".join(_type_name(t) for t in typing.get_args(typ))
    if typing.get_origin(typ) is list:
        (inner,) = typing.get_args(typ)
        return f"list of {inner.__name__} (e.g. {'C1,C2' if inner is str else '512,256,64'})"
    return typ.__name__ if isinstance(typ, type) else str(typ)


def set_value(cfg: Config, key: str, value) -> None:
    section, name = _resolve_key(key)
    setattr(getattr(cfg, section), name, _coerce(key, value, _field_type(section, name)))


def apply_dict(cfg: Config, data: dict, *, source: str) -> None:
    for section, values in data.items():
        if section not in SECTIONS:
            raise ConfigError(f"{source}: unknown config section {section!r}{_suggest(section, SECTIONS)}")
        if not isinstance(values, dict):
            raise ConfigError(f"{source}: [{section}] must be a table of keys")
        for name, value in values.items():
            try:
                set_value(cfg, f"{section}.{name}", value)
            except ConfigError as e:
                raise ConfigError(f"{source}: {e}") from None


PATH_KEYS = ("data.path", "data.stream", "data.stream_schema", "dist.plan", "train.run_dir")
"""The config keys whose values are file system paths."""


def load_file(path: str | Path) -> dict:
    """A config file's sections, its relative paths (:data:`PATH_KEYS`) made relative to
    the file's directory (joined to it: a path ``runs/x`` in ``conf/a.toml`` is
    ``conf/runs/x``)."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"{p}: config file does not exist")
    try:
        if p.suffix == ".json":
            data = json.loads(p.read_text())
        else:
            data = tomllib.loads(p.read_text())
    except (tomllib.TOMLDecodeError, json.JSONDecodeError) as e:
        raise ConfigError(f"config file {p}: {e}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"config file {p}: expected sections ({', '.join(f'[{n}]' for n in SECTIONS)})")
    for key in PATH_KEYS:
        section, name = key.split(".")
        values = data.get(section)
        value = values.get(name) if isinstance(values, dict) else None
        if isinstance(value, str) and value and not os.path.isabs(value):
            values[name] = os.path.normpath(os.path.join(os.path.dirname(p), value))
    return data


def parse_overrides(items: list[str]) -> list[tuple[str, str]]:
    out = []
    for item in items:
        if "=" not in item:
            raise ConfigError(f"override {item!r}: expected KEY=VALUE, e.g. optim.dense_lr=0.05")
        k, v = item.split("=", 1)
        out.append((k.strip(), v.strip()))
    return out


def describe() -> str:
    """Every key with its type, default and docstring (for --help)."""
    lines = []
    cfg = Config()
    for section in SECTIONS:
        lines.append(f"[{section}]")
        for name in _section_fields(section):
            doc = _field_doc(section, name)
            default = getattr(getattr(cfg, section), name)
            lines.append(f"  {section}.{name} = {default!r}  ({_type_name(_field_type(section, name))}) {doc}")
    return "\n".join(lines)


def _field_doc(section: str, name: str) -> str:
    import ast
    import inspect

    tree = ast.parse(inspect.getsource(SECTIONS[section]))
    body = tree.body[0].body
    for i, node in enumerate(body):
        if isinstance(node, ast.AnnAssign) and getattr(node.target, "id", None) == name:
            nxt = body[i + 1] if i + 1 < len(body) else None
            if isinstance(nxt, ast.Expr) and isinstance(getattr(nxt, "value", None), ast.Constant):
                return str(nxt.value.value)
    return ""


__all__ = [
    "Config",
    "DataConfig",
    "DistConfig",
    "ModelConfig",
    "OptimConfig",
    "TrainConfig",
    "describe",
    "set_value",
]
