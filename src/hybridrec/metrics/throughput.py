"""Samples-per-second meter with warm-up exclusion and a recent-steps window."""

from __future__ import annotations

import time
from collections import deque


class Throughput:
    """Measures training throughput from step boundaries.

    The first ``warmup`` steps are left out of every rate: they include
    one-time costs (CUDA context and kernel autotuning, allocator growth,
    data-loader worker start) that would bias a short run's number.

    On an asynchronous device ``step`` must be called after a point where the
    host waited for the device (e.g. the logged loss's ``.item()``); otherwise
    it times kernel launches rather than their execution.

    Args:
        warmup: number of initial steps excluded from the rates.
        window: number of recent (post-warm-up) steps in :meth:`samples_per_sec`.
    """

    def __init__(self, *, warmup: int = 5, window: int = 50) -> None:
        if warmup < 0:
            raise ValueError(f"Throughput: warmup must be >= 0, got {warmup}")
        if window < 1:
            raise ValueError(f"Throughput: window must be >= 1, got {window}")
        self.warmup = warmup
        self.window = window
        self._last: float | None = None
        self._steps = 0
        # (seconds, samples) of the most recent measured steps.
        self._recent: deque[tuple[float, int]] = deque(maxlen=window)
        self._total_seconds = 0.0
        self._total_samples = 0

    def start(self) -> None:
        """Starts (or restarts, e.g. after an evaluation pause) the clock of the next step."""
        self._last = time.perf_counter()

    def step(self, num_samples: int) -> None:
        """Ends one step that processed ``num_samples`` samples; the next step starts now."""
        if self._last is None:
            raise RuntimeError("Throughput.step called before Throughput.start")
        now = time.perf_counter()
        seconds, self._last = now - self._last, now
        self._steps += 1
        if self._steps <= self.warmup:
            return
        self._recent.append((seconds, num_samples))
        self._total_seconds += seconds
        self._total_samples += num_samples

    @property
    def steps(self) -> int:
        """Steps seen, warm-up included."""
        return self._steps

    @property
    def measured_steps(self) -> int:
        """Steps counted in the overall rate (after warm-up)."""
        return max(0, self._steps - self.warmup)

    def samples_per_sec(self) -> float:
        """Rate over the last ``window`` measured steps; NaN before any."""
        seconds = sum(s for s, _ in self._recent)
        samples = sum(n for _, n in self._recent)
        return _rate(samples, seconds)

    def overall_samples_per_sec(self) -> float:
        """Rate over all measured steps since construction; NaN before any."""
        return _rate(self._total_samples, self._total_seconds)

    def summary(self) -> dict[str, float | int]:
        """JSON-ready numbers for metrics.jsonl / summary.json."""
        return {
            "samples_per_sec": self.samples_per_sec(),
            "samples_per_sec_overall": self.overall_samples_per_sec(),
            "measured_steps": self.measured_steps,
            "measured_seconds": self._total_seconds,
            "measured_samples": self._total_samples,
        }


def _rate(samples: int, seconds: float) -> float:
    """samples / seconds, NaN when nothing was measured."""
    if seconds <= 0.0:
        return float("nan")
    return samples / seconds
