"""Where the tensors of a (sharded) model and its optimizers live, as DCP sees them.

Every table is ONE global tensor keyed by its name, made of the rank-local shards at their
global offsets (see :mod:`hybridrec.parallel.checkpoint` for the keys and why
ShardedTensor). This module turns a model and its optimizers into those global tensors
(:class:`GlobalTensor`: this rank's pieces and every rank's layout) for saving, and into
the targets ``dcp.load`` fills for loading, including the row-wise optimizer state of
column-split tables (cell form).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.distributed._shard.metadata import ShardMetadata
from torch.distributed._shard.sharded_tensor import Shard as STShard
from torch.distributed._shard.sharded_tensor import ShardedTensor
from torch.distributed._shard.sharded_tensor.metadata import ShardedTensorMetadata
from torch.distributed._shard.sharded_tensor.metadata import TensorProperties as STProperties
from torch.nn.parallel import DistributedDataParallel

from hybridrec.model.embedding import TableConfig
from hybridrec.parallel.checkpoint_io import CheckpointError
from hybridrec.parallel.plan import Shard
from hybridrec.parallel.topology import Topology

# -- global tensors ---------------------------------------------------------------------
Layout = list[tuple[tuple[int, ...], tuple[int, ...], int]]  # (offsets, sizes, rank) per shard


@dataclass
class GlobalTensor:
    """One DCP key: global size, the pieces this rank holds, every rank's pieces."""

    size: tuple[int, ...]
    pieces: list[tuple[tuple[int, ...], torch.Tensor]]
    layout: Layout | None  # None: replicated, every holder has the whole tensor


def _sharded_tensor(g: GlobalTensor, topo: Topology) -> ShardedTensor:
    dev = g.pieces[0][1].device
    where = "cpu" if dev.type == "cpu" else f"{dev.type}:{{}}"

    def place(rank: int) -> str:  # (ShardedTensor names the global rank of a group's member)
        return f"rank:{topo.global_of(rank)}/" + where.format(rank % topo.local_world_size)

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


def own_storage(t: torch.Tensor) -> torch.Tensor:
    """``t`` for DCP's writer without a copy: the same memory, with a storage of exactly its bytes.

    A table is a row block of a fused weight (and its optimizer state of a fused state
    tensor): contiguous, but a view into a larger storage. DCP's file writer clones such a
    tensor before ``torch.save`` (which would otherwise write the whole storage) and keeps
    every clone of a file until the file is written: a whole copy of the rank's tables
    during a save. An alias of the block's own bytes (through numpy: zero-copy, and numpy's
    array keeps ``t``'s storage alive) is written as it is, byte for byte what the clone
    would have written. Other tensors (non-contiguous, not on the CPU, their storage already
    their own) are returned as they are.
    """
    t = t.detach()
    if (t.device.type != "cpu" or not t.is_contiguous() or t.numel() == 0
            or t.untyped_storage().nbytes() == t.nbytes):
        return t
    try:
        raw = t.reshape(-1).view(torch.uint8)  # contiguous: views, whatever the dtype
        return torch.from_numpy(raw.numpy()).view(t.dtype).view(t.shape)
    except (RuntimeError, TypeError):  # (e.g. a conjugate view): DCP's writer copies it
        return t


def save_object(g: GlobalTensor, topo: Topology) -> torch.Tensor:
    """What ``dcp.save`` writes for ``g``: this rank's pieces, not copied (:func:`own_storage`)."""
    if g.layout is None:
        return own_storage(g.pieces[0][1])
    if topo.group_size > 1:
        return _sharded_tensor(GlobalTensor(g.size, [(o, own_storage(t)) for o, t in g.pieces], g.layout), topo)
    if len(g.pieces) == 1 and tuple(g.pieces[0][1].shape) == tuple(g.size):
        return own_storage(g.pieces[0][1])  # the whole tensor in one piece
    full = g.pieces[0][1].new_empty(g.size)  # one process holds every shard: assemble
    for o, t in g.pieces:
        full[_block(o, t)] = t
    return full


def load_object(g: GlobalTensor, topo: Topology) -> tuple[torch.Tensor, Callable | None]:
    """What ``dcp.load`` fills, and what then moves it into the pieces (None: in place)."""
    if g.layout is None:
        return g.pieces[0][1], None
    if topo.group_size > 1:
        return _sharded_tensor(g, topo), None
    full = g.pieces[0][1].new_empty(g.size)

    def scatter():
        for o, t in g.pieces:
            t.copy_(full[_block(o, t)])

    return full, scatter


# -- where the embedding state lives ---------------------------------------------------
@dataclass(frozen=True)
class Where:
    """A local table of a collection: a block of global table ``table``."""

    table: TableConfig
    shard: Shard | None  # None: the whole table (replicated or single process)
    all_shards: list[Shard] | None

    @property
    def column_split(self) -> bool:
        return any(s.cols != (0, self.table.embedding_dim) for s in self.all_shards or [])


def locate(ebc: nn.Module, local_name: str) -> Where:
    table = ebc.tables[local_name.partition("@")[0]]
    found = ebc.shard_of(local_name)
    return Where(table, *found) if found is not None else Where(table, None, None)


def local_weights(ebc: nn.Module) -> dict[str, torch.Tensor]:
    """This process's table weights by local name (none where parameter servers hold them)."""
    return ebc.local_weights()


def add_block(out: dict[str, GlobalTensor], key: str, where: Where, t: torch.Tensor, two_d: bool) -> None:
    """Register this rank's block ``t`` of table-shaped key ``key`` ([rows, dim] or [rows])."""
    tc = where.table
    size = (tc.num_embeddings, tc.embedding_dim) if two_d else (tc.num_embeddings,)
    if where.shard is None:
        out[key] = GlobalTensor(size, [((0,) * len(size), t.detach())], None)
        return

    def at(s: Shard):
        if two_d:
            return (s.rows[0], s.cols[0]), (s.num_rows, s.num_cols), s.rank
        return (s.rows[0],), (s.num_rows,), s.rank

    g = out.setdefault(key, GlobalTensor(size, [], [at(s) for s in where.all_shards]))
    g.pieces.append((at(where.shard)[0], t.detach()))


def table_key(table: str) -> str:
    return f"model.sparse.tables.{table}.weight"


# -- dense part -------------------------------------------------------------------------
def _dense_modules(model: nn.Module) -> dict[str, nn.Module]:
    """Every child but the embeddings, DDP unwrapped: names as in the single-process model."""
    return {n: (m.module if isinstance(m, DistributedDataParallel) else m)
            for n, m in model.named_children() if n != "sparse"}


def dense_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """This rank's dense state by ``model.<fqn>`` (a partitioned layer's: its block)."""
    out = {}
    for name, m in _dense_modules(model).items():
        for k, v in m.state_dict(prefix=f"{name}.").items():
            out[f"model.{k}"] = v  # detached, shares storage: loads in place
    return out


@dataclass(frozen=True)
class RowBlock:
    """A dense parameter that is this rank's block of rows of one global tensor: a
    partitioned layer's weight ``[c_r, in]`` of ``[out, in]`` or bias ``[c_r]`` of ``[out]``
    (:class:`~hybridrec.parallel.placement.ColumnParallelLinear`, group-relative ranks)."""

    size: tuple[int, ...]  # global
    local: tuple[int, ...]  # this rank's block
    start: int  # this rank's first row
    layout: Layout

    def of(self, t: torch.Tensor) -> GlobalTensor:
        """``t`` (this rank's block, or a state tensor of its shape) as its global tensor."""
        rest = (0,) * (len(self.size) - 1)
        return GlobalTensor(self.size, [((self.start, *rest), t.detach())], self.layout)


def row_blocks(model: nn.Module) -> dict[str, RowBlock]:
    """The dense parameters that are row blocks, by name (``top.layers.1.weight``); none
    in a model whose dense modules are all replicated."""
    from hybridrec.parallel.placement import ColumnParallelLinear

    out = {}
    for name, m in _dense_modules(model).items():
        for path, layer in m.named_modules(prefix=name):
            if not isinstance(layer, ColumnParallelLinear):
                continue
            spans, me = layer.spans(), layer.route.rank
            for p, v in layer.named_parameters(prefix=path, recurse=False):
                rest = tuple(v.shape[1:])
                layout = [((c0, *(0,) * len(rest)), (c1 - c0, *rest), r) for r, (c0, c1) in spans.items()]
                out[p] = RowBlock((layer.total_out, *rest), tuple(v.shape), spans[me][0], layout)
    return out


def dense_shapes(model: nn.Module) -> dict[str, tuple[int, ...]]:
    """Global shapes of :func:`dense_tensors` (a row block's: the whole layer's)."""
    blocks = row_blocks(model)
    return {k: blocks[fqn].size if (fqn := k.removeprefix("model.")) in blocks else tuple(v.shape)
            for k, v in dense_tensors(model).items()}


def opt_blocks(skeleton: dict | None, blocks: dict[str, RowBlock], *, globalize: bool = False) -> dict[str, RowBlock]:
    """The dense optimizer's state tensors (DCP key -> block) shaped like a row-block
    parameter (e.g. Adam's ``exp_avg``; not its scalar ``step``), from the skeleton of
    :func:`dense_opt_state`. ``globalize``: their shapes in the skeleton become the global
    ones (a save: the manifest then describes the whole layer, whatever the ranks)."""
    out = {}
    for fqn, states in ((skeleton or {}).get("state") or {}).items():
        b = blocks.get(fqn)
        for s in (states.values() if b is not None and isinstance(states, dict) else ()):
            if isinstance(s, dict) and "__tensor__" in s and tuple(s["shape"]) in (b.local, b.size):
                out[s["__tensor__"]] = b
                if globalize:
                    s["shape"] = list(b.size)
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


def dense_opt_state(opt: torch.optim.Optimizer, model: nn.Module) -> dict:
    """``opt.state_dict()`` with parameter names instead of indices."""
    names, sd = _opt_params(opt, model), opt.state_dict()
    return {"state": {names[i]: s for i, s in sd["state"].items()},
            "param_groups": [{**g, "params": [names[i] for i in g["params"]]} for g in sd["param_groups"]]}


def load_dense_opt(opt: torch.optim.Optimizer, model: nn.Module, named: dict) -> None:
    index = {n: i for i, n in enumerate(_opt_params(opt, model))}
    unknown = sorted({n for g in named["param_groups"] for n in g["params"]} - index.keys())
    if unknown or len(named["param_groups"]) != len(opt.param_groups):
        raise CheckpointError(f"dense optimizer does not match the checkpoint (unknown {unknown[:5]}, "
                              f"{len(named['param_groups'])} groups saved, {len(opt.param_groups)} here)")
    opt.load_state_dict({
        "state": {index[n]: s for n, s in named["state"].items()},
        "param_groups": [{**g, "params": [index[n] for n in g["params"]]} for g in named["param_groups"]]})


@dataclass
class LoadPlan:
    """What ``dcp.load`` fills, then what moves it into the model and optimizers."""

    targets: dict
    scatters: list[Callable]  # world 1: full tensors into the shards
    reductions: list[Callable]  # after the scatters: blocks into per-row state
    local: dict = field(default_factory=dict)  # DCP key -> the tensor a ShardedTensor target fills


def add_targets(plan: LoadPlan, g: dict[str, GlobalTensor], topo: Topology) -> None:
    for key, x in g.items():
        plan.targets[key], fn = load_object(x, topo)
        if fn is not None:
            plan.scatters.append(fn)


def model_targets(plan: LoadPlan, model: nn.Module, stored: dict, topo: Topology, parts: str = "all") -> None:
    """``parts``: ``all``, ``tables`` or ``dense`` (the tables a checkpoint also holds are
    then not read)."""
    ebc, g = model.sparse, {}
    if parts != "dense":
        for name, w in local_weights(ebc).items():
            add_block(g, table_key(name.partition("@")[0]), locate(ebc, name), w, two_d=True)
    dense = dense_tensors(model) if parts != "tables" else {}
    blocks = row_blocks(model) if dense else {}
    for k in [k for k in dense if k.removeprefix("model.") in blocks]:  # a partitioned layer's block: its rows
        g[k] = blocks[k.removeprefix("model.")].of(dense.pop(k))
    saved = {k for k in stored if k.startswith("model.")}
    missing = sorted((dense.keys() | g.keys()) - saved)
    allowed = dense.keys() | g.keys() | {table_key(t) for t in ebc.tables}
    unexpected = sorted(saved - allowed)
    if missing or unexpected:
        raise CheckpointError(f"the model does not match the checkpoint: missing {missing[:5]}, "
                              f"unexpected {unexpected[:5]}")
    here = {**{k: tuple(x.size) for k, x in g.items()}, **{k: tuple(v.shape) for k, v in dense.items()}}
    if differ := [k for k in sorted(here) if tuple(stored[k]) != here[k]]:
        shown = ", ".join(f"{k} {_dims(stored[k])} (this model: {_dims(here[k])})" for k in differ[:3])
        more = f" and {len(differ) - 3} more" if len(differ) > 3 else ""
        raise CheckpointError(f"a checkpoint of another model: {shown}{more}")
    add_targets(plan, g, topo)
    plan.targets.update(dense)


def _dims(shape) -> str:
    return "x".join(map(str, shape)) or "scalar"


def model_fingerprint(shapes: dict[str, tuple[int, ...]]) -> str:
    """A digest of a model's structure: its checkpoint keys (``model.*``) and their global
    shapes (table names, rows and dims, the MLPs' layers), whatever the sharding."""
    text = "\n".join(f"{k}:{_dims(v)}" for k, v in sorted(shapes.items()) if k.startswith("model."))
    return "sha256:" + hashlib.sha256(text.encode()).hexdigest()[:16]


def sparse_targets(plan: LoadPlan, ebc, sparse_opts: Sequence, stored: dict, topo) -> None:
    """Per-row state of the sparse optimizers, whatever form it was saved in."""
    g: dict[str, GlobalTensor] = {}
    for opt in sparse_opts:
        for name, states in opt.state_dict()["tables"].items():  # views of the live state
            where = locate(ebc, name)
            for s, v in states.items():
                key = f"sparse_opt.{where.table.name}.{s}"
                if key not in stored:
                    raise CheckpointError(f"the checkpoint has no {key}")
                if v.dim() == 2 or len(stored[key]) == 1 and not where.column_split:
                    add_block(g, key, where, v, two_d=v.dim() == 2)  # same form: straight in
                elif len(stored[key]) == 1:  # [rows] into a column shard: its rows, whole
                    full = plan.targets.setdefault(key, v.new_empty(stored[key]))
                    r0, r1 = where.shard.rows
                    plan.reductions.append(lambda v=v, x=full[r0:r1]: v.copy_(x))
                else:  # cell form: one value per row
                    cols = where.shard.num_cols if where.shard else where.table.embedding_dim
                    block = v.new_empty(v.shape[0], cols)
                    add_block(g, key, where, block, two_d=True)
                    plan.reductions.append(lambda v=v, b=block: v.copy_(_row_mean(b)))
    add_targets(plan, g, topo)


def _row_mean(block: torch.Tensor) -> torch.Tensor:
    """Mean over columns; exactly the value when a row's cells are all equal."""
    first = block[:, :1]
    return (first + (block - first).mean(1, keepdim=True)).squeeze(1)
