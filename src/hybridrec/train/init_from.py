"""Warm start: ``train.init_from=RUN`` starts a new run from another run's weights.

Recommendation models are retrained every day on the newest logs: day 23's run starts from
day 22's model instead of from random values. What is taken from the source:

- the weights (tables and dense arches) of one checkpoint: ``train.init_from=RUN`` takes the
  run's best checkpoint when it recorded one (``train.early_stop``), else its newest, the
  same one ``hybridrec eval RUN`` and ``hybridrec predict RUN`` use (a newest one that fails
  its checks is skipped with a warning for the next older one);
  ``train.init_from=RUN/checkpoints/step-00000100`` takes that one;
- with ``train.init_optimizer=true`` also the optimizers' state: the dense optimizer's
  (Adam's moments, Adagrad's sums, by parameter name) and the sparse optimizers' per-row
  state (row-wise Adagrad's ``sum``, lazy Adam's moments) and step counts. Their
  hyper-parameters (learning rates, betas) are this run's config's, not the source's. The
  source must have trained with the same ``optim.dense`` and ``optim.sparse``.

What is not taken: the step, the data position, the LR schedule's progress, early
stopping's best, the random generators, per-rank state (compressor residuals) and a
synchronizer's state: the new run starts at step 0 with its own schedule (its warmup
included: ``optim.warmup_steps=0`` skips it) and counts its own steps.

Any world size and plan to any other: the load goes through the checkpoint's resharding
(:func:`hybridrec.parallel.checkpoint.load_state`), as a resume on another world size does.

Only when there is nothing to resume: :func:`apply` is called while the trainer is built,
and does nothing when the run directory holds a checkpoint (``Trainer.maybe_resume`` then
restores the run's own), so a run started with ``train.init_from`` and stopped resumes from
its own checkpoint, not from the source again.

Shapes: the model built from this run's config and dataset must have the source's tables
(names, rows, dims) and dense arches; the first difference is refused in one line naming
the table or parameter and both shapes, before a tensor is read. One exception: a table
that a dataset made with ``preprocess --like --grow`` grew by exactly the rows its
``meta.json`` records (``preprocessing.grown_rows``), which keeps the source's rows at its
first ids and draws the new rows (their optimizer state starts from scratch). That load
reads each source table whole on every rank that holds a piece of it (memory: the source's
largest tables, once, while loading) instead of resharding it piece by piece.

Not supported (refused in one line): a parameter-server run as the new run (its tables
live on the servers) or as the source (its tables are in the servers' own part).
"""

from __future__ import annotations

import json
import sys
import warnings
from collections.abc import Sequence
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException as DCPException

from hybridrec.errors import ConfigError
from hybridrec.parallel.checkpoint import load_state, read_manifest
from hybridrec.parallel.checkpoint_io import (
    CheckpointError,
    SafeFileSystemReader,
    agree,
    decode_skeleton,
    describe,
    dist_kwargs,
    is_complete,
    quiet,
    raise_failures,
    tensor_slots,
)
from hybridrec.parallel.checkpoint_layout import (
    dense_tensors,
    load_dense_opt,
    local_weights,
    locate,
    table_key,
)
from hybridrec.parallel.topology import Topology
from hybridrec.train.checkpointing import checkpoint as ckpt
from hybridrec.train.loop.early_stop import resolve_checkpoint
from hybridrec.train.setup.config import Config

PS_PART = ckpt.PS_PART
RECORD = "init_from.json"
"""Written into the new run's directory: which checkpoint it started from."""


def source_checkpoint(value: str) -> tuple[Path, str]:
    """The checkpoint ``train.init_from=value`` names and how it was chosen (``best``,
    ``latest``, ``given``)."""
    path = Path(value)
    if is_complete(path):
        return path, "given"
    if (path / "config.json").is_file() or ckpt.checkpoint_dir(path).is_dir():
        found, which = resolve_checkpoint(path, None)
        if found is None:
            raise ConfigError(f"train.init_from={value}: the run has no checkpoint to start from")
        return found, which
    raise ConfigError(f"train.init_from={value}: neither a run directory (config.json, checkpoints/) "
                      "nor a checkpoint directory (RUN/checkpoints/step-N)")


def _source_config(path: Path) -> dict | None:
    """The source run's config.json (``RUN/checkpoints/step-N`` -> ``RUN``), if there is one."""
    file = path.parent.parent / "config.json"
    try:
        data = json.loads(file.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _optimizer_problem(cfg: Config, path: Path) -> str | None:
    """Why the source's optimizer state cannot be this run's (None: it can)."""
    old = _source_config(path) or {}
    for key in ("dense", "sparse"):
        theirs = (old.get("optim") or {}).get(key)
        mine = getattr(cfg.optim, key)
        if theirs is not None and theirs != mine:
            return (f"train.init_optimizer: {path} was trained with optim.{key}={theirs}, this run has "
                    f"optim.{key}={mine}; use the same optimizer, or train.init_optimizer=false")
    return None


# -- shapes ------------------------------------------------------------------------------
def model_shapes(model: nn.Module) -> dict[str, tuple[int, ...]]:
    """Every checkpoint key of the model (``model.*``) and its global shape."""
    shapes = {k: tuple(v.shape) for k, v in dense_tensors(model).items()}
    shapes.update({table_key(t): (tc.num_embeddings, tc.embedding_dim) for t, tc in model.sparse.tables.items()})
    return shapes


def stored_shapes(path: Path) -> dict[str, tuple[int, ...]]:
    md = SafeFileSystemReader(path).read_metadata().state_dict_metadata
    return {k: tuple(m.size) for k, m in md.items() if k.startswith("model.") and hasattr(m, "size")}


def _name(key: str) -> str:
    prefix, _, suffix = table_key("{}").partition("{}")
    if key.startswith(prefix) and key.endswith(suffix):
        return f"table {key[len(prefix):-len(suffix)]}"
    return f"parameter {key[len('model.'):]}"


def _dims(shape: Sequence[int]) -> str:
    return "x".join(map(str, shape)) or "scalar"


def compare(here: dict, there: dict, grown: dict[str, int], source: Path) -> dict[str, int]:
    """``{table key: source rows}`` of the tables that grew by their recorded rows; raises
    :class:`ConfigError` at the first other difference, naming it and both shapes."""
    grew, differ = {}, []
    for key in sorted(here.keys() | there.keys()):
        a, b = there.get(key), here.get(key)
        if a == b:
            continue
        name = _name(key)
        table = name.partition(" ")[2] if name.startswith("table ") else None
        if a is not None and b is not None and table in grown and b[0] - a[0] == grown[table] > 0 \
                and a[1:] == b[1:]:
            grew[key] = a[0]
            continue
        differ.append(f"{name}: {'absent' if a is None else _dims(a)} there, "
                      f"{'absent' if b is None else _dims(b)} here")
    if differ:
        more = f" (and {len(differ) - 1} more differences)" if len(differ) > 1 else ""
        raise ConfigError(f"train.init_from: {source} holds another model than this run's: {differ[0]}{more}")
    return grew


# -- the hook ----------------------------------------------------------------------------
def apply(cfg: Config, meta, *, model: nn.Module, dense_opt: torch.optim.Optimizer, sparse_opt,
          topo: Topology, run_dir: Path, resuming: bool) -> dict | None:
    """Collective: load ``train.init_from``'s weights (and with ``train.init_optimizer`` the
    optimizers' state) into the just built model and optimizers, unless the run has a
    checkpoint of its own to resume (``resuming``) or no ``train.init_from``. Returns what
    was loaded (also written to ``RUN/init_from.json`` by the lead), or None."""
    if not cfg.train.init_from or resuming:
        return None
    path, which = source_checkpoint(cfg.train.init_from)
    if (path / PS_PART).is_dir():
        raise ConfigError(f"train.init_from: {path} is a parameter-server run's checkpoint (its tables are "
                          "in the servers' part): not supported as a source")
    with_opt = cfg.train.init_optimizer
    if with_opt and (problem := _optimizer_problem(cfg, path)):
        raise ConfigError(problem)
    grown = (meta.preprocessing.get("grown_rows") or {}) if meta is not None else {}
    here = model_shapes(model)
    try:
        grew = compare(here, stored_shapes(path), grown, path)
    except CheckpointError as e:
        raise CheckpointError(f"train.init_from: {e}") from None
    sparse_opts = list(sparse_opt.optimizers.values()) if with_opt else []
    kept = _hyperparameters(dense_opt, sparse_opts)

    def load(p: Path) -> dict:
        if grew:
            return _load_grown(p, model, dense_opt if with_opt else None, sparse_opts, topo, grew)
        return load_state(p, model=model, dense_opt=dense_opt if with_opt else None,
                          sparse_opts=sparse_opts or None, topo=topo).extra

    candidates = [path]
    if which == "latest":  # (the newest failing its checks: the next older one, as `hybridrec eval`)
        candidates += [p for _, p in reversed(ckpt.list_checkpoints(path.parent.parent)) if p != path]
    path, extra, skipped = ckpt.load_newest(candidates, load, topo)  # (files checked first, every rank alike)
    for bad, why in skipped if topo.lead else ():
        warnings.warn(f"train.init_from: skipped the checkpoint {bad} ({why}); using {path.name}", stacklevel=2)
    _restore(kept, dense_opt, sparse_opts)
    record = {"source": cfg.train.init_from, "checkpoint": str(path.resolve()), "which": which,
              "source_step": extra.get("step"), "optimizer": with_opt,
              "grown_rows": {_name(k).partition(" ")[2]: here[k][0] - rows for k, rows in grew.items()}}
    if topo.lead:
        (run_dir / RECORD).write_text(json.dumps(record, indent=2) + "\n")
        opt = " and optimizer state" if with_opt else ""
        grown_text = f"; {sum(record['grown_rows'].values()):,} new rows drawn" if grew else ""
        print(f"starting from the weights{opt} of {path} (its step {extra.get('step')}, {which}){grown_text}; "
              "this run counts its steps from 0", file=sys.stderr, flush=True)
    return record


def _hyperparameters(dense_opt, sparse_opts) -> tuple[list[dict], list[float]]:
    """This run's optimizer hyper-parameters, to put back after the source's state is loaded."""
    groups = [{k: v for k, v in g.items() if k != "params"} for g in dense_opt.param_groups]
    return groups, [o.lr for o in sparse_opts]


def _restore(kept, dense_opt, sparse_opts) -> None:
    groups, lrs = kept
    for g, mine in zip(dense_opt.param_groups, groups):
        g.update(mine)
    for o, lr in zip(sparse_opts, lrs):
        o.lr = lr


# -- a grown dataset: each source table whole, then its rows ----------------------------
def _load_grown(path: Path, model: nn.Module, dense_opt, sparse_opts, topo: Topology,
                grew: dict[str, int]) -> dict:
    """Collective: :func:`load_state` for a model whose tables ``grew`` have more rows than
    the source's: each table (and row state) this rank holds a piece of is read whole at the
    source's shape, then the rows below the source's count are copied into the pieces."""
    err, meta, targets, copies = None, {}, {}, []
    try:
        meta = read_manifest(path)
        md = SafeFileSystemReader(path).read_metadata().state_dict_metadata
        targets.update(dense_tensors(model))  # (same shapes: compared already)
        ebc = model.sparse
        for name, w in local_weights(ebc).items():
            key = table_key(name.partition("@")[0])
            copies.append((w, _whole(targets, md, key), locate(ebc, name)))
        if dense_opt is not None:
            tensor_slots(meta["dense_opt"], targets)
        for opt in sparse_opts:
            if opt.name != (meta.get("sparse_opt") or {}).get("name"):
                raise CheckpointError(f"sparse optimizer state is for {(meta.get('sparse_opt') or {}).get('name')!r}, "
                                      f"not {opt.name!r}")
            for name, states in opt.state_dict()["tables"].items():  # views of the live state
                where = locate(ebc, name)
                for s, v in states.items():
                    copies.append((v, _whole(targets, md, f"sparse_opt.{where.table.name}.{s}"), where))
        tensor_slots(meta["extra"], targets)
    except Exception as e:  # noqa: BLE001 - every rank learns of it below
        err = e
    agree(topo, err, path, "loading the checkpoint")
    try:  # DCP reports a rank's failure to every rank itself
        with quiet():
            dcp.load(targets, storage_reader=SafeFileSystemReader(path), **dist_kwargs(topo))
    except DCPException as e:
        raise_failures([describe(e)] * topo.group_size, path, "loading the checkpoint", e)
    with torch.no_grad():
        for live, whole, where in copies:
            _copy_rows(live, whole, where)
    if dense_opt is not None:
        load_dense_opt(dense_opt, model, decode_skeleton(meta["dense_opt"], targets))
    for opt in sparse_opts:
        opt.load_state_dict({**meta["sparse_opt"], "tables": {}})
    return decode_skeleton(meta["extra"], targets)


def _whole(targets: dict, md: dict, key: str) -> torch.Tensor:
    if key not in md:
        raise CheckpointError(f"the checkpoint has no {key}")
    if key not in targets:
        targets[key] = torch.empty(tuple(md[key].size), dtype=md[key].properties.dtype)
    return targets[key]


def _copy_rows(live: torch.Tensor, whole: torch.Tensor, where) -> None:
    """The source rows of ``live`` (a rank's piece of a table, or of its row state) from the
    whole source tensor; rows past the source's stay as they were built (drawn, or zero state)."""
    r0 = where.shard.rows[0] if where.shard is not None else 0
    c0, c1 = where.shard.cols if where.shard is not None else (0, where.table.embedding_dim)
    k = max(0, min(live.shape[0], whole.shape[0] - r0))
    if k == 0:
        return
    src = whole[r0:r0 + k]
    if src.dim() == 2:
        src = src[:, c0:c1]
    if live.dim() == 1 and src.dim() == 2:  # row-wise state saved in cell form: one value per row
        src = src.mean(1)
    live[:k].copy_(src)
