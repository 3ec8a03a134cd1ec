"""``hybridrec data``: synthesize, preprocess and inspect datasets (parsing only)."""

from __future__ import annotations

import argparse
import json
import sys

from hybridrec.errors import ConfigError

_FORMATS = ("criteo", "csv", "parquet")


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "data",
        help="make, preprocess and inspect datasets",
        description="Synthetic click logs, preprocessing into memory-mappable shards, inspection.",
    )
    sub = p.add_subparsers(dest="data_command", metavar="SUBCOMMAND", required=True)
    _add_synth(sub)
    _add_preprocess(sub)
    _add_inspect(sub)


def _add_synth(sub) -> None:
    p = sub.add_parser(
        "synth",
        help="generate Criteo-format days from a planted teacher model",
        description=(
            "Write day_0.tsv .. day_{D-1}.tsv in the Criteo Kaggle format, sampled from a "
            "known logistic teacher (per-id biases, dense effects, a few FM interactions; "
            "Zipf ids, Criteo-like missing values and click rate), and teacher.json with the "
            "teacher's AUC on the last day: the ceiling a model trained on the other days "
            "can approach. With --stream: hour_0000.tsv, hour_0001.tsv, ... landing one by one "
            "(written to .NAME.tmp, renamed), whose ids are born and die (--drift), and "
            "stream.json (per hour: click rate, teacher AUC, live and distinct ids)."
        ),
    )
    p.add_argument("--out", required=True, metavar="DIR", help="output directory")
    p.add_argument(
        "--days", type=int, default=None, metavar="N", help="day files to write (default 7)"
    )
    p.add_argument(
        "--rows-per-day",
        type=int,
        default=None,
        metavar="N",
        help="rows per day (default 100000)",
    )
    p.add_argument(
        "--multi-hot",
        type=int,
        default=None,
        metavar="N",
        help="0: one id per field; N: multi-hot fields hold about N comma-separated ids",
    )
    p.add_argument(
        "--multi-hot-fields",
        default=None,
        metavar="C1,C2,...",
        help="which fields are multi-hot with --multi-hot (default: all 26)",
    )
    p.add_argument(
        "--scale",
        type=float,
        default=None,
        metavar="X",
        help="vocabulary sizes = Criteo Kaggle's x SCALE (default 0.01; with --stream 0.003: "
        "live ids per feature)",
    )
    p.add_argument(
        "--max-cardinality",
        type=int,
        default=100_000,
        metavar="N",
        help="cap on any vocabulary size (default 100000)",
    )
    p.add_argument(
        "--zipf", type=float, default=1.1, metavar="A", help="id popularity exponent (default 1.1)"
    )
    p.add_argument(
        "--ctr", type=float, default=0.25, metavar="P", help="target click rate (default 0.25)"
    )
    p.add_argument("--gzip", action="store_true", help="write day_i.tsv.gz")
    p.add_argument(
        "--seed", type=int, default=0, metavar="N", help="teacher and sampling seed (default 0)"
    )
    p.add_argument("--overwrite", action="store_true",
                   help="replace the day files and teacher.json of a non-empty --out (once every new "
                   "one is complete; other files are left alone); with --stream: remove the hour "
                   "files and stream.json of an earlier stream first")
    s = p.add_argument_group("a drifting stream (--stream)")
    s.add_argument("--stream", action="store_true",
                   help="write hour files that land one by one, ids born and dying each hour")
    s.add_argument("--hours", type=int, default=None, metavar="H",
                   help="hour files to write (default 24)")
    s.add_argument("--rows-per-hour", type=int, default=None, metavar="N",
                   help="rows per hour (default 100000)")
    s.add_argument("--drift", type=float, default=None, metavar="RATE",
                   help="fraction of each feature's live ids replaced by new ids every hour "
                   "(default 0.1)")
    s.add_argument("--land-every", type=float, default=None, metavar="SECONDS",
                   help="one hour file lands every SECONDS, timed from the start (default 0: as "
                   "fast as they are written)")
    p.set_defaults(func=_synth)


def _add_preprocess(sub) -> None:
    p = sub.add_parser(
        "preprocess",
        help="raw logs (Criteo TSV, CSV, Parquet) -> dataset directory",
        description=(
            "Convert input files (one part each, in order) into a dataset directory of .npy "
            "shards + meta.json (docs/data-format.md). Dense values: missing/negative -> 0, "
            "log(x+1). Categorical ids: modulo --table-size, or a vocabulary of the ids seen "
            "at least --min-count times in the training parts (rare/unseen -> 0); with neither, "
            "the exact vocabulary. The last input is the eval split unless --eval-parts says "
            "otherwise. Written atomically: OUT appears only when complete."
        ),
    )
    p.add_argument("inputs", nargs="+", metavar="INPUT", help="input files (plain or .gz)")
    p.add_argument("--out", required=True, metavar="DIR", help="dataset directory to create")
    p.add_argument(
        "--format",
        choices=_FORMATS,
        default="criteo",
        help="input format (default criteo); csv/parquet need --schema",
    )
    p.add_argument(
        "--schema",
        metavar="FILE",
        help="JSON schema of CSV/Parquet inputs (label, label_positive + label_negative or "
        "label_threshold, dense, categorical, multihot, table_size, min_count, dense_transform, "
        "list_delimiter; docs/data-format.md)",
    )
    p.add_argument(
        "--table-size",
        metavar="N",
        help="ids = hash %% N; N, one N per feature (N1,N2,...) or N,C3=M overrides",
    )
    p.add_argument(
        "--min-count",
        type=int,
        metavar="K",
        help="vocabulary: ids seen fewer than K times in training parts -> 0",
    )
    p.add_argument(
        "--on-bad-line",
        choices=("error", "skip"),
        default="error",
        help="malformed line: stop with file:line:field (default) or skip and count",
    )
    p.add_argument(
        "--multi-hot-fields",
        default="",
        metavar="C1,C2,...",
        help="Criteo fields holding comma-separated id lists ('all' for every field)",
    )
    p.add_argument(
        "--eval-parts",
        default=None,
        metavar="LIST",
        help="eval parts: input indices (-1 = last), part names or input files, "
        "comma-separated; 'none' for no eval split (default: the last input)",
    )
    p.add_argument(
        "--like",
        metavar="DATASET",
        help="encode with DATASET's vocabulary, table sizes and dense transform (new days for a "
        "model trained on DATASET: same tables, unseen ids -> 0 as rare ones); "
        "--table-size and --min-count are DATASET's",
    )
    p.add_argument(
        "--grow",
        action="store_true",
        help="with --like and vocabulary tables: append rows for new keys seen --min-count times "
        "in the new training parts (train.init_from keeps the old rows)",
    )
    p.add_argument("--overwrite", action="store_true",
                   help="replace an existing dataset at --out (only a hybridrec dataset: its meta.json "
                   "and a dataset's files, nothing else; never an input or the --like dataset)")
    p.set_defaults(func=_preprocess)


def _add_inspect(sub) -> None:
    p = sub.add_parser(
        "inspect",
        help="summarize a dataset directory",
        description="Print the schema, parts, splits, preprocessing report and per-feature stats, "
        "then check every part as training opens it (files whole, every id inside its table); "
        "a problem ends with one line naming the file and status 2.",
    )
    p.add_argument("dataset", metavar="DIR", help="dataset directory (with meta.json)")
    p.add_argument("--json", action="store_true", help="print meta.json instead of tables")
    p.set_defaults(func=_inspect)


_STREAM_ONLY = ("hours", "rows_per_hour", "drift", "land_every")
_DAYS_ONLY = ("days", "rows_per_day", "multi_hot", "multi_hot_fields")


def _flag(dest: str) -> str:
    return "--" + dest.replace("_", "-")


def _synth(args: argparse.Namespace) -> int:
    from hybridrec.data.synth import generate

    wrong = [_flag(d) for d in (_DAYS_ONLY if args.stream else _STREAM_ONLY)
             if getattr(args, d) is not None]
    if wrong:
        raise ConfigError(f"{', '.join(wrong)}: " + (
            "for day files; --stream writes hours (--hours, --rows-per-hour)" if args.stream
            else "for a stream (add --stream)"))
    if args.stream:
        return _synth_stream(args)
    fields = None
    if args.multi_hot_fields:
        fields = tuple(f.strip() for f in args.multi_hot_fields.split(",") if f.strip())
    report = generate(
        args.out,
        days=7 if args.days is None else args.days,
        rows_per_day=100_000 if args.rows_per_day is None else args.rows_per_day,
        seed=args.seed,
        multi_hot=args.multi_hot or 0,
        scale=0.01 if args.scale is None else args.scale,
        gzip=args.gzip,
        overwrite=args.overwrite,
        multi_hot_fields=fields,
        max_cardinality=args.max_cardinality,
        zipf_exponent=args.zipf,
        target_ctr=args.ctr,
    )
    print(
        f"wrote {report['rows']} rows in {len(report['files'])} files to {args.out} "
        f"({report['rows_per_second']:,} rows/s)"
    )
    print(
        f"click rate {report['ctr']:.4f}; teacher AUC on {report['eval_file']}: "
        f"{report['teacher_auc']:.4f} (log loss {report['teacher_logloss']:.4f})"
    )
    if report["multi_hot_fields"]:
        print("preprocess with: --multi-hot-fields " + ",".join(report["multi_hot_fields"]))
    return 0


def _synth_stream(args: argparse.Namespace) -> int:
    from hybridrec.data.synth_stream import DEFAULT_SCALE, generate_stream

    given = {"hours": args.hours, "rows_per_hour": args.rows_per_hour, "drift": args.drift,
             "land_every": args.land_every}
    r = generate_stream(
        args.out,
        seed=args.seed,
        scale=DEFAULT_SCALE if args.scale is None else args.scale,
        gzip=args.gzip,
        overwrite=args.overwrite,
        max_cardinality=args.max_cardinality,
        zipf_exponent=args.zipf,
        target_ctr=args.ctr,
        **{k: v for k, v in given.items() if v is not None},
    )
    hours = r["hours"]
    aucs = [h["teacher_auc"] for h in hours]
    print(
        f"wrote {len(hours)} hour files ({r['rows']:,} rows, {r['rows_per_second']:,} rows/s) to "
        f"{args.out}: click rate {sum(h['ctr'] * h['rows'] for h in hours) / r['rows']:.4f}, "
        f"teacher AUC {min(aucs):.4f}-{max(aucs):.4f}, {hours[-1]['live_ids']['total']:,} live ids, "
        f"{hours[-1]['distinct_ids_so_far']['total']:,} distinct seen (per hour: stream.json)"
    )
    return 0


def _preprocess(args: argparse.Namespace) -> int:
    from pathlib import Path

    from hybridrec.data.inputs import text_order_note
    from hybridrec.data.preprocess import preprocess_criteo, preprocess_tabular

    note = None if args.eval_parts is not None else text_order_note([Path(p) for p in args.inputs])
    if note is not None:
        print(f"note: {note}", file=sys.stderr)

    if args.like or args.grow:
        meta = _preprocess_like(args)
        _report_preprocess(meta)
        return 0
    common = {
        "table_size": args.table_size,
        "min_count": args.min_count,
        "on_bad_line": args.on_bad_line,
        "eval_parts": args.eval_parts,
        "overwrite": args.overwrite,
    }
    if args.format == "criteo":
        if args.schema:
            raise ConfigError("--schema is for --format csv/parquet (Criteo's layout is fixed)")
        meta = preprocess_criteo(
            args.inputs, args.out, multi_hot_fields=args.multi_hot_fields, **common
        )
    else:
        if not args.schema:
            raise ConfigError(f"--format {args.format} needs --schema FILE")
        if args.multi_hot_fields:
            raise ConfigError("--multi-hot-fields is for criteo; list multihot columns in --schema")
        meta = preprocess_tabular(
            args.inputs, args.out, schema_path=args.schema, fmt=args.format, **common
        )
    _report_preprocess(meta)
    return 0


def _preprocess_like(args: argparse.Namespace):
    from hybridrec.data.like import preprocess_like

    if not args.like:
        raise ConfigError("--grow adds rows to the tables of a --like DATASET; give --like")
    given = [o for o, v in (("--table-size", args.table_size), ("--min-count", args.min_count is not None),
                            ("--multi-hot-fields", args.multi_hot_fields)) if v]
    if given:
        raise ConfigError(f"{', '.join(given)} with --like: the tables are {args.like}'s")
    return preprocess_like(args.inputs, args.out, like=args.like, fmt=args.format,
                           schema_path=args.schema, grow=args.grow, on_bad_line=args.on_bad_line,
                           eval_parts=args.eval_parts, overwrite=args.overwrite)


def _report_preprocess(meta) -> None:
    from pathlib import Path

    r = meta.report
    print(
        f"wrote {r['rows_written']} rows ({len(meta.parts)} parts) to {meta.path} "
        f"in {r['seconds']:.1f}s; bad lines skipped: {r['bad_lines_skipped']}"
    )
    for example in r["bad_line_examples"]:
        print(f"  skipped: {example}")
    held = {p.name: p.source for p in meta.parts}
    for split, names in meta.splits.items():
        if split != "train" and names:
            print(f"{split} split: " + ", ".join(Path(held[n]).name for n in names))
    pp = meta.preprocessing
    if pp.get("like"):
        unseen = pp.get("ids_unseen") or {}
        worst = max(unseen, key=unseen.get) if unseen else None
        print(f"ids of {pp['like']}" + (f"; unseen keys -> id 0: up to {unseen[worst]:.1%} of {worst}'s "
                                        "training values" if worst else ""))
    if pp.get("grown_rows") is not None:
        grown = {n: k for n, k in pp["grown_rows"].items() if k}
        print(f"grew the tables by {sum(grown.values()):,} rows"
              + (": " + ", ".join(f"{n} +{k:,}" for n, k in grown.items()) if grown else ""))


def _inspect(args: argparse.Namespace) -> int:
    from hybridrec.data.loader import check_parts
    from hybridrec.data.schema import DatasetMeta

    meta = DatasetMeta.load(args.dataset)
    if args.json:
        print(json.dumps(meta.to_dict(), indent=2))
    else:
        for line in describe(meta):
            print(line)
    sys.stdout.flush()  # the summary before a problem's line (stderr)
    check_parts(meta)  # a file missing, cut short or holding an id past its table: one line
    if not args.json:
        print(f"checked: {len(meta.parts)} parts, their files whole and every id inside its table")
    return 0


def _label_map_text(label_map) -> str:
    """How raw labels became 0/1 (the schema's label_positive/negative, label_threshold)."""
    if not isinstance(label_map, dict):
        return ""
    if "threshold" in label_map:
        return f" (>= {label_map['threshold']} is 1, below is 0)"
    return (f" ({', '.join(map(str, label_map.get('positive', [])))} is 1; "
            f"{', '.join(map(str, label_map.get('negative', [])))} is 0)")


def describe(meta) -> list[str]:
    """Human-readable summary lines of a dataset."""
    s = meta.schema
    out = [
        f"dataset {meta.path} (format_version {meta.format_version}, {meta.created_by})",
        (f"label: {s.label}{_label_map_text(meta.preprocessing.get('label_map'))}; "
         f"dense ({len(s.dense)}): {', '.join(s.dense)}"),
        f"features: {len(s.onehot)} one-hot, {len(s.multihot)} multi-hot",
        "splits: "
        + "; ".join(
            f"{k} {meta.split_rows(k):,} rows in {len(v)} parts" for k, v in meta.splits.items()
        ),
    ]
    pp = meta.preprocessing
    out.append(
        f"ids: {pp.get('categorical')} (min_count {pp.get('min_count')}), "
        f"dense: {pp.get('dense_transform')}"
    )
    r = meta.report
    out.append(
        f"report: {r.get('lines_read', 0):,} lines read, {r.get('rows_written', 0):,} "
        f"rows written, {r.get('bad_lines_skipped', 0)} bad lines skipped, "
        f"{r.get('seconds', 0)}s"
    )
    out.append(
        f"{'feature':<14}{'kind':<9}{'rows':>12}{'distinct':>12}{'ids/sample':>11}"
        f"{'top1%':>8}{'top10%':>8}"
    )
    for f in s.features:
        st = meta.stats.get(f.name, {})
        out.append(
            f"{f.name:<14}{f.kind:<9}{f.num_embeddings:>12,}{st.get('distinct', 0):>12,}"
            f"{st.get('mean_ids_per_sample', 0):>11.2f}{st.get('top1pct_share', 0):>8.3f}"
            f"{st.get('top10pct_share', 0):>8.3f}"
        )
    return out
