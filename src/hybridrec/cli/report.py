"""``hybridrec report`` (argument parsing only; the report is :mod:`hybridrec.bench.report`)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

_EPILOG = """\
examples:
  hybridrec report runs/kaggle                       # -> runs/kaggle/report/index.html
  hybridrec report runs/a runs/b --out runs/compare  # both runs side by side

Charts (one SVG each, also inline in index.html): train loss, held-out AUC and log loss,
samples/s (against the step), bytes sent per step by communication category with the bytes
before compression beside a compressed category, and predicted vs counted bytes. Above
them a table per run: world size, steps, final metrics, throughput, peak memory and the
config that shapes the run, and a table of the run's failures (train.inject_failure's kills,
RUN/recovery.jsonl's recoveries: when, after which step, which rank, what the recovery did,
how long it took), each also printed here in one line. A run without summary.json (still
training) is reported as far as it got, and said to be partial.
"""


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "report", help="charts and a table of one run or several (SVG + one HTML page)",
        description="Draw one run directory, or several side by side: SVG charts and one "
        "self-contained index.html (no script, nothing fetched).",
        epilog=_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("runs", nargs="+", metavar="RUN", help="run directories")
    p.add_argument("--out", metavar="DIR",
                   help="report directory [RUN/report for one run; the runs' common parent "
                        "directory/report for several]")
    p.set_defaults(func=_report)


def _report(args: argparse.Namespace) -> int:
    from hybridrec.bench.report import build_report

    index, runs = build_report([Path(r) for r in args.runs],
                               Path(args.out) if args.out else None)
    for run in runs:
        for note in run.notes:
            print(f"hybridrec report: {run.label}: {note}", file=sys.stderr)
        for failure in run.failures:
            print(f"{run.label}: {failure.line()}")
    print(f"wrote {index} ({len(runs)} run{'s' if len(runs) > 1 else ''})")
    return 0
