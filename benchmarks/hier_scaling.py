#!/usr/bin/env python3
"""Predicted scaling of flat against hierarchical training (hybridrec.bench.hier_cost).

    .venv/bin/python benchmarks/hier_scaling.py                 # 1..512 machines x 8 ranks
    .venv/bin/python benchmarks/hier_scaling.py --compute-s 0.17 --sharding table_wise \\
        --measured 2,2,1650,flat --measured 2,2,9800,hier       # beside measured points

The bench model (benchmarks/throughput.py, cluster_throughput.py: 26 tables x 100,000 rows x
dim 64, bottom 13-512-256-64, top 512-256-1, one-hot), --batch-size samples per rank,
--compute-s seconds of computation per step and rank (a 1-rank run's step at that batch;
benchmarks/hierarchical.py measures it with every rank's CPU load present). For every
--setting and every machine count (a machine = a group of --group-size ranks): flat (one
synchronous group of all ranks, DDP) against hierarchical (a group per machine, the replicas
averaged across machines by --sync-*). Prints the Markdown tables (also to --md when
given) and writes a line chart (x: log2 machines, y: log10 samples/s, one line per setting
and mode) to --out.

Settings, ``NAME=INTRA,CROSS[,A2A_EFF,ALLREDUCE_EFF]`` (tc units, per direction; INTRA: each
rank's own link, CROSS: each machine's link to the others, shared by its ranks):

- ``namespace=1gbit,100mbit,0.5,0.95``: the namespace cluster of benchmarks/hierarchical.py;
  gloo's all_to_all reaches half the link rate, its ring all-reduce 0.95 (measured,
  docs/benchmarks.md "Link rate of gloo collectives").
- ``datacenter=100gbit,25gbit,0.9,0.95``: machines whose ranks share a 100 Gbit/s local path
  and a 25 Gbit/s NIC, with the receive-first exchange (``dist.exchange=pairwise``, ~0.9).

--measured G,M,SAMPLES_PER_S[,flat|hier][,compute=S][,steps=N][,cores=C] (repeatable;
default hier) prints the prediction for that cluster shape at the --measured-setting
(default: the first) beside the measurement, with the error in %; ``compute``: that run's
compute per step (default --compute-s), ``steps``: its length (a run that ends before its
first round: the shadow thread busy throughout), ``cores``: cores per rank there.

Calibration (measured apart from the training runs, docs/benchmarks.md):
--cross-a2a RANKS:EFF (repeatable): the all-to-all's share of a group link shared by RANKS
ranks' flows (``benchmarks/linkrate.py --group-size``); --host-cpu
NONE_MS,DCT_MS,WRITE_BACK_MS,CORES_PER_RANK[,AGREE_MS]: the shadow thread's CPU ms per MiB of
replica and round (exact, dct), the write-back's, cores per rank, the members' per-step
agreement (``benchmarks/shadow_cpu.py``), times --cpu-scale (another processor's step time
over the measuring one's).
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_SETTINGS = ["namespace=1gbit,100mbit,0.5,0.95", "datacenter=100gbit,25gbit,0.9,0.95"]
TABLES, ROWS, DIM = 26, 100_000, 64
BOTTOM, TOP, NUM_DENSE = [512, 256, 64], [512, 256, 1], 13
COMPUTE_S = 2048 / 51_139
"""docs/benchmarks.md: the bench model trains 51,139 samples/s in one process with 2 threads
at batch 2048 (2026-11-22); measure your own with benchmarks/hierarchical.py."""


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--machines", type=int, nargs="+", default=[2**i for i in range(10)])
    p.add_argument("--group-size", type=int, default=8, help="ranks per machine (group)")
    p.add_argument("--batch-size", type=int, default=2048, help="per rank")
    p.add_argument("--compute-s", type=float, default=COMPUTE_S,
                   help="computation per step and rank, seconds (default: %(default).4f)")
    p.add_argument("--multi-hot", type=float, default=1.0, help="ids per bag")
    p.add_argument("--sharding", choices=["balanced", "table_wise"], default="balanced",
                   help="balanced: 1/n of every table per rank (what no plan reaches past 26 "
                        "ranks); table_wise: train.tables.uniform_plan, as the harness runs")
    p.add_argument("--sync-algorithm", default="ma", choices=["ma", "easgd", "bmuf"])
    p.add_argument("--sync-mode", default="background", choices=["background", "foreground"])
    p.add_argument("--sync-every", type=int, default=1)
    p.add_argument("--sync-duty", type=float, default=0.5)
    p.add_argument("--sync-compress", default="none", choices=["none", "fp16", "bf16", "dct"])
    p.add_argument("--sync-ratio", type=float, default=0.01)
    p.add_argument("--setting", action="append", default=[],
                   metavar="NAME=INTRA,CROSS[,A2A_EFF,ALLREDUCE_EFF]",
                   help=f"link setting (repeatable; default: {' and '.join(DEFAULT_SETTINGS)})")
    p.add_argument("--measured", action="append", default=[], metavar="G,M,SAMPLES_PER_S[,MODE]")
    p.add_argument("--cross-a2a", action="append", default=[], metavar="RANKS:EFF")
    p.add_argument("--host-cpu", metavar="NONE_MS,DCT_MS,WRITE_BACK_MS,CORES_PER_RANK[,AGREE_MS]")
    p.add_argument("--cpu-scale", type=float, default=1.0)
    p.add_argument("--measured-setting",
                   help="the setting the measurements ran at (default: the first)")
    p.add_argument("--out", default=str(ROOT / "docs/img/hier_scaling.svg"), help="the chart")
    p.add_argument("--md", help="also write the Markdown tables (printed always) to this file")
    return p.parse_args(argv)


def parse_setting(text: str, cross_a2a: list[str] = ()):
    """``NAME=INTRA,CROSS[,A2A_EFF,ALLREDUCE_EFF]`` -> ``(name, Links)``; rates in tc units."""
    from hybridrec.bench.hier_cost import Links
    from hybridrec.bench.netns import parse_rate

    name, _, rest = text.partition("=")
    parts = rest.split(",")
    if not name or len(parts) not in (2, 4):
        raise SystemExit(f"--setting {text!r}: expected NAME=INTRA,CROSS[,A2A_EFF,ALLREDUCE_EFF]")
    rates = [parse_rate(x) for x in parts[:2]]
    if None in rates:
        raise SystemExit(f"--setting {text!r}: the model needs finite rates")
    effs = [float(x) for x in parts[2:]] or [1.0, 1.0]
    cross = tuple(sorted((int(m), float(e)) for m, e in (x.split(":") for x in cross_a2a)))
    return name, Links(intra=rates[0] / 8, cross=rates[1] / 8, a2a_efficiency=effs[0],
                       allreduce_efficiency=effs[1], cross_a2a_efficiency=cross)


def parse_host_cpu(text: str | None, scale: float):
    """``NONE_MS,DCT_MS,WRITE_BACK_MS,CORES_PER_RANK[,AGREE_MS]`` (ms per MiB) -> HostCpu."""
    from hybridrec.bench.hier_cost import HostCpu

    if text is None:
        return None
    v = [float(x) for x in text.split(",")]
    if len(v) not in (4, 5):
        raise SystemExit(f"--host-cpu {text!r}: expected NONE_MS,DCT_MS,WRITE_BACK_MS,"
                         "CORES_PER_RANK[,AGREE_MS]")
    per = 1e-3 / 2**20
    return HostCpu(round_s_per_byte=v[0] * per, dct_round_s_per_byte=v[1] * per,
                   write_back_s_per_byte=v[2] * per, cores_per_rank=v[3],
                   agree_s=(v[4] if len(v) == 5 else 0.0) * 1e-3).scaled(scale)


def parse_measured(text: str) -> tuple[int, int, float, bool, dict]:
    """``G,M,SAMPLES_PER_S[,flat|hier][,key=value...]`` -> ``(G, M, samples/s,
    hierarchical, {compute, steps, cores})``."""
    parts = text.split(",")
    extra = dict(x.split("=", 1) for x in parts[3:] if "=" in x)
    plain = [x for x in parts if "=" not in x]
    if (len(plain) not in (3, 4) or (len(plain) == 4 and plain[3] not in ("flat", "hier"))
            or not set(extra) <= {"compute", "steps", "cores"}):
        raise SystemExit(f"--measured {text!r}: expected G,M,SAMPLES_PER_S[,flat|hier]"
                         "[,compute=S][,steps=N][,cores=C]")
    return (int(plain[0]), int(plain[1]), float(plain[2]), len(plain) == 3 or plain[3] == "hier",
            extra)


def bench_workload(args):
    """The bench model as :class:`~hybridrec.bench.hier_cost.Workload`."""
    from hybridrec.bench.hier_cost import Workload, dlrm_dense_params
    from hybridrec.model.embedding import TableConfig

    tables = tuple(TableConfig(name=f"C{i}", num_embeddings=ROWS, embedding_dim=DIM)
                   for i in range(1, TABLES + 1))
    plan = None
    if args.sharding == "table_wise":
        from hybridrec.train.setup.tables import uniform_plan

        def plan(n):
            return uniform_plan("table_wise", list(tables), n, n)
    dense = dlrm_dense_params(NUM_DENSE, TABLES, DIM, BOTTOM, TOP)
    return Workload(tables=tables, dense_params=dense, batch_per_rank=args.batch_size,
                    compute_s=args.compute_s, ids_per_bag=args.multi_hot, plan=plan)


def sync_spec(args):
    from hybridrec.bench.hier_cost import SyncSpec

    return SyncSpec(algorithm=args.sync_algorithm, mode=args.sync_mode, every=args.sync_every,
                    duty=args.sync_duty, compress=args.sync_compress, ratio=args.sync_ratio)


def predict_rows(w, links, sync, machines: list[int], m: int) -> list[dict]:
    """Flat and hierarchical predictions for every machine count."""
    from hybridrec.bench.hier_cost import predict_step

    rows = []
    for g in machines:
        flat = predict_step(w, links, g, m, hierarchical=False)
        hier = predict_step(w, links, g, m, hierarchical=True, sync=sync)
        rows.append({"machines": g, "ranks": g * m, "flat": flat, "hier": hier})
    return rows


def scaling_table(name: str, links, rows: list[dict]) -> str:
    from hybridrec.bench.netns import format_rate
    from hybridrec.train.setup.memory import size_text

    base = rows[0]["hier"].samples_per_s / rows[0]["machines"]

    lines = [(f"**{name}**: {format_rate(round(links.intra * 8))} per rank, "
              f"{format_rate(round(links.cross * 8))} per machine, all-to-all at "
              f"{links.a2a_efficiency:g}, all-reduce at {links.allreduce_efficiency:g} of the "
              "rate"),
             "",
             ("| machines | ranks | flat samples/s | hier samples/s | hier / flat | hier scaling "
              "efficiency | flat step s (compute / a2a / all-reduce) | hier step s (compute / a2a "
              "/ all-reduce / sync) | hier round s (gap, steps) | cross bytes per step, flat / "
              "hier |"),
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        f, h = r["flat"], r["hier"]
        eff = h.samples_per_s / (base * r["machines"])
        round_cell = f"{h.round_s:,.1f} ({h.gap_steps:,.0f})" if h.round_s else "-"
        lines.append(
            f"| {r['machines']} | {r['ranks']} | {f.samples_per_s:,.0f} | {h.samples_per_s:,.0f} | "
            f"{h.samples_per_s / f.samples_per_s:,.2f}x | {eff:.2f} | {f.step_s:.3f} "
            f"({f.compute_s:.3f} / {f.a2a_s:.3f} / {f.dense_s:.3f}) | {h.step_s:.3f} "
            f"({h.compute_s:.3f} / {h.a2a_s:.3f} / {h.dense_s:.3f} / {h.sync_s:.3f}) | "
            f"{round_cell} | {size_text(f.cross_bytes_per_step)} / {size_text(h.cross_bytes_per_step)} |")
    return "\n".join(lines)


def measured_table(w, links, sync, points, cpu=None) -> str:
    import dataclasses

    from hybridrec.bench.hier_cost import predict_step

    lines = [("| G x M | mode | measured samples/s | predicted | error | predicted step s "
              "(compute / a2a / all-reduce / sync / host) |"), "|---|---|---|---|---|---|"]
    for g, m, sps, hier, extra in points:
        wp = dataclasses.replace(w, compute_s=float(extra.get("compute", w.compute_s)))
        cp = (dataclasses.replace(cpu, cores_per_rank=float(extra["cores"]))
              if cpu is not None and "cores" in extra else cpu)
        steps = int(extra["steps"]) if "steps" in extra else None
        p = predict_step(wp, links, g, m, hierarchical=hier, sync=sync, cpu=cp, run_steps=steps)
        lines.append(f"| {g} x {m} | {'hier' if hier else 'flat'} | {sps:,.0f} | "
                     f"{p.samples_per_s:,.0f} | {100 * (p.samples_per_s - sps) / sps:+.1f}% | "
                     f"{p.step_s:.3f} ({p.compute_s:.3f} / {p.a2a_s:.3f} / {p.dense_s:.3f} / "
                     f"{p.sync_s:.3f} / {p.host_s:.3f}) |")
    return "\n".join(lines)


def _si(log10: float) -> str:
    """A tick of the log10 axis as a number: 1k, 30k, 1M, ..."""
    v = 10 ** log10
    for unit, scale in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if v >= scale:
            return f"{v / scale:.3g}{unit}"
    return f"{v:.3g}"


def write_svg(path: Path, results: dict[str, list[dict]], note: str) -> None:
    from hybridrec.bench.svg import Series, color, line_svg

    series = []
    for i, (name, rows) in enumerate(results.items()):
        for j, mode in enumerate(("flat", "hier")):
            pts = [(math.log2(r["machines"]), math.log10(r[mode].samples_per_s)) for r in rows]
            series.append(Series(f"{name}, {'hierarchical' if mode == 'hier' else 'flat'}", pts,
                                 color(2 * i + j)))
    svg = line_svg(series, title="Predicted throughput: flat against hierarchical training",
                   x_label="machines, log2 (0 = 1, 9 = 512)", y_label="samples/s (whole cluster)",
                   y_format=_si, note=note)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(svg)


def main(argv=None) -> int:
    args = parse_args(argv)
    settings = dict(parse_setting(s, args.cross_a2a) for s in (args.setting or DEFAULT_SETTINGS))
    cpu = parse_host_cpu(args.host_cpu, args.cpu_scale)
    points = [parse_measured(x) for x in args.measured]
    w, sync = bench_workload(args), sync_spec(args)
    results = {name: predict_rows(w, links, sync, args.machines, args.group_size)
               for name, links in settings.items()}
    spec = (f"bench model, {args.batch_size} samples per rank, compute {args.compute_s:.4f} s per "
            f"step, {args.sharding} sharding; sync {sync.algorithm} {sync.mode}, every "
            f"{sync.every}, duty {sync.duty:g}, compress {sync.compress}"
            + (f" {sync.ratio:g}" if sync.compress == "dct" else ""))
    out = [(f"Predicted by hybridrec.bench.hier_cost: {spec}; {args.group_size} ranks per "
            "machine."),
           "", *[x for name, links in settings.items()
                 for x in (scaling_table(name, links, results[name]), "")]]
    if points:
        which = args.measured_setting or next(iter(settings))
        if which not in settings:
            raise SystemExit(f"--measured-setting {which!r}: not one of {list(settings)}")
        out += [f"Measured against predicted ({which}):", "",
                measured_table(w, settings[which], sync, points, cpu), ""]
    text = "\n".join(out)
    print(text)
    if args.md:
        Path(args.md).parent.mkdir(parents=True, exist_ok=True)
        Path(args.md).write_text(text + "\n")
    write_svg(Path(args.out), results, spec)
    print(f"written: {', '.join(filter(None, [args.md, args.out]))}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
