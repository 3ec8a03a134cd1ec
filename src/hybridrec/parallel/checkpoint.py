"""Sharded checkpoints with torch.distributed.checkpoint (DCP): every rank writes its own shards.

A checkpoint directory::

    PATH/.metadata           DCP's index: which file holds which chunk of which tensor
    PATH/__<r>_0.distcp      the tensors rank r wrote (each replicated tensor once)
    PATH/meta.json           everything that is not a tensor, written by rank 0

DCP keys; the same whatever the sharding plan and world size::

    model.sparse.tables.<t>.weight    [rows, dim]  one global tensor per table
    model.<fqn>                       dense arches, without DDP's ``module.``
    sparse_opt.<t>.<state>            row-wise Adagrad ``sum`` [rows] (see below);
                                      lazy Adam ``exp_avg``/``exp_avg_sq`` [rows, dim]
    dense_opt.state.<fqn>.<state>     torch.optim state, by parameter name
    extra.<path>                      the tensors found in ``extra`` (e.g. ``extra.rng``)

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
key that several ranks hold.

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

Nothing is unpickled from the checkpoint: tensors load with
``torch.load(weights_only=True)`` (DCP's reader), non-tensor data comes from
``meta.json`` (DCP would pickle it and load it with ``weights_only=False``),
and DCP's pickled ``.metadata`` is read by an unpickler that only builds DCP's
own metadata classes.

Atomicity: ranks write into ``PATH.tmp-<pid of rank 0>``; after every rank
reported success, rank 0 renames it to ``PATH``. After each phase the ranks
exchange their outcome, so a failure on one rank makes every rank raise instead
of waiting in a collective; a rank that dies is caught by the process-group
timeout. :func:`is_complete` is what readers check.
"""

from __future__ import annotations

import contextlib
import json
import os
import pickle
import shutil
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed._shard.metadata import ShardMetadata
from torch.distributed._shard.sharded_tensor import Shard as STShard
from torch.distributed._shard.sharded_tensor import ShardedTensor
from torch.distributed._shard.sharded_tensor.metadata import ShardedTensorMetadata
from torch.distributed._shard.sharded_tensor.metadata import TensorProperties as STProperties
from torch.distributed.checkpoint.api import CheckpointException as DCPException
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.nn.parallel import DistributedDataParallel

from hybridrec.errors import HybridrecError
from hybridrec.model.embedding import EmbeddingBagCollection, TableConfig
from hybridrec.parallel.plan import Shard
from hybridrec.parallel.sharded_embedding import ShardedEmbeddingBagCollection
from hybridrec.parallel.topology import Topology

FORMAT = "hybridrec-dcp/1"
META = "meta.json"
TMP_MARK = ".tmp-"


class CheckpointError(HybridrecError):
    """A sharded checkpoint could not be saved or loaded; says which rank and why."""


def is_complete(path: str | Path) -> bool:
    """A finished checkpoint: not a tmp dir, DCP's index and ``meta.json`` present."""
    p = Path(path)
    return TMP_MARK not in p.name and (p / ".metadata").is_file() and (p / META).is_file()


# -- ranks agree on every outcome ------------------------------------------------------
def _gather(topo: Topology, obj) -> list:
    """Collective: every rank's ``obj`` (small, picklable: our own live processes, never
    a file), in rank order."""
    if topo.group is None or topo.world_size == 1:
        return [obj]
    out = [None] * topo.world_size
    dist.all_gather_object(out, obj, group=topo.group)
    return out


def _describe(error: BaseException | None) -> str | None:
    if error is None:
        return None
    if isinstance(error, DCPException):  # the ranks' root causes, not DCP's tracebacks
        causes = "; ".join(f"rank {r}: {type(e).__name__}: {e}" for r, (e, _) in error.failures.items())
        return f"DCP failed ({causes})"
    return f"{type(error).__name__}: {error}"


def _raise_failures(messages: list, what: str, error: BaseException | None) -> None:
    by_message: dict[str, list[int]] = {}
    for r, m in enumerate(messages):
        if m is not None:
            by_message.setdefault(m, []).append(r)
    if by_message:
        lines = "; ".join(f"rank {', '.join(map(str, rs))}: {m}" for m, rs in by_message.items())
        raise CheckpointError(f"{what} failed on {lines}") from error


def _agree(topo: Topology, error: BaseException | None, what: str) -> None:
    """Collective: raise on every rank if any rank failed ``what``, so that no rank goes on
    into a collective its peers will never join."""
    _raise_failures(_gather(topo, _describe(error)), what, error)


def _dist_kwargs(topo: Topology) -> dict:
    return {"process_group": topo.group, "no_dist": topo.group is None}


# -- global tensors ---------------------------------------------------------------------
Layout = list[tuple[tuple[int, ...], tuple[int, ...], int]]  # (offsets, sizes, rank) per shard


@dataclass
class _Global:
    """One DCP key: global size, the pieces this rank holds, every rank's pieces."""

    size: tuple[int, ...]
    pieces: list[tuple[tuple[int, ...], torch.Tensor]]
    layout: Layout | None  # None: replicated, every holder has the whole tensor


def _sharded_tensor(g: _Global, topo: Topology) -> ShardedTensor:
    dev = g.pieces[0][1].device
    where = "cpu" if dev.type == "cpu" else f"{dev.type}:{{}}"

    def place(rank: int) -> str:
        return f"rank:{rank}/" + where.format(rank % topo.local_world_size)

    local = [STShard(t, ShardMetadata(shard_offsets=list(o), shard_sizes=list(t.shape),
                                      placement=place(topo.rank))) for o, t in g.pieces]
    md = ShardedTensorMetadata(
        shards_metadata=[ShardMetadata(shard_offsets=list(o), shard_sizes=list(s), placement=place(r))
                         for o, s, r in g.layout],
        size=torch.Size(g.size),
        tensor_properties=STProperties(dtype=g.pieces[0][1].dtype))
    return ShardedTensor._init_from_local_shards_and_global_metadata(local, md, process_group=topo.group)


def _block(offsets: tuple[int, ...], t: torch.Tensor) -> tuple[slice, ...]:
    return tuple(slice(o, o + n) for o, n in zip(offsets, t.shape))


def _save_object(g: _Global, topo: Topology) -> torch.Tensor:
    # Pieces may be views into fused weights: DCP's writer copies such views before
    # torch.save, which would otherwise write the whole storage.
    if g.layout is None:
        return g.pieces[0][1]
    if topo.world_size > 1:
        return _sharded_tensor(g, topo)
    full = g.pieces[0][1].new_empty(g.size)  # one process holds every shard: assemble
    for o, t in g.pieces:
        full[_block(o, t)] = t
    return full


def _load_object(g: _Global, topo: Topology) -> tuple[torch.Tensor, Callable | None]:
    """What ``dcp.load`` fills, and what then moves it into the pieces (None: in place)."""
    if g.layout is None:
        return g.pieces[0][1], None
    if topo.world_size > 1:
        return _sharded_tensor(g, topo), None
    full = g.pieces[0][1].new_empty(g.size)

    def scatter():
        for o, t in g.pieces:
            t.copy_(full[_block(o, t)])

    return full, scatter


# -- where the embedding state lives ---------------------------------------------------
@dataclass(frozen=True)
class _Where:
    """A local table of a collection: a block of global table ``table``."""

    table: TableConfig
    shard: Shard | None  # None: the whole table (replicated or single process)
    all_shards: list[Shard] | None

    @property
    def column_split(self) -> bool:
        return any(s.cols != (0, self.table.embedding_dim) for s in self.all_shards or [])


def _locate(ebc: nn.Module, local_name: str) -> _Where:
    base, _, idx = local_name.partition("@")
    if isinstance(ebc, ShardedEmbeddingBagCollection) and idx not in ("", "*"):
        shards = ebc.plan.tables[base].shards
        return _Where(ebc.tables[base], shards[int(idx)], shards)
    return _Where(ebc.tables[base], None, None)


def _local_weights(ebc: nn.Module) -> dict[str, torch.Tensor]:
    if isinstance(ebc, ShardedEmbeddingBagCollection):
        return {k: w for k, (_, w) in ebc.local_shards().items()}
    if isinstance(ebc, EmbeddingBagCollection):
        return {n: ebc.table_weight(n) for n in ebc.tables}
    raise TypeError(f"model.sparse is a {type(ebc).__name__}, not an embedding-bag collection")


def _add(out: dict[str, _Global], key: str, where: _Where, t: torch.Tensor, two_d: bool) -> None:
    """Register this rank's block ``t`` of table-shaped key ``key`` ([rows, dim] or [rows])."""
    tc = where.table
    size = (tc.num_embeddings, tc.embedding_dim) if two_d else (tc.num_embeddings,)
    if where.shard is None:
        out[key] = _Global(size, [((0,) * len(size), t.detach())], None)
        return

    def at(s: Shard):
        if two_d:
            return (s.rows[0], s.cols[0]), (s.num_rows, s.num_cols), s.rank
        return (s.rows[0],), (s.num_rows,), s.rank

    g = out.setdefault(key, _Global(size, [], [at(s) for s in where.all_shards]))
    g.pieces.append((at(where.shard)[0], t.detach()))


def _table_key(table: str) -> str:
    return f"model.sparse.tables.{table}.weight"


# -- dense part -------------------------------------------------------------------------
def _dense_modules(model: nn.Module) -> dict[str, nn.Module]:
    """Every child but the embeddings, DDP unwrapped: names as in the single-process model."""
    return {n: (m.module if isinstance(m, DistributedDataParallel) else m)
            for n, m in model.named_children() if n != "sparse"}


def _dense_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    out = {}
    for name, m in _dense_modules(model).items():
        for k, v in m.state_dict(prefix=f"{name}.").items():
            out[f"model.{k}"] = v  # detached, shares storage: loads in place
    return out


def _param_names(model: nn.Module) -> dict[int, str]:
    return {id(p): f"{name}.{k}" for name, m in _dense_modules(model).items()
            for k, p in m.named_parameters()}


def _opt_params(opt: torch.optim.Optimizer, model: nn.Module) -> list[str]:
    """Names of the optimizer's parameters in its state-dict index order."""
    names = _param_names(model)
    order = [p for g in opt.param_groups for p in g["params"]]
    missing = [i for i, p in enumerate(order) if id(p) not in names]
    if missing:
        raise CheckpointError(f"dense optimizer parameters {missing} are not dense model parameters")
    return [names[id(p)] for p in order]


def _dense_opt_state(opt: torch.optim.Optimizer, model: nn.Module) -> dict:
    """``opt.state_dict()`` with parameter names instead of indices."""
    names, sd = _opt_params(opt, model), opt.state_dict()
    return {"state": {names[i]: s for i, s in sd["state"].items()},
            "param_groups": [{**g, "params": [names[i] for i in g["params"]]} for g in sd["param_groups"]]}


def _load_dense_opt(opt: torch.optim.Optimizer, model: nn.Module, named: dict) -> None:
    index = {n: i for i, n in enumerate(_opt_params(opt, model))}
    unknown = sorted({n for g in named["param_groups"] for n in g["params"]} - index.keys())
    if unknown or len(named["param_groups"]) != len(opt.param_groups):
        raise CheckpointError(f"dense optimizer does not match the checkpoint (unknown {unknown[:5]}, "
                              f"{len(named['param_groups'])} groups saved, {len(opt.param_groups)} here)")
    opt.load_state_dict({
        "state": {index[n]: s for n, s in named["state"].items()},
        "param_groups": [{**g, "params": [index[n] for n in g["params"]]} for g in named["param_groups"]]})


# -- non-tensor data: JSON, with tensors moved out to DCP keys ----------------------------
_MARKS = ("__tensor__", "__tuple__", "__dict__")


def _encode(obj, key: str, tensors: dict[str, torch.Tensor]) -> object:
    """JSON-able skeleton of ``obj``; each tensor goes to ``tensors[<its path>]``,
    e.g. ``extra.rng`` or ``dense_opt.state.top.layers.0.weight.exp_avg``."""
    if isinstance(obj, torch.Tensor):
        if key in tensors:
            raise CheckpointError(f"two tensors would be stored as {key!r}")
        tensors[key] = obj
        return {"__tensor__": key, "dtype": str(obj.dtype).removeprefix("torch."), "shape": list(obj.shape)}
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    if isinstance(obj, (list, tuple)):
        items = [_encode(v, f"{key}.{i}", tensors) for i, v in enumerate(obj)]
        return items if isinstance(obj, list) else {"__tuple__": items}
    if isinstance(obj, dict):
        if all(isinstance(k, str) for k in obj) and not any(k in _MARKS for k in obj):
            return {k: _encode(v, f"{key}.{k}", tensors) for k, v in obj.items()}
        return {"__dict__": [[_encode(k, f"{key}.{k}#key", tensors), _encode(v, f"{key}.{k}", tensors)]
                             for k, v in obj.items()]}
    raise CheckpointError(f"{key}: cannot store a {type(obj).__name__} "
                          "(use tensors, numbers, strings, None, lists, tuples, dicts)")


def _decode(obj, tensors: dict[str, torch.Tensor]):
    if isinstance(obj, list):
        return [_decode(v, tensors) for v in obj]
    if not isinstance(obj, dict):
        return obj
    if "__tensor__" in obj:
        return tensors[obj["__tensor__"]]
    if "__tuple__" in obj:
        return tuple(_decode(v, tensors) for v in obj["__tuple__"])
    if "__dict__" in obj:
        return {_decode(k, tensors): _decode(v, tensors) for k, v in obj["__dict__"]}
    return {k: _decode(v, tensors) for k, v in obj.items()}


def _tensor_slots(obj, out: dict[str, torch.Tensor]) -> None:
    """Empty tensors for every tensor placeholder in a skeleton (what ``dcp.load`` fills)."""
    if isinstance(obj, list):
        for v in obj:
            _tensor_slots(v, out)
    elif isinstance(obj, dict):
        if "__tensor__" in obj:
            dtype = getattr(torch, obj["dtype"], None)
            if not isinstance(dtype, torch.dtype):
                raise CheckpointError(f"{obj['__tensor__']}: unknown dtype {obj['dtype']!r}")
            out[obj["__tensor__"]] = torch.empty(obj["shape"], dtype=dtype)
        else:
            for v in obj.values():
                _tensor_slots(v, out)


# -- DCP's .metadata without arbitrary unpickling ---------------------------------------------
class _MetadataUnpickler(pickle.Unpickler):
    """Builds only DCP's metadata types, torch.Size, dtypes, layouts and paths."""

    _ALLOWED: ClassVar[set[tuple[str, str]]] = {
        *(("torch.distributed.checkpoint.metadata", n) for n in (
            "Metadata", "MetadataIndex", "StorageMeta", "TensorProperties", "TensorStorageMetadata",
            "ChunkStorageMetadata", "BytesStorageMetadata", "_MEM_FORMAT_ENCODING")),
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
        ("torch", "Size"), ("torch.serialization", "_get_layout"), ("collections", "OrderedDict"),
        ("pathlib", "PosixPath"), ("pathlib", "WindowsPath"), ("pathlib", "PurePosixPath"),
    }

    def find_class(self, module: str, name: str):
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        if (module, name) in self._ALLOWED:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"checkpoint metadata may not reference {module}.{name}")


class SafeFileSystemReader(dcp.FileSystemReader):
    """DCP's file reader with :class:`_MetadataUnpickler` for ``.metadata``."""

    def read_metadata(self, *args, **kwargs) -> Metadata:
        rank = kwargs.get("rank")
        name = ".metadata" if rank is None else f"__{rank}.metadata"
        with open(Path(self.path) / name, "rb") as f:
            metadata = _MetadataUnpickler(f).load()
        if not isinstance(metadata, Metadata):
            raise CheckpointError(f"{self.path}: {name} is not DCP metadata")
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


@contextlib.contextmanager
def _quiet():
    """DCP warns that ShardedTensor is deprecated and that a single process has no process
    group; both are expected here."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*deprecating ShardedTensor")
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


# -- save -------------------------------------------------------------------------------
def _sparse_header(sparse_opts: Sequence) -> dict | None:
    """Hyper-parameters and step shared by the sparse optimizers of this rank."""
    heads = [{"name": o.name, "lr": o.lr, "step": o.step_count} for o in sparse_opts]
    if any(h != heads[0] for h in heads[1:]):
        raise CheckpointError(f"sparse optimizers disagree: {heads}")
    return heads[0] if heads else None


def _save_state(model, dense_opt, sparse_opts, extra, topo) -> tuple[dict, dict]:
    """This rank's DCP state dict and the non-tensor skeleton (``meta.json``)."""
    ebc = model.sparse
    if topo.world_size > 1 and not isinstance(ebc, ShardedEmbeddingBagCollection):
        raise CheckpointError("save_sharded on several ranks needs a ShardedEmbeddingBagCollection")
    g: dict[str, _Global] = {}
    for name, w in _local_weights(ebc).items():
        _add(g, _table_key(name.partition("@")[0]), _locate(ebc, name), w, two_d=True)
    for opt in sparse_opts:
        for name, states in opt.state_dict()["tables"].items():
            where = _locate(ebc, name)
            for s, v in states.items():
                if v.dim() == 1 and where.column_split:  # cell form, see the module docstring
                    v = v.unsqueeze(1).expand(-1, where.shard.num_cols).contiguous()
                _add(g, f"sparse_opt.{where.table.name}.{s}", where, v, two_d=v.dim() == 2)
    state = {k: _save_object(x, topo) for k, x in g.items()}
    state.update(_dense_tensors(model))
    tensors: dict[str, torch.Tensor] = {}
    meta = {"format": FORMAT, "world_size": topo.world_size,
            "plan": ebc.plan.to_dict() if isinstance(ebc, ShardedEmbeddingBagCollection) else None,
            "dense_opt": None if dense_opt is None else
            _encode(_dense_opt_state(dense_opt, model), "dense_opt", tensors),
            "sparse_opt": _sparse_header(sparse_opts)}
    state.update({k: v.detach() for k, v in tensors.items()})  # replicas: DCP keeps one
    tensors = {}
    meta["extra"] = _encode(extra, "extra", tensors)
    if topo.rank == 0:  # extra is global: rank 0's is the one saved
        state.update({k: v.detach() for k, v in tensors.items()})
    return state, meta


def save_sharded(path: str | Path, *, model: nn.Module, dense_opt: torch.optim.Optimizer | None,
                 sparse_opts: Sequence, extra: dict, topo: Topology) -> Path:
    """Collective: write a checkpoint of a (sharded) DLRM to the directory ``path``.

    Every rank writes its own shards; replicated tensors are written once.
    ``extra`` (step, loader state, rng, config, as tensors, numbers, strings,
    None, lists, tuples and dicts) is global: rank 0's is saved. An existing
    checkpoint at ``path`` is replaced only once the new one is complete.
    """
    final, tmp, err, state, meta = Path(path), None, None, {}, {}
    try:  # phase 1, local: state dicts; rank 0 makes the tmp dir
        state, meta = _save_state(model, dense_opt, sparse_opts, extra, topo)
        if topo.rank == 0:
            tmp = final.with_name(f"{final.name}{TMP_MARK}{os.getpid()}")
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
    except Exception as e:  # noqa: BLE001 - every rank learns of it below
        err = e
    infos = _gather(topo, (_describe(err), meta.get("sparse_opt"), tmp))
    try:
        _raise_failures([m for m, _, _ in infos], "save_sharded: preparing", err)
        heads = [h for _, h, _ in infos if h is not None]  # a rank may hold no embeddings
        if any(h != heads[0] for h in heads[1:]):
            raise CheckpointError(f"save_sharded: the ranks' sparse optimizers disagree: {heads}")
        meta["sparse_opt"] = heads[0] if heads else None
        tmp = infos[0][2]
        _write_and_publish(final, tmp, state, meta, topo)
    except BaseException:
        if topo.rank == 0 and tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final


def _write_and_publish(final: Path, tmp: Path, state: dict, meta: dict, topo: Topology) -> None:
    err = None
    try:  # phase 2: every rank writes its chunks (DCP reports a rank's failure to all ranks)
        with _quiet():
            dcp.save(state, storage_writer=dcp.FileSystemWriter(tmp), **_dist_kwargs(topo))
        if topo.rank == 0:
            _write_json(tmp / META, meta)
    except (Exception, DCPException) as e:  # noqa: BLE001 - DCP's is a BaseException
        err = e
    _agree(topo, err, "save_sharded: writing")
    try:  # phase 3: every rank's part is on disk; rank 0 publishes the directory
        if topo.rank == 0:
            if final.exists():
                shutil.rmtree(final)
            os.replace(tmp, final)
            _fsync_dir(final.parent)
    except Exception as e:  # noqa: BLE001
        err = e
    _agree(topo, err, "save_sharded: publishing")


def _write_json(path: Path, obj) -> None:
    with open(path, "w") as f:
        json.dump(obj, f)
        f.flush()
        os.fsync(f.fileno())


def _fsync_dir(d: Path) -> None:
    fd = os.open(d, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# -- load -------------------------------------------------------------------------------
@dataclass
class _LoadPlan:
    """What ``dcp.load`` fills, then what moves it into the model and optimizers."""

    targets: dict
    scatters: list[Callable]  # world 1: full tensors into the shards
    reductions: list[Callable]  # after the scatters: blocks into per-row state


def _add_targets(plan: _LoadPlan, g: dict[str, _Global], topo: Topology) -> None:
    for key, x in g.items():
        plan.targets[key], fn = _load_object(x, topo)
        if fn is not None:
            plan.scatters.append(fn)


def _model_targets(plan: _LoadPlan, model: nn.Module, stored: dict, topo: Topology) -> None:
    ebc, g = model.sparse, {}
    for name, w in _local_weights(ebc).items():
        _add(g, _table_key(name.partition("@")[0]), _locate(ebc, name), w, two_d=True)
    dense = _dense_tensors(model)
    saved = {k for k in stored if k.startswith("model.")}
    missing = sorted((dense.keys() | g.keys()) - saved)
    unexpected = sorted(saved - dense.keys() - {_table_key(t) for t in ebc.tables})
    if missing or unexpected:
        raise CheckpointError(f"the model does not match the checkpoint: missing {missing[:5]}, "
                              f"unexpected {unexpected[:5]}")
    _add_targets(plan, g, topo)
    plan.targets.update(dense)


def _sparse_targets(plan: _LoadPlan, ebc, sparse_opts: Sequence, stored: dict, topo) -> None:
    """Per-row state of the sparse optimizers, whatever form it was saved in."""
    g: dict[str, _Global] = {}
    for opt in sparse_opts:
        for name, states in opt.state_dict()["tables"].items():  # views of the live state
            where = _locate(ebc, name)
            for s, v in states.items():
                key = f"sparse_opt.{where.table.name}.{s}"
                if key not in stored:
                    raise CheckpointError(f"the checkpoint has no {key}")
                if v.dim() == 2 or len(stored[key]) == 1 and not where.column_split:
                    _add(g, key, where, v, two_d=v.dim() == 2)  # same form: straight in
                elif len(stored[key]) == 1:  # [rows] into a column shard: its rows, whole
                    full = plan.targets.setdefault(key, v.new_empty(stored[key]))
                    r0, r1 = where.shard.rows
                    plan.reductions.append(lambda v=v, x=full[r0:r1]: v.copy_(x))
                else:  # cell form: one value per row
                    cols = where.shard.num_cols if where.shard else where.table.embedding_dim
                    block = v.new_empty(v.shape[0], cols)
                    _add(g, key, where, block, two_d=True)
                    plan.reductions.append(lambda v=v, b=block: v.copy_(_row_mean(b)))
    _add_targets(plan, g, topo)


def _row_mean(block: torch.Tensor) -> torch.Tensor:
    """Mean over columns; exactly the value when a row's cells are all equal."""
    first = block[:, :1]
    return (first + (block - first).mean(1, keepdim=True)).squeeze(1)


def _plan_load(path: Path, model, dense_opt, sparse_opts, topo) -> tuple[dict, _LoadPlan]:
    if not is_complete(path):
        raise CheckpointError(f"{path} is not a complete sharded checkpoint")
    meta = json.loads((path / META).read_text())
    if meta.get("format") != FORMAT:
        raise CheckpointError(f"{path}: format {meta.get('format')!r}, expected {FORMAT!r}")
    stored = {k: tuple(m.size) for k, m in
              SafeFileSystemReader(path).read_metadata().state_dict_metadata.items()}
    plan = _LoadPlan({}, [], [])
    _model_targets(plan, model, stored, topo)
    if dense_opt is not None:
        if meta["dense_opt"] is None:
            raise CheckpointError(f"{path} has no dense optimizer state")
        _tensor_slots(meta["dense_opt"], plan.targets)
    if sparse_opts:
        head = meta["sparse_opt"]
        if head is None:
            raise CheckpointError(f"{path} has no sparse optimizer state")
        for o in sparse_opts:
            if o.name != head["name"]:
                raise CheckpointError(f"sparse optimizer state is for {head['name']!r}, not {o.name!r}")
        _sparse_targets(plan, model.sparse, sparse_opts, stored, topo)
    _tensor_slots(meta["extra"], plan.targets)
    return meta, plan


def load_sharded(path: str | Path, *, model: nn.Module, dense_opt: torch.optim.Optimizer | None,
                 sparse_opts: Sequence | None, topo: Topology) -> dict:
    """Collective: load a checkpoint of :func:`save_sharded` into ``model`` and the
    optimizers (None: skip them). Returns the saved ``extra``.

    ``model`` may be sharded by any plan on any world size, or be a single-process
    DLRM (``Topology.single()``): the targets describe the new layout and DCP
    reads the overlapping pieces of what was saved.
    """
    path, err, meta, plan = Path(path), None, {}, _LoadPlan({}, [], [])
    try:
        meta, plan = _plan_load(path, model, dense_opt, sparse_opts, topo)
    except Exception as e:  # noqa: BLE001 - every rank learns of it below
        err = e
    _agree(topo, err, "load_sharded: planning")
    try:  # DCP reports a rank's failure to every rank itself
        with _quiet():
            dcp.load(plan.targets, storage_reader=SafeFileSystemReader(path), **_dist_kwargs(topo))
    except DCPException as e:
        raise CheckpointError(f"load_sharded: reading {path} failed: {_describe(e)}") from e
    extra = None
    try:
        with torch.no_grad():
            for fn in plan.scatters + plan.reductions:
                fn()
        if dense_opt is not None:
            _load_dense_opt(dense_opt, model, _decode(meta["dense_opt"], plan.targets))
        for opt in sparse_opts or []:
            opt.load_state_dict({**meta["sparse_opt"], "tables": {}})
        extra = _decode(meta["extra"], plan.targets)
    except Exception as e:  # noqa: BLE001
        err = e
    _agree(topo, err, "load_sharded: applying")
    return extra
