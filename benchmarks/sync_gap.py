#!/usr/bin/env python3
"""The sync gap of background synchronization against the link rate (namespace cluster).

    sudo .venv/bin/python benchmarks/sync_gap.py --rates 50mbit 100mbit 300mbit 1gbit \\
        --variant b2b=sync.algorithm=ma,sync.duty=1 --variant default=sync.algorithm=ma \\
        -- model.embedding_dim=128 model.bottom_mlp=512,256,128 model.top_mlp=1024,1024,512,256,1

For every rate, benchmarks/cluster_throughput.py runs every --variant (after the positional
overrides, which every variant gets) once in a cluster of --world namespaces capped at that
rate; the sync gap (training steps between two rounds of rank 0: mean and max), the rounds,
the shadow thread's busy share and the throughput come from each run's summary.json. Writes
a Markdown table, the JSON of every run and an SVG line chart (x: link rate in Mbit/s, y:
mean sync gap, one line per variant) to --svg.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import cluster_throughput
import throughput


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="hybridrec overrides of every run")
    p.add_argument("--variant", action="append", default=[], metavar="NAME=KEY=VALUE,...",
                   help="a background-sync configuration (repeatable; at least one)")
    p.add_argument("--rates", nargs="+", default=["50mbit", "100mbit", "300mbit", "1gbit"])
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--steps", type=int, default=30, help="timed steps per run")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--batch-size", type=int, default=256, help="per rank")
    p.add_argument("--data", required=True, help="a preprocessed dataset")
    p.add_argument("--out", default=str(ROOT / "benchmarks/out/sync-gap"), help="work directory")
    p.add_argument("--svg", default=str(ROOT / "docs/img/sync_gap.svg"), help="the chart")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if not args.variant:
        raise SystemExit("give at least one --variant NAME=KEY=VALUE,...")
    from hybridrec.bench.netns import parse_rate

    out = Path(args.out)
    rows = []
    for rate in args.rates:
        rate_out = out / rate
        cluster_throughput.main(
            ["--rate", rate, "--world", str(args.world), "--no-peer", "--no-base", "--rounds", "1",
             "--steps", str(args.steps), "--warmup", str(args.warmup), "--batch-size", str(args.batch_size),
             "--data", args.data, "--out", str(rate_out),
             *[x for v in args.variant for x in ("--variant", v)], "--", *args.overrides])
        rep = json.loads((rate_out / f"cluster-w{args.world}-{rate}.json").read_text())
        for name, res in rep["results"].items():
            run = res["runs"][0]
            s = run.get("sync") or {}
            rows.append({"rate": rate, "mbit": parse_rate(rate) / 1e6, "variant": name,
                         "samples_per_sec": run["samples_per_sec"], "auc": run.get("auc"),
                         "steps": run.get("steps"), **{k: s.get(k) for k in (
                             "rounds", "gap_mean", "gap_max", "busy_fraction", "round_seconds_mean")}})
    report = {"date": time.strftime("%Y-%m-%d"), "machine": throughput.machine(),
              "command": shlex.join([Path(sys.executable).name, *sys.argv]), "rows": rows,
              "variants": args.variant, "overrides": args.overrides}
    out.mkdir(parents=True, exist_ok=True)
    (out / "sync_gap.json").write_text(json.dumps(report, indent=2))
    print(format_table(rows))
    write_svg(rows, Path(args.svg), report)
    print(f"\nwritten: {out / 'sync_gap.json'}, {args.svg}")
    return 0


def format_table(rows: list[dict]) -> str:
    lines = [("| link (per direction) | variant | rounds | sync gap mean | max | busy share "
              "| seconds per round | samples/s |"), "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        gap = f"{r['gap_mean']:.2f}" if r["gap_mean"] is not None else "-"
        busy = f"{r['busy_fraction']:.2f}" if r["busy_fraction"] is not None else "-"
        sec = f"{r['round_seconds_mean']:.2f}" if r["round_seconds_mean"] is not None else "-"
        lines.append(f"| {r['rate']} | {r['variant']} | {r['rounds']} | {gap} | {r['gap_max']} | {busy} "
                     f"| {sec} | {r['samples_per_sec']:,.0f} |")
    return "\n".join(lines)


def write_svg(rows: list[dict], path: Path, report: dict) -> None:
    from hybridrec.bench.svg import Series, color, line_svg

    names = list(dict.fromkeys(r["variant"] for r in rows))
    series = [Series(name, sorted((r["mbit"], r["gap_mean"]) for r in rows
                                  if r["variant"] == name and r["gap_mean"] is not None), color(i))
              for i, name in enumerate(names)]
    svg = line_svg(series, title="Background sync: training steps between two rounds vs link rate",
                   x_label="link rate per direction (Mbit/s)", y_label="sync gap, mean (steps)",
                   x_min=0, note=f"{report['machine']}, {report['date']}; 2 ranks")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(svg)


if __name__ == "__main__":
    raise SystemExit(cluster_throughput.run_main(main))
