"""CommLedger: where every collective records the bytes it moved.

Pure bookkeeping, no torch.distributed: the collectives (input_dist,
output_dist, dense all-reduce, synchronizers, parameter-server pulls/pushes)
call :meth:`CommLedger.record` with the bytes they put on the wire, after
encoding. Whoever can predict a collective's bytes from a formula (the sharded
collection through the cost model, a plain dense all-reduce) calls
:meth:`CommLedger.predict` in the same step, with that step's prediction.
Predictions accumulate per step like the counts, so a data-dependent collective
(row-wise input_dist: which ids fall in which row range) is compared step by step;
categories nobody predicts are simply not compared.

Counters are keyed by ``(category, table, direction)``, e.g.
``("output_dist", "t_user", "fwd")`` or ``("dense_allreduce", None, "bwd")``.
Categories and directions are free strings so new collectives need no change
here; the usual directions are "fwd", "bwd", "pull", "push" and "sync".

Worked example, one step of a compressed output all-to-all::

    ledger.predict("output_dist", sent=2048, received=2048, table="t0")
    ledger.record("output_dist", sent=2048, received=2048, table="t0", original=4096)
    ledger.step_end()
    ledger.totals(category="output_dist").ratio    # 2.0 = original / sent
    ledger.summary()["predicted_vs_counted"]["output_dist"]["match"]    # True
"""

from __future__ import annotations

import contextlib
import operator
import threading
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Literal

import torch

Key = tuple[str, str | None, str]
Scope = Literal["run", "step", "last_step", "predicted", "predicted_step", "predicted_last_step"]
Check = tuple[str, str | None]  # (category, direction): predicted vs counted; direction None: any


@dataclass(frozen=True)
class ByteCount:
    """Bytes of one or more collective calls.

    Attributes:
        sent: bytes this rank put on the wire (after encoding).
        received: bytes this rank took off the wire (after encoding).
        original: bytes of ``sent`` before compression (equal to ``sent``
            when uncompressed), so ``ratio`` is a measured byte ratio.
        calls: number of :meth:`CommLedger.record` calls summed here.
    """

    sent: int = 0
    received: int = 0
    original: int = 0
    calls: int = 0

    @property
    def ratio(self) -> float | None:
        """Compression ratio ``original / sent`` (1.0 = none); None when nothing was sent."""
        return self.original / self.sent if self.sent else None

    def __add__(self, other: ByteCount) -> ByteCount:
        return ByteCount(
            sent=self.sent + other.sent,
            received=self.received + other.received,
            original=self.original + other.original,
            calls=self.calls + other.calls,
        )

    def __sub__(self, other: ByteCount) -> ByteCount:
        return ByteCount(
            sent=self.sent - other.sent,
            received=self.received - other.received,
            original=self.original - other.original,
            calls=self.calls - other.calls,
        )

    def to_dict(self) -> dict[str, Any]:
        """``{"sent", "received", "original", "calls", "ratio"}`` (ratio may be None)."""
        return {
            "sent": self.sent,
            "received": self.received,
            "original": self.original,
            "calls": self.calls,
            "ratio": self.ratio,
        }


_ZERO = ByteCount()


def tensor_nbytes(t: torch.Tensor | Iterable[torch.Tensor]) -> int:
    """Bytes of a tensor's elements (``numel * element_size``), or the sum over several."""
    if isinstance(t, torch.Tensor):
        return t.numel() * t.element_size()
    return sum(x.numel() * x.element_size() for x in t)


def ring_allreduce_bytes(nbytes: int, world: int) -> int:
    """Bytes one rank sends (and receives) in a ring all-reduce of ``nbytes``
    (integer division: what the hooks record and the cost model predicts)."""
    return 2 * (world - 1) * nbytes // world


def _nbytes(name: str, value: int) -> int:
    """Validates a byte count: a non-negative integer."""
    value = operator.index(value)
    if value < 0:
        raise ValueError(f"CommLedger: {name} must be >= 0, got {value}")
    return value


def _key(category: str, table: str | None, direction: str) -> Key:
    """Validates and builds a counter key."""
    if not category or not isinstance(category, str):
        raise ValueError(f"CommLedger: category must be a non-empty string, got {category!r}")
    if not direction or not isinstance(direction, str):
        raise ValueError(f"CommLedger: direction must be a non-empty string, got {direction!r}")
    return (category, table, direction)


def _add(counters: dict[Key, ByteCount], key: Key, inc: ByteCount) -> None:
    counters[key] = counters.get(key, _ZERO) + inc


def _group(counters: dict[Key, ByteCount], field: int) -> dict[str, ByteCount]:
    """Sums counters by one key field (0 category, 1 table, 2 direction); skips None."""
    out: dict[str, ByteCount] = {}
    for key, count in counters.items():
        if key[field] is not None:
            out[key[field]] = out.get(key[field], _ZERO) + count
    return dict(sorted(out.items()))


def _mean(count: ByteCount, steps: int) -> dict[str, float | None]:
    """Per-step mean bytes of a sum over ``steps`` steps; None before the first step."""
    if steps == 0:
        return {"sent": None, "received": None, "original": None}
    return {
        "sent": count.sent / steps,
        "received": count.received / steps,
        "original": count.original / steps,
    }


class CommLedger:
    """Byte counters of every collective, counted and predicted, per run and per step.

    Thread-safe: the training thread and a background synchronizer thread may
    record at the same time.

    Scopes (see :meth:`totals`): "run" is everything recorded since the last
    :meth:`reset`; "step" the open step; "last_step" the step closed by the
    last :meth:`step_end`; "predicted", "predicted_step" and "predicted_last_step"
    the same for what :meth:`predict` was told.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._suspended = 0  # > 0 inside suspended(): records and predictions are dropped
        self.reset()

    def record(
        self,
        category: str,
        *,
        sent: int,
        received: int,
        table: str | None = None,
        direction: str = "fwd",
        original: int | None = None,
    ) -> None:
        """Counts one collective call.

        Args:
            category: what moved, e.g. "input_dist", "output_dist", "dense_allreduce".
            sent: bytes this rank sent, as encoded on the wire.
            received: bytes this rank received, as encoded on the wire.
            table: the embedding table, when the bytes belong to one.
            direction: "fwd", "bwd", "pull", "push", "sync", ...
            original: bytes of ``sent`` before compression; defaults to ``sent``.
        """
        if self._suspended:
            return
        key = _key(category, table, direction)
        sent = _nbytes("sent", sent)
        inc = ByteCount(
            sent=sent,
            received=_nbytes("received", received),
            original=sent if original is None else _nbytes("original", original),
            calls=1,
        )
        with self._lock:
            _add(self._run, key, inc)
            _add(self._step, key, inc)

    def predict(
        self,
        category: str,
        *,
        sent: int,
        received: int,
        table: str | None = None,
        direction: str = "fwd",
    ) -> None:
        """Adds to the open step's predicted on-the-wire bytes (calls add up: one step may
        run several collectives of a category). Dropped inside :meth:`suspended`."""
        if self._suspended:
            return
        key = _key(category, table, direction)
        sent = _nbytes("sent", sent)
        inc = ByteCount(sent=sent, received=_nbytes("received", received), original=sent, calls=1)
        with self._lock:
            _add(self._pred_run, key, inc)
            _add(self._pred_step, key, inc)

    def step_end(self) -> None:
        """Closes the current step: it becomes "last_step" and a new one opens. Every
        (category, direction) predicted so far is compared with its counted bytes of the step."""
        with self._lock:
            self._predicted_keys |= set(_by_check(self._pred_step))
            counted, predicted = _by_check(self._step), _by_check(self._pred_step)
            bad = {key for key in self._predicted_keys
                   if _pair(counted.get(key, _ZERO)) != _pair(predicted.get(key, _ZERO))}
            for key in bad | {(cat, None) for cat, _ in bad}:  # (category, None): any direction
                self._mismatched[key] = self._mismatched.get(key, 0) + 1
                self._first_mismatch.setdefault(key, self._steps)
            self._last, self._pred_last = self._step, self._pred_step
            self._step, self._pred_step = {}, {}
            self._steps += 1

    @property
    def steps(self) -> int:
        """Steps closed by :meth:`step_end` since the last reset."""
        with self._lock:
            return self._steps

    def totals(
        self,
        *,
        scope: Scope = "run",
        category: str | None = None,
        table: str | None = None,
        direction: str | None = None,
    ) -> ByteCount:
        """Sum of the counters of ``scope`` that match every filter given (None = any)."""
        with self._lock:
            counters = self._counters(scope)
            total = _ZERO
            for (cat, tab, dirn), count in counters.items():
                if category is not None and cat != category:
                    continue
                if table is not None and tab != table:
                    continue
                if direction is not None and dirn != direction:
                    continue
                total = total + count
            return total

    def _counters(self, scope: Scope) -> dict[Key, ByteCount]:
        """The counter dict of a scope; the caller holds the lock."""
        scopes = {"run": self._run, "step": self._step, "last_step": self._last,
                  "predicted": self._pred_run, "predicted_step": self._pred_step,
                  "predicted_last_step": self._pred_last}
        if scope not in scopes:
            raise ValueError(f"CommLedger: unknown scope {scope!r}")
        return scopes[scope]

    @contextlib.contextmanager
    def suspended(self):
        """Drops what is recorded and predicted inside the block (e.g. evaluation traffic,
        which is not part of a training step)."""
        with self._lock:
            self._suspended += 1
        try:
            yield
        finally:
            with self._lock:
                self._suspended -= 1

    def reset(self) -> None:
        """Clears the counters, the predictions, their comparison and the step count."""
        with self._lock:
            self._run: dict[Key, ByteCount] = {}
            self._step: dict[Key, ByteCount] = {}
            self._last: dict[Key, ByteCount] = {}
            self._pred_run: dict[Key, ByteCount] = {}
            self._pred_step: dict[Key, ByteCount] = {}
            self._pred_last: dict[Key, ByteCount] = {}
            self._predicted_keys: set[Check] = set()
            self._mismatched: dict[Check, int] = {}  # closed steps where the two differed
            self._first_mismatch: dict[Check, int] = {}
            self._steps = 0

    def summary(self) -> dict[str, Any]:
        """JSON-ready report of the ledger (ratios are None where nothing was sent).

        Layout::

            {"steps": int,
             "total": counts,                       # whole run
             "by_category" | "by_table" | "by_direction": {name: counts},
             "entries": [{"category", "table", "direction", **counts}, ...],
             "per_step": {"mean": {...}, "last": counts,
                          "mean_by_category": {...}, "last_by_category": {...}},
             "predicted_vs_counted": {category: {**comparison,
                                                 "by_direction": {direction: comparison}}}}

        where ``counts`` is :meth:`ByteCount.to_dict` and ``comparison`` is
        ``{"predicted": {"sent", "received"}, "counted": {"sent", "received"},
        "predicted_per_step": means, "counted_per_step": means, "mismatched_steps": int,
        "first_mismatched_step": int | None, "match": bool}`` over closed steps (``match``:
        equal totals and no step that differed). Only predicted categories appear.
        Per-step means are over closed steps only, so a half-recorded open step does not skew them.
        """
        with self._lock:
            run, step, last = dict(self._run), dict(self._step), dict(self._last)
            pred_closed = _closed(self._pred_run, self._pred_step)
            checks = (set(self._predicted_keys), dict(self._mismatched), dict(self._first_mismatch))
            steps = self._steps
        closed = _closed(run, step)
        return {
            "steps": steps,
            "total": sum(run.values(), _ZERO).to_dict(),
            "by_category": {k: v.to_dict() for k, v in _group(run, 0).items()},
            "by_table": {k: v.to_dict() for k, v in _group(run, 1).items()},
            "by_direction": {k: v.to_dict() for k, v in _group(run, 2).items()},
            "entries": _entries(run),
            "per_step": {
                "mean": _mean(sum(closed.values(), _ZERO), steps),
                "last": sum(last.values(), _ZERO).to_dict(),
                "mean_by_category": {k: _mean(v, steps) for k, v in _group(closed, 0).items()},
                "last_by_category": {k: v.to_dict() for k, v in _group(last, 0).items()},
            },
            "predicted_vs_counted": _compare(pred_closed, closed, checks, steps),
        }


def _pair(count: ByteCount) -> tuple[int, int]:
    return count.sent, count.received


def _closed(run: dict[Key, ByteCount], step: dict[Key, ByteCount]) -> dict[Key, ByteCount]:
    """Counters of the closed steps: the run less the open step."""
    return {k: run[k] - step.get(k, _ZERO) for k in run}


def _by_check(counters: dict[Key, ByteCount]) -> dict[Check, ByteCount]:
    """Counters summed over tables: ``{(category, direction): counts}``."""
    out: dict[Check, ByteCount] = {}
    for (cat, _, dirn), count in counters.items():
        out[(cat, dirn)] = out.get((cat, dirn), _ZERO) + count
    return out


def _entries(counters: dict[Key, ByteCount]) -> list[dict[str, Any]]:
    """One row per (category, table, direction), sorted for stable output."""
    rows = sorted(counters.items(), key=lambda kv: (kv[0][0], kv[0][1] or "", kv[0][2]))
    return [
        {"category": c, "table": t, "direction": d, **count.to_dict()} for (c, t, d), count in rows
    ]


def _comparison(p: ByteCount, c: ByteCount, mismatched: int, first: int | None, steps: int) -> dict[str, Any]:
    return {
        "predicted": {"sent": p.sent, "received": p.received},
        "counted": {"sent": c.sent, "received": c.received},
        "predicted_per_step": {k: v for k, v in _mean(p, steps).items() if k != "original"},
        "counted_per_step": {k: v for k, v in _mean(c, steps).items() if k != "original"},
        "mismatched_steps": mismatched,
        "first_mismatched_step": first,
        "match": mismatched == 0 and (p.sent, p.received) == (c.sent, c.received),
    }


def _compare(predicted: dict[Key, ByteCount], counted: dict[Key, ByteCount],
             checks: tuple[set[Check], dict[Check, int], dict[Check, int]], steps: int) -> dict[str, Any]:
    """Per predicted category (and direction): predicted beside counted bytes, closed steps."""
    keys, mismatched, first = checks
    pred, count = _by_check(predicted), _by_check(counted)
    out: dict[str, Any] = {}
    for cat in sorted({c for c, _ in keys}):
        dirs = sorted(d for c, d in keys if c == cat and d is not None)
        by_dir = {d: _comparison(pred.get((cat, d), _ZERO), count.get((cat, d), _ZERO),
                                 mismatched.get((cat, d), 0), first.get((cat, d)), steps) for d in dirs}
        p = sum((pred.get((cat, d), _ZERO) for d in dirs), _ZERO)
        c = sum((count.get((cat, d), _ZERO) for d in dirs), _ZERO)
        out[cat] = {**_comparison(p, c, mismatched.get((cat, None), 0), first.get((cat, None)), steps),
                    "by_direction": by_dir}
        out[cat]["match"] = all(v["match"] for v in by_dir.values())  # equal sums could hide a swap
    return out
