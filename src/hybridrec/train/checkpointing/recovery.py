"""Recovery after a failure: full, or partial (CPR) where the surviving ranks keep their state.

CPR (Maeng et al., MLSys 2021) observed that a recommendation model's embedding shards can
recover independently: when a rank fails, only the shards it held need to roll back to their
last checkpoint, while the other ranks keep their up-to-date shards. The updates those
shards received since the checkpoint are lost (a small share of the model, for a small
share of the run), but no step is trained again.

``train.recovery=partial``, how it runs here:

1. While training, each rank marks the part of a step that changes its state (the dense and
   sparse optimizer updates, :meth:`Recovery.updating`): the state is whole (every update
   of step N applied, none of N+1) outside it, and the loader position of the last whole
   step is kept.
2. When the run stops under a rank (a peer died: its collective fails, or the launcher's
   agent sends SIGTERM to stop it), the rank writes a *snapshot* of its whole state to
   ``RUN/recovery/rank-R/`` (:meth:`Recovery.write_snapshot`): its embedding shards and
   their sparse optimizer state, the dense arches and their optimizer state, every
   checkpointed component (loader, RNG, ...), the step. A thread waits for SIGTERM on
   :func:`signal.set_wakeup_fd`'s pipe (:mod:`hybridrec.train.checkpointing.sigterm`), so the snapshot is written even while the main
   thread is blocked in a collective; it waits for a step's update to finish first. Then
   ``RUN/recovery/rank-R.json`` says which step it holds and where (written last: a
   snapshot without it is not used). Under the local launcher the snapshot goes to
   ``/dev/shm`` instead (:func:`~hybridrec.train.checkpointing.snapshots.fast_snapshots`),
   and there a rank's shards and their sparse optimizer state live all along in files of
   that directory (:mod:`hybridrec.train.checkpointing.resident`,
   :meth:`Recovery.start_resident`): the snapshot takes those files by a rename and writes
   only the rest. A rank killed outright (SIGKILL, a lost
   machine) writes nothing, and its shards' delta being written (incremental saves, below)
   is lost: its newest complete one serves. A stopped rank finishes that delta first.
   The snapshot is written as the state is, without a copy (no update runs meanwhile),
   and not synced to disk (the page cache serves the restart on this machine, in a
   fraction of the time): ``rank-R.json`` records the kernel's boot id, and a snapshot
   written before the machine restarted is not used (that rank rolls back).
3. The restarted run (``dist.max_restarts``, or the same command again) restores the
   newest checkpoint on every rank, as full recovery does, except that a rank with a usable
   snapshot of its own reads only the checkpoint's dense part: a thread reads its shards
   and their optimizer state from its snapshot meanwhile (in place, into the tables), while
   the ranks that roll back read the checkpoint's tables (:meth:`Recovery.own_snapshot`).
   Shards whose files a snapshot took are not read: the restarted process maps the same
   files (the record's ``shards_kept_in_memory`` names those ranks).
   Then every rank loads the dense part, the loader position and the other global state
   from the snapshot of one survivor (the lowest rank among those at the newest step), so
   the replicas agree. Training goes on from the survivors'
   step; the failed rank's shards hold the checkpoint's values. The snapshots are deleted
   once loaded (the shards' incremental saves, ``RUN/recovery/deltas/``, stay for the
   next failure).

What a recovery lost is appended to ``RUN/recovery.jsonl`` and summary.json ``recovery``
(:mod:`hybridrec.train.checkpointing.lost_work`). Where the snapshots and their records go,
and how they are written and checked: :mod:`hybridrec.train.checkpointing.snapshots`.

A run whose ``checkpoint_every=auto`` choice falls back to full recovery (partial recovery
cannot keep ``train.lost_fraction`` at a cost below full recovery's:
:func:`~hybridrec.train.checkpointing.checkpoint_interval.partial_recovery_interval`) calls
:meth:`Recovery.fall_back`: from then on its ranks recover fully (no snapshot, no deltas),
and its records say ``full``.

A stream with dynamic tables (``data.stream``, ``model.tables=dynamic``): the key maps'
checkpointed state merges every rank's slots (a collective that a snapshot written after a
peer died cannot make), so a component may give a snapshot a state of its own
(``snapshot_state``, written in place of ``state_dict``): the maps' global component
(``keymaps``) writes only the mapping's step, taken from the donor, and each rank's own slots
go in the per-rank ``keymaps_own``
(:class:`~hybridrec.train.loop.stream.OwnSlots`), loaded from a survivor's own snapshot over
the checkpoint's maps; the stream's position is the loader's of the last whole step, the
donor's. Taking the maps waits for the feed's thread to finish mapping a chunk, at most
:data:`~hybridrec.train.loop.stream.SNAPSHOT_LOCK_WAIT_S`; past that the rank writes no
snapshot and rolls back. What this loses besides the failed shards' updates: the failed
rank's slots forget the keys mapped since the checkpoint (admitted again later as fresh
rows), and a row whose key changed since the checkpoint on one side (the failed rank's
slots, or its shards) may hold another key's values until it is evicted.

Simplifications: the snapshot is written to the run directory (``RUN/recovery/``), which
every rank of a run already shares for its checkpoints; a rank that stops inside an update
(an error of its own there) writes no snapshot and rolls back like a failed one; a
compressor's error-feedback residuals (``dist.dense_sync`` with ``compress.dense``) are
saved as they are when the run stops, which may include the interrupted step's part.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import threading
import time
from pathlib import Path

import torch

from hybridrec import launch_env
from hybridrec.files import write_json_atomic
from hybridrec.parallel.checkpoint_io import (
    MANIFEST,
    CheckpointError,
    agree,
    encode_skeleton,
    gather,
)
from hybridrec.parallel.checkpoint_layout import (
    dense_opt_state,
    dense_tensors,
    load_dense_opt,
    local_weights,
)
from hybridrec.parallel.sharded_embedding import REPLICATED, SHARDS
from hybridrec.parallel.topology import Topology
from hybridrec.train.checkpointing.checkpoint import list_checkpoints
from hybridrec.train.checkpointing.deltas import ShardDeltas, plan_json
from hybridrec.train.checkpointing.lost_work import (
    older_rows,
    record_event,
    shard_losses,
    steps_lost_by,
)
from hybridrec.train.checkpointing.resident import (
    ResidentShards,
    files_fit,
    read_into,
    shard_tensors,
)
from hybridrec.train.checkpointing.sigterm import LOCK_WAIT_S, SigtermWatch
from hybridrec.train.checkpointing.snapshots import (
    RESIDENT_DIR,
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


class Recovery:
    """One rank's side of recovery: the snapshot it writes when the run stops under it, and
    the restore after a restart. Built from the run's
    :class:`~hybridrec.train.checkpointing.checkpointer.Checkpointer` (the same model, optimizers and
    components)."""

    def __init__(self, checkpointer, *, mode: str, global_batch: int, deltas: ShardDeltas | None = None,
                 fast_dir: str | Path | None = None) -> None:
        """``deltas``: this rank's incremental saves of its shards (``train.shard_delta_every``);
        ``fast_dir``: the local launcher's directory on local memory
        (:func:`~hybridrec.train.checkpointing.snapshots.fast_snapshots`; None: snapshots go to
        ``RUN/recovery/``)."""
        self.ckpt, self.mode, self.global_batch, self.deltas = checkpointer, mode, global_batch, deltas
        self.fast_dir = usable_fast_dir(fast_dir)
        self.topo: Topology = checkpointer.topo
        self.run_dir = Path(checkpointer.run_dir)
        self.step = 0  # the last whole step (all of its updates applied)
        self._loader_state: dict | None = None  # the loader position after that step
        self._state_lock = threading.Lock()  # held while a step updates the state
        self._torn = False  # an update stopped half-way: the state is not whole
        self._snap_lock = threading.Lock()
        self._done = False
        self._sigterm = SigtermWatch()
        self._own: tuple | None = None  # (progress, path, manifest or None: not usable), as own_snapshot found them
        self._own_error: BaseException | None = None  # (reading its shards from it failed)
        self._own_reader: threading.Thread | None = None
        self._own_start = 0.0
        self.resident: ResidentShards | None = None  # (start_resident: this rank's shards in local memory files)
        self._adopted = False  # (its shards are its own snapshot's files, taken at start_resident)

    def _shard_parts(self):
        """This rank's shard collection and their sparse optimizer (None: no shard here)."""
        local = getattr(self.ckpt.model.sparse, "local", None)
        opt = getattr(self.ckpt.sparse_opt, "optimizers", {}).get(SHARDS)
        return (local, opt) if local is not None and opt is not None else None

    def start_resident(self, *, resume: bool, drawn: bool | None) -> None:
        """Before the restore (partial recovery under the local launcher): this rank's shards
        move into files of the launcher's local-memory directory (hybridrec.train.checkpointing.resident),
        a survivor's into its own snapshot's files. ``drawn``: True, the tables hold their
        initial values (kept); False, zeros; None, nothing yet: they start as zeros (also
        where the files cannot be made: then zeroed where they are)."""
        fast, parts = self.fast_dir, self._shard_parts()
        on_host = self.topo.device.type == "cpu"  # (a GPU's shards stay there: the files are host memory)
        if self.mode != "partial" or fast is None or parts is None or self.resident is not None or not on_host:
            if drawn is None:
                self._zero_shards()
            return
        resident = ResidentShards(fast, self.topo.rank, *parts)
        try:
            found = self._own_files(resident) if resume else None
            if found is not None:
                resident.adopt(*found)
                self._adopted = True
            elif resident.room(launch_env.local_world_size(1)):
                resident.create(copy=bool(drawn))
            else:
                self._note(f"{fast} has no room for its shards' {resident.nbytes():,} bytes: a failure's "
                           "snapshot writes them")
                resident = None
        except (OSError, RuntimeError) as e:
            self._note(f"its shards stay in process memory ({e}): a failure's snapshot writes them")
            resident.release()
            resident, self._adopted = None, False
        self.resident = resident
        if resident is None and drawn is None:
            self._zero_shards()

    def _zero_shards(self) -> None:
        parts = self._shard_parts()
        with torch.no_grad():
            for t in shard_tensors(*parts).values() if parts is not None else ():
                t.zero_()

    def _own_files(self, resident: ResidentShards) -> tuple[Path, dict] | None:
        """This rank's snapshot's shard files, where they can be taken as they are: on the
        launcher's local-memory file system, in a snapshot that passes
        :meth:`_check_snapshot` (which :meth:`own_snapshot` says why of, if not)."""
        progress = read_progress(self.run_dir, self.topo.rank)
        if progress is None or not progress.get("snapshot"):
            return None
        path = snapshot_written_at(progress, self.run_dir, self.topo.rank)
        if path.parent != resident.dir.parent:
            return None
        try:
            entries = self._check_snapshot(progress, path).get("resident")
        except Exception:  # noqa: BLE001 - not taken: own_snapshot checks it again and says why
            return None
        return (path / RESIDENT_DIR, entries) if entries is not None else None

    # -- while training ------------------------------------------------------------------
    @contextlib.contextmanager
    def updating(self, step_after: int):
        """Around the updates of a step: the state is whole again, at ``step_after``, when
        it ends (an exception inside leaves it torn: no snapshot)."""
        with self._state_lock:
            try:
                yield self.deltas.track if self.deltas is not None else None
            except BaseException:
                self._torn = True
                raise
            self.step = step_after
            loader = self._loader()
            self._loader_state = dict(loader.obj.state_dict()) if loader is not None else None

    def delta_due(self, step: int) -> bool:
        return self.deltas is not None and self.mode == "partial" and step % self.deltas.every == 0

    def fall_back(self, reason: str) -> None:
        """Recover fully from now on (the interval's choice: partial recovery cannot keep
        ``train.lost_fraction`` at a sensible cost, ``reason``): a failure writes no snapshot,
        the shards' deltas stop, and the restarted run restores every rank from the
        checkpoint (its record says ``full``). Said once, by the lead rank."""
        if self.mode == "full":
            return
        with self._state_lock:  # (not while a snapshot is being written)
            self.mode = "full"
        if self.topo.lead:
            print(f"hybridrec: train.recovery=partial falls back to full recovery ({reason})",
                  file=sys.stderr, flush=True)

    def save_delta(self, step: int) -> None:
        with self._state_lock:  # (not while a snapshot reads the counts)
            self.deltas.save(step)

    def checkpointed(self, step: int) -> None:
        """A checkpoint of ``step`` is on disk."""
        if self.deltas is not None:
            self.deltas.checkpointed(step)

    def resumed(self, *, checkpoint_step: int, step: int) -> None:
        """Training resumes at ``step`` after the checkpoint of ``checkpoint_step`` (0: none):
        this rank's deltas of another trajectory (after ``step``, or after another
        checkpoint) go."""
        if self.deltas is not None:
            self.deltas.resumed(checkpoint_step=checkpoint_step, step=step)

    @contextlib.contextmanager
    def watch(self, step: int):
        """Training from ``step`` on: if it stops with an error (e.g. a collective that lost
        its peer) or by SIGTERM (partial), the state is kept (:meth:`on_failure`)."""
        self.begin(step)
        try:
            yield
        except BaseException:
            self.on_failure()
            raise
        finally:
            self.end()
            if self.deltas is not None:
                self.deltas.wait()  # (the last delta on disk before the process ends)

    def begin(self, step: int) -> None:
        """Training starts (or resumes) at ``step``: arm the SIGTERM watcher."""
        self.step = step
        loader = self._loader()
        self._loader_state = dict(loader.obj.state_dict()) if loader is not None else None
        self._sigterm.start(lambda: self.on_failure(wait_s=LOCK_WAIT_S))

    def end(self) -> None:
        """Training ended normally: put SIGTERM's handling back."""
        self._sigterm.stop()

    def on_failure(self, wait_s: float = 0.0) -> None:
        """The run stops under this rank: write what it has, once (the main thread's error
        path and the SIGTERM watcher may both get here)."""
        with self._snap_lock:
            if self._done:
                return
            self._done = True
            if self.mode != "partial":  # only the step it reached, for the record
                with contextlib.suppress(OSError):
                    self.write_snapshot()
                return
            # (the main thread's error path: never inside an update, the lock is free or
            # torn; the watcher: waits for the update in progress to finish)
            got = self._state_lock.acquire(timeout=wait_s) if wait_s > 0 else self._state_lock.acquire(blocking=False)
            if not got:
                self._note("the rank stopped inside a step's update: no snapshot")
                return
            try:
                try:
                    self.write_snapshot()
                except Exception as e:  # noqa: BLE001 - the run is ending already; say why, go on
                    self._note(f"writing the recovery snapshot failed: {e}")
                self._delta_on_disk()
            finally:
                self._state_lock.release()

    def _delta_on_disk(self) -> None:
        """The delta being written reaches disk before the process ends: it serves this
        rank's next failure, and the snapshot's counts take its rows as saved. (The SIGTERM
        watcher ends the process past :meth:`watch`'s own wait; called under the state lock,
        so no delta is being staged.)"""
        if self.deltas is None:
            return
        try:
            self.deltas.wait()
        except OSError as e:  # (the run is ending already: said, not raised)
            self._note(str(e))

    def _note(self, text: str) -> None:
        with contextlib.suppress(OSError):
            print(f"hybridrec: rank {self.topo.rank}: {text}", file=sys.stderr, flush=True)

    def write_snapshot(self) -> None:
        """``RUN/recovery/rank-R/`` (partial: the whole state; full: nothing) and then
        ``rank-R.json`` with the step it holds."""
        d = recovery_dir(self.run_dir)
        d.mkdir(parents=True, exist_ok=True)
        try:
            self._write_snapshot(d)
        except BaseException:
            with contextlib.suppress(OSError):  # (nothing half-written is left: the tmp dir went)
                d.rmdir()  # (only when empty)
            raise

    def _write_snapshot(self, d: Path) -> None:
        rank = self.topo.rank
        start = time.perf_counter()
        snapshot = self.mode == "partial" and not self._torn
        boot = boot_id()  # (None: the files are synced to disk instead)
        if snapshot:
            tensors: dict[str, torch.Tensor] = {}
            resident = self.resident if self.resident is not None and self.resident.intact() else None
            skeleton = encode_skeleton(self._state(resident=resident is not None), "s", tensors)
            root = (resident.dir.parent if resident is not None  # (its files move: the same file system)
                    else snapshot_root(self.fast_dir, d, tensors))
            final = save_snapshot(root / f"rank-{rank:05d}", skeleton, tensors,
                                  {"rank": rank, "world_size": self.topo.group_size, "step": self.step,
                                   "plan": plan_json(self.ckpt.model.sparse)}, sync=boot is None,
                                  more=(lambda tmp: {"resident": resident.hand_over(tmp / RESIDENT_DIR)})
                                  if resident is not None else None)
        write_json_atomic(progress_file(self.run_dir, rank), {
            "rank": rank, "step": self.step, "snapshot": snapshot, "mode": self.mode, "time": time.time(),
            "seconds": time.perf_counter() - start, "pid": os.getpid(), "boot": boot,
            **({"path": str(final)} if snapshot else {})})
        if snapshot:  # (full recovery: the step reached is for the record only, said after the restart)
            self._note(f"the run stopped at step {self.step}: wrote its state to {final}")

    def _loader(self):
        return next((c for c in self.ckpt.components if c.name == "loader"), None)

    def _state(self, *, resident: bool = False) -> dict:
        """What a snapshot holds (``resident``: not the shards and their optimizer's tables,
        whose files it takes instead)."""
        model, c = self.ckpt.model, self.ckpt
        # (a component whose state_dict is a collective gives a snapshot its own: snapshot_state)
        comps = {x.name: (self._loader_state if x.name == "loader" and self._loader_state is not None
                          else getattr(x.obj, "snapshot_state", x.obj.state_dict)()) for x in c.components}
        weights = {k: w.detach() for k, w in local_weights(model.sparse).items()
                   if not resident or k.endswith("@*")}
        sparse_opt = c.sparse_opt.state_dict()
        if resident:
            sparse_opt[SHARDS] = {**sparse_opt[SHARDS], "tables": {}}
        return {"step": self.step,
                "weights": weights,
                "sparse_opt": sparse_opt,
                "dense": {k: v.detach() for k, v in dense_tensors(model).items()},
                "dense_opt": dense_opt_state(c.dense_opt, model),
                "components": comps,
                "deltas": self.deltas.state_dict() if self.deltas is not None else None}

    # -- after a restart ------------------------------------------------------------------
    def own_snapshot(self) -> bool:
        """Collective, before the checkpoint is restored: whether this rank takes its shards
        and their optimizer state from its own snapshot (partial recovery, a snapshot that
        passes its checks, of a step not older than the newest checkpoint rank 0 sees). Such
        a rank needs only the checkpoint's dense part (its tables would be overwritten);
        :meth:`restore` then uses this same snapshot. Its shards and their optimizer state
        are read by a thread that starts here, while the checkpoint is restored (the ranks
        that roll back read its tables meanwhile); :meth:`restore` waits for it and raises
        an error of it on every rank."""
        self._own = self._own_error = None
        if self.mode != "partial":
            return False
        found = list_checkpoints(self.run_dir) if self.topo.rank == 0 else []
        newest = gather(self.topo, found[-1][0] if found else None)[0]
        progress = read_progress(self.run_dir, self.topo.rank)
        if progress is not None and progress.get("snapshot") and progress["step"] >= (newest or 0):
            self._own = (progress, *self._usable_snapshot(progress))
        mine = self._own is not None and self._own[2] is not None
        if any(gather(self.topo, mine)) and not mine and self.deltas is not None:
            self.deltas.prefetch(newest or 0)  # (a rank that rolls back: its deltas read while the checkpoint is)
        if not mine:
            return False
        path = self._own[1]
        self._own_start = time.perf_counter()

        def read() -> None:
            try:
                self._load_shards(path, self._own[2])
            except BaseException as e:  # noqa: BLE001 - every rank learns of it in restore()
                self._own_error = e

        self._own_reader = threading.Thread(target=read, name="hybridrec-snapshot-read", daemon=True)
        self._own_reader.start()
        return True

    def restore(self, checkpoint_step: int | None) -> dict | None:
        """Collective, after the newest checkpoint (of ``checkpoint_step``; None: none) was
        restored on every rank. Loads the survivors' snapshots (partial) and returns the
        recovery's record, or None when the run did not stop under any rank."""
        start, early = time.perf_counter(), False
        if self._own is not None:  # (as own_snapshot found them)
            (progress, path, mine), self._own = self._own, None
            if mine is not None:  # (its shards are being read: the checkpoint's tables were not)
                self._own_reader.join()
                start, early = self._own_start, True
        else:
            progress = read_progress(self.run_dir, self.topo.rank)
            mine = path = None  # (this rank's snapshot: its manifest, where it is)
            if progress is not None and progress["step"] < (checkpoint_step or 0):
                progress = None  # (older than the checkpoint: of a recovery long done)
            if progress is not None and progress.get("snapshot") and self.mode == "partial":
                path, mine = self._usable_snapshot(progress)
        err = None
        everyone = gather(self.topo, (progress, mine is not None))
        attachment = self.ckpt.attachment  # (a parameter-server run: its servers recover too)
        if all(p is None for p, _ in everyone):
            attachment.no_failure(self.run_dir, self.fast_dir)
            return None
        c = checkpoint_step or 0
        reached = [p["step"] for p, _ in everyone if p is not None]
        failed_at = max(reached)
        survivors = [r for r, (p, ok) in enumerate(everyone) if ok]
        # (partial: every rank without a usable snapshot rolls back; full: the ranks that died)
        failed = [r for r, (p, ok) in enumerate(everyone) if (not ok if survivors else p is None)]
        # (a run that fell back to full recovery before the failure: its ranks' records say so)
        mode = "full" if any(p is not None and p.get("mode") == "full" for p, _ in everyone) else self.mode
        event = {"mode": mode, "checkpoint_step": checkpoint_step, "failed_at_step": failed_at,
                 "failed_ranks": failed, "survivors": survivors,
                 "failed_at_time": min(p["time"] for p, _ in everyone if p is not None)}
        # (the step this rank's shards hold; rows a delta left pending, and those by shard and held step)
        resumed_at, held = c, (c, None, {})
        if survivors:  # partial: the survivors' state; the donor is the lowest of the newest
            donor = min(r for r in survivors if everyone[r][0]["step"] == max(everyone[s][0]["step"]
                                                                                  for s in survivors))
            resumed_at = everyone[donor][0]["step"]
            try:
                if early and self._own_error is not None:
                    raise self._own_error
                self._load(path, mine, snapshot_written_at(everyone[donor][0], self.run_dir, donor), shards=not early)
                if mine is not None:
                    held = (progress["step"], None, {})
                elif self.deltas is not None:  # a failed rank: its shards' incremental saves
                    newest, pending, older = self.deltas.apply(c, resumed_at)
                    held = (newest, pending, older) if newest is not None else (c, None, {})
            except Exception as e:  # noqa: BLE001 - every rank learns of it below
                err = e
            agree(self.topo, err, recovery_dir(self.run_dir), "loading the survivors' snapshots")
            event["donor"] = donor
            # (the survivors whose shards' files in local memory were taken as they were)
            kept = gather(self.topo, self._adopted and mine is not None)
            event["shards_kept_in_memory"] = [r for r, a in enumerate(kept) if a]
        holds = gather(self.topo, held)
        lost_since = steps_lost_by(self.run_dir, checkpoint_step, failed_at)
        lost = {r: lost_since(r, step) for r, (step, *_) in enumerate(holds)}
        # rows a hot-row delta left out: {rank: {shard: {steps lost: rows}}}, by the step of their newest save
        older = older_rows(holds, failed, lost_since)
        if self.deltas is not None and survivors:
            event["deltas"] = {str(r): {"step": holds[r][0], "pending_rows": holds[r][1]} for r in failed}
        # the tables' shards' losses: the trainers', or each server's (its own snapshot over the
        # checkpoint's shards, or not) with the servers that failed
        event.update(attachment.recover(resumed_at, checkpoint_step, use_snapshots=bool(survivors),
                                        run_dir=recovery_dir(self.run_dir), lost_since=lost_since,
                                        global_batch=self.global_batch,
                                        trainers_shards=lambda: shard_losses(self.ckpt.model.sparse,
                                                                             self.global_batch, lost, older)))
        event.update(resumed_at_step=resumed_at,
                     dense_steps_lost=max(0, failed_at - resumed_at),
                     restore_seconds=time.perf_counter() - start, resumed_time=time.time())
        event["restore_seconds"] = max(gather(self.topo, event["restore_seconds"]))
        torch.distributed.barrier(group=self.topo.group)  # every rank read the donor's files
        if self.topo.lead:
            record_event(self.run_dir, event, self.fast_dir)
        return event

    def _usable_snapshot(self, progress: dict) -> tuple[Path, dict | None]:
        """Where this rank's snapshot of ``progress`` is, and its manifest if it passes
        :meth:`_check_snapshot` (None, said on stderr: this rank rolls back)."""
        path = snapshot_written_at(progress, self.run_dir, self.topo.rank)
        try:
            return path, self._check_snapshot(progress, path)
        except Exception as e:  # noqa: BLE001 - a snapshot that does not fit: this rank rolls back
            self._note(f"its recovery snapshot is not used ({e})")
            return path, None

    def _check_snapshot(self, progress: dict, path: Path) -> dict:
        step = progress["step"]
        meta = check_snapshot_dir(progress, path)
        if (meta.get("world_size"), meta.get("plan"), meta.get("step")) != (self.topo.group_size, plan_json(self.ckpt.model.sparse), step):
            raise CheckpointError(f"{path}: saved by another world size, plan or step")
        resident = meta.get("resident")
        want = {k: tuple(w.shape) for k, w in local_weights(self.ckpt.model.sparse).items()
                if resident is None or k.endswith("@*")}
        have = {k: tuple(v["shape"]) for k, v in meta["state"]["weights"].items()}
        if want != have:
            raise CheckpointError(f"{path}: its shards are not this rank's ({sorted(have)} vs {sorted(want)})")
        if resident is not None:
            parts = self._shard_parts()
            why = ("this rank has no shard" if parts is None or not isinstance(resident, dict)
                   else files_fit(path / RESIDENT_DIR, resident, shard_tensors(*parts)))
            if why is not None:
                raise CheckpointError(f"{path}: its shards' files do not fit: {why}")
        return meta

    def _load_shards(self, path: Path, mine: dict) -> None:
        """This rank's shards, their sparse optimizer state and its deltas' counts from its
        own snapshot (``path``, its manifest ``mine``)."""
        c = self.ckpt
        live = {k: w.detach() for k, w in local_weights(c.model.sparse).items()
                if not k.endswith("@*")}  # (replicated tables: the donor's, in _load)
        state = read_snapshot(path, mine, ("weights", "sparse_opt", "deltas"),
                      weights=lambda k: not k.endswith("@*"), into=live)
        if self.deltas is not None and state["deltas"] is not None:  # (rows still pending stay so)
            self.deltas.load_state_dict(state["deltas"])
        with torch.no_grad():
            for k, v in state["weights"].items():
                if v is not live[k]:  # (read in place when it could be)
                    live[k].copy_(v)
        c.sparse_opt.load_state_dict(state["sparse_opt"])
        if mine.get("resident") is not None and not self._adopted:  # (its shards' files: read, not taken)
            read_into(path / RESIDENT_DIR, mine["resident"], shard_tensors(*self._shard_parts()))

    def _load(self, path: Path | None, mine: dict | None, dpath: Path, *, shards: bool = True) -> None:
        """This rank's state from its own snapshot (``path``, its manifest ``mine``; None:
        none; ``shards`` False: its shards were read already); the replicated state from
        the donor's (``dpath``)."""
        model, c = self.ckpt.model, self.ckpt
        if mine is not None:
            if shards:
                self._load_shards(path, mine)
            state = read_snapshot(path, mine, ("components",))
            for x in c.components:
                if x.per_rank and x.name in state["components"]:
                    x.obj.load_state_dict(state["components"][x.name])
        dmeta = json.loads((dpath / MANIFEST).read_text())
        state = read_snapshot(dpath, dmeta, ("dense", "dense_opt", "components", "weights", "sparse_opt"),
                      weights=lambda k: k.endswith("@*"), sparse_opt=lambda k: k == REPLICATED)
        live = dense_tensors(model)
        with torch.no_grad():
            for k, v in state["dense"].items():
                live[k].copy_(v)
            replicas = local_weights(model.sparse)
            for k, v in state["weights"].items():
                replicas[k].copy_(v)
        load_dense_opt(c.dense_opt, model, state["dense_opt"])
        # The replicated tables' optimizer state, and the donor's step and learning rate for
        # every sparse optimizer (e.g. Adam's bias correction).
        for name, opt in c.sparse_opt.optimizers.items():
            saved = state["sparse_opt"].get(name)
            if saved is None:
                continue
            if name == REPLICATED:
                opt.load_state_dict(saved)
            opt.lr, opt.step_count = float(saved["lr"]), int(saved["step"])
        for x in c.components:
            if not x.per_rank and x.name in state["components"]:
                x.obj.load_state_dict(state["components"][x.name])
