"""``hybridrec bench compression`` (argument parsing only; the sweep is
:mod:`hybridrec.bench.compression`)."""

from __future__ import annotations

import argparse
from pathlib import Path

_EPILOG = """\
settings (the uncompressed "baseline" is always trained first):
  --dense COMPRESSOR[:V,V...]     dct:ETA,..  topk:ETA,..  powersgd:RANK,..  fp16  bf16
  --embedding CODEC[:V,V...]      dct:ETA,..  dct-fp16:ETA,..  dct-bf16:ETA,..  fp16  bf16  int8
      one setting per value, compressing that hop only (--cross: every dense point
      with every embedding point); ETA in (0, 1] is the fraction of entries kept.
      Names: dense-dct-0.01, dense-powersgd-r4, emb-dct-0.05, emb-dct-fp16-0.05, emb-int8.
  --setting NAME:KEY=VALUE[,KEY=VALUE...]
      a named setting; a KEY without a section is in [compress]
      (embedding=dct = compress.embedding=dct); list values continue after commas
      (embedding_tables=C1,C2).

examples:
  hybridrec bench compression --data data/pre --out runs/sweep --nproc 2 \\
      --embedding dct:0.25,0.05,0.01 --embedding fp16 --embedding int8 --seeds 0,1
  hybridrec bench compression --data data/pre --out runs/dp --nproc 2 \\
      --dense dct:0.01,0.001 --dense topk:0.01 --dense powersgd:1,4 --max-steps 500
  hybridrec bench compression --data data/pre --out runs/big --nproc 2 \\
      --setting big-only:embedding=dct,embedding_ratio=0.05,embedding_min_rows=10000 \\
      -- data.batch_size=1024 optim.dense_lr=0.05

Each run trains into OUT/<setting>/seed<k>/ (its output in OUT/<setting>/seed<k>.log); a finished
run with the same config is reused (--overwrite retrains). OUT gets results.json,
results.md (the table) and pareto.svg (AUC and log loss vs bytes sent per step).
"""


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="benchmarks: a compression sweep",
                       description="Benchmarks that train several runs and compare them.")
    bsub = p.add_subparsers(dest="bench_command", metavar="SUBCOMMAND", required=True)
    c = bsub.add_parser(
        "compression", help="train each compression setting, compare AUC with bytes sent",
        description="Sweep compressors (dense gradients), codecs (pooled embeddings) and eta "
        "on one dataset and world size: train every setting and seed through `hybridrec "
        "train`, then write a table and a Pareto plot of held-out AUC / log loss against "
        "the bytes sent per step.",
        epilog=_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    c.add_argument("--data", required=True, metavar="DIR", help="preprocessed dataset")
    c.add_argument("--out", required=True, metavar="RUN_DIR", help="sweep directory")
    c.add_argument("--nproc", type=int, default=1, metavar="N", help="ranks per run [1]")
    c.add_argument("--recipe", default="demo", metavar="NAME", help="config to start from [demo]")
    c.add_argument("--setting", action="append", default=[], metavar="NAME:KEY=VALUE,...",
                   help="a named setting (repeatable)")
    c.add_argument("--dense", action="append", default=[], metavar="COMPRESSOR[:V,...]",
                   help="dense-gradient grid, e.g. dct:0.01,0.001 (repeatable)")
    c.add_argument("--embedding", action="append", default=[], metavar="CODEC[:V,...]",
                   help="pooled-embedding grid, e.g. dct:0.05 (repeatable)")
    c.add_argument("--cross", action="store_true",
                   help="combine every --dense point with every --embedding point")
    c.add_argument("--seeds", default="0", metavar="S,S,...", help="train.seed of each run [0]")
    c.add_argument("--max-steps", type=int, default=0, metavar="N",
                   help="steps per run (0: the recipe's epochs) [0]")
    c.add_argument("--overwrite", action="store_true", help="retrain runs that already finished")
    c.add_argument("overrides", nargs="*", metavar="KEY=VALUE",
                   help="config overrides for every run (after --)")
    c.set_defaults(func=_compression)


def _compression(args: argparse.Namespace) -> int:
    from hybridrec.bench.compression import SweepSpec, build_settings, parse_seeds, run_sweep
    from hybridrec.bench.compression_report import format_markdown

    spec = SweepSpec(
        data=Path(args.data), out=Path(args.out), nproc=args.nproc, recipe=args.recipe,
        settings=build_settings(named=args.setting, dense=args.dense, embedding=args.embedding,
                                cross=args.cross),
        seeds=parse_seeds(args.seeds), max_steps=args.max_steps, overrides=args.overrides,
        overwrite=args.overwrite)
    results = run_sweep(spec, echo=lambda line: print(line, flush=True))
    print()
    print(format_markdown(results), end="")
    failed = sum(s["runs_failed"] for s in results["settings"])
    return 1 if failed else 0
