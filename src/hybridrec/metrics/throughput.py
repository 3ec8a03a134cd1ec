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
        totals: also add every step (warm-up included) to these run totals.
    """

    def __init__(self, *, warmup: int = 5, window: int = 50, totals: RunTotals | None = None) -> None:
        if warmup < 0:
            raise ValueError(f"Throughput: warmup must be >= 0, got {warmup}")
        if window < 1:
            raise ValueError(f"Throughput: window must be >= 1, got {window}")
        self.warmup = warmup
        self.window = window
        self.totals = totals
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
        if self.totals is not None:
            self.totals.add(num_samples, seconds)
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


class RunTotals:
    """Samples and training seconds of a whole run, over every invocation that resumed
    it: saved in its checkpoints (``state_dict``), so they count exactly the steps that
    made the checkpoint's model (steps trained after the last checkpoint of a crashed
    invocation are trained again, and counted once). Seconds are training steps only:
    evaluation and checkpoint time are not in them."""

    def __init__(self) -> None:
        self.samples = 0
        self.seconds = 0.0
        self.steps = 0
        self.invocations = 0
        """Invocations that trained steps now in the checkpoint (this one counts once it trained)."""
        self.started_at: str | None = None
        """When the run's first invocation started (ISO 8601)."""
        self._counted = False

    def begin(self, started_at: str) -> None:
        """This invocation starts: the run's start, unless one is known (from a restored
        checkpoint, which replaces it)."""
        if self.started_at is None:
            self.started_at = started_at

    def add(self, samples: int, seconds: float) -> None:
        self.samples += int(samples)
        self.seconds += float(seconds)
        self.steps += 1
        if not self._counted:
            self.invocations += 1
            self._counted = True

    def samples_per_sec(self) -> float:
        return _rate(self.samples, self.seconds)

    def summary(self) -> dict:
        return {"started_at": self.started_at, "invocations": self.invocations, "steps": self.steps,
                "samples": self.samples, "train_seconds": self.seconds,
                "samples_per_sec": self.samples_per_sec()}

    def state_dict(self) -> dict:
        return {"samples": self.samples, "seconds": self.seconds, "steps": self.steps,
                "invocations": self.invocations, "started_at": self.started_at}

    def load_state_dict(self, state: dict) -> None:
        self.samples, self.seconds = int(state["samples"]), float(state["seconds"])
        self.steps, self.invocations = int(state["steps"]), int(state["invocations"])
        self.started_at = state.get("started_at") or self.started_at  # older checkpoints: none
        self._counted = False


def _rate(samples: int, seconds: float) -> float:
    """samples / seconds, NaN when nothing was measured."""
    if seconds <= 0.0:
        return float("nan")
    return samples / seconds
