#!/usr/bin/env python3
"""Hogwild training threads (``train.workers``) against one thread, on this machine.

Each variant is ``train.workers=W train.threads=T`` (W training threads, T torch intra-op
threads; T=0 is torch's default, one per core). One pass over the same synthetic data per
run (``hybridrec data synth`` + ``data preprocess``), no checkpoints, every run in its own
process; rounds alternate the variants so that drift of the machine hits all of them.
Reports per recipe and variant the median train samples/s over the rounds (the trainer's
own measurement: steady-state steps, evaluation excluded), its ratio to the first variant,
and the held-out AUC (mean and spread over the rounds: Hogwild runs are not reproducible).

With ``--bursts N`` it also measures throughput *interleaved*: one process per recipe trains
short bursts (``--burst-samples``) of every variant in turn, N times (after one untimed
repetition), changing ``train.workers`` and torch's threads between bursts; it reports each
variant's median burst rate and the median of its ratio to the first variant within the same
repetition. On a machine that other jobs share, a slow minute then hits every variant alike,
which whole runs minutes apart cannot promise. The 1-minute load average at the start of
every run is recorded.

    .venv/bin/python benchmarks/hogwild.py                        # demo and bench recipes
    .venv/bin/python benchmarks/hogwild.py --recipe demo --rounds 5 \\
        --variant 1x2 --variant 2x1 --variant 2x2 --variant 4x1
    .venv/bin/python benchmarks/hogwild.py --rounds 0 --bursts 20  # interleaved throughput only
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

from throughput import machine  # this folder's: the CPU model and cores

ROOT = Path(__file__).resolve().parents[1]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--out", default=str(ROOT / "benchmarks/out/hogwild"), help="work directory")
    p.add_argument("--data", help="a preprocessed dataset (default: synthesize one under --out)")
    p.add_argument("--days", type=int, default=4, help="synthetic days (the last is held out)")
    p.add_argument("--rows-per-day", type=int, default=100_000)
    p.add_argument("--recipe", action="append", default=[], help="recipes (default: demo, bench)")
    p.add_argument("--variant", action="append", default=[], metavar="WxT",
                   help="train.workers x train.threads (default: 1x0 1x1 2x1 2x2); the first is the baseline")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--max-steps", type=int, default=0, help="train.max_steps (0: one pass)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="more overrides, every run")
    p.add_argument("--bursts", type=int, default=0, help="interleaved repetitions (0: none)")
    p.add_argument("--burst-samples", type=int, default=40_960, help="samples per interleaved burst")
    return p.parse_args(argv)


def hybridrec(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "hybridrec", *args], check=True)


def dataset(args) -> Path:
    if args.data:
        return Path(args.data)
    out = Path(args.out)
    data = out / "data"
    if not (data / "meta.json").exists():
        shutil.rmtree(out / "raw", ignore_errors=True)
        hybridrec("data", "synth", "--out", str(out / "raw"), "--days", str(args.days),
                  "--rows-per-day", str(args.rows_per_day))
        hybridrec("data", "preprocess", *sorted(str(p) for p in (out / "raw").glob("day_*")),
                  "--out", str(data))
    return data


def run(args, data: Path, recipe: str, workers: int, threads: int, rnd: int) -> dict:
    run_dir = Path(args.out) / "runs" / f"{recipe}-w{workers}t{threads}-r{rnd}"
    cmd = ["train", "--recipe", recipe, f"data.path={data}", f"train.run_dir={run_dir}",
           "train.resume=false", "train.save_checkpoints=false", "train.progress=false",
           f"train.workers={workers}", f"train.threads={threads}", f"train.max_steps={args.max_steps}",
           *args.set]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    load = os.getloadavg()[0]  # the machine's 1-minute load when the run starts (others' jobs too)
    subprocess.run([sys.executable, "-m", "hybridrec", *cmd], check=True, env=env,
                   stdout=subprocess.DEVNULL)
    s = json.loads((run_dir / "summary.json").read_text())
    return {"samples_per_sec": s["throughput"]["samples_per_sec"], "auc": s["eval"]["auc"],
            "log_loss": s["eval"]["log_loss"], "steps": s["step"], "wall_seconds": s["wall_seconds"],
            "load": load}


def interleaved(args, data: Path, recipe: str, variants: list[tuple[int, int]]) -> dict:
    """``{variant: [samples/s of each burst]}`` and ``{variant: [ratio to the first variant in
    the same repetition]}`` of one trainer (this process) switching variants between bursts."""
    import torch

    from hybridrec.train.build import build_trainer
    from hybridrec.train.loop.hogwild import HogwildSteps
    from hybridrec.train.loop.parts import StepSource
    from hybridrec.train.setup.configure import build_config
    from hybridrec.train.setup.recipes import recipe as named

    default_threads = torch.get_num_threads()
    cfg = build_config(named(recipe), overrides=[
        f"data.path={data}", f"train.run_dir={Path(args.out) / 'runs' / f'{recipe}-interleaved'}",
        "train.resume=false", "train.save_checkpoints=false", "train.progress=false", "train.epochs=1000",
        *args.set])
    trainer = build_trainer(cfg)
    steps = max(1, args.burst_samples // cfg.data.batch_size)
    rates: dict[tuple, list[float]] = {v: [] for v in variants}
    ratios: dict[tuple, list[float]] = {v: [] for v in variants}
    for rep in range(args.bursts + 1):  # repetition 0 warms up, untimed
        got = {}
        for w, t in variants if rep % 2 else variants[::-1]:  # alternate the order
            torch.set_num_threads(t or default_threads)
            trainer.total_steps = trainer.step + steps
            source = HogwildSteps(trainer.pipeline, w) if w > 1 else StepSource(trainer.pipeline)
            source.start(trainer)  # (Hogwild: the threads' replicas of the model as it is now)
            start = time.perf_counter()
            for _ in source.steps(trainer):  # the loop's steps without its logging
                pass
            got[(w, t)] = steps * cfg.data.batch_size / (time.perf_counter() - start)
        if rep:
            for v in variants:
                rates[v].append(got[v])
                ratios[v].append(got[v] / got[variants[0]])
            print(f"burst {rep} {recipe}: " + ", ".join(f"{w}x{t} {got[(w, t)]:,.0f}" for w, t in variants)
                  + f" samples/s, load {os.getloadavg()[0]:.1f}", file=sys.stderr, flush=True)
    torch.set_num_threads(default_threads)
    return {"rates": rates, "ratios": ratios, "steps_per_burst": steps}


def main(argv=None) -> int:
    args = parse_args(argv)
    recipes = args.recipe or ["demo", "bench"]
    variants = [tuple(int(x) for x in v.lower().split("x")) for v in (args.variant or ["1x0", "1x1", "2x1", "2x2"])]
    data = dataset(args)
    results: dict[tuple, list[dict]] = {}
    for rnd in range(args.rounds):
        for recipe in recipes:
            for w, t in variants:
                r = run(args, data, recipe, w, t, rnd)
                results.setdefault((recipe, w, t), []).append(r)
                print(f"round {rnd} {recipe} workers={w} threads={t}: {r['samples_per_sec']:,.0f} samples/s, "
                      f"AUC {r['auc']:.4f}, load {r['load']:.1f}", file=sys.stderr, flush=True)
    lines = [f"machine: {machine()}   date: {datetime.date.today().isoformat()}   data: {data}"]
    if args.rounds:
        lines += ["", f"Whole runs: one pass each, {args.rounds} rounds", "",
                  ("| recipe | workers | torch threads | samples/s (median) | vs first | AUC (mean ± spread) "
                   "| log loss | load at start (median) |"),
                  "|---|---|---|---|---|---|---|---|"]
    for recipe in recipes if args.rounds else []:
        base = statistics.median(r["samples_per_sec"] for r in results[(recipe, *variants[0])])
        for w, t in variants:
            rs = results[(recipe, w, t)]
            sps = statistics.median(r["samples_per_sec"] for r in rs)
            aucs = [r["auc"] for r in rs]
            lines.append(f"| {recipe} | {w} | {t or 'default'} | {sps:,.0f} | {sps / base:.2f}x | "
                         f"{statistics.mean(aucs):.4f} ± {(max(aucs) - min(aucs)) / 2:.4f} | "
                         f"{statistics.mean(r['log_loss'] for r in rs):.4f} | "
                         f"{statistics.median(r['load'] for r in rs):.1f} |")
    bursts = {}
    if args.bursts:
        lines += ["", (f"Interleaved: {args.bursts} repetitions of {args.burst_samples:,}-sample bursts per "
                       "variant, one process per recipe"), "",
                  ("| recipe | workers | torch threads | samples/s (median burst) | vs first, same repetition "
                   "(median [min, max]) |"), "|---|---|---|---|---|"]
        for recipe in recipes:
            b = bursts[recipe] = interleaved(args, data, recipe, variants)
            for w, t in variants:
                r = b["ratios"][(w, t)]
                lines.append(f"| {recipe} | {w} | {t or 'default'} | {statistics.median(b['rates'][(w, t)]):,.0f} | "
                             f"{statistics.median(r):.2f}x [{min(r):.2f}, {max(r):.2f}] |")
    text = "\n".join(lines)
    print(text)
    (Path(args.out) / "results.md").write_text(text + "\n")
    (Path(args.out) / "results.json").write_text(json.dumps(
        {"runs": {f"{k[0]} w{k[1]} t{k[2]}": v for k, v in results.items()},
         "bursts": {r: {f"w{w}t{t}": {"rates": b["rates"][(w, t)], "ratios": b["ratios"][(w, t)]}
                        for w, t in variants} for r, b in bursts.items()}}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
