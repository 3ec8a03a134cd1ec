"""``train.checkpoint_every=auto``: the checkpoint interval from the failure rate.

CPR (Maeng et al., "CPR: Understanding and Improving Failure Tolerant Training for Deep
Learning Recommendation with Partial Recovery", MLSys 2021) chooses the checkpoint
interval from the job's failure rate and the costs of saving and loading checkpoints.
This module implements the classic first-order optimum of Young (1974) and Daly (2006),
a simplification of CPR's model: it leaves out the load (recovery) cost, which a failure
pays whatever the interval (with incremental saves, below, the part of it that grows with
the interval is measured), and, for partial recovery, the accuracy lost by not reloading
every part:

    T = sqrt(2 * C * MTBF)            seconds of training between two checkpoints
    N = clamp(round(T / t_step), 1, total_steps)   the same in steps

with ``C`` the measured seconds of one checkpoint save, ``MTBF`` the mean time between
failures of the whole job (``train.mtbf_hours``) and ``t_step`` the measured seconds of a
training step. ``T`` minimises the expected time lost per unit of time, ``C / T`` (saving)
plus ``T / (2 MTBF)`` (half an interval of work redone per failure), to first order in
``C / MTBF``.

With partial recovery (``train.recovery=partial``) a failure trains nothing again: only the
failed rank's shards lose their updates since the checkpoint, about half an interval of them
on average, for 1/N of the embedding rows (N ranks). The expected fraction of the run's
embedding updates lost is then ``T / (2 N MTBF)`` (CPR's portion of lost samples), and the
interval is the longest that keeps it within ``train.lost_fraction``:

    T = max(Young/Daly's, 2 * N * MTBF * lost_fraction)

(CPR's model also weighs the accuracy a lost sample costs; this keeps a fraction instead.)

With incremental saves of the shards every ``D`` seconds (``train.shard_delta_every``) a
failed rank loses only the updates since its newest delta (``D / (2 N MTBF)`` of them), and
the checkpoint interval no longer bounds that; what a longer interval costs instead is the
deltas a failed rank replays, about ``T / (2 D)`` of them per failure, ``L`` seconds each.
Minimising ``C / T + T L / (2 D MTBF)`` (saving, plus replaying) gives the Young/Daly
analogue

    T = max(Young/Daly's, sqrt(2 D MTBF C / L))

``L`` is measured: the seconds of reading back one delta as a restarted rank reads it
(:meth:`~hybridrec.train.deltas.ShardDeltas.time_next_read`, the first delta after the
probe's checkpoint, scaled to the mean delta's rows; the writing of its rows into the
tables, an ``index_copy``, is not timed). Until that delta is written, ``L`` is priced at
a save per checkpoint's worth of rows, ``phi C`` (``phi``: the share of the shards' rows a
delta saves), which gives ``sqrt(2 D MTBF / phi)``: shorter, as reading back costs a
fraction of writing with its fsyncs. The trainer chooses again with the measured ``L`` at
the delta after that one (every rank takes rank 0's measurement); the probe's choice holds
until then.

The trainer measures the rest: the steps of the first :data:`PROBE_STEPS` of an invocation
(between the first and the last of them; logging and evaluation excluded) and the save of
a checkpoint at the last of them; rank 0 chooses and every rank takes its choice. A
resumed run measures again, except the ranks the launcher restarts after a failure
(``dist.max_restarts``): they take the choice made before it (``RUN/checkpoint_interval.json``,
when made for the same settings), on the same machines seconds later, rather than pay
for one more save per failure.
"""

from __future__ import annotations

import contextlib
import json
import math
from pathlib import Path

from hybridrec.metrics.logger import write_json_atomic

CHOICE_FILE = "checkpoint_interval.json"
"""In the run directory: the newest choice (``{"inputs", "choice"}``)."""

PROBE_STEPS = 10
"""Steps an invocation trains (and times) before its first, measured, checkpoint."""


def young_daly_interval(*, save_s: float, step_s: float, mtbf_s: float, total_steps: int) -> dict:
    """The interval in steps: ``clamp(round(sqrt(2 * save_s * mtbf_s) / step_s), 1,
    total_steps)``, as summary.json's ``checkpoint_interval``: ``{"mtbf_s", "save_s",
    "step_s", "steps", "reason"}`` (``reason``: the arithmetic in words)."""
    if save_s < 0 or step_s < 0 or mtbf_s <= 0:
        raise ValueError(f"save_s and step_s must be >= 0 and mtbf_s > 0, got {save_s}, {step_s}, {mtbf_s}")
    upper = max(1, int(total_steps))
    period = math.sqrt(2.0 * save_s * mtbf_s)
    raw = period / step_s if step_s > 0 else math.inf
    steps = min(upper, max(1, round(raw))) if math.isfinite(raw) else upper
    why = (f"Young/Daly optimum sqrt(2 x save {save_s:.3g} s x MTBF {mtbf_s:.4g} s) = {period:.3g} s"
           f" = {raw:,.1f} steps of {step_s:.3g} s")
    if raw < 1:
        why += ", clamped to 1 step"
    elif raw >= upper + 0.5:
        why += f", clamped to the run's {upper:,} steps"
    return {"mtbf_s": float(mtbf_s), "save_s": float(save_s), "step_s": float(step_s), "steps": int(steps),
            "reason": why}


class IntervalProbe:
    """Times the first steps of an invocation (``train.checkpoint_every=auto``): the probe
    step is :data:`PROBE_STEPS` after the first one trained (or the last step); the step
    time is the mean over the probe's steps without the first (warm-up) one."""

    def __init__(self, *, first_step: int, total_steps: int) -> None:
        self.at = min(first_step + PROBE_STEPS, total_steps)
        self._seconds: list[float] = []

    def record(self, step: int, seconds: float) -> None:
        """``seconds``: how long step ``step`` took (the loop's work between steps excluded)."""
        if step <= self.at:
            self._seconds.append(seconds)

    def step_s(self) -> float:
        timed = self._seconds[1:] or self._seconds
        return sum(timed) / len(timed) if timed else 0.0


def partial_recovery_interval(*, save_s: float, step_s: float, mtbf_s: float, total_steps: int, ranks: int,
                              lost_fraction: float, delta_steps: int = 0, delta_share: float = 1.0,
                              replay_s: float | None = None) -> dict:
    """``train.recovery=partial``: the interval in steps, ``max(Young/Daly's, 2 * ranks * mtbf_s *
    lost_fraction / step_s)`` clamped to the run, as :func:`young_daly_interval`'s dict with
    ``lost_fraction`` (the expected share of the embedding updates lost) added. With
    incremental saves every ``delta_steps`` steps: ``max(Young/Daly's, sqrt(2 * D * mtbf_s *
    save_s / replay_s) / step_s)`` with ``D = delta_steps * step_s`` and ``replay_s`` the
    measured seconds of replaying one delta (None: priced at ``delta_share * save_s``, the
    share of the shards' rows a delta saves; the dict's ``replay_s`` is None then)."""
    if ranks < 1 or not 0 < lost_fraction < 1:
        raise ValueError(f"ranks must be >= 1 and lost_fraction in (0, 1), got {ranks}, {lost_fraction}")
    if replay_s is not None and replay_s <= 0:
        raise ValueError(f"replay_s must be > 0, got {replay_s}")
    yd = young_daly_interval(save_s=save_s, step_s=step_s, mtbf_s=mtbf_s, total_steps=total_steps)
    upper = max(1, int(total_steps))
    if delta_steps > 0:
        d_s = delta_steps * step_s
        if replay_s is None:
            share = min(1.0, max(delta_share, 1e-6))
            period = math.sqrt(2.0 * d_s * mtbf_s / share)
            why_bound = (f"partial recovery with incremental saves every {delta_steps} steps of {share:.3g} of the "
                         f"rows, each replay priced at that share of a save: sqrt(2 x {d_s:.3g} s x MTBF "
                         f"{mtbf_s:.4g} s / {share:.3g}) = {period:.3g} s")
        else:
            period = math.sqrt(2.0 * d_s * mtbf_s * save_s / replay_s)
            why_bound = (f"partial recovery with incremental saves every {delta_steps} steps, replayed in "
                         f"{replay_s:.3g} s each (measured): sqrt(2 x {d_s:.3g} s x MTBF {mtbf_s:.4g} s x save "
                         f"{save_s:.3g} s / {replay_s:.3g} s) = {period:.3g} s")
        expected = min(1.0, d_s / (2.0 * ranks * mtbf_s)) if mtbf_s > 0 else 0.0
    else:
        period = 2.0 * ranks * mtbf_s * lost_fraction
        why_bound = (f"partial recovery: the longest interval that loses at most {lost_fraction:g} of the embedding "
                     f"updates, 2 x {ranks} ranks x MTBF {mtbf_s:.4g} s x {lost_fraction:g} = {period:.3g} s")
        expected = None
    raw = period / step_s if step_s > 0 else math.inf
    bound = min(upper, max(1, round(raw))) if math.isfinite(raw) else upper
    steps = max(yd["steps"], bound)
    why = f"{why_bound} = {raw:,.1f} steps of {step_s:.3g} s"
    if bound < yd["steps"]:
        why += f", less than Young/Daly's ({yd['reason']}): that one"
    elif raw >= upper + 0.5:
        why += f", clamped to the run's {upper:,} steps"
    if expected is None:
        expected = min(1.0, steps * step_s / (2.0 * ranks * mtbf_s)) if mtbf_s > 0 else 0.0
    return {**yd, "steps": int(steps), "reason": why, "lost_fraction": expected,
            "replay_s": None if replay_s is None else float(replay_s)}


def save_choice(run_dir: str | Path, choice: dict, inputs: dict) -> None:
    """Keep ``choice`` (made for the settings ``inputs``) for the run's restarted ranks."""
    write_json_atomic(Path(run_dir) / CHOICE_FILE, {"inputs": inputs, "choice": choice})


def restarted_choice(run_dir: str | Path, inputs: dict) -> dict | None:
    """The choice :func:`save_choice` kept for the same ``inputs`` (None: none, or other settings)."""
    with contextlib.suppress(OSError, ValueError):
        kept = json.loads((Path(run_dir) / CHOICE_FILE).read_text())
        if isinstance(kept, dict) and kept.get("inputs") == inputs and isinstance(kept.get("choice"), dict) \
                and isinstance(kept["choice"].get("steps"), int) and kept["choice"]["steps"] >= 1:
            return kept["choice"]
    return None
