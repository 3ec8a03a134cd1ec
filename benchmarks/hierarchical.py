#!/usr/bin/env python3
"""Hierarchical against flat training in the namespace cluster: G groups x M ranks, fast links
inside a group, one capped link between groups.

    sudo .venv/bin/python benchmarks/hierarchical.py                      # the bar: 2 x 2
    sudo .venv/bin/python benchmarks/hierarchical.py --seeds 0 1 \\
        --variants flat,hier,hier-dct,hier-easgd,hier-bmuf,torchrec
    sudo .venv/bin/python benchmarks/hierarchical.py --groups 2 --group-size 1  # model check, 2 x 1

Bar: one pass over the same data, hierarchical >= 1.9x the samples/s of the flat synchronous
run on the same ranks, at held-out AUC >= flat - 0.001; and the bytes that cross the slow
links per step, flat against hierarchical, per category.

Cluster: ``netns_cluster(G*M, --rate, group_size=M, cross_rate=--cross-rate)``
(hybridrec.bench.netns): each rank's own link carries --rate each way, each group's link to
the others --cross-rate, shared by the group's ranks; one torchrun per namespace. Data: the
synthetic one-hot set of benchmarks/throughput.py with --samples training rows (day 0) and as
many held-out rows (day 1, evaluated whole). Model: the bench recipe (26 x 100,000 x 64,
bottom 13-512-256-64, top 512-256-1, SGD) at --lr for dense and sparse (the recipe's 0.01
barely moves the model in one pass), --batch-size per rank, table-wise.

Variants (--variants, comma separated; positional KEY=VALUE overrides go to every hybridrec one):

- ``flat``: ``dist.group_size=W``: one synchronous group, embeddings sharded over W, DDP.
- ``hier``: ``dist.group_size=M sync.algorithm=ma sync.mode=background``.
- ``hier-dct``: hier with ``sync.compress=dct sync.compress_ratio=--sync-ratio``.
- ``hier-easgd``, ``hier-bmuf``: hier with ``sync.algorithm=easgd`` / ``bmuf``.
- ``torchrec``: TorchRec DMP on all W ranks, table-wise (benchmarks/peers: trains on the first
  --peer-batches batches cycled, reports no AUC).

Per variant and seed: samples/s and wall time from rank 0's summary.json, held-out AUC, the
ledger's bytes per step by category (rank 0, sent: ``comm.per_step.mean_by_category``) and by
level (``bytes_by_level`` intra / cross, where the trainer writes it), and the bytes that
crossed the capped links (``Cluster.cross_bytes()``, Ethernet headers included) over the
whole run (rendezvous and evaluation included) per training step.

Cost model (hybridrec.bench.hier_cost, benchmarks/hier_scaling.py): first W 1-rank runs at
once, one per namespace (each rank's CPU share, no network), --compute-steps steps each, give
the compute per step; at the end the script prints it with every variant's samples/s as a
``hier_scaling.py --measured`` command line.
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import shlex
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import cluster_throughput  # runs, results, run_main
import throughput  # data preparation

PEER_PY, PEER_SCRIPT = cluster_throughput.PEER_PY, cluster_throughput.PEER_SCRIPT
VARIANTS = ("flat", "hier", "hier-dct", "hier-easgd", "hier-bmuf", "torchrec")
BAR_SPEEDUP, BAR_AUC = 1.9, 0.001


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE",
                   help="hybridrec overrides of every hybridrec variant (after --)")
    p.add_argument("--groups", type=int, default=2, help="G")
    p.add_argument("--group-size", type=int, default=2, help="M, ranks per group")
    p.add_argument("--rate", default="1gbit", help="each rank's link, per direction (tc units)")
    p.add_argument("--cross-rate", default="100mbit", help="each group's link to the others")
    p.add_argument("--samples", type=int, default=400_000, help="training rows (one pass)")
    p.add_argument("--seeds", type=int, nargs="+", default=[0], help="training seeds (train.seed)")
    p.add_argument("--variants", default="flat,hier",
                   help=f"comma separated, from {', '.join(VARIANTS)}")
    p.add_argument("--batch-size", type=int, default=2048, help="per rank")
    p.add_argument("--lr", type=float, default=0.1, help="dense and sparse SGD learning rate")
    p.add_argument("--sync-ratio", type=float, default=0.01, help="hier-dct: sync.compress_ratio")
    p.add_argument("--compute-steps", type=int, default=30,
                   help="steps of the 1-rank compute runs (0: skip them)")
    p.add_argument("--warmup", type=int, default=5, help="untimed steps: compute runs, TorchRec")
    p.add_argument("--peer-batches", type=int, default=16, help="batches handed to TorchRec")
    p.add_argument("--multi-hot", type=int, default=0, help="ids per feature (0 = one-hot)")
    p.add_argument("--data", help="an existing preprocessed dataset (default: made under --out)")
    p.add_argument("--out", default=str(ROOT / "benchmarks/out/hierarchical"),
                   help="work directory")
    p.add_argument("--timeout", type=float, default=3600, help="seconds per run")
    args = p.parse_args(argv)
    args.variant_list = [v.strip() for v in args.variants.split(",") if v.strip()]
    bad = [v for v in args.variant_list if v not in VARIANTS]
    if bad or not args.variant_list:
        p.error(f"--variants: unknown {bad}; choose from {', '.join(VARIANTS)}")
    args.world = args.groups * args.group_size
    # What throughput.prepare_data and dump_peer_batches read.
    args.rows = args.samples
    return args


def variant_overrides(args, name: str) -> list[str]:
    """The hybridrec overrides of a variant (after the common ones)."""
    if name == "flat":
        return [f"dist.group_size={args.world}"]
    algorithm = {"hier-easgd": "easgd", "hier-bmuf": "bmuf"}.get(name, "ma")
    out = [f"dist.group_size={args.group_size}", f"sync.algorithm={algorithm}",
           "sync.mode=background"]
    if name == "hier-dct":
        out += ["sync.compress=dct", f"sync.compress_ratio={args.sync_ratio}"]
    return out


def common_overrides(args, data: Path) -> list[str]:
    return [f"data.path={data}", f"data.batch_size={args.batch_size}", "dist.sharding=table_wise",
            f"optim.dense_lr={args.lr}", f"optim.sparse_lr={args.lr}", *args.overrides]


def one_pass_steps(args, data: Path) -> int:
    from hybridrec.data.schema import DatasetMeta

    steps = DatasetMeta.load(data).split_rows("train") // (args.world * args.batch_size)
    if steps < 2:
        raise SystemExit(f"--samples {args.samples}: under 2 steps of {args.world} ranks x "
                         f"{args.batch_size}")
    return steps


def hybridrec_script(args, data: Path, run_dir: Path, name: str, seed: int) -> list[str]:
    return ["-m", "hybridrec", "train", "--recipe", "bench", *common_overrides(args, data),
            f"train.max_steps={one_pass_steps(args, data)}", f"train.run_dir={run_dir}",
            f"train.seed={seed}", "train.resume=false", "train.progress=false",
            "train.save_checkpoints=false", *variant_overrides(args, name)]


def peer_script(args, data: Path, npz: Path, seed: int) -> list[str]:
    steps = one_pass_steps(args, data)
    return [str(PEER_SCRIPT), "--batches", str(npz), "--steps", str(max(1, steps - args.warmup)),
            "--warmup", str(min(args.warmup, steps - 1)), "--batch-size", str(args.batch_size),
            "--lr", str(args.lr), "--seed", str(seed)]


def build_cluster(args):
    """The grouped cluster, or (before netns grew groups) a flat one with a warning."""
    from hybridrec.bench.netns import netns_cluster

    if "group_size" in inspect.signature(netns_cluster).parameters:
        return netns_cluster(args.world, args.rate, group_size=args.group_size,
                             cross_rate=args.cross_rate)
    print(f"warning: this netns_cluster has no groups: every link at {args.rate}, the cross link "
          "is not emulated", file=sys.stderr)
    return netns_cluster(args.world, args.rate)


def cross_bytes(cluster) -> int | None:
    """Bytes that crossed the capped links so far (None: the cluster cannot count them)."""
    return cluster.cross_bytes() if hasattr(cluster, "cross_bytes") else None


# -- runs ----------------------------------------------------------------------------------
def measure_compute(cluster, args, data: Path, env: dict, out: Path) -> dict | None:
    """W 1-rank runs at once, one per namespace (benchmarks/throughput.py's worker: training
    only, no network), so each sees the CPU share a cluster rank gets: ``{"compute_s": median
    of batch / samples_per_s, "runs": [...]}``."""
    if args.compute_steps <= 0:
        return None
    overrides = [f"optim.dense_lr={args.lr}", f"optim.sparse_lr={args.lr}", *args.overrides]
    cmds = [[sys.executable, str(ROOT / "benchmarks/throughput.py"), "--worker", "hybridrec",
             "--data", str(data), "--out", str(out / f"compute/r{r}"), "--batch-size",
             str(args.batch_size), "--steps", str(args.compute_steps), "--warmup", str(args.warmup),
             *(a for kv in overrides for a in ("--override", kv))]
            for r in range(args.world)]
    res = cluster.run(cmds, timeout_s=args.timeout, env=env, log_dir=out / "logs/compute", cwd=ROOT)
    bad = [r for r in res if not r.ok]
    if bad:
        raise SystemExit(f"compute run failed on rank {bad[0].rank}:\n{bad[0].stderr[-3000:]}")
    runs = [json.loads([ln for ln in r.stdout.splitlines() if ln.startswith("{")][-1]) for r in res]
    sps = [r["samples_per_sec"] for r in runs]
    return {"compute_s": statistics.median(args.batch_size / s for s in sps),
            "samples_per_sec": sps, "threads": runs[0]["threads"]}


def hybridrec_run(cluster, args, data: Path, name: str, seed: int, env: dict, port: int,
                  out: Path) -> dict:
    """One hybridrec variant: its summary.json, and the bytes that crossed the capped links."""
    run_dir = out / f"run-{name}-s{seed}"
    script = hybridrec_script(args, data, run_dir, name, seed)
    before = cross_bytes(cluster)
    cluster_throughput.run_one(cluster, f"{name} seed {seed}", script, sys.executable, env, args,
                               port, out / f"logs/{name}-s{seed}")
    after = cross_bytes(cluster)
    s = json.loads((run_dir / "summary.json").read_text())
    res = cluster_throughput.hybridrec_result(run_dir)
    steps = res["steps"] or 0
    res.update(seed=seed, wall_seconds=s.get("wall_seconds"), bytes_by_level=level_bytes(s),
               cross_bytes_total=None if before is None else after - before,
               command=shlex.join(cluster.torchrun_argv(0, script, port=port)))
    res["cross_bytes_per_step"] = (res["cross_bytes_total"] / steps
                                   if res["cross_bytes_total"] is not None and steps else None)
    return res


def torchrec_run(cluster, args, data: Path, npz: Path, seed: int, threads: int, port: int,
                 out: Path) -> dict:
    script = peer_script(args, data, npz, seed)
    before = cross_bytes(cluster)
    start = time.monotonic()
    res = cluster_throughput.run_one(cluster, f"torchrec seed {seed}", script, str(PEER_PY),
                                     {"OMP_NUM_THREADS": str(threads)}, args, port,
                                     out / f"logs/torchrec-s{seed}")
    wall, after = time.monotonic() - start, cross_bytes(cluster)
    r = cluster_throughput.peer_result(res)
    steps = one_pass_steps(args, data)
    r.update(seed=seed, wall_seconds=wall, auc=None, steps=steps,
             cross_bytes_total=None if before is None else after - before,
             command=shlex.join(cluster.torchrun_argv(0, script, port=port, python=str(PEER_PY))))
    total = r["cross_bytes_total"]
    r["cross_bytes_per_step"] = total / steps if total is not None else None
    return r


def level_bytes(summary: dict) -> dict | None:
    """``{"intra": bytes, "cross": bytes}`` per step from summary.json's ``bytes_by_level``
    (top level or under ``comm``), whatever its inner form: a number, or a record whose
    ``per_step`` / ``sent`` is taken."""
    raw = summary.get("bytes_by_level") or (summary.get("comm") or {}).get("bytes_by_level")
    if not raw:
        return None
    out = {}
    for level, v in raw.items():
        if isinstance(v, dict):
            v = v.get("per_step", v)
            v = v.get("sent") if isinstance(v, dict) else v
        out[level] = v
    return out


def run_all(cluster, args, data: Path, npz: Path | None, env: dict, threads: int,
            out: Path) -> dict[str, list[dict]]:
    """Every seed, every variant, alternating so that drift of the machine hits them all."""
    runs: dict[str, list[dict]] = {v: [] for v in args.variant_list}
    port = 29600
    for seed in args.seeds:
        for name in args.variant_list:
            port += 1  # a fresh store port per run: the last one may linger in TIME_WAIT
            if name == "torchrec":
                r = torchrec_run(cluster, args, data, npz, seed, threads, port, out)
            else:
                r = hybridrec_run(cluster, args, data, name, seed, env, port, out)
            runs[name].append(r)
            crossed = _fmt(r.get("cross_bytes_per_step"), ",.0f")
            print(f"seed {seed} {name}: {r['samples_per_sec']:,.0f} samples/s, AUC "
                  f"{_fmt(r.get('auc'), '.4f')}, crossed per step {crossed}",
                  file=sys.stderr, flush=True)
    return runs


def _fmt(v, spec: str) -> str:
    return "-" if v is None else format(v, spec)


# -- report --------------------------------------------------------------------------------
def summarize(runs: dict[str, list[dict]]) -> dict[str, dict]:
    """Per variant: medians of samples/s, wall time and crossed bytes over seeds, mean AUC,
    mean ledger bytes per step by category; ratios against flat."""
    rows = {}
    for name, rs in runs.items():
        aucs = [r["auc"] for r in rs if r.get("auc") is not None]
        crossed = [r["cross_bytes_per_step"] for r in rs
                   if r.get("cross_bytes_per_step") is not None]
        cats: dict[str, list[float]] = {}
        for r in rs:
            for k, v in (r.get("sent_bytes_per_step_by_category_rank0") or {}).items():
                cats.setdefault(k, []).append(v or 0.0)
        levels: dict[str, list[float]] = {}
        for r in rs:
            for k, v in (r.get("bytes_by_level") or {}).items():
                if isinstance(v, (int, float)):
                    levels.setdefault(k, []).append(v)
        rows[name] = {
            "samples_per_sec": statistics.median(r["samples_per_sec"] for r in rs),
            "wall_seconds": statistics.median(r["wall_seconds"] for r in rs),
            "auc": statistics.mean(aucs) if aucs else None,
            "auc_std": statistics.stdev(aucs) if len(aucs) > 1 else None,
            "cross_bytes_per_step": statistics.median(crossed) if crossed else None,
            "bytes_per_step_by_category": {k: statistics.mean(v) for k, v in sorted(cats.items())},
            "bytes_by_level": {k: statistics.mean(v) for k, v in sorted(levels.items())},
            "runs": rs}
    flat = rows.get("flat")
    for v in rows.values():
        if flat:
            v["vs_flat"] = v["samples_per_sec"] / flat["samples_per_sec"]
            if v["auc"] is not None and flat["auc"] is not None:
                v["auc_vs_flat"] = v["auc"] - flat["auc"]
    return rows


def bar_lines(rows: dict[str, dict]) -> list[str]:
    """The bar per hierarchical variant: >= 1.9x flat at AUC >= flat - 0.001."""
    out = []
    for name, v in rows.items():
        if not name.startswith("hier") or "vs_flat" not in v:
            continue
        speed_ok = v["vs_flat"] >= BAR_SPEEDUP
        auc = v.get("auc_vs_flat")
        auc_ok = auc is not None and auc >= -BAR_AUC
        out.append(f"- {name}: {v['vs_flat']:.2f}x flat ({'met' if speed_ok else 'missed'}, bar "
                   f"{BAR_SPEEDUP}x); AUC {_fmt(auc, '+.4f')} vs flat "
                   f"({'met' if auc_ok else 'missed'}, bar -{BAR_AUC})")
    return out


def format_report(rep: dict) -> str:
    rows = rep["results"]
    lines = [(f"machine: {rep['machine']}   date: {rep['date']}   {rep['groups']} groups x "
              f"{rep['group_size']} ranks, {rep['rate']} per rank, {rep['cross_rate']} between "
              f"groups, {rep['threads_per_rank']} thread(s) per rank, {rep['steps']} steps of "
              f"{rep['batch_size']} per rank (one pass), seeds {rep['seeds']}"), "",
             ("| variant | samples/s (median) | runs | wall s | held-out AUC | vs flat "
              "| AUC vs flat | crossed the capped links per step |"),
             "|---|---|---|---|---|---|---|---|"]
    for name, v in rows.items():
        auc = _fmt(v["auc"], ".4f") + (f" ± {v['auc_std']:.4f}" if v.get("auc_std") else "")
        each = ", ".join(f"{r['samples_per_sec']:,.0f}" for r in v["runs"])
        lines.append(
            f"| {name} | {v['samples_per_sec']:,.0f} | {each} | "
            f"{v['wall_seconds']:,.0f} | {auc} | {_fmt(v.get('vs_flat'), '.2f')}x | "
            f"{_fmt(v.get('auc_vs_flat'), '+.4f')} | {_fmt(v['cross_bytes_per_step'], ',.0f')} |")
    lines += ["", *bar_lines(rows), "", *category_table(rows)]
    return "\n".join(lines)


def category_table(rows: dict[str, dict]) -> list[str]:
    """Rank 0's ledger, bytes sent per step by category and by level (where recorded)."""
    cats = sorted({k for v in rows.values() for k in v["bytes_per_step_by_category"]})
    levels = sorted({k for v in rows.values() for k in v["bytes_by_level"]})
    if not cats and not levels:
        return []
    head = [*cats, *(f"level {x}" for x in levels)]
    lines = ["Bytes sent per step, rank 0's ledger (mean over seeds):", "",
             "| variant | " + " | ".join(head) + " |", "|---|" + "---|" * len(head)]
    for name, v in rows.items():
        cells = [_fmt(v["bytes_per_step_by_category"].get(c), ",.0f") for c in cats]
        cells += [_fmt(v["bytes_by_level"].get(x), ",.0f") for x in levels]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return lines


def model_check_lines(rep: dict) -> list[str]:
    """The measurements as a benchmarks/hier_scaling.py command line."""
    c = rep.get("compute")
    if not c:
        return ["(no compute runs: --compute-steps 0; hier_scaling.py needs --compute-s)"]
    g, m = rep["groups"], rep["group_size"]
    measured = [f"--measured {g},{m},{v['samples_per_sec']:.0f},{'flat' if n == 'flat' else 'hier'}"
                for n, v in rep["results"].items() if n in ("flat", "hier")]
    each = ", ".join(f"{s:,.0f}" for s in c["samples_per_sec"])
    return [(f"compute per step and rank: {c['compute_s']:.4f} s ({g * m} 1-rank runs at once, "
             f"{c['threads']} thread(s) each: {each} samples/s)"),
            ("cost model: .venv/bin/python benchmarks/hier_scaling.py --sharding table_wise "
             f"--batch-size {rep['batch_size']} --compute-s {c['compute_s']:.4f} "
             f"--setting cluster={rep['rate']},{rep['cross_rate']},0.5,0.95 " + " ".join(measured))]


def main(argv=None) -> int:
    args = parse_args(argv)
    if "torchrec" in args.variant_list and not PEER_PY.exists():
        raise SystemExit("TorchRec venv missing: run benchmarks/peers/setup_torchrec.sh "
                         "(or leave torchrec out of --variants)")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    data = Path(args.data) if args.data else throughput.prepare_data(args)
    npz = throughput.dump_peer_batches(data, args) if "torchrec" in args.variant_list else None
    threads = max(1, (os.cpu_count() or 1) // args.world)
    env = {"OMP_NUM_THREADS": str(threads),
           "PYTHONPATH": cluster_throughput._pythonpath(str(ROOT / "src"))}
    with build_cluster(args) as c:
        print("# cluster built by:\n#   " + "\n#   ".join(c.setup_commands), file=sys.stderr)
        compute = measure_compute(c, args, data, env, out)
        runs = run_all(c, args, data, npz, env, threads, out)
        setup = list(c.setup_commands)
    rep = {"date": time.strftime("%Y-%m-%d"), "machine": throughput.machine(),
           "groups": args.groups, "group_size": args.group_size, "rate": args.rate,
           "cross_rate": args.cross_rate, "batch_size": args.batch_size, "seeds": args.seeds,
           "steps": one_pass_steps(args, data), "threads_per_rank": threads, "data": str(data),
           "lr": args.lr, "overrides": args.overrides,
           "variants": {v: variant_overrides(args, v) if v != "torchrec" else "peer"
                        for v in args.variant_list},
           "command": shlex.join([Path(sys.executable).name, *sys.argv]), "cluster_setup": setup,
           "compute": compute, "results": summarize(runs)}
    path = out / f"hierarchical-{args.groups}x{args.group_size}-{args.rate}-{args.cross_rate}.json"
    path.write_text(json.dumps(rep, indent=2))
    print(format_report(rep))
    print("\n" + "\n".join(model_check_lines(rep)))
    print(f"\nwritten: {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(cluster_throughput.run_main(main))
