"""The training loop: step, evaluate, fit; metrics, checkpoints and summary.json."""

from __future__ import annotations

import contextlib
import json
import math
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
from tqdm import tqdm

from hybridrec.comm.ledger import CommLedger
from hybridrec.metrics.classification import RunningLoss
from hybridrec.metrics.logger import MetricLogger
from hybridrec.metrics.throughput import RunTotals, Throughput
from hybridrec.parallel.dense_sync import DenseSync
from hybridrec.parallel.topology import Topology
from hybridrec.sparse.keyed_jagged import Batch
from hybridrec.sync.runners import SyncRunner
from hybridrec.train.checkpoint_interval import (
    IntervalProbe,
    partial_recovery_interval,
    restarted_choice,
    save_choice,
    young_daly_interval,
)
from hybridrec.train.checkpointer import Checkpointer
from hybridrec.train.config import Config
from hybridrec.train.early_stop import EarlyStopping
from hybridrec.train.faults import FailureInjector
from hybridrec.train.hogwild import HogwildWorkers
from hybridrec.train.optim import LRScheduler
from hybridrec.train.pipeline import TrainPipeline
from hybridrec.train.recovery import Recovery, elastic_restarts
from hybridrec.train.sparse_optim import CombinedSparseOptimizer
from hybridrec.train.thread_governor import ThreadGovernor
from hybridrec.train.step import evaluate_model, training_step


@dataclass
class FitResult:
    step: int
    eval_metrics: dict
    train_loss: float
    throughput: dict
    resumed_from: int | None = None
    history: list[dict] = field(default_factory=list)


class Trainer:
    """Owns one run and every stateful part of it: model, dense and sparse optimizers, the
    dense synchronization (and its compressor state), the loader position (through the
    pipeline), the RNG; one :class:`~hybridrec.train.checkpointer.Checkpointer` saves
    and restores them as a list.

    Constructed by :func:`hybridrec.train.build.build_trainer`; it stores what it
    is given and does no set-up of its own.
    """

    resumed_path: Path | None = None
    """The checkpoint :meth:`maybe_resume` restored (None: started from scratch)."""

    def __init__(
        self,
        *,
        cfg: Config,
        model: torch.nn.Module,
        dense_opt: torch.optim.Optimizer,
        sparse_opt: CombinedSparseOptimizer,
        dense_sync: DenseSync,
        scheduler: LRScheduler,
        pipeline: TrainPipeline,
        eval_loader,
        checkpointer: Checkpointer,
        logger: MetricLogger | None,
        ledger: CommLedger,
        run_dir: Path,
        total_steps: int,
        topo: Topology,
        sync_runner: SyncRunner | None = None,
        totals: RunTotals | None = None,
        early_stop: EarlyStopping | None = None,
        kernels: dict | None = None,
        recovery: Recovery | None = None,
        tables_drawn: bool | None = True,
        threads: ThreadGovernor | None = None,
    ) -> None:
        """``tables_drawn`` False: the embedding tables were built as zeros for the run's
        checkpoint to overwrite; :meth:`maybe_resume` draws their initial values if no
        checkpoint is restored. None: the rank's shards were not even zeroed, for
        ``recovery`` to move into files of local memory first (:meth:`Recovery.start_resident`)."""
        self.cfg = cfg
        self.model = model
        self.dense_opt = dense_opt
        self.sparse_opt = sparse_opt
        self.dense_sync = dense_sync
        self.scheduler = scheduler
        self.pipeline = pipeline
        self.eval_loader = eval_loader
        self.checkpointer = checkpointer
        self.logger = logger
        self.ledger = ledger
        self.run_dir = run_dir
        self.total_steps = total_steps
        self.topo = topo
        self.sync_runner = sync_runner
        # Samples and training seconds over every invocation of the run (a checkpointed
        # component; None: not kept). The run's start is set by whoever starts it (run.train).
        self.totals = totals
        # train.early_stop: counts evaluations without an AUC improvement (a checkpointed
        # component; None: off).
        self.early_stop = early_stop
        self.kernels = kernels  # the MLPs' linear implementations and why (summary.json)
        # train.recovery: the survivors' snapshots (partial) and what a recovery lost (None: off).
        self.recovery = recovery
        self.recovered: dict | None = None  # this invocation's recovery (Recovery.restore's record)
        self.tables_drawn = tables_drawn
        self.threads = threads  # train.threads=0: the step's thread count, chosen by timing steps
        self.step = 0
        self._saved_step: int | None = None  # step of the newest checkpoint on disk
        every = cfg.train.checkpoint_every
        # Steps between checkpoints (0: only at the end); train.checkpoint_every=auto: 0 until
        # the probe step's measured save chooses it (every rank rank 0's choice).
        self.checkpoint_every = every if isinstance(every, int) else 0
        self.checkpoint_interval: dict | None = (
            None if every == "auto" else {"mtbf_s": None, "save_s": None, "step_s": None,
                                          "steps": every or None, "reason": f"train.checkpoint_every={every}"})
        self.probe: IntervalProbe | None = None  # auto: times the first steps, until its checkpoint
        # auto, partial recovery with deltas: the probe's inputs, until a delta's measured
        # read-back chooses again (_replay_interval)
        self._replay_probe: dict | None = None
        self.last_save_s = 0.0  # seconds the newest save_checkpoint took

    # -- one step --------------------------------------------------------------
    def train_step(self, batch: Batch, pending=None) -> torch.Tensor:
        """The learning rate of this step, then :func:`training_step`."""
        self.scheduler.apply(self.step)
        loss = training_step(self.model, batch, dense_opt=self.dense_opt, sparse_opt=self.sparse_opt,
                             dense_sync=self.dense_sync, pending=pending,
                             updating=self.recovery.updating(self.step + 1) if self.recovery is not None else None)
        self.step += 1
        if self.sync_runner is not None:  # a foreground round, or a background target written back
            self.sync_runner.after_step(self.step)
        self.ledger.step_end()
        return loss

    def evaluate(self) -> dict:
        with self.ledger.suspended():  # evaluation traffic is not a training step's
            return evaluate_model(self.model, self.eval_loader, self.topo)

    # -- state -----------------------------------------------------------------
    def save_checkpoint(self) -> Path:
        start = time.perf_counter()
        with self.sync_runner.parked() if self.sync_runner is not None else contextlib.nullcontext():
            path = self.checkpointer.save(self.step)
        if self.recovery is not None:  # (every row is saved: the shards' older deltas go)
            self.recovery.checkpointed(self.step)
        self._saved_step, self.last_save_s = self.step, time.perf_counter() - start
        if self.logger:  # (the seconds a run spends saving: the failure-schedule benchmark's)
            self.logger.log(self.step, {"save_seconds": self.last_save_s}, split="checkpoint")
        return path

    def maybe_resume(self) -> int | None:
        """Restore the newest checkpoint that passes its checks (newer ones that fail are
        renamed aside, with a warning each); None: nothing to resume."""
        if self.recovery is not None:  # (partial recovery: its shards into files of local memory first)
            self.recovery.start_resident(resume=self.cfg.train.resume, drawn=self.tables_drawn)
        # A rank with its own recovery snapshot (partial) reads its shards from it, and only
        # the dense part of the checkpoint.
        own = self.recovery is not None and self.cfg.train.resume and self.recovery.own_snapshot()
        found = self.checkpointer.restore_newest(dense_only=own) if self.cfg.train.resume else None
        if found is None and not self.tables_drawn and not own:  # (none passed its checks: the initial values)
            self.model.sparse.reset_parameters()
            self.tables_drawn = True
        if found is not None:
            self.step, self.resumed_path = found
            self._saved_step = self.step
        if self.recovery is not None and self.cfg.train.resume:  # the run stopped under a rank
            checkpoint_step = found[0] if found is not None else None
            self.recovered = self.recovery.restore(checkpoint_step)
            if self.recovered is not None:
                self.step = self.recovered["resumed_at_step"]
            self.recovery.resumed(checkpoint_step=checkpoint_step or 0, step=self.step)
        if found is None and not self.step:
            return None
        if self.logger:  # records of steps after it, if a newer checkpoint was skipped
            self.logger.drop(lambda r: r["step"] > self.step)
        return self.step

    # -- the loop --------------------------------------------------------------
    def fit(self) -> FitResult:
        t = self.cfg.train
        lead = self.topo.lead
        resumed = self.maybe_resume()
        if resumed is not None and lead:
            partial = self.recovered is not None and self.recovered["survivors"]
            where = (f"partial recovery: the failed shards from {self.resumed_path or 'their initial values'}"
                     if partial else self.resumed_path)
            print(f"resumed from step {resumed} ({where})", file=sys.stderr, flush=True)
        first_step = self.step
        injector = FailureInjector(t.inject_failure, rank=self.topo.global_rank, run_dir=self.run_dir)
        if t.checkpoint_every == "auto" and t.save_checkpoints and self.step < self.total_steps \
                and not self._restarted_interval():
            self.probe = IntervalProbe(first_step=self.step, total_steps=self.total_steps)
        running = RunningLoss()
        meter = Throughput(warmup=min(5, max(0, self.total_steps // 10)), totals=self.totals)
        history: list[dict] = []
        tty = sys.stderr.isatty()
        show = t.progress and tty and lead
        bar = tqdm(total=self.total_steps, initial=self.step, unit="step", dynamic_ncols=True,
                   disable=not show, desc="train")
        lines = (ProgressLines(self.total_steps, self.step, t.log_interval_s)
                 if t.progress and not tty and lead and t.log_interval_s > 0 else None)
        if self.sync_runner is not None:
            self.sync_runner.start()
        # (partial recovery: if the run stops under this rank from here on, its state is kept)
        with self.recovery.watch(self.step) if self.recovery is not None else contextlib.nullcontext():
            meter.start()
            # stopped_early: this invocation stopped at an evaluation (train.early_stop)
            stopped_early, logged = self._loop(injector, running, meter, bar, lines, history)
            last_loss = logged if logged is not None else float("nan")
            bar.close()
            if stopped_early:
                self.pipeline.discard_ahead()  # (dist.pipeline: the next batch's ids are under way)
            self.sparse_opt.flush()  # parameter servers: this rank's last push applied
            if self.sync_runner is not None:  # last round, then one averaged dense model
                self.sync_runner.finish()
            if getattr(self.model.sparse, "remote", False) and self.topo.global_world_size > 1:
                dist.barrier(group=self.topo.run_group)  # every trainer's last push, before evaluating
            trained = self.step > first_step
            if trained and (not t.log_every or self.step % t.log_every):
                last_loss = self._log_train(running, meter, None)  # the steps since the last log
            if lines is not None and trained:
                lines.emit(self.step)
            if not trained and self.logger:
                # Nothing trained (a finished run evaluated again): its evaluation of this
                # step replaces the earlier one, and the loss is the last one logged.
                self.logger.drop(lambda r: r["split"] == "eval" and r["step"] == self.step)
                last_loss = _last_train_loss(self.logger.path)
            final = None
            if stopped_early:  # the evaluation that stopped training is the final one ...
                final = history.pop()
                if self.sync_runner is not None or getattr(self.model.sparse, "remote", False):
                    # ... unless the replicas were averaged or the pushes landed since: again
                    if self.logger:
                        self.logger.drop(lambda r: r["split"] == "eval" and r["step"] == self.step)
                    final = None
            elif self.early_stop is not None:  # evaluated first: the final checkpoint knows if it is the best
                final = self._eval_and_log()
                self.early_stop.update(self.step, final)
            if t.save_checkpoints and self.step > 0 and self._saved_step != self.step:
                self.save_checkpoint()
            if final is None:
                final = self._eval_and_log()
            self.checkpointer.wait()  # (train.async_checkpoint: the last one published, or its error)
            if self.recovery is not None and self.recovery.deltas is not None:
                self.recovery.deltas.wait()  # (the obsolete deltas deleted while the run evaluated)
            if self.logger:
                self.logger.flush()
            return FitResult(self.step, final, last_loss, meter.summary(), resumed, history)

    def _loop(self, injector: FailureInjector, running: RunningLoss, meter: Throughput, bar, lines,
              history: list[dict]) -> tuple[bool, float | None]:
        """The steps with the loop's work between them (logging, evaluation, checkpoints);
        returns whether training stopped early and the last train loss logged (None: none)."""
        t = self.cfg.train
        last_loss = None
        idle_since = time.perf_counter()  # the end of the loop's own work after a step
        for loss, samples in self._train_steps():
            injector.after_step(self.step)  # train.inject_failure: dies here, before this step's checkpoint
            if self.probe is not None:
                self.probe.record(self.step, time.perf_counter() - idle_since)
            if self.threads is not None:
                self.threads.record(self.step, time.perf_counter() - idle_since)
            running.update(loss)
            meter.step(samples)
            bar.update(1)
            if lines is not None:
                lines.step(self.step, loss, samples)
            if t.log_every and self.step % t.log_every == 0:
                last_loss = self._log_train(running, meter, bar)
            if t.eval_every and self.step % t.eval_every == 0 and self.step < self.total_steps:
                history.append(self._eval_and_log())
                if self._early_stop(history[-1]):  # every rank: the same gathered AUC
                    return True, last_loss
                meter.start()  # evaluation time is not training time
            # early stopping: the last step's checkpoint is saved after its evaluation (below)
            may_save = self.early_stop is None or self.step < self.total_steps
            if may_save and t.save_checkpoints and self._periodic_save_due():
                self.save_checkpoint()
                meter.start()
            elif self.recovery is not None and self.recovery.delta_due(self.step) and not self._save_follows(may_save):
                start = time.perf_counter()
                self.recovery.save_delta(self.step)  # (this rank's shards alone; written in the background)
                if self.logger:  # (the seconds it held training up: the failure-schedule benchmark's)
                    self.logger.log(self.step, {"delta_seconds": time.perf_counter() - start}, split="checkpoint")
                if self._replay_probe is not None:  # (the previous delta's read-back is measured by now)
                    self._replay_interval()
            if may_save and self.probe is not None and self.step == self.probe.at:
                self._choose_checkpoint_interval()
                meter.start()
            idle_since = time.perf_counter()
        return False, last_loss

    def _train_steps(self) -> Iterator[tuple[torch.Tensor, int]]:
        """Trains the remaining steps; yields each one's loss and global samples after it
        (the loop's logging, evaluation and checkpoints run between two yields). With
        ``train.workers > 1`` the steps of the Hogwild threads, as they finish; they are
        all paused whenever the loop may evaluate or save (:mod:`hybridrec.train.hogwild`).
        Nothing when the run resumed has stopped early already (``train.early_stop``)."""
        if self.early_stop is not None and self.early_stop.stopped:
            return
        if self.cfg.train.workers > 1:
            yield from HogwildWorkers(self).steps()
            return
        while self.step < self.total_steps:
            for batch, pending in self.pipeline.batches(self.total_steps - self.step):
                loss = self.train_step(batch, pending)
                yield loss, batch.batch_size * self.topo.global_world_size  # global samples

    def _save_follows(self, may_save: bool) -> bool:
        """A full checkpoint of this step comes next (the probe's, or the run's final one),
        which saves every row: an incremental save now would be redundant."""
        if not self.cfg.train.save_checkpoints:
            return False
        return self.step >= self.total_steps or (may_save and self.probe is not None and self.step == self.probe.at)

    def _periodic_save_due(self) -> bool:
        """A checkpoint is due at this step by the interval. Under
        ``train.checkpoint_every=auto`` one due less than half an interval before the end is
        skipped (the run's final checkpoint follows): by the first-order model that chose the
        interval, a save pays only if the training after it, until the next save, is at least
        half an interval (its cost C against the work a failure there would lose, R T / MTBF,
        with T = sqrt(2 C MTBF))."""
        every = self.checkpoint_every
        if not every or self.step % every or self._saved_step == self.step:
            return False
        return not (self.cfg.train.checkpoint_every == "auto" and self.total_steps - self.step < every / 2)

    def _choose_checkpoint_interval(self) -> None:
        """``train.checkpoint_every=auto`` at the probe step: save a checkpoint (timed), then
        the Young/Daly interval from its seconds, the probe's step time and
        ``train.mtbf_hours`` (:mod:`hybridrec.train.checkpoint_interval`); with several
        ranks every rank takes rank 0's measurements and interval (one broadcast)."""
        deltas = self.recovery.deltas if self.recovery is not None else None
        share = deltas.share_per_delta(self.step) if deltas is not None else 1.0  # (before the save resets it)
        if self._saved_step != self.step:  # (else an early-stopping best at this step: its time)
            self.save_checkpoint()
        save_s, step_s = self.last_save_s, self.probe.step_s()
        if self.topo.global_world_size > 1:  # rank 0's measurements
            box = torch.tensor([save_s, step_s, share], dtype=torch.float64)
            dist.broadcast(box, group=self.topo.run_group, group_src=0)
            save_s, step_s, share = box.tolist()
        t = self.cfg.train
        mtbf_s = t.mtbf_hours * 3600.0
        self.probe = None
        if t.recovery == "partial" and self.topo.world_size > 1:
            inputs = dict(save_s=save_s, step_s=step_s, mtbf_s=mtbf_s, total_steps=self.total_steps,
                          ranks=self.topo.world_size, lost_fraction=t.lost_fraction,
                          delta_steps=deltas.every if deltas is not None else 0, delta_share=share)
            self._take_interval(partial_recovery_interval(**inputs))
            if deltas is not None:  # a replay's cost, measured on the next delta, chooses again
                deltas.time_next_read()
                self._replay_probe = inputs
        else:
            self._take_interval(young_daly_interval(save_s=save_s, step_s=step_s, mtbf_s=mtbf_s,
                                                    total_steps=self.total_steps))

    def _replay_interval(self) -> None:
        """Partial recovery with deltas, at a delta step once the delta after the probe was
        read back (:meth:`ShardDeltas.time_next_read`, rank 0's): the interval again, with a
        replay priced at that read, scaled to the mean delta's rows, instead of a share of a
        save (:func:`~hybridrec.train.checkpoint_interval.partial_recovery_interval`)."""
        deltas = self.recovery.deltas
        measured, replay_s = deltas.read_probe, -1.0
        if measured is not None and measured["rows"] > 0 and deltas.saved["deltas"]:
            mean_rows = deltas.saved["rows"] / deltas.saved["deltas"]
            replay_s = max(measured["seconds"] * mean_rows / measured["rows"], 1e-6)
        if self.topo.global_world_size > 1:  # rank 0's measurement
            box = torch.tensor([replay_s], dtype=torch.float64)
            dist.broadcast(box, group=self.topo.run_group, group_src=0)
            replay_s = box.item()
        if replay_s <= 0:  # not read back yet: at the next delta
            return
        inputs, self._replay_probe = self._replay_probe, None
        self._take_interval(partial_recovery_interval(**inputs, replay_s=replay_s))

    def _take_interval(self, choice: dict) -> None:
        """Train on with ``choice``'s interval; rank 0 keeps it for restarted ranks and says it."""
        self.checkpoint_every, self.checkpoint_interval = choice["steps"], choice
        if self.topo.lead:
            save_choice(self.run_dir, choice, self._interval_inputs())
            print(f"checkpoint interval: every {choice['steps']:,} steps (train.checkpoint_every=auto, "
                  f"train.mtbf_hours={self.cfg.train.mtbf_hours:g}: {choice['reason']})",
                  file=sys.stderr, flush=True)

    def _interval_inputs(self) -> dict:
        """The settings a checkpoint interval is chosen for (a kept choice serves the same)."""
        t = self.cfg.train
        return {"mtbf_hours": t.mtbf_hours, "recovery": t.recovery, "lost_fraction": t.lost_fraction,
                "shard_delta_every": t.shard_delta_every, "shard_delta_rows": t.shard_delta_rows,
                "shard_delta_hot": t.shard_delta_hot, "world_size": self.topo.global_world_size,
                "total_steps": self.total_steps}

    def _restarted_interval(self) -> bool:
        """``train.checkpoint_every=auto`` in ranks the launcher started again after a
        failure: take the interval chosen before it, if one was for these settings (rank
        0's file; every rank takes its answer). True: taken, no probe."""
        if not elastic_restarts():
            return False
        choice = restarted_choice(self.run_dir, self._interval_inputs()) if self.topo.lead else None
        if self.topo.global_world_size > 1:
            box = [choice]
            dist.broadcast_object_list(box, group=self.topo.run_group, group_src=0)
            choice = box[0]
        if choice is None:
            return False
        choice = {**choice, "reason": f"{choice['reason']} (chosen before the restart)"}
        self.checkpoint_every, self.checkpoint_interval = choice["steps"], choice
        if self.topo.lead:
            print(f"checkpoint interval: every {choice['steps']:,} steps, as chosen before the restart "
                  f"(train.checkpoint_every=auto)", file=sys.stderr, flush=True)
        return True

    def _early_stop(self, metrics: dict) -> bool:
        """Count an evaluation for ``train.early_stop``: a new best AUC is saved at once (the
        checkpoint kept as the run's best); True when training stops here. Every rank
        decides alike: ``metrics`` come from every rank's gathered predictions, and rank 0's
        AUC is broadcast (one float64), so that even machines whose floating point differs
        apply the same number and stop at the same step."""
        es = self.early_stop
        if es is None:
            return False
        if self.topo.global_world_size > 1:
            auc = metrics.get("auc")
            box = torch.tensor([float("nan") if auc is None else float(auc)], dtype=torch.float64)
            dist.broadcast(box, group=self.topo.run_group, group_src=0)
            metrics = {**metrics, "auc": box.item()}
        if es.update(self.step, metrics) and self.cfg.train.save_checkpoints:
            self.save_checkpoint()
        return es.stopped

    def _log_train(self, running: RunningLoss, meter: Throughput, bar) -> float:
        values = running.compute()
        values.update(lr_scale=self.scheduler.schedule.factor(max(0, self.step - 1)),
                      samples_per_sec=meter.samples_per_sec())
        if self.logger:
            self.logger.log(self.step, values, split="train")
        if bar is not None:
            bar.set_postfix(loss=f"{values['loss']:.4f}")
        return values["loss"]

    def _eval_and_log(self) -> dict:
        start = time.perf_counter()
        m = self.evaluate()
        m["eval_seconds"] = time.perf_counter() - start
        if self.logger:
            self.logger.log(self.step, m, split="eval")
        return {"step": self.step, **m}


def _last_train_loss(path: Path) -> float:
    loss = float("nan")
    try:
        for line in path.read_text(encoding="utf-8").splitlines():
            try:
                r = json.loads(line)
            except ValueError:
                continue
            if r.get("split") == "train" and r.get("loss") is not None:
                loss = float(r["loss"])
    except OSError:
        pass
    return loss


class ProgressLines:
    """Progress for a stream that is not a terminal (a log file, a pipe): a plain line
    every ``interval_s`` seconds, ``step 120/1,171 (10%)  90,123 samples/s  loss 0.4521
    ETA 0:01:23``. Samples/s and loss are over the steps since the previous line; the
    ETA is the remaining steps at this invocation's mean time per step so far."""

    def __init__(self, total: int, first_step: int, interval_s: float, stream=None) -> None:
        self.total, self.first_step, self.interval_s = total, first_step, interval_s
        self.stream = stream
        self._start = self._last = time.monotonic()
        self._samples = 0
        self._loss = RunningLoss()
        self._emitted = first_step

    def step(self, step: int, loss: torch.Tensor, samples: int) -> None:
        self._samples += samples
        self._loss.update(loss)
        if time.monotonic() - self._last >= self.interval_s:
            self.emit(step)

    def emit(self, step: int) -> None:
        """A line now (nothing when ``step`` has had its line already)."""
        if step == self._emitted:
            return
        self._emitted = step
        now = time.monotonic()
        rate = self._samples / (now - self._last) if now > self._last else float("nan")
        loss = self._loss.compute()["loss"]
        done, left = step - self.first_step, self.total - step
        eta = (now - self._start) / done * left if done > 0 else float("nan")
        pct = 100.0 * step / self.total if self.total else 100.0
        print(f"step {step:,}/{self.total:,} ({pct:.0f}%)  {_num(rate, '{:,.0f}')} samples/s  "
              f"loss {_num(loss, '{:.4f}')}  ETA {_duration(eta)}",
              file=self.stream or sys.stderr, flush=True)
        self._last, self._samples = now, 0


def _num(value: float, fmt: str) -> str:
    return fmt.format(value) if math.isfinite(value) else "n/a"


def _duration(seconds: float) -> str:
    if not math.isfinite(seconds):
        return "n/a"
    s = round(seconds)
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}"
