"""Building a parameter-server run from a :class:`~hybridrec.train.setup.config.Config`: the
servers' placement of the tables, a server's whole life, and the trainers' checkpoint
attachment (:class:`ServerCheckpoints`). The trainers' side of the run is the servers' sparse
backend, :class:`hybridrec.train.backends.ServerBackend`."""

from __future__ import annotations

import sys
from pathlib import Path

import torch.distributed
from torch.distributed import rpc

from hybridrec.data.schema import DatasetMeta
from hybridrec.errors import ConfigError
from hybridrec.model.embedding import TableConfig
from hybridrec.parallel.checkpoint_io import agree, gather
from hybridrec.parallel.cost_model import memory_by_rank
from hybridrec.parallel.plan import ShardingPlan
from hybridrec.parallel.topology import Topology
from hybridrec.ps import server as srv
from hybridrec.ps.client import ServerError, wait_reply
from hybridrec.ps.world import Roles, init_world, join_rpc, server_name, shutdown
from hybridrec.train.checkpointing import checkpoint as ckpt
from hybridrec.train.checkpointing.faults import FailureInjector
from hybridrec.train.checkpointing.lost_work import server_shard_loss
from hybridrec.train.checkpointing.server_recovery import ServerRecovery
from hybridrec.train.checkpointing.snapshots import clear_snapshots
from hybridrec.train.loop.sparse_optim import combined_sparse_optimizer
from hybridrec.train.setup.config import Config
from hybridrec.train.setup.memory import memory_limit, size_text
from hybridrec.train.setup.tables import build_tables, uniform_plan

PS_DIR = ckpt.PS_PART
"""The servers' part of a checkpoint: ``step-N/ps/``, a sharded checkpoint of its own."""


def ps_plan(cfg: Config, tables: list[TableConfig], num_ps: int) -> ShardingPlan:
    """Where the tables live on ``num_ps`` servers (``dist.ps_sharding``)."""
    return uniform_plan(cfg.dist.ps_sharding, tables, num_ps, num_ps)


def run_server(cfg: Config, meta: DatasetMeta, r: Roles, *, snapshot_dir: str | None = None) -> dict:
    """A server's life: its process group, its shards, then it answers RPCs until every
    trainer has left (graceful RPC shutdown). With checkpoints, the run stopping under it
    (SIGTERM) leaves a recovery snapshot (partial recovery; ``snapshot_dir``: the local
    launcher's directory on local memory) or the step it reached (full)."""
    topo = init_world(r, timeout_s=cfg.dist.timeout_s)
    tables = build_tables(meta, cfg)
    plan = ps_plan(cfg, tables, r.num_ps)
    # Before the shards are allocated; every server raises the same error (trainers then
    # see a server gone and end with one line).
    problems = sorted({p for p in gather(topo, server_memory_problem(cfg, plan, topo)) if p})
    if problems:
        raise ConfigError("; ".join(problems))
    kwargs = {} if cfg.optim.sparse == "sgd" else {"eps": cfg.optim.eps}
    server = srv.EmbeddingServer(tables, plan, topo,
                                 optimizer=lambda ebc: combined_sparse_optimizer(
                                     cfg.optim.sparse, ebc, lr=cfg.optim.sparse_lr, **kwargs),
                                 num_trainers=r.num_trainers,
                                 max_staleness=cfg.dist.ps_max_staleness, timeout_s=cfg.dist.timeout_s,
                                 seed=cfg.train.seed)
    srv.serve(server)  # before joining RPC: no pull can arrive at a server without its shards
    global _RECOVERY
    if cfg.train.save_checkpoints:
        _RECOVERY = ServerRecovery(server, topo.rank, run_dir=cfg.train.run_dir, mode=cfg.train.recovery,
                                   fast_dir=snapshot_dir)
        _RECOVERY.begin()
    injector = FailureInjector(cfg.train.inject_failure, rank=r.name, run_dir=cfg.train.run_dir)
    if injector.armed:  # (train.inject_failure=psJ:STEP: once every trainer's push of STEP is applied)
        def on_step(done: int) -> None:
            for step in injector.steps:
                if step <= done:
                    injector.after_step(step)  # (kills the process)

        server.on_step = on_step
    join_rpc(r, timeout_s=cfg.dist.timeout_s, interface=cfg.dist.rpc_interface)
    rows = sum(w.shape[0] for _, w in server.model.sparse.local_shards().values())
    print(f"parameter server {r.name}: {rows:,} rows of {len(tables)} tables", file=sys.stderr, flush=True)
    shutdown()
    if _RECOVERY is not None:
        _RECOVERY.end()
    return {"server": r.name, "pushes": server.version}


_RECOVERY: ServerRecovery | None = None


def rpc_recover(resumed_at: int, checkpoint_step: int | None, use_snapshot: bool) -> dict:
    """A trainer asks this server to recover (:meth:`ServerRecovery.recover`)."""
    if _RECOVERY is None:
        raise RuntimeError("this parameter server keeps no recovery state (train.save_checkpoints=false)")
    return _RECOVERY.recover(resumed_at, checkpoint_step, use_snapshot)


def server_memory_problem(cfg: Config, plan: ShardingPlan, topo: Topology) -> str | None:
    """Why the parameter servers on this server's machine cannot hold their shards with
    their sparse optimizer state (the planner's estimate against ``train.memory_limit_gb``
    or else the memory available now), or None when they fit."""
    need_by = memory_by_rank(plan, cfg.optim.sparse)
    host = topo.rank // topo.local_world_size
    ranks = range(host * topo.local_world_size, min(topo.group_size, (host + 1) * topo.local_world_size))
    need = sum(need_by[r] for r in ranks)
    limit, source = memory_limit(cfg)
    if limit is None or need <= limit:
        return None
    return (f"not enough memory: the {len(ranks)} parameter server(s) on this machine need {size_text(need)} "
            f"(embedding shards with their {cfg.optim.sparse} state), {source} is {size_text(limit)}; "
            f"add servers (dist.num_ps=P, or servers on more machines) or make the tables smaller "
            f"(hybridrec data preprocess --table-size N)")


def local_servers_memory_problem(cfg: Config, meta: DatasetMeta) -> str | None:
    """:func:`server_memory_problem` of a local launch: every server on this machine."""
    n = cfg.dist.num_ps
    shape = Topology(0, n, 0, n, torch.device("cpu"), "none", None, None)
    return server_memory_problem(cfg, ps_plan(cfg, build_tables(meta, cfg), n), shape)


class ServerCheckpoints:
    """The trainers' handle on the servers' checkpoints: the servers' backend's checkpoint
    attachment (:class:`~hybridrec.train.checkpointing.checkpointer.Attachment`,
    ``Checkpointer(attachment=...)``). :meth:`save` and :meth:`load` are collective over
    the trainers: rank 0 asks every server at once (they save and load together, over
    their own group), and every trainer learns of a failure. The trainers' checkpoint is
    written in the foreground: the servers' part is in it before it is published."""

    in_background = False

    def __init__(self, topo: Topology, num_ps: int, timeout_s: float) -> None:
        self.topo, self.num_ps, self.timeout_s = topo, num_ps, timeout_s

    def manifest(self) -> dict:
        """The manifest's entry of the servers' part."""
        return {PS_DIR: "servers"}

    def processes(self, trainers: int) -> int:
        """The processes a failure can hit: the trainers and the servers."""
        return trainers + self.num_ps

    def _all(self, fn, args, what: str, path: Path) -> list:
        """``fn(*args)`` on every server at once, asked by the lead trainer; every trainer
        gets the replies (or the error)."""
        err, replies = None, None
        if self.topo.lead:  # (hierarchical training: one trainer of every group's)
            try:
                futs = [(server_name(j), rpc.rpc_async(server_name(j), fn, args=args, timeout=self.timeout_s))
                        for j in range(self.num_ps)]
                replies = [wait_reply(f, what, name) for name, f in futs]
            except ServerError as e:
                err = e
        agree(self.topo, err, path, what)
        return gather(self.topo, replies)[0]

    def quiesce(self, sparse_opt) -> None:
        """Collective over every trainer, before a checkpoint (every rank, before group 0
        saves): this trainer's pushes in flight land (``sparse_opt.flush()``), then, in
        hierarchical training, a world barrier, so that the servers save only after every
        group's pushes landed. (Only group 0 saves: a flush inside its save left the other
        groups' pushes in flight, a torn server checkpoint in async mode, and in lockstep
        mode a resumed run waited for a step never pushed again.)"""
        sparse_opt.flush()
        if self.topo.hierarchical:
            torch.distributed.barrier(group=self.topo.job_group)

    def save(self, path: Path, step: int) -> None:
        """Into ``path/ps`` (``path``: the trainers' checkpoint, not yet published)."""
        self._all(srv.rpc_save, (str(path / PS_DIR), {"step": step}), "saving the servers' checkpoint", path)

    def no_failure(self, run_dir: Path, fast_dir) -> None:
        """No trainer stopped under a failure: a server's snapshot, if any, is of no failure
        to recover now (the lead trainer clears them)."""
        if self.topo.lead:
            clear_snapshots(run_dir, fast_dir)

    def recover(self, resumed_at: int, checkpoint_step: int | None, *, use_snapshots: bool, run_dir: Path,
                lost_since, global_batch: int, trainers_shards=None) -> dict:
        """Collective over the trainers, after the checkpoint was restored: every server's
        part of a recovery (:meth:`ServerRecovery.recover`: its own snapshot over the
        checkpoint's shards, or not); the recovery record's entries: the servers that
        failed, each server's reply and its shards' losses (``lost_since(f"psJ", step)``:
        the steps server J's shards lost; the trainers hold no shard)."""
        replies = self._all(rpc_recover, (resumed_at, checkpoint_step, use_snapshots),
                            "recovering the parameter servers", run_dir)
        kept = [x for x in replies if x["snapshot"]]
        if kept:  # every server at the sparse optimizers' step of the first that kept its state
            self._all(srv.rpc_set_clock, (kept[0]["clock"],), "recovering the parameter servers", run_dir)
        return {"failed_servers": [x["server"] for x in replies
                                   if not (x["snapshot"] if use_snapshots else x["wrote"])],
                "servers": [{k: x[k] for k in ("server", "snapshot", "held_step", "version")} for x in replies],
                "shards": [server_shard_loss(x["server"], s, lost_since(f"ps{x['server']}", x["held_step"]),
                                             global_batch) for x in replies for s in x["shards"]]}

    def load(self, path: Path) -> None:
        self._all(srv.rpc_load, (str(path / PS_DIR),), "loading the servers' checkpoint", path)
        if self.topo.hierarchical:  # no group pulls a row before the servers have loaded
            torch.distributed.barrier(group=self.topo.job_group)
