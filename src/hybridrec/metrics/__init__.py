"""Metrics: binary classification metrics, throughput, and run-directory logging."""

from hybridrec.metrics.classification import (
    EPS,
    BinaryMetrics,
    RunningLoss,
    accuracy,
    auc,
    calibration,
    log_loss,
    normalized_entropy,
)
from hybridrec.metrics.logger import MetricLogger, cuda_peak_memory_bytes, peak_memory_bytes
from hybridrec.metrics.throughput import Throughput

__all__ = [
    "EPS",
    "BinaryMetrics",
    "MetricLogger",
    "RunningLoss",
    "Throughput",
    "accuracy",
    "auc",
    "calibration",
    "cuda_peak_memory_bytes",
    "log_loss",
    "normalized_entropy",
    "peak_memory_bytes",
]
