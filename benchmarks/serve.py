#!/usr/bin/env python3
"""Serving on this CPU: latency of the exported model against the eager one, rows/s of score.py.

    .venv/bin/python benchmarks/serve.py [--work DIR] [--rows 1000000] [--reps 200]

Makes (or reuses, under --work) a synthetic Criteo dataset and a run of the default model
(``--recipe demo``, a few steps: the weights do not change the time), exports it with fp32
and int8 tables, then measures

- latency p50/p99 of one call at batch 1, 64 and 1,024 rows of the held-out day: the run's
  eager model (``model(batch)``, as ``hybridrec eval`` loads it: plain kernels) and the
  exported program (``torch.export.load(...).module()``), inputs already made;
- rows/s of ``python score.py`` (raw TSV -> probabilities, start-up included) and of
  ``hybridrec predict`` when it exists, on a file of ``--rows`` rows (the held-out day repeated).

Prints a Markdown table and one JSON line.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def prepare(work: Path, rows_per_day: int, *overrides: str) -> Path:
    """The run directory (made once): 3 synthetic days, the last held out, 20 steps
    (``overrides``: more of the run's KEY=VALUE, e.g. its checkpoint interval)."""
    from hybridrec.cli.main import main

    run = work / "run"
    if (run / "summary.json").is_file():
        return run
    if not (work / "data" / "meta.json").is_file():
        assert main(["data", "synth", "--out", str(work / "raw"), "--days", "3", "--rows-per-day",
                     str(rows_per_day), "--overwrite"]) == 0
        assert main(["data", "preprocess", *(str(work / "raw" / f"day_{i}.tsv") for i in range(3)),
                     "--out", str(work / "data"), "--overwrite"]) == 0
    assert main(["train", "--recipe", "demo", f"data.path={work / 'data'}", f"train.run_dir={run}",
                 "train.max_steps=20", "train.progress=false", *overrides]) == 0
    return run


def percentiles(fns: dict, reps: int) -> dict[str, tuple[float, float]]:
    """p50 and p99 of each of ``fns``' wall time in milliseconds, after 5 warm-up calls. The
    calls take turns (one of each per round), so load from other processes of a shared
    machine falls on every variant alike."""
    import numpy as np

    times: dict[str, list[float]] = {k: [] for k in fns}
    for i in range(reps + 5):
        for k, fn in fns.items():
            t = time.perf_counter()
            fn()
            if i >= 5:
                times[k].append(time.perf_counter() - t)
    return {k: (float(np.percentile(v, 50)) * 1e3, float(np.percentile(v, 99)) * 1e3) for k, v in times.items()}


def latencies(run: Path, arts: dict[str, Path], reps: int) -> list[dict]:
    import torch

    from hybridrec.data.loader import ShardedLoader
    from hybridrec.serve.export import batch_inputs
    from hybridrec.train.run import load_run_model

    _, meta, model, _, _ = load_run_model(run)
    model.eval()
    programs = {t: torch.export.load(str(a / "model.pt2")).module() for t, a in arts.items()}
    out = []
    for b in (1, 64, 1024):
        batch = next(iter(ShardedLoader(meta, split="eval", batch_size=b, shuffle=False, prefetch=0)))
        args = batch_inputs(batch, meta)
        n = max(20, reps if b < 1024 else reps // 4)
        fns = {"eager": lambda batch=batch: model(batch)}
        fns.update({f"exported {t}": lambda prog=prog, args=args: prog(*args) for t, prog in programs.items()})
        with torch.no_grad():
            row = {"batch": b, **percentiles(fns, n)}
        out.append(row)
        print(row, flush=True)
    return out


def big_file(work: Path, rows: int) -> Path:
    """``rows`` lines of the held-out day, repeated."""
    path = work / f"big-{rows}.tsv"
    if not path.is_file():
        lines = (work / "raw" / "day_2.tsv").read_bytes().splitlines(keepends=True)
        with open(path, "wb") as f:
            f.writelines(b"".join(lines[: min(len(lines), rows - i)]) for i in range(0, rows, len(lines)))
    return path


def score_rates(work: Path, run: Path, art: Path, rows: int) -> dict[str, float]:
    """Rows/s of score.py and of `hybridrec predict` (when there is one) on ``rows`` raw rows."""
    big = big_file(work, rows)
    rates = {"score.py": rows / timed([sys.executable, str(art / "score.py"), str(big), str(work / "score.csv")])}
    try:
        import hybridrec.serve.predict  # noqa: F401
    except ImportError:
        return rates
    rates["hybridrec predict"] = rows / timed([sys.executable, "-m", "hybridrec", "predict", str(run), str(big),
                                               "--out", str(work / "predict.csv")])
    return rates


def timed(cmd: list[str]) -> float:
    t = time.perf_counter()
    r = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if r.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed: {r.stderr[-2000:]}")
    return time.perf_counter() - t


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--work", default="/tmp/hybridrec-serve-bench", help="work directory (reused)")
    p.add_argument("--rows-per-day", type=int, default=20_000)
    p.add_argument("--rows", type=int, default=1_000_000, help="rows of the file scored")
    p.add_argument("--reps", type=int, default=200, help="timed calls per latency (a quarter at 1,024)")
    p.add_argument("--threads", type=int, default=1, help="torch threads for the latencies [1]")
    p.add_argument("--skip-files", action="store_true", help="latencies only (no score.py / predict)")
    args = p.parse_args(argv)
    import torch

    torch.set_num_threads(args.threads)
    from hybridrec.model.kernels import cpu_name
    from hybridrec.serve.export import export_run

    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    run = prepare(work, args.rows_per_day)
    arts = {}
    for tables in ("fp32", "int8"):
        arts[tables] = work / f"art-{tables}"
        rec = export_run(run, arts[tables], tables=tables, eval_rows=20_000, overwrite=True)
        print(f"{tables}: held-out AUC {rec['held_out']['auc_exported']:.5f} "
              f"(eager {rec['held_out']['auc_eager']:.5f}), model.pt2 {rec['model_bytes'] / 2**20:.1f} MiB")
    lat = latencies(run, arts, args.reps)
    rates = {} if args.skip_files else score_rates(work, run, arts["fp32"], args.rows)
    print(f"\nCPU: {cpu_name()}; {args.threads} torch thread(s) for the latencies\n")
    print("| batch | eager p50 / p99 ms | exported fp32 p50 / p99 ms | exported int8 p50 / p99 ms |")
    print("|---:|---:|---:|---:|")
    for r in lat:
        cells = [f"{r[k][0]:.3f} / {r[k][1]:.3f}" for k in ("eager", "exported fp32", "exported int8")]
        print(f"| {r['batch']:,} | " + " | ".join(cells) + " |")
    print("\n| raw rows -> probabilities | rows/s |\n|---|---:|")
    for k, v in rates.items():
        print(f"| {k} ({args.rows:,} rows, start-up included) | {v:,.0f} |")
    print(json.dumps({"cpu": cpu_name(), "threads": args.threads, "latency_ms": lat, "rows_per_sec": rates}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
