"""Dense optimizers and the learning-rate schedule shared by dense and sparse parts."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from hybridrec.train.setup.config import OptimConfig


def dense_parameters(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    """Parameters trained by the dense optimizer (embedding tables are not: they
    have ``requires_grad=False`` and a sparse optimizer of their own)."""
    return [p for p in model.parameters() if p.requires_grad]


FUSED = {"cpu": ("sgd", "adam", "adagrad"), "cuda": ("sgd", "adam")}
"""The dense optimizers torch has one fused kernel for, by the parameters' device type."""


def build_dense_optimizer(params, cfg: OptimConfig) -> torch.optim.Optimizer:
    """``optim.dense`` over ``params``, with torch's fused implementation where it has one for
    the parameters' device (:data:`FUSED`: one kernel updates every parameter), else the
    multi-tensor (``foreach``) one. The same update, rounded alike for SGD; for Adagrad and Adam
    within float32 rounding (a few 1e-7 after 30 steps). On the Zen 5 the fused Adagrad made
    the demo's step 5% faster, Adam the Criteo Kaggle recipe's 1.5%; SGD is as fast either way
    (docs/benchmarks.md, "Fused dense optimizers")."""
    params = list(params)
    kinds = {p.device.type for p in params}
    fused = len(kinds) == 1 and cfg.dense in FUSED.get(next(iter(kinds)), ())
    fast = {"fused": True} if fused else {"foreach": True}
    if cfg.dense == "sgd":
        return torch.optim.SGD(params, lr=cfg.dense_lr, momentum=cfg.momentum,
                               weight_decay=cfg.weight_decay, **fast)
    if cfg.dense == "adagrad":
        return torch.optim.Adagrad(params, lr=cfg.dense_lr, eps=cfg.eps,
                                   weight_decay=cfg.weight_decay, **fast)
    if cfg.dense == "adam":
        return torch.optim.Adam(params, lr=cfg.dense_lr, eps=cfg.eps,
                                weight_decay=cfg.weight_decay, **fast)
    raise ValueError(f"unknown dense optimizer {cfg.dense!r}")


@dataclass
class LRSchedule:
    """Multiplier of the peak learning rates at each step.

    Linear warm-up over ``warmup_steps`` (from 1/warmup to 1), constant until
    ``decay_start``, then ``decay`` down to 0 at ``total_steps``.
    """

    warmup_steps: int
    decay: str
    decay_start: int
    total_steps: int

    def factor(self, step: int) -> float:
        if self.warmup_steps and step < self.warmup_steps:
            return (step + 1) / self.warmup_steps
        start = max(self.decay_start, self.warmup_steps)
        if self.decay == "none" or step < start or self.total_steps <= start:
            return 1.0
        frac = min(1.0, (step - start) / (self.total_steps - start))
        if self.decay == "linear":
            return 1.0 - frac
        if self.decay == "cosine":
            return 0.5 * (1.0 + math.cos(math.pi * frac))
        if self.decay == "poly2":
            return (1.0 - frac) ** 2
        raise ValueError(f"unknown decay {self.decay!r}")


class LRScheduler:
    """Sets the dense and sparse learning rates from one :class:`LRSchedule`."""

    def __init__(self, schedule: LRSchedule, dense_opt, sparse_opt, *, dense_lr: float, sparse_lr: float):
        self.schedule = schedule
        self.dense_opt, self.sparse_opt = dense_opt, sparse_opt
        self.dense_lr, self.sparse_lr = dense_lr, sparse_lr

    def apply(self, step: int) -> float:
        f = self.schedule.factor(step)
        for group in self.dense_opt.param_groups:
            group["lr"] = self.dense_lr * f
        if self.sparse_opt is not None:
            self.sparse_opt.lr = self.sparse_lr * f
        return f
