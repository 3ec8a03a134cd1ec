"""The loop's recovery part (``train.recovery``, several ranks): everything the loop does for
recovery, around :class:`~hybridrec.train.checkpointing.recovery.Recovery`.

- the step's updates: :meth:`Recovery.updating` installed as the optimizers' ``updating``
  hook (the state is whole outside it; the incremental saves count the rows looked up);
- while training, a failure (an error, SIGTERM) keeps this rank's state (partial
  recovery's snapshot: :meth:`Recovery.watch`);
- incremental saves of the shards (``train.shard_delta_every``) between full checkpoints;
- the restore, through the checkpoint part's hooks (:class:`CheckpointHooks`): the shards
  into files of local memory first, a survivor's shards from its own snapshot (then only the
  checkpoint's dense part), the survivors' state after it;
- with ``train.checkpoint_every=auto`` and partial recovery, the interval
  (:func:`~hybridrec.train.checkpointing.checkpoint_interval.partial_recovery_interval`),
  chosen again once a delta's read-back is measured, and the fall back to full recovery;
- what each recovery lost, in the summary.
"""

from __future__ import annotations

import contextlib
import time
from typing import ClassVar

import torch
import torch.distributed as dist

from hybridrec.metrics.logger import MetricLogger
from hybridrec.train.checkpointing.checkpoint_interval import partial_recovery_interval
from hybridrec.train.checkpointing.lost_work import read_events
from hybridrec.train.checkpointing.recovery import Recovery
from hybridrec.train.loop.checkpoint_policy import CheckpointHooks
from hybridrec.train.loop.parts import Done, Part


def nothing_updating(step: int):
    """No part wraps a step's updates (see :meth:`Recovery.updating`)."""
    return contextlib.nullcontext()


class RecoveryPart(Part, CheckpointHooks):
    """``train.recovery`` (several ranks): while training runs, a failure (an error, SIGTERM)
    keeps this rank's state (partial recovery's snapshot); incremental saves of the
    shards (``train.shard_delta_every``) between full checkpoints; its side of the restore
    and of the checkpoint interval; what each recovery lost, in the summary."""

    absent: ClassVar[dict] = {"recovery": None}

    def __init__(self, recovery: Recovery, t, *, optim, logger: MetricLogger | None) -> None:
        """``t``: the config's ``train`` section; ``optim``: the step's optimizers
        (:class:`~hybridrec.train.loop.trainer.Optimizers`), whose ``updating`` hook this
        part installs."""
        self.recovery, self.t, self.logger = recovery, t, logger
        # auto, partial recovery with deltas: the probe's inputs, until a delta's measured
        # read-back chooses again (:meth:`_delta_saved`)
        self._replay_inputs: dict | None = None
        optim.updating = recovery.updating

    # -- the loop --------------------------------------------------------------------------
    def running(self, loop):
        return self.recovery.watch(loop.step)

    def after_step(self, loop, done: Done) -> None:
        if not self.recovery.delta_due(done.step) or loop.checkpoints.saves_at(done.step):
            return
        start = time.perf_counter()
        self.recovery.save_delta(done.step)  # (this rank's shards alone; written in the background)
        if self.logger:  # (the seconds it held training up: the failure-schedule benchmark's)
            self.logger.log(done.step, {"delta_seconds": time.perf_counter() - start}, split="checkpoint")
        self._delta_saved(loop)  # (the previous delta's read-back is measured by now)

    def after_save(self, loop, step: int, seconds: float) -> None:
        self.recovery.checkpointed(step)  # (every row is saved: the shards' older deltas go)

    def close(self, loop) -> None:
        if self.recovery.deltas is not None:
            self.recovery.deltas.wait()  # (the obsolete deltas deleted while the run evaluated)

    def summary(self) -> dict:
        deltas = self.recovery.deltas
        return {"recovery": {"mode": self.recovery.mode, "events": read_events(self.recovery.run_dir),
                             "shard_deltas": deltas.saved if deltas is not None else None}}

    # -- the restore (CheckpointHooks) -------------------------------------------------------
    def before_restore(self, *, resume: bool, drawn: bool | None) -> bool:
        """Partial recovery: its shards into files of local memory first; a rank with its own
        recovery snapshot reads its shards from it, and only the dense part of the checkpoint."""
        rec = self.recovery
        rec.start_resident(resume=resume, drawn=drawn)
        return resume and rec.own_snapshot()

    def after_restore(self, checkpoint_step: int | None, step: int, path) -> tuple[int, str]:
        """The run stopped under a rank: the survivors' state (:meth:`Recovery.restore`), and
        training resumes at their step."""
        rec = self.recovery
        recovered = rec.restore(checkpoint_step)  # (this invocation's recovery's record)
        if recovered is not None:
            step = recovered["resumed_at_step"]
        rec.resumed(checkpoint_step=checkpoint_step or 0, step=step)
        partial = recovered is not None and recovered["survivors"]
        where = f"partial recovery: the failed shards from {path or 'their initial values'}" if partial else str(path)
        return step, where

    # -- train.checkpoint_every=auto (CheckpointHooks) -------------------------------------
    def probe_measures(self, step: int) -> list[float]:
        """The share of the shards' rows a delta saves and of the updates (1 without deltas)."""
        deltas = self.recovery.deltas
        share = deltas.share_per_delta(step) if deltas is not None else 1.0  # (before the save resets it)
        update = deltas.update_share() if deltas is not None else 1.0  # (the updates a delta saves)
        return [share, update]

    def choose_interval(self, *, save_s: float, step_s: float, mtbf_s: float, total_steps: int,
                        measured: list[float]) -> dict | None:
        """Partial recovery's interval (None: full recovery, or one process: Young/Daly's)."""
        t, rec = self.t, self.recovery
        share, update = measured
        deltas = rec.deltas
        # (parameter servers: a failure hits one of the N + P processes alike, and only a
        # server's loses anything, 1/P of the tables: 1/(N + P) expected, as N + P DES ranks)
        processes = rec.ckpt.attachment.processes(rec.topo.group_size)
        if not (t.recovery == "partial" and processes > 1):
            return None
        inputs = {"save_s": save_s, "step_s": step_s, "mtbf_s": mtbf_s, "total_steps": total_steps,
                  "ranks": processes, "lost_fraction": t.lost_fraction,
                  "delta_steps": deltas.every if deltas is not None else 0, "delta_share": share,
                  "delta_update_share": update}
        choice = partial_recovery_interval(**inputs)
        if deltas is not None:  # a replay's cost, measured on the next delta, chooses again
            deltas.time_next_read()
            self._replay_inputs = inputs
        return choice

    def interval_taken(self, choice: dict) -> None:
        """A choice that falls back to full recovery (partial recovery cannot keep
        ``train.lost_fraction`` at a cost below full's) ends partial recovery here."""
        if choice.get("fallback") == "full":
            self.recovery.fall_back(choice["fallback_reason"])

    def _delta_saved(self, loop) -> None:
        """Partial recovery with deltas, after a delta once the delta after the probe was
        read back (:meth:`ShardDeltas.time_next_read`, rank 0's): the interval again, with a
        replay priced at that read, scaled to the mean delta's rows, instead of a share of a
        save (:func:`~hybridrec.train.checkpointing.checkpoint_interval.partial_recovery_interval`)."""
        if self._replay_inputs is None:
            return
        replay_s = self.recovery.deltas.replay_seconds() or -1.0
        topo = self.recovery.topo
        if topo.job_size > 1:  # rank 0's measurement
            box = torch.tensor([replay_s], dtype=torch.float64, device=topo.comm_device)
            dist.broadcast(box, group=topo.run_group, group_src=0)
            replay_s = box.item()
        if replay_s <= 0:  # not read back yet: at the next delta
            return
        inputs, self._replay_inputs = self._replay_inputs, None
        loop.checkpoints.take(partial_recovery_interval(**inputs, replay_s=replay_s))
