"""DES (tables sharded over the trainers) against the parameter-server mode, 2 trainers.

For one-hot and multi-hot synthetic click logs (``--multi-hot``: about that many ids per
field) and several batch sizes, trains once with DES (``dist.nproc=2``) and once with
parameter servers (``dist.nproc=2 dist.num_ps=2``) over the same data and reports, from
each run's ``summary.json``:

- embedding bytes per sample through a trainer's link, sent plus received, as counted by
  the code that moves them (DES: input_dist ids and counts, output_dist pooled embeddings
  forward and backward, replicated tables' all-reduce; PS: pulled ids and rows, pushed ids
  and gradient rows). Bytes a rank keeps for itself are not counted. The dense all-reduce
  (the same in both) is reported on its own.
- samples/s (all processes on this machine, over loopback: it shows the cost of the work,
  not of a network) and held-out AUC.

    python benchmarks/des_vs_ps.py --work /tmp/des-vs-ps --out docs/des_vs_ps.json
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

from throughput import machine  # this folder's: the CPU model and cores

EMBEDDING = ("input_dist", "input_dist_counts", "output_dist", "dp_table_allreduce", "ps_pull", "ps_push")
MODEL = ["model.bottom_mlp=[64,16]", "model.top_mlp=[64,1]", "train.progress=false",
         "train.save_checkpoints=false", "optim.sparse=rowwise_adagrad", "train.log_every=0"]


def hybridrec(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "hybridrec", *args], check=True, stdout=subprocess.DEVNULL)


def dataset(work: Path, multi_hot: int, days: int, rows: int) -> Path:
    out = work / f"data-mh{multi_hot}"
    if (out / "meta.json").is_file():
        return out
    raw = work / f"raw-mh{multi_hot}"
    hybridrec("data", "synth", "--out", str(raw), "--days", str(days), "--rows-per-day", str(rows),
              "--multi-hot", str(multi_hot), "--overwrite")
    hybridrec("data", "preprocess", *sorted(str(p) for p in raw.glob("day_*")), "--out", str(out),
              *(["--multi-hot-fields", "all"] if multi_hot else []))
    return out


VARIANTS = {"des": [], "des-table-wise": ["dist.sharding=table_wise"], "ps": ["dist.num_ps=2"],
            "ps-sync": ["dist.num_ps=2", "dist.ps_max_staleness=0"]}
"""DES as the planner places the tables (small ones replicated, all-reduced every step),
DES with every table on one rank (only ids and pooled embeddings travel), 2 servers
asynchronous (the default) and synchronous (a step's pushes summed into one update)."""


def run(data: Path, run_dir: Path, batch: int, variant: str, extra: list[str], collect: bool = False) -> dict:
    args = ["train", f"data.path={data}", f"train.run_dir={run_dir}", "train.resume=false", "dist.nproc=2",
            f"data.batch_size={batch}", *MODEL, *extra, *VARIANTS[variant]]
    if not collect:
        hybridrec(*args)
    s = json.loads((run_dir / "summary.json").read_text())
    cats = s["comm"]["by_category"]
    samples = s["comm"]["steps"] * batch  # this rank's samples (the ledger is rank 0's)

    def per_sample(names) -> float:
        return sum(c["sent"] + c["received"] for k, c in cats.items() if k in names) / samples

    return {"mode": variant, "batch_per_trainer": batch, "steps": s["step"],
            "embedding_bytes_per_sample": per_sample(EMBEDDING),
            "by_category_per_sample": {k: (c["sent"] + c["received"]) / samples for k, c in cats.items()},
            "samples_per_sec": s["throughput"].get("samples_per_sec_overall"),
            "auc": s["eval"]["auc"], "wall_s": s.get("wall_seconds"),
            "staleness": s.get("ps")}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--work", type=Path, default=Path("/tmp/des-vs-ps"))
    p.add_argument("--out", type=Path, help="write the results as JSON here")
    p.add_argument("--days", type=int, default=3)
    p.add_argument("--rows-per-day", type=int, default=40_000)
    p.add_argument("--multi-hot", default="0,10", help="ids per field of each dataset (0: one-hot)")
    p.add_argument("--batch-sizes", default="64,256,1024")
    p.add_argument("--variants", default=",".join(VARIANTS), help=f"of {', '.join(VARIANTS)}")
    p.add_argument("--collect", action="store_true", help="only read the runs already in --work")
    p.add_argument("overrides", nargs="*", help="more training overrides, e.g. dist.sharding=row_wise")
    a = p.parse_args()
    a.work.mkdir(parents=True, exist_ok=True)
    results = []
    for mh in (int(m) for m in a.multi_hot.split(",")):
        data = dataset(a.work, mh, a.days, a.rows_per_day)
        for batch in (int(b) for b in a.batch_sizes.split(",")):
            for variant in a.variants.split(","):
                r = run(data, a.work / f"run-mh{mh}-b{batch}-{variant}", batch, variant, a.overrides, a.collect)
                r["multi_hot"] = mh
                results.append(r)
                print(f"multi-hot {mh:>2}  batch {batch:>5}  {r['mode']:>14}: "
                      f"{r['embedding_bytes_per_sample']:,.0f} embedding B/sample  "
                      f"{r['samples_per_sec'] or float('nan'):,.0f} samples/s  AUC {r['auc']:.4f}", flush=True)
    report = {"cpu": machine(), "date": time.strftime("%Y-%m-%d"), "command": sys.argv,
              "results": results}
    if a.out:
        a.out.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
