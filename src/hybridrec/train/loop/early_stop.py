"""Early stopping on held-out AUC (``train.early_stop``), with the best checkpoint kept.

``train.early_stop=K`` (patience, as Keras' ``EarlyStopping(patience=K)``): training stops
after ``K`` evaluations in a row (``train.eval_every``) whose AUC did not beat the best one
so far by more than ``train.early_stop_min_delta``. The evaluation is the trainer's, whose
predictions are gathered from every rank, so every rank computes the AUC from the same
numbers; rank 0's value is broadcast besides (``Trainer._early_stop``), so every rank counts
the same number and stops at the same step.

The best checkpoint. An evaluation that improves the AUC saves a checkpoint of that step
(through the run's :class:`~hybridrec.train.checkpointing.checkpointer.Checkpointer`, like any other),
and this object is one of the checkpointer's global components (``early_stop``): every
checkpoint's manifest says which step is the best so far (``extra.early_stop.best_step``),
and pruning (``train.keep_checkpoints``) keeps that checkpoint besides the newest ones. So
there is one checkpoint format and one place that says which is best: the newest
checkpoint's manifest (:func:`best_checkpoint`). The final checkpoint is still the last
step trained (a resume continues exactly from it); ``hybridrec eval RUN`` loads the best
one when the run recorded one.

Its state (best step, best AUC and metrics, evaluations since the best) is checkpointed,
so a resumed run counts on where it stopped; ``stopped`` is derived from the *current*
patience, so resuming a stopped run with a larger ``train.early_stop`` trains on.
"""

from __future__ import annotations

import math
from pathlib import Path

from hybridrec.errors import ConfigError
from hybridrec.train.checkpointing import checkpoint as ckpt

COMPONENT = "early_stop"
"""The checkpointer's name for it (``manifest["extra"]["early_stop"]``)."""


class EarlyStopping:
    """Counts evaluations without an AUC improvement; the checkpointer's ``early_stop``."""

    def __init__(self, patience: int, min_delta: float = 0.0) -> None:
        self.patience, self.min_delta = patience, min_delta
        self.best_step: int | None = None
        self.best_auc: float | None = None
        self.best_metrics: dict = {}
        self.since_best = 0  # evaluations since the best one
        self.evaluations = 0  # evaluations counted
        self.last_step = -1  # the step of the last one counted

    def update(self, step: int, metrics: dict) -> bool:
        """Count the evaluation of ``step``; True when it is the new best. An evaluation
        of a step already counted (a finished run evaluated again) changes nothing."""
        if step <= self.last_step:
            return False
        self.last_step = step
        self.evaluations += 1
        auc = metrics.get("auc")
        if (isinstance(auc, (int, float)) and math.isfinite(auc)
                and (self.best_auc is None or auc - self.min_delta > self.best_auc)):
            self.best_step, self.best_auc = step, float(auc)
            self.best_metrics = {k: v for k, v in metrics.items()
                                 if isinstance(v, (int, float)) and not isinstance(v, bool)}
            self.since_best = 0
            return True
        self.since_best += 1
        return False

    @property
    def stopped(self) -> bool:
        """``patience`` evaluations in a row without an improvement."""
        return self.patience > 0 and self.since_best >= self.patience

    def kept_steps(self) -> set[int]:
        """Checkpoints that pruning must keep besides the newest (the best one)."""
        return set() if self.best_step is None else {self.best_step}

    def reason(self, step: int, total_steps: int) -> str:
        if self.stopped:
            return (f"early stop at step {step:,}: no eval AUC improvement in {self.since_best} "
                    f"evaluations (train.early_stop={self.patience}); best AUC "
                    f"{_auc(self.best_auc)} at step {self.best_step:,}")
        return f"trained the planned {total_steps:,} steps"

    def summary(self, step: int, total_steps: int, run_dir: Path, *, saved: bool) -> dict:
        """summary.json's ``early_stop`` (``saved``: checkpoints were written)."""
        best = ckpt.step_dir(run_dir, self.best_step) if saved and self.best_step is not None else None
        return {"patience": self.patience, "min_delta": self.min_delta,
                "stopped_early": self.stopped, "stopped_at": step, "planned_steps": total_steps,
                "reason": self.reason(step, total_steps), "evaluations": self.evaluations,
                "evaluations_since_best": self.since_best, "best_step": self.best_step,
                "best_auc": self.best_auc, "best": dict(self.best_metrics),
                "best_checkpoint": str(best) if best is not None else None}

    # -- a checkpointer component ----------------------------------------------------
    def state_dict(self) -> dict:
        return {"best_step": self.best_step, "best_auc": self.best_auc,
                "best_metrics": dict(self.best_metrics), "since_best": self.since_best,
                "evaluations": self.evaluations, "last_step": self.last_step}

    def load_state_dict(self, state: dict) -> None:
        self.best_step = state["best_step"]
        self.best_auc = state["best_auc"]
        self.best_metrics = dict(state["best_metrics"])
        self.since_best = int(state["since_best"])
        self.evaluations = int(state["evaluations"])
        self.last_step = int(state["last_step"])


def _auc(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.4f}"


def recorded_best(run_dir: str | Path) -> dict | None:
    """The early-stopping state of a run's newest checkpoint (None: it has none)."""
    from hybridrec.parallel.checkpoint import read_manifest

    newest = ckpt.latest_sound(run_dir)  # (one whose files fail its checks says nothing)
    if newest is None:
        return None
    state = (read_manifest(newest).get("extra") or {}).get(COMPONENT)
    return state if isinstance(state, dict) and state.get("best_step") is not None else None


def best_checkpoint(run_dir: str | Path) -> tuple[int, Path] | None:
    """``(step, path)`` of the best checkpoint the run's newest checkpoint names (None:
    the run recorded no best: early stopping was off). A named checkpoint that is not on
    disk is an error (saved with ``train.save_checkpoints=false``, or deleted)."""
    state = recorded_best(run_dir)
    if state is None:
        return None
    step = int(state["best_step"])
    for s, path in ckpt.list_checkpoints(run_dir):
        if s == step:
            return step, path
    raise ConfigError(f"{run_dir}: the best checkpoint (step {step:,}, AUC {_auc(state.get('best_auc'))}) "
                      "is not on disk; `--checkpoint latest` evaluates the newest one")


def resolve_checkpoint(run_dir: str | Path, which: str | None) -> tuple[Path | None, str]:
    """The checkpoint ``hybridrec eval --checkpoint WHICH`` means, and what it is:
    ``best`` (the run's best; an error when it recorded none), ``latest`` (the newest),
    a checkpoint directory, or None: the best when the run recorded one, else the newest."""
    if which not in (None, "best", "latest"):
        return Path(which), "given"
    if which != "latest":
        found = best_checkpoint(run_dir)
        if found is not None:
            return found[1], "best"
        if which == "best":
            raise ConfigError(f"{run_dir}: no best checkpoint recorded (the run was trained without "
                              "train.early_stop); `--checkpoint latest` evaluates the newest one")
    return ckpt.latest_checkpoint(run_dir), "latest"
