"""Placement of the dense modules: the plan's dense part applied to a single-device model.

Every dense module is ``replicated`` (every rank a copy, gradients averaged by the dense
sync) unless the plan's dense part (:class:`~hybridrec.parallel.plan.DensePlan`)
*partitions* it: the module's widest ``nn.Linear`` (most output columns; the first of
equals) is split by output columns over the ranks of the group, each rank holding its
block of the weight rows and bias. The ranks stay data-parallel (each has its own batch),
so the layer exchanges activations, synchronously, on rank ``r`` of ``G`` (``B_s`` rows on
rank ``s``, ``N = sum_s B_s``, ``c_s`` columns on rank ``s``)::

    sizes = all_gather(B_r)                  # G ints: the exchanges' split sizes
    X     = every rank's input rows          # [B_r, in] -> [N, in], rows in rank order
    Y_r   = act(X @ W_r.T + b_r)             # [N, c_r]: this rank's columns, every row
    y     = rank s's c_s columns of my rows  # [B_r, out], columns in plan order

Both moves are one all-to-all over ``topo.group`` (``Topology.all_to_all``, by
``dist.exchange``); backward runs them in reverse (:class:`_Exchange`). The input gradient of ``x_r`` comes back complete (the
sum over every column block), so the layers before and the embeddings need nothing new.
``W_r``'s gradient sums over all ``N`` rows, i.e. over every rank's loss, while DDP
*averages* the replicated gradients over the ``G`` ranks: the slice's gradient is scaled
by ``1 / G`` (:func:`~hybridrec.parallel.grad_scale.scale_grad`), so placed training equals replicated DDP training
(and one process on the concatenated batch when the ranks' batches are equal). The
dense sync leaves the slices alone (:func:`partitioned_parameter_names`).

Simplifications: one layer per module (its widest), MLP modules only
(:class:`~hybridrec.model.mlp.MLP`, whose forward reads the weights itself), every rank
of the group holds at least one column; uneven batch sizes are supported.

A checkpoint holds the whole layer (:meth:`ColumnParallelLinear.spans`: each rank writes its
rows, :mod:`hybridrec.parallel.checkpoint`). ``dist.partition_dense=auto`` lets the planner
choose by bytes (:func:`choose_dense`).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from hybridrec.comm.ledger import CommLedger, ring_allreduce_bytes
from hybridrec.model.kernels import linear
from hybridrec.model.mlp import MLP
from hybridrec.parallel.grad_scale import scale_grad
from hybridrec.parallel.plan import DensePlan, partitioned
from hybridrec.parallel.topology import Topology

CATEGORY = "dense_activations"
"""Ledger category of the exchanges (table = the module's name)."""

MODULE_ALIASES = {"bottom_mlp": "bottom", "top_mlp": "top"}
"""``dist.partition_dense`` names (config's) -> the model's attribute names."""

SIZE_BYTES = 8
"""One int64 batch size, sent to every other rank of the group per forward."""

AUTO = "auto"
"""``dist.partition_dense=auto`` (``hybridrec plan --partition-dense auto``): the planner
decides each module (:func:`choose_dense`)."""


@dataclass(frozen=True)
class LinearSpec:
    """One ``nn.Linear`` of a module: its path inside it and its shape."""

    path: str
    in_features: int
    out_features: int


def mlp_linears(sizes: Sequence[int]) -> list[LinearSpec]:
    """The layers of ``MLP(sizes)`` without building it, e.g. ``[13, 8, 4]`` ->
    ``layers.0`` 13->8, ``layers.1`` 8->4."""
    return [LinearSpec(f"layers.{i}", a, b) for i, (a, b) in enumerate(itertools.pairwise(sizes))]


def model_linears(model: nn.Module) -> dict[str, list[LinearSpec] | None]:
    """Every child of ``model`` -> its ``nn.Linear`` layers (None: ``sparse``, the
    embeddings, which the plan's tables place)."""
    out: dict[str, list[LinearSpec] | None] = {}
    for name, m in model.named_children():
        out[name] = None if name == "sparse" else [
            LinearSpec(p, x.in_features, x.out_features) for p, x in m.named_modules()
            if isinstance(x, nn.Linear)]
    return out


def _widest(asked: str, modules: Mapping[str, list[LinearSpec] | None], group_size: int,
            option: str) -> LinearSpec:
    name = MODULE_ALIASES.get(asked, asked)
    where = f"{option} {asked!r}"
    if name not in modules:
        known = ", ".join(n for n, v in modules.items() if v is not None)
        raise ValueError(f"{where}: the model has no module {name!r} (dense modules: {known})")
    layers = modules[name]
    if layers is None:
        raise ValueError(f"{where}: the embeddings are placed by the plan's tables, not partitioned")
    if not layers:
        raise ValueError(f"{where}: module {name!r} has no nn.Linear layer to partition")
    best = max(layers, key=lambda x: x.out_features)  # (max keeps the first of equals)
    if best.out_features < group_size:
        raise ValueError(f"{where}: its widest layer {name}.{best.path} has {best.out_features} output "
                         f"columns, fewer than the {group_size} ranks of the group")
    return best


def plan_dense(modules: Mapping[str, list[LinearSpec] | None], names: Sequence[str],
               group_size: int, *, option: str = "dist.partition_dense") -> dict[str, DensePlan]:
    """The dense part that partitions each module of ``names`` (``top_mlp`` or ``top``...)
    over ranks ``0..group_size-1``: its widest layer, columns split evenly. Pure; raises
    ValueError naming ``option`` and the module when it cannot be done."""
    if AUTO in names:
        raise ValueError(f"{option}: '{AUTO}' lets the planner decide every module; give it alone "
                         f"(got {', '.join(names)})")
    out = {}
    for asked in names:
        spec = _widest(asked, modules, group_size, option)
        name = MODULE_ALIASES.get(asked, asked)
        out[name] = partitioned(name, spec.path, spec.in_features, spec.out_features,
                                list(range(group_size)))
    return out


def check_dense(dense: Mapping[str, DensePlan], modules: Mapping[str, list[LinearSpec] | None],
                group_size: int) -> None:
    """Raise ValueError unless ``dense`` (e.g. read from a plan file) fits the model whose
    layers are ``modules`` on a group of ``group_size`` ranks."""
    for name, dp in dense.items():
        where = f"plan of dense module {name!r}"
        if problem := dp.problem(group_size):
            raise ValueError(f"{where}: {problem}")
        if dp.placement != "partitioned":
            continue
        spec = next((s for s in modules.get(name) or [] if s.path == dp.layer), None)
        if modules.get(name) is None or spec is None:
            raise ValueError(f"{where}: the model has no nn.Linear {name}.{dp.layer}")
        if (spec.in_features, spec.out_features) != (dp.in_features, dp.out_features):
            raise ValueError(f"{where}: the plan splits a {dp.in_features}->{dp.out_features} layer, "
                             f"the model's {name}.{dp.layer} is {spec.in_features}->{spec.out_features}")
        if len(dp.shards) != group_size:
            raise ValueError(f"{where}: columns on {len(dp.shards)} rank(s), the group has {group_size}: "
                             "every rank of the group must hold some")


def resolve_dense(requested: Sequence[str], from_plan: Mapping[str, DensePlan], model: nn.Module,
                  group_size: int, *, batch: int = 0) -> dict[str, DensePlan]:
    """The run's dense part: ``requested`` (``dist.partition_dense``) planned on ``model``
    (``["auto"]``: the planner's choice at ``batch`` rows per rank,
    :func:`choose_dense`), or else the plan file's, checked
    against ``model``. Both given must agree."""
    modules = model_linears(model)
    if not requested:
        dense = dict(from_plan)
    elif list(requested) == [AUTO]:
        if batch < 1:
            raise ValueError(f"dist.partition_dense=auto: needs the batch size per rank, got {batch}")
        dense = choose_dense({n: v for n, v in modules.items() if type(getattr(model, n)) is MLP},
                             group_size, batch)
    else:
        dense = plan_dense(modules, requested, group_size)
    if requested and from_plan and from_plan != dense:
        raise ValueError(f"dist.partition_dense={','.join(requested)} and the plan file's dense part "
                         f"({', '.join(from_plan)}) differ: give one of them")
    check_dense(dense, modules, group_size)
    return dense


def input_grad(dp: DensePlan) -> bool:
    """Whether the split layer's input needs a gradient: not the bottom MLP's first layer,
    whose input is the raw dense features (so its gathered rows never travel back)."""
    return not (dp.module == "bottom" and dp.layer == "layers.0")


def activation_bytes(dp: DensePlan, batch: int, rank: int, elem_bytes: int = 4) -> dict[str, tuple[int, int]]:
    """``{"fwd": (sent, received), "bwd": ...}`` bytes of rank ``rank``'s exchanges for
    partitioned ``dp`` per step at ``batch`` rows on every rank (what the ledger counts)."""
    g = len(dp.shards)
    mine = next(s.num_cols for s in dp.shards if s.rank == rank)
    rows = (g - 1) * batch * dp.in_features * elem_bytes  # the gathered inputs
    to_others = (g - 1) * batch * mine * elem_bytes  # my columns of the others' rows
    from_others = batch * (dp.out_features - mine) * elem_bytes  # their columns of my rows
    sizes = (g - 1) * SIZE_BYTES
    back = rows if input_grad(dp) else 0
    return {"fwd": (rows + to_others + sizes, rows + from_others + sizes),
            "bwd": (back + from_others, back + to_others)}


# -- the mechanism ----------------------------------------------------------------------
@dataclass
class _Route:
    """Where a partitioned layer's exchanges go: the group (``topo``: its all-to-all, by
    ``dist.exchange``), the ledger, the module's name."""

    topo: Topology
    ledger: CommLedger | None
    name: str

    @property
    def rank(self) -> int:
        return self.topo.rank

    @property
    def size(self) -> int:
        return self.topo.group_size

    def batch_sizes(self, rows: int, device: torch.device) -> list[int]:
        mine = torch.tensor([rows], dtype=torch.int64, device=device)
        every = [torch.empty_like(mine) for _ in range(self.size)]
        dist.all_gather(every, mine, group=self.topo.group)
        self._count(SIZE_BYTES * (self.size - 1), SIZE_BYTES * (self.size - 1), "fwd")
        # .tolist() waits for the collective: the exchanges' split sizes are host ints.
        return torch.cat(every).tolist()

    def move(self, x: torch.Tensor, out_splits: list[int], in_splits: list[int],
             direction: str) -> torch.Tensor:
        """``all_to_all_single`` of ``x`` split along dim 0 (synchronous); counts the bytes
        that leave and reach this rank (its own split stays here)."""
        out = x.new_empty((sum(out_splits), *x.shape[1:]))
        self.topo.all_to_all(out, x.contiguous(), out_splits, in_splits)
        row, me = math.prod(x.shape[1:]) * x.element_size(), self.rank
        sent, received = sum(in_splits) - in_splits[me], sum(out_splits) - out_splits[me]
        self._count(sent * row, received * row, direction)
        return out

    def _count(self, sent: int, received: int, direction: str) -> None:
        if self.ledger is not None:
            self.ledger.record(CATEGORY, sent=sent, received=received, table=self.name, direction=direction)


class _Exchange(torch.autograd.Function):
    """``route.move`` as an autograd op: backward moves the gradient back, splits swapped."""

    @staticmethod
    def forward(ctx, x, route: _Route, out_splits: list[int], in_splits: list[int]):
        ctx.route, ctx.splits = route, (out_splits, in_splits)
        return route.move(x, out_splits, in_splits, "fwd")

    @staticmethod
    def backward(ctx, grad):
        out_splits, in_splits = ctx.splits
        return ctx.route.move(grad, in_splits, out_splits, "bwd"), None, None, None


class ColumnParallelLinear(nn.Module):
    """This rank's output columns ``cols`` of a ``Linear(in_features, total_out)`` split
    over the group (``widths[s]``: rank ``s``'s columns; ``order``: the ranks in column
    order). Input ``[B_r, in]``, output ``[B_r, total_out]`` (module docstring).

    ``out_features`` is this rank's column count: what the kernel tuner times."""

    def __init__(self, weight: nn.Parameter, bias: nn.Parameter, *, cols: tuple[int, int],
                 widths: list[int], order: list[int], route: _Route) -> None:
        super().__init__()
        self.weight, self.bias = weight, bias
        self.cols, self.widths, self.order, self.route = cols, widths, order, route
        self.in_features, self.out_features = weight.shape[1], weight.shape[0]
        self.total_out = sum(widths)

    def forward(self, x: torch.Tensor, *, relu: bool = False, impl: str = "torch") -> torch.Tensor:
        sizes = self.route.batch_sizes(x.shape[0], x.device)
        g, me = len(sizes), self.route.rank
        # Every rank's rows, in rank order: x goes to each rank (itself included).
        rows = _Exchange.apply(x.repeat(g, 1), self.route, sizes, [x.shape[0]] * g)  # [N, in]
        # Each slice sees all G ranks' rows: its gradient sums G per-rank losses, DDP averages them.
        w, b = scale_grad(self.weight, 1.0 / g), scale_grad(self.bias, 1.0 / g)
        y = linear(rows, w, b, relu=relu, impl=impl)  # [N, c_me]: row blocks of rank s contiguous
        mine = [sizes[me] * c for c in self.widths]  # flat: the blocks differ in width
        back = _Exchange.apply(y.reshape(-1), self.route, mine, [n * self.widths[me] for n in sizes])
        pieces = back.split(mine)
        return torch.cat([pieces[s].view(sizes[me], self.widths[s]) for s in self.order], dim=1)

    def spans(self) -> dict[int, tuple[int, int]]:
        """Every rank's (group-relative) columns ``[c0, c1)`` of the whole layer: where each
        block's rows sit in the global weight (what a checkpoint saves, one tensor)."""
        out, start = {}, 0
        for s in self.order:
            out[s] = (start, start + self.widths[s])
            start += self.widths[s]
        return out

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, cols={self.cols} of {self.total_out}"


class PartitionedMLP(MLP):
    """An :class:`MLP` whose layer ``index`` is a :class:`ColumnParallelLinear`; the same
    parameter names (the slice's are the rank's block), ``impls`` and ``final_relu``."""

    def __init__(self, layers: nn.ModuleList, *, final_relu: bool, impls: list[str], index: int) -> None:
        nn.Module.__init__(self)  # (MLP's __init__ builds and initialises layers: these exist)
        self.layers, self.final_relu, self.impls, self.index = layers, final_relu, impls, index

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        last = len(self.layers) - 1
        for i, layer in enumerate(self.layers):
            relu = i < last or self.final_relu
            if i == self.index:
                x = layer(x, relu=relu, impl=self.impls[i])
            else:
                x = linear(x, layer.weight, layer.bias, relu=relu, impl=self.impls[i])
        return x


def partition_linear(layer: nn.Linear, dp: DensePlan, topo: Topology, *,
                     ledger: CommLedger | None = None) -> ColumnParallelLinear:
    """This rank's (``topo.rank``, group-relative) block of ``layer`` by ``dp``, copied."""
    widths = [0] * topo.group_size
    for s in dp.shards:
        widths[s.rank] = s.num_cols
    c0, c1 = next(s.cols for s in dp.shards if s.rank == topo.rank)
    weight = nn.Parameter(layer.weight.detach()[c0:c1].clone())
    bias = nn.Parameter(layer.bias.detach()[c0:c1].clone())
    order = [s.rank for s in sorted(dp.shards, key=lambda s: s.cols)]
    route = _Route(topo, ledger, dp.module)
    return ColumnParallelLinear(weight, bias, cols=(c0, c1), widths=widths, order=order, route=route)


def place_dense(model: nn.Module, dense: Mapping[str, DensePlan], topo: Topology, *,
                ledger: CommLedger | None = None) -> nn.Module:
    """Apply the plan's dense part to the single-device ``model`` (before the dense sync
    wraps it): each partitioned MLP becomes a :class:`PartitionedMLP` holding this rank's
    columns; replicated modules stay. Checks ``dense`` first (ValueError, before any
    collective). One rank: nothing to split."""
    check_dense(dense, model_linears(model), topo.group_size)
    for name, dp in dense.items():
        if dp.placement != "partitioned" or topo.group_size == 1:
            continue
        mlp = getattr(model, name)
        if type(mlp) is not MLP:
            raise ValueError(f"plan of dense module {name!r}: only MLP modules can be partitioned "
                             f"(this one is a {type(mlp).__name__})")
        index = next(i for i in range(len(mlp.layers)) if f"layers.{i}" == dp.layer)
        layers = nn.ModuleList(partition_linear(x, dp, topo, ledger=ledger) if i == index else x
                               for i, x in enumerate(mlp.layers))
        setattr(model, name, PartitionedMLP(layers, final_relu=mlp.final_relu, impls=list(mlp.impls),
                                            index=index))
    return model


def partitioned_parameter_names(module: nn.Module) -> set[str]:
    """Names (inside ``module``) of the parameters that are column blocks: their gradients
    are complete on each rank, so the dense sync must not average them."""
    return {f"{n}.{p}" if n else p for n, m in module.named_modules() if isinstance(m, ColumnParallelLinear)
            for p, _ in m.named_parameters(recurse=False)}


# -- the dense part ------------------------------------------------------------------------
def dense_cost(dp: DensePlan, batch: int, elem_bytes: int = 4) -> dict:
    """What partitioning ``dp`` costs and saves, per rank per step at ``batch`` rows on
    every rank (bytes sent + received): ``activation_bytes`` of the most loaded rank's
    exchanges and ``allreduce_bytes_saved``, the layer's gradient leaving the ring all-reduce."""
    g = len(dp.shards)
    act = max(sum(s + r for s, r in activation_bytes(dp, batch, rank, elem_bytes).values()) for rank in range(g))
    params = (dp.in_features + 1) * dp.out_features * elem_bytes  # weight and bias
    return {"layer": dp.layer, "batch": batch, "activation_bytes": act,
            "allreduce_bytes_saved": 2 * ring_allreduce_bytes(params, g)}


def choose_dense(modules: Mapping, group_size: int, batch: int) -> dict[str, DensePlan]:
    """The dense part for ``modules`` (name -> its ``LinearSpec`` layers; the MLPs the
    mechanism can split) on groups of ``group_size`` ranks at ``batch`` rows per rank:
    each module partitioned when it pays (:mod:`hybridrec.parallel.planner`'s docstring), else replicated; each entry's
    ``cost`` says the numbers and ``pays``. Pure, deterministic."""
    out = {}
    for name, layers in modules.items():
        if not layers:
            continue
        widest = max(x.out_features for x in layers)
        if group_size < 2 or widest < group_size:
            why = "one rank" if group_size < 2 else f"{widest} columns, fewer than the {group_size} ranks"
            out[name] = DensePlan(module=name, cost={"pays": False, "why": why})
            continue
        dp = plan_dense(modules, [name], group_size)[name]
        cost = dense_cost(dp, batch)
        cost["pays"] = cost["activation_bytes"] < cost["allreduce_bytes_saved"]
        out[name] = dp if cost["pays"] else DensePlan(module=name)
        out[name].cost = cost
    return out
