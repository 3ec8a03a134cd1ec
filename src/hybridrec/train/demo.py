"""The README's main job: synthesize -> preprocess -> train -> evaluate, in one call."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from hybridrec.data.preprocess import preprocess_criteo
from hybridrec.data.synth import generate
from hybridrec.train.run import train
from hybridrec.train.setup import recipes
from hybridrec.train.setup.configure import build_config


def _synthesize(raw: Path, *, days: int, rows_per_day: int, seed: int) -> dict:
    """Generate the click log, or reuse it when ``raw`` holds the same settings."""
    report_path = raw / "teacher.json"
    if report_path.is_file():
        report = json.loads(report_path.read_text())
        cfg = report.get("config", {})
        if (cfg.get("days"), cfg.get("rows_per_day"), cfg.get("seed")) == (days, rows_per_day, seed):
            return report
    return generate(raw, days=days, rows_per_day=rows_per_day, seed=seed, overwrite=True)


def run_demo(*, out: str | Path, days: int = 7, rows_per_day: int = 100_000, seed: int = 0,
             overrides: list[str] = ()) -> dict:
    """Train the ``demo`` recipe on a synthetic Criteo-like log; the last day is held out.

    Writes ``OUT/raw`` (TSV days + teacher.json), ``OUT/data`` (shards) and ``OUT/run``
    (a fresh run directory). Returns the run's summary with the teacher's ceiling.
    """
    out = Path(out)
    raw, data, run = out / "raw", out / "data", out / "run"
    print(f"[1/3] synthesizing {days} days x {rows_per_day:,} rows into {raw}", flush=True)
    teacher = _synthesize(raw, days=days, rows_per_day=rows_per_day, seed=seed)
    print(f"      teacher AUC on the held-out day (the ceiling): {teacher['teacher_auc']:.4f}", flush=True)
    print(f"[2/3] preprocessing into {data}", flush=True)
    preprocess_criteo(sorted(raw.glob("day_*.tsv*")), data, overwrite=True)
    shutil.rmtree(run, ignore_errors=True)  # the demo's own run directory: always a fresh run
    cfg = build_config(recipes.recipe("demo"), overrides=[
        f"data.path={data}", f"train.run_dir={run}", f"train.seed={seed}", *overrides])
    print(f"[3/3] training ({cfg.train.epochs} epoch(s)) and evaluating on the held-out day", flush=True)
    return train(cfg, extra_summary={"teacher": {
        "auc": teacher["teacher_auc"], "log_loss": teacher.get("teacher_logloss"),
        "ne": teacher.get("teacher_ne"), "source": str(raw / "teacher.json")}})
