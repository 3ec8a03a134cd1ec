"""The training loop: a short loop over finished steps and a list of parts.

The steps come from a *step source* (one thread, Hogwild's threads, a parameter-server
trainer); everything else a run does between and around steps (logging, evaluation and
early stopping, checkpoints and their interval, partial recovery, the synchronizer of
dense replicas, failure injection, the thread count) is a part with one small protocol
(:mod:`hybridrec.train.loop.parts`), built by :func:`hybridrec.train.build.build_trainer`.
"""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from hybridrec.comm.ledger import CommLedger
from hybridrec.metrics.logger import MetricLogger
from hybridrec.parallel.dense_sync import DenseSync
from hybridrec.parallel.topology import Topology
from hybridrec.sparse.keyed_jagged import Batch
from hybridrec.train.loop.checkpoint_policy import Checkpoints
from hybridrec.train.loop.optim import LRScheduler
from hybridrec.train.loop.parts import Done, End, Part, StepSource, summary_entries
from hybridrec.train.loop.sparse_optim import CombinedSparseOptimizer
from hybridrec.train.loop.step import training_step


@dataclass
class FitResult:
    """The fit's outcome: its last step, the step it resumed from, and every part's
    summary entries under their summary.json names (:func:`summary_entries`); the loop
    names none of them. The properties read the common ones."""
    step: int
    resumed_from: int | None = None
    parts: dict = field(default_factory=dict)

    @property
    def eval_metrics(self) -> dict | None:
        return self.parts.get("eval")

    @property
    def history(self) -> list[dict]:
        return self.parts.get("eval_history") or []

    @property
    def train_loss(self) -> float | None:
        return self.parts.get("train_loss")

    @property
    def throughput(self) -> dict | None:
        return self.parts.get("throughput")


@dataclass
class Optimizers:
    """What a step updates with: the optimizers, the dense synchronization, the learning
    rate schedule, and a context around the updates (partial recovery's)."""
    dense: torch.optim.Optimizer
    sparse: CombinedSparseOptimizer
    dense_sync: DenseSync
    scheduler: LRScheduler
    updating: Callable[[int], contextlib.AbstractContextManager]


class Trainer:
    """One run's loop: steps from ``source``, the loop's work in ``parts`` (the source is the
    first of them, ``checkpoints`` one of them). Constructed by
    :func:`hybridrec.train.build.build_trainer`; it stores what it is given and does no
    set-up of its own."""

    def __init__(self, *, model: torch.nn.Module, optim: Optimizers, source: StepSource, checkpoints: Checkpoints,
                 parts: list[Part], logger: MetricLogger | None, ledger: CommLedger, total_steps: int,
                 topo: Topology, kernels: dict | None = None) -> None:
        self.model, self.optim, self.source, self.checkpoints = model, optim, source, checkpoints
        self.parts = [source, *parts]
        self.logger, self.ledger, self.total_steps, self.topo = logger, ledger, total_steps, topo
        self.kernels = kernels  # the MLPs' linear implementations and why (summary.json)
        self.step = 0
        self.scores = None  # a part's hook for each batch's scores before it trains (test-then-train)

    @property
    def pipeline(self):
        """The step source's batches (benchmarks and tests step by hand)."""
        return self.source.pipeline

    # -- one step --------------------------------------------------------------
    def train_step(self, batch: Batch, pending=None) -> torch.Tensor:
        """The learning rate of this step, then :func:`training_step`, then its closing."""
        o = self.optim
        o.scheduler.apply(self.step)
        loss = training_step(self.model, batch, dense_opt=o.dense, sparse_opt=o.sparse, dense_sync=o.dense_sync,
                             pending=pending, updating=o.updating(self.step + 1), scores=self.scores)
        self.close_step()
        return loss

    def close_step(self) -> None:
        """A step's updates are applied: count it, then its parts' closing work (a foreground
        sync round) and its bytes."""
        self.step += 1
        for p in self.parts:
            p.end_step(self, self.step)
        self.ledger.step_end()

    def pause_at(self, step: int) -> int:
        """The first step after ``step`` at which a part acts with every thread stopped."""
        return min([self.total_steps, *(s for p in self.parts if (s := p.pause_at(step)) is not None)])

    # -- what parts ask of the loop ----------------------------------------------
    def save_checkpoint(self):
        start = time.perf_counter()
        with contextlib.ExitStack() as stack:
            for p in self.parts:
                stack.enter_context(p.saving(self))
            path = self.checkpoints.save(self.step)
        seconds = time.perf_counter() - start
        for p in self.parts:
            p.after_save(self, self.step, seconds)
        return path

    def evaluated(self) -> None:
        for p in self.parts:
            p.after_evaluate(self)

    def maybe_resume(self) -> int | None:
        """Restore the newest checkpoint that passes its checks; None: nothing to resume."""
        found = self.checkpoints.restore(self)
        if found is None:
            return None
        self.step, where = found
        if self.topo.lead:
            print(f"resumed from step {self.step} ({where})", file=sys.stderr, flush=True)
        return self.step

    # -- the loop --------------------------------------------------------------
    def fit(self) -> FitResult:
        resumed = self.maybe_resume()
        first_step = self.step
        over = [p.start(self) for p in self.parts]  # (True: nothing to train)
        with contextlib.ExitStack() as stack:
            for p in self.parts:
                stack.enter_context(p.running(self))
            stopped_early = not any(over) and self._loop()
            end = End(stopped_early=stopped_early, trained=self.step > first_step)
            for p in self.parts:
                p.finish(self, end)  # before the final checkpoint
            for p in self.parts:
                p.close(self)  # after it
            if self.logger is not None:  # (rank 0's metrics.jsonl: every record written)
                self.logger.flush()
        return FitResult(self.step, resumed, summary_entries(self.parts))

    def _loop(self) -> bool:
        """Every remaining step, with the parts' work after each; True: a part stopped
        training early (at an evaluation)."""
        idle_since = time.perf_counter()  # the end of the loop's own work after a step
        for loss, samples in self.source.steps(self):
            done = Done(self.step, loss, samples, time.perf_counter() - idle_since)
            for p in self.parts:
                if p.after_step(self, done):
                    return True
            idle_since = time.perf_counter()
        return False


