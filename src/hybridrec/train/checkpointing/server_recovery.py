"""Recovery of a parameter-server run: a server's side (CPR's own setting).

CPR (Maeng et al., MLSys 2021) trains with embedding tables sharded over parameter servers;
when a server fails, only its shards roll back to their last checkpoint while the trainers
and the other servers keep their state. Here, with ``dist.num_ps`` and
``train.recovery=partial``:

1. When the run stops under a server (the launcher's agent stops every process after one
   failed: SIGTERM), the server waits for the update under way to finish (its lock), then
   writes a *snapshot* of its whole state: its shards, their sparse optimizer state, its
   version and every trainer's pushed step (:meth:`ServerRecovery.on_failure`), to
   ``RUN/recovery/ps-J/`` (or the local launcher's directory on ``/dev/shm``), then
   ``RUN/recovery/ps-J.json`` saying which step it holds: the newest step every trainer's
   push of which it has applied (``min(pushed)``). A server killed outright writes nothing.
   The trainers write theirs as in any run (:mod:`~hybridrec.train.checkpointing.recovery`).
2. The restarted run (``dist.max_restarts``, or the same command again) restores the
   newest checkpoint everywhere, the servers' shards included, then the trainers take the
   dense state of one surviving trainer (the donor), and each server with a usable snapshot
   of its own loads it over the checkpoint's shards (:meth:`ServerRecovery.recover`, asked
   by the trainers over RPC); the others take its sparse optimizers' step count and learning
   rate (:meth:`~hybridrec.ps.server.EmbeddingServer.set_clock`, as DES ranks take the
   donor's). Every server then counts every trainer at the donor's step,
   where training goes on; pushes of later steps held for a synchronous update are dropped
   (those steps are trained again).
3. The record (``RUN/recovery.jsonl``, summary.json ``recovery``) names the failed servers
   and, per server shard, the steps of updates it lost: the failed step minus the step its
   state holds (the checkpoint's for a failed server, its snapshot's ``min(pushed)`` for a
   survivor: a push of a trainer still in flight when the run stopped is lost too).

Simplifications: a surviving server reads the checkpoint's shards first and then its
snapshot's (the servers load checkpoints together, as one sharded load); with an
unbounded or bounded staleness (``dist.ps_max_staleness`` != 0) a failed *trainer* that
was ahead of the donor had pushed steps that are trained again, so their updates reach the
surviving servers twice (in the synchronous mode, ``0``, no step is applied before every
trainer pushed it).
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
from pathlib import Path

import torch

from hybridrec.files import write_json_atomic
from hybridrec.parallel.checkpoint_io import CheckpointError, encode_skeleton
from hybridrec.ps.server import EmbeddingServer
from hybridrec.train.checkpointing.deltas import plan_json
from hybridrec.train.checkpointing.sigterm import LOCK_WAIT_S, SigtermWatch
from hybridrec.train.checkpointing.snapshots import (
    boot_id,
    check_snapshot_dir,
    progress_file,
    read_progress,
    read_snapshot,
    recovery_dir,
    save_snapshot,
    snapshot_root,
    snapshot_written_at,
    usable_fast_dir,
)

ROLE = "ps"


class ServerRecovery:
    """Server ``index``'s side of recovery: its snapshot when the run stops under it, and
    its part of the restore after a restart (``mode``: ``partial`` or ``full``, where it
    writes only the step it reached, for the record)."""

    def __init__(self, server: EmbeddingServer, index: int, *, run_dir: str | Path, mode: str,
                 fast_dir: str | Path | None = None) -> None:
        self.server, self.index, self.mode = server, index, mode
        self.run_dir, self.fast_dir = Path(run_dir), usable_fast_dir(fast_dir)
        self._sigterm = SigtermWatch()
        self._once = threading.Lock()
        self._done = False

    def begin(self) -> None:
        """Serving starts: arm the SIGTERM watcher (in the main thread)."""
        self._sigterm.start(lambda: self.on_failure(wait_s=LOCK_WAIT_S))

    def end(self) -> None:
        self._sigterm.stop()

    def on_failure(self, wait_s: float) -> None:
        """The run stops under this server: write what it has, once, at a whole state (the
        lock is not given back: the process ends)."""
        with self._once:
            if self._done:
                return
            self._done = True
        if not self.server.lock.acquire(timeout=wait_s):
            self._note("it stopped inside an update: no snapshot")
            return
        try:
            self.write_snapshot()
        except Exception as e:  # noqa: BLE001 - the run is ending already; say why, go on
            self._note(f"writing the recovery snapshot failed: {e}")

    def write_snapshot(self) -> None:
        """``RUN/recovery/ps-J/`` (partial: the whole state) and then ``ps-J.json``. The
        caller holds the server's lock."""
        d = recovery_dir(self.run_dir)
        d.mkdir(parents=True, exist_ok=True)
        start, boot = time.perf_counter(), boot_id()
        state = self.server.state()
        step, partial = min(state["pushed"]), self.mode == "partial"
        final = None
        if partial:
            tensors: dict[str, torch.Tensor] = {}
            skeleton = encode_skeleton(state, "s", tensors)
            final = save_snapshot(snapshot_root(self.fast_dir, d, tensors) / f"{ROLE}-{self.index:05d}",
                                  skeleton, tensors, self._identity(step), sync=boot is None)
        write_json_atomic(progress_file(self.run_dir, self.index, ROLE), {
            "server": self.index, "step": step, "version": state["version"], "snapshot": partial,
            "mode": self.mode, "time": time.time(), "seconds": time.perf_counter() - start, "pid": os.getpid(),
            "boot": boot, **({"path": str(final)} if final is not None else {})})
        if final is not None:
            self._note(f"the run stopped with every push up to step {step} applied: wrote its state to {final}")

    def _identity(self, step: int) -> dict:
        """What a snapshot must match to be this server's: its index, the trainers, the plan."""
        return {"server": self.index, "num_trainers": self.server.num_trainers, "step": step,
                "plan": plan_json(self.server.model.sparse)}

    def recover(self, resumed_at: int, checkpoint_step: int | None, use_snapshot: bool) -> dict:
        """After the servers restored the checkpoint of ``checkpoint_step`` (None: none):
        this server's own snapshot over it (``use_snapshot``: partial recovery with a
        surviving trainer to go on from), then every trainer counted at ``resumed_at``.
        Returns this server's part of the record."""
        progress = read_progress(self.run_dir, self.index, ROLE)
        if progress is not None and progress["step"] < (checkpoint_step or 0):
            progress = None  # (older than the checkpoint: of a recovery long done)
        used = False
        if use_snapshot and progress is not None and progress.get("snapshot"):
            path = snapshot_written_at(progress, self.run_dir, self.index, ROLE)
            try:
                meta = check_snapshot_dir(progress, path)
                if {k: meta.get(k) for k in ("server", "num_trainers", "step", "plan")} != \
                        self._identity(progress["step"]):
                    raise CheckpointError(f"{path}: saved by another server, trainer count, step or plan")
                self.server.load_own(read_snapshot(path, meta, ("weights", "sparse_opt", "version")))
                used = True
            except Exception as e:  # noqa: BLE001 - a snapshot that does not fit: this server rolls back
                self._note(f"its recovery snapshot is not used ({e}); its shards hold the checkpoint's values")
        self.server.restart_at(resumed_at)
        local = self.server.model.sparse.local_shards()
        return {"server": self.index, "wrote": progress is not None, "snapshot": used,
                "held_step": progress["step"] if used else (checkpoint_step or 0), "version": self.server.version,
                "clock": self.server.clock(),
                "shards": [{"table": name.partition("@")[0], "rows": s.num_rows, "cols": s.num_cols,
                            "row_start": s.rows[0], "col_start": s.cols[0]} for name, (s, _) in sorted(local.items())]}

    def _note(self, text: str) -> None:
        with contextlib.suppress(OSError):
            print(f"hybridrec: parameter server ps{self.index}: {text}", file=sys.stderr, flush=True)
