"""`hybridrec` command line: argument parsing only; the work lives in the library."""

from __future__ import annotations

import argparse
import sys

from hybridrec import __version__
from hybridrec.errors import HybridrecError


def build_parser() -> argparse.ArgumentParser:
    from hybridrec.cli import bench as bench_cmd
    from hybridrec.cli import data as data_cmd
    from hybridrec.cli import plan as plan_cmd
    from hybridrec.cli import report as report_cmd
    from hybridrec.cli import train as train_cmd

    p = argparse.ArgumentParser(
        prog="hybridrec",
        description=(
            "Train DLRM-class recommendation models (sharded embeddings + dense MLPs) "
            "on click logs such as Criteo."
        ),
    )
    p.add_argument("--version", action="version", version=f"hybridrec {__version__}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND", required=True)
    data_cmd.register(sub)
    train_cmd.register(sub)
    plan_cmd.register(sub)
    bench_cmd.register(sub)
    report_cmd.register(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except HybridrecError as e:
        print(f"hybridrec: error: {e}", file=sys.stderr)
        return 2
