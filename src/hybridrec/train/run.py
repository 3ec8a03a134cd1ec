"""Training's entry point (:func:`train`, ``hybridrec train``) and the run-directory checks
before it. summary.json's entries: :mod:`hybridrec.train.summary`; a trained run loaded
and evaluated (``hybridrec eval``): :mod:`hybridrec.train.evaluate` (its functions are
still importable from here).

A run directory belongs to one run. Before anything is written, :func:`inspect_run_dir`
compares what the directory holds (config.json, the newest checkpoint) with the new
config: a run of an incompatible config is refused (nothing in the directory changes),
a finished run is left alone, anything else is resumed. Every rank of a multi-rank run
reads the same files and decides the same, before any collective. What a directory must be
for a run to take it (new, empty or a hybridrec run; no links), what starting over deletes
and the leftovers of killed saves: :mod:`hybridrec.train.run_files`; SIGTERM:
:mod:`hybridrec.train.terminate`.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from hybridrec import launch_env
from hybridrec.broadcast import rank0_value
from hybridrec.data.loader import steps_per_epoch
from hybridrec.data.schema import DatasetMeta
from hybridrec.errors import ConfigError, HybridrecError, records_errors
from hybridrec.files import write_json_atomic
from hybridrec.parallel.checkpoint import read_manifest
from hybridrec.parallel.checkpoint_io import SafeFileSystemReader
from hybridrec.parallel.checkpoint_layout import table_key
from hybridrec.ps import world as ps_world
from hybridrec.train import run_files, run_lock, terminate
from hybridrec.train.backends import backend_class, stored_backend
from hybridrec.train.build import (
    build_topology,
    build_trainer,
    ranks_backend,
    run_facts,
    start_over,
)
from hybridrec.train.checkpointing import checkpoint as ckpt
from hybridrec.train.checkpointing.faults import elastic_restarts

# (a run's load and evaluation have their own module; still importable from here)
from hybridrec.train.evaluate import evaluate_run, load_run_config, load_run_model  # noqa: F401
from hybridrec.train.loop.parts import Part
from hybridrec.train.ps_run import run_server
from hybridrec.train.setup.config import PATH_KEYS, Config
from hybridrec.train.setup.configure import replace
from hybridrec.train.setup.rules import RunFacts, check_run, group_size, planned_steps
from hybridrec.train.setup.tables import load_dataset
from hybridrec.train.summary import now_iso, run_summary

RUNS_ROOT = "runs"
"""Where the run directories that are not named (``train.run_dir`` empty) go."""


@records_errors  # a rank's error reaches its launcher even if the rank then dies in teardown
def train(cfg: Config, *, extra_summary: dict | None = None, hold_run_dir: bool = True,
          snapshot_dir: str | None = None, extra_parts: Sequence[Part] = ()) -> dict:
    """Train, evaluate on the held-out split, write summary.json; returns the summary.

    ``cfg``'s paths are made absolute (config.json works from any directory); an empty
    ``train.run_dir`` becomes a new ``runs/<YYYYmmdd-HHMMSS>``. A finished run is not
    trained again: the returned dict is its summary with ``already_finished``, the line
    that says so (``train.reevaluate=true``: evaluate it again instead).
    ``hold_run_dir``: this process (global rank 0) locks the run directory while it trains
    (:mod:`~hybridrec.train.run_lock`); false where a launcher holds it for its ranks.
    ``snapshot_dir``: the local launcher's directory on local memory for partial recovery
    (``hybridrec train --snapshot-dir``, :func:`~hybridrec.train.checkpointing.snapshots.fast_snapshots`).
    ``extra_parts``: more parts of the training loop (:class:`~hybridrec.train.loop.parts.Part`),
    after the run's own; their ``summary()`` entries go into summary.json."""
    started_at, clock = now_iso(), time.monotonic()
    shown = cfg.train.run_dir  # the run directory as the user wrote it, for messages
    cfg = absolute_paths(cfg)
    meta = load_dataset(cfg)
    if not cfg.dist.num_ps:
        return _train(cfg, meta, None, shown, started_at, clock, extra_summary, hold_run_dir, snapshot_dir,
                      extra_parts)
    # Parameter-server run: servers serve until the trainers leave; trainers train.
    r = ps_world.roles(cfg.dist.num_ps)
    local = r.num_trainers if r.all_local else 1  # (trainers per machine: the default group)
    # every process alike (servers too), before any group is made
    check_run(cfg, RunFacts(world=r.num_trainers, local_world=local, meta=meta))
    if r.is_server:
        return run_server(cfg, meta, r, snapshot_dir=snapshot_dir)
    topo = ps_world.init_world(r, timeout_s=cfg.dist.timeout_s,
                               backend=ranks_backend(cfg),
                               group_size=group_size(cfg, r.num_trainers, local))
    topo.exchange = cfg.dist.exchange
    ps_world.join_rpc(r, timeout_s=cfg.dist.timeout_s, interface=cfg.dist.rpc_interface)
    ok = False
    try:
        summary = _train(cfg, meta, topo, shown, started_at, clock, extra_summary, hold_run_dir, snapshot_dir,
                         extra_parts)
        ok = True
        return summary
    finally:  # graceful: the servers leave once every trainer has; after an error, leave now
        ps_world.shutdown(graceful=ok)


def _train(cfg: Config, meta, topo, shown: str, started_at: str, clock: float, extra_summary,
           hold_run_dir: bool, snapshot_dir: str | None, extra_parts: Sequence[Part] = ()) -> dict:
    """:func:`train` in this process (``topo``: a parameter-server run's trainers, else
    None: from torchrun's environment)."""
    world, rank = (topo.group_size, topo.rank) if topo is not None else _world_and_rank()
    restarts = elastic_restarts()
    if restarts and not cfg.train.resume:  # (false started this launch over; its restarts resume it)
        cfg = replace(cfg, {"train.resume": True})
    if restarts and rank == 0:  # dist.max_restarts: the agent started the ranks again
        print(f"restarted the ranks after a failure ({restarts} of dist.max_restarts="
              f"{os.environ.get('TORCHELASTIC_MAX_RESTARTS', '?')}); resuming {cfg.train.run_dir or 'the run'}",
              file=sys.stderr, flush=True)
    created = None
    if not cfg.train.run_dir:
        if world > 1:  # launched by torchrun without a run directory: rank 0's choice
            topo = topo or build_topology(cfg)
            shown = rank0_value(str(new_run_dir()) if topo.lead else None,  # (hierarchical: every group's too)
                                topo.run_group, device=topo.comm_device)
        else:
            shown = str(new_run_dir())
        created = os.path.abspath(shown)
        cfg = replace(cfg, {"train.run_dir": created})
        if rank == 0:
            _announce(shown)
    run_dir = Path(cfg.train.run_dir)
    with run_lock.holding(run_dir, shown) if hold_run_dir and rank == 0 else contextlib.nullcontext():
        finished = inspect_run_dir(cfg, meta, world_size=world, shown=shown)
        if finished is not None and not cfg.train.reevaluate:
            return finished
        if rank == 0:  # (the lock is held, by this process or its launcher: a gone process's saves)
            run_files.remove_leftovers(run_dir)
        if not cfg.train.resume and rank == 0:  # (a run refused by its rules deletes nothing)
            check_run(cfg, run_facts(cfg, meta, topo, building=True))
            run_files.check_start_over(run_dir, shown)  # (what no run wrote: refused, nothing deleted)
            start_over(run_dir, snapshot_dir)  # (before any rank builds: nothing of it is mixed in)
        # SIGTERM: this process's unfinished saves go, and the process the user started says so
        with terminate.on_sigterm(run_dir, shown, say=hold_run_dir and rank == 0, resume=cfg.train.resume) as term:
            try:
                trainer = build_trainer(cfg, meta=meta, topo=topo, started_at=started_at, snapshot_dir=snapshot_dir,
                                        extra_parts=extra_parts)
            except HybridrecError:
                if created and rank == 0:  # refused (e.g. memory): leave no empty directory behind
                    run_lock.remove_empty(created)
                raise
            term.trainer = trainer
            return _fit(cfg, meta, trainer, shown, started_at, clock, extra_summary)


def _fit(cfg: Config, meta, trainer, shown: str, started_at: str, clock: float, extra_summary) -> dict:
    """The rest of :func:`_train` once the trainer is built: fit, summarize, write summary.json."""
    run_dir, topo = Path(cfg.train.run_dir), trainer.topo
    if topo.lead:
        write_json_atomic(run_dir / "config.json", cfg.to_dict())
    try:
        result = trainer.fit()
    finally:
        if trainer.logger:
            trainer.logger.close()
    summary = {**run_summary(trainer, result, meta, cfg, shown=shown, started_at=started_at,
                             clock=clock), **(extra_summary or {})}
    if topo.lead:
        try:
            write_json_atomic(run_dir / "summary.json", summary)
        except OSError as e:
            e.summary = summary  # the run's numbers, for the caller to show before the error
            raise
    return summary


def absolute_paths(cfg: Config) -> Config:
    """``cfg`` with ``data.path``, ``dist.plan`` and ``train.run_dir`` (where set) as absolute
    paths, so that config.json and summary.json mean the same from any working directory."""
    return replace(cfg, {k: os.path.abspath(v) for k in PATH_KEYS if (v := _value(cfg, k))})


def _value(cfg: Config, key: str):
    section, name = key.split(".")
    return getattr(getattr(cfg, section), name)


def new_run_dir(root: str | Path = RUNS_ROOT) -> Path:
    """A new, empty ``ROOT/<YYYYmmdd-HHMMSS>`` (``-2``, ``-3``, ... when that exists: the
    directory is created here, so two runs never get the same one)."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    for i in range(1, 10_000):
        path = root / (stamp if i == 1 else f"{stamp}-{i}")
        try:
            path.mkdir()
            return path
        except FileExistsError:
            continue
    raise ConfigError(f"{root}: no free run directory named {stamp}-N; name one with train.run_dir")


def preflight(cfg: Config, *, world_size: int) -> tuple[dict | None, str, Config]:
    """What :func:`train` checks before anything is written, for a launcher about to start
    ``world_size`` local ranks (``hybridrec train dist.nproc=N``): refuse a run directory
    of another run or a plan that does not fit this machine's memory (ConfigError).
    Returns ``(finished, run_dir, cfg)``: a finished run's summary with ``already_finished``
    (else None), the run directory as the ranks should be given it, and the config with
    absolute paths, an empty ``train.run_dir`` become a new directory."""
    shown = cfg.train.run_dir
    cfg = absolute_paths(cfg)
    meta = load_dataset(cfg)
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    device = "cuda" if gpus and cfg.dist.backend != "gloo" else "cpu"  # (as the ranks will choose)
    check_run(cfg, RunFacts(world=world_size, local_world=world_size, device=device, gpus=gpus, meta=meta))
    if cfg.train.run_dir:
        finished = inspect_run_dir(cfg, meta, world_size=world_size, shown=shown)
        if finished is not None and not cfg.train.reevaluate:
            return finished, shown, cfg
        if not cfg.train.resume:  # (refused here in one line, before any rank starts)
            run_files.check_start_over(cfg.train.run_dir, shown)
    m = group_size(cfg, world_size, world_size)  # (hierarchical: every group holds every table)
    problem = backend_class(cfg, m).launch_memory_problem(cfg, meta, world_size=world_size, group=m)
    if problem:
        raise ConfigError(problem)
    if not cfg.train.run_dir:
        shown = str(new_run_dir())
        cfg = replace(cfg, {"train.run_dir": os.path.abspath(shown)})
        _announce(shown)
    return None, shown, cfg


def _announce(shown: str) -> None:
    print(f"run directory {shown} (train.run_dir={shown} resumes it)", file=sys.stderr, flush=True)


def _world_and_rank() -> tuple[int, int]:
    """This process's world size and rank from torchrun's environment (1, 0 without)."""
    world = launch_env.world_size()
    return world, launch_env.rank() if world > 1 else 0


# -- is the run directory this run's? ----------------------------------------------------
COMPARED_KEYS = ("model.arch", "model.embedding_dim", "model.bottom_mlp", "model.top_mlp",
                 "model.interaction", "model.pooling", "optim.dense", "optim.sparse",
                 "train.seed", "data.shuffle", "data.shuffle_window", "data.stream", "model.tables",
                 "model.evict")
"""Config keys a run cannot change and still resume its checkpoints (with the tables,
the global batch and the training rows, compared separately): the model's shapes, the
optimizers' state, the order of the rows."""

CROSS_KEYS = ("model.dcn_layers", "model.dcn_rank")
"""The cross network's shape: compared as :data:`COMPARED_KEYS` where either run has one
(``model.interaction=dcn``; the dot and cat interactions ignore them)."""


def inspect_run_dir(cfg: Config, meta: DatasetMeta, *, world_size: int,
                    shown: str | None = None) -> dict | None:
    """Decide, from the files alone (before anything is written, and the same on every
    rank), what ``cfg.train.run_dir`` holds for this run:

    - a run of an incompatible config: :class:`ConfigError` naming the differences
      (``key: old -> new``) and the two ways out;
    - a finished run (summary.json at the newest checkpoint's step, and that step is at
      least this config's planned steps): its summary, with ``already_finished`` (the
      line that says so);
    - otherwise (nothing, or a run to resume) None.

    ``train.resume=false`` starts over: nothing is compared."""
    run_dir = Path(cfg.train.run_dir)
    shown = shown or str(run_dir)
    if not cfg.train.resume or not run_dir.is_dir():
        return None
    newest = ckpt.latest_sound(run_dir)  # one whose files fail is skipped when resuming too
    try:
        old = load_run_config(run_dir) if (run_dir / "config.json").is_file() else None
        manifest = read_manifest(newest) if newest else None
        diffs = _differences(old, cfg, meta, world_size, run_dir, newest, manifest)
    except HybridrecError as e:
        raise ConfigError(f"{shown} holds a run this one cannot be compared with ({e}): "
                          f"{_WAYS_OUT}") from None
    if diffs:
        raise ConfigError(f"{shown} holds a run of another configuration ({'; '.join(diffs)}): "
                          f"{_WAYS_OUT}")
    summary = _read_json(run_dir / "summary.json")
    per_epoch = steps_per_epoch(meta.split_rows("train"), cfg.data.batch_size, world_size)
    planned = planned_steps(cfg, per_epoch)
    if summary is None or manifest is None or summary.get("step") != manifest.get("step"):
        return None
    es = summary.get("early_stop") or {}
    # Stopped early, and the patience asked for now would have stopped it too (a larger
    # one resumes it: its evaluations since the best are in the checkpoint).
    stopped = 0 < cfg.train.early_stop <= int(es.get("evaluations_since_best") or 0)
    if summary["step"] < planned and not stopped:
        return None
    auc = (summary.get("eval") or {}).get("auc")
    auc_text = f", AUC {auc:.4f}" if isinstance(auc, (int, float)) else ""
    if stopped and isinstance(es.get("best_auc"), (int, float)):
        auc_text = f", stopped early; best AUC {es['best_auc']:.4f} at step {es['best_step']:,}"
    return {**summary, "already_finished": (
        f"{shown} is finished (step {summary['step']:,} of {planned:,}{auc_text}); nothing to do: "
        f"train.reevaluate=true evaluates it again, `hybridrec eval {shown}` evaluates its "
        f"checkpoint, train.run_dir=DIR starts another run")}


_WAYS_OUT = ("train another run in a new directory (train.run_dir=DIR), or replace this one "
             "(train.resume=false deletes its checkpoints, metrics and summary)")


def _differences(old: Config | None, new: Config, meta: DatasetMeta, world_size: int,
                 run_dir: Path, newest: Path | None, manifest: dict | None) -> list[str]:
    """``key: old -> new`` for everything the old run and this one must share."""
    diffs: list[str] = []
    if old is not None:
        cross = "dcn" in (old.model.interaction, new.model.interaction)
        for key in (*COMPARED_KEYS, *(CROSS_KEYS if cross else ())):
            section, name = key.split(".")
            a, b = getattr(getattr(old, section), name), getattr(getattr(new, section), name)
            if a != b:
                diffs.append(f"{key}: {_show(a)} -> {_show(b)}")
    loader = ((manifest or {}).get("extra") or {}).get("loader") or {}
    new_global = new.data.batch_size * world_size
    if loader.get("global_batch_size") is not None:  # what the checkpoint was trained with
        old_global, old_world = int(loader["global_batch_size"]), int(manifest.get("world_size", 1))
    elif old is not None:
        old_world = _old_world_size(run_dir)
        old_global = old.data.batch_size * old_world
    else:
        old_global = None
    if old_global is not None and old_global != new_global:
        diffs.append(f"global batch (data.batch_size x ranks): {old_global} "
                     f"({old_global // max(1, old_world)} x {old_world}) -> {new_global} "
                     f"({new.data.batch_size} x {world_size})")
    rows = meta.split_rows("train")
    if loader.get("num_rows") is not None and int(loader["num_rows"]) != rows:
        diffs.append(f"training rows (data.path): {int(loader['num_rows']):,} -> {rows:,}")
    if old is None and manifest is not None:  # no config.json: what the checkpoint says
        head = manifest.get("sparse_opt") or {}
        if head.get("name") not in (None, new.optim.sparse):
            diffs.append(f"optim.sparse: {head['name']} -> {new.optim.sparse}")
        for key, saved in (("train.seed", loader.get("seed")), ("data.shuffle", loader.get("shuffle")),
                           ("data.shuffle_window", loader.get("shuffle_window"))):
            section, name = key.split(".")
            if saved is not None and saved != getattr(getattr(new, section), name):
                diffs.append(f"{key}: {_show(saved)} -> {_show(getattr(getattr(new, section), name))}")
    diffs += _table_differences(_old_tables(old, newest), meta.num_embeddings)
    return diffs


def _show(value) -> str:
    return ",".join(map(str, value)) if isinstance(value, list) else str(value)


def _old_world_size(run_dir: Path) -> int:
    """The world size of the run that wrote config.json, where no checkpoint says it:
    summary.json's, else plan.json's (written by multi-rank runs only), else 1."""
    summary = _read_json(run_dir / "summary.json") or {}
    if isinstance(summary.get("world_size"), int):
        return summary["world_size"]
    plan = _read_json(run_dir / "plan.json") or {}
    groups = plan.get("groups") if isinstance(plan.get("groups"), int) else 1  # hierarchical: one group's plan
    return plan["world_size"] * groups if isinstance(plan.get("world_size"), int) else 1


def _old_tables(old: Config | None, newest: Path | None) -> dict[str, int] | None:
    """Rows of every table of the old run: the newest checkpoint's tensors, else its
    dataset's schema (None when neither can be read)."""
    if newest is not None:
        newest = stored_backend(newest).tables_dir(newest)  # (parameter servers: their part holds them)
        stored = SafeFileSystemReader(newest).read_metadata().state_dict_metadata
        prefix, _, suffix = table_key("{}").partition("{}")
        return {k[len(prefix):-len(suffix)]: int(m.size[0]) for k, m in stored.items()
                if k.startswith(prefix) and k.endswith(suffix) and hasattr(m, "size")}
    if old is not None and old.data.path:
        try:
            return DatasetMeta.load(old.data.path).num_embeddings
        except HybridrecError:
            return None
    return None


def _table_differences(old: dict[str, int] | None, new: dict[str, int]) -> list[str]:
    if old is None:
        return []
    if old.keys() != new.keys():
        gone, added = sorted(old.keys() - new.keys()), sorted(new.keys() - old.keys())
        parts = ([f"without {', '.join(gone[:3])}{'...' if len(gone) > 3 else ''}"] if gone else []) + \
                ([f"with {', '.join(added[:3])}{'...' if len(added) > 3 else ''}"] if added else [])
        return [f"tables: {len(old)} -> {len(new)} ({'; '.join(parts)})"]
    changed = [f"table {t} rows: {old[t]:,} -> {new[t]:,}" for t in new if old[t] != new[t]]
    return changed[:3] + ([f"{len(changed) - 3} more tables' rows"] if len(changed) > 3 else [])


def _read_json(path: Path) -> dict | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None
