#!/usr/bin/env python3
"""Training throughput in the namespace cluster: hybridrec vs TorchRec at a capped link rate.

    sudo .venv/bin/python benchmarks/cluster_throughput.py --rate 1gbit            # 3 rounds
    sudo .venv/bin/python benchmarks/cluster_throughput.py --rate 1gbit -- \\
        compress.dense=dct compress.embedding=dct                  # overrides for hybridrec
    sudo .venv/bin/python benchmarks/cluster_throughput.py --rate none --world 2   # no cap

Every rank runs in its own network namespace, every link carries --rate each way (tc tbf,
hybridrec.bench.netns), one torchrun per namespace (--nnodes W --node-rank i
--nproc-per-node 1, GLOO_SOCKET_IFNAME=eth0). Rounds alternate hybridrec and TorchRec
inside the same cluster; the median of the rounds is reported.

Model: DLRM 26 tables x 100,000 rows x dim 64, bottom 13-512-256-64, top 512-256-1, SGD
(--optimizers default: Adam and row-wise Adagrad in both systems), 2048 samples per rank,
table-wise sharding for both. hybridrec: `python -m hybridrec train
--recipe bench ...` on the preprocessed shards of benchmarks/throughput.py (same data
preparation); its held-out AUC is read from the run's summary.json. TorchRec:
benchmarks/peers/torchrec_dlrm.py (DistributedModelParallel, fused FBGEMM SGD) on the first
--peer-batches batches the same loader yields. Threads per rank: cores // world (as torchrun
sets for local ranks). hybridrec's own meter leaves out its first min(5, steps/10) steps;
TorchRec's leaves out --warmup steps.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import throughput  # data preparation shared with the local benchmark

PEER_PY = ROOT / "benchmarks/peers/.venv-torchrec/bin/python"
PEER_SCRIPT = ROOT / "benchmarks/peers/torchrec_dlrm.py"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE",
                   help="hybridrec config overrides for every hybridrec run (after --), "
                        "e.g. model.embedding_dim=128")
    p.add_argument("--variant", action="append", default=[], metavar="NAME=KEY=VALUE,...",
                   help="another hybridrec configuration run in every round, e.g. "
                        "dct=compress.dense=dct,compress.embedding=dct (repeatable)")
    p.add_argument("--rate", default="1gbit",
                   help="per-direction link cap (tc units; none = uncapped)")
    p.add_argument("--world", type=int, default=2, help="ranks = namespaces")
    p.add_argument("--rounds", type=int, default=3, help="alternating rounds")
    p.add_argument("--steps", type=int, default=60, help="timed steps per run")
    p.add_argument("--one-pass", action="store_true",
                   help="hybridrec runs train one pass over the training split instead: "
                        "rows // (world x batch) steps, --warmup of them untimed")
    p.add_argument("--warmup", type=int, default=5, help="untimed steps first")
    p.add_argument("--batch-size", type=int, default=2048, help="per rank")
    p.add_argument("--sharding", default="table_wise", help="hybridrec's dist.sharding")
    p.add_argument("--rows", type=int, default=400_000, help="training rows to synthesize")
    p.add_argument("--multi-hot", type=int, default=0, help="ids per feature (0 = one-hot)")
    p.add_argument("--data", help="an existing preprocessed dataset (default: made under --out)")
    p.add_argument("--peer", action=argparse.BooleanOptionalAction, default=True,
                   help="also run TorchRec (needs benchmarks/peers/setup_torchrec.sh)")
    p.add_argument("--peer-batches", type=int, default=16, help="batches handed to TorchRec")
    p.add_argument("--out", default=str(ROOT / "benchmarks/out/cluster"), help="work directory")
    p.add_argument("--no-base", action="store_true",
                   help="run only the --variant configurations, not the positional overrides alone")
    p.add_argument("--baseline", action="append", default=[], metavar="NAME",
                   help="also report every run's throughput as a multiple of this run's "
                        "(a variant name or hybridrec; repeatable)")
    p.add_argument("--optimizers", choices=["bench", "default"], default="bench",
                   help="bench: plain SGD 0.01 for both parts in both systems (--recipe bench); "
                        "default: hybridrec's default optimizers (Adam 0.001 dense, row-wise "
                        "Adagrad 0.05 embeddings, 50 warm-up steps) and TorchRec's equivalents "
                        "(Adam, fused EXACT_ROWWISE_ADAGRAD)")
    p.add_argument("--timeout", type=float, default=900, help="seconds per run")
    return p.parse_args(argv)


def total_steps(args, data: Path) -> int:
    """Steps of a hybridrec run: --warmup + --steps, or with --one-pass one pass over the
    training split."""
    if not args.one_pass:
        return args.warmup + args.steps
    from hybridrec.data.schema import DatasetMeta

    return DatasetMeta.load(data).split_rows("train") // (args.world * args.batch_size)


def default_optimizers() -> list[str]:
    """--optimizers default: the bench recipe's SGD replaced by OptimConfig's defaults."""
    from hybridrec.train.setup.config import OptimConfig

    c = OptimConfig()
    return [f"optim.{k}={getattr(c, k)}" for k in ("dense", "dense_lr", "sparse", "sparse_lr", "eps", "warmup_steps")]


def hybridrec_script(args, data: Path, run_dir: Path, overrides: list[str]) -> list[str]:
    optim = default_optimizers() if args.optimizers == "default" else []
    return ["-m", "hybridrec", "train", "--recipe", "bench", f"data.path={data}",
            f"data.batch_size={args.batch_size}", f"dist.sharding={args.sharding}",
            f"train.max_steps={total_steps(args, data)}", f"train.run_dir={run_dir}",
            "train.resume=false", "train.progress=false", "train.save_checkpoints=false",
            *optim, *overrides]


def variants(args) -> dict[str, list[str]]:
    """hybridrec configurations per round: "hybridrec" (the positional overrides), then
    every --variant NAME=KEY=VALUE,KEY=VALUE (the positional overrides first, then its own:
    the positional ones set the model every variant trains)."""
    out = {} if getattr(args, "no_base", False) else {"hybridrec": list(args.overrides)}
    for v in args.variant:
        name, _, rest = v.partition("=")
        if not name or not rest or name in out or name == "torchrec":
            raise SystemExit(f"--variant {v!r}: expected a new NAME=KEY=VALUE[,KEY=VALUE...]")
        out[name] = [*args.overrides, *(kv for kv in rest.split(",") if kv)]
    return out


def peer_script(args, npz: Path) -> list[str]:
    optim = ["--optimizers", "default"] if args.optimizers == "default" else []
    return [str(PEER_SCRIPT), "--batches", str(npz), "--steps", str(args.steps),
            "--warmup", str(args.warmup), "--batch-size", str(args.batch_size), *optim]


def run_one(cluster, name: str, script: list[str], python: str, env: dict, args,
            port: int, log_dir: Path) -> list:
    cmds = [cluster.torchrun_argv(r, script, port=port, python=python)
            for r in range(cluster.world_size)]
    rank_env = {**env, **cluster.env(0)}
    shown = " ".join(f"{k}={v}" for k, v in sorted(rank_env.items()))
    print(f"# {name}, rank 0 of {cluster.world_size} (rank i: namespace "
          f"{cluster.nodes[0].netns[:-1]}<i>, --node-rank=<i>):\n"
          f"#   ip netns exec {cluster.nodes[0].netns} env {shown} {shlex.join(cmds[0])}",
          file=sys.stderr, flush=True)
    res = cluster.run(cmds, timeout_s=args.timeout, env=env, log_dir=log_dir, cwd=ROOT)
    bad = [r for r in res if not r.ok]
    if bad:
        r = bad[0]
        raise SystemExit(f"{name}: rank {r.rank} failed (exit {r.returncode}, timed out "
                         f"{r.timed_out}); logs in {log_dir}:\n{r.stderr[-3000:]}")
    return res


def hybridrec_result(run_dir: Path) -> dict:
    s = json.loads((run_dir / "summary.json").read_text())
    t = s["throughput"]
    return {"samples_per_sec": t["samples_per_sec_overall"], "measured_steps": t["measured_steps"],
            "auc": s["eval"].get("auc"), "log_loss": s["eval"].get("log_loss"),
            "eval_rows": s["eval"].get("count"),
            "peak_rss_bytes": sum(s["peak_memory_bytes_per_rank"]),
            "sent_bytes_per_step_rank0": _sent_per_step(s),
            "sent_bytes_per_step_by_category_rank0": _sent_per_step_by_category(s),
            "steps": s.get("step"), "sync": s.get("sync")}


def _sent_per_step(summary: dict) -> float | None:
    """Bytes rank 0 put on the wire per training step (its ledger)."""
    mean = ((summary.get("comm") or {}).get("per_step") or {}).get("mean") or {}
    return mean.get("sent")


def _sent_per_step_by_category(summary: dict) -> dict:
    by = ((summary.get("comm") or {}).get("per_step") or {}).get("mean_by_category") or {}
    return {k: v.get("sent") for k, v in by.items()}


def peer_result(res) -> dict:
    line = [ln for ln in res[0].stdout.splitlines() if ln.startswith("{")][-1]
    r = json.loads(line)
    return {"samples_per_sec": r["samples_per_s"], "measured_steps": r["steps"],
            "samples_per_sec_from_median_step": r["samples_per_s_from_median_step"],
            "peak_rss_bytes": int(r["peak_rss_mb_total"] * 2**20),
            "sharding_types_used": r["sharding_types_used"]}


def main(argv=None) -> int:
    args = parse_args(argv)
    from hybridrec.bench.netns import format_rate, netns_cluster, parse_rate

    rate_bps = parse_rate(args.rate)
    if args.peer and not PEER_PY.exists():
        print("TorchRec venv missing: run benchmarks/peers/setup_torchrec.sh (or pass --no-peer)",
              file=sys.stderr)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    data = Path(args.data) if args.data else throughput.prepare_data(args)
    npz = throughput.dump_peer_batches(data, args) if args.peer else None
    threads = max(1, (os.cpu_count() or 1) // args.world)
    src = str(ROOT / "src")
    env = {"OMP_NUM_THREADS": str(threads),
           "PYTHONPATH": _pythonpath(src)}
    configs = variants(args)
    runs: dict[str, list[dict]] = {**{k: [] for k in configs}, "torchrec": []}
    commands: dict[str, str] = {}
    with netns_cluster(args.world, args.rate) as c:
        print(f"# cluster: {args.world} namespaces, {format_rate(rate_bps)} per direction per "
              f"rank, tbf burst {c.burst_bytes} B; built by:\n#   "
              + "\n#   ".join(c.setup_commands), file=sys.stderr)
        port = 29500
        for rnd in range(args.rounds):
            for name, overrides in configs.items():
                run_dir = out / f"run-{name}"
                port += 1  # a fresh store port per run: the last one may linger in TIME_WAIT
                script = hybridrec_script(args, data, run_dir, overrides)
                run_one(c, name, script, sys.executable, env, args, port, out / f"logs/{name}-{rnd}")
                runs[name].append(hybridrec_result(run_dir))
                commands[name] = shlex.join(c.torchrun_argv(0, script, port=port))
            if args.peer:
                port += 1
                res = run_one(c, "torchrec", peer_script(args, npz), str(PEER_PY),
                              {"OMP_NUM_THREADS": str(threads)}, args, port,
                              out / f"logs/torchrec-{rnd}")
                runs["torchrec"].append(peer_result(res))
                commands["torchrec"] = shlex.join(c.torchrun_argv(
                    0, peer_script(args, npz), port=port, python=str(PEER_PY)))
            print(f"round {rnd + 1}/{args.rounds}: " + ", ".join(
                f"{k} {v[-1]['samples_per_sec']:,.0f}" for k, v in runs.items() if v),
                file=sys.stderr, flush=True)
        setup = list(c.setup_commands)
    report = summarize(runs, args, data, rate_bps, threads, commands, setup)
    path = out / f"cluster-w{args.world}-{args.rate}.json"
    path.write_text(json.dumps(report, indent=2))
    print(format_report(report))
    print(f"\nwritten: {path}")
    return 0


def summarize(runs, args, data, rate_bps, threads, commands, setup) -> dict:
    rows = {}
    for name, rs in runs.items():
        if not rs:
            continue
        sps = [r["samples_per_sec"] for r in rs]
        sent = [r["sent_bytes_per_step_rank0"] for r in rs if r.get("sent_bytes_per_step_rank0")]
        rows[name] = {"median_samples_per_sec": statistics.median(sps), "runs": rs,
                      "sent_bytes_per_step_rank0": statistics.median(sent) if sent else None,
                      "peak_rss_mib": max(r["peak_rss_bytes"] for r in rs) / 2**20}
        aucs = [r["auc"] for r in rs if r.get("auc") is not None]
        if aucs:
            rows[name]["auc"] = statistics.median(aucs)
    for base_name in ("torchrec", *args.baseline):
        if base_name in rows:
            base = rows[base_name]["median_samples_per_sec"]
            for v in rows.values():
                v[f"vs_{base_name}"] = v["median_samples_per_sec"] / base
    return {"date": time.strftime("%Y-%m-%d"), "machine": throughput.machine(),
            "rate": args.rate, "rate_bps": rate_bps, "world": args.world,
            "threads_per_rank": threads, "data": str(data), "overrides": args.overrides,
            "variants": variants(args),
            "settings": {k: getattr(args, k) for k in ("steps", "warmup", "rounds", "batch_size",
                                                       "sharding", "peer_batches", "one_pass",
                                                       "optimizers")},
            "baselines": args.baseline,
            "command": shlex.join([Path(sys.executable).name, *sys.argv]),
            "rank0_commands": commands, "cluster_setup": setup, "results": rows}


def format_report(rep: dict) -> str:
    lines = [(f"machine: {rep['machine']}   date: {rep['date']}   link: {rep['rate']} per "
              f"direction, {rep['world']} ranks, {rep['threads_per_rank']} thread(s) per rank, "
              f"optimizers: {rep['settings'].get('optimizers', 'bench')}"),
             *[f"{k} overrides: {' '.join(v) or '(none)'}" for k, v in rep["variants"].items()], "",
             "| run | samples/s (median) | runs | held-out AUC | peak RSS (all ranks) "
             "| vs TorchRec | " + "".join(f"vs {b} | " for b in rep.get("baselines", []))
             + "sync rounds (gap mean / max; busy share) | sent per step, rank 0 |",
             "|---|---|---|---|---|---|" + "---|" * len(rep.get("baselines", [])) + "---|---|"]
    for name, v in rep["results"].items():
        ratio = f"{v['vs_torchrec']:.2f}x" if "vs_torchrec" in v else "-"
        others = "".join(f"{v[f'vs_{b}']:.2f}x | " if f"vs_{b}" in v else "- | "
                         for b in rep.get("baselines", []))
        runs = ", ".join(f"{r['samples_per_sec']:,.0f}" for r in v["runs"])
        auc = f"{v['auc']:.4f}" if "auc" in v else "-"
        sent = f"{v['sent_bytes_per_step_rank0']:,.0f}" if v.get("sent_bytes_per_step_rank0") else "-"
        lines.append(f"| {name} | {v['median_samples_per_sec']:,.0f} | {runs} | {auc} | "
                     f"{v['peak_rss_mib']:,.0f} MiB | {ratio} | {others}{_sync_cell(v['runs'])} | {sent} |")
    lines += ["", "rank 0 commands (rank i: its namespace and --node-rank=i):"]
    lines += [f"  {k}: {cmd}" for k, cmd in rep["rank0_commands"].items()]
    return "\n".join(lines)


def _sync_cell(runs: list[dict]) -> str:
    """Rounds, sync gap (mean / max) and the shadow thread's busy share of every run."""
    cells = []
    for r in runs:
        s = r.get("sync")
        if not s:
            continue
        gap = (f"{s['gap_mean']:.2f} / {s['gap_max']}" if s.get("gap_mean") is not None else "- / -")
        busy = f"; {s['busy_fraction']:.2f}" if s.get("busy_fraction") is not None else ""
        cells.append(f"{s['rounds']} ({gap}{busy})")
    return ", ".join(cells) or "-"


def _pythonpath(src: str) -> str:
    """This checkout's src/ first (the ranks import the package from here), once."""
    rest = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and p != src]
    return os.pathsep.join([src, *rest])


def run_main(main) -> int:
    """``main()``, with hybridrec's own errors (e.g. not root) as one clear line."""
    from hybridrec.errors import HybridrecError

    try:
        return main()
    except HybridrecError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(run_main(main))
