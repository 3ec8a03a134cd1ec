"""How many threads a step's operators use, chosen by measurement while the run trains.

torch splits a CPU operator over an OpenMP team of ``torch.get_num_threads()`` threads (one
per core by default). On an idle machine the team pays: the demo recipe on a 2-core Zen 3
trains 46,500 samples/s with 2 threads against 34,800 with 1. Beside one CPU-bound process,
it collapses: every one of the hundreds of parallel operators of a step waits at its barrier
for a team member the scheduler has put off, and 2 threads train 10,400 samples/s against
30,900 with 1 (up to 50x slower with a busier neighbour; docs/benchmarks.md, "Training
beside other work"). Whether the cores are shared is not known in advance and changes while
a run trains (data loaders, evaluation jobs, other users), so the count is chosen the way
the kernels are: by timing, here repeatedly, on the steps themselves.

:class:`ThreadGovernor` (``train.threads=0``, the default, where torch would use more than
one thread in one training process): every so often it times ``probe_steps`` steps at the
current count and as many at a neighbour (half or double, alternately, within 1 and torch's
own count; on in the direction of the last change, else alternately), by their median step time, and keeps the faster, the current one unless the
other is faster by ``margin``. A probe that keeps the count doubles the wait before the
next one (from ``period`` up to ``max_period`` steps); a change shortens it again. The first
probe comes after ``first_at`` steps (the first steps carry warm-up costs). In steady
conditions it costs the probe steps run at the slower count: about 1% of an idle run's
time on 2 cores. ``summary.json`` ``kernels.threads`` records the counts, the probes and
the changes.

The wait is counted in wall time as well as in steps, whichever ends first: ``period_s``
seconds at first, doubled with the steps' wait up to ``max_period_s`` (after a first probe
that keeps the count: 400 steps or 10 s). Counted in steps alone, a bad count lasted as
long as its slow steps took: beside one CPU-bound process, a first probe kept 2 threads and
the demo run trained 2,958 samples/s against 33,744 with 1 thread for the 400 steps to the
next probe, minutes of wall time. A wall-time wait is never shorter than ``spacing`` times
the last probe's own duration, so that where every step is slow (a large model) probes
take about the share of the run's time that the steps' wait gives them.

Only the training thread's count changes (OpenMP's count is a per-thread setting); helper
threads keep their one thread (:mod:`hybridrec.threads`). A count the user set
(``train.threads=N``), Hogwild workers, several ranks (each already on ``OMP_NUM_THREADS``
threads, usually 1) and GPU runs are left alone.
"""

from __future__ import annotations

import statistics
import time

import torch


class ThreadGovernor:
    """Times steps at the current thread count and a neighbour, keeps the faster (see the
    module's docstring). Call :meth:`record` after every step with its seconds."""

    def __init__(self, most: int, *, probe_steps: int = 12, first_at: int = 24, period: int = 200,
                 max_period: int = 3200, margin: float = 0.05, period_s: float = 5.0,
                 max_period_s: float = 300.0, spacing: float = 8.0) -> None:
        if most < 2:
            raise ValueError(f"a thread governor needs at least 2 threads to choose from, got {most}")
        self.most = most  # torch's own count: the upper bound
        self.current = most
        self.probe_steps, self.period, self.max_period, self.margin = probe_steps, period, max_period, margin
        self.period_s, self.max_period_s, self.spacing = period_s, max_period_s, spacing
        self.wait = period  # steps between two probes now
        self.wait_s = period_s  # seconds between two probes now (the one first of the two ends the wait)
        self.next_at = first_at  # the step the next probe starts at
        self.next_time: float | None = None  # the clock (time.monotonic) it starts at; None: steps alone
        self._probe_start = 0.0
        self._up = False  # which way the next probe tries (see _neighbour)
        self._phase: str | None = None  # None, "base", "warm" (the first step at the other count), "other"
        self._times: list[float] = []
        self._base: float | None = None
        self._other = most
        self.probes: list[dict] = []  # step, counts and median seconds of each probe (summary.json)

    def record(self, step: int, seconds: float, now: float | None = None) -> None:
        """The step ``step`` took ``seconds`` (the loop's work between steps excluded) and
        ended at ``now`` (``time.monotonic()`` seconds; None: read here)."""
        if now is None:
            now = time.monotonic()
        if self._phase is None:
            if step >= self.next_at or (self.next_time is not None and now >= self.next_time):
                self._phase, self._times, self._probe_start = "base", [], now
            return
        if self._phase == "warm":  # (a new team's first parallel operators pay its start-up)
            self._phase = "other"
            return
        self._times.append(seconds)
        if len(self._times) < self.probe_steps:
            return
        if self._phase == "base":
            self._base = statistics.median(self._times)
            self._other = self._neighbour()
            self._set(self._other)
            self._phase, self._times = "warm", []
            return
        self._decide(step, statistics.median(self._times), now)

    @property
    def probing(self) -> bool:
        """Whether a probe is under way (its other count may be in force)."""
        return self._phase is not None

    def _neighbour(self) -> int:
        """The count the probe tries: in the direction of the last probe that changed the
        count, else the other way from the last one (half first), within 1 and ``most``."""
        down, up = max(1, self.current // 2), min(self.most, self.current * 2)
        choices = [c for c in ((up, down) if self._up else (down, up)) if c != self.current]
        self._up = choices[0] > self.current
        return choices[0]

    def _decide(self, step: int, other_s: float, now: float) -> None:
        base, other, faster = self._base, self._other, other_s < self._base * (1 - self.margin)
        self.probes.append({"step": step, "threads": [self.current, other],
                            "median_step_s": [round(base, 6), round(other_s, 6)],
                            "kept": other if faster else self.current})
        if faster:  # (the next probe goes on in the same direction)
            self.current, self.wait, self.wait_s = other, self.period, self.period_s
        else:
            self._set(self.current)
            self.wait, self.wait_s = min(self.wait * 2, self.max_period), min(self.wait_s * 2, self.max_period_s)
            self._up = not self._up
        self.next_at, self._phase, self._times = step + self.wait, None, []
        self.next_time = now + max(self.wait_s, self.spacing * (now - self._probe_start))

    def _set(self, count: int) -> None:
        torch.set_num_threads(count)

    def summary(self) -> dict:
        """What ``summary.json`` ``kernels.threads`` records."""
        return {"chosen_by": "timing steps (train.threads=0)", "most": self.most, "current": self.current,
                "changes": sum(p["kept"] != p["threads"][0] for p in self.probes), "probes": self.probes}


def thread_governor(threads: int, *, world_size: int, workers: int, device: torch.device) -> ThreadGovernor | None:
    """The governor of a run's training thread, or None where the count is not this
    module's to choose (see the module's docstring)."""
    if threads or world_size > 1 or workers > 1 or device.type != "cpu":
        return None
    most = torch.get_num_threads()
    return ThreadGovernor(most) if most > 1 else None
