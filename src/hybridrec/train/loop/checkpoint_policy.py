"""The loop's checkpoint parts: when a run saves (a fixed interval, or
``train.checkpoint_every=auto``'s measured choice), what it resumes from, and partial
recovery's watch and incremental saves (:mod:`hybridrec.train.loop.parts` for the protocol,
:mod:`hybridrec.train.checkpointing.checkpoint_interval` for the intervals' arithmetic)."""

from __future__ import annotations

import contextlib
import sys
import time
from pathlib import Path
from typing import ClassVar

import torch
import torch.distributed as dist

from hybridrec.metrics.logger import MetricLogger
from hybridrec.train.checkpointing.checkpoint_interval import (
    IntervalProbe,
    partial_recovery_interval,
    restarted_choice,
    save_choice,
    young_daly_interval,
)
from hybridrec.train.checkpointing.checkpointer import Checkpointer
from hybridrec.train.checkpointing.recovery import Recovery, elastic_restarts, read_events
from hybridrec.train.loop.parts import Done, End, Part, next_multiple


class Checkpoints(Part):
    """Saves and restores the run's checkpoints (:class:`Checkpointer`). Saves every
    ``train.checkpoint_every`` steps and at the end; with ``auto`` the interval is chosen
    at the probe step from a timed save, the probe's step time and ``train.mtbf_hours``
    (every rank takes rank 0's measurements), or taken from before a restart. With
    partial recovery (``recovery``) a rank restores its own snapshot's shards and only
    the dense part of the checkpoint."""

    def __init__(self, checkpointer: Checkpointer, t, *, total_steps: int, run_dir: Path, topo,
                 logger: MetricLogger | None, recovery: Recovery | None, tables_drawn: bool | None) -> None:
        """``t``: the config's ``train`` section. ``tables_drawn`` False: the embedding
        tables were built as zeros for the run's checkpoint to overwrite; :meth:`restore`
        draws their initial values if no checkpoint is restored. None: the rank's shards
        were not even zeroed, for ``recovery`` to move into files of local memory first
        (:meth:`Recovery.start_resident`)."""
        self.checkpointer, self.t, self.total_steps = checkpointer, t, total_steps
        self.run_dir, self.topo, self.logger = run_dir, topo, logger
        self.recovery, self.tables_drawn = recovery, tables_drawn
        self.deltas = recovery.deltas if recovery is not None else None
        every = t.checkpoint_every
        # Steps between checkpoints (0: only at the end); auto: 0 until the probe step's
        # measured save chooses it (every rank rank 0's choice).
        self.every = every if isinstance(every, int) else 0
        self.interval: dict | None = (
            None if every == "auto" else {"mtbf_s": None, "save_s": None, "step_s": None,
                                          "steps": every or None, "reason": f"train.checkpoint_every={every}"})
        self.probe: IntervalProbe | None = None  # auto: times the first steps, until its checkpoint
        # auto, partial recovery with deltas: the probe's inputs, until a delta's measured
        # read-back chooses again (:meth:`delta_saved`)
        self._replay_inputs: dict | None = None
        self.saved_step: int | None = None  # step of the newest checkpoint on disk
        self.last_save_s = 0.0
        self.recovered: dict | None = None  # this invocation's recovery (Recovery.restore's record)

    # -- saving and restoring ---------------------------------------------------------
    def save(self, step: int) -> Path:
        return self.checkpointer.save(step)

    def after_save(self, loop, step: int, seconds: float) -> None:
        self.saved_step, self.last_save_s = step, seconds
        if self.logger:  # (the seconds a run spends saving: the failure-schedule benchmark's)
            self.logger.log(step, {"save_seconds": seconds}, split="checkpoint")

    def restore(self, model) -> tuple[int, str] | None:
        """Restore the newest checkpoint that passes its checks (newer ones that fail are
        renamed aside, with a warning each); ``(step, where from)``, or None: nothing to
        resume."""
        rec, resume = self.recovery, self.t.resume
        if rec is not None:  # (partial recovery: its shards into files of local memory first)
            rec.start_resident(resume=resume, drawn=self.tables_drawn)
        # A rank with its own recovery snapshot (partial) reads its shards from it, and only
        # the dense part of the checkpoint.
        own = rec is not None and resume and rec.own_snapshot()
        found = self.checkpointer.restore_newest(dense_only=own) if resume else None
        if found is None and not self.tables_drawn and not own:  # (none passed its checks: the initial values)
            model.sparse.reset_parameters()
            self.tables_drawn = True
        step, path = found if found is not None else (0, None)
        self.saved_step = step if found is not None else None
        if rec is not None and resume:  # the run stopped under a rank
            checkpoint_step = found[0] if found is not None else None
            self.recovered = rec.restore(checkpoint_step)
            if self.recovered is not None:
                step = self.recovered["resumed_at_step"]
            rec.resumed(checkpoint_step=checkpoint_step or 0, step=step)
        if found is None and not step:
            return None
        if self.logger:  # records of steps after it, if a newer checkpoint was skipped
            self.logger.drop(lambda r: r["step"] > step)
        partial = self.recovered is not None and self.recovered["survivors"]
        where = f"partial recovery: the failed shards from {path or 'their initial values'}" if partial else str(path)
        return step, where

    # -- the loop ------------------------------------------------------------------------
    def start(self, loop) -> None:
        t = self.t
        if t.checkpoint_every == "auto" and t.save_checkpoints and loop.step < self.total_steps \
                and not self._restarted_interval():
            self.probe = IntervalProbe(first_step=loop.step, total_steps=self.total_steps)

    def after_step(self, loop, done: Done) -> None:
        if self.probe is not None:
            self.probe.record(done.step, done.seconds)
        if not self.may_save(done.step):  # early stopping: the last step's checkpoint follows its evaluation
            return
        if self._periodic_save_due(done.step):
            loop.save_checkpoint()
        if self.probe is not None and done.step == self.probe.at:
            self._choose_interval(loop)

    def may_save(self, step: int) -> bool:
        return self.t.save_checkpoints and (not self.t.early_stop or step < self.total_steps)

    def saves_at(self, step: int) -> bool:
        """A full checkpoint of ``step`` is saved (or follows: the probe's, or the run's final
        one), which saves every row: an incremental save there would be redundant."""
        if not self.t.save_checkpoints:
            return False
        return (self.saved_step == step or step >= self.total_steps
                or (self.may_save(step) and self.probe is not None and step == self.probe.at))

    def pause_at(self, step: int) -> int | None:
        stops = [next_multiple(step, self.every)] if self.every and self.t.save_checkpoints else []
        if self.probe is not None and self.probe.at > step:  # checkpoint_every=auto's measured save
            stops.append(self.probe.at)
        return min(stops, default=None)

    def finish(self, loop, end: End) -> None:
        if self.t.save_checkpoints and loop.step > 0 and self.saved_step != loop.step:
            loop.save_checkpoint()

    def close(self, loop) -> None:
        self.checkpointer.wait()  # (train.async_checkpoint: the last one published, or its error)

    def summary(self) -> dict:
        # Steps between checkpoints: the configured number, or auto's choice (mtbf_s, save_s,
        # step_s, steps, reason); None: the run ended before choosing.
        return {"checkpoint_interval": self.interval}

    # -- train.checkpoint_every=auto -------------------------------------------------------
    def _periodic_save_due(self, step: int) -> bool:
        """A checkpoint is due at this step by the interval. Under
        ``train.checkpoint_every=auto`` one due less than half an interval before the end is
        skipped (the run's final checkpoint follows): by the first-order model that chose the
        interval, a save pays only if the training after it, until the next save, is at least
        half an interval (its cost C against the work a failure there would lose, R T / MTBF,
        with T = sqrt(2 C MTBF))."""
        every = self.every
        if not every or step % every or self.saved_step == step:
            return False
        return not (self.t.checkpoint_every == "auto" and self.total_steps - step < every / 2)

    def _choose_interval(self, loop) -> None:
        """At the probe step: save a checkpoint (timed), then the Young/Daly interval from its
        seconds, the probe's step time and ``train.mtbf_hours``; with several ranks every
        rank takes rank 0's measurements and interval (one broadcast)."""
        deltas = self.deltas
        share = deltas.share_per_delta(loop.step) if deltas is not None else 1.0  # (before the save resets it)
        update = deltas.update_share() if deltas is not None else 1.0  # (the updates a delta saves)
        if self.saved_step != loop.step:  # (else an early-stopping best at this step: its time)
            loop.save_checkpoint()
        save_s, step_s = self.last_save_s, self.probe.step_s()
        if self.topo.job_size > 1:  # rank 0's measurements
            box = torch.tensor([save_s, step_s, share, update], dtype=torch.float64, device=self.topo.comm_device)
            dist.broadcast(box, group=self.topo.run_group, group_src=0)
            save_s, step_s, share, update = box.tolist()
        t = self.t
        mtbf_s = t.mtbf_hours * 3600.0
        self.probe = None
        # (parameter servers: a failure hits one of the N + P processes alike, and only a
        # server's loses anything, 1/P of the tables: 1/(N + P) expected, as N + P DES ranks)
        servers = self.checkpointer.servers
        processes = self.topo.group_size + (servers.num_ps if servers is not None else 0)
        if t.recovery == "partial" and processes > 1:
            inputs = {"save_s": save_s, "step_s": step_s, "mtbf_s": mtbf_s, "total_steps": self.total_steps,
                      "ranks": processes, "lost_fraction": t.lost_fraction,
                      "delta_steps": deltas.every if deltas is not None else 0, "delta_share": share,
                      "delta_update_share": update}
            self._take(partial_recovery_interval(**inputs))
            if deltas is not None:  # a replay's cost, measured on the next delta, chooses again
                deltas.time_next_read()
                self._replay_inputs = inputs
        else:
            self._take(young_daly_interval(save_s=save_s, step_s=step_s, mtbf_s=mtbf_s,
                                           total_steps=self.total_steps))

    def delta_saved(self) -> None:
        """Partial recovery with deltas, after a delta once the delta after the probe was
        read back (:meth:`ShardDeltas.time_next_read`, rank 0's): the interval again, with a
        replay priced at that read, scaled to the mean delta's rows, instead of a share of a
        save (:func:`~hybridrec.train.checkpointing.checkpoint_interval.partial_recovery_interval`)."""
        if self._replay_inputs is None:
            return
        replay_s = self.deltas.replay_seconds() or -1.0
        if self.topo.job_size > 1:  # rank 0's measurement
            box = torch.tensor([replay_s], dtype=torch.float64, device=self.topo.comm_device)
            dist.broadcast(box, group=self.topo.run_group, group_src=0)
            replay_s = box.item()
        if replay_s <= 0:  # not read back yet: at the next delta
            return
        inputs, self._replay_inputs = self._replay_inputs, None
        self._take(partial_recovery_interval(**inputs, replay_s=replay_s))

    def _take(self, choice: dict) -> None:
        """Train on with ``choice``'s interval; rank 0 keeps it for restarted ranks and says it.
        A choice that falls back to full recovery (partial recovery cannot keep
        ``train.lost_fraction`` at a cost below full's) ends partial recovery here."""
        self.every, self.interval = choice["steps"], choice
        self._fall_back(choice)
        if self.topo.lead:
            save_choice(self.run_dir, choice, self._inputs())
            print(f"checkpoint interval: every {choice['steps']:,} steps (train.checkpoint_every=auto, "
                  f"train.mtbf_hours={self.t.mtbf_hours:g}: {choice['reason']})", file=sys.stderr, flush=True)

    def _fall_back(self, choice: dict) -> None:
        if choice.get("fallback") == "full" and self.recovery is not None:
            self.recovery.fall_back(choice["fallback_reason"])

    def _inputs(self) -> dict:
        """The settings a checkpoint interval is chosen for (a kept choice serves the same)."""
        t = self.t
        return {"mtbf_hours": t.mtbf_hours, "recovery": t.recovery, "lost_fraction": t.lost_fraction,
                "shard_delta_every": t.shard_delta_every, "shard_delta_rows": t.shard_delta_rows,
                "shard_delta_hot": t.shard_delta_hot, "world_size": self.topo.job_size,
                "total_steps": self.total_steps}

    def _restarted_interval(self) -> bool:
        """Ranks the launcher started again after a failure take the interval chosen before
        it, if one was for these settings (rank 0's file; every rank takes its answer).
        True: taken, no probe."""
        if not elastic_restarts():
            return False
        choice = restarted_choice(self.run_dir, self._inputs()) if self.topo.lead else None
        if self.topo.job_size > 1:
            box = [choice]
            dist.broadcast_object_list(box, group=self.topo.run_group, group_src=0)
            choice = box[0]
        if choice is None:
            return False
        choice = {**choice, "reason": f"{choice['reason']} (chosen before the restart)"}
        self.every, self.interval = choice["steps"], choice
        self._fall_back(choice)
        if self.topo.lead:
            print(f"checkpoint interval: every {choice['steps']:,} steps, as chosen before the restart "
                  f"(train.checkpoint_every=auto)", file=sys.stderr, flush=True)
        return True


class RecoveryWatch(Part):
    """``train.recovery`` (several ranks): while training runs, a failure (an error, SIGTERM)
    keeps this rank's state (partial recovery's snapshot); incremental saves of the
    shards (``train.shard_delta_every``) between full checkpoints; what each recovery
    lost, in the summary."""

    absent: ClassVar[dict] = {"recovery": None}

    def __init__(self, recovery: Recovery, checkpoints: Checkpoints, *, logger: MetricLogger | None) -> None:
        self.recovery, self.checkpoints, self.logger = recovery, checkpoints, logger

    def running(self, loop):
        return self.recovery.watch(loop.step)

    def after_step(self, loop, done: Done) -> None:
        if not self.recovery.delta_due(done.step) or self.checkpoints.saves_at(done.step):
            return
        start = time.perf_counter()
        self.recovery.save_delta(done.step)  # (this rank's shards alone; written in the background)
        if self.logger:  # (the seconds it held training up: the failure-schedule benchmark's)
            self.logger.log(done.step, {"delta_seconds": time.perf_counter() - start}, split="checkpoint")
        self.checkpoints.delta_saved()  # (the previous delta's read-back is measured by now)

    def after_save(self, loop, step: int, seconds: float) -> None:
        self.recovery.checkpointed(step)  # (every row is saved: the shards' older deltas go)

    def close(self, loop) -> None:
        if self.recovery.deltas is not None:
            self.recovery.deltas.wait()  # (the obsolete deltas deleted while the run evaluated)

    def summary(self) -> dict:
        deltas = self.recovery.deltas
        return {"recovery": {"mode": self.recovery.mode, "events": read_events(self.checkpoints.run_dir),
                             "shard_deltas": deltas.saved if deltas is not None else None}}


def nothing_updating(step: int):
    """No part wraps a step's updates (see :meth:`Recovery.updating`)."""
    return contextlib.nullcontext()
