"""The loop's checkpoint part: when a run saves (a fixed interval, or
``train.checkpoint_every=auto``'s measured choice) and what it resumes from
(:mod:`hybridrec.train.loop.parts` for the protocol,
:mod:`hybridrec.train.checkpointing.checkpoint_interval` for the intervals' arithmetic). A
part that adds to the restore or to the interval's choice (partial recovery's,
:mod:`hybridrec.train.loop.recovery_part`) does so through :class:`CheckpointHooks`."""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist

from hybridrec.broadcast import rank0_value
from hybridrec.train.checkpointing.checkpoint_interval import (
    IntervalProbe,
    interval_settings,
    restarted_choice,
    save_choice,
    young_daly_interval,
)
from hybridrec.train.checkpointing.checkpointer import Checkpointer
from hybridrec.train.checkpointing.faults import elastic_restarts
from hybridrec.train.loop.parts import Done, End, Part, next_multiple


class CheckpointHooks:
    """What another part of the loop adds to the checkpoints' restore and to the choice of
    their interval (:class:`~hybridrec.train.loop.recovery_part.RecoveryPart`); by default
    nothing."""

    def before_restore(self, *, resume: bool, drawn: bool | None) -> bool:
        """Before the newest checkpoint is restored (``resume``: one is looked for; ``drawn``:
        :class:`Checkpoints`' ``tables_drawn``). True: restore only its dense part (the
        tables are this part's to restore)."""
        return False

    def after_restore(self, checkpoint_step: int | None, step: int, path) -> tuple[int, str]:
        """Resuming, after the newest checkpoint (of ``checkpoint_step``, at ``path``; None:
        none, ``step`` 0) was restored on every rank: the step training resumes at and where
        from, in words."""
        return step, str(path)

    def probe_measures(self, step: int) -> list[float]:
        """At ``train.checkpoint_every=auto``'s probe step ``step``, before its save: more
        numbers the interval is chosen from (every rank takes rank 0's, in the broadcast of
        the save's and the step's seconds)."""
        return []

    def choose_interval(self, *, save_s: float, step_s: float, mtbf_s: float, total_steps: int,
                        measured: list[float]) -> dict | None:
        """The interval from the probe's measurements (``measured``: :meth:`probe_measures`',
        rank 0's); None: Young/Daly's."""
        return None

    def interval_taken(self, choice: dict) -> None:
        """The run trains on with ``choice``'s interval (chosen now, or before a restart)."""


class Checkpoints(Part):
    """Saves and restores the run's checkpoints (:class:`Checkpointer`). Saves every
    ``train.checkpoint_every`` steps and at the end; with ``auto`` the interval is chosen
    at the probe step from a timed save, the probe's step time and ``train.mtbf_hours``
    (every rank takes rank 0's measurements), or taken from before a restart. ``hooks``
    add to the restore and to the interval's choice (:class:`CheckpointHooks`)."""

    def __init__(self, checkpointer: Checkpointer, t, *, total_steps: int, tables_drawn: bool | None,
                 hooks: CheckpointHooks | None = None) -> None:
        """``t``: the config's ``train`` section. ``tables_drawn`` False: the embedding
        tables were built as zeros for the run's checkpoint to overwrite; :meth:`restore`
        draws their initial values if no checkpoint is restored. None: the rank's shards
        were not even zeroed, for ``hooks`` to place first
        (:meth:`CheckpointHooks.before_restore`)."""
        self.checkpointer, self.t, self.total_steps = checkpointer, t, total_steps
        self.tables_drawn = tables_drawn
        self.hooks = hooks if hooks is not None else CheckpointHooks()
        every = t.checkpoint_every
        # Steps between checkpoints: the configured number, or auto's choice (mtbf_s, save_s,
        # step_s, steps, reason); None: auto, until the probe step's measured save chooses it
        # (every rank rank 0's choice).
        self.interval: dict | None = (
            None if every == "auto" else {"mtbf_s": None, "save_s": None, "step_s": None,
                                          "steps": every or None, "reason": f"train.checkpoint_every={every}"})
        self.probe: IntervalProbe | None = None  # auto: times the first steps and its save, until its checkpoint
        self.saved_step: int | None = None  # step of the newest checkpoint on disk

    @property
    def every(self) -> int:
        """Steps between checkpoints (0: only at the end; auto: until its choice)."""
        return (self.interval or {}).get("steps") or 0

    @property
    def run_dir(self):
        return self.checkpointer.run_dir

    @property
    def topo(self):
        return self.checkpointer.topo

    # -- saving and restoring ---------------------------------------------------------
    def save(self, step: int) -> Path:
        return self.checkpointer.save(step)

    def after_save(self, loop, step: int, seconds: float) -> None:
        self.saved_step = step
        if self.probe is not None:  # (the probe step's save: what the interval is chosen from)
            self.probe.save_s = seconds
        if loop.logger:  # (the seconds a run spends saving: the failure-schedule benchmark's)
            loop.logger.log(step, {"save_seconds": seconds}, split="checkpoint")

    def restore(self, loop) -> tuple[int, str] | None:
        """Restore the newest checkpoint that passes its checks (newer ones that fail are
        renamed aside, with a warning each) into ``loop``'s model; ``(step, where from)``, or
        None: nothing to resume."""
        resume = self.t.resume
        # (a hook may restore the tables itself: then only the checkpoint's dense part)
        dense_only = self.hooks.before_restore(resume=resume, drawn=self.tables_drawn)
        found = self.checkpointer.restore_newest(dense_only=dense_only) if resume else None
        if found is None and not self.tables_drawn and not dense_only:  # (none passed its checks: the initial values)
            loop.model.sparse.reset_parameters()
            self.tables_drawn = True
        step, path = found if found is not None else (0, None)
        self.saved_step = step if found is not None else None
        where = str(path)
        if resume:
            step, where = self.hooks.after_restore(found[0] if found is not None else None, step, path)
        if found is None and not step:
            return None
        if loop.logger:  # records of steps after it, if a newer checkpoint was skipped
            loop.logger.drop(lambda r: r["step"] > step)
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
        seconds, the probe's step time and ``train.mtbf_hours``, unless a hook chooses another
        (:meth:`CheckpointHooks.choose_interval`); with several ranks every rank takes rank
        0's measurements and interval (one broadcast)."""
        measured = self.hooks.probe_measures(loop.step)  # (before the save, which may reset what they count)
        if self.saved_step != loop.step:  # (else an early-stopping best at this step: its time)
            loop.save_checkpoint()
        save_s, step_s = self.probe.save_s, self.probe.step_s()
        if self.topo.job_size > 1:  # rank 0's measurements
            box = torch.tensor([save_s, step_s, *measured], dtype=torch.float64, device=self.topo.comm_device)
            dist.broadcast(box, group=self.topo.run_group, group_src=0)
            save_s, step_s, *measured = box.tolist()
        mtbf_s = self.t.mtbf_hours * 3600.0
        self.probe = None
        choice = self.hooks.choose_interval(save_s=save_s, step_s=step_s, mtbf_s=mtbf_s,
                                            total_steps=self.total_steps, measured=measured)
        self.take(choice if choice is not None else
                  young_daly_interval(save_s=save_s, step_s=step_s, mtbf_s=mtbf_s, total_steps=self.total_steps))

    def take(self, choice: dict) -> None:
        """Train on with ``choice``'s interval (the probe's, or a hook's later one); rank 0
        keeps it for restarted ranks and says it."""
        self.interval = choice
        self.hooks.interval_taken(choice)
        if self.topo.lead:
            save_choice(self.run_dir, choice, self._settings())
            print(f"checkpoint interval: every {choice['steps']:,} steps (train.checkpoint_every=auto, "
                  f"train.mtbf_hours={self.t.mtbf_hours:g}: {choice['reason']})", file=sys.stderr, flush=True)

    def _settings(self) -> dict:
        """The settings a checkpoint interval is chosen for (a kept choice serves the same)."""
        return interval_settings(self.t, world_size=self.topo.job_size, total_steps=self.total_steps)

    def _restarted_interval(self) -> bool:
        """Ranks the launcher started again after a failure take the interval chosen before
        it, if one was for these settings (rank 0's file; every rank takes its answer).
        True: taken, no probe."""
        if not elastic_restarts():
            return False
        choice = restarted_choice(self.run_dir, self._settings()) if self.topo.lead else None
        if self.topo.job_size > 1:
            choice = rank0_value(choice, self.topo.run_group, device=self.topo.comm_device)
        if choice is None:
            return False
        choice = {**choice, "reason": f"{choice['reason']} (chosen before the restart)"}
        self.interval = choice
        self.hooks.interval_taken(choice)
        if self.topo.lead:
            print(f"checkpoint interval: every {choice['steps']:,} steps, as chosen before the restart "
                  f"(train.checkpoint_every=auto)", file=sys.stderr, flush=True)
        return True
