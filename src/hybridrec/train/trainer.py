"""The training loop: step, evaluate, fit; metrics, checkpoints and summary.json."""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from tqdm import tqdm

from hybridrec.comm.ledger import CommLedger
from hybridrec.metrics.classification import BinaryMetrics, RunningLoss
from hybridrec.metrics.logger import MetricLogger
from hybridrec.metrics.throughput import Throughput
from hybridrec.parallel.dense_sync import DenseSync
from hybridrec.parallel.sharded_embedding import ShardedEmbeddingBagCollection
from hybridrec.parallel.topology import Topology
from hybridrec.sparse.keyed_jagged import Batch
from hybridrec.train.checkpointer import Checkpointer
from hybridrec.train.config import Config
from hybridrec.train.optim import LRScheduler
from hybridrec.train.pipeline import TrainPipeline
from hybridrec.train.sparse_optim import CombinedSparseOptimizer


@dataclass
class FitResult:
    step: int
    eval_metrics: dict
    train_loss: float
    throughput: dict
    resumed_from: int | None = None
    history: list[dict] = field(default_factory=list)


@torch.no_grad()
def evaluate_model(model: torch.nn.Module, loader, topo: Topology | None = None) -> dict:
    """AUC, log loss, NE, calibration, accuracy over every batch of ``loader``; with
    several ranks, over the union of every rank's rows (predictions are gathered)."""
    was_training = model.training
    model.eval()
    metrics = BinaryMetrics()
    for batch in loader:
        metrics.update(model(batch), batch.labels)
    model.train(was_training)
    if topo is not None and topo.world_size > 1:
        parts = [None] * topo.world_size
        dist.all_gather_object(parts, metrics.state(), group=topo.group)
        metrics = BinaryMetrics.from_parts(parts)
    return metrics.compute()


def sparse_grads(sparse) -> dict[str, list]:
    """The row gradients of the step for the sparse optimizers, by collection name
    (``CombinedSparseOptimizer``'s keys). With several ranks the replicated tables' rows
    are all-reduced here: an explicit collective every rank runs every step."""
    if isinstance(sparse, ShardedEmbeddingBagCollection):
        return sparse.reduce_sparse_grads(sparse.pop_sparse_grads())
    return {"tables": sparse.pop_sparse_grads()}


def training_step(model: torch.nn.Module, batch: Batch, *, dense_opt: torch.optim.Optimizer,
                  sparse_opt: CombinedSparseOptimizer, dense_sync: DenseSync,
                  pending=None) -> torch.Tensor:
    """One training step, in order; returns the detached loss. ``pending``: the batch's
    input_dist already under way (the pipeline's handle), or None."""
    model.train()
    # Forward: input_dist (or its pending handle), lookup, output_dist, the dense arches.
    logits = model(batch) if pending is None else model(batch, sparse_input=pending)
    loss = F.binary_cross_entropy_with_logits(logits, batch.labels)
    dense_opt.zero_grad(set_to_none=True)
    loss.backward()  # dense grads, the lookups' row grads, the output_dist backward
    dense_sync.synchronize()  # dense synchronization (DDP's ran inside backward)
    grads = sparse_grads(model.sparse)
    dense_opt.step()
    sparse_opt.step(grads)
    return loss.detach()


class Trainer:
    """Owns one run and every stateful part of it: model, dense and sparse optimizers, the
    dense synchronization (and its compressor state), the loader position (through the
    pipeline), the RNG; one :class:`~hybridrec.train.checkpointer.Checkpointer` saves
    and restores them as a list.

    Constructed by :func:`hybridrec.train.build.build_trainer`; it stores what it
    is given and does no set-up of its own.
    """

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
    ) -> None:
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
        self.step = 0
        self._saved_step: int | None = None  # step of the newest checkpoint on disk

    # -- one step --------------------------------------------------------------
    def train_step(self, batch: Batch, pending=None) -> torch.Tensor:
        """The learning rate of this step, then :func:`training_step`."""
        self.scheduler.apply(self.step)
        loss = training_step(self.model, batch, dense_opt=self.dense_opt, sparse_opt=self.sparse_opt,
                             dense_sync=self.dense_sync, pending=pending)
        self.step += 1
        self.ledger.step_end()
        return loss

    def evaluate(self) -> dict:
        with self.ledger.suspended():  # evaluation traffic is not a training step's
            return evaluate_model(self.model, self.eval_loader, self.topo)

    # -- state -----------------------------------------------------------------
    def save_checkpoint(self) -> Path:
        path = self.checkpointer.save(self.step)
        self._saved_step = self.step
        return path

    def maybe_resume(self) -> int | None:
        path = self.checkpointer.latest() if self.cfg.train.resume else None
        if path is None:
            return None
        self.step = self.checkpointer.restore(path)
        self._saved_step = self.step
        return self.step

    # -- the loop --------------------------------------------------------------
    def fit(self) -> FitResult:
        t = self.cfg.train
        resumed = self.maybe_resume()
        running, meter = RunningLoss(), Throughput(warmup=min(5, max(0, self.total_steps // 10)))
        history: list[dict] = []
        show = t.progress and sys.stderr.isatty() and self.topo.rank == 0
        bar = tqdm(total=self.total_steps, initial=self.step, unit="step", dynamic_ncols=True,
                   disable=not show, desc="train")
        last_loss = float("nan")
        meter.start()
        while self.step < self.total_steps:
            for batch, pending in self.pipeline.batches(self.total_steps - self.step):
                running.update(self.train_step(batch, pending))
                meter.step(batch.batch_size * self.topo.world_size)  # global samples
                bar.update(1)
                if t.log_every and self.step % t.log_every == 0:
                    last_loss = self._log_train(running, meter, bar)
                if t.eval_every and self.step % t.eval_every == 0 and self.step < self.total_steps:
                    history.append(self._eval_and_log())
                    meter.start()  # evaluation time is not training time
                if t.save_checkpoints and t.checkpoint_every and self.step % t.checkpoint_every == 0:
                    self.save_checkpoint()
                    meter.start()
                if self.step >= self.total_steps:
                    break
        bar.close()
        if not t.log_every or self.step % t.log_every:
            last_loss = self._log_train(running, meter, None)  # the steps since the last log
        if t.save_checkpoints and self.step > 0 and self._saved_step != self.step:
            self.save_checkpoint()
        final = self._eval_and_log()
        if self.logger:
            self.logger.flush()
        return FitResult(self.step, final, last_loss, meter.summary(), resumed, history)

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
