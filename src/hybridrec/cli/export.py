"""``hybridrec export``: a run's model as a serving artifact (parsing only; the work is in
:mod:`hybridrec.serve.export`)."""

from __future__ import annotations

import argparse

_TABLES = ("fp32", "bf16", "int8")  # (hybridrec.serve.export.TABLES; not imported: it imports torch)


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "export", help="write a run's model as a self-contained serving artifact (torch.export)",
        description="Write a checkpoint of a run as DIR/model.pt2 (a torch.export program taking "
        "preprocessed ids and dense values, dynamic batch size, returning probabilities), the "
        "preprocessing as plain files (DIR/preprocess: spec.json, vocabularies), DIR/score.py "
        "(raw rows -> probabilities with only torch and numpy) and DIR/README.md. Prints the "
        "held-out AUC of the exported model next to the model as trained.")
    p.add_argument("run_dir", metavar="RUN_DIR")
    p.add_argument("--out", required=True, metavar="DIR", help="artifact directory")
    p.add_argument("--checkpoint", metavar="best|latest|DIR",
                   help="best (train.early_stop's best evaluation), latest (the newest) or a checkpoint "
                   "directory (default: best when the run recorded one, else latest)")
    p.add_argument("--tables", choices=_TABLES, default="fp32",
                   help="storage of the exported tables: fp32, bf16 (half) or int8 (row-wise, with a "
                   "scale and bias per row, dequantized in the program) [fp32]")
    p.add_argument("--onnx", action="store_true",
                   help="also write DIR/model.onnx through torch's dynamo exporter (needs the onnx and "
                   "onnxscript packages; if it fails, export.json says why)")
    p.add_argument("--eval-rows", type=int, default=0, metavar="N",
                   help="evaluate on the first N held-out rows only (0: all) [0]")
    p.add_argument("--overwrite", action="store_true",
                   help="replace an earlier export at DIR (only an export: its export.json and files, "
                   "nothing else; the new one is renamed into place when complete)")
    p.set_defaults(func=_export)


def _export(args: argparse.Namespace) -> int:
    from hybridrec.cli.train import format_table
    from hybridrec.serve.export import describe, export_run

    record = export_run(args.run_dir, args.out, checkpoint=args.checkpoint, tables=args.tables,
                        onnx=args.onnx, eval_rows=max(0, args.eval_rows), overwrite=args.overwrite)
    print(format_table([("artifact", args.out), *describe(record)]))
    return 0
