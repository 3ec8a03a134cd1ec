"""``hybridrec bench compression``: train one run per compression setting and seed, then
compare held-out quality with the bytes each setting sent.

A *setting* is a name and the ``key=value`` overrides that make it; the sweep always
starts with ``baseline`` (nothing compressed). Settings come from two small grammars:

- named: ``NAME:KEY=VALUE[,KEY=VALUE...]``. A bare KEY is in ``compress``
  (``embedding=dct`` is ``compress.embedding=dct``); a piece without ``=`` continues
  the previous value, so list values work: ``embedding_tables=C1,C2``.
- grids, one hop at a time: ``--dense COMPRESSOR[:V,V...]`` and
  ``--embedding CODEC[:V,V...]``. V is eta (the kept fraction) for ``dct``/``topk``
  and the rank for ``powersgd``; ``fp16``/``bf16``/``int8`` take none. Embedding
  ``dct-fp16``/``dct-bf16`` send the kept values in 16 bits. A grid point compresses
  its own hop only, unless ``cross`` combines every dense point with every embedding
  point.

Example: ``parse_grid("embedding", "dct:0.05,0.01")`` gives the settings
``emb-dct-0.05`` and ``emb-dct-0.01`` with ``compress.embedding=dct``,
``compress.embedding_ratio=0.05`` (resp. 0.01) and ``compress.dense=none``.

Each run is ``python -m hybridrec train`` in a subprocess (so ``dist.nproc > 1`` goes
through torchrun as usual) into ``OUT/<setting>/seed<k>/``; its output goes to
``OUT/<setting>/seed<k>.log`` beside it (not inside: a run directory holds the run's own
files alone, and a run refuses a directory with other files in it). A finished run (a summary.json whose config equals the one this
sweep would train) is reused. Results are rewritten atomically after every run
(``complete: false`` until the last one), see :mod:`hybridrec.bench.compression_report`.
"""

from __future__ import annotations

import json
import math
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from hybridrec.bench import compression_report as report
from hybridrec.bench.compression_report import BASELINE
from hybridrec.errors import ConfigError

_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._+-]*")
_DENSE = {"dct": "eta", "topk": "eta", "powersgd": "rank", "fp16": None, "bf16": None}
_EMBEDDING = {"dct": "eta", "dct-fp16": "eta", "dct-bf16": "eta",
              "fp16": None, "bf16": None, "int8": None}
# Set by the sweep itself (one value per run); in a setting or an extra override they
# would silently fight the sweep's own options.
_RESERVED = {"data.path": "--data", "train.run_dir": "--out", "dist.nproc": "--nproc",
             "train.seed": "--seeds", "train.max_steps": "--max-steps"}


@dataclass(frozen=True)
class Setting:
    """One point of the sweep: its directory name and the config overrides that make it."""

    name: str
    overrides: tuple[str, ...]


@dataclass(kw_only=True)
class SweepSpec:
    """What to sweep and where; :func:`run_sweep` reads it."""

    data: Path
    """Preprocessed dataset (``hybridrec data preprocess`` output)."""
    out: Path
    """Sweep directory: ``<setting>/seed<k>/`` runs, results.json/.md, pareto.svg."""
    settings: list[Setting]
    """Baseline first (see :func:`build_settings`)."""
    seeds: list[int] = field(default_factory=lambda: [0])
    """``train.seed`` of each run of a setting."""
    nproc: int = 1
    """Ranks per run (``dist.nproc``)."""
    recipe: str = "demo"
    """Named config every run starts from."""
    max_steps: int = 0
    """``train.max_steps`` (0: the recipe's epochs)."""
    overrides: list[str] = field(default_factory=list)
    """``key=value`` for every run, before the setting's own overrides."""
    overwrite: bool = False
    """Retrain runs that already finished."""


def _bad(option: str, text: str, why: str) -> ConfigError:
    return ConfigError(f"{option} {text!r}: {why}")


def parse_setting(text: str) -> Setting:
    """``"NAME:KEY=VALUE,KEY=VALUE"`` -> :class:`Setting` with full config keys."""
    name, sep, body = text.partition(":")
    name = name.strip()
    if not sep or not body.strip():
        raise _bad("--setting", text, "expected NAME:KEY=VALUE[,KEY=VALUE...], "
                   "e.g. small-dct:embedding=dct,embedding_ratio=0.02")
    _check_name("--setting", text, name)
    items: list[str] = []
    for piece in body.split(","):
        piece = piece.strip()
        if "=" in piece:
            items.append(piece)
        elif items and piece:  # a list value's next element: embedding_tables=C1,C2
            items[-1] += "," + piece
        elif piece or not items:
            raise _bad("--setting", text, f"{piece!r} is not KEY=VALUE")
    overrides = []
    for item in items:
        key, value = (s.strip() for s in item.split("=", 1))
        if not key:
            raise _bad("--setting", text, f"{item!r} has no key")
        overrides.append(f"{key if '.' in key else 'compress.' + key}={value}")
    check_reserved("--setting", text, overrides)
    return Setting(name, tuple(overrides))


def _check_name(option: str, text: str, name: str) -> None:
    if not _NAME.fullmatch(name):
        raise _bad(option, text, f"setting name {name!r} must be letters, digits and . _ + - "
                   "(it names a directory)")
    if name == BASELINE:
        raise _bad(option, text, f"{BASELINE!r} is always included and cannot be redefined")


def check_reserved(option: str, text: str, overrides: list[str]) -> None:
    for item in overrides:
        key = item.split("=", 1)[0].strip()
        if key in _RESERVED:
            raise _bad(option, text, f"{key} is set by the sweep; use {_RESERVED[key]}")


def _grid_values(option: str, text: str, kind: str, values: str) -> list[str]:
    """Each value of ``V,V,...`` checked: eta in (0, 1] or a rank >= 1; returns the texts."""
    out = []
    for v in (s.strip() for s in values.split(",")):
        try:
            ok = (0 < float(v) <= 1) if kind == "eta" else int(v) >= 1
        except ValueError:
            ok = False
        if not ok or (kind == "eta" and not math.isfinite(float(v))):
            want = "an eta in (0, 1]" if kind == "eta" else "a rank >= 1"
            raise _bad(option, text, f"{v!r} is not {want}")
        out.append(v)
    if len(set(out)) != len(out):
        raise _bad(option, text, "a value is listed twice")
    return out


def parse_grid(hop: str, text: str) -> list[Setting]:
    """``hop`` = ``"dense"`` or ``"embedding"``; ``text`` = ``COMPRESSOR[:V,V...]``.

    ``parse_grid("dense", "dct:0.01,0.001")`` -> settings ``dense-dct-0.01`` and
    ``dense-dct-0.001``; ``parse_grid("embedding", "int8")`` -> ``emb-int8``.
    """
    table = _DENSE if hop == "dense" else _EMBEDDING
    option = f"--{hop}"
    comp, sep, values = (s.strip() for s in text.partition(":"))
    if comp == "none":
        raise _bad(option, text, "the uncompressed baseline is always included")
    if comp not in table:
        raise _bad(option, text, f"unknown {'compressor' if hop == 'dense' else 'codec'} "
                   f"{comp!r}; choose from {', '.join(table)}")
    kind = table[comp]
    if kind is None:
        if sep:
            raise _bad(option, text, f"{comp} takes no values")
        return [_grid_setting(hop, comp, None)]
    if not values:
        example = "dct:0.01,0.001" if kind == "eta" else "powersgd:1,4"
        raise _bad(option, text, f"{comp} needs {'eta' if kind == 'eta' else 'rank'} values, "
                   f"e.g. {example}")
    return [_grid_setting(hop, comp, v) for v in _grid_values(option, text, kind, values)]


def _grid_setting(hop: str, comp: str, value: str | None) -> Setting:
    if hop == "dense":
        over = [f"compress.dense={comp}", "compress.embedding=none"]
        name = f"dense-{comp}"
        if value is not None:
            key, prefix = ("powersgd_rank", "r") if comp == "powersgd" else ("dense_ratio", "")
            over.append(f"compress.{key}={value}")
            name += f"-{prefix}{value}"
        return Setting(name, tuple(over))
    codec, _, values_dtype = comp.partition("-")
    over = ["compress.dense=none", f"compress.embedding={codec}"]
    if values_dtype:
        over.append(f"compress.embedding_values={values_dtype}")
    if value is not None:
        over.append(f"compress.embedding_ratio={value}")
    return Setting(f"emb-{comp}" + ("" if value is None else f"-{value}"), tuple(over))


def combine(dense: Setting, embedding: Setting) -> Setting:
    """One dense grid point with one embedding grid point (``--cross``)."""
    over = [o for o in dense.overrides if not o.startswith("compress.embedding=")]
    over += [o for o in embedding.overrides if not o.startswith("compress.dense=")]
    return Setting(f"{dense.name}+{embedding.name}", tuple(over))


def build_settings(*, named: list[str] = (), dense: list[str] = (), embedding: list[str] = (),
                   cross: bool = False) -> list[Setting]:
    """The baseline, then the grid points, then the named settings; names are unique."""
    dense_pts = [s for spec in dense for s in parse_grid("dense", spec)]
    emb_pts = [s for spec in embedding for s in parse_grid("embedding", spec)]
    if cross:
        if not (dense_pts and emb_pts):
            raise ConfigError("--cross needs both --dense and --embedding grids")
        grid = [combine(d, e) for d in dense_pts for e in emb_pts]
    else:
        grid = dense_pts + emb_pts
    settings = [Setting(BASELINE, ("compress.dense=none", "compress.embedding=none"))]
    settings += grid + [parse_setting(t) for t in named]
    seen: set[str] = set()
    for s in settings:
        if s.name in seen:
            raise ConfigError(f"setting {s.name!r} is defined twice")
        seen.add(s.name)
    return settings


def parse_seeds(text: str) -> list[int]:
    """``"0,1,2"`` -> ``[0, 1, 2]``."""
    try:
        seeds = [int(s) for s in text.split(",") if s.strip()]
    except ValueError:
        raise ConfigError(f"--seeds {text!r}: expected integers, e.g. 0,1,2") from None
    if not seeds or len(set(seeds)) != len(seeds) or min(seeds) < 0:
        raise ConfigError(f"--seeds {text!r}: expected distinct integers >= 0, e.g. 0,1,2")
    return seeds


def run_overrides(spec: SweepSpec, setting: Setting, seed: int) -> list[str]:
    """Every ``key=value`` of one run: the sweep's, then the extra ones, then the setting's."""
    out = [f"data.path={spec.data.resolve()}",
           f"train.run_dir={run_dir(spec, setting, seed).resolve()}",
           f"dist.nproc={spec.nproc}", f"train.seed={seed}", "train.progress=false"]
    if spec.max_steps:
        out.append(f"train.max_steps={spec.max_steps}")
    return out + list(spec.overrides) + list(setting.overrides)


def run_dir(spec: SweepSpec, setting: Setting, seed: int) -> Path:
    return spec.out / setting.name / f"seed{seed}"


def expected_configs(spec: SweepSpec) -> dict[tuple[str, int], dict]:
    """The resolved config of every run, before anything starts: a bad key or value in
    any setting is an error that names the setting, not a failure an hour in."""
    from hybridrec.train.setup import recipes
    from hybridrec.train.setup.configure import build_config

    if spec.nproc < 1:
        raise ConfigError("--nproc must be >= 1")
    if spec.max_steps < 0:
        raise ConfigError("--max-steps must be >= 0")
    if not (spec.data / "meta.json").is_file():
        raise ConfigError(f"--data {spec.data}: not a preprocessed dataset (no meta.json); "
                          "make one with hybridrec data preprocess")
    check_reserved("extra override", " ".join(spec.overrides), list(spec.overrides))
    base = recipes.recipe(spec.recipe)
    out = {}
    for s in spec.settings:
        for seed in spec.seeds:
            try:
                cfg = build_config(base, [], run_overrides(spec, s, seed))
            except ConfigError as e:
                raise ConfigError(f"setting {s.name!r}: {e}") from None
            out[s.name, seed] = json.loads(json.dumps(cfg.to_dict()))
    return out


def _config_diff(a: dict, b: dict) -> list[str]:
    return sorted(f"{sec}.{k}" for sec in set(a) | set(b)
                  for k in set(a.get(sec, {})) | set(b.get(sec, {}))
                  if a.get(sec, {}).get(k) != b.get(sec, {}).get(k))


def train_one(spec: SweepSpec, setting: Setting, seed: int, expected: dict, *,
              starting: Callable[[], None] = lambda: None) -> dict:
    """Train (or reuse) one run; returns ``{"status": "ok"|"reused"|"failed", ...}``.
    ``starting`` is called just before a training process starts (not for a reused run)."""
    rdir = run_dir(spec, setting, seed)
    summary_path = rdir / "summary.json"
    log_path = rdir.parent / f"{rdir.name}.log"  # (beside the run: its directory is the run's alone)
    base = {"seed": seed, "run_dir": str(rdir), "log": str(log_path),
            "compress": expected["compress"]}
    if summary_path.is_file() and not spec.overwrite:
        summary = json.loads(summary_path.read_text())
        diff = _config_diff(summary.get("config", {}), expected)
        if not diff:
            return {**base, "status": "reused", "seconds": 0.0, "summary": summary}
        return {**base, "status": "failed", "seconds": 0.0,
                "error": f"a finished run with another config is there (differs in "
                         f"{', '.join(diff[:4])}); pass --overwrite to retrain it"}
    if rdir.exists():  # unfinished or to be overwritten: start it from scratch
        shutil.rmtree(rdir)
    rdir.parent.mkdir(parents=True, exist_ok=True)
    starting()
    cmd = [sys.executable, "-m", "hybridrec", "train", "--recipe", spec.recipe,
           *run_overrides(spec, setting, seed)]
    t0 = time.perf_counter()
    with open(log_path, "w") as log:
        log.write("$ " + " ".join(cmd) + "\n")
        log.flush()
        rc = subprocess.call(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    seconds = time.perf_counter() - t0
    if rc != 0 or not summary_path.is_file():
        return {**base, "status": "failed", "seconds": seconds, "returncode": rc,
                "error": _last_error(log_path, rc)}
    return {**base, "status": "ok", "seconds": seconds,
            "summary": json.loads(summary_path.read_text())}


def _last_error(log: Path, rc: int) -> str:
    """The most telling line of a failed run's log: hybridrec's own one-line error (the
    first: with several ranks the launcher's line that names the failed rank follows it),
    else the last exception line (not the launcher's report that a rank failed), else the
    exit code."""
    lines = [ln.strip() for ln in log.read_text(errors="replace").splitlines()
             if ln.strip() and "ChildFailedError" not in ln]
    ours = [ln for ln in lines if "hybridrec: error:" in ln]
    if ours:
        return ours[0][:300]
    for pattern in ("Error:", "Error"):
        hits = [ln for ln in lines if pattern in ln]
        if hits:
            return hits[-1][:300]
    return f"exit code {rc} and no summary.json"


def run_sweep(spec: SweepSpec, *, echo: Callable[[str], None] = print) -> dict:
    """Train every setting x seed, with progress lines per run; a failed run is reported
    and the sweep goes on. Rewrites results.json, results.md and pareto.svg in
    ``spec.out`` after every run (``complete: false`` until the last) and returns the
    final results (see :mod:`hybridrec.bench.compression_report`)."""
    expected = expected_configs(spec)
    spec.out.mkdir(parents=True, exist_ok=True)
    total, done = len(spec.settings) * len(spec.seeds), 0
    runs: dict[str, list[dict]] = {}
    echo(f"sweep: {len(spec.settings)} settings x {len(spec.seeds)} seed(s) = {total} runs, "
         f"{spec.nproc} rank(s), into {spec.out}")
    if spec.nproc == 1 and any(c["compress"]["embedding"] != "none" for c in expected.values()):
        echo("note: with one process nothing travels, so the embedding codecs do not act; "
             "compare them with --nproc 2 or more")
    for setting in spec.settings:
        runs[setting.name] = []
        for seed in spec.seeds:
            done += 1
            head = f"[{done}/{total}] {setting.name} seed {seed}:"
            r = train_one(spec, setting, seed, expected[setting.name, seed],
                          starting=lambda head=head: echo(f"{head} training ..."))
            runs[setting.name].append(report.run_record(r))
            echo(f"{head} {report.progress_text(r)}")
            report.write_results(spec, runs, complete=done == total)
    return report.load_results(spec.out)
