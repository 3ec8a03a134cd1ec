"""Dense columns' transforms, one per column: ``log1p``, ``log1p_standardize``,
``standardize`` or ``none``.

A reader parses a dense value into a float64, a missing one (an empty cell, null, NaN) into
NaN; the transform then makes the model's float32 input, every missing value 0 *after* the
transform:

- ``log1p``: ``log(1 + max(x, 0))`` (Criteo's counts; a negative count is 0);
- ``standardize``: ``(x - mean) / std`` with the column's mean and (population) standard
  deviation over the train split, so a missing value is the mean;
- ``log1p_standardize``: ``log1p``, then standardized with the mean and std of the
  train split's ``log1p`` values;
- ``none``: ``x``.

All in float64, then float32: the same operations wherever raw values are transformed
(preprocessing, ``--like``, ``hybridrec predict`` and ``serve``, the export's score.py), so
the same raw row gives the same bits.

**Choosing.** A schema file's ``dense_transform`` (default ``auto``) is one choice for every
column or ``{column: choice, "*": default}``; a choice is ``auto``, one of the four, or
``{"transform": "standardize" | "log1p_standardize", "mean": M, "std": S}``. ``auto`` is
decided from the column's values over the train split in the preprocessing pass: a count
(every present value a non-negative integer) gets ``log1p_standardize``, any other column
``standardize`` (on UCI Adult, whose six numeric columns are all counts, ``log1p`` alone
left them uncentred, fnlwgt's near 12: the default model's held-out AUC 0.9003 against
0.9071 with ``auto`` and 0.9116 with ``standardize`` for every column; docs/experiments/
defaults.md). ``standardize`` and ``log1p_standardize`` without numbers take the train
split's.

**meta.json** (``preprocessing.dense_transform``): ``"log1p"`` (or ``"none"``) when every
column has it (Criteo's datasets, and every dataset of earlier versions), else
``{column: "log1p" | "none" | {"transform": "standardize" | "log1p_standardize", "mean": M,
"std": S}}``, every column named. The export's spec.json carries the same value.

**Without a preprocessing pass** (``data.stream``): ``auto`` is ``log1p``, and
``standardize`` and ``log1p_standardize`` need their numbers in the schema file.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from hybridrec.errors import DataError

TRANSFORMS = ("log1p", "log1p_standardize", "standardize", "none")
SCALED = ("standardize", "log1p_standardize")
"""The transforms with numbers (a mean and std)."""
CHOICES = ("auto", *TRANSFORMS)


@dataclass(frozen=True)
class Column:
    """One column's transform, with its numbers for ``standardize``."""

    how: str
    mean: float = 0.0
    std: float = 1.0

    def entry(self) -> Any:
        """meta.json's entry of the column."""
        if self.how in SCALED:
            return {"transform": self.how, "mean": self.mean, "std": self.std}
        return self.how


Plan = list[Any]
"""Per column a :class:`Column` or a choice still to make from the values (``auto``, or
``standardize`` / ``log1p_standardize`` without numbers)."""


def parse(value: Any, names: Sequence[str], where: str) -> Plan:
    """A schema's (or meta.json's) ``dense_transform`` as a plan for the columns ``names``."""
    if value is None:
        value = "auto"
    if not isinstance(value, dict):
        return [_choice(value, names[j], where) for j in range(len(names))] if names else []
    unknown = sorted(set(value) - set(names) - {"*"})
    if unknown:
        raise DataError(f"{where}: dense_transform names {unknown}, which are not dense columns "
                        f"({', '.join(names) or 'none'})")
    default = value.get("*", "auto")
    return [_choice(value.get(n, default), n, where) for n in names]


def _choice(v: Any, name: str, where: str) -> Any:
    if isinstance(v, str):
        if v not in CHOICES:
            raise DataError(f"{where}: dense_transform of {name}: {v!r} is not one of {CHOICES}")
        return Column(v) if v in ("log1p", "none") else v
    if isinstance(v, dict) and v.get("transform") in ("log1p", "none") and set(v) == {"transform"}:
        return Column(v["transform"])
    if isinstance(v, dict) and v.get("transform") in SCALED and set(v) <= {"transform", "mean", "std"}:
        how, mean, std = v["transform"], v.get("mean"), v.get("std")
        if mean is None and std is None:
            return how
        if not (_finite(mean) and _finite(std) and std > 0):
            raise DataError(f"{where}: dense_transform of {name}: {how} needs a finite mean and "
                            f"a std > 0, got mean {mean!r}, std {std!r}")
        return Column(how, float(mean), float(std))
    raise DataError(f"{where}: dense_transform of {name}: {v!r} is not one of {CHOICES} or "
                    '{"transform": "standardize" | "log1p_standardize", "mean": M, "std": S}')


def _finite(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def resolved(plan: Plan) -> list[Column] | None:
    """The plan's columns when no choice is left to the values, else None."""
    return list(plan) if all(isinstance(c, Column) for c in plan) else None


def without_stats(plan: Plan, names: Sequence[str], where: str) -> list[Column]:
    """The plan where there is no preprocessing pass (a stream): ``auto`` is ``log1p``;
    ``standardize`` without its numbers is refused."""
    out = []
    for c, name in zip(plan, names):
        if c in SCALED:
            raise DataError(f"{where}: dense column {name}: {c} needs its numbers here (no "
                            f'preprocessing pass computes them): give {{"transform": "{c}", '
                            '"mean": M, "std": S}')
        out.append(Column("log1p") if c == "auto" else c)
    return out


def from_meta(value: Any, names: Sequence[str], where: str) -> list[Column]:
    """The columns' transforms a dataset (or an export) was made with. A missing entry is
    ``log1p``, as every dataset of earlier versions was made."""
    cols = resolved(parse("log1p" if value is None else value, names, where))
    if cols is None:
        raise DataError(f"{where}: dense_transform {value!r} does not say every column's transform "
                        "and numbers (it is not one preprocessing wrote)")
    return cols


def to_meta(columns: Sequence[Column], names: Sequence[str]) -> Any:
    """meta.json's ``dense_transform``: one word when every column has it (and for no column,
    ``log1p``, as before), else ``{column: entry}``."""
    kinds = {c.how for c in columns}
    if not columns or kinds == {"log1p"}:
        return "log1p"
    if kinds == {"none"}:
        return "none"
    return {n: c.entry() for n, c in zip(names, columns)}


def agrees(plan: Plan, columns: Sequence[Column]) -> bool:
    """Whether a schema's plan allows ``columns`` (a dataset's): ``auto`` allows any,
    ``standardize`` (``log1p_standardize``) itself with any numbers, a fixed transform only
    itself."""
    for p, c in zip(plan, columns):
        if p == "auto":
            continue
        if p in SCALED and c.how == p:
            continue
        if p != c:
            return False
    return True


def apply(values: np.ndarray, columns: Sequence[Column] | None) -> np.ndarray:
    """Raw float64 values ``[n, len(columns)]`` (NaN missing) -> float32 model inputs, every
    missing value 0 after the transform. ``columns`` None: the raw values as they are (the
    statistics pass)."""
    if columns is None:
        return np.asarray(values, dtype=np.float64)
    x = np.array(values, dtype=np.float64)
    missing = np.isnan(x)
    for j, c in enumerate(columns):
        if c.how in ("log1p", "log1p_standardize"):
            x[:, j] = np.log1p(np.maximum(x[:, j], 0.0))
        if c.how in SCALED:
            x[:, j] = (x[:, j] - c.mean) / c.std
    x[missing] = 0.0
    return x.astype(np.float32)


class _Moments:
    """Present values' count, mean and spread per column, merged chunk by chunk (Chan et al.)."""

    def __init__(self, width: int) -> None:
        self.n = np.zeros(width, np.int64)
        self.mean = np.zeros(width, np.float64)
        self.m2 = np.zeros(width, np.float64)

    def add(self, j: int, v: np.ndarray) -> None:
        n, m = v.size, float(v.mean())
        m2 = float(((v - m) ** 2).sum())
        total = self.n[j] + n
        delta = m - self.mean[j]
        self.m2[j] += m2 + delta * delta * self.n[j] * n / total
        self.mean[j] += delta * n / total
        self.n[j] = total

    def column(self, how: str, j: int) -> Column:
        """``how`` with column ``j``'s numbers (a constant or empty column: std 1)."""
        std = math.sqrt(self.m2[j] / self.n[j]) if self.n[j] else 0.0
        return Column(how, float(self.mean[j]), std if std > 0 else 1.0)


class Stats:
    """Over the train split, per column: the present values' mean and spread, those of their
    ``log1p``, and whether every one is a non-negative integer (a count)."""

    def __init__(self, width: int) -> None:
        self.raw, self.logs = _Moments(width), _Moments(width)
        self.counts = np.ones(width, bool)

    def add(self, values: np.ndarray) -> None:
        for j in range(values.shape[1]):
            v = values[:, j]
            v = v[~np.isnan(v)]
            if v.size == 0:
                continue
            self.counts[j] &= bool(np.all(v >= 0) and np.all(v == np.floor(v)))
            self.raw.add(j, v)
            self.logs.add(j, np.log1p(np.maximum(v, 0.0)))

    def resolve(self, plan: Plan) -> list[Column]:
        """The plan with each choice made: ``auto`` a count's ``log1p_standardize``, else
        ``standardize``; each with the column's numbers."""
        out = []
        for j, c in enumerate(plan):
            if isinstance(c, Column):
                out.append(c)
                continue
            how = ("log1p_standardize" if self.counts[j] else "standardize") if c == "auto" else c
            out.append((self.logs if how == "log1p_standardize" else self.raw).column(how, j))
        return out
