"""A drifting stream of synthetic Criteo hours: ids are born and die (``data synth --stream``).

The teacher is :mod:`hybridrec.data.synth`'s (:class:`~hybridrec.data.synth.Teacher`: per-id
biases, dense effects, FM-style factors for a few feature pairs, an intercept calibrated to
the click rate), with one change: its per-id parameters belong to *ids*, not to popularity
ranks, and the ids change.

- Every categorical feature has a population of live ids, as many as the feature's
  cardinality (Criteo Kaggle's x ``scale``, capped by ``max_cardinality``; constant over
  time). Hour 0's population is the batch teacher's vocabulary, id ``i`` at popularity rank
  ``i``.
- Before each later hour, every feature loses a fraction ``drift`` of its live ids
  (``floor(drift * live + u)`` of them, ``u`` uniform: small features drift too), chosen
  uniformly among the ranks; as many new ids are born into the vacated ranks (new ids enter
  at random popularity ranks). A new id gets a key never used before in its feature and its
  own parameters, drawn at birth as the teacher draws them for that rank (bias, and factors
  for a feature of an interacting pair). An id that died never returns.
- Rows draw a rank per feature from the teacher's Zipf law over the live ids and take the
  id holding it. The intercept is calibrated again each hour (the click rate stays at
  ``target_ctr`` instead of wandering with the biases of the popular ids that die).

So a learner that keeps one row per live id does best, one that freezes the first hour's
vocabulary degrades as its ids die, and modulo hashing collides as on real data.

Hour ``h`` depends on the seed and ``h`` only (not on ``hours``): a longer stream starts
with the same files. Files land as objects do in a store: each is written to
``.hour_NNNN.tsv.tmp``, fsynced and renamed to ``hour_NNNN.tsv``, in order; ``stream.json``
(the per-hour report) is rewritten atomically after each landing. Multi-hot fields are not
generated (every field holds one id or none).
"""

from __future__ import annotations

import dataclasses
import gzip as gzip_mod
import os
import re
import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from hybridrec.data.criteo import CATEGORICAL
from hybridrec.data.synth import (
    CHUNK_ROWS,
    SynthConfig,
    Teacher,
    format_tsv,
    hex_table,
    teacher_log_loss,
)
from hybridrec.errors import ConfigError, DataError, HybridrecWarning, naming
from hybridrec.files import fsync_dir, write_json_atomic
from hybridrec.metrics.classification import auc

DEFAULT_SCALE = 0.003
"""The stream's default ``scale``: 101,952 live ids (a 12-hour stream of 50,000 rows an hour
shows ~147k distinct ids; docs/data-format.md)."""
REPORT = "stream.json"
_HOUR = re.compile(r"hour_\d{4,}\.tsv(\.gz)?")
_HOUR_TMP = re.compile(r"\.hour_\d{4,}\.tsv(\.gz)?\.tmp")


@dataclass(kw_only=True)
class StreamConfig:
    """What determines the stream besides the teacher's settings (:class:`SynthConfig`)."""

    hours: int = 24
    """Hour files ``hour_0000.tsv .. hour_{hours-1}``."""
    rows_per_hour: int = 100_000
    """Rows per hour file."""
    drift: float = 0.1
    """Fraction of every feature's live ids that dies (and is replaced by new ids) each hour."""
    land_every: float = 0.0
    """Seconds between two landings, measured from the start (0: as fast as written)."""
    gzip: bool = False
    """Write ``hour_NNNN.tsv.gz`` (level 1, no time stamp: deterministic bytes)."""

    def __post_init__(self) -> None:
        if self.hours < 1 or self.rows_per_hour < 1:
            raise ConfigError("synth --stream: --hours and --rows-per-hour must be >= 1")
        if not 0.0 <= self.drift < 1.0:
            raise ConfigError(f"synth --stream: --drift {self.drift} is not in [0, 1)")
        if not self.land_every >= 0.0:
            raise ConfigError(f"synth --stream: --land-every {self.land_every} is negative")

    def file_name(self, hour: int) -> str:
        width = max(4, len(str(self.hours - 1)))  # name order is hour order
        return f"hour_{hour:0{width}d}.tsv" + (".gz" if self.gzip else "")


class StreamTeacher(Teacher):
    """:class:`Teacher` whose per-id parameters are indexed by id (every id ever born, in
    birth order) and whose ranks map to the live ids (:attr:`live`); :meth:`advance` moves
    to the next hour's population."""

    def __init__(self, cfg: SynthConfig) -> None:
        if cfg.multi_hot:
            raise ConfigError("synth --stream: multi-hot fields are not generated in a stream")
        self.live: list[np.ndarray] | None = None  # (Teacher's calibration draws ranks = ids)
        super().__init__(cfg)
        self.hex_values, self.hex_bytes = list(self.hex_values), list(self.hex_bytes)
        self.live = [np.arange(c) for c in self.cards]
        self.used = [np.sort(v) for v in self.hex_values]  # every key given out, sorted
        self.seen = [np.zeros(c, bool) for c in self.cards]  # born ids that appeared in a row
        self.hour = 0

    @property
    def born(self) -> list[int]:
        """Ids born so far per feature (hour 0's population included)."""
        return [v.size for v in self.hex_values]

    def _draw(self, rng: np.random.Generator, n: int) -> dict:
        rows = super()._draw(rng, n)
        if self.live is not None:  # popularity ranks -> the live ids holding them
            rows["cats"] = [
                np.where(c >= 0, live[np.maximum(c, 0)], -1) for c, live in zip(rows["cats"], self.live)
            ]
        return rows

    def advance(self, drift: float) -> list[int]:
        """Hour ``hour + 1``'s population: ``drift`` of each feature's live ids die, as many are
        born at their ranks (drawn from ``(seed, 4, hour, feature)``), and the intercept that
        keeps the click rate at ``target_ctr``. Returns the births per feature."""
        self.hour += 1
        births = []
        for f, card in enumerate(self.cards):
            rng = np.random.default_rng([self.cfg.seed, 4, self.hour, f])
            k = min(card, int(np.floor(drift * card + rng.random())))
            ranks = np.sort(rng.choice(card, k, replace=False))
            values, digits = self._fresh_keys(rng, f, k)
            tail = self.tail[f][ranks]
            self.bias[f] = np.concatenate([self.bias[f], rng.normal(0, self.strength[f], k) * tail])
            if f in self.factors:
                new = rng.normal(0, self.factor_scale, (k, self.cfg.latent_dim)) * tail[:, None]
                self.factors[f] = np.concatenate([self.factors[f], new])
            self.live[f][ranks] = self.hex_values[f].size + np.arange(k)
            self.hex_values[f] = np.concatenate([self.hex_values[f], values])
            self.hex_bytes[f] = np.concatenate([self.hex_bytes[f], digits])
            self.seen[f] = np.concatenate([self.seen[f], np.zeros(k, bool)])
            births.append(k)
        # The click rate would random-walk with the popular ids' biases: the intercept is
        # calibrated again on the new population (Teacher's bisection, from (seed, 3, hour)).
        self.intercept = 0.0
        self.intercept = self._calibrate(np.random.default_rng([self.cfg.seed, 3, self.hour]))
        return births

    def _fresh_keys(self, rng: np.random.Generator, f: int, k: int) -> tuple[np.ndarray, np.ndarray]:
        """``k`` distinct keys of feature ``f`` never given out before (values, hex bytes)."""
        values, digits = np.zeros(0, np.int64), np.zeros((0, 8), np.uint8)
        while values.size < k:
            v, d = hex_table(rng, k - values.size + 16)
            used = self.used[f]
            fresh = used[np.minimum(np.searchsorted(used, v), used.size - 1)] != v
            fresh &= ~np.isin(v, values)
            values, digits = np.concatenate([values, v[fresh]]), np.concatenate([digits, d[fresh]])
        values, digits = values[:k], digits[:k]
        self.used[f] = np.sort(np.concatenate([self.used[f], values]))
        return values, digits

    def sample_hour(self, rows_per_hour: int):
        """The current hour's rows in chunks: yields ``(rows, p, labels)``, drawn from
        ``(seed, 5, hour, chunk)``; marks the ids seen (:attr:`seen`; this hour's count per
        feature: :attr:`ids_in_hour`, once every chunk is drawn)."""
        in_hour = [np.zeros(n, bool) for n in self.born]
        for i, lo in enumerate(range(0, rows_per_hour, CHUNK_ROWS)):
            rng = np.random.default_rng([self.cfg.seed, 5, self.hour, i])
            rows, p, labels = self.sample(rng, min(CHUNK_ROWS, rows_per_hour - lo))
            for f, c in enumerate(rows["cats"]):
                in_hour[f][c[c >= 0]] = True
            yield rows, p, labels
        for f, mask in enumerate(in_hour):
            self.seen[f] |= mask
        self.ids_in_hour = [int(mask.sum()) for mask in in_hour]


def _per_feature(counts) -> dict:
    return {"total": int(sum(counts)), **{n: int(c) for n, c in zip(CATEGORICAL, counts)}}


def _prepare_out(out: Path, overwrite: bool) -> None:
    """Refuse a directory holding another stream's hour files (unless ``overwrite``: then
    they, their temporaries and ``stream.json`` are removed); other files are left alone."""
    if out.exists() and not out.is_dir():
        raise DataError(f"{out}: exists and is not a directory")
    out.mkdir(parents=True, exist_ok=True)
    names = sorted(p.name for p in out.iterdir())
    hours = [n for n in names if _HOUR.fullmatch(n)]
    if hours and not overwrite:
        shown = ", ".join(hours[:3]) + (", ..." if len(hours) > 3 else "")
        raise DataError(f"{out}: holds hour files of another stream ({shown}); "
                        "use --overwrite to replace them")
    stale = [n for n in names if _HOUR_TMP.fullmatch(n)]
    if stale and not overwrite:
        warnings.warn(f"removed what an interrupted stream left in {out}: {', '.join(stale)}",
                      HybridrecWarning, stacklevel=3)
    for name in ([REPORT] if REPORT in names else []) + hours + stale:  # the report first
        (out / name).unlink()
    fsync_dir(out)


def _write_tmp(teacher: StreamTeacher, tmp: Path, cfg: StreamConfig):
    """The current hour under its temporary name, fsynced; returns ``(p, labels)``."""
    ps, ys = [], []
    with naming(tmp), open(tmp, "wb") as raw:
        f = gzip_mod.GzipFile(filename="", mode="wb", fileobj=raw, compresslevel=1, mtime=0) \
            if cfg.gzip else raw
        for rows, p, labels in teacher.sample_hour(cfg.rows_per_hour):
            f.write(format_tsv(teacher, rows, labels))
            ps.append(p)
            ys.append(labels)
        if cfg.gzip:
            f.close()
        raw.flush()
        os.fsync(raw.fileno())
    return np.concatenate(ps), np.concatenate(ys)


def generate_stream(
    out_dir: str | os.PathLike,
    *,
    hours: int = 24,
    rows_per_hour: int = 100_000,
    seed: int = 0,
    scale: float = DEFAULT_SCALE,
    drift: float = 0.1,
    land_every: float = 0.0,
    gzip: bool = False,
    overwrite: bool = False,
    progress: bool | None = None,
    **options,
) -> dict:
    """Write ``hour_0000.tsv, hour_0001.tsv, ...`` one by one into ``out_dir`` and
    ``stream.json`` after each; return the final report (``stream.json``'s content).

    ``options``: the teacher's other :class:`SynthConfig` fields (``max_cardinality``,
    ``zipf_exponent``, ``target_ctr``, ...). ``progress``: a bar on stderr (default: when
    stderr is a terminal).
    """
    from tqdm import tqdm

    start = time.perf_counter()
    cfg = StreamConfig(hours=hours, rows_per_hour=rows_per_hour, drift=drift,
                       land_every=land_every, gzip=gzip)
    tcfg = SynthConfig(days=1, rows_per_day=rows_per_hour, seed=seed, scale=scale, **options)
    out = Path(out_dir)
    _prepare_out(out, overwrite)
    teacher = StreamTeacher(tcfg)
    report = {
        "complete": False,
        "hours_planned": cfg.hours,
        "hours": [],
        "cardinalities": dict(zip(CATEGORICAL, teacher.cards)),
        "interaction_pairs": [[CATEGORICAL[a], CATEGORICAL[b]] for a, b in teacher.pairs],
        "config": {**dataclasses.asdict(cfg), "teacher": dataclasses.asdict(tcfg)},
    }
    bar = tqdm(total=cfg.hours, unit="hour", desc="stream", dynamic_ncols=True,
               disable=not (sys.stderr.isatty() if progress is None else progress))
    first = time.monotonic()
    tmp, slept = None, 0.0
    try:
        for hour in range(cfg.hours):
            births = teacher.advance(cfg.drift) if hour else [0] * len(CATEGORICAL)
            name = cfg.file_name(hour)
            tmp = out / f".{name}.tmp"
            p, y = _write_tmp(teacher, tmp, cfg)
            wait = first + hour * cfg.land_every - time.monotonic()
            if wait > 0:
                time.sleep(wait)
                slept += wait
            os.replace(tmp, out / name)
            tmp = None
            fsync_dir(out)
            report["hours"].append({
                "hour": hour,
                "file": name,
                "rows": int(y.size),
                "ctr": float(y.mean()),
                "teacher_auc": auc(y, p),
                "teacher_logloss": teacher_log_loss(y, p),
                "intercept": teacher.intercept,
                "live_ids": _per_feature([live.size for live in teacher.live]),
                "ids_in_hour": _per_feature(teacher.ids_in_hour),
                "born": _per_feature(births),
                "distinct_ids_so_far": _per_feature([int(s.sum()) for s in teacher.seen]),
                "ids_born_so_far": _per_feature(teacher.born),
            })
            write_json_atomic(out / REPORT, report)
            bar.update(1)
            bar.set_postfix_str(f"AUC {report['hours'][-1]['teacher_auc']:.3f}", refresh=False)
    finally:
        bar.close()
        if tmp is not None:
            tmp.unlink(missing_ok=True)
    seconds = time.perf_counter() - start
    rows = cfg.hours * cfg.rows_per_hour
    # Generation speed: the waits for --land-every left out.
    report.update(complete=True, rows=rows, seconds=round(seconds, 3),
                  rows_per_second=round(rows / max(seconds - slept, 1e-9)))
    write_json_atomic(out / REPORT, report)
    return report
