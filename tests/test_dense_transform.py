"""Dense columns' transforms per column (hybridrec.data.dense): chosen from the values at
preprocessing (counts log1p, others standardized with the train split's numbers in
meta.json), overridden in the schema, and the same numbers reused by --like, predict, the
JSON rows, the export's score.py and a stream; Criteo's datasets as before."""

from __future__ import annotations

import csv
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from hybridrec.cli.main import main
from hybridrec.data import dense
from hybridrec.data.like import preprocess_like
from hybridrec.data.preprocess import preprocess_criteo, preprocess_tabular
from hybridrec.data.schema import DatasetMeta
from hybridrec.data.stream import stream_meta
from hybridrec.errors import ConfigError, DataError

HEADER = ["clicked", "visits", "temp", "city"]


def rows(n: int, seed: int) -> list[list[str]]:
    """``visits``: a count (non-negative integers, some missing); ``temp``: continuous, with
    negatives and fractions (some missing); the label follows both."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        visits = int(rng.poisson(3.0))
        temp = round(float(rng.normal(-1.5, 4.0)), 3)
        label = int(rng.random() < 1 / (1 + np.exp(-(0.4 * visits - 1.2 + 0.3 * temp))))
        out.append([str(label), "" if rng.random() < 0.05 else str(visits),
                    "" if rng.random() < 0.05 else repr(temp), f"c{rng.integers(0, 8)}"])
    return out


def write_csv(path: Path, body: list[list[str]]) -> Path:
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(HEADER)
        w.writerows(body)
    return path


def write_schema(path: Path, **extra) -> Path:
    path.write_text(json.dumps({"label": "clicked", "dense": ["visits", "temp"],
                                "categorical": ["city"], **extra}))
    return path


def raw_column(body: list[list[str]], j: int) -> np.ndarray:
    return np.array([float(r[j]) if r[j] else np.nan for r in body])


@pytest.fixture(scope="module")
def tabular(tmp_path_factory):
    """A CSV dataset of two files (the second held out), the schema leaving the transforms
    to the values: ``(dataset meta, train rows, eval rows, root)``."""
    root = tmp_path_factory.mktemp("dense")
    train, held = rows(3000, 1), rows(800, 2)
    a, b = write_csv(root / "a.csv", train), write_csv(root / "b.csv", held)
    meta = preprocess_tabular([a, b], root / "ds", schema_path=write_schema(root / "schema.json"))
    return meta, train, held, root


def test_auto_logs_counts_and_standardizes_the_rest_with_train_numbers(tabular):
    meta, train, held, _ = tabular
    temp, logs = raw_column(train, 2), np.log1p(raw_column(train, 1))
    got = meta.preprocessing["dense_transform"]
    assert set(got) == {"visits", "temp"}
    v, t = got["visits"], got["temp"]
    assert v["transform"] == "log1p_standardize" and t["transform"] == "standardize"
    assert v["mean"] == pytest.approx(np.nanmean(logs), rel=1e-12)
    assert v["std"] == pytest.approx(np.nanstd(logs), rel=1e-12)
    assert t["mean"] == pytest.approx(np.nanmean(temp), rel=1e-12)
    assert t["std"] == pytest.approx(np.nanstd(temp), rel=1e-12)
    # meta.json on disk says the same, and the shards hold the transformed values: the
    # held-out part standardized with the train split's numbers; a missing value 0.
    assert json.loads((meta.path / "meta.json").read_text())["preprocessing"]["dense_transform"] == got
    for part, body in (("part-00000", train), ("part-00001", held)):
        d = np.load(meta.path / part / "dense.npy")
        visits, t = raw_column(body, 1), raw_column(body, 2)
        want_v = np.where(np.isnan(visits), 0.0, (np.log1p(np.nan_to_num(visits)) - v["mean"]) / v["std"])
        want_t = np.where(np.isnan(t), 0.0, (t - got["temp"]["mean"]) / got["temp"]["std"])
        assert np.array_equal(d[:, 0], want_v.astype(np.float32))
        assert np.array_equal(d[:, 1], want_t.astype(np.float32))
    d = np.load(meta.path / "part-00000" / "dense.npy")
    for j in range(2):  # (missing values: 0, the mean)
        assert abs(d[:, j].mean()) < 0.01 and 0.9 < d[:, j].std() < 1.0


def test_parquet_chooses_as_csv_does(tabular, tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    meta, train, held, root = tabular
    for name, body in (("a", train), ("b", held)):
        cols = {"clicked": [int(r[0]) for r in body], "visits": [int(r[1]) if r[1] else None for r in body],
                "temp": [float(r[2]) if r[2] else None for r in body], "city": [r[3] for r in body]}
        pq.write_table(pa.table(cols), tmp_path / f"{name}.parquet")
    pm = preprocess_tabular([tmp_path / "a.parquet", tmp_path / "b.parquet"], tmp_path / "ds",
                            schema_path=root / "schema.json")
    assert pm.preprocessing["dense_transform"] == meta.preprocessing["dense_transform"]
    for part in ("part-00000", "part-00001"):
        assert np.array_equal(np.load(pm.path / part / "dense.npy"), np.load(meta.path / part / "dense.npy"))


def test_schema_override_wins(tabular, tmp_path):
    _, train, _, root = tabular
    a, b = root / "a.csv", root / "b.csv"
    schema = write_schema(tmp_path / "s1.json", dense_transform={"visits": "standardize", "temp": "log1p"})
    got = preprocess_tabular([a, b], tmp_path / "d1", schema_path=schema).preprocessing["dense_transform"]
    assert set(got) == {"visits", "temp"}
    visits = raw_column(train, 1)
    assert got["temp"] == "log1p" and got["visits"]["transform"] == "standardize"
    assert got["visits"]["mean"] == pytest.approx(np.nanmean(visits), rel=1e-12)
    # "*" is every column not named; given numbers are used as they are.
    schema = write_schema(tmp_path / "s2.json", dense_transform={
        "*": "none", "temp": {"transform": "standardize", "mean": 2.0, "std": 4.0}})
    m2 = preprocess_tabular([a, b], tmp_path / "d2", schema_path=schema)
    assert m2.preprocessing["dense_transform"] == {
        "visits": "none", "temp": {"transform": "standardize", "mean": 2.0, "std": 4.0}}
    t = raw_column(train, 2)
    assert np.array_equal(np.load(m2.path / "part-00000" / "dense.npy")[:, 1],
                          np.where(np.isnan(t), 0.0, (t - 2.0) / 4.0).astype(np.float32))
    # One word for every column: meta.json says it in one word, as before.
    schema = write_schema(tmp_path / "s3.json", dense_transform="log1p")
    assert preprocess_tabular([a, b], tmp_path / "d3", schema_path=schema).preprocessing["dense_transform"] == "log1p"
    for bad, words in (({"age": "log1p"}, "not dense columns"), ("zscore", "is not one of"),
                       ({"temp": {"transform": "standardize", "mean": 1.0, "std": 0}}, "std > 0")):
        schema = write_schema(tmp_path / "bad.json", dense_transform=bad)
        with pytest.raises(DataError, match=words):
            preprocess_tabular([a, b], tmp_path / "d4", schema_path=schema)


def test_criteo_stays_log1p_byte_for_byte(tmp_path):
    """Criteo's dense fields are counts: log1p of each (a negative 0, a missing 0), and
    meta.json's one word, as every earlier version wrote them."""
    rng = np.random.default_rng(0)
    lines = []
    for i in range(200):
        d = ["" if rng.random() < 0.2 else str(int(rng.integers(-3, 5000))) for _ in range(13)]
        lines.append("\t".join([str(i % 2), *d, *[f"{rng.integers(0, 1 << 20):08x}" for _ in range(26)]]))
    for k in range(2):
        (tmp_path / f"day_{k}.tsv").write_text("\n".join(lines[k * 100:(k + 1) * 100]) + "\n")
    meta = preprocess_criteo([tmp_path / "day_0.tsv", tmp_path / "day_1.tsv"], tmp_path / "ds")
    assert meta.preprocessing["dense_transform"] == "log1p"
    assert '"dense_transform": "log1p"' in (meta.path / "meta.json").read_text()
    for k in range(2):
        raw = np.array([[float(v) if v else 0.0 for v in ln.split("\t")[1:14]] for ln in lines[k * 100:(k + 1) * 100]])
        want = np.log1p(np.maximum(raw, 0.0)).astype(np.float32)
        assert np.load(meta.path / f"part-0000{k}" / "dense.npy").tobytes() == want.tobytes()


def test_old_meta_reads_as_log1p():
    names = ["a", "b"]
    assert dense.from_meta("log1p", names, "m") == [dense.Column("log1p")] * 2
    assert dense.from_meta(None, names, "m") == [dense.Column("log1p")] * 2  # (no entry at all)
    assert dense.from_meta("none", names, "m") == [dense.Column("none")] * 2
    cols = [dense.Column("log1p"), dense.Column("standardize", 1.5, 2.0), dense.Column("log1p_standardize", 1.0, 0.5)]
    names = ["a", "b", "c"]
    assert dense.from_meta(dense.to_meta(cols, names), names, "m") == cols
    with pytest.raises(DataError, match="not one preprocessing wrote"):
        dense.from_meta("auto", names, "m/meta.json")
    x = np.array([[3.0, np.nan, 0.0], [np.nan, 5.5, np.nan], [-1.0, -0.5, np.e - 1]])
    want = np.array([[np.log1p(3.0), 0.0, -2.0], [0.0, 2.0, 0.0], [0.0, -1.0, 0.0]], np.float32)
    assert np.array_equal(dense.apply(x, cols), want)


def test_like_reuses_the_numbers(tabular, tmp_path):
    meta, _, _, root = tabular
    new = write_csv(tmp_path / "c.csv", rows(500, 3))
    lm = preprocess_like([new, root / "b.csv"], tmp_path / "new", like=meta.path, fmt="csv",
                         schema_path=root / "schema.json")
    assert lm.preprocessing["dense_transform"] == meta.preprocessing["dense_transform"]
    assert np.array_equal(np.load(lm.path / "part-00001" / "dense.npy"),
                          np.load(meta.path / "part-00001" / "dense.npy"))
    schema = write_schema(tmp_path / "fixed.json", dense_transform="log1p")
    with pytest.raises(ConfigError, match="was made with"):
        preprocess_like([new], tmp_path / "new2", like=meta.path, fmt="csv", schema_path=schema)


def test_stream_logs_unless_the_schema_gives_numbers(tmp_path):
    meta = stream_meta(tmp_path, "modulo", "100", schema_file=write_schema(tmp_path / "s.json"))
    assert meta.preprocessing["dense_transform"] == "log1p"
    numbers = {"transform": "standardize", "mean": 1.0, "std": 3.0}
    meta = stream_meta(tmp_path, "modulo", "100",
                       schema_file=write_schema(tmp_path / "s.json", dense_transform={"temp": numbers}))
    assert meta.preprocessing["dense_transform"] == {"visits": "log1p", "temp": numbers}
    with pytest.raises(DataError, match="standardize needs its numbers"):
        stream_meta(tmp_path, "modulo", "100",
                    schema_file=write_schema(tmp_path / "s.json", dense_transform={"temp": "standardize"}))


def _probabilities(path: Path) -> np.ndarray:
    with open(path) as f:
        return np.array([float(r["probability"]) for r in csv.DictReader(f)])


@pytest.mark.slow
def test_predict_export_and_score_py_transform_as_training(tabular, tmp_path):
    """A run on the standardized dataset: the dense inputs predict, the JSON rows and the
    export's score.py make of raw rows are the training shards' (bit for bit where the same
    rows were preprocessed), so their probabilities agree."""
    from hybridrec.data.chunk import ParseReport
    from hybridrec.serve.inputs import read_file
    from hybridrec.serve.json_rows import json_chunk

    def load_spec(art: Path) -> dict:
        return json.loads((art / "preprocess" / "spec.json").read_text())

    meta, _, held, root = tabular
    run, art = tmp_path / "run", tmp_path / "art"
    assert main(["train", "--recipe", "demo", f"data.path={meta.path}", f"train.run_dir={run}",
                 "data.batch_size=64", "train.progress=false", "train.max_steps=30",
                 "model.embedding_dim=8", "model.bottom_mlp=16,8", "model.top_mlp=16,1"]) == 0
    assert main(["export", str(run), "--out", str(art)]) == 0
    assert load_spec(art)["dense_transform"] == meta.preprocessing["dense_transform"]
    # hybridrec predict's reading: the held-out shard's values, from the raw file.
    m = DatasetMeta.load(meta.path)
    chunks = [c for c, *_ in read_file(root / "b.csv", m, on_bad_line="error", report=ParseReport())]
    got = np.concatenate([c.dense for c in chunks])
    assert np.array_equal(got, np.load(meta.path / "part-00001" / "dense.npy"))
    # The JSON rows of a request: the same values.
    cols = {"visits": [int(r[1]) if r[1] else None for r in held],
            "temp": [float(r[2]) if r[2] else None for r in held], "city": [r[3] for r in held]}
    assert np.array_equal(json_chunk(cols, len(held), m).dense, got)
    # score.py (its own reading and transform) and hybridrec predict: the same probabilities.
    assert main(["predict", str(run), str(root / "b.csv"), "--out", str(tmp_path / "p.csv")]) == 0
    r = subprocess.run([sys.executable, str(art / "score.py"), str(root / "b.csv"), str(tmp_path / "s.csv")],
                       capture_output=True, text=True, timeout=300, check=False)
    assert r.returncode == 0, r.stderr
    p, s = _probabilities(tmp_path / "p.csv"), _probabilities(tmp_path / "s.csv")
    assert p.shape == (len(held),) and np.abs(p - s).max() <= 1e-6
    st = importlib.util.spec_from_file_location("score_copy", art / "score.py")
    mod = importlib.util.module_from_spec(st)
    st.loader.exec_module(mod)
    raw = np.stack([np.array([float(r[j]) if r[j] else np.nan for r in held]) for j in (1, 2)], 1)
    assert np.array_equal(mod.transform(raw, load_spec(art)["dense_transform"], ["visits", "temp"]), got)
