"""Sharded checkpoints with torch.distributed.checkpoint (DCP): every rank writes its own shards.

A checkpoint directory::

    PATH/.metadata           DCP's index: which file holds which chunk of which tensor
    PATH/__<r>_0.distcp      the tensors rank r wrote (each replicated tensor once)
    PATH/manifest.json       everything that is not a tensor, written by rank 0 (below)

DCP keys; the same whatever the sharding plan and world size::

    model.sparse.tables.<t>.weight    [rows, dim]  one global tensor per table
    model.<fqn>                       dense arches, without DDP's ``module.``; a
                                      partitioned layer's weight [out, in] and bias [out]
                                      whole, each rank writing its rows (below)
    sparse_opt.<t>.<state>            row-wise Adagrad ``sum`` [rows] (see below);
                                      lazy Adam ``exp_avg``/``exp_avg_sq`` [rows, dim]
    dense_opt.state.<fqn>.<state>     torch.optim state, by parameter name (of a
                                      partitioned layer's: whole, as its parameter)
    extra.<path>                      tensors of the global state (rank 0's), e.g. the loader's
    rank<r>.<path>                    tensors of rank r's own state (e.g. its RNG, a
                                      compressor's residuals): written by rank r only

The ``model.`` keys are the single-process DLRM's own state-dict keys
(``sparse.tables.<t>.weight`` is what :class:`EmbeddingBagCollection` shows), so
a plain model loads a sharded checkpoint key for key, and a checkpoint saved by
one process loads into N ranks.

Representation. A table is ONE global tensor keyed by its name, made of the
rank-local shards at their global offsets: a ``ShardedTensor`` built with
``_init_from_local_shards_and_global_metadata`` from the plan (every rank knows
every shard, so no collective is needed to build it; rank ``r``'s shards are
``ShardMetadata(shard_offsets=[r0, c0], shard_sizes=[rows, cols],
placement="rank:r/cpu")``). DCP writes each rank's chunks and, on load, reads
the overlap of the saved chunks with the chunks the NEW layout asks for: that is
the resharding. Why ShardedTensor: a plan places arbitrary row/column blocks on
arbitrary ranks (a table-wise table on one rank, ``split_evenly`` row ranges
that are not ``torch.chunk``'s, column blocks on a subset of ranks), which
DTensor's mesh placements cannot express; DTensor over torchrec's
``LocalShardsWrapper`` could, but that wrapper is a private torchrec-oriented
tensor subclass with few ops. ShardedTensor is deprecated but still a
first-class DCP type in torch 2.13; DCP warns about it on load, and that one
warning is silenced here. Replicated (data-parallel) tables and the dense
arches are plain tensors on every rank: DCP's save planner keeps one copy of a
key that several ranks hold. A partitioned dense layer
(:class:`~hybridrec.parallel.placement.ColumnParallelLinear`) is a ShardedTensor of row
blocks like a row-wise table (:func:`~hybridrec.parallel.checkpoint_layout.row_blocks`), and
so is the optimizer state shaped like it: a replicated model loads it, and the reverse.

Row-wise optimizer state of a column-split table. Row-wise Adagrad keeps one
accumulator per row *per shard*; the column shards of one table each have their
own, which a ``[rows]`` tensor cannot hold. For a table that is column-split in
the saving plan, ``sum`` is saved in cell form ``[rows, dim]``: cell ``(r, c)``
holds the accumulator that scaled element ``(r, c)``. Loading reduces a cell
block to one value per row by its mean over columns: exact for the same plan,
and for a whole row it is the width-weighted mean of the column shards'
accumulators, i.e. what one accumulator over the full row would hold. A
``[rows]`` state loaded into a column shard gives every column shard the row's
accumulator.

The manifest (JSON)::

    {"format", "world_size", "plan", "model": {"fingerprint", "tensors"},
     "dense_opt": skeleton, "sparse_opt": header, "extra": skeleton,
     "per_rank": [skeleton of rank 0, rank 1, ...], **manifest_extra}

``model.fingerprint`` is a digest of the saved ``model.*`` keys and their global shapes
(:func:`~hybridrec.parallel.checkpoint_layout.model_fingerprint`): a load checks it against
DCP's index (a manifest and tensors of two different checkpoints are refused), and the
index's shapes against the model being loaded (a checkpoint of another model, e.g.
another embedding dim or MLP, is refused naming the tensors that differ, before any
tensor is read). Checkpoints saved before the fingerprint load as before.

where a skeleton is the JSON of a state dict with its tensors moved out to DCP keys
(:func:`hybridrec.parallel.checkpoint_io.encode_skeleton`). Per-rank state is bound to
the world size it was saved with: :func:`load_state` gives it back only to a world of
the same size (``per_rank`` None otherwise, and the caller says what it resets).

Safety and atomicity: :mod:`hybridrec.parallel.checkpoint_io` (nothing unpickled; a
directory is renamed into place only when every rank's part is on disk).

Memory: :func:`save_sharded` hands DCP the live tables (row blocks of fused weights) as
tensors of their own bytes, so DCP's writer writes them without cloning them; a save
costs next to no memory. :func:`save_sharded_async` instead blocks only while it copies
this rank's state, and writes the copy in a thread (the same files, published the same
way): shorter stops, but a copy of every tensor a rank saves, until it is written.
"""

from __future__ import annotations

import dataclasses
import json
import os
import threading
import time
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed._shard.sharded_tensor import Shard as STShard
from torch.distributed._shard.sharded_tensor import ShardedTensor
from torch.distributed.checkpoint.api import CheckpointException as DCPException

from hybridrec.parallel.checkpoint_io import (
    FORMAT,
    MANIFEST,
    TMP_MARK,
    CheckpointError,
    SafeFileSystemReader,
    agree,
    decode_skeleton,
    describe,
    dist_kwargs,
    encode_skeleton,
    gather,
    is_complete,
    quiet,
    raise_failures,
    root_cause,
    save_begun,
    save_ended,
    tensor_slots,
    write_and_publish,
)
from hybridrec.parallel.checkpoint_layout import (
    GlobalTensor,
    LoadPlan,
    add_block,
    dense_opt_state,
    dense_shapes,
    dense_tensors,
    load_dense_opt,
    load_object,
    local_weights,
    locate,
    model_fingerprint,
    model_targets,
    opt_blocks,
    own_storage,
    row_blocks,
    save_object,
    sparse_targets,
    table_key,
)
from hybridrec.parallel.topology import Topology
from hybridrec.threads import single_threaded

__all__ = [
    "TMP_MARK",
    "CheckpointError",
    "LoadedState",
    "PendingSave",
    "is_complete",
    "load_sharded",
    "load_state",
    "read_manifest",
    "save_sharded",
    "save_sharded_async",
]


# -- save -------------------------------------------------------------------------------
def _sparse_header(sparse_opts: Sequence) -> dict | None:
    """Hyper-parameters and step shared by the sparse optimizers of this rank."""
    heads = [{"name": o.name, "lr": o.lr, "step": o.step_count} for o in sparse_opts]
    if any(h != heads[0] for h in heads[1:]):
        raise CheckpointError(f"sparse optimizers disagree: {heads}")
    return heads[0] if heads else None


def _tensor_state(model, sparse_opts, topo) -> dict:
    """This rank's tables and sparse optimizer state as DCP objects, plus the dense arches."""
    ebc = model.sparse
    if topo.group_size > 1 and not ebc.spans_ranks:
        raise CheckpointError("a checkpoint of several ranks needs a ShardedEmbeddingBagCollection")
    g: dict[str, GlobalTensor] = {}
    for name, w in local_weights(ebc).items():
        add_block(g, table_key(name.partition("@")[0]), locate(ebc, name), w, two_d=True)
    for opt in sparse_opts:
        for name, states in opt.state_dict()["tables"].items():
            where = locate(ebc, name)
            for s, v in states.items():
                if v.dim() == 1 and where.column_split:  # cell form, see the module docstring
                    v = v.unsqueeze(1).expand(-1, where.shard.num_cols).contiguous()
                add_block(g, f"sparse_opt.{where.table.name}.{s}", where, v, two_d=v.dim() == 2)
    state = {k: save_object(x, topo) for k, x in g.items()}
    blocks = row_blocks(model)  # a partitioned layer: each rank writes its rows of one tensor
    for k, v in dense_tensors(model).items():
        b = blocks.get(k.removeprefix("model."))
        state[k] = own_storage(v) if b is None else save_object(b.of(v), topo)
    return state


def _save_state(model, dense_opt, sparse_opts, extra, per_rank, topo) -> tuple[dict, dict, object]:
    """This rank's DCP state dict, the manifest and this rank's per-rank skeleton."""
    state = _tensor_state(model, sparse_opts, topo)
    ebc = model.sparse
    tensors: dict[str, torch.Tensor] = {}
    # every rank alike: every table of the model (a rank holds shards of only some)
    shapes = dense_shapes(model)
    if ebc.holds_tables:  # (a parameter-server run's tables: in ps/)
        shapes.update({table_key(t): (tc.num_embeddings, tc.embedding_dim) for t, tc in ebc.tables.items()})
    meta = {"format": FORMAT, "world_size": topo.group_size,
            "model": {"fingerprint": model_fingerprint(shapes), "tensors": len(shapes)},
            "plan": ebc.plan_dict(),
            "dense_opt": None if dense_opt is None else
            encode_skeleton(dense_opt_state(dense_opt, model), "dense_opt", tensors),
            "sparse_opt": _sparse_header(sparse_opts)}
    blocks = opt_blocks(meta["dense_opt"], row_blocks(model), globalize=True)
    state.update({k: save_object(blocks[k].of(v), topo) if k in blocks else own_storage(v)  # replicas: DCP keeps one
                  for k, v in tensors.items()})
    tensors = {}
    meta["extra"] = encode_skeleton(extra, "extra", tensors)
    if topo.rank == 0:  # extra is global: rank 0's is the one saved
        state.update({k: own_storage(v) for k, v in tensors.items()})
    tensors = {}  # per-rank state: keys of this rank only
    mine = encode_skeleton(per_rank, f"rank{topo.rank}", tensors)
    state.update({k: v.detach().clone() for k, v in tensors.items()})
    return state, meta, mine


def save_sharded(path: str | Path, *, model: nn.Module, dense_opt: torch.optim.Optimizer | None,
                 sparse_opts: Sequence, extra: dict, topo: Topology, per_rank: dict | None = None,
                 manifest: dict | None = None, attach=None) -> Path:
    """Collective: write a checkpoint of a (sharded) DLRM to the directory ``path``.

    Every rank writes its own shards; replicated tensors are written once.
    ``extra`` (step, loader state, as tensors, numbers, strings, None, lists, tuples and
    dicts) is global: rank 0's is saved. ``per_rank`` is each rank's own (e.g. its RNG,
    a compressor's residuals). ``manifest`` entries (JSON) are added to the manifest.
    An existing checkpoint at ``path`` is replaced only once the new one is complete.
    ``attach(tmp)`` (collective) adds to the checkpoint before it is published (the
    parameter servers' part).

    Memory: the tensors are written from the model's and optimizers' own memory, without
    a copy (:func:`~hybridrec.parallel.checkpoint_layout.own_storage`); only the cell
    form of a column-split table's row-wise state is made for the save.
    """
    final, tmp, state, meta = _prepare(Path(path), model, dense_opt, sparse_opts, extra, per_rank, manifest, topo)
    try:
        write_and_publish(final, tmp, state, meta, topo, attach)
    except BaseException:
        _discard(tmp, topo)
        raise
    return final


def _prepare(final: Path, model, dense_opt, sparse_opts, extra, per_rank, manifest,
             topo: Topology) -> tuple[Path, Path, dict, dict]:
    """Phase 1 of a save (collective): this rank's state dict and the manifest; rank 0
    makes the tmp directory. Returns ``(final, tmp, state, manifest)``, or raises the same
    :class:`CheckpointError` on every rank (and leaves no tmp directory)."""
    tmp, err, state, meta, mine = None, None, {}, {}, None
    try:  # local: state dicts; rank 0 makes the tmp dir
        state, meta, mine = _save_state(model, dense_opt, sparse_opts, extra, per_rank or {}, topo)
        if topo.rank == 0:
            tmp = final.with_name(f"{final.name}{TMP_MARK}{os.getpid()}")
            save_begun(tmp, make=True)  # (a SIGTERM removes it: hybridrec.train.terminate)
    except Exception as e:  # noqa: BLE001 - every rank learns of it below
        err = e
    infos = gather(topo, (describe(err), meta.get("sparse_opt"), tmp, mine))
    tmp = infos[0][2]
    if topo.rank != 0 and tmp is not None:  # (DCP writes this rank's files there too)
        save_begun(tmp)
    try:
        raise_failures([m for m, *_ in infos], final, "saving the checkpoint", err)
        heads = [h for _, h, _, _ in infos if h is not None]  # a rank may hold no embeddings
        if any(h != heads[0] for h in heads[1:]):
            raise CheckpointError(f"{final}: saving the checkpoint failed: the ranks' sparse optimizers "
                                  f"disagree: {heads}")
    except BaseException:
        _discard(tmp, topo)
        raise
    meta.update(manifest or {}, sparse_opt=heads[0] if heads else None, per_rank=[x for *_, x in infos])
    return final, tmp, state, meta


def _discard(tmp: Path | None, topo: Topology) -> None:
    save_ended(tmp, discard=topo.rank == 0)


class PendingSave:
    """A checkpoint being written in the background (:func:`save_sharded_async`).

    Its directory appears (renamed into place) only once every rank's part is written;
    until then only ``PATH.tmp-<pid>`` exists, which no reader takes for a checkpoint.
    """

    def __init__(self, final: Path, staged: dict, meta: dict, tmp: Path, topo: Topology,
                 staging_s: float) -> None:
        self.path, self.staging_s = final, staging_s
        self.writing_s: float | None = None  # seconds from the start of the write to its end
        self._error: BaseException | None = None
        # Not a daemon: at exit the interpreter waits for the write (the error, though, only
        # wait() raises).
        self._thread = threading.Thread(target=self._write, args=(staged, meta, tmp, topo),
                                        name=f"checkpoint {final.name}")
        self._thread.start()

    def _write(self, staged: dict, meta: dict, tmp: Path, topo: Topology) -> None:
        single_threaded()  # (beside the training step: hybridrec.threads)
        start = time.perf_counter()
        try:
            write_and_publish(self.path, tmp, staged, meta, topo, background=True)
        except BaseException as e:  # noqa: BLE001 - raised by wait(), in the caller's thread
            self._error = e
            _discard(tmp, topo)
        finally:
            staged.clear()  # the staged copy goes now, not when this object does
            self.writing_s = time.perf_counter() - start

    def done(self) -> bool:
        return not self._thread.is_alive()

    def wait(self) -> Path:
        """Block until the checkpoint is published; returns its path, or raises the save's
        :class:`CheckpointError` (the same on every rank: the ranks agreed on it)."""
        self._thread.join()
        if self._error is not None:
            raise self._error
        return self.path


def _stage(state: dict, tmp: Path, topo: Topology) -> dict:
    """A copy of ``state`` to write while training goes on: CPU tensors cloned, a
    ShardedTensor rebuilt around clones of its local shards (no collective).

    Not DCP's CPU staging (``FileSystemWriter.stage``, what ``dcp.async_save`` runs): it
    ``copy.deepcopy``s every ShardedTensor and then copies the deep copy into the staging
    tensor, i.e. twice the copying; with the row-wise run's tables (1.03 GiB per rank) it
    took 3-4x the time of these clones and 28% more memory than the bytes staged. It is
    used for tensors on another device, which it copies to the CPU.
    """
    def local(v):
        return [sh.tensor for sh in v.local_shards()] if isinstance(v, ShardedTensor) else [v]

    if any(t.device.type != "cpu" for v in state.values() for t in local(v)):
        return dcp.FileSystemWriter(tmp).stage(state)
    out = {}
    for k, v in state.items():
        if isinstance(v, ShardedTensor):
            shards = [STShard(sh.tensor.clone(), sh.metadata) for sh in v.local_shards()]
            out[k] = ShardedTensor._init_from_local_shards_and_global_metadata(
                shards, v.metadata(), process_group=topo.group)
        else:
            out[k] = v.clone()
    return out


_quieted = False


def save_sharded_async(path: str | Path, *, model: nn.Module, dense_opt: torch.optim.Optimizer | None,
                       sparse_opts: Sequence, extra: dict, topo: Topology, group, per_rank: dict | None = None,
                       manifest: dict | None = None) -> PendingSave:
    """Collective: :func:`save_sharded` whose files are written in the background.

    It blocks while this rank's state is staged, i.e. copied (:func:`_stage`; what
    ``dcp.async_save`` does first), then writes the copy in a thread and returns; the model
    and optimizers may change from then on. The copy costs memory: every tensor this rank
    saves, until the write ends. :meth:`PendingSave.wait`
    before the next save and before the process ends (it raises the save's error).
    ``group``: a process group of the ranks of ``topo.group`` for the writing thread's
    collectives, used by nothing else meanwhile (None in a single process).
    """
    global _quieted
    final, tmp, state, meta = _prepare(Path(path), model, dense_opt, sparse_opts, extra, per_rank, manifest, topo)
    err, staged, start = None, {}, time.perf_counter()
    try:
        with quiet():
            staged = _stage(state, tmp, topo)
    except Exception as e:  # noqa: BLE001 - e.g. out of memory on one rank: every rank learns of it
        err = e
    state = {}
    try:
        agree(topo, err, final, "saving the checkpoint")
    except BaseException:
        _discard(tmp, topo)
        raise
    if not _quieted:  # quiet() (catch_warnings) is not thread-safe: the same filters, for good
        warnings.filterwarnings("ignore", message=".*deprecating ShardedTensor")
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        _quieted = True
    return PendingSave(final, staged, meta, tmp, dataclasses.replace(topo, group=group),
                       time.perf_counter() - start)


# -- load -------------------------------------------------------------------------------
def read_manifest(path: str | Path) -> dict:
    """The manifest of a complete checkpoint (JSON; raises CheckpointError otherwise)."""
    path = Path(path)
    if not is_complete(path):
        if not path.is_dir():
            os.listdir(path)  # raises the file system's error: No such file, Not a directory
        what = "an unfinished save" if TMP_MARK in path.name else "no .metadata or manifest.json"
        raise CheckpointError(f"{path}: not a complete checkpoint ({what})")
    try:
        meta = json.loads((path / MANIFEST).read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{path / MANIFEST}: {root_cause(e)}") from None
    if meta.get("format") != FORMAT:
        raise CheckpointError(f"{path}: format {meta.get('format')!r}, expected {FORMAT!r}")
    return meta


def _plan_load(path: Path, model, dense_opt, sparse_opts, topo, parts: str = "all") -> tuple[dict, LoadPlan]:
    meta = read_manifest(path)
    stored = {k: tuple(m.size) for k, m in
              SafeFileSystemReader(path).read_metadata().state_dict_metadata.items() if hasattr(m, "size")}
    saved = (meta.get("model") or {}).get("fingerprint")  # (absent in checkpoints saved before it)
    if saved is not None and saved != model_fingerprint(stored):
        raise CheckpointError(f"{MANIFEST}: its model fingerprint {saved} is not that of the tensors "
                              f"in .metadata ({model_fingerprint(stored)}): parts of two checkpoints")
    plan = LoadPlan({}, [], [])
    model_targets(plan, model, stored, topo, parts)
    if dense_opt is not None:
        if meta["dense_opt"] is None:
            raise CheckpointError(f"{path}: it has no dense optimizer state")
        tensor_slots(meta["dense_opt"], plan.targets)
        for key, b in opt_blocks(meta["dense_opt"], row_blocks(model)).items():  # read as this rank's rows
            plan.local[key] = plan.targets[key].new_empty(b.local)
            plan.targets[key], scatter = load_object(b.of(plan.local[key]), topo)
            plan.scatters += [scatter] if scatter else []
    if sparse_opts:
        head = meta["sparse_opt"]
        if head is None:
            raise CheckpointError(f"{path}: it has no sparse optimizer state")
        for o in sparse_opts:
            if o.name != head["name"]:
                raise CheckpointError(f"sparse optimizer state is for {head['name']!r}, not {o.name!r}")
        sparse_targets(plan, model.sparse, sparse_opts, stored, topo)
    tensor_slots(meta["extra"], plan.targets)
    if _per_rank_fits(meta, topo):
        tensor_slots(meta["per_rank"][topo.rank], plan.targets)
    return meta, plan


def _per_rank_fits(meta: dict, topo: Topology) -> bool:
    return meta["world_size"] == topo.group_size and len(meta.get("per_rank") or []) == topo.group_size


@dataclass
class LoadedState:
    """What :func:`load_state` gives back besides what it loaded in place."""

    extra: dict
    per_rank: dict | None  # None: saved by another world size, not carried over
    manifest: dict = field(repr=False)


def load_state(path: str | Path, *, model: nn.Module, dense_opt: torch.optim.Optimizer | None,
               sparse_opts: Sequence | None, topo: Topology, parts: str = "all") -> LoadedState:
    """Collective: load a checkpoint of :func:`save_sharded` into ``model`` and the
    optimizers (None: skip them); returns the global ``extra``, this rank's ``per_rank``
    state (when the world size is the one saved) and the manifest.

    ``model`` may be sharded by any plan on any world size, or be a single-process
    DLRM (``Topology.single()``): the targets describe the new layout and DCP
    reads the overlapping pieces of what was saved. ``parts``: ``all``, or only the
    ``tables`` or the ``dense`` arches of the model (a parameter-server run keeps them in
    two checkpoints).
    """
    path, err, meta, plan = Path(path), None, {}, LoadPlan({}, [], [])
    try:
        meta, plan = _plan_load(path, model, dense_opt, sparse_opts, topo, parts)
    except Exception as e:  # noqa: BLE001 - every rank learns of it below
        err = e
    agree(topo, err, path, "loading the checkpoint")
    try:  # DCP reports a rank's failure to every rank itself
        with quiet():
            dcp.load(plan.targets, storage_reader=SafeFileSystemReader(path), **dist_kwargs(topo))
    except DCPException as e:
        raise_failures([describe(e)] * topo.group_size, path, "loading the checkpoint", e)
    loaded = None
    try:
        with torch.no_grad():
            for fn in plan.scatters + plan.reductions:
                fn()
        if dense_opt is not None:
            load_dense_opt(dense_opt, model, decode_skeleton(meta["dense_opt"], {**plan.targets, **plan.local}))
        for opt in sparse_opts or []:
            opt.load_state_dict({**meta["sparse_opt"], "tables": {}})
        mine = decode_skeleton(meta["per_rank"][topo.rank], plan.targets) if _per_rank_fits(meta, topo) else None
        loaded = LoadedState(decode_skeleton(meta["extra"], plan.targets), mine, meta)
    except Exception as e:  # noqa: BLE001
        err = e
    agree(topo, err, path, "loading the checkpoint")
    return loaded


def load_sharded(path: str | Path, *, model: nn.Module, dense_opt: torch.optim.Optimizer | None,
                 sparse_opts: Sequence | None, topo: Topology) -> dict:
    """:func:`load_state`, returning only the global ``extra``."""
    return load_state(path, model=model, dense_opt=dense_opt, sparse_opts=sparse_opts, topo=topo).extra
