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
interval is the longest that keeps it within ``train.lost_fraction`` (``f``): saving less
often only saves time, as nothing is trained again,

    T = B = 2 * N * MTBF * f          (floored to whole steps, so the target holds)

(CPR's model also weighs the accuracy a lost sample costs; this keeps a fraction instead.)

With incremental saves of the shards every ``D`` seconds (``train.shard_delta_every``) a
failed rank loses only the updates since its newest delta (``D / (2 N MTBF)`` of them), and
the checkpoint interval no longer bounds that; what a longer interval costs instead is the
deltas a failed rank replays, about ``T / (2 D)`` of them per failure, ``L`` seconds each.
Minimising ``C / T + T L / (2 D MTBF)`` (saving, plus replaying) gives the Young/Daly
analogue

    T = max(Young/Daly's, sqrt(2 D MTBF C / L))

``L`` is measured: the seconds of reading back one delta as a restarted rank reads it
(:meth:`~hybridrec.train.checkpointing.deltas.ShardDeltas.time_next_read`, the first delta after the
probe's checkpoint, scaled to the mean delta's rows; the writing of its rows into the
tables, an ``index_copy``, is not timed). Until that delta is written, ``L`` is priced at
a save per checkpoint's worth of rows, ``phi C`` (``phi``: the share of the shards' rows a
delta saves), which gives ``sqrt(2 D MTBF / phi)``: shorter, as reading back costs a
fraction of writing with its fsyncs. The trainer chooses again with the measured ``L`` at
the delta after that one (every rank takes rank 0's measurement); the probe's choice holds
until then.

The target still bounds that choice. A delta of hot rows only (CPR-MFU,
``train.shard_delta_rows=hot``) saves a share ``u`` of the updates (``delta_update_share``:
the lookups of the rows it saves over those of every row touched); the rest stay with the
checkpoint until a later delta saves them, so a failure loses about
``(u min(D, T) + (1 - u) T) / (2 N MTBF)`` (an upper estimate: a row left out of one delta may
be in the next). The interval is at most the longest ``T`` that keeps this within ``f``:
``B`` when ``D >= B`` (the deltas cannot keep it, the checkpoints must), else
``(B - u D) / (1 - u)`` (no bound for ``u = 1``, every touched row saved).

CPR's benefit estimate (:func:`recovery_overheads`) then decides between partial and full
recovery: the expected share of training time each loses to failure tolerance, to first
order, with full recovery at Young/Daly's interval ``T_f`` (saving, plus half an interval
trained again per failure) and partial recovery at its interval ``T`` (saving, plus the
deltas replayed):

    full    = C / T_f + T_f / (2 MTBF)
    partial = C / T   + T L / (2 D MTBF)       (the second term only with deltas)

Where keeping the target costs partial recovery as much as full recovery or more (a short
``B``: a small target, few ranks, a short MTBF or a slow save), or where not even a
checkpoint every step keeps it, the choice says ``fallback: "full"`` with its reason and
Young/Daly's interval: the run should then recover fully (nothing lost) and say so. The
restart and the reload, which both pay (partial a little more: the survivors' snapshots),
are left out of the estimate, and so are the seconds a delta holds training up.

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

from hybridrec.files import write_json_atomic

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
        self.save_s = 0.0  # the seconds of the newest save meanwhile (the probe step's, once there)

    def record(self, step: int, seconds: float) -> None:
        """``seconds``: how long step ``step`` took (the loop's work between steps excluded)."""
        if step <= self.at:
            self._seconds.append(seconds)

    def step_s(self) -> float:
        timed = self._seconds[1:] or self._seconds
        return sum(timed) / len(timed) if timed else 0.0


def recovery_overheads(*, save_s: float, mtbf_s: float, full_s: float, partial_s: float,
                       delta_s: float = 0.0, replay_s: float = 0.0) -> dict:
    """CPR's benefit estimate: the expected share of training time that failure tolerance
    costs, to first order, with full recovery checkpointing every ``full_s`` seconds
    (``save_s / full_s + full_s / (2 mtbf_s)``: saving, plus half an interval trained again
    per failure) and with partial recovery every ``partial_s`` seconds (``save_s / partial_s``
    plus, with incremental saves every ``delta_s`` seconds, ``partial_s * replay_s / (2 delta_s
    mtbf_s)``: the deltas a failed rank replays). Returns ``{"full", "partial", "benefit"}``
    (``benefit``: full - partial; > 0, partial recovery pays)."""
    if save_s < 0 or mtbf_s <= 0 or full_s <= 0 or partial_s <= 0 or delta_s < 0 or replay_s < 0:
        raise ValueError(f"recovery_overheads: save_s, delta_s, replay_s must be >= 0 and mtbf_s, full_s, partial_s "
                         f"> 0, got {save_s}, {delta_s}, {replay_s}, {mtbf_s}, {full_s}, {partial_s}")
    full = save_s / full_s + full_s / (2.0 * mtbf_s)
    partial = save_s / partial_s + (partial_s * replay_s / (2.0 * delta_s * mtbf_s) if delta_s > 0 else 0.0)
    return {"full": full, "partial": partial, "benefit": full - partial}


def expected_lost_fraction(*, interval_s: float, mtbf_s: float, ranks: int, delta_s: float = 0.0,
                           delta_update_share: float = 1.0) -> float:
    """The expected share of the run's embedding updates that partial recovery loses with
    checkpoints every ``interval_s`` seconds (and incremental saves every ``delta_s``, each
    saving ``delta_update_share`` of the updates): ``(u min(D, T) + (1 - u) T) / (2 N MTBF)``,
    or ``T / (2 N MTBF)`` without deltas (module docstring)."""
    t = interval_s
    if delta_s > 0:
        u = min(1.0, max(0.0, delta_update_share))
        t = u * min(delta_s, interval_s) + (1.0 - u) * interval_s
    return min(1.0, t / (2.0 * ranks * mtbf_s))


def _longest_keeping(budget_s: float, delta_s: float, share: float) -> float:
    """The longest interval (seconds) whose expected loss stays within the target, ``budget_s``
    being ``2 N MTBF f`` (module docstring); inf: any."""
    if delta_s <= 0 or delta_s >= budget_s:
        return budget_s
    if share >= 1.0:
        return math.inf
    return (budget_s - share * delta_s) / (1.0 - share)


def partial_recovery_interval(*, save_s: float, step_s: float, mtbf_s: float, total_steps: int, ranks: int,
                              lost_fraction: float, delta_steps: int = 0, delta_share: float = 1.0,
                              replay_s: float | None = None, delta_update_share: float = 1.0) -> dict:
    """``train.recovery=partial``: the interval in steps that keeps the expected lost fraction
    within ``lost_fraction`` (module docstring), as :func:`young_daly_interval`'s dict with
    ``lost_fraction`` (the expected share of the embedding updates lost), ``target``,
    ``replay_s``, ``overheads`` (:func:`recovery_overheads`) and ``fallback`` added.

    Without incremental saves: ``floor(2 * ranks * mtbf_s * lost_fraction / step_s)`` clamped
    to the run. With them every ``delta_steps`` steps: ``max(Young/Daly's, sqrt(2 * D * mtbf_s *
    save_s / replay_s) / step_s)`` with ``D = delta_steps * step_s`` and ``replay_s`` the
    measured seconds of replaying one delta (None: priced at ``delta_share * save_s``, the
    share of the shards' rows a delta saves; the dict's ``replay_s`` is None then), at most
    the longest interval that keeps the target (``delta_update_share``: the share of the
    updates a delta saves, below 1 with hot-row deltas).

    ``fallback``: None, or ``"full"`` where partial recovery cannot keep the target at a cost
    below full recovery's (or at all): then ``steps`` is Young/Daly's, ``lost_fraction`` 0
    (full recovery loses nothing), and ``fallback_reason`` says why, in words."""
    if ranks < 1 or not 0 < lost_fraction < 1:
        raise ValueError(f"ranks must be >= 1 and lost_fraction in (0, 1), got {ranks}, {lost_fraction}")
    if replay_s is not None and replay_s <= 0:
        raise ValueError(f"replay_s must be > 0, got {replay_s}")
    if not 0 < delta_update_share <= 1:
        raise ValueError(f"delta_update_share must be in (0, 1], got {delta_update_share}")
    yd = young_daly_interval(save_s=save_s, step_s=step_s, mtbf_s=mtbf_s, total_steps=total_steps)
    upper = max(1, int(total_steps))
    budget = 2.0 * ranks * mtbf_s * lost_fraction
    d_s = delta_steps * step_s if delta_steps > 0 else 0.0
    limit = _longest_keeping(budget, d_s, delta_update_share)
    if delta_steps > 0:
        share = min(1.0, max(delta_share, 1e-6))
        per_replay = share * save_s if replay_s is None else replay_s
        if replay_s is None:
            period = math.sqrt(2.0 * d_s * mtbf_s / share)
            why = (f"partial recovery with incremental saves every {delta_steps} steps of {share:.3g} of the "
                   f"rows, each replay priced at that share of a save: sqrt(2 x {d_s:.3g} s x MTBF "
                   f"{mtbf_s:.4g} s / {share:.3g}) = {period:.3g} s")
        else:
            period = math.sqrt(2.0 * d_s * mtbf_s * save_s / replay_s)
            why = (f"partial recovery with incremental saves every {delta_steps} steps, replayed in "
                   f"{replay_s:.3g} s each (measured): sqrt(2 x {d_s:.3g} s x MTBF {mtbf_s:.4g} s x save "
                   f"{save_s:.3g} s / {replay_s:.3g} s) = {period:.3g} s")
        yd_s = yd["steps"] * step_s
        if period < yd_s:
            period, why = yd_s, f"{why}, less than Young/Daly's ({yd['reason']}): that one"
    else:
        per_replay, period, why = 0.0, math.inf, "partial recovery: nothing is trained again, so the longest interval"
    keep = (f"that loses at most {lost_fraction:g} of the embedding updates, "
            f"2 x {ranks} ranks x MTBF {mtbf_s:.4g} s x {lost_fraction:g} = {budget:.3g} s")
    if delta_steps > 0 and limit < math.inf:
        keep += (f" (incremental saves of {delta_update_share:.3g} of the updates every {d_s:.3g} s: "
                 f"{limit:.3g} s)" if d_s < budget else f" (incremental saves every {d_s:.3g} s cannot keep it)")
    if limit < period:
        period, why = limit, f"{why}; at most the longest {keep}" if delta_steps > 0 else f"{why} {keep}"
        raw = period / step_s if step_s > 0 else math.inf
        steps = min(upper, max(1, math.floor(raw * (1 + 1e-9)))) if math.isfinite(raw) else upper
    else:
        raw = period / step_s if step_s > 0 else math.inf
        steps = min(upper, max(1, round(raw))) if math.isfinite(raw) else upper
    why += f" = {raw:,.1f} steps of {step_s:.3g} s" if math.isfinite(raw) else ""
    if math.isfinite(raw) and raw >= upper + 0.5:
        why += f", clamped to the run's {upper:,} steps"
    elif not math.isfinite(raw):
        why += f": the run's {upper:,} steps"
    interval_s = steps * step_s
    expected = expected_lost_fraction(interval_s=interval_s, mtbf_s=mtbf_s, ranks=ranks, delta_s=d_s,
                                      delta_update_share=delta_update_share)
    out = {**yd, "steps": int(steps), "reason": why, "lost_fraction": expected, "target": float(lost_fraction),
           "replay_s": None if replay_s is None else float(replay_s), "fallback": None}
    if step_s <= 0:
        return out
    costs = recovery_overheads(save_s=save_s, mtbf_s=mtbf_s, full_s=yd["steps"] * step_s, partial_s=interval_s,
                               delta_s=d_s, replay_s=per_replay)
    out["overheads"] = costs
    if expected > lost_fraction * (1 + 1e-9):
        because = (f"partial recovery cannot keep train.lost_fraction={lost_fraction:g}: even every "
                   f"{steps:,} step(s) it loses {expected:.3g} of the embedding updates")
    elif costs["benefit"] <= 0:
        because = (f"keeping train.lost_fraction={lost_fraction:g} costs partial recovery {costs['partial']:.3g} of "
                   f"the training time (saving every {steps:,} steps), full recovery {costs['full']:.3g} "
                   f"at Young/Daly's interval")
    else:
        return out
    return {**out, "steps": yd["steps"], "lost_fraction": 0.0, "fallback": "full", "fallback_reason": because,
            "reason": f"{because}: full recovery instead, {yd['reason']}"}


def interval_settings(t, *, world_size: int, total_steps: int) -> dict:
    """The settings a checkpoint interval is chosen for (``t``: the config's ``train``
    section): a choice kept for them (:func:`save_choice`) serves a restarted run with the same."""
    return {"mtbf_hours": t.mtbf_hours, "recovery": t.recovery, "lost_fraction": t.lost_fraction,
            "shard_delta_every": t.shard_delta_every, "shard_delta_rows": t.shard_delta_rows,
            "shard_delta_hot": t.shard_delta_hot, "world_size": world_size, "total_steps": total_steps}


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
