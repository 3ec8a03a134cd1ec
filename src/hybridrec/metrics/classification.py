"""Binary click-prediction metrics: AUC, log loss, NE, calibration, accuracy.

All functions take 1-D ``labels`` (0/1) and ``scores``/``probs`` of the same
length ``[n]`` as torch tensors, numpy arrays or lists, and compute in float64
on the host. Undefined values (an empty input, a single class for AUC and NE,
no positive for calibration) come back as ``float('nan')`` rather than an
exception: an evaluation on a small shard may legitimately see one class, and
the caller logs the NaN (the logger writes it as JSON ``null``).

:class:`BinaryMetrics` accumulates evaluation outputs batch by batch and keeps
its state as plain CPU tensors so the per-rank parts can be gathered and merged
before :meth:`BinaryMetrics.compute`. :class:`RunningLoss` keeps the training
loss on the device so the training step needs no host sync.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

import numpy as np
import torch

#: Probabilities are clipped to ``[EPS, 1 - EPS]`` before taking logs, so one
#: confidently wrong prediction costs at most ``-log(EPS) ≈ 16.1`` nats.
EPS = 1e-7

ArrayLike = torch.Tensor | np.ndarray | Sequence[float]


def _as_f64(x: ArrayLike) -> np.ndarray:
    """Any array-like → flat float64 numpy array ``[n]``."""
    if isinstance(x, torch.Tensor):
        x = x.detach().to("cpu", torch.float64).numpy()
    return np.asarray(x, dtype=np.float64).reshape(-1)


def _check_pair(labels: ArrayLike, values: ArrayLike, what: str) -> tuple[np.ndarray, np.ndarray]:
    """Converts and validates ``labels`` (0/1) and ``values`` of equal length ``[n]``."""
    y = _as_f64(labels)
    v = _as_f64(values)
    if y.shape != v.shape:
        raise ValueError(f"labels has {y.size} elements but {what} has {v.size}")
    if not np.all((y == 0.0) | (y == 1.0)):
        raise ValueError("labels must be 0 or 1")
    return y, v


def auc(labels: ArrayLike, scores: ArrayLike) -> float:
    """Exact ROC AUC as the Mann–Whitney statistic, in O(n log n).

    AUC = P(score of a random positive > score of a random negative), where a
    tie counts 1/2. Sorting the distinct scores and counting, for each tied
    group, the negatives strictly below it gives every positive–negative pair
    at once::

        AUC = Σ_g pos_g · (neg_below_g + neg_g / 2) / (P · N)

    Example: labels ``[0, 0, 1, 1]``, scores ``[0.1, 0.4, 0.35, 0.8]`` → 0.75;
    with scores ``[0.5, 0.5, 0.5, 0.5]`` → 0.5.

    Args:
        labels: 0/1 labels, shape ``[n]``.
        scores: any monotone score (logits or probabilities), shape ``[n]``.

    Returns:
        AUC in ``[0, 1]``; NaN when only one class is present, when ``n == 0``
        or when a score is NaN (a diverged model should show up as NaN, not as
        an arbitrary number).
    """
    y, s = _check_pair(labels, scores, "scores")
    n_pos = float(y.sum())
    n_neg = float(y.size) - n_pos
    if n_pos == 0.0 or n_neg == 0.0 or np.isnan(s).any():
        return float("nan")
    # np.unique sorts; `group` maps every sample to the index of its distinct score.
    _, group = np.unique(s, return_inverse=True)
    group = group.reshape(-1)
    pos_g = np.bincount(group, weights=y)
    neg_g = np.bincount(group) - pos_g
    neg_below = np.cumsum(neg_g) - neg_g
    pairs = float(np.dot(pos_g, neg_below + 0.5 * neg_g))
    return pairs / (n_pos * n_neg)


def log_loss(labels: ArrayLike, probs: ArrayLike, *, eps: float = EPS) -> float:
    """Mean binary cross-entropy in nats, probabilities clipped to ``[eps, 1-eps]``.

    Example: labels ``[1, 0]``, probs ``[0.8, 0.3]`` →
    ``-(log 0.8 + log 0.7) / 2 ≈ 0.289909``.

    Args:
        labels: 0/1 labels, shape ``[n]``.
        probs: predicted click probabilities, shape ``[n]``.

    Returns:
        The mean loss (float64); NaN when ``n == 0``.
    """
    y, p = _check_pair(labels, probs, "probs")
    if y.size == 0:
        return float("nan")
    p = np.clip(p, eps, 1.0 - eps)
    return float(-np.mean(y * np.log(p) + (1.0 - y) * np.log1p(-p)))


def _entropy(rate: float) -> float:
    """Binary entropy (nats) of a Bernoulli with mean ``rate``; 0 at 0 and 1."""
    if rate <= 0.0 or rate >= 1.0:
        return 0.0
    return -(rate * math.log(rate) + (1.0 - rate) * math.log1p(-rate))


def normalized_entropy(labels: ArrayLike, probs: ArrayLike, *, eps: float = EPS) -> float:
    """Log loss divided by the entropy of the base click rate (He et al., 2014).

    ``NE = log_loss / H(p̄)`` with ``p̄ = mean(labels)`` and
    ``H(p) = -(p log p + (1-p) log(1-p))``: 1.0 means no better than always
    predicting the base rate, lower is better.

    Example: labels ``[1, 0]``, probs ``[0.8, 0.3]`` → ``0.289909 / log 2 ≈ 0.418253``.

    Returns:
        NE; NaN when ``n == 0`` or only one class is present (``H(p̄) = 0``).
    """
    y, p = _check_pair(labels, probs, "probs")
    h = _entropy(float(y.mean())) if y.size else 0.0
    if h == 0.0:
        return float("nan")
    return log_loss(y, p, eps=eps) / h


def calibration(labels: ArrayLike, probs: ArrayLike) -> float:
    """Mean predicted probability over mean label (1.0 = calibrated on average).

    Example: labels ``[1, 0]``, probs ``[0.8, 0.3]`` → ``0.55 / 0.5 = 1.1``.

    Returns:
        The ratio; NaN when ``n == 0`` or there is no positive label.
    """
    y, p = _check_pair(labels, probs, "probs")
    positives = float(y.sum())
    if positives == 0.0:
        return float("nan")
    return float(p.sum()) / positives


def accuracy(labels: ArrayLike, probs: ArrayLike, threshold: float = 0.5) -> float:
    """Fraction of samples where ``(prob > threshold) == label``; NaN when ``n == 0``.

    The comparison is strict, so a probability of exactly 0.5 (logit 0) predicts 0.
    """
    y, p = _check_pair(labels, probs, "probs")
    if y.size == 0:
        return float("nan")
    return float(np.mean((p > threshold) == (y == 1.0)))


class BinaryMetrics:
    """Accumulates evaluation outputs and computes all binary metrics at once.

    The exact AUC needs every score, so the accumulator keeps them: 8 bytes
    per sample (a float32 probability and a float32 label) on the host, which
    leaves device memory flat however long the evaluation is. float32
    probabilities saturate to exactly 1.0 beyond a logit of about 17; such
    samples then tie in the AUC, which real CTR models do not reach.

    Per-rank use::

        part = BinaryMetrics()
        for batch in loader:
            part.update(model(batch), batch.labels)
        parts = gather(part.state())          # list of dicts, one per rank
        metrics = BinaryMetrics.from_parts(parts).compute()
    """

    def __init__(self) -> None:
        self._probs: list[torch.Tensor] = []
        self._labels: list[torch.Tensor] = []

    def update(self, logits: torch.Tensor, labels: torch.Tensor) -> None:
        """Adds one batch.

        Args:
            logits: raw model outputs, shape ``[b]`` or ``[b, 1]``.
            labels: 0/1 labels, shape ``[b]`` (any dtype).
        """
        logits = logits.detach().reshape(-1)
        labels = labels.detach().reshape(-1)
        if logits.numel() != labels.numel():
            raise ValueError(
                f"BinaryMetrics.update: {logits.numel()} logits but {labels.numel()} labels"
            )
        # Host copy (a sync on GPU): evaluation is not the hot path, and holding
        # every score on the device would grow device memory with eval size.
        self._probs.append(torch.sigmoid(logits.float()).to("cpu", torch.float32))
        self._labels.append(labels.to("cpu", torch.float32))

    @property
    def count(self) -> int:
        """Number of samples accumulated so far."""
        return sum(p.numel() for p in self._probs)

    def state(self) -> dict[str, torch.Tensor]:
        """The accumulated samples: ``{"probs": [n] float32, "labels": [n] float32}``.

        This is what a rank sends to be merged; it also compacts the batches
        into one tensor each, so repeated calls are cheap.
        """
        probs = torch.cat(self._probs) if self._probs else torch.empty(0)
        labels = torch.cat(self._labels) if self._labels else torch.empty(0)
        self._probs, self._labels = [probs], [labels]
        return {"probs": probs, "labels": labels}

    def merge(self, other: BinaryMetrics | dict[str, torch.Tensor]) -> BinaryMetrics:
        """Appends the samples of another accumulator (or of its :meth:`state`); returns self."""
        part = other.state() if isinstance(other, BinaryMetrics) else other
        probs = part["probs"].detach().to("cpu", torch.float32).reshape(-1)
        labels = part["labels"].detach().to("cpu", torch.float32).reshape(-1)
        if probs.numel() != labels.numel():
            raise ValueError("BinaryMetrics.merge: probs and labels differ in length")
        self._probs.append(probs)
        self._labels.append(labels)
        return self

    @classmethod
    def from_parts(cls, parts: Iterable[BinaryMetrics | dict[str, torch.Tensor]]) -> BinaryMetrics:
        """One accumulator holding the samples of all ``parts`` (e.g. one per rank)."""
        merged = cls()
        for part in parts:
            merged.merge(part)
        return merged

    def reset(self) -> None:
        """Forgets all samples."""
        self._probs, self._labels = [], []

    def compute(self) -> dict[str, float | int]:
        """All metrics over the accumulated samples.

        Returns:
            ``{"auc", "log_loss", "ne", "calibration", "accuracy", "ctr", "count"}``;
            floats (NaN where undefined, see the module docstring) and ``count`` an int.
        """
        st = self.state()
        y = st["labels"].numpy().astype(np.float64)
        p = st["probs"].numpy().astype(np.float64)
        return {
            "auc": auc(y, p),
            "log_loss": log_loss(y, p),
            "ne": normalized_entropy(y, p),
            "calibration": calibration(y, p),
            "accuracy": accuracy(y, p),
            "ctr": float(y.mean()) if y.size else float("nan"),
            "count": int(y.size),
        }


class RunningLoss:
    """Training-loss window mean and EMA, accumulated on the loss's device.

    ``update`` only adds tensors, so the training step never waits for the
    device: calling ``loss.item()`` every step would force a host sync and stall
    the CUDA stream (or the pipeline of overlapped collectives) each step.
    The one sync happens in :meth:`compute`, called at the logging interval.

    Args:
        ema_decay: weight of the previous EMA value, in ``[0, 1)``.
    """

    def __init__(self, *, ema_decay: float = 0.98) -> None:
        if not 0.0 <= ema_decay < 1.0:
            raise ValueError(f"RunningLoss: ema_decay must be in [0, 1), got {ema_decay}")
        self.ema_decay = ema_decay
        self._window_sum: torch.Tensor | None = None
        self._window_count = 0
        self._ema: torch.Tensor | None = None
        # Number of EMA updates, kept on the host to correct the EMA's bias toward
        # its zero start (as Adam does) without a device read.
        self._updates = 0

    def update(self, loss: torch.Tensor) -> None:
        """Adds one step's scalar loss (any shape that holds one element); no host sync."""
        value = loss.detach().reshape(()).float()
        if self._window_sum is None or self._ema is None:
            self._window_sum = torch.zeros((), device=value.device)
            self._ema = torch.zeros((), device=value.device)
        self._window_sum += value
        self._ema.mul_(self.ema_decay).add_(value, alpha=1.0 - self.ema_decay)
        self._window_count += 1
        self._updates += 1

    def compute(self, *, reset_window: bool = True) -> dict[str, float]:
        """``{"loss": mean since the last reset, "loss_ema": bias-corrected EMA}``.

        This is the host sync point (``.item()``); NaN when there was no update.
        """
        if self._window_sum is None or self._ema is None or self._window_count == 0:
            mean = float("nan")
        else:
            mean = self._window_sum.item() / self._window_count
        if self._ema is None or self._updates == 0:
            ema = float("nan")
        else:
            ema = self._ema.item() / (1.0 - self.ema_decay**self._updates)
        if reset_window:
            self.reset_window()
        return {"loss": mean, "loss_ema": ema}

    def reset_window(self) -> None:
        """Starts a new window for the mean; the EMA carries on."""
        if self._window_sum is not None:
            self._window_sum.zero_()
        self._window_count = 0

    def reset(self) -> None:
        """Forgets everything, EMA included."""
        self._window_sum = None
        self._ema = None
        self._window_count = 0
        self._updates = 0
