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
from hybridrec.parallel import checkpoint as sharded
from hybridrec.parallel.topology import Topology
from hybridrec.sparse.keyed_jagged import Batch
from hybridrec.train import checkpoint as ckpt
from hybridrec.train.config import Config
from hybridrec.train.optim import LRScheduler
from hybridrec.train.pipeline import TrainPipeline


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


class Trainer:
    """Owns one run: model, optimizers, loaders, logger, ledger.

    Constructed by :func:`hybridrec.train.build.build_trainer`; it stores what it
    is given and does no set-up of its own.
    """

    def __init__(
        self,
        *,
        cfg: Config,
        model: torch.nn.Module,
        dense_opt: torch.optim.Optimizer,
        sparse_opt,
        scheduler: LRScheduler,
        train_loader,
        eval_loader,
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
        self.scheduler = scheduler
        self.train_loader = train_loader
        self.eval_loader = eval_loader
        self.logger = logger
        self.ledger = ledger
        self.run_dir = run_dir
        self.total_steps = total_steps
        self.topo = topo
        self.step = 0
        self._saved_step: int | None = None  # step of the newest checkpoint on disk
        sparse = getattr(model, "sparse", None)
        self.pipeline = TrainPipeline(train_loader, sparse, enabled=cfg.dist.pipeline)

    # -- one step --------------------------------------------------------------
    def train_step(self, batch: Batch) -> torch.Tensor:
        """Forward, backward, dense and sparse updates. Returns the detached loss."""
        self.scheduler.apply(self.step)
        self.model.train()
        logits = self.model(batch)
        loss = F.binary_cross_entropy_with_logits(logits, batch.labels)
        self.dense_opt.zero_grad(set_to_none=True)
        loss.backward()
        self.dense_opt.step()
        self.sparse_opt.step()
        self.step += 1
        self.ledger.step_end()
        return loss.detach()

    def evaluate(self) -> dict:
        with self.ledger.suspended():  # evaluation traffic is not a training step's
            return evaluate_model(self.model, self.eval_loader, self.topo)

    # -- state -----------------------------------------------------------------
    def state_dict(self) -> dict:
        return {
            "step": self.step,
            "model": self.model.state_dict(),
            "dense_opt": self.dense_opt.state_dict(),
            "sparse_opt": self.sparse_opt.state_dict(),
            "loader": self.pipeline.loader_state(),
            "rng": torch.get_rng_state(),
        }

    def load_state_dict(self, state: dict) -> None:
        self.model.load_state_dict(state["model"])
        self.dense_opt.load_state_dict(state["dense_opt"])
        self.sparse_opt.load_state_dict(state["sparse_opt"])
        self.train_loader.load_state_dict(state["loader"])
        torch.set_rng_state(state["rng"])
        self.step = int(state["step"])

    def save_checkpoint(self) -> Path:
        """One process: an atomic torch.save file; several: a sharded
        torch.distributed.checkpoint that any world size or plan can load."""
        keep = self.cfg.train.keep_checkpoints
        if self.topo.world_size == 1:
            path = ckpt.save_checkpoint(self.run_dir, self.step, self.state_dict(), keep=keep)
        else:
            path = ckpt.checkpoint_dir(self.run_dir) / f"step-{self.step:08d}"
            extra = {"step": self.step, "loader": self.pipeline.loader_state()}
            sharded.save_sharded(path, model=self.model, dense_opt=self.dense_opt,
                                 sparse_opts=list(self.sparse_opt.optimizers.values()), extra=extra, topo=self.topo)
            if self.topo.rank == 0:
                ckpt.prune(self.run_dir, keep=keep)
        self._saved_step = self.step
        return path

    def maybe_resume(self) -> int | None:
        path = ckpt.latest_checkpoint(self.run_dir) if self.cfg.train.resume else None
        if path is None:
            return None
        if self.topo.world_size == 1 and (path / "state.pt").is_file():
            self.load_state_dict(ckpt.load_checkpoint(path))
        else:
            extra = sharded.load_sharded(path, model=self.model, dense_opt=self.dense_opt,
                                         sparse_opts=list(self.sparse_opt.optimizers.values()), topo=self.topo)
            self.train_loader.load_state_dict(extra["loader"])
            self.step = int(extra["step"])
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
            for batch in self.pipeline.batches(self.total_steps - self.step):
                running.update(self.train_step(batch))
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
