"""Synthetic Criteo-format click logs drawn from a planted teacher model.

The teacher is a logistic model a DLRM can represent::

    logit = b + sum_f w_f[id_f] + dense(x) + sum_{(f,g) in pairs} <v_f[id_f], v_g[id_g]>

- ``w_f``: per-feature, per-id biases (most of the signal), drawn with a
  per-feature strength; a missing value has its own bias (missingness informs).
- ``dense(x)``: linear effects of the standardized ``log(x+1)`` values plus two
  mild non-linear terms (an MLP learns them).
- ``v_f``: small latent factors (``latent_dim``) for a few feature pairs
  (FM-style interactions; the DLRM dot interaction covers them).
- multi-hot fields hold a bag of ids (about ``multi_hot`` of them) and sum the
  bias / factor of every id (the DLRM's sum pooling); per-id parameters are scaled
  by ``1/sqrt(multi_hot)`` so a field's contribution keeps its size.
- ``b`` is found by bisection on a sample so the click rate is ``target_ctr``.

Ids follow a truncated Zipf law per feature; cardinalities are Criteo Kaggle's
times ``scale`` (at least ``min(kaggle, 64)``, at most ``max_cardinality``). An id is
written as an 8-hex-digit value from a fixed random map index -> 32-bit value,
so modulo hashing collides as on real data. Dense raw values are log-normal
integer counts with Criteo-like missing rates (and a few negative values).

``teacher.json`` reports the teacher's AUC on the last day (true probabilities
vs sampled labels): the ceiling a learner can approach.

The output is a set of files written together: every day file and ``teacher.json`` go to
``NAME.tmp-<pid>`` first, and only when all are complete do they replace the earlier set
(its day files that the new set lacks removed, ``teacher.json`` renamed last). A failure
(a full disk, Ctrl-C) removes the temporaries and leaves the earlier files as they were;
replacing a set therefore needs room for both while it is written. Files of the directory
that are not ``day_*.tsv[.gz]`` or ``teacher.json`` are never touched.
"""

from __future__ import annotations

import dataclasses
import gzip as gzip_mod
import json
import os
import re
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from hybridrec.data.criteo import CATEGORICAL, DENSE
from hybridrec.data.shards import clear_stale_tmp, tmp_path
from hybridrec.errors import ConfigError, DataError, naming
from hybridrec.files import fsync_dir, fsync_file
from hybridrec.metrics.classification import auc

KAGGLE_CARDINALITIES = (
    1460, 583, 10131227, 2202608, 305, 24, 12517, 633, 3, 93145, 5683, 8351593, 3194,
    27, 14992, 5461306, 10, 5652, 2173, 4, 7046547, 18, 15, 286181, 105, 142572,
)  # fmt: skip
"""Distinct values of C1..C26 in Criteo Kaggle (the DLRM reference's table sizes)."""

# Approximate Criteo Kaggle missing rates, I1..I13 and C1..C26.
_DENSE_MISSING = (0.45, 0.0, 0.21, 0.22, 0.03, 0.22, 0.04, 0.0, 0.04, 0.45, 0.04, 0.77, 0.22)
_CAT_MISSING = (
    0, 0, 0.03, 0.03, 0, 0.12, 0, 0, 0, 0.03, 0, 0.03, 0,
    0, 0, 0.03, 0, 0, 0.44, 0.44, 0.03, 0.76, 0, 0.03, 0.44, 0.44,
)  # fmt: skip
_MAX_DENSE = 10**9 - 1  # 9 digits: a fixed-width formatting column
_DENSE_WIDTH = 12  # three 4-digit groups: sign + up to 9 digits
CHUNK_ROWS = 1 << 15


@dataclass(kw_only=True)
class SynthConfig:
    """Generator settings (everything that determines the output, with the seed)."""

    days: int = 7
    """Day files ``day_0.tsv .. day_{days-1}.tsv``; the last one is the usual eval day."""
    rows_per_day: int = 100_000
    """Rows per day file."""
    seed: int = 0
    """Fixes the teacher and every sampled row."""
    multi_hot: int = 0
    """0: one id per field. N > 0: multi-hot fields hold about N ids (1 + Poisson(N-1))."""
    multi_hot_fields: tuple[str, ...] | None = None
    """Which C-fields are multi-hot when ``multi_hot > 0`` (default: all 26)."""
    scale: float = 0.01
    """Cardinality = Kaggle's x scale (clipped to [min(kaggle, 64), max_cardinality])."""
    max_cardinality: int = 100_000
    """Upper bound of a feature's vocabulary."""
    zipf_exponent: float = 1.1
    """Id popularity ~ rank^-exponent (Criteo-like: 1.05-1.2)."""
    latent_dim: int = 4
    """Size of the interaction factors."""
    n_interactions: int = 6
    """Feature pairs with an FM-style interaction."""
    bias_scale: float = 0.5
    """Typical std of a strong feature's per-id bias (logit units)."""
    dense_scale: float = 0.35
    """Std of a dense feature's linear effect (per standardized unit)."""
    interaction_scale: float = 0.3
    """Std of one interaction term (between frequent ids)."""
    tail_rank: float = 500.0
    """Per-id effects shrink as 1/sqrt(1 + rank/tail_rank): rare ids carry less signal."""
    target_ctr: float = 0.25
    """Click rate the intercept is calibrated to (Criteo Kaggle: ~0.256)."""
    gzip: bool = False
    """Write ``day_i.tsv.gz`` (level 1) instead of plain TSV."""

    def __post_init__(self) -> None:
        if self.days < 1 or self.rows_per_day < 1:
            raise ConfigError("synth: days and rows_per_day must be >= 1")
        if self.multi_hot < 0 or self.latent_dim < 1 or self.max_cardinality < 2:
            raise ConfigError("synth: multi_hot >= 0, latent_dim >= 1, max_cardinality >= 2")
        if not 0.0 < self.target_ctr < 1.0 or self.zipf_exponent <= 0 or self.scale <= 0:
            raise ConfigError("synth: need 0 < target_ctr < 1, zipf_exponent > 0, scale > 0")
        if self.multi_hot_fields is not None:
            self.multi_hot_fields = tuple(self.multi_hot_fields)
            unknown = sorted(set(self.multi_hot_fields) - set(CATEGORICAL))
            if unknown:
                raise ConfigError(f"synth: multi_hot_fields {unknown} are not C1..C26")

    @property
    def multihot_names(self) -> tuple[str, ...]:
        if self.multi_hot == 0:
            return ()
        return self.multi_hot_fields if self.multi_hot_fields is not None else CATEGORICAL

    def cardinalities(self) -> list[int]:
        return [
            int(np.clip(round(k * self.scale), min(k, 64), self.max_cardinality))
            for k in KAGGLE_CARDINALITIES
        ]


def _sigmoid(z: np.ndarray) -> np.ndarray:
    return 0.5 * (1.0 + np.tanh(0.5 * z))  # overflow-free logistic


def hex_table(rng: np.random.Generator, n: int) -> tuple[np.ndarray, np.ndarray]:
    """``n`` distinct random 32-bit values and their 8 lowercase hex digits as bytes ``[n, 8]``."""
    values = np.zeros(0, np.int64)
    while values.size < n:  # distinct: two vocabulary entries never share a hash
        values = np.unique(np.concatenate([values, rng.integers(0, 2**32, n - values.size + 16)]))
    values = rng.permutation(values)[:n]
    shifts = np.arange(28, -4, -4, dtype=np.int64)
    nibbles = (values[:, None] >> shifts) & 0xF
    return values, np.frombuffer(b"0123456789abcdef", np.uint8)[nibbles]


class Teacher:
    """The planted model: parameters drawn from ``(seed, 0)``; rows sampled by :meth:`sample`."""

    def __init__(self, cfg: SynthConfig) -> None:
        self.cfg = cfg
        rng = np.random.default_rng([cfg.seed, 0])
        self.cards = cfg.cardinalities()
        self.multihot = [n in cfg.multihot_names for n in CATEGORICAL]
        pool = [1 / np.sqrt(cfg.multi_hot) if m else 1.0 for m in self.multihot]
        # Feature strengths spread over ~an order of magnitude, as in real logs.
        strength = cfg.bias_scale * np.exp(rng.uniform(np.log(0.15), 0.0, len(CATEGORICAL)))
        self.strength = strength  # (an id born later draws its bias with it: synth_stream)
        # Rare ids get smaller effects: a learner sees them too seldom to fit them, and
        # signal it cannot see would only widen the gap between teacher and learner.
        self.tail = [1.0 / np.sqrt(1.0 + np.arange(c) / cfg.tail_rank) for c in self.cards]
        self.bias = [
            rng.normal(0, s * p, c) * t for s, p, c, t in zip(strength, pool, self.cards, self.tail)
        ]
        self.missing_bias = rng.normal(0, strength)
        self.zipf_cdf = []
        for c in self.cards:
            w = np.arange(1, c + 1, dtype=np.float64) ** -cfg.zipf_exponent
            self.zipf_cdf.append(np.cumsum(w) / w.sum())
        self.hex_values, self.hex_bytes = zip(*(hex_table(rng, c) for c in self.cards))
        self.dense_mu = rng.uniform(0.3, 3.0, len(DENSE))
        self.dense_sigma = rng.uniform(0.7, 1.6, len(DENSE))
        self.dense_coef = rng.normal(0, cfg.dense_scale, len(DENSE))
        self.pairs, self.factors = self._draw_interactions(rng, pool)
        sample = self._dense_raw(np.random.default_rng([cfg.seed, 2]), 20_000)
        t = self._dense_log(sample)
        self.dense_mean, self.dense_std = t.mean(0), t.std(0) + 1e-6
        self.intercept = 0.0
        self.intercept = self._calibrate(np.random.default_rng([cfg.seed, 3]))

    def _draw_interactions(self, rng, pool):
        # Pairs among mid-sized features: enough ids to carry a factor, few enough that
        # their co-occurrences are seen often (a learner cannot fit pairs it rarely sees).
        eligible = [f for f, c in enumerate(self.cards) if 8 <= c <= 5000]
        if len(eligible) < 2:
            eligible = sorted(range(len(self.cards)), key=lambda f: self.cards[f])[:4]
        all_pairs = [(a, b) for i, a in enumerate(eligible) for b in eligible[i + 1 :]]
        k = min(self.cfg.n_interactions, len(all_pairs))
        pairs = [all_pairs[i] for i in sorted(rng.choice(len(all_pairs), k, replace=False))]
        # Var(<u, v>) = dim * s^4 for iid N(0, s^2) entries: pick s for the wanted term std.
        s = self.factor_scale = (self.cfg.interaction_scale**2 / self.cfg.latent_dim) ** 0.25
        factors = {
            f: rng.normal(0, s * pool[f], (self.cards[f], self.cfg.latent_dim))
            * self.tail[f][:, None]
            for f in sorted({f for p in pairs for f in p})
        }
        return pairs, factors

    def _dense_raw(self, rng: np.random.Generator, n: int) -> np.ndarray:
        """Integer counts, ``-9`` marks missing (the writer leaves those fields empty)."""
        x = np.floor(rng.lognormal(self.dense_mu, self.dense_sigma, (n, len(DENSE))))
        x = np.minimum(x, _MAX_DENSE).astype(np.int64)
        neg = rng.random(n) < 0.08  # like Criteo's I2: a few small negative values
        x[neg, 1] = -rng.integers(1, 4, int(neg.sum()))
        x[rng.random((n, len(DENSE))) < np.array(_DENSE_MISSING)] = -9
        return x

    @staticmethod
    def _dense_log(x: np.ndarray) -> np.ndarray:
        """What preprocessing makes of the raw values: missing/negative -> 0, log(x+1)."""
        return np.log1p(np.maximum(x, 0).astype(np.float64))

    def _calibrate(self, rng: np.random.Generator) -> float:
        z = self._logit(self._draw(rng, 50_000))
        lo, hi = -30.0, 30.0
        for _ in range(60):  # mean sigmoid is increasing in the intercept
            mid = 0.5 * (lo + hi)
            if _sigmoid(z + mid).mean() < self.cfg.target_ctr:
                lo = mid
            else:
                hi = mid
        return 0.5 * (lo + hi)

    def _draw(self, rng: np.random.Generator, n: int) -> dict:
        """Raw features of ``n`` rows: dense counts and per-field id indices (-1 missing)."""
        cats = []
        for f, card in enumerate(self.cards):
            missing = rng.random(n) < _CAT_MISSING[f]
            if self.multihot[f]:
                m = self.cfg.multi_hot
                lengths = np.minimum(1 + rng.poisson(m - 1, n), 3 * m)
                lengths[missing] = 0
                ids = np.searchsorted(self.zipf_cdf[f], rng.random(int(lengths.sum())), "right")
                cats.append((np.minimum(ids, card - 1), lengths))
            else:
                ids = np.searchsorted(self.zipf_cdf[f], rng.random(n), "right")
                cats.append(np.where(missing, -1, np.minimum(ids, card - 1)))
        return {"n": n, "dense": self._dense_raw(rng, n), "cats": cats}

    def _logit(self, rows: dict) -> np.ndarray:
        n = rows["n"]
        s = (self._dense_log(rows["dense"]) - self.dense_mean) / self.dense_std
        z = self.intercept + s @ self.dense_coef
        z += 0.3 * np.tanh(s[:, 0] * s[:, 1]) + 0.3 * np.tanh(s[:, 2] - 1.0)
        pooled = {}
        for f, c in enumerate(rows["cats"]):
            if self.multihot[f]:
                ids, lengths = c
                row = np.repeat(np.arange(n), lengths)
                z += np.bincount(row, self.bias[f][ids], n)
                z += np.where(lengths == 0, self.missing_bias[f], 0.0)
                if f in self.factors:
                    v = self.factors[f][ids]
                    pooled[f] = np.stack(
                        [np.bincount(row, v[:, d], n) for d in range(v.shape[1])], 1
                    )
            else:
                present = c >= 0
                z += np.where(present, self.bias[f][np.maximum(c, 0)], self.missing_bias[f])
                if f in self.factors:
                    pooled[f] = np.where(present[:, None], self.factors[f][np.maximum(c, 0)], 0.0)
        for a, b in self.pairs:
            z += np.einsum("nd,nd->n", pooled[a], pooled[b])
        return z

    def sample(self, rng: np.random.Generator, n: int) -> tuple[dict, np.ndarray, np.ndarray]:
        """``(raw rows, click probabilities, sampled 0/1 labels)``."""
        rows = self._draw(rng, n)
        p = _sigmoid(self._logit(rows))
        return rows, p, (rng.random(n) < p).astype(np.uint8)


# "0000".."9999" as little-endian uint32: one 4-byte store per group of four digits.
_DIGITS4 = np.array([list(b"%04d" % i) for i in range(10_000)], np.uint8).view("<u4")[:, 0]
_POW10 = 10 ** np.arange(1, 10, dtype=np.int64)


def _format_ints(x: np.ndarray, out: np.ndarray, valid: np.ndarray) -> None:
    """Decimal text of ints ``[n, c]``, right-aligned in ``[n, c, 12]`` byte columns, + valid mask.

    Three table lookups of 4-digit groups instead of a division per digit.
    Missing values (-9) get no valid byte.
    """
    a = np.abs(x)
    groups = out.view("<u4")  # [n, c, 3]
    groups[..., 0] = _DIGITS4[a // 10**8 % 10_000]
    groups[..., 1] = _DIGITS4[a // 10**4 % 10_000]
    groups[..., 2] = _DIGITS4[a % 10_000]
    first = out.shape[-1] - 1 - np.searchsorted(_POW10, a, side="right")  # leading digit column
    np.greater_equal(np.arange(out.shape[-1]), first[..., None], out=valid)
    neg = np.nonzero(x < 0)  # rare: index them instead of a full-size mask
    out[(*neg, first[neg] - 1)] = ord("-")
    valid[(*neg, first[neg] - 1)] = True
    valid[x == -9] = False


def _bags(table: np.ndarray, ids: np.ndarray, lengths: np.ndarray, width: int):
    """Comma-separated hex ids per row: bytes ``[n, 9 * width]`` and a valid mask."""
    n = lengths.size
    mat = np.full((n, width, 9), ord(","), np.uint8)
    row = np.repeat(np.arange(n), lengths)
    slot = np.arange(ids.size) - np.repeat(np.cumsum(lengths) - lengths, lengths)
    mat[row, slot, :8] = table[ids]
    valid = np.arange(width * 9) < (lengths * 9 - 1)[:, None]  # no comma after the last id
    return mat.reshape(n, width * 9), valid


def format_tsv(teacher: Teacher, rows: dict, labels: np.ndarray) -> bytes:
    """Criteo TSV lines of sampled rows, built as one byte matrix + a mask of real bytes.

    Every field sits in a fixed-width column block (a tab before it); compressing
    the matrix with the mask (row-major) drops the padding and leaves the lines.
    """
    n, dense, cats = rows["n"], rows["dense"], rows["cats"]
    nd = dense.shape[1]
    widths = [
        8 if not teacher.multihot[f] else 9 * max(int(c[1].max(initial=0)), 1)
        for f, c in enumerate(cats)
    ]
    total = 2 + nd * (1 + _DENSE_WIDTH) + sum(widths) + len(widths)
    mat = np.full((n, total), 9, np.uint8)  # tabs everywhere not overwritten below
    mask = np.ones((n, total), bool)
    mat[:, 0] = labels + np.uint8(48)
    digits = np.empty((n, nd, _DENSE_WIDTH), np.uint8)
    valid = np.empty((n, nd, _DENSE_WIDTH), bool)
    _format_ints(dense, digits, valid)
    col = 1
    for j in range(nd):  # each field: its tab, then its bytes
        mat[:, col + 1 : col + 1 + _DENSE_WIDTH] = digits[:, j]
        mask[:, col + 1 : col + 1 + _DENSE_WIDTH] = valid[:, j]
        col += 1 + _DENSE_WIDTH
    for f, c in enumerate(cats):
        a, b = col + 1, col + 1 + widths[f]
        if teacher.multihot[f]:
            mat[:, a:b], mask[:, a:b] = _bags(teacher.hex_bytes[f], *c, widths[f] // 9)
        else:
            mat[:, a:b] = teacher.hex_bytes[f][np.maximum(c, 0)]
            mask[:, a:b] = (c >= 0)[:, None]
        col = b
    mat[:, -1] = 10
    return mat[mask].tobytes()


def teacher_log_loss(labels: np.ndarray, p: np.ndarray) -> float:
    p = np.clip(p, 1e-12, 1 - 1e-12)
    return float(-np.mean(labels * np.log(p) + (1 - labels) * np.log1p(-p)))


_OUTPUTS = re.compile(r"day_\d+\.tsv(\.gz)?|teacher\.json")


def _prepare_out(out: Path, overwrite: bool) -> None:
    """Refusals before anything is written; the earlier files are replaced by :func:`_commit`."""
    if out.exists() and not out.is_dir():
        raise DataError(f"{out}: exists and is not a directory")
    clear_stale_tmp(out, lambda name: _OUTPUTS.fullmatch(name) is not None)
    if out.exists() and any(out.iterdir()) and not overwrite:
        raise DataError(f"{out}: not empty (use --overwrite to replace its day files)")
    out.mkdir(parents=True, exist_ok=True)


def _commit(out: Path, written: list[str]) -> None:
    """Every complete temporary of ``written`` renamed into place, ``teacher.json`` last;
    first the earlier ``teacher.json`` and the earlier day files ``written`` lacks are
    removed (a crash in between leaves no ``teacher.json`` describing other days)."""
    for name in written:
        fsync_file(tmp_path(out / name))
    (out / "teacher.json").unlink(missing_ok=True)
    for p in out.iterdir():
        if _OUTPUTS.fullmatch(p.name) and p.name not in written:
            p.unlink(missing_ok=True)
    for name in sorted(written, key=lambda n: n == "teacher.json"):
        os.replace(tmp_path(out / name), out / name)
    fsync_dir(out)


def _write_day(teacher: Teacher, path: Path, day: int, keep: bool) -> tuple[int, list]:
    """Write one day file to its temporary name (renamed by :func:`_commit`); returns
    (clicks, [(p, labels)] if keep)."""
    cfg = teacher.cfg
    clicks, kept = 0, []
    tmp = tmp_path(path)
    # Level 1: gzip is otherwise the bottleneck of generation.
    with naming(path), gzip_mod.open(tmp, "wb", compresslevel=1) if cfg.gzip else open(tmp, "wb") as f:
        for i, lo in enumerate(range(0, cfg.rows_per_day, CHUNK_ROWS)):
            n = min(CHUNK_ROWS, cfg.rows_per_day - lo)
            rng = np.random.default_rng([cfg.seed, 1, day, i])
            rows, p, labels = teacher.sample(rng, n)
            f.write(format_tsv(teacher, rows, labels))
            clicks += int(labels.sum())
            if keep:
                kept.append((p, labels))
    return clicks, kept


def generate(
    out_dir: str | os.PathLike,
    *,
    days: int = 7,
    rows_per_day: int = 100_000,
    seed: int = 0,
    multi_hot: int = 0,
    scale: float = 0.01,
    gzip: bool = False,
    overwrite: bool = False,
    **options,
) -> dict:
    """Write ``day_0.tsv .. day_{days-1}.tsv`` (+ ``.gz``) and ``teacher.json``; return the report.

    ``options``: the other :class:`SynthConfig` fields (``max_cardinality``,
    ``zipf_exponent``, ``multi_hot_fields``, ``target_ctr``, ...).
    """
    start = time.perf_counter()
    cfg = SynthConfig(
        days=days,
        rows_per_day=rows_per_day,
        seed=seed,
        multi_hot=multi_hot,
        scale=scale,
        gzip=gzip,
        **options,
    )
    out = Path(out_dir)
    _prepare_out(out, overwrite)
    teacher = Teacher(cfg)
    files = [f"day_{day}.tsv" + (".gz" if cfg.gzip else "") for day in range(cfg.days)]
    try:
        report = _write_all(teacher, out, files, start)
        _commit(out, [*files, "teacher.json"])
    except BaseException:
        for name in [*files, "teacher.json"]:
            tmp_path(out / name).unlink(missing_ok=True)
        raise
    return report


def _write_all(teacher: Teacher, out: Path, files: list[str], start: float) -> dict:
    """The day files and ``teacher.json`` under their temporary names; returns the report."""
    cfg = teacher.cfg
    clicks, last = 0, []
    for day, name in enumerate(files):
        c, kept = _write_day(teacher, out / name, day, keep=day == cfg.days - 1)
        clicks += c
        last += kept
    p = np.concatenate([k[0] for k in last])
    y = np.concatenate([k[1] for k in last])
    base = float(y.mean())
    entropy = -(base * np.log(base) + (1 - base) * np.log(1 - base)) if 0 < base < 1 else 1.0
    rows = cfg.days * cfg.rows_per_day
    seconds = time.perf_counter() - start
    report = {
        "teacher_auc": auc(y, p),
        "teacher_logloss": teacher_log_loss(y, p),
        "teacher_ne": float(teacher_log_loss(y, p) / entropy),
        "ctr": clicks / rows,
        "ctr_last_day": base,
        "rows": rows,
        "files": files,
        "eval_file": files[-1],
        "intercept": teacher.intercept,
        "cardinalities": dict(zip(CATEGORICAL, teacher.cards)),
        "multi_hot_fields": list(cfg.multihot_names),
        "interaction_pairs": [[CATEGORICAL[a], CATEGORICAL[b]] for a, b in teacher.pairs],
        "config": dataclasses.asdict(cfg),
        "seconds": round(seconds, 3),
        "rows_per_second": round(rows / seconds),
    }
    with naming(out / "teacher.json"):
        tmp_path(out / "teacher.json").write_text(json.dumps(report, indent=2) + "\n")
    return report
