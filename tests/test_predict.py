"""`hybridrec predict`: a run's probabilities for raw files, the ids and dense values made
exactly as preprocessing made them, so the raw held-out file scores what `hybridrec eval`
scores."""

from __future__ import annotations

import gzip
import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch

from hybridrec.cli.main import main
from hybridrec.data.chunk import ParseReport
from hybridrec.data.criteo import FIELDS
from hybridrec.data.loader import ShardedLoader
from hybridrec.data.preprocess import encode_chunk, load_encoders
from hybridrec.data.schema import DatasetMeta
from hybridrec.metrics.classification import auc
from hybridrec.serve.inputs import read_file, table_chunks
from hybridrec.train.run import load_run_model

pa = pytest.importorskip("pyarrow")
import pyarrow.parquet as pq


@pytest.fixture(scope="module")
def trained(shared_dataset, trained_run):
    """A tiny Criteo-format dataset (3 days, the last held out) and a run trained on it
    (the one test_outputs_atomic.py reads; shared: read-only)."""
    data = shared_dataset(days=3, rows=600)
    return data, trained_run(data, 12, "data.eval_batch_size=256", export=True)


def held_out_file(data: Path) -> Path:
    """The raw file of the dataset's held-out split (preprocess: one part per input file)."""
    meta = DatasetMeta.load(data)
    (name,) = meta.splits["eval"]
    return Path(meta.part(name).source)


def test_the_raw_held_out_file_scores_what_eval_scores(trained, tmp_path, capsys):
    data, run = trained
    assert main(["eval", str(run), "--out", str(tmp_path / "eval.json")]) == 0
    evaluated = json.loads((tmp_path / "eval.json").read_text())
    out = tmp_path / "scores.parquet"
    assert main(["predict", str(run), str(held_out_file(data)), "--out", str(out),
                 "--keep-columns", "label", "--batch-size", "100"]) == 0
    assert f"wrote 600 predictions to {out}" in capsys.readouterr().out
    table = pq.read_table(out)
    assert table.column_names == ["label", "probability"]
    assert table.schema.field("probability").type == pa.float32()
    labels = table.column("label").to_numpy().astype(np.float64)
    probs = table.column("probability").to_numpy()
    assert len(probs) == evaluated["count"] == 600
    assert abs(auc(labels, probs.astype(np.float64)) - evaluated["auc"]) <= 1e-6
    # Row by row: the model on the preprocessed held-out part, as evaluation runs it.
    _, meta, model, *_ = load_run_model(run)
    loader = ShardedLoader(meta, split="eval", batch_size=600, shuffle=False, drop_last=False)
    (batch,) = list(loader)
    model.eval()
    with torch.no_grad():
        expected = torch.sigmoid(model(batch).float()).numpy()
    np.testing.assert_array_equal(labels, batch.labels.numpy())
    np.testing.assert_allclose(probs, expected, rtol=0, atol=1e-6)
    assert not list(tmp_path.glob("*.tmp-*"))


def test_a_file_without_labels_gzipped_to_csv(trained, tmp_path):
    """Criteo's test files have no label: 39 fields. The same rows, the same numbers."""
    data, run = trained
    lines = held_out_file(data).read_bytes().splitlines(keepends=True)
    unlabelled = tmp_path / "test.txt.gz"
    unlabelled.write_bytes(gzip.compress(b"".join(line.split(b"\t", 1)[1] for line in lines)))
    labelled_out, csv_out = tmp_path / "a.parquet", tmp_path / "b.csv"
    assert main(["predict", str(run), str(held_out_file(data)), "--out", str(labelled_out)]) == 0
    assert main(["predict", str(run), str(unlabelled), "--out", str(csv_out)]) == 0
    text = csv_out.read_text().splitlines()
    assert text[0] == "probability" and len(text) == 601
    from_csv = np.array([float(t) for t in text[1:]], dtype=np.float32)
    np.testing.assert_array_equal(from_csv, pq.read_table(labelled_out).column("probability").to_numpy())
    assert main(["predict", str(run), str(unlabelled), "--out", str(tmp_path / "c.csv"),
                 "--keep-columns", "label"]) == 2  # a file without labels has none to keep
    assert not (tmp_path / "c.csv").exists()


def _ids_of(path: Path, meta: DatasetMeta, **options):
    """Raw rows through prediction's readers and the dataset's encoders, concatenated."""
    return _ids(read_file(path, meta, on_bad_line="error", report=ParseReport(), **options), meta)


def _ids(chunks, meta: DatasetMeta):
    encoders = load_encoders(meta)
    parts = [(chunk.dense, *encode_chunk(chunk, meta.schema, encoders), kept)
             for chunk, kept, _, _ in chunks]
    dense = np.concatenate([p[0] for p in parts])
    onehot = np.concatenate([p[1] for p in parts])
    mh = {n: (np.concatenate([p[2][n][0] for p in parts]), np.concatenate([p[2][n][1] for p in parts]))
          for n in parts[0][2]}
    return dense, onehot, mh, [p[3] for p in parts]


def _assert_as_preprocessed(part: Path, dense, onehot, mh) -> None:
    np.testing.assert_array_equal(dense, np.load(part / "dense.npy"))
    np.testing.assert_array_equal(onehot, np.load(part / "onehot.npy"))
    for name, (ids, lengths) in mh.items():
        np.testing.assert_array_equal(ids, np.load(part / f"mh-{name}.values.npy"))
        np.testing.assert_array_equal(np.cumsum(lengths), np.load(part / f"mh-{name}.offsets.npy")[1:])


@pytest.mark.parametrize("options", [["--table-size", "97", "--multi-hot-fields", "C1,C2"],
                                     ["--min-count", "2"]], ids=["modulo-multihot", "vocabulary"])
def test_criteo_ids_are_those_preprocessing_wrote(shared_dataset, options):
    multi = ("--multi-hot", "2", "--multi-hot-fields", "C1,C2") if "--table-size" in options else ()
    ds = shared_dataset(days=2, rows=300, synth=multi, preprocess=tuple(options))
    days = sorted(str(p) for p in (ds.parent / "raw").glob("day_*"))
    meta = DatasetMeta.load(ds)
    dense, onehot, mh, _ = _ids_of(Path(days[1]), meta)
    if "--min-count" in options:  # keys the training day saw fewer than twice -> 0
        assert 0 < (onehot == 0).mean() < 1
    else:
        assert set(mh) == {"C1", "C2"} and onehot.shape[1] == 24
    _assert_as_preprocessed(ds / "part-00001", dense, onehot, mh)
    # The same rows in memory (the Python API's path): counts as ints, bags as lists of ids.
    rows = [line.split("\t") for line in Path(days[1]).read_text().splitlines()]
    cols = {name: [(r[j].split(",") if name in mh else r[j]) or None for r in rows]
            for j, name in enumerate(FIELDS) if j}
    cols.update({f"I{j}": [int(v) if v is not None else None for v in cols[f"I{j}"]] for j in range(1, 14)})
    dense, onehot, mh, _ = _ids(table_chunks(cols, meta, ParseReport()), meta)
    _assert_as_preprocessed(ds / "part-00001", dense, onehot, mh)


def _tabular_rows(rng, n: int) -> dict:
    cities = np.array([f"city{i}" for i in range(30)])
    return {
        "click": rng.integers(0, 2, n).tolist(),
        "price": [None if rng.random() < 0.2 else float(rng.integers(-3, 500)) for _ in range(n)],
        "city": [None if rng.random() < 0.1 else str(cities[rng.integers(0, 30)]) for _ in range(n)],
        "shop": rng.integers(0, 300, n).tolist(),
        "tags": [[f"t{t}" for t in rng.integers(0, 40, rng.integers(0, 4))] for _ in range(n)],
        "row_id": [f"r{i}" for i in range(n)],
    }


def _write(path: Path, cols: dict, fmt: str) -> None:
    if fmt == "parquet":
        pq.write_table(pa.table(cols), path)
        return
    cell = {type(None): lambda v: "", list: lambda v: "|".join(v), float: lambda v: str(int(v))}
    names = list(cols)
    rows = zip(*[[cell.get(type(v), str)(v) for v in cols[n]] for n in names])
    path.write_text("\n".join([",".join(names), *(",".join(r) for r in rows)]) + "\n")


@pytest.mark.parametrize("fmt", ["csv", "parquet"])
def test_tabular_ids_are_those_preprocessing_wrote(tmp_path, fmt):
    """A CSV / Parquet dataset (vocabulary of keys seen twice); the file to predict has no
    label column, its columns in another order, and a column to keep."""
    rng = np.random.default_rng(0)
    train, test = _tabular_rows(rng, 400), _tabular_rows(rng, 300)
    suffix = ".csv" if fmt == "csv" else ".parquet"
    _write(tmp_path / f"d0{suffix}", train, fmt)
    _write(tmp_path / f"d1{suffix}", test, fmt)
    (tmp_path / "schema.json").write_text(json.dumps(
        {"label": "click", "dense": ["price"], "categorical": ["city", "shop"], "multihot": ["tags"],
         "min_count": 2}))
    assert main(["data", "preprocess", str(tmp_path / f"d0{suffix}"), str(tmp_path / f"d1{suffix}"),
                 "--format", fmt, "--schema", str(tmp_path / "schema.json"), "--out", str(tmp_path / "ds")]) == 0
    meta = DatasetMeta.load(tmp_path / "ds")
    shuffled = {n: test[n] for n in ["row_id", "tags", "shop", "city", "price"]}  # no click
    _write(tmp_path / f"new{suffix}", shuffled, fmt)
    dense, onehot, mh, kept = _ids_of(tmp_path / f"new{suffix}", meta, keep=["row_id"])
    assert 0 < (onehot[:, 1] == 0).mean() < 1  # shops seen once in training -> 0
    _assert_as_preprocessed(tmp_path / "ds" / "part-00001", dense, onehot, mh)
    ids = [v for k in kept for v in (k["row_id"].to_pylist() if fmt == "parquet" else k["row_id"])]
    assert ids == test["row_id"]
    dense, onehot, mh, _ = _ids(table_chunks(shuffled, meta, ParseReport()), meta)  # in memory
    _assert_as_preprocessed(tmp_path / "ds" / "part-00001", dense, onehot, mh)


def _corrupt(src: Path, dst: Path, line_no: int) -> None:
    lines = src.read_text().splitlines(keepends=True)
    fields = lines[line_no - 1].split("\t")
    fields[16] = "zz"  # C3
    lines[line_no - 1] = "\t".join(fields)
    dst.write_text("".join(lines))


def test_bad_lines_as_preprocess_reports_them(trained, tmp_path, capsys):
    data, run = trained
    bad = tmp_path / "bad.tsv"
    _corrupt(held_out_file(data), bad, 5)
    capsys.readouterr()
    assert main(["data", "preprocess", str(bad), "--out", str(tmp_path / "ds")]) == 2
    preprocess_error = capsys.readouterr().err.strip().splitlines()[-1]
    assert main(["predict", str(run), str(bad), "--out", str(tmp_path / "p.parquet")]) == 2
    predict_error = capsys.readouterr().err.strip().splitlines()[-1]
    assert predict_error == preprocess_error
    assert predict_error.startswith(f"hybridrec: error: {bad}:5: field C3 (column 17): ")
    assert not list(tmp_path.glob("p.parquet*"))  # no output, no tmp file left
    assert main(["predict", str(run), str(bad), "--out", str(tmp_path / "p.parquet"),
                 "--on-bad-line", "skip", "--keep-columns", "label"]) == 0
    out = capsys.readouterr().out
    assert "wrote 599 predictions" in out and "bad lines skipped: 1" in out
    assert f"  skipped: {bad}:5: field C3 (column 17)" in out
    assert pq.read_table(tmp_path / "p.parquet").num_rows == 599


def test_refusals_are_one_line(trained, tmp_path, capsys):
    data, run = trained
    raw = str(held_out_file(data))
    cases = [
        (["--out", str(tmp_path / "p.txt")], "name a .parquet or .csv file"),
        (["--out", str(tmp_path / "p.csv"), "--keep-columns", "I1"], "only the label can be kept"),
        (["--out", str(tmp_path / "p.csv"), "--checkpoint", "best"], "no best checkpoint recorded"),
        (["--out", str(tmp_path / "p.csv"), "--batch-size", "0"], "batch size must be >= 1"),
    ]
    for extra, message in cases:
        assert main(["predict", str(run), raw, *extra]) == 2, extra
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and message in err[0], err
    assert not list(tmp_path.iterdir())


def test_latest_and_a_named_checkpoint_directory(trained, tmp_path):
    data, run = trained
    raw = str(held_out_file(data))
    (step,) = sorted((run / "checkpoints").glob("step-*"))
    for which in ("latest", str(step)):
        out = tmp_path / f"{os.path.basename(which)}.parquet"
        assert main(["predict", str(run), raw, "--out", str(out), "--checkpoint", which]) == 0
        assert pq.read_table(out).num_rows == 600
