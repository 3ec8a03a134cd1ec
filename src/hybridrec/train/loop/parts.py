"""The training loop's parts: every concern of a run besides the steps themselves.

:class:`~hybridrec.train.loop.trainer.Trainer` is a short loop over finished steps and a list
of parts; each part owns its state (and its checkpointed state, through the checkpointer's
components) and acts through one small protocol, :class:`Part`:

- ``running(loop)``: a context around the whole training (partial recovery's watch of a
  failure);
- ``start(loop)``: training starts at ``loop.step`` (after a resume); True: there is
  nothing to train (a resumed run that had stopped early);
- ``end_step(loop, step)``: the closing work *of* a step, counted in its time and bytes
  (a foreground sync round);
- ``after_step(loop, done)``: the loop's work between two steps (logging, evaluation,
  checkpoints), in the list's order; True: training stops here (early stopping);
- ``pause_at(step)``: the next step after ``step`` at which this part acts with every
  Hogwild thread stopped (an evaluation, a checkpoint), or None;
- ``saving(loop)``: a context around every full checkpoint (the sync thread parked), then
  ``after_save(loop, step, seconds)``;
- ``after_evaluate(loop)``: an evaluation ran (its time is not training time);
- ``finish(loop, end)``: training ended (last sync round, last log line, early stopping's
  evaluation), before the final checkpoint; ``close(loop)`` after it (the final
  evaluation, waiting for background writes);
- ``summary()``: this part's entries of summary.json, under their names there; a
  run without the part has its class's ``absent`` entries instead (``{"sync": None}``),
  so summary.json has the same keys whatever the run (:func:`summary_entries` merges
  them, :func:`hybridrec.train.summary.run_summary` writes them). A part that reports a
  number is one class: its hooks and its ``summary()``.

The order of the list is the order of every hook (:func:`hybridrec.train.build.build_trainer`
makes it). A way of producing steps (one thread, Hogwild's threads, a parameter-server
trainer) is a part too, with :meth:`StepSource.steps`.
"""

from __future__ import annotations

import contextlib
import json
import math
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import torch
import torch.distributed as dist
from tqdm import tqdm

from hybridrec.metrics.classification import RunningLoss
from hybridrec.metrics.logger import MetricLogger
from hybridrec.metrics.throughput import RunTotals, Throughput
from hybridrec.train.checkpointing.faults import FailureInjector
from hybridrec.train.loop.early_stop import EarlyStopping
from hybridrec.train.loop.step import evaluate_model
from hybridrec.train.setup.rules import STREAM_STEPS


@dataclass(frozen=True)
class Done:
    """A finished step: its number (the loop's step after it), loss, global samples, and
    the seconds it took (the loop's own work between steps excluded)."""
    step: int
    loss: torch.Tensor
    samples: int
    seconds: float


@dataclass(frozen=True)
class End:
    """How training ended: ``stopped_early`` at an evaluation (``train.early_stop``);
    ``trained``: at least one step in this invocation."""
    stopped_early: bool
    trained: bool


class Part:
    """One concern of the loop (module docstring); every hook does nothing by default."""

    absent: ClassVar[dict] = {}  # summary.json's entries of a run without this part

    def running(self, loop) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def start(self, loop) -> bool | None:
        pass

    def end_step(self, loop, step: int) -> None:
        pass

    def after_step(self, loop, done: Done) -> bool | None:
        pass

    def pause_at(self, step: int) -> int | None:
        return None

    def saving(self, loop) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def after_save(self, loop, step: int, seconds: float) -> None:
        pass

    def after_evaluate(self, loop) -> None:
        pass

    def finish(self, loop, end: End) -> None:
        pass

    def close(self, loop) -> None:
        pass

    def summary(self) -> dict:
        return {}


def merge_entries(base: dict, entries: dict) -> dict:
    """``base`` with ``entries`` over it; where both hold a dict under one key, the two
    dicts merged (one level: a part adds ``{"kernels": {"threads": ...}}`` to the run's
    ``kernels``)."""
    out = dict(base)
    for key, value in entries.items():
        old = out.get(key)
        out[key] = {**old, **value} if isinstance(old, dict) and isinstance(value, dict) else value
    return out


def summary_entries(parts: list[Part]) -> dict:
    """Every part's summary entries, in the list's order, over the ``absent`` entries of
    every part class (those of the parts this run has not: their keys are in summary.json
    too)."""
    out: dict = {}
    for cls in _part_classes(Part):
        out = merge_entries(out, cls.absent)
    for part in parts:
        out = merge_entries(out, part.summary())
    return out


def _part_classes(cls: type) -> list[type]:
    """``cls`` and its subclasses (every imported part class), parents first."""
    return [cls, *(c for sub in cls.__subclasses__() for c in _part_classes(sub))]


def next_multiple(step: int, every: int) -> int:
    return (step // every + 1) * every


class Progress(Part):
    """Train loss and throughput: the progress bar (a terminal) or plain lines (a log),
    ``train`` records every ``train.log_every`` steps, and the run's totals over every
    invocation (a checkpointed component, :class:`RunTotals`)."""

    def __init__(self, *, total_steps: int, log_every: int, show: bool, tty: bool, log_interval_s: float,
                 logger: MetricLogger | None, totals: RunTotals, lr_factor: Callable[[int], float]) -> None:
        self.total_steps, self.log_every, self.logger = total_steps, log_every, logger
        self.show, self.tty, self.log_interval_s = show, tty, log_interval_s
        self.totals, self.lr_factor = totals, lr_factor
        self.loss = RunningLoss()
        self.meter = Throughput(warmup=min(5, max(0, total_steps // 10)), totals=totals)
        self.bar = None
        self.lines: ProgressLines | None = None
        self.last_loss: float | None = None  # the last train loss logged
        self.status = None

    def start(self, loop) -> None:
        total = self.total_steps if self.total_steps < STREAM_STEPS else None  # (a stream: no end known)
        self.status = getattr(loop.source, "status", None)  # (a stream's files done and waiting)
        self.bar = tqdm(total=total, initial=loop.step, unit="step", dynamic_ncols=True,
                        disable=not (self.show and self.tty), desc="train")
        if self.show and not self.tty and self.log_interval_s > 0:
            self.lines = ProgressLines(total, loop.step, self.log_interval_s, status=self.status)
        self.meter.start()

    def after_step(self, loop, done: Done) -> None:
        self.loss.update(done.loss)
        self.meter.step(done.samples)
        self.bar.update(1)
        if self.status is not None and done.step % 20 == 0 and self.show and self.tty:
            self.bar.set_postfix_str(self.status(), refresh=False)
        if self.lines is not None:
            self.lines.step(done.step, done.loss, done.samples)
        if self.log_every and done.step % self.log_every == 0:
            self._log(done.step, self.bar)

    def after_save(self, loop, step: int, seconds: float) -> None:
        self.meter.start()  # saving is not training time

    def after_evaluate(self, loop) -> None:
        self.meter.start()

    def finish(self, loop, end: End) -> None:
        self.bar.close()
        if end.trained and (not self.log_every or loop.step % self.log_every):
            self._log(loop.step, None)  # the steps since the last log
        if self.lines is not None and end.trained:
            self.lines.emit(loop.step)
        if not end.trained and self.logger:  # a finished run evaluated again: its last loss logged
            self.last_loss = _last_train_loss(self.logger.path)

    def summary(self) -> dict:
        return {"train_loss": self.last_loss if self.last_loss is not None else float("nan"),
                "throughput": self.meter.summary(), "run": self.totals.summary()}

    def _log(self, step: int, bar) -> None:
        values = self.loss.compute()
        values.update(lr_scale=self.lr_factor(max(0, step - 1)), samples_per_sec=self.meter.samples_per_sec())
        if self.logger:
            self.logger.log(step, values, split="train")
        if bar is not None:
            bar.set_postfix(loss=f"{values['loss']:.4f}")
        self.last_loss = values["loss"]


class Evaluation(Part):
    """Held-out evaluation every ``train.eval_every`` steps and at the end, and early
    stopping (``train.early_stop``, :class:`EarlyStopping`: a new best AUC is saved at
    once; training stops after the patience). Every rank decides alike: the metrics come
    from every rank's gathered predictions, and rank 0's AUC is broadcast (one float64),
    so that even machines whose floating point differs apply the same number and stop
    at the same step."""

    def __init__(self, eval_loader, *, eval_every: int, total_steps: int, early_stop: EarlyStopping | None,
                 save_best: bool, changes_after_stop: bool, logger: MetricLogger | None) -> None:
        """``changes_after_stop``: the model changes after the last step (replicas averaged,
        pushes landing on servers), so the evaluation that stopped training is done again."""
        self.loader, self.every, self.total_steps = eval_loader, eval_every, total_steps
        self.early_stop, self.save_best = early_stop, save_best
        self.changes_after_stop, self.logger = changes_after_stop, logger
        self.history: list[dict] = []
        self.final: dict | None = None

    def evaluate(self, loop) -> dict:
        with loop.ledger.suspended():  # evaluation traffic is not a training step's
            return evaluate_model(loop.model, self.loader, loop.topo)

    def start(self, loop) -> bool:
        return self.early_stop is not None and self.early_stop.stopped  # (a resumed run that had stopped)

    def after_step(self, loop, done: Done) -> bool | None:
        if not self.every or done.step % self.every or done.step >= self.total_steps:
            return None
        self.history.append(self._eval_and_log(loop))
        if self._early_stop(loop, self.history[-1]):
            return True
        loop.evaluated()
        return None

    def pause_at(self, step: int) -> int | None:
        return next_multiple(step, self.every) if self.every else None

    def finish(self, loop, end: End) -> None:
        if not end.trained:  # this evaluation of the step replaces the earlier one
            self._drop(loop.step)
        if end.stopped_early:  # the evaluation that stopped training is the final one ...
            self.final = self.history.pop()
            if self.changes_after_stop:  # ... unless the model changed since: again
                self._drop(loop.step)
                self.final = None
        elif self.early_stop is not None:  # evaluated first: the final checkpoint knows if it is the best
            self.final = self._eval_and_log(loop)
            self.early_stop.update(loop.step, self.final)

    def close(self, loop) -> None:
        if self.final is None:
            self.final = self._eval_and_log(loop)

    def summary(self) -> dict:
        return {"eval": self.final, "eval_history": self.history}

    def _drop(self, step: int) -> None:
        if self.logger:
            self.logger.drop(lambda r: r["split"] == "eval" and r["step"] == step)

    def _early_stop(self, loop, metrics: dict) -> bool:
        es = self.early_stop
        if es is None:
            return False
        if loop.topo.job_size > 1:
            auc = metrics.get("auc")
            box = torch.tensor([float("nan") if auc is None else float(auc)], dtype=torch.float64,
                               device=loop.topo.comm_device)
            dist.broadcast(box, group=loop.topo.run_group, group_src=0)
            metrics = {**metrics, "auc": box.item()}
        if es.update(loop.step, metrics) and self.save_best:
            loop.save_checkpoint()
        return es.stopped

    def _eval_and_log(self, loop) -> dict:
        start = time.perf_counter()
        m = self.evaluate(loop)
        m["eval_seconds"] = time.perf_counter() - start
        if self.logger:
            self.logger.log(loop.step, m, split="eval")
        return {"step": loop.step, **m}


class StopEarly(Part):
    """Early stopping's summary entries (the part that stops is :class:`Evaluation`)."""

    absent: ClassVar[dict] = {"stop_reason": "planned_steps", "early_stop": None}

    def __init__(self, early_stop: EarlyStopping, *, total_steps: int, run_dir: Path, saved: bool) -> None:
        self.early_stop, self.total_steps, self.run_dir, self.saved = early_stop, total_steps, run_dir, saved
        self._step = 0

    def close(self, loop) -> None:
        self._step = loop.step

    def summary(self) -> dict:
        es = self.early_stop
        return {"stop_reason": "early_stop" if es.stopped else "planned_steps",
                "early_stop": es.summary(self._step, self.total_steps, self.run_dir, saved=self.saved)}


class FailureInjection(Part):
    """``train.inject_failure``: this rank dies after its scheduled steps, before the
    step's checkpoint."""

    def __init__(self, spec: str, *, rank: int, run_dir: Path) -> None:
        self.spec, self.rank, self.run_dir = spec, rank, run_dir
        self.injector: FailureInjector | None = None

    def start(self, loop) -> None:
        self.injector = FailureInjector(self.spec, rank=self.rank, run_dir=self.run_dir)

    def after_step(self, loop, done: Done) -> None:
        self.injector.after_step(done.step)


class ThreadTiming(Part):
    """``train.threads=0``: the step's thread count, chosen by timing steps
    (:class:`~hybridrec.train.loop.thread_governor.ThreadGovernor`)."""

    def __init__(self, governor) -> None:
        self.governor = governor

    def after_step(self, loop, done: Done) -> None:
        self.governor.record(done.step, done.seconds)

    def summary(self) -> dict:  # (the thread count chosen: with the run's kernels)
        return {"kernels": {"threads": t}} if (t := self.governor.summary()) else {}


class Sync(Part):
    """The synchronizer of dense replicas (MA / EASGD / BMUF, foreground or background):
    started with training, a round (or a background target written back) closing each
    step, parked while a checkpoint is saved, its last round at the end."""

    absent: ClassVar[dict] = {"sync": None}  # rounds and the sync gap of this rank's synchronizer

    def __init__(self, runner) -> None:
        self.runner = runner

    def start(self, loop) -> None:
        self.runner.start()

    def end_step(self, loop, step: int) -> None:
        self.runner.after_step(step)

    def saving(self, loop):
        return self.runner.parked()

    def finish(self, loop, end: End) -> None:
        self.runner.finish()  # last round, then one averaged dense model

    def summary(self) -> dict:
        return {"sync": self.runner.summary()}


class StepSource(Part):
    """One thread's steps: the pipeline's batches, one :meth:`Trainer.train_step` each."""

    def __init__(self, pipeline) -> None:
        self.pipeline = pipeline

    def steps(self, loop) -> Iterator[tuple[torch.Tensor, int]]:
        """Trains the remaining steps; yields each one's loss and global samples after it
        (the loop's work runs between two yields)."""
        while loop.step < loop.total_steps:
            for batch, pending in self.pipeline.batches(loop.total_steps - loop.step):
                loss = loop.train_step(batch, pending)
                yield loss, batch.batch_size * loop.topo.job_size

    def finish(self, loop, end: End) -> None:
        if end.stopped_early:
            self.pipeline.discard_ahead()  # (dist.pipeline: the next batch's ids are under way)
        loop.optim.sparse.flush()  # (parameter servers: this rank's last push applied)


class ServerSteps(StepSource):
    """A parameter-server trainer's steps: as one thread's, and at the end every
    trainer's last push has landed before anyone evaluates; its pushes and their
    staleness in the summary."""

    absent: ClassVar[dict] = {"ps": None}  # this trainer's pushes and their staleness

    def __init__(self, pipeline, remote) -> None:
        super().__init__(pipeline)
        self.remote = remote

    def finish(self, loop, end: End) -> None:
        super().finish(loop, end)
        if loop.topo.job_size > 1:
            dist.barrier(group=loop.topo.run_group)

    def summary(self) -> dict:
        return {"ps": self.remote.summary()}


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

    def __init__(self, total: int | None, first_step: int, interval_s: float, stream=None, status=None) -> None:
        self.total, self.first_step, self.interval_s = total, first_step, interval_s
        self.stream, self.status = stream, status  # (status: more fields, e.g. a data stream's files)
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
        if self.total is None:  # (a stream: no last step, no ETA)
            where, eta = f"step {step:,}", ""
        else:
            done, left = step - self.first_step, self.total - step
            pct = 100.0 * step / self.total if self.total else 100.0
            where = f"step {step:,}/{self.total:,} ({pct:.0f}%)"
            eta = f"  ETA {_duration((now - self._start) / done * left if done > 0 else float('nan'))}"
        extra = f"  {self.status()}" if self.status is not None else ""
        print(f"{where}  {_num(rate, '{:,.0f}')} samples/s  loss {_num(loss, '{:.4f}')}{eta}{extra}",
              file=self.stream or sys.stderr, flush=True)
        self._last, self._samples = now, 0


def _num(value: float, fmt: str) -> str:
    return fmt.format(value) if math.isfinite(value) else "n/a"


def _duration(seconds: float) -> str:
    if not math.isfinite(seconds):
        return "n/a"
    s = round(seconds)
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}"
