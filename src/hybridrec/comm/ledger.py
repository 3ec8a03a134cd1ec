"""CommLedger: where every collective records the bytes it moved.

Pure bookkeeping, no torch.distributed: the collectives (input_dist,
output_dist, dense all-reduce, synchronizers, parameter-server pulls/pushes)
call :meth:`CommLedger.record` with the bytes they put on the wire, after
encoding. The planner calls :meth:`CommLedger.predict` with the bytes it
expects per step, so tests and reports can compare predicted with counted.

Counters are keyed by ``(category, table, direction)``, e.g.
``("output_dist", "t_user", "fwd")`` or ``("dense_allreduce", None, "bwd")``.
Categories and directions are free strings so new collectives need no change
here; the usual directions are "fwd", "bwd", "pull", "push" and "sync".

Worked example, one step of a compressed output all-to-all::

    ledger.record("output_dist", sent=2048, received=2048, table="t0", original=4096)
    ledger.step_end()
    ledger.totals(category="output_dist").ratio    # 2.0 = original / sent
"""

from __future__ import annotations

import operator
import contextlib
import threading
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Literal

import torch

Key = tuple[str, str | None, str]
Scope = Literal["run", "step", "last_step", "predicted"]


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
    """Byte counters of every collective: counted per run and per step, and predicted.

    Thread-safe: the training thread and a background synchronizer thread may
    record at the same time.

    Scopes (see :meth:`totals`): "run" is everything recorded since the last
    :meth:`reset`; "step" the open step; "last_step" the step closed by the
    last :meth:`step_end`; "predicted" what :meth:`predict` was told, per step.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._suspended = 0  # > 0 inside suspended(): records are dropped
        self._run: dict[Key, ByteCount] = {}
        self._step: dict[Key, ByteCount] = {}
        self._last: dict[Key, ByteCount] = {}
        self._predicted: dict[Key, ByteCount] = {}
        self._steps = 0

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
        """Adds the planner's predicted on-the-wire bytes of one step.

        Calls with the same key add up (one step may run several collectives of
        a category, e.g. the lengths and the ids of input_dist). Predictions are
        kept apart from the counted bytes and survive :meth:`reset`'s ``counted_only``.
        """
        key = _key(category, table, direction)
        sent = _nbytes("sent", sent)
        inc = ByteCount(sent=sent, received=_nbytes("received", received), original=sent, calls=1)
        with self._lock:
            _add(self._predicted, key, inc)

    def step_end(self) -> None:
        """Closes the current step: it becomes "last_step" and a new one opens."""
        with self._lock:
            self._last = self._step
            self._step = {}
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
        if scope == "run":
            return self._run
        if scope == "step":
            return self._step
        if scope == "last_step":
            return self._last
        if scope == "predicted":
            return self._predicted
        raise ValueError(f"CommLedger: unknown scope {scope!r}")

    @contextlib.contextmanager
    def suspended(self):
        """Drops what is recorded inside the block (e.g. evaluation traffic, which is
        not part of a training step)."""
        with self._lock:
            self._suspended += 1
        try:
            yield
        finally:
            with self._lock:
                self._suspended -= 1

    def reset(self, *, counted_only: bool = False) -> None:
        """Clears the counters and the step count (and the predictions unless ``counted_only``)."""
        with self._lock:
            self._run, self._step, self._last = {}, {}, {}
            self._steps = 0
            if not counted_only:
                self._predicted = {}

    def summary(self) -> dict[str, Any]:
        """JSON-ready report of the ledger (ratios are None where nothing was sent).

        Layout::

            {"steps": int,
             "total": counts,                       # whole run
             "by_category" | "by_table" | "by_direction": {name: counts},
             "entries": [{"category", "table", "direction", **counts}, ...],
             "per_step": {"mean": {...}, "last": counts,
                          "mean_by_category": {...}, "last_by_category": {...}},
             "predicted_vs_counted": {category: {"predicted": counts,
                                                 "last_step": counts,
                                                 "mean_per_step": {...},
                                                 "match_last_step": bool}}}

        where ``counts`` is :meth:`ByteCount.to_dict`. Per-step means are over
        closed steps only, so a half-recorded open step does not skew them.
        """
        with self._lock:
            run, step, last = dict(self._run), dict(self._step), dict(self._last)
            predicted, steps = dict(self._predicted), self._steps
        closed = {k: run[k] - step.get(k, _ZERO) for k in run}
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
            "predicted_vs_counted": _compare(predicted, last, closed, steps),
        }


def _entries(counters: dict[Key, ByteCount]) -> list[dict[str, Any]]:
    """One row per (category, table, direction), sorted for stable output."""
    rows = sorted(counters.items(), key=lambda kv: (kv[0][0], kv[0][1] or "", kv[0][2]))
    return [
        {"category": c, "table": t, "direction": d, **count.to_dict()} for (c, t, d), count in rows
    ]


def _compare(
    predicted: dict[Key, ByteCount],
    last: dict[Key, ByteCount],
    closed: dict[Key, ByteCount],
    steps: int,
) -> dict[str, Any]:
    """Per predicted category: predicted bytes per step beside the counted ones."""
    pred_by, last_by, closed_by = _group(predicted, 0), _group(last, 0), _group(closed, 0)
    out: dict[str, Any] = {}
    for cat in sorted(pred_by):
        p, c = pred_by[cat], last_by.get(cat, _ZERO)
        out[cat] = {
            "predicted": {"sent": p.sent, "received": p.received},
            "last_step": {"sent": c.sent, "received": c.received},
            "mean_per_step": _mean(closed_by.get(cat, _ZERO), steps),
            "match_last_step": (p.sent, p.received) == (c.sent, c.received),
        }
    return out
