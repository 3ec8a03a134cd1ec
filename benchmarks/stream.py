#!/usr/bin/env python3
"""Training on a stream: quality, memory, speed, freshness and exactly-once, each a command.

    .venv/bin/python benchmarks/stream.py quality   --hours 12 --rows-per-hour 50000 --seeds 0,1
    .venv/bin/python benchmarks/stream.py memory    --hours 4 --rows-per-hour 50000
    .venv/bin/python benchmarks/stream.py speed     --hours 4 --rows-per-hour 50000 --nproc 1,2
    .venv/bin/python benchmarks/stream.py freshness --hours 12 --land-every 10 --publish-every 30s
    .venv/bin/python benchmarks/stream.py kill      --trials 3 --nproc 1,2

Every run is the command a user runs (``hybridrec data synth --stream``, ``hybridrec train
data.stream=...``, ``hybridrec predict``), in a subprocess; each command prints a table and
writes ``RESULT.json`` under ``--out`` with the processor, date and arguments.

- quality: a drifting stream (``data synth --stream``, seed = the seed), hours 0..H-2 trained
  in order, hour H-1 scored with ``hybridrec predict``: dynamic tables at a budget of
  ``--budget`` x each feature's live ids (the generator's population alive at hour H-2,
  ``stream.json``), modulo tables of the same rows, and dynamic tables that never evict (a
  row for every id born by then). Tables get at least 32 rows (the three alike).
- memory: peak RSS (summary.json) of dynamic tables at one fixed budget on a stream and on a
  stream of ``--factor`` x its scale (choose it so that the second holds 3x the distinct ids:
  ``distinct_ratio``).
- speed: samples/s of the stream with dynamic tables against the same rows preprocessed into
  shards with static tables (vocabulary encoding, the default), one process and N ranks;
  runs alternate so that drift of the machine hits both.
- freshness: the generator lands a file every ``--land-every`` s while a run trains with
  ``train.publish_every``; each file's freshness is summary.json's.
- kill: ``kill -9`` of the launcher at a random moment (a seeded draw), the same command
  again, until it ends; every file's trained rows against its lines.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
HYBRIDREC = [sys.executable, "-m", "hybridrec"]
sys.path.insert(0, str(ROOT / "benchmarks"))
from throughput import machine

BASE = ["train.progress=false", "data.stream_stop=idle:0", "data.stream_poll_s=0.2"]


def run(cmd: list[str], **kw) -> subprocess.CompletedProcess:
    out = subprocess.run(cmd, capture_output=True, text=True, check=False, **kw)
    if out.returncode:
        raise SystemExit(f"failed ({out.returncode}): {' '.join(cmd)}\n{out.stderr[-3000:]}")
    return out


def synth(directory: Path, hours: int, rows: int, seed: int, scale: float | None = None,
          land_every: float = 0.0) -> Path:
    if (directory / "stream.json").is_file() and json.loads((directory / "stream.json").read_text()).get("complete"):
        return directory
    extra = ["--scale", str(scale)] if scale else []
    run([*HYBRIDREC, "data", "synth", "--stream", "--out", str(directory), "--hours", str(hours),
         "--rows-per-hour", str(rows), "--seed", str(seed), "--overwrite", *extra,
         *(["--land-every", str(land_every)] if land_every else [])])
    return directory


def train(run_dir: Path, stream: Path, *overrides: str, nproc: int = 1) -> dict:
    shutil.rmtree(run_dir, ignore_errors=True)
    run([*HYBRIDREC, "train", f"data.stream={stream}", f"train.run_dir={run_dir}", f"dist.nproc={nproc}",
         *BASE, *overrides])
    return json.loads((run_dir / "summary.json").read_text())


def labels_of(path: Path) -> np.ndarray:
    with open(path, "rb") as f:
        return np.array([int(line[:1]) for line in f], dtype=np.int64)


def auc(y: np.ndarray, p: np.ndarray) -> float:
    sys.path.insert(0, str(ROOT / "src"))
    from hybridrec.metrics.classification import auc as exact

    return float(exact(y, p))


def rows_string(per_feature: dict[str, int]) -> str:
    return ",".join(f"{k}={v}" for k, v in per_feature.items() if k != "total")


def save(out: Path, name: str, record: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    record = {"machine": machine(), "date": time.strftime("%Y-%m-%d"), "argv": sys.argv[1:], **record}
    (out / f"{name}.json").write_text(json.dumps(record, indent=2) + "\n")
    print(json.dumps(record, indent=2))


# ------------------------------------------------------------------ quality
def quality(a) -> None:
    results = []
    for seed in a.seeds:
        stream = synth(a.out / f"stream-{seed}", a.hours, a.rows_per_hour, seed)
        meta = json.loads((stream / "stream.json").read_text())
        trained = a.out / f"train-{seed}"  # hours 0..H-2
        shutil.rmtree(trained, ignore_errors=True)
        trained.mkdir(parents=True)
        for h in meta["hours"][:-1]:
            os.link(stream / h["file"], trained / h["file"])
        last = meta["hours"][-2]
        test = stream / meta["hours"][-1]["file"]
        live = {k: max(32, math.ceil(a.budget * v)) for k, v in last["live_ids"].items() if k != "total"}
        every = {k: max(32, int(v) + 1) for k, v in last["ids_born_so_far"].items() if k != "total"}
        configs = {"dynamic": ["model.tables=dynamic", f"model.table_rows={rows_string(live)}"],
                   "modulo": ["model.tables=modulo", f"model.table_rows={rows_string(live)}"],
                   "dynamic_never_evicts": ["model.tables=dynamic", f"model.table_rows={rows_string(every)}"]}
        configs = {k: v for k, v in configs.items() if not a.only or k in a.only}
        y = labels_of(test)
        row = {"seed": seed, "live_ids": last["live_ids"]["total"], "budget_rows": sum(live.values()),
               "never_rows": sum(every.values()), "distinct_ids": last["distinct_ids_so_far"]["total"]}
        for name, overrides in configs.items():
            run_dir = a.out / f"run-{seed}-{name}"
            pred = a.out / f"pred-{seed}-{name}.csv"
            if a.reuse and pred.is_file() and (run_dir / "summary.json").is_file():  # (an earlier invocation's)
                s = json.loads((run_dir / "summary.json").read_text())
            else:
                s = train(run_dir, trained, f"train.seed={seed}", *overrides, *a.overrides)
                run([*HYBRIDREC, "predict", str(run_dir), str(test), "--out", str(pred)])
            p = np.loadtxt(pred, skiprows=1)
            row[name] = {"auc": auc(y, p), "progressive_auc": s["progressive"]["auc"],
                         "samples_per_sec": s["throughput"].get("samples_per_sec_overall"),
                         "evicted": (s.get("dynamic_tables") or {}).get("evicted")}
            print(seed, name, row[name], flush=True)
        if {"dynamic", "modulo"} <= set(row):
            row["dynamic_minus_modulo"] = row["dynamic"]["auc"] - row["modulo"]["auc"]
        if {"dynamic", "dynamic_never_evicts"} <= set(row):
            row["never_minus_dynamic"] = row["dynamic_never_evicts"]["auc"] - row["dynamic"]["auc"]
        results.append(row)
    save(a.out, "quality", {"hours": a.hours, "rows_per_hour": a.rows_per_hour, "budget": a.budget,
                            "results": results})


# ------------------------------------------------------------------ memory
def memory(a) -> None:
    out = {}
    for name, scale in (("base", a.scale), ("more_ids", a.factor * a.scale)):
        stream = synth(a.out / f"stream-{name}", a.hours, a.rows_per_hour, 0, scale=scale)
        meta = json.loads((stream / "stream.json").read_text())
        s = train(a.out / f"run-{name}", stream, "model.tables=dynamic", f"model.table_rows={a.table_rows}",
                  *a.overrides)
        out[name] = {"scale": scale, "distinct_ids": meta["hours"][-1]["distinct_ids_so_far"]["total"],
                     "peak_memory_bytes": s["peak_memory_bytes"], "evicted": s["dynamic_tables"]["evicted"],
                     "live": s["dynamic_tables"]["live"]}
        print(name, out[name], flush=True)
    out["distinct_ratio"] = out["more_ids"]["distinct_ids"] / out["base"]["distinct_ids"]
    out["rss_growth"] = out["more_ids"]["peak_memory_bytes"] / out["base"]["peak_memory_bytes"] - 1
    save(a.out, "memory", {"table_rows": a.table_rows, **out})


# ------------------------------------------------------------------ speed
def speed(a) -> None:
    stream = synth(a.out / "stream", a.hours, a.rows_per_hour, 0)
    files = sorted(stream.glob("hour_*.tsv"))
    pre = a.out / "pre"
    if not (pre / "meta.json").is_file():
        run([*HYBRIDREC, "data", "preprocess", *map(str, files), "--out", str(pre), "--eval-parts", "none"])
    rows = {}
    for nproc in a.nproc:
        batch = f"data.batch_size={a.batch_size}"
        for r in range(a.repeats):
            s = train(a.out / f"stream-{nproc}", stream, "model.tables=dynamic", f"model.table_rows={a.table_rows}",
                      batch, "train.save_checkpoints=false", *a.overrides, nproc=nproc)
            rows.setdefault((nproc, "stream_dynamic"), []).append(s["throughput"]["samples_per_sec_overall"])
            run_dir = a.out / f"static-{nproc}"
            shutil.rmtree(run_dir, ignore_errors=True)
            run([*HYBRIDREC, "train", f"data.path={pre}", f"train.run_dir={run_dir}", f"dist.nproc={nproc}",
                 "train.progress=false", batch, "train.save_checkpoints=false", *a.overrides])
            s2 = json.loads((run_dir / "summary.json").read_text())
            rows.setdefault((nproc, "shards_static"), []).append(s2["throughput"]["samples_per_sec_overall"])
            print(nproc, r, rows[(nproc, "stream_dynamic")][-1], rows[(nproc, "shards_static")][-1], flush=True)
    out = {}
    for nproc in a.nproc:
        st, sh = rows[(nproc, "stream_dynamic")], rows[(nproc, "shards_static")]
        out[str(nproc)] = {"stream_dynamic": st, "shards_static": sh,
                           "ratio_of_medians": statistics.median(st) / statistics.median(sh)}
    save(a.out, "speed", {"hours": a.hours, "rows_per_hour": a.rows_per_hour, "batch_size": a.batch_size,
                          "table_rows": a.table_rows, "results": out})


# ------------------------------------------------------------------ freshness
def freshness(a) -> None:
    stream = a.out / "landing"
    shutil.rmtree(stream, ignore_errors=True)
    producer = subprocess.Popen([*HYBRIDREC, "data", "synth", "--stream", "--out", str(stream), "--hours",
                                 str(a.hours), "--rows-per-hour", str(a.rows_per_hour), "--land-every",
                                 str(a.land_every)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        while not stream.is_dir():
            time.sleep(0.1)
        run_dir = a.out / "run"
        shutil.rmtree(run_dir, ignore_errors=True)
        run([*HYBRIDREC, "train", f"data.stream={stream}", f"train.run_dir={run_dir}", "model.tables=dynamic",
             f"model.table_rows={a.table_rows}", f"train.publish_every={a.publish_every}", "train.progress=false",
             f"data.stream_stop=idle:{3 * a.land_every}", "data.stream_poll_s=0.5", *a.overrides])
    finally:
        producer.wait()
    s = json.loads((run_dir / "summary.json").read_text())
    fresh = [f["freshness_s"] for f in s["stream"]["files"]]
    save(a.out, "freshness", {"land_every_s": a.land_every, "publish_every": a.publish_every,
                              "rows_per_file": a.rows_per_hour, "files": len(fresh),
                              "freshness_s": fresh, "median_s": statistics.median([f for f in fresh if f is not None]),
                              "versions": s["published"]["versions"],
                              "export_seconds": s["published"]["export_seconds"]})


# ------------------------------------------------------------------ kill
def kill(a) -> None:
    stream = synth(a.out / "stream", a.hours, a.rows_per_hour, 0)
    lines = {p.name: p.read_bytes().count(b"\n") for p in sorted(stream.glob("hour_*.tsv"))}
    rng = random.Random(a.seed)
    results = []
    for nproc in a.nproc:
        for trial in range(a.trials):
            run_dir = a.out / f"run-{nproc}-{trial}"
            shutil.rmtree(run_dir, ignore_errors=True)
            cmd = [*HYBRIDREC, "train", f"data.stream={stream}", f"train.run_dir={run_dir}", f"dist.nproc={nproc}",
                   "model.tables=dynamic", "model.table_rows=20000", "train.checkpoint_every=20", *BASE,
                   *a.overrides]
            kills = []
            for _ in range(a.kills):
                wait = rng.uniform(a.min_s, a.max_s)
                proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                time.sleep(wait)
                ended = proc.poll() is not None
                if not ended:
                    os.kill(proc.pid, signal.SIGKILL)
                proc.wait()
                kills.append(round(wait, 2) if not ended else None)
            run(cmd)
            s = json.loads((run_dir / "summary.json").read_text())
            got = {f["name"]: f["rows"] for f in s["stream"]["files"]}
            results.append({"nproc": nproc, "trial": trial, "killed_after_s": kills, "exact": got == lines,
                            "rows": sum(got.values()), "expected": sum(lines.values()),
                            "invocations": s["run"]["invocations"]})
            print(results[-1], flush=True)
    save(a.out, "kill", {"results": results, "all_exact": all(r["exact"] for r in results)})


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("what", choices=["quality", "memory", "speed", "freshness", "kill"])
    p.add_argument("--out", type=Path, default=None, help="work directory [benchmarks/out/stream-WHAT]")
    p.add_argument("--hours", type=int, default=12)
    p.add_argument("--rows-per-hour", type=int, default=50_000)
    p.add_argument("--seeds", type=lambda s: [int(x) for x in s.split(",")], default=[0])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--budget", type=float, default=1.25, help="quality: dynamic rows per live id")
    p.add_argument("--scale", type=float, default=0.003, help="memory: the base stream's scale")
    p.add_argument("--factor", type=float, default=3.0, help="memory: the second stream's scale / the first's")
    p.add_argument("--table-rows", default="20000")
    p.add_argument("--batch-size", type=int, default=512)
    p.add_argument("--nproc", type=lambda s: [int(x) for x in s.split(",")], default=[1])
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--land-every", type=float, default=10.0)
    p.add_argument("--publish-every", default="30s")
    p.add_argument("--trials", type=int, default=3)
    p.add_argument("--kills", type=int, default=2, help="kill: kills per trial before the run is let end")
    p.add_argument("--min-s", type=float, default=8.0)
    p.add_argument("--max-s", type=float, default=25.0)
    p.add_argument("--only", type=lambda s: s.split(","), default=[],
                   help="quality: only these of dynamic, modulo, dynamic_never_evicts")
    p.add_argument("--reuse", action="store_true", help="quality: keep runs an earlier invocation finished")
    p.add_argument("overrides", nargs="*", help="more KEY=VALUE for every training run")
    a = p.parse_intermixed_args()
    a.out = (a.out or ROOT / "benchmarks" / "out" / f"stream-{a.what}").resolve()
    {"quality": quality, "memory": memory, "speed": speed, "freshness": freshness, "kill": kill}[a.what](a)


if __name__ == "__main__":
    main()
