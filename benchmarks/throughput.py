#!/usr/bin/env python3
"""Single-process training throughput: hybridrec vs TorchRec, side by side.

Model: DLRM, 26 tables x 100,000 rows x dim 64, bottom MLP 13-512-256-64,
top MLP 512-256-1, batch 2048, SGD (dense and sparse), one process.

    .venv/bin/python benchmarks/throughput.py                 # both, 3 alternating rounds
    .venv/bin/python benchmarks/throughput.py --no-peer       # hybridrec only
    .venv/bin/python benchmarks/throughput.py --no-peer --no-ablation --baseline-rev HEAD~1
                                                              # this tree vs an earlier commit

Data: a synthetic Criteo-like click log (Zipf ids) preprocessed into the binary
shards with 100,000-row tables (hex ids modulo 100,000). hybridrec reads its
batches from the shards through the loader while it trains. TorchRec trains on
the first --peer-batches batches that the same loader yields (dumped to .npz,
cycled in memory, as TorchRec's own benchmarks do with random batches).
Each framework runs in its own process (peak RSS is per process); rounds
alternate hybridrec / TorchRec so that drift of the machine hits both.
hybridrec's runs also report the minor page faults per step and rank of the timed
steps (``--variant system=train.allocator=system`` against the default ``retain``), and
the voluntary context switches per step and rank (threads that slept and were woken:
an OpenMP team that sleeps between operators shows here, docs/design.md "One OpenMP team").
The TorchRec environment is made by benchmarks/peers/setup_torchrec.sh.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PEER_PY = ROOT / "benchmarks/peers/.venv-torchrec/bin/python"
PEER_SCRIPT = ROOT / "benchmarks/peers/torchrec_dlrm.py"
TABLE_ROWS = 100_000


def bench_parser(doc: str, out: str, rows: int) -> argparse.ArgumentParser:
    """The arguments every script on the benchmark model takes: work directory, data, batch
    and ranks (``doc``: the script's docstring)."""
    p = argparse.ArgumentParser(description=doc.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=doc)
    p.add_argument("--out", default=str(ROOT / out), help="work directory")
    p.add_argument("--rows", type=int, default=rows, help="training rows to synthesize")
    p.add_argument("--multi-hot", type=int, default=0, help="ids per feature (0 = one-hot)")
    p.add_argument("--batch-size", type=int, default=2048, help="per rank")
    p.add_argument("--nproc", type=int, default=1, help="local ranks (torchrun; TorchRec: DMP)")
    return p


def parse_args(argv=None):
    p = bench_parser(__doc__, "benchmarks/out/throughput", 400_000)
    p.add_argument("--sharding", default="table_wise", help="hybridrec's dist.sharding with --nproc > 1")
    p.add_argument("--steps", type=int, default=60, help="timed steps per run")
    p.add_argument("--warmup", type=int, default=10, help="untimed steps first")
    p.add_argument("--rounds", type=int, default=3, help="alternating rounds")
    p.add_argument("--peer", action=argparse.BooleanOptionalAction, default=True,
                   help="also run TorchRec (needs benchmarks/peers/setup_torchrec.sh)")
    p.add_argument("--peer-batches", type=int, default=16, help="batches handed to TorchRec")
    p.add_argument("--ablation", action=argparse.BooleanOptionalAction, default=True,
                   help="also run hybridrec with torch's F.linear in every layer (train.kernels=torch)")
    p.add_argument("--variant", action="append", default=[], metavar="NAME=KEY=VALUE,...",
                   help="another hybridrec configuration in every round, e.g. "
                        "nopipe=dist.pipeline=false (repeatable)")
    p.add_argument("--baseline-rev", metavar="REV",
                   help="also run hybridrec as of this git revision (e.g. HEAD~1) in every round, "
                        "as it is and with every --variant: its source is exported under --out and "
                        "run with its own worker")
    p.add_argument("--override", action="append", default=[], help=argparse.SUPPRESS)
    p.add_argument("--worker", choices=["hybridrec"], help=argparse.SUPPRESS)
    p.add_argument("--data", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def prepare_data(args) -> Path:
    from hybridrec.data.preprocess import preprocess_criteo
    from hybridrec.data.synth import generate

    out = Path(args.out)
    tag = f"rows{args.rows}-mh{args.multi_hot}"
    data = out / f"data-{tag}"
    if (data / "meta.json").is_file():
        return data
    raw = out / f"raw-{tag}"
    # Day 0 trains, day 1 (small) is the held-out split the loader needs.
    generate(raw, days=2, rows_per_day=args.rows, seed=0, multi_hot=args.multi_hot,
             scale=1.0)
    files = sorted(raw.glob("day_*"))
    mh = [f"C{i}" for i in range(1, 27)] if args.multi_hot else ()
    preprocess_criteo(files, data, table_size=TABLE_ROWS, multi_hot_fields=mh, overwrite=True)
    return data


def dump_peer_batches(data: Path, args) -> Path:
    import numpy as np

    from hybridrec.data.loader import ShardedLoader
    from hybridrec.data.schema import DatasetMeta

    path = Path(args.out) / f"peer-batches-{data.name}.npz"
    if path.is_file():
        return path
    loader = ShardedLoader(DatasetMeta.load(data), split="train", batch_size=args.batch_size,
                           shuffle=True, seed=0, prefetch=0)
    dense, values, lengths, labels = [], [], [], []
    for i, b in enumerate(loader):
        if i == args.peer_batches:
            break
        dense.append(b.dense.numpy())
        values.append(b.sparse.values.numpy())  # key-major, as TorchRec's KJT
        lengths.append(b.sparse.lengths.numpy())
        labels.append(b.labels.numpy())
    offsets = np.concatenate([[0], np.cumsum([v.size for v in values])])
    np.savez(path, dense=np.concatenate(dense), labels=np.concatenate(labels),
             kjt_values=np.concatenate(values), kjt_lengths=np.stack(lengths), kjt_offsets=offsets)
    return path


def worker_hybridrec(args) -> dict:
    """Train the benchmark model from the shards; print one JSON line."""
    import torch

    from hybridrec.train.build import build_trainer
    from hybridrec.train.setup import recipes
    from hybridrec.train.setup.configure import build_config

    cfg = build_config(recipes.recipe("bench"), overrides=[
        f"data.path={args.data}", f"data.batch_size={args.batch_size}",
        f"train.run_dir={Path(args.out) / 'run-hybridrec'}", "train.resume=false",
        "train.progress=false", f"dist.sharding={args.sharding}", *args.override])
    trainer = build_trainer(cfg)
    world = trainer.topo.group_size
    total = args.warmup + args.steps
    # Through the trainer's pipeline (dist.pipeline: the next batch's ids travel during a step).
    it = trainer.pipeline.batches(total)
    start = faults = switches = None
    gpu = trainer.topo.device.type == "cuda"
    for i in range(total):
        if i == args.warmup:
            if gpu:  # (the warm-up's kernels end before the clock starts)
                torch.cuda.synchronize()
            start = time.perf_counter()
            usage = resource.getrusage(resource.RUSAGE_SELF)
            faults, switches = usage.ru_minflt, usage.ru_nvcsw
        item = next(it, None)
        if item is None:  # a new pass over the data
            it = trainer.pipeline.batches(total - i)
            item = next(it)
        trainer.train_step(*item)  # (batch, its input_dist handle when pipelined)
    if gpu:
        torch.cuda.synchronize()
    secs = time.perf_counter() - start
    usage = resource.getrusage(resource.RUSAGE_SELF)
    rss, faults = usage.ru_maxrss * 1024, (usage.ru_minflt - faults) / args.steps
    switches = (usage.ru_nvcsw - switches) / args.steps
    if world > 1:  # total peak RSS over the ranks, like the peer reports; faults, switches: per rank
        import torch.distributed as dist

        t = torch.tensor([rss, secs, faults, switches], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
        rss, secs, faults, switches = int(t[0]), float(t[1]) / world, float(t[2]) / world, float(t[3]) / world
    return {"framework": "hybridrec", "kernels": trainer.kernels, "world_size": world,
            "device": str(trainer.topo.device),
            "samples_per_sec": args.steps * args.batch_size * world / secs, "steps": args.steps,
            "batch_size": args.batch_size, "threads": torch.get_num_threads(),
            "peak_rss_bytes": rss, "page_faults_per_step": faults, "switches_per_step": switches,
            "rank": trainer.topo.rank}


def run_json(cmd: list[str], env=None) -> dict:
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stderr[-3000:]}")
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    result = json.loads(lines[-1])
    if "samples_per_s" in result:  # the peer script's name for it
        result["samples_per_sec"] = result["samples_per_s"]
        result["peak_rss_bytes"] = int(result["peak_rss_mb_total"] * 2**20)
    return result


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.worker:
        result = worker_hybridrec(args)
        if result["rank"] == 0:
            print(json.dumps(result))
        return 0
    if args.peer and not PEER_PY.exists():
        print("TorchRec venv missing: run benchmarks/peers/setup_torchrec.sh (or pass --no-peer)",
              file=sys.stderr)
        return 2
    data = prepare_data(args)
    launcher = [sys.executable]
    if args.nproc > 1:
        launcher += ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={args.nproc}"]
    me = [*launcher, __file__, "--worker", "hybridrec", "--data", str(data), "--out", args.out,
          "--steps", str(args.steps), "--warmup", str(args.warmup), "--batch-size", str(args.batch_size),
          "--sharding", args.sharding]
    variants = {}
    for v in args.variant:
        name, _, rest = v.partition("=")
        if not name or not rest:
            raise SystemExit(f"--variant {v!r}: expected NAME=KEY=VALUE[,KEY=VALUE...]")
        variants[name] = [a for kv in rest.split(",") if kv for a in ("--override", kv)]
    baseline = baseline_command(args, me) if args.baseline_rev else None
    runs: dict[str, list[dict]] = {"hybridrec": [], **{k: [] for k in variants},
                                   "hybridrec (torch F.linear)": [], "torchrec": []}
    at_base = {}  # variant -> its run name on the baseline
    if baseline:  # the revision as it is, and with every variant
        runs[baseline[0]] = []
        at_base = {name: f"{name} @ {baseline[0].split(' @ ')[1]}" for name in variants}
        runs.update({run: [] for run in at_base.values()})
    peer = None
    if args.peer:
        npz = dump_peer_batches(data, args)
        peer = [str(PEER_PY), str(PEER_SCRIPT), "--batches", str(npz), "--steps", str(args.steps),
                "--warmup", str(args.warmup), "--batch-size", str(args.batch_size),
                "--nproc", str(args.nproc)]
    for r in range(args.rounds):
        runs["hybridrec"].append(run_json(me))
        for name, extra in variants.items():
            runs[name].append(run_json([*me, *extra]))
        if baseline:
            runs[baseline[0]].append(run_json(baseline[1], env=baseline[2]))
            for name, extra in variants.items():
                runs[at_base[name]].append(run_json([*baseline[1], *extra], env=baseline[2]))
        if args.ablation:
            runs["hybridrec (torch F.linear)"].append(
                run_json([*me, "--override", "train.kernels=torch"]))
        if peer:
            runs["torchrec"].append(run_json(peer))
        print(f"round {r + 1}/{args.rounds}: " + ", ".join(
            f"{k} {v[-1]['samples_per_sec']:,.0f}" for k, v in runs.items() if v), file=sys.stderr)
    report = summarize(runs, args, data)
    out = Path(args.out) / f"throughput-nproc{args.nproc}-mh{args.multi_hot}.json"
    out.write_text(json.dumps(report, indent=2))
    print(format_report(report))
    print(f"\nwritten: {out}")
    return 0


def baseline_command(args, me: list[str]) -> tuple[str, list[str], dict]:
    """``(name, command, env)`` that runs the worker of hybridrec as of ``--baseline-rev``:
    ``git archive`` of that revision under --out, its own benchmark script, its ``src`` first
    on PYTHONPATH (ahead of the installed package)."""
    rev = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", args.baseline_rev],
                         capture_output=True, text=True, check=False)
    if rev.returncode:
        raise SystemExit(f"--baseline-rev {args.baseline_rev}: {rev.stderr.strip()}")
    sha = rev.stdout.strip()
    tree = Path(args.out) / f"rev-{sha}"
    if not (tree / "src").is_dir():
        tree.mkdir(parents=True, exist_ok=True)
        archive = subprocess.run(["git", "-C", str(ROOT), "archive", sha], capture_output=True, check=True)
        subprocess.run(["tar", "-x", "-C", str(tree)], input=archive.stdout, check=True)
    script = me.index(__file__)
    cmd = [*me[:script], str(tree / "benchmarks/throughput.py"), *me[script + 1:]]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(tree / "src"),
                                                                      os.environ.get("PYTHONPATH")]))}
    return f"hybridrec @ {sha}", cmd, env


def summarize(runs: dict, args, data: Path) -> dict:
    rows = {}
    for name, rs in runs.items():
        if not rs:
            continue
        sps = [r["samples_per_sec"] for r in rs]
        rows[name] = {"median_samples_per_sec": statistics.median(sps), "runs": sps,
                      "peak_rss_mib": max(r["peak_rss_bytes"] for r in rs) / 2**20}
        if all("page_faults_per_step" in r for r in rs):  # (hybridrec's runs; minor faults per rank)
            rows[name]["page_faults_per_step"] = statistics.median(r["page_faults_per_step"] for r in rs)
        if all("switches_per_step" in r for r in rs):  # (voluntary context switches per rank)
            rows[name]["switches_per_step"] = statistics.median(r["switches_per_step"] for r in rs)
        if rs[0].get("kernels"):  # the first run's choices: what the run-time measurement picked
            k = rs[0]["kernels"]
            rows[name]["device"] = rs[0].get("device", "cpu")
            rows[name]["kernels"] = {c["shape"]: c["impl"] for part in ("linear", "interaction", "embedding_update", "embedding_lookup")
                                     for c in k.get(part, []) if c.get("shape")}
    if "torchrec" in rows:
        base = rows["torchrec"]["median_samples_per_sec"]
        for v in rows.values():
            v["vs_torchrec"] = v["median_samples_per_sec"] / base
    return {"date": time.strftime("%Y-%m-%d"), "machine": machine(), "data": str(data),
            "settings": {k: getattr(args, k) for k in ("rows", "multi_hot", "batch_size", "nproc",
                                                       "sharding", "steps", "warmup", "rounds",
                                                       "peer_batches")},
            "results": rows}


def machine() -> str:
    """The processor's name, family and model, and the cores this process may use (its
    affinity: a run under ``taskset -c 0,1`` says 2 of the machine's count)."""
    from hybridrec.model.kernels import cpu_info

    info = cpu_info()
    model = info.get("model name", "unknown cpu")
    if "cpu family" in info:
        model += f" (family {info['cpu family']}, model {info.get('model', '?')})"
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count()))
    used = len(cpus)
    cores = f"{used} cores" if used == os.cpu_count() else f"{used} of {os.cpu_count()} cores"
    physical = physical_cores(cpus)
    if physical is not None and physical < used:  # (SMT siblings: half a core's throughput each)
        cores += f" on {physical} physical core{'s' if physical > 1 else ''} (SMT siblings)"
    return f"{model}, {cores}"


def physical_cores(cpus: list[int]) -> int | None:
    """How many physical cores the logical CPUs ``cpus`` sit on (Linux sysfs topology; None
    where it cannot be read). A run under ``taskset -c 0,1`` on a large host may have been
    given two hyper-threads of one core."""
    seen = set()
    for c in cpus:
        topo = Path(f"/sys/devices/system/cpu/cpu{c}/topology")
        try:
            seen.add((topo.joinpath("physical_package_id").read_text().strip(),
                      topo.joinpath("core_id").read_text().strip()))
        except OSError:
            return None
    return len(seen)


def format_report(rep: dict) -> str:
    lines = [f"machine: {rep['machine']}   date: {rep['date']}", "",
             "| run | samples/s (median) | runs | peak RSS | page faults/step | switches/step | vs TorchRec |",
             "|---|---|---|---|---|---|---|"]
    for name, v in rep["results"].items():
        ratio = f"{v['vs_torchrec']:.2f}x" if "vs_torchrec" in v else "-"
        runs = ", ".join(f"{x:,.0f}" for x in v["runs"])
        faults = f"{v['page_faults_per_step']:,.0f}" if "page_faults_per_step" in v else "-"
        switches = f"{v['switches_per_step']:,.0f}" if "switches_per_step" in v else "-"
        lines.append(f"| {name} | {v['median_samples_per_sec']:,.0f} | {runs} | "
                     f"{v['peak_rss_mib']:,.0f} MiB | {faults} | {switches} | {ratio} |")
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
