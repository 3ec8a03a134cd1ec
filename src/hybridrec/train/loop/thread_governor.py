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
one thread in one training process): every so often it probes, comparing the current count
with a neighbour (half or double within 1 and torch's own count: on in the direction of the
last change, else alternately) by their median step times, and keeps the faster, the
current one unless the other is faster by ``margin``. A probe times ``base_steps`` steps at
the current count, then steps at the other (its first step untimed: a new team's first
parallel operators pay its start-up), and ends as soon as its times settle it:

- a clear difference: a loss from the second step timed at the other count, when each of
  them took ``clear`` (1.5) times the current count's median or longer (a single slow step
  settles nothing; these steps are the slow ones, so they are few), or from the
  ``base_steps``-th (4th), when their median did; a win from the 4th, when their median is
  1.5 times faster; and a first, untimed step that alone took longer than the current
  count's ``base_steps`` steps would at 1.5 times their median (``clear * base_steps``: 6
  medians) is a loss at once: on a Zen 4 such a first step took 0.7-1.3 medians idle,
  1.5-13 beside a busy process, 12-68 on a machine loaded besides;
- else after ``probe_steps`` (12) steps at the other count: kept where the other is not
  faster by ``margin``; where it is, the count goes back for the rest of ``probe_steps``
  steps at the current count (their first untimed), and the two medians of 12 decide.

The first probe starts at the ``first_at``-th (2nd) step a process records, so that the
first step, with its warm-up costs (allocations, first kernels: 5-12x a later step), is not
timed; the medians, the confirmation and the clear factor discount the slower steps after
it. Beside a CPU-bound process on 2 cores, where 2 threads are 1.5-4x slower than one (a
Zen 4 and a Zen 3), the first probe keeps one thread at step 11 after 6 steps at 2 threads
where its medians differ by 1.5x (it used to take 36: 24 untimed and 12 timed; a closer
call takes 14, the confirmation's 9 included), and a later probe from one thread spends 3
steps at 2 threads, or one where the first takes over 6 medians. On an idle machine, where one thread is 1.3-1.5x slower, a probe from 2
threads times its 12 steps at one, as before, or 2 where each is 1.5x slower: about 1% of
an idle run's time on 2 cores.

A run's first steps are not its later ones: on an idle 2-core Zen 4, the demo's steps at 2
threads took 7-9 ms over the first 20-50 steps and 5 ms after, at one thread 6-7 ms
throughout, and the first probe moved 3 of 8 idle runs to one thread (the one at step 49
before: 1 of 5), each for 225 steps, the time to the next probe. So a first probe that changes the
count is checked again after ``recheck`` (50) steps: an idle run's mistake lasts 50 steps,
and a busy run pays the 3 steps of a loss at 2 threads once more. A probe that keeps the
count doubles the wait before the next one (from ``period`` up to ``max_period`` steps); a
change shortens it again. ``summary.json`` ``kernels.threads`` records the counts, the
probes (each with the steps timed at each count) and the changes.

The wait is counted in wall time as well as in steps, whichever ends first: ``period_s``
seconds at first, doubled with the steps' wait up to ``max_period_s`` (after a first probe
that keeps the count: 400 steps or 10 s). Counted in steps alone, a bad count lasted as
long as its slow steps took: beside one CPU-bound process, a first probe kept 2 threads and
the demo run trained 2,958 samples/s against 33,744 with 1 thread for the 400 steps to the
next probe, minutes of wall time. A wall-time wait is never shorter than ``spacing`` times
the last probe's own duration, so that where every step is slow (a large model) probes
take about the share of the run's time that the steps' wait gives them. And the steps'
wait ends no sooner than ``spacing`` (8) times what the last probe lost, where it kept the
count (its steps at the other count beyond the current count's median): on a machine
loaded besides, beside a busy process, a step at 2 threads took 0.5-1.7 s against 15-40 ms
at one, and a probe each 100-400 steps spent up to a third of the run at 2 threads; spaced so,
probes that lose take at most a ninth of the time.

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

    def __init__(self, most: int, *, probe_steps: int = 12, base_steps: int = 4, clear: float = 1.5,
                 first_at: int = 2, recheck: int = 50, period: int = 200, max_period: int = 3200,
                 margin: float = 0.05,
                 period_s: float = 5.0, max_period_s: float = 300.0, spacing: float = 8.0) -> None:
        if most < 2:
            raise ValueError(f"a thread governor needs at least 2 threads to choose from, got {most}")
        self.most = most  # torch's own count: the upper bound
        self.current = most
        self.probe_steps, self.period, self.max_period, self.margin = probe_steps, period, max_period, margin
        self.base_steps, self.clear = min(base_steps, probe_steps), clear
        self.period_s, self.max_period_s, self.spacing = period_s, max_period_s, spacing
        self.wait = period  # steps between two probes now
        self.wait_s = period_s  # seconds between two probes now (the one first of the two ends the wait)
        self.first_at = first_at  # the first probe starts at the first_at-th step recorded
        self.recheck = min(recheck, period)  # the steps' wait after a first probe that changed the count
        self._seen = 0  # steps recorded before the first probe
        self.next_at: int | None = None  # the step the next probe starts at; None: the first probe's
        self.next_time: float | None = None  # the clock (time.monotonic) it starts at; None: steps alone
        self._probe_start = 0.0
        self._warm_s: float | None = None  # the untimed first step at the other count, where not in _times
        self._not_before = 0.0  # no probe starts before this clock: `spacing` times the last one's loss
        self._up = False  # which way the next probe tries (see _neighbour)
        # None; "base" (the current count's first base_steps steps); "warm" (the first step at
        # the other count, not timed: a new team's first parallel operators pay its start-up);
        # "other"; "back" (the first step back at the current count, not timed); "rest" (the
        # current count's other steps, where the other count looked faster)
        self._phase: str | None = None
        self._base: list[float] = []  # seconds of the probe's steps at the current count
        self._times: list[float] = []  # at the other count
        self._other = most
        self.probes: list[dict] = []  # step, counts, steps timed and median seconds of each probe (summary.json)

    def record(self, step: int, seconds: float, now: float | None = None) -> None:
        """The step ``step`` took ``seconds`` (the loop's work between steps excluded) and
        ended at ``now`` (``time.monotonic()`` seconds; None: read here)."""
        if now is None:
            now = time.monotonic()
        phase = self._phase
        if phase is None:
            if self.next_at is None:  # (counted in steps recorded: a resumed run's first steps warm up too)
                self._seen += 1
                due = self._seen >= self.first_at
            else:
                due = (step >= self.next_at and now >= self._not_before) or (
                    self.next_time is not None and now >= self.next_time)
            if due:
                self._phase, self._base, self._times, self._probe_start = "base", [], [], now
            return
        if phase == "warm":
            self._warm_s = seconds
            if seconds > self.clear * self.base_steps * statistics.median(self._base):
                self._times, self._warm_s = [seconds], None  # (longer than the base's steps at `clear` times their median)
                self._decide(step, now)
                return
        if phase in ("warm", "back"):
            self._phase = "other" if phase == "warm" else "rest"
            return
        if phase == "base":
            self._base.append(seconds)
            if len(self._base) >= self.base_steps:
                self._other = self._neighbour()
                self._set(self._other)
                self._phase = "warm"
            return
        if phase == "rest":
            self._base.append(seconds)
            if len(self._base) >= self.probe_steps:
                self._decide(step, now)
            return
        self._times.append(seconds)
        base = statistics.median(self._base)
        n = len(self._times)
        loss = n >= 2 and min(self._times) > self.clear * base  # (each `clear` times slower)
        if n >= self.base_steps:  # (by their median, as many steps as the base has)
            loss = loss or statistics.median(self._times) > self.clear * base
        win = n >= self.base_steps and statistics.median(self._times) * self.clear < base
        if loss or win:
            self._decide(step, now)
        elif n >= self.probe_steps:
            if statistics.median(self._times) < base * (1 - self.margin) and len(self._base) < self.probe_steps:
                self._set(self.current)  # faster than a few steps: the current count's rest first
                self._phase = "back"
            else:
                self._decide(step, now)

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

    def _decide(self, step: int, now: float) -> None:
        base, other_s, other = statistics.median(self._base), statistics.median(self._times), self._other
        faster = other_s < base * (1 - self.margin)
        self.probes.append({"step": step, "threads": [self.current, other],
                            "steps": [len(self._base), len(self._times)],
                            "median_step_s": [round(base, 6), round(other_s, 6)],
                            "kept": other if faster else self.current})
        if faster:  # (the next probe goes on in the same direction)
            self.current, self.wait, self.wait_s = other, self.period, self.period_s
            if len(self.probes) == 1:  # (the conditions of a run's first steps pass: see the module)
                self.wait = self.recheck
        else:
            self.wait, self.wait_s = min(self.wait * 2, self.max_period), min(self.wait_s * 2, self.max_period_s)
            self._up = not self._up
        self._set(self.current)
        # what a probe that kept the count lost: its steps at the other count beyond the current one's median
        lost = 0.0
        if not faster:
            at_other = self._times + ([] if self._warm_s is None else [self._warm_s])
            lost = sum(at_other) - len(at_other) * base
        self._not_before, self._warm_s = now + self.spacing * max(0.0, lost), None
        self.next_at, self._phase, self._base, self._times = step + self.wait, None, [], []
        self.next_time = now + max(self.wait_s, self.spacing * (now - self._probe_start))

    def _set(self, count: int) -> None:
        if torch.get_num_threads() != count:
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
