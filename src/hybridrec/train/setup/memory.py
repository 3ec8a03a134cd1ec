"""Memory, before anything is allocated: each rank's embedding shards with their sparse
optimizer state and the dense model, against ``train.memory_limit_gb`` or the memory the
machine (or its cgroup) has available now. A run that cannot fit is refused with one line
that says what to change."""

from __future__ import annotations

import itertools
import os
from pathlib import Path

import torch

from hybridrec import launch_env
from hybridrec.data.schema import DatasetMeta
from hybridrec.errors import ConfigError
from hybridrec.model.embedding import WEIGHT_DTYPES
from hybridrec.model.interaction import interaction_parameters, interaction_width
from hybridrec.parallel.checkpoint_io import gather
from hybridrec.parallel.cost_model import memory_by_rank
from hybridrec.parallel.topology import Topology
from hybridrec.sync.algorithms import SYNCHRONIZERS
from hybridrec.train.setup.config import Config
from hybridrec.train.setup.tables import build_plan, build_tables, uniform_plan

_DENSE_OPT_STATES = {"sgd": 0, "adagrad": 1, "adam": 2}


def dense_model_bytes(cfg: Config, meta: DatasetMeta, world_size: int = 1) -> int:
    """The dense arches' weights, gradients and dense optimizer state (float32), plus
    DDP's gradient buckets with several ranks."""
    m = cfg.model
    top_in = interaction_width(m.interaction, len(meta.schema.features), m.embedding_dim)
    params = interaction_parameters(m.interaction, len(meta.schema.features), m.embedding_dim,
                                    dcn_layers=m.dcn_layers, dcn_rank=m.dcn_rank)
    for widths in ([len(meta.schema.dense), *m.bottom_mlp], [top_in, *m.top_mlp]):
        params += sum(a * b + b for a, b in itertools.pairwise(widths))
    copies = 2 + _DENSE_OPT_STATES.get(cfg.optim.dense, 2)
    copies += cfg.optim.dense == "sgd" and cfg.optim.momentum > 0  # the momentum buffer
    copies += world_size > 1 and cfg.dist.dense_sync == "ddp"
    return params * 4 * copies


def memory_per_rank(cfg: Config, meta: DatasetMeta, world_size: int,
                    local_world_size: int) -> tuple[list[int], int]:
    """``([embedding bytes of each rank], dense bytes of every rank)``: the planner's
    estimate of each rank's shards with their sparse optimizer state
    (:func:`~hybridrec.parallel.cost_model.memory_by_rank`), one process holding every
    table whole; activations, batches and buffers not counted."""
    tables = build_tables(meta, cfg)
    if world_size == 1:
        plan = uniform_plan("table_wise", tables, 1, 1)
    else:
        shape = Topology(0, world_size, 0, local_world_size, torch.device("cpu"), "none", None, None)
        plan = build_plan(cfg, tables, shape, meta)
    weight = WEIGHT_DTYPES[cfg.model.embedding_dtype].itemsize
    return memory_by_rank(plan, cfg.optim.sparse, weight), dense_model_bytes(cfg, meta, world_size)


def memory_problem(cfg: Config, meta: DatasetMeta, *, world_size: int = 1, local_world_size: int = 1,
                   host: int = 0, groups: int = 1, hierarchical: bool = False) -> str | None:
    """Why the run cannot fit in the memory of machine ``host`` (its ranks
    ``host * local_world_size ...``), or None when it fits: the sum of its ranks'
    estimates against ``train.memory_limit_gb`` or else the memory available now.
    ``hierarchical``: ``world_size`` is a group's (``groups`` of them on this machine, each
    holding every table) and each rank's replica is held again by the synchronizer
    (:func:`sync_copies` times)."""
    sparse, dense = memory_per_rank(cfg, meta, world_size, local_world_size)
    ranks = range(host * local_world_size, min(world_size, (host + 1) * local_world_size))
    extra = 1 + (sync_copies(cfg) if hierarchical else 0)
    need = groups * sum((sparse[r] + dense) * extra for r in ranks)
    limit, source = memory_limit(cfg)
    if limit is None or need <= limit:
        return None
    if world_size == 1:
        what = (f"this run needs {size_text(need)} (embedding tables with their {cfg.optim.sparse} state "
                f"{size_text(sparse[0])}, dense model {size_text(dense)})")
    else:
        big = max(ranks, key=lambda r: sparse[r])
        what = (f"the {len(ranks)} ranks on this machine need {size_text(need)} (the largest, rank {big}: "
                f"embedding shards with their {cfg.optim.sparse} state {size_text(sparse[big])}, "
                f"dense model {size_text(dense)})")
    return (f"not enough memory: {what}, {source} is {size_text(limit)}; train on more ranks "
            f"(dist.nproc=N, or torchrun over more machines), split the tables' rows over them "
            f"(dist.sharding=row_wise), or make the tables smaller "
            f"(hybridrec data preprocess --table-size N)")


def sync_copies(cfg: Config) -> int:
    """How many more copies of a rank's replica (its shards and the dense part) a
    synchronizer across groups holds, an estimate: the snapshot, the target and the
    round's result; EASGD's centre; BMUF's global model and block momentum;
    ``sync.compress``'s anchor and residual."""
    s = cfg.sync
    held = SYNCHRONIZERS[s.algorithm].state_copies if s.algorithm in SYNCHRONIZERS else 0
    return 3 + held + (2 if s.compress != "none" else 0)


def check_memory(cfg: Config, meta: DatasetMeta, topo: Topology) -> None:
    """Refuse a plan that cannot fit before anything is allocated. Collective with several
    ranks: every rank raises the same error when any machine is short."""
    machine = launch_env.local_world_size(topo.local_world_size)
    problem = memory_problem(cfg, meta, world_size=topo.group_size,
                             local_world_size=topo.local_world_size,
                             host=topo.rank // topo.local_world_size,
                             groups=max(1, machine // topo.group_size) if topo.hierarchical else 1,
                             hierarchical=topo.hierarchical)
    problems = sorted({p for p in gather(topo, problem) if p}) if topo.group_size > 1 else [problem]
    if any(problems):
        raise ConfigError("; ".join(p for p in problems if p))


def memory_limit(cfg: Config) -> tuple[int | None, str]:
    """``(bytes, what they are)``: ``train.memory_limit_gb``, else the memory this machine
    (or the container's cgroup limit) has available now; None when unknown."""
    if cfg.train.memory_limit_gb > 0:
        return int(cfg.train.memory_limit_gb * 1e9), f"train.memory_limit_gb={cfg.train.memory_limit_gb:g}"
    avail, source = available_memory()
    return avail, f"{source} (train.memory_limit_gb=0: the machine's)"


def available_memory() -> tuple[int | None, str]:
    """Bytes of memory available now, and where the number comes from: MemAvailable of
    /proc/meminfo (else sysconf), lowered to what a cgroup (v2) memory limit leaves."""
    avail, source = None, "the memory available"
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                avail, source = int(line.split()[1]) * 1024, "the memory available (MemAvailable)"
                break
    except (OSError, ValueError, IndexError):
        pass
    if avail is None:
        try:
            avail = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (OSError, ValueError, AttributeError):
            return None, source
    left = _cgroup_memory_left()
    if left is not None and left < avail:
        return left, "the memory this cgroup may still use (memory.max)"
    return avail, source


def _cgroup_memory_left() -> int | None:
    try:
        rel = next((line[3:] for line in Path("/proc/self/cgroup").read_text().splitlines()
                    if line.startswith("0::")), None)
        for d in ([Path("/sys/fs/cgroup") / rel.lstrip("/")] if rel else []) + [Path("/sys/fs/cgroup")]:
            limit = d / "memory.max"
            if limit.is_file():
                text = limit.read_text().strip()
                if text == "max":
                    return None
                return max(0, int(text) - int((d / "memory.current").read_text()))
    except (OSError, ValueError):
        pass
    return None


def size_text(n: float) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:,.1f} {unit}"
    return f"{n:,.0f} bytes"
