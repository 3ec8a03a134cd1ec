"""`hybridrec predict`: a trained run's probabilities for raw files."""

from __future__ import annotations

import argparse
from pathlib import Path

_EPILOG = """\
examples:
  hybridrec predict runs/kaggle day_23.gz --out day_23-predictions.parquet
  hybridrec predict runs/adult new.csv --out scores.csv --keep-columns id --checkpoint latest

The inputs are raw files in the format the run's dataset was made from (Criteo TSV, plain
or .gz, with or without the label; CSV or Parquet with the dataset's columns). Values become
ids and dense inputs exactly as at preprocessing (the dataset's vocabulary or table sizes
and dense transform; the dataset directory must still be there). The output has one row
per valid input row, in order: the kept columns, then `probability`; it is written to a
temporary file beside OUT and renamed to OUT at the end (a failure leaves an earlier OUT as
it was). An OUT that is one of the inputs is refused.
"""


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("predict", help="a trained run's click probabilities for raw files",
                       description="Score raw rows with a run's model: one probability per row, "
                       "to Parquet or CSV (by the extension of --out). Runs on the GPU when there "
                       "is one.", epilog=_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run_dir", metavar="RUN", help="the run directory")
    p.add_argument("inputs", nargs="+", metavar="INPUT", help="raw files, read in order")
    p.add_argument("--out", required=True, metavar="FILE", help="output .parquet or .csv file")
    p.add_argument("--checkpoint", metavar="best|latest|DIR",
                   help="which checkpoint (default: best when the run recorded one, else latest)")
    p.add_argument("--keep-columns", default="", metavar="COL,...",
                   help="input columns copied to the output beside the probability (Criteo: label)")
    p.add_argument("--on-bad-line", choices=("error", "skip"), default="error",
                   help="malformed line: stop with file:line:field (default) or skip and count")
    p.add_argument("--batch-size", type=int, metavar="N",
                   help="rows per forward pass [the run's data.eval_batch_size]")
    p.set_defaults(func=_predict)


def _predict(args) -> int:
    from hybridrec.serve.predict import Predictor, check_out, predict_files

    check_out(Path(args.out), args.inputs)  # a bad --out fails before the model loads
    keep = [c.strip() for c in args.keep_columns.split(",") if c.strip()]
    predictor = Predictor.load(args.run_dir, checkpoint=args.checkpoint, batch_size=args.batch_size)
    r = predict_files(predictor, args.inputs, args.out, keep=keep, on_bad_line=args.on_bad_line)
    rate = f" ({r['rows_per_second']:,.0f} rows/s)" if r["rows_per_second"] else ""
    print(f"wrote {r['rows']} predictions to {r['out']} in {r['seconds']:.1f}s{rate} on {r['device']} "
          f"with {r['checkpoint']}; bad lines skipped: {r['bad_lines_skipped']}")
    for example in r["bad_line_examples"]:
        print(f"  skipped: {example}")
    return 0
