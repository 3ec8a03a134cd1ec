"""Dense columns' transforms, one per column: ``log1p``, ``standardize`` or ``none``.

A reader parses a dense value into a float64, a missing one (an empty cell, null, NaN) into
NaN; the transform then makes the model's float32 input, every missing value 0 *after* the
transform:

- ``log1p``: ``log(1 + max(x, 0))`` (Criteo's counts; a negative count is 0);
- ``standardize``: ``(x - mean) / std`` with the column's mean and (population) standard
  deviation over the train split, so a missing value is the mean;
- ``none``: ``x``.

All in float64, then float32: the same operations wherever raw values are transformed
(preprocessing, ``--like``, ``hybridrec predict`` and ``serve``, the export's score.py), so
the same raw row gives the same bits.

**Choosing.** A schema file's ``dense_transform`` (default ``auto``) is one choice for every
column or ``{column: choice, "*": default}``; a choice is ``auto``, ``log1p``,
``standardize``, ``none`` or ``{"transform": "standardize", "mean": M, "std": S}``. ``auto``
is decided from the column's values over the train split in the preprocessing pass: a count
(every present value a non-negative integer) gets ``log1p``, any other column
``standardize``. ``standardize`` without numbers takes the train split's.

**meta.json** (``preprocessing.dense_transform``): ``"log1p"`` (or ``"none"``) when every
column has it (Criteo's datasets, and every dataset of earlier versions), else
``{column: "log1p" | "none" | {"transform": "standardize", "mean": M, "std": S}}``, every
column named. The export's spec.json carries the same value.

**Without a preprocessing pass** (``data.stream``): ``auto`` is ``log1p`` and ``standardize``
needs its numbers in the schema file.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from hybridrec.errors import DataError

TRANSFORMS = ("log1p", "standardize", "none")
CHOICES = ("auto", *TRANSFORMS)


@dataclass(frozen=True)
class Column:
    """One column's transform, with its numbers for ``standardize``."""

    how: str
    mean: float = 0.0
    std: float = 1.0

    def entry(self) -> Any:
        """meta.json's entry of the column."""
        if self.how == "standardize":
            return {"transform": "standardize", "mean": self.mean, "std": self.std}
        return self.how


Plan = list[Any]
"""Per column a :class:`Column` or a choice still to make from the values (``auto``, or
``standardize`` without its numbers)."""


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
    if isinstance(v, dict) and v.get("transform") == "standardize" and set(v) <= {"transform", "mean", "std"}:
        mean, std = v.get("mean"), v.get("std")
        if mean is None and std is None:
            return "standardize"
        if not (_finite(mean) and _finite(std) and std > 0):
            raise DataError(f"{where}: dense_transform of {name}: standardize needs a finite mean and "
                            f"a std > 0, got mean {mean!r}, std {std!r}")
        return Column("standardize", float(mean), float(std))
    raise DataError(f"{where}: dense_transform of {name}: {v!r} is not one of {CHOICES} or "
                    '{"transform": "standardize", "mean": M, "std": S}')


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
        if c == "standardize":
            raise DataError(f"{where}: dense column {name}: standardize needs its numbers here (no "
                            'preprocessing pass computes them): give {"transform": "standardize", '
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
    ``standardize`` any numbers, a fixed transform only itself."""
    for p, c in zip(plan, columns):
        if p == "auto":
            continue
        if p == "standardize" and c.how == "standardize":
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
        if c.how == "log1p":
            x[:, j] = np.log1p(np.maximum(x[:, j], 0.0))
        elif c.how == "standardize":
            x[:, j] = (x[:, j] - c.mean) / c.std
    x[missing] = 0.0
    return x.astype(np.float32)


class Stats:
    """Over the train split, per column: present values, their mean and spread (merged chunk
    by chunk, Chan et al.), and whether every one is a non-negative integer."""

    def __init__(self, width: int) -> None:
        self.n = np.zeros(width, np.int64)
        self.mean = np.zeros(width, np.float64)
        self.m2 = np.zeros(width, np.float64)
        self.counts = np.ones(width, bool)

    def add(self, values: np.ndarray) -> None:
        for j in range(values.shape[1]):
            v = values[:, j]
            v = v[~np.isnan(v)]
            if v.size == 0:
                continue
            self.counts[j] &= bool(np.all(v >= 0) and np.all(v == np.floor(v)))
            n, m = v.size, float(v.mean())
            m2 = float(((v - m) ** 2).sum())
            total = self.n[j] + n
            delta = m - self.mean[j]
            self.m2[j] += m2 + delta * delta * self.n[j] * n / total
            self.mean[j] += delta * n / total
            self.n[j] = total

    def resolve(self, plan: Plan) -> list[Column]:
        """The plan with each choice made: ``auto`` a count's ``log1p``, else ``standardize``
        with the column's numbers (a constant or empty column: std 1)."""
        out = []
        for j, c in enumerate(plan):
            if isinstance(c, Column):
                out.append(c)
                continue
            if c == "auto" and self.counts[j]:
                out.append(Column("log1p"))
                continue
            std = math.sqrt(self.m2[j] / self.n[j]) if self.n[j] else 0.0
            out.append(Column("standardize", float(self.mean[j]), std if std > 0 else 1.0))
        return out
