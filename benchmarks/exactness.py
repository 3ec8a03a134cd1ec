#!/usr/bin/env python3
"""Exactness: N ranks vs one process with the same global batch, per sharding type.

    .venv/bin/python benchmarks/exactness.py [--nproc 2] [--steps 20] [--optimizer sgd]

Trains the `demo` recipe on a small synthetic dataset through the real CLI: once in one
process with batch B*N, then with N ranks (torchrun) of batch B for every sharding type,
all for the same number of steps from the same seed. Both final checkpoints are loaded into
a single-process model and compared: the maximum absolute difference over every parameter,
embedding tables and dense layers separately, and the held-out AUC of both.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TYPES = ["table_wise", "row_wise", "column_wise", "table_row_wise", "data_parallel"]


def run(cmd: list[str]) -> None:
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{proc.stderr[-3000:]}")


def final_state(run_dir: Path, data: Path):
    from hybridrec.train.run import load_run_model

    return load_run_model(run_dir, data_path=str(data))[2].state_dict()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=str(ROOT / "benchmarks/out/exactness"))
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=256, help="per rank")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--optimizer", default="sgd", help="sparse optimizer (sgd, rowwise_adagrad, lazy_adam)")
    args = p.parse_args(argv)
    out = Path(args.out)
    data = out / "data"
    hr = [sys.executable, "-m", "hybridrec"]
    if not (data / "meta.json").is_file():
        run([*hr, "data", "synth", "--out", str(out / "raw"), "--days", "2", "--rows-per-day", "20000",
             "--overwrite"])
        run([*hr, "data", "preprocess", *sorted(str(x) for x in (out / "raw").glob("day_*")),
             "--out", str(data), "--overwrite"])
    common = ["--recipe", "demo", f"data.path={data}", f"train.max_steps={args.steps}",
              "train.resume=false", "train.progress=false", "optim.warmup_steps=0",
              f"optim.sparse={args.optimizer}", "optim.dense=sgd"]
    ref_dir = out / "single"
    run([*hr, "train", *common, f"data.batch_size={args.batch_size * args.nproc}",
         f"train.run_dir={ref_dir}"])
    ref = final_state(ref_dir, data)
    ref_auc = json.loads((ref_dir / "summary.json").read_text())["eval"]["auc"]
    rows = []
    for kind in TYPES:
        d = out / kind
        run([*hr, "train", *common, f"data.batch_size={args.batch_size}", f"dist.nproc={args.nproc}",
             f"dist.sharding={kind}", f"train.run_dir={d}"])
        got = final_state(d, data)
        emb = max((got[k] - ref[k]).abs().max().item() for k in ref if "sparse.tables" in k)
        dense = max((got[k] - ref[k]).abs().max().item() for k in ref if "sparse.tables" not in k)
        auc = json.loads((d / "summary.json").read_text())["eval"]["auc"]
        rows.append({"sharding": kind, "max_abs_diff_embeddings": emb, "max_abs_diff_dense": dense,
                     "auc": auc, "auc_single_process": ref_auc})
        print(f"{kind:15} embeddings {emb:.2e}  dense {dense:.2e}  AUC {auc:.6f} (1 process {ref_auc:.6f})",
              flush=True)
    (out / "exactness.json").write_text(json.dumps({"nproc": args.nproc, "steps": args.steps,
                                                    "optimizer": args.optimizer, "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
