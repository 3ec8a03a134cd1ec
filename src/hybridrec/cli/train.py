"""`hybridrec train`, `hybridrec eval` and `hybridrec demo`."""

from __future__ import annotations

import argparse
import contextlib
import errno
import math
import os
import sys
from pathlib import Path

from hybridrec import launch_env
from hybridrec.errors import os_error_message
from hybridrec.train.setup import recipes
from hybridrec.train.setup.config import PATH_KEYS, SECTIONS, describe

_TRAIN_EPILOG = f"""\
examples:
  hybridrec train --recipe criteo-kaggle data.path=data/criteo-pre train.run_dir=runs/kaggle
  hybridrec train --config my.toml optim.dense_lr=0.05 train.max_steps=1000
  hybridrec train --list-keys

Without train.run_dir every run gets a new runs/<YYYYmmdd-HHMMSS>. Naming a directory
that holds a run resumes it (train.run_dir=runs/kaggle again); a finished run is left
alone (train.reevaluate=true evaluates it again), a run of another config is refused
(train.resume=false replaces it).

A config file is TOML (or JSON) with sections {" ".join(f"[{n}]" for n in SECTIONS)};
precedence: defaults < --recipe < --config files (in order) < KEY=VALUE arguments. A
relative path in a config file ({", ".join(PATH_KEYS)}) is relative to the file's
directory; in a KEY=VALUE argument, to the working directory.
"""


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("train", help="train a model on a preprocessed dataset",
                       description="Train a DLRM on a preprocessed dataset, evaluate it on the "
                       "held-out split and write a run directory (config.json, metrics.jsonl, "
                       "summary.json, checkpoints/).",
                       epilog=_TRAIN_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="config overrides, e.g. optim.dense_lr=0.05")
    p.add_argument("--config", action="append", default=[], metavar="FILE", help="TOML/JSON config file (repeatable)")
    p.add_argument("--recipe", choices=sorted(recipes.RECIPES), help="start from a named configuration")
    p.add_argument("--list-keys", action="store_true", help="print every config key with its default and meaning")
    p.add_argument("--print-config", action="store_true", help="print the resolved config and exit")
    # Set by the local launcher on its ranks' command line (partial recovery's snapshots on
    # local memory: hybridrec.train.checkpointing.snapshots.fast_snapshots), not by users.
    p.add_argument("--snapshot-dir", help=argparse.SUPPRESS)
    p.set_defaults(func=_train)

    e = sub.add_parser("eval", help="evaluate a run's checkpoint on the held-out split",
                       description="Evaluate a checkpoint of a run directory on the held-out split of "
                       "its dataset (or --data); prints the metrics and writes them to RUN/eval.json "
                       "(or --out). By default the run's best checkpoint when it was trained with "
                       "train.early_stop (the best held-out AUC), else its newest. A run directory "
                       "that cannot be written (read-only) keeps no eval.json: the metrics are "
                       "printed and a warning says so.")
    e.add_argument("run_dir", metavar="RUN_DIR")
    e.add_argument("--checkpoint", metavar="best|latest|DIR",
                   help="best (train.early_stop's best evaluation), latest (the newest) or a checkpoint "
                   "directory (default: best when the run recorded one, else latest)")
    e.add_argument("--data", help="another preprocessed dataset to evaluate on")
    e.add_argument("--out", metavar="FILE", help="where the metrics JSON goes [RUN/eval.json]")
    e.set_defaults(func=_eval)

    d = sub.add_parser("demo", help="synthesize data, preprocess, train and evaluate (the README job)",
                       description="End to end on a synthetic Criteo-like click log from a planted "
                       "teacher: generate, preprocess, train a DLRM, evaluate on the held-out last "
                       "day and print AUC / log loss / NE / samples/s next to the teacher's ceiling.")
    d.add_argument("--out", default="runs/demo", help="work directory (data and run) [runs/demo]")
    d.add_argument("--days", type=int, default=7, help="days of synthetic data; the last is held out [7]")
    d.add_argument("--rows-per-day", type=int, default=100_000, help="rows per day [100000]")
    d.add_argument("--seed", type=int, default=0, help="seed for data and training [0]")
    d.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="training config overrides")
    d.set_defaults(func=_demo)


def _train(args) -> int:
    if args.list_keys:
        print(describe())
        return 0
    # (the config's rules import torch: not while the parser is built)
    from hybridrec.train.setup.configure import build_config

    cfg = build_config(recipes.recipe(args.recipe) if args.recipe else None, args.config, args.overrides)
    if args.print_config:
        import json

        print(json.dumps(cfg.to_dict(), indent=2))
        return 0
    if (cfg.dist.nproc + cfg.dist.num_ps > 1 or cfg.dist.max_restarts or cfg.dist.nnodes > 1) \
            and not launch_env.started_as_rank():
        return _launch(cfg, args)
    from hybridrec.cli.lifeline import end_with
    from hybridrec.cli.outcome import LAUNCHED_ENV
    from hybridrec.serve.publisher import publisher_parts
    from hybridrec.train.run import train

    launched = bool(os.environ.get(LAUNCHED_ENV))
    if launch_env.started_as_rank() and not launched and "TORCHELASTIC_RUN_ID" in os.environ:
        end_with(os.getppid(), "its torchrun agent")  # (torchrun's ranks are its children)
    try:  # (hybridrec's own launcher holds the run directory for its ranks)
        summary = train(cfg, hold_run_dir=not launched, snapshot_dir=args.snapshot_dir,
                        extra_parts=publisher_parts(cfg))
    except OSError as e:
        if getattr(e, "summary", None) is not None:  # trained, but summary.json failed: the numbers
            print(format_results(e.summary))
        raise
    if launch_env.rank() == 0:
        if "already_finished" in summary:
            print(summary["already_finished"])
        else:
            _report(summary)
            print(format_results(summary))
    return 0


def _report(summary: dict) -> None:
    """The run's picture (RUN/report/index.html); a plotting problem is a warning, never a
    failed run."""
    from hybridrec.bench.report import write_report

    write_report(Path(summary["run_dir"]),
                 on_error=lambda why: print(f"hybridrec: warning: report not written: {why}", file=sys.stderr))


def _launch(cfg, args) -> int:
    """Start the local processes of this same command through torch's elastic agent
    (what torchrun runs, here in this process): it sets RANK/WORLD_SIZE/MASTER_*, and if
    one process fails it stops the others, so a dead rank never leaves the rest hanging;
    the failure ends in the failing rank's own error and one line naming it (see
    :mod:`hybridrec.cli.launch`). The run directory is checked here first (a refusal is
    one line, no rank starts), and a new one chosen here is handed to every process."""
    from hybridrec.cli.launch import start_rank_server

    # The ranks' fork server imports torch while this process imports it for the checks.
    start_rank_server(servers=cfg.dist.num_ps, nnodes=cfg.dist.nnodes, interface=cfg.dist.interface)
    from hybridrec.train.run import preflight
    from hybridrec.train.run_lock import holding

    named = bool(cfg.train.run_dir)
    with contextlib.ExitStack() as held:
        # The run directory is locked before it is looked at, for as long as the ranks run
        # (across machines, by machine 0's launcher: the others' ranks train the same one).
        if named and cfg.dist.node_rank == 0:
            held.enter_context(holding(os.path.abspath(cfg.train.run_dir), cfg.train.run_dir))
        finished, run_dir, cfg = preflight(cfg, world_size=cfg.dist.nproc * cfg.dist.nnodes)
        if finished is not None:
            print(finished["already_finished"])
            return 0
        if not named:  # the new directory preflight made
            held.enter_context(holding(cfg.train.run_dir, run_dir))
        return _start_ranks(cfg, args, named, run_dir)


def _start_ranks(cfg, args, named: bool, run_dir: str) -> int:
    from hybridrec.cli.launch import run_local_ranks

    servers = cfg.dist.num_ps  # parameter servers: more processes of this command
    nproc = cfg.dist.nproc + servers
    argv = ["train"]
    if args.recipe:
        argv += ["--recipe", args.recipe]
    for f in args.config:
        argv += ["--config", f]
    argv += list(args.overrides)
    if not named:  # the new directory preflight made, the same for every process
        argv.append(f"train.run_dir={run_dir}")
    what = f"{cfg.dist.nproc} rank{'s' if cfg.dist.nproc > 1 else ''}" + (
        f" of machine {cfg.dist.node_rank} of {cfg.dist.nnodes} ({cfg.dist.master} over {cfg.dist.interface})"
        if cfg.dist.nnodes > 1 else "") + (
        f" and {servers} parameter servers" if servers else "") + (
        f", restarted up to {cfg.dist.max_restarts} times" if cfg.dist.max_restarts else "")
    print(f"launching {what}: hybridrec {' '.join(argv)}", file=sys.stderr, flush=True)
    from hybridrec.train import terminate
    from hybridrec.train.checkpointing.faults import MARKER
    from hybridrec.train.checkpointing.snapshots import fast_snapshots

    # partial recovery: the survivors' snapshots on this machine's memory while it runs
    with fast_snapshots(run_dir) if cfg.train.recovery == "partial" else contextlib.nullcontext() as fast:
        if fast is not None:  # (the ranks' command line: the same on a restart)
            argv[1:1] = ["--snapshot-dir", str(fast)]
        return run_local_ranks(nproc, argv, entry=args.entry, servers=servers, port=cfg.dist.port,
                               max_restarts=cfg.dist.max_restarts,
                               injection_marker=os.path.join(cfg.train.run_dir, MARKER), nnodes=cfg.dist.nnodes,
                               node_rank=cfg.dist.node_rank, master=cfg.dist.master, interface=cfg.dist.interface,
                               join_timeout_s=cfg.dist.join_timeout_s,
                               terminated=lambda: terminate.line(cfg.train.run_dir, run_dir, resume=cfg.train.resume))


def _eval(args) -> int:
    from hybridrec.train.run import evaluate_run

    def show(result: dict) -> None:  # before eval.json is written: seen even if that fails
        which = f" ({result['which']}, step {result['step']:,})" if isinstance(result.get("step"), int) else ""
        print(format_table([("checkpoint", result["checkpoint"] + which)] + _metric_rows(result)), flush=True)

    try:
        evaluate_run(args.run_dir, checkpoint=args.checkpoint, data_path=args.data, show=show, out=args.out)
    except OSError as e:
        if args.out is not None or not _read_only(e, Path(args.run_dir) / "eval.json"):
            raise
        print(f"hybridrec: warning: the metrics were not saved: {os_error_message(e)} "
              "(--out FILE writes them elsewhere)", file=sys.stderr)
    return 0


def _read_only(e: OSError, eval_json: Path) -> bool:
    """Whether ``e`` is the run directory refusing ``eval.json`` as a read-only one does
    (a read-only file system, or no permission to write there), not another failure."""
    return (e.errno in (errno.EROFS, errno.EACCES, errno.EPERM) and e.filename is not None
            and os.path.abspath(os.fsdecode(e.filename)) == os.path.abspath(eval_json))


def _demo(args) -> int:
    from hybridrec.train.demo import run_demo

    summary = run_demo(out=args.out, days=args.days, rows_per_day=args.rows_per_day,
                       seed=args.seed, overrides=args.overrides)
    _report(summary)
    print(format_results(summary))
    return 0


def _metric_rows(m: dict) -> list[tuple[str, str]]:
    def f(key, fmt="{:.4f}"):
        v = m.get(key)
        return "n/a" if v is None or (isinstance(v, float) and math.isnan(v)) else fmt.format(v)

    return [("AUC", f("auc")), ("log loss", f("log_loss")), ("NE", f("ne")),
            ("calibration", f("calibration")), ("accuracy", f("accuracy")),
            ("eval rows", f("count", "{:,}"))]


def _stream_rows(summary: dict) -> list[tuple[str, str]]:
    """A stream run's result lines: test-then-train metrics, what the stream held."""
    prog, stream = summary.get("progressive") or {}, summary.get("stream") or {}

    def f(v, fmt="{:.4f}"):
        return "n/a" if v is None or (isinstance(v, float) and math.isnan(v)) else fmt.format(v)

    rows = [(f"progressive AUC (last {prog.get('window', 0):,})", f(prog.get("auc"))),
            ("progressive log loss", f(prog.get("logloss"))),
            ("stream rows trained", f(stream.get("rows"), "{:,}")),
            ("stream files", f"{stream.get('files_done', 0):,} done, {stream.get('files_waiting', 0):,} waiting"
                             + (f" (stopped: {stream['stopped']})" if stream.get("stopped") else ""))]
    if (tables := summary.get("dynamic_tables")) is not None:
        rows.append(("dynamic table keys", (f"{tables['live']:,} live, {tables['admitted']:,} admitted, "
                                           f"{tables['evicted']:,} evicted")))
    return rows


def format_results(summary: dict) -> str:
    rows = _metric_rows(summary["eval"]) if summary.get("eval") is not None else _stream_rows(summary)
    if "teacher" in summary:
        rows.insert(1, ("teacher AUC (ceiling)", f"{summary['teacher']['auc']:.4f}"))
    tp = summary["throughput"].get("samples_per_sec_overall", float("nan"))
    es = summary.get("early_stop")
    if es and es.get("best_step") is not None:
        rows.insert(1, (f"best AUC (step {es['best_step']:,})", f"{es['best_auc']:.4f}"))
    rows += [("train samples/s", "n/a" if math.isnan(tp) else f"{tp:,.0f}"),
             ("steps", f"{summary['step']:,}" + (" (stopped early)" if es and es.get("stopped_early") else "")),
             ("peak memory", f"{summary['peak_memory_bytes'] / 2**20:,.0f} MiB")]
    if summary.get("cuda_peak_memory_bytes") is not None:  # (trained on a GPU: which, and its peak)
        rows += [("device", summary.get("device", "cuda")),
                 ("GPU peak memory", f"{summary['cuda_peak_memory_bytes'] / 2**20:,.0f} MiB")]
    rows.append(("run directory", summary["run_dir"]))
    return format_table(rows)


def format_table(rows: list[tuple[str, str]]) -> str:
    w = max(len(k) for k, _ in rows)
    line = "-" * (w + 2 + max(len(v) for _, v in rows))
    return "\n".join([line] + [f"{k:<{w}}  {v}" for k, v in rows] + [line])
