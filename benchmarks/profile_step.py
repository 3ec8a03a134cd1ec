#!/usr/bin/env python3
"""Where a training step's time goes: torch.profiler over steps of the benchmark DLRM.

The model and data are benchmarks/throughput.py's (26 tables x 100,000 rows x dim 64,
bottom MLP 13-512-256-64, top MLP 512-256-1, batch 2048 per rank). After --warmup
steps, --steps steps run under torch.profiler; the report gives, per step:

- the phases the training step marks (forward: embeddings, bottom_mlp, interaction,
  top_mlp; backward; grad_sync; dense_update; sparse_update) and the time outside them
  (the loader and the pipeline),
- the operators with the most self time (the backward's autograd nodes included).

    .venv/bin/python benchmarks/profile_step.py                      # fp32 and bf16, 1 process
    .venv/bin/python benchmarks/profile_step.py --precision bf16 --nproc 2

Several ranks run under torchrun; rank 0 profiles (its all-to-all waits show in the
phases that hold them). Writes benchmarks/out/profile/profile-*.json and prints tables.
"""

from __future__ import annotations

import argparse
import datetime
import json
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from throughput import (  # this folder's: arguments, data, CPU model
    bench_parser,
    machine,
    prepare_data,
)

from hybridrec.phases import MP_PHASES  # the coded hop's own ranges, inside forward and backward

ROOT = Path(__file__).resolve().parents[1]
PHASES = ("forward", "embeddings", "bottom_mlp", "interaction", "top_mlp", "backward", "grad_sync",
          "dense_update", "sparse_update", *MP_PHASES)
NESTED = {"embeddings", "bottom_mlp", "interaction", "top_mlp"}  # inside forward


def parse_args(argv=None):
    p = bench_parser(__doc__, "benchmarks/out/profile", 200_000)
    p.add_argument("--precision", action="append", choices=["fp32", "bf16"],
                   help="train.precision (repeatable; default: fp32, and bf16 where the processor has bf16 kernels)")
    p.add_argument("--steps", type=int, default=20, help="profiled steps")
    p.add_argument("--warmup", type=int, default=10, help="steps before profiling")
    p.add_argument("--top", type=int, default=15, help="operators listed")
    p.add_argument("--override", action="append", default=[], metavar="KEY=VALUE",
                   help="another config override (repeatable)")
    p.add_argument("--shapes", action="store_true",
                   help="group the operators by input shapes (records shapes; adds overhead)")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--data", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def worker(args) -> dict | None:
    import torch
    from torch.profiler import ProfilerActivity, profile

    from hybridrec.train.build import build_trainer
    from hybridrec.train.setup import recipes
    from hybridrec.train.setup.configure import build_config

    precision = args.precision[0]
    cfg = build_config(recipes.recipe("bench"), overrides=[
        f"data.path={args.data}", f"data.batch_size={args.batch_size}",
        f"train.run_dir={Path(args.out) / f'run-{precision}'}", "train.resume=false",
        "train.progress=false", f"train.precision={precision}", *args.override])
    trainer = build_trainer(cfg)
    it = trainer.pipeline.batches(args.warmup + args.steps)
    for _ in range(args.warmup):
        trainer.train_step(*next(it))
    with profile(activities=[ProfilerActivity.CPU], record_shapes=args.shapes) as prof:
        start = time.perf_counter()
        for _ in range(args.steps):
            trainer.train_step(*next(it))
        wall = time.perf_counter() - start
    if trainer.topo.rank != 0:
        return None
    n = args.steps
    by_name = {e.key: e for e in prof.key_averages()}
    avg = prof.key_averages(group_by_input_shape=True) if args.shapes else by_name.values()
    phases = {k: by_name[k].cpu_time_total / 1e3 / n for k in PHASES if k in by_name}
    step_ms = wall * 1e3 / n
    top_level = sum(v for k, v in phases.items() if k not in NESTED and k not in MP_PHASES)
    ops = sorted((e for e in avg if e.key not in PHASES and not e.key.startswith("ProfilerStep")),
                 key=lambda e: e.self_cpu_time_total, reverse=True)[: args.top]
    return {
        "precision": precision, "world_size": trainer.topo.group_size, "batch_size": args.batch_size,
        "threads": torch.get_num_threads(), "step_ms": step_ms,
        "samples_per_sec": args.batch_size * trainer.topo.group_size / (wall / n),
        "phases_ms": phases, "outside_phases_ms": step_ms - top_level,
        "ops": [{"op": e.key + (f" {e.input_shapes}" if args.shapes else ""), "self_ms": e.self_cpu_time_total / 1e3 / n, "calls": e.count / n} for e in ops],
        "kernels": trainer.kernels,
    }


def fmt(rep: dict) -> str:
    step = rep["step_ms"]
    lines = [(f"### {rep['precision']}, {rep['world_size']} rank(s), batch {rep['batch_size']}/rank, "
              f"{rep['threads']} threads: {step:.1f} ms/step, {rep['samples_per_sec']:,.0f} samples/s"), "",
             "| phase | ms/step | share |", "|---|---|---|"]
    for k in PHASES:
        if k in rep["phases_ms"]:
            v = rep["phases_ms"][k]
            name = f"  {k} (in forward)" if k in NESTED else f"  {k} (in the step)" if k in MP_PHASES else k
            lines.append(f"| {name} | {v:.2f} | {v / step:.0%} |")
    lines.append(f"| outside the step (loader, pipeline) | {rep['outside_phases_ms']:.2f} | "
                 f"{rep['outside_phases_ms'] / step:.0%} |")
    lines += ["", "| operator (self time) | ms/step | calls/step |", "|---|---|---|"]
    lines += [f"| {o['op']} | {o['self_ms']:.2f} | {o['calls']:.0f} |" for o in rep["ops"]]
    return "\n".join(lines)


def main(argv=None) -> int:
    args = parse_args(argv)
    if not args.precision:  # (bf16 where this processor trains it: refused on one without bf16 kernels)
        from hybridrec.model.kernels import precision_problem

        refused = precision_problem("bf16", "cpu")
        if refused and not args.worker:
            print(f"bf16 left out: {refused}", file=sys.stderr)
        args.precision = ["fp32"] if refused else ["fp32", "bf16"]
    if args.worker:
        rep = worker(args)
        if rep is not None:
            print(json.dumps(rep))
        return 0
    data = prepare_data(args)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    launcher = [sys.executable]
    if args.nproc > 1:
        launcher += ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={args.nproc}"]
    print(f"machine: {machine()}   date: {datetime.date.today()}\n")
    for precision in args.precision:
        cmd = [*launcher, __file__, "--worker", "--data", str(data), "--out", str(out),
               "--batch-size", str(args.batch_size), "--steps", str(args.steps), "--warmup",
               str(args.warmup), "--top", str(args.top), "--precision", precision,
               *(["--shapes"] if args.shapes else []),
               *[a for o in args.override for a in ("--override", o)]]
        proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if proc.returncode != 0:
            print(proc.stderr[-3000:], file=sys.stderr)
            return 1
        rep = json.loads([ln for ln in proc.stdout.splitlines() if ln.startswith("{")][-1])
        rep.update(machine=machine(), date=str(datetime.date.today()), command=" ".join(sys.argv))
        path = out / f"profile-{precision}-nproc{args.nproc}-mh{args.multi_hot}.json"
        path.write_text(json.dumps(rep, indent=2))
        print(fmt(rep) + f"\n\nwritten: {path}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
