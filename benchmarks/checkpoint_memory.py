#!/usr/bin/env python3
"""Memory and stall of a sharded checkpoint: the row-wise run of docs/benchmarks.md.

    .venv/bin/python benchmarks/checkpoint_memory.py                   # sync, async, sync-clone
    .venv/bin/python benchmarks/checkpoint_memory.py --modes sync async --rounds 2

The model and data are those of the section "Row-wise sharding of tables larger than one
rank's memory cap": C3 with 6,000,000 rows and 25 tables of 100,000 rows, dim 64, the
``bench`` recipe, the planner's plan for 2 ranks under a 1.25 GiB cap (C3 row-wise over
both ranks). Missing data is made with the commands of that section (the raw click log as
benchmarks/throughput.py makes it).

Each mode runs in fresh processes (``torch.distributed.run``, 2 ranks; peak RSS is per
process). A rank trains ``--steps`` steps, saves a checkpoint through the run's
Checkpointer, trains ``--after`` steps more (in async mode while the files are written),
then waits for the checkpoint to be published. Per rank:

- training peak: VmHWM (/proc/self/status) before the save;
- checkpointing peak: VmHWM after the checkpoint is published (and the steps after it);
- blocking: seconds ``Checkpointer.save`` took (training stopped);
- total: seconds from the save's start until the checkpoint is published;
- stall: blocking + the extra seconds the ``--after`` steps took over as many steps of
  the median length of the (up to ``--after``) last steps before the save.

Modes: ``sync`` (the default save), ``async`` (``Checkpointer(background=True)``: DCP's
staging copy, then the write in a thread), ``sync-clone`` (the save as it was before the
tables were handed to DCP without a copy: DCP's writer clones each table, a view into a
fused weight, and keeps the clones until the rank's file is written).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
from throughput import machine  # benchmarks/ is not a package

OUT = ROOT / "benchmarks/out/checkpoint_memory"
MODES = ("sync", "async", "sync-clone")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--out", default=str(OUT), help="work directory (runs, results JSON)")
    p.add_argument("--data", default=str(ROOT / "benchmarks/out/rowwise/data"))
    p.add_argument("--plan", default=str(ROOT / "benchmarks/out/rowwise/plan.json"))
    p.add_argument("--raw", default=str(ROOT / "benchmarks/out/throughput/raw-rows400000-mh0"),
                   help="raw click log (day_0.tsv, day_1.tsv), made if missing")
    p.add_argument("--rows", type=int, default=400_000, help="rows per day of a raw log made here")
    p.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    p.add_argument("--rounds", type=int, default=1, help="runs of every mode, alternating")
    p.add_argument("--steps", type=int, default=20, help="steps before the save")
    p.add_argument("--after", type=int, default=30, help="steps after the save")
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--override", action="append", default=[], metavar="KEY=VALUE",
                   help="another hybridrec config override (repeatable)")
    p.add_argument("--worker", choices=MODES, help=argparse.SUPPRESS)
    return p.parse_args(argv)


# -- memory ------------------------------------------------------------------------------
def status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


class RssSampler:
    """VmRSS every ``every_s`` in a thread: the highest value seen since :meth:`reset`."""

    def __init__(self, every_s: float = 0.005) -> None:
        self.every_s, self.peak, self._stop = every_s, 0, threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            self.peak = max(self.peak, status_kib("VmRSS"))

    def reset(self) -> None:
        self.peak = status_kib("VmRSS")

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


# -- one rank ----------------------------------------------------------------------------
def worker(args) -> None:
    import torch.distributed as dist

    from hybridrec.parallel import checkpoint as C
    from hybridrec.parallel import checkpoint_layout as L
    from hybridrec.train.build import build_trainer
    from hybridrec.train.setup import recipes
    from hybridrec.train.setup.configure import build_config
    from hybridrec.train.setup.tables import load_dataset

    mode = args.worker
    run_dir = Path(args.out) / f"run-{mode}"
    cfg = build_config(recipes.recipe("bench"), [], [
        f"data.path={args.data}", f"dist.plan={args.plan}", f"dist.nproc={args.ranks}",
        f"train.run_dir={run_dir}", "train.resume=false", "train.progress=false",
        f"train.max_steps={args.steps + args.after}", *args.override])
    if mode == "sync-clone":  # as before: DCP's writer gets the views into the fused weights
        C.own_storage = L.own_storage = lambda t: t.detach()
    sampler = RssSampler()
    trainer = build_trainer(cfg, meta=load_dataset(cfg))
    topo, ck = trainer.topo, trainer.checkpoints.checkpointer
    ck.background = mode == "async"
    built_kib = status_kib("VmHWM")

    def train(n: int) -> list[float]:
        times, t0 = [], time.perf_counter()
        for batch, pending in trainer.pipeline.batches(n):
            trainer.train_step(batch, pending)
            t1 = time.perf_counter()
            times.append(t1 - t0)
            t0 = t1
        return times

    before = train(args.steps)
    dist.barrier(group=topo.group)
    train_kib = status_kib("VmHWM")
    sampler.reset()
    start = time.perf_counter()
    ck.save(trainer.step)
    blocking = time.perf_counter() - start
    blocked_kib = status_kib("VmHWM")  # async: the staged copy is made
    pending = ck._pending  # (async: its staging and writing seconds)
    after = train(args.after)
    ck.wait()
    total = blocking + (pending.writing_s if pending is not None else 0.0)  # (its thread's own end)
    ckpt_kib, window_kib = status_kib("VmHWM"), sampler.peak
    sampler.stop()
    ref = statistics.median(before[-args.after:])
    stall = blocking + max(0.0, sum(after) - ref * len(after))
    views = sum(t.nbytes for t in L.local_weights(trainer.model.sparse).values()
                if t.untyped_storage().nbytes() != t.nbytes)
    mine = {"rank": topo.rank, "built_kib": built_kib, "train_peak_kib": train_kib,
            "ckpt_peak_kib": ckpt_kib, "save_window_peak_kib": window_kib, "blocked_peak_kib": blocked_kib,
            "blocking_s": blocking, "total_s": total, "stall_s": stall,
            "staging_s": pending.staging_s if pending is not None else None,
            "step_s_before": ref, "step_s_after": statistics.median(after),
            "table_view_bytes": views}
    out = [None] * topo.group_size
    dist.all_gather_object(out, mine, group=topo.group)
    if topo.rank == 0:
        files = sorted((p.name, p.stat().st_size) for p in next(run_dir.glob("checkpoints/step-*")).iterdir())
        (Path(args.out) / f"result-{mode}.json").write_text(json.dumps({"mode": mode, "ranks": out,
                                                                         "files": files}))


# -- the driver ---------------------------------------------------------------------------
def prepare(args) -> None:
    data, plan, raw = Path(args.data), Path(args.plan), Path(args.raw)
    hybridrec = [sys.executable, "-m", "hybridrec"]
    if not (data / "meta.json").is_file():
        if not (raw / "day_1.tsv").is_file():
            from hybridrec.data.synth import generate

            generate(raw, days=2, rows_per_day=args.rows, seed=0, multi_hot=0, scale=1.0)
        subprocess.run([*hybridrec, "data", "preprocess", str(raw / "day_0.tsv"), str(raw / "day_1.tsv"),
                        "--out", str(data), "--table-size", "100000,C3=6000000"], check=True)
    if not plan.is_file():
        subprocess.run([*hybridrec, "plan", "--nproc", "2", "--data", str(data), "--dim", "64",
                        "--memory-per-rank", "1.25GiB", "--out", str(plan)], check=True,
                       stdout=subprocess.DEVNULL)


def run_mode(args, mode: str) -> dict:
    me = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={args.ranks}",
          __file__, "--worker", mode, "--out", args.out, "--data", args.data, "--plan", args.plan,
          "--steps", str(args.steps), "--after", str(args.after), "--ranks", str(args.ranks),
          *(f"--override={o}" for o in args.override)]
    result = Path(args.out) / f"result-{mode}.json"
    result.unlink(missing_ok=True)
    proc = subprocess.run(me, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"}, check=False)
    if proc.returncode != 0:
        sys.exit(f"{mode}: the ranks failed:\n{proc.stderr[-4000:]}")
    return json.loads(result.read_text())


def gib(kib: int) -> str:
    return f"{kib / 2**20:.2f}"


def table(runs: list[dict]) -> str:
    rows = [("| mode | training peak GiB (r0 / r1) | checkpointing peak GiB (r0 / r1) | ratio (max) "
             "| save blocking s | save total s | training stall s |"),
            "|---|---|---|---|---|---|---|"]
    for run in runs:
        rs = run["ranks"]
        ratio = max(r["ckpt_peak_kib"] / r["train_peak_kib"] for r in rs)
        m = {k: max(r[k] for r in rs) for k in ("blocking_s", "total_s", "stall_s")}  # the slowest rank's
        rows.append(f"| {run['mode']} | {' / '.join(gib(r['train_peak_kib']) for r in rs)} "
                    f"| {' / '.join(gib(r['ckpt_peak_kib']) for r in rs)} | {ratio:.2f}x "
                    f"| {m['blocking_s']:.2f} | {m['total_s']:.2f} | {m['stall_s']:.2f} |")
    return "\n".join(rows)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.steps < 1 or args.after < 1:
        sys.exit("--steps and --after: at least 1")
    args.out = str(Path(args.out).resolve())
    if args.worker:
        worker(args)
        return 0
    Path(args.out).mkdir(parents=True, exist_ok=True)
    prepare(args)
    load0, started = os.getloadavg(), datetime.datetime.now().astimezone()
    runs = []
    for _ in range(args.rounds):
        for mode in args.modes:
            runs.append(run_mode(args, mode))
            print(f"{mode}: done", file=sys.stderr, flush=True)
    load1 = os.getloadavg()
    report = {"machine": machine(), "date": started.isoformat(timespec="seconds"),
              "load_before": load0, "load_after": load1, "settings": {
                  k: getattr(args, k) for k in ("steps", "after", "ranks", "override", "data", "plan")},
              "runs": runs}
    (Path(args.out) / "checkpoint_memory.json").write_text(json.dumps(report, indent=1))
    print(f"{report['machine']}; {started:%Y-%m-%d %H:%M %Z}; load average {load0[0]:.2f} before, "
          f"{load1[0]:.2f} after; {args.ranks} ranks, {args.steps} steps, save, {args.after} steps\n")
    print(table(runs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
