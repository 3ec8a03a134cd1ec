"""Schema labels that are not 0/1: classes (``label_positive`` / ``label_negative``) and a
numeric threshold (``label_threshold``), through CSV and Parquet, with every value that
maps to neither an error naming the file, the row and the value."""

from __future__ import annotations

import json

import numpy as np
import pytest

from hybridrec.cli.main import main
from hybridrec.data.chunk import ParseReport
from hybridrec.data.preprocess import preprocess_tabular
from hybridrec.data.schema import DatasetMeta
from hybridrec.data.tabular import CsvReader, ParquetReader, TabularSpec
from hybridrec.errors import DataError

CLASSES = {"label_positive": [">50K", ">50K."], "label_negative": ["<=50K", "<=50K."]}


def schema(tmp_path, **label_map) -> str:
    path = tmp_path / "schema.json"
    path.write_text(json.dumps({"label": "y", "dense": ["age"], "categorical": ["job"],
                                "table_size": 50, **label_map}))
    return str(path)


def csv_file(tmp_path, labels, name="a.csv"):
    path = tmp_path / name
    path.write_text("age,job,y\n" + "".join(f"{20 + i},j{i % 3},{v}\n" for i, v in enumerate(labels)))
    return path


def parquet_file(tmp_path, labels, name="a.parquet"):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    path = tmp_path / name
    pq.write_table(pa.table({"age": list(range(len(labels))), "job": ["a"] * len(labels), "y": labels}), path)
    return path


def labels_of(reader, path) -> list[int]:
    return [v for c, _ in reader.read(path, ParseReport()) for v in c.labels.tolist()]


# -- classes ------------------------------------------------------------------------------
def test_string_classes_map_to_0_1_in_csv_and_parquet(tmp_path):
    spec = TabularSpec.load(schema(tmp_path, **CLASSES))
    csv = csv_file(tmp_path, [">50K", " <=50K", ">50K. ", "<=50K."])  # surrounding spaces ignored
    assert labels_of(CsvReader(spec=spec), csv) == [1, 0, 1, 0]
    pq = parquet_file(tmp_path, [">50K", "<=50K", " >50K."])
    assert labels_of(ParquetReader(spec=spec), pq) == [1, 0, 1]
    assert spec.label_map == {"positive": [">50K", ">50K."], "negative": ["<=50K", "<=50K."]}


def test_numbers_listed_as_classes_match_a_numeric_parquet_column(tmp_path):
    spec = TabularSpec.load(schema(tmp_path, label_positive=[4, 5], label_negative=[1, 2, 3]))
    assert labels_of(ParquetReader(spec=spec), parquet_file(tmp_path, [5, 1, 4, 3])) == [1, 0, 1, 0]
    assert labels_of(ParquetReader(spec=spec), parquet_file(tmp_path, [5.0, 2.0], "f.parquet")) == [1, 0]
    assert labels_of(CsvReader(spec=spec), csv_file(tmp_path, ["5", "2"])) == [1, 0]


@pytest.mark.parametrize("labels, fmt, where, why", [
    ([">50K", "50K"], "csv", "a.csv:3: field y (column 3)",
     ("label '50K' is neither a positive class (label_positive: >50K, >50K.) nor a negative one "
      "(label_negative: <=50K, <=50K.)")),
    ([">50K", ""], "csv", "a.csv:3: field y (column 3)",
     "missing label (label_positive/label_negative need one of their values)"),
    (["<=50K", ">50K", "unknown"], "parquet", "a.parquet: row 3: field y (column 3)",
     "label 'unknown' is neither a positive class"),
    ([">50K", None], "parquet", "a.parquet: row 2: field y (column 3)", "missing label"),
])
def test_a_value_in_no_class_names_file_row_and_value(tmp_path, labels, fmt, where, why):
    _expect_error(tmp_path, TabularSpec.load(schema(tmp_path, **CLASSES)), labels, fmt, f"{where}: {why}")


def _expect_error(tmp_path, spec, labels, fmt, message):
    path, reader = ((csv_file(tmp_path, labels), CsvReader(spec=spec)) if fmt == "csv"
                    else (parquet_file(tmp_path, labels), ParquetReader(spec=spec)))
    with pytest.raises(DataError) as e:
        labels_of(reader, path)
    assert str(e.value).startswith(f"{tmp_path}/{message}"), str(e.value)


# -- threshold ----------------------------------------------------------------------------
def test_a_threshold_maps_numbers(tmp_path):
    spec = TabularSpec.load(schema(tmp_path, label_threshold=4))
    assert labels_of(CsvReader(spec=spec), csv_file(tmp_path, ["5", "3.5", "4", " 4.0", "-1"])) == [1, 0, 1, 1, 0]
    assert labels_of(ParquetReader(spec=spec), parquet_file(tmp_path, [4.5, 3.99, 4.0])) == [1, 0, 1]
    assert labels_of(ParquetReader(spec=spec), parquet_file(tmp_path, ["4", "1"], "s.parquet")) == [1, 0]
    assert spec.label_map == {"threshold": 4}


@pytest.mark.parametrize("labels, fmt, where, why", [
    (["5", "good"], "csv", "a.csv:3: field y (column 3)",
     "label 'good' is not a finite number (label_threshold=4)"),
    (["5", ""], "csv", "a.csv:3: field y (column 3)", "missing label (label_threshold=4 needs a number)"),
    (["nan", "5"], "csv", "a.csv:2: field y (column 3)", "label 'nan' is not a finite number"),
    ([5.0, float("nan")], "parquet", "a.parquet: row 2: field y (column 3)", "label nan is not a finite number"),
    ([5.0, None], "parquet", "a.parquet: row 2: field y (column 3)",
     "missing label (null; label_threshold=4 needs a number)"),
    (["5", "x"], "parquet", "a.parquet: row 2: field y (column 3)", "label 'x' is not a finite number"),
])
def test_a_value_that_is_no_number_names_file_row_and_value(tmp_path, labels, fmt, where, why):
    _expect_error(tmp_path, TabularSpec.load(schema(tmp_path, label_threshold=4)), labels, fmt, f"{where}: {why}")


def test_bad_rows_can_be_skipped_and_counted(tmp_path):
    spec = TabularSpec.load(schema(tmp_path, **CLASSES))
    report = ParseReport()
    path = csv_file(tmp_path, [">50K", "maybe", "<=50K"])
    chunks = [c for c, _ in CsvReader(spec=spec, on_bad_line="skip").read(path, report)]
    assert [v for c in chunks for v in c.labels.tolist()] == [1, 0]
    assert report.bad_lines_skipped == 1 and "label 'maybe'" in report.bad_line_examples[0]


# -- the schema file ----------------------------------------------------------------------
@pytest.mark.parametrize("label_map, message", [
    ({"label_positive": ">50K"}, "label_positive needs label_negative as well"),
    ({"label_negative": "<=50K"}, "label_negative needs label_positive as well"),
    ({"label_positive": ["a", "b"], "label_negative": ["b"]}, "'b' is in both label_positive and label_negative"),
    ({"label_positive": [], "label_negative": ["b"]}, "label_positive is an empty list"),
    ({"label_positive": [None], "label_negative": ["b"]},
     "label_positive must be a non-empty string or a number, or a list of them; got None"),
    ({"label_threshold": "4"}, "label_threshold must be a finite number, got '4'"),
    ({"label_threshold": 4, "label_positive": "a", "label_negative": "b"},
     "label_threshold and label_positive/label_negative are two ways to map the label; give one"),
])
def test_schema_mistakes_name_the_schema_file(tmp_path, label_map, message):
    path = schema(tmp_path, **label_map)
    with pytest.raises(DataError) as e:
        TabularSpec.load(path)
    assert str(e.value).startswith(f"{path}: {message}"), str(e.value)


# -- end to end -----------------------------------------------------------------------------
def test_preprocess_records_the_mapping_and_a_model_trains_on_it(tmp_path, capsys):
    rng = np.random.default_rng(0)
    for name, rows in (("train.csv", 600), ("eval.csv", 200)):
        age = rng.integers(18, 80, rows)
        y = np.where(age + rng.normal(0, 10, rows) > 45, ">50K", "<=50K")
        (tmp_path / name).write_text("age,job,y\n" + "".join(
            f"{a},j{rng.integers(0, 5)},{v}\n" for a, v in zip(age, y)))
    data = tmp_path / "data"
    assert main(["data", "preprocess", str(tmp_path / "train.csv"), str(tmp_path / "eval.csv"),
                 "--format", "csv", "--schema", schema(tmp_path, **CLASSES), "--out", str(data)]) == 0
    meta = DatasetMeta.load(data)
    assert meta.preprocessing["label_map"] == {"positive": [">50K", ">50K."], "negative": ["<=50K", "<=50K."]}
    labels = np.load(data / "part-00000" / "labels.npy")
    assert labels.dtype == np.uint8 and set(labels.tolist()) == {0, 1}
    capsys.readouterr()
    assert main(["data", "inspect", str(data)]) == 0
    assert "label: y (>50K, >50K. is 1; <=50K, <=50K. is 0)" in capsys.readouterr().out
    run = tmp_path / "run"
    assert main(["train", "--recipe", "demo", f"data.path={data}", f"train.run_dir={run}", "model.embedding_dim=8",
                 "model.bottom_mlp=16,8", "model.top_mlp=16,1", "data.batch_size=64", "train.progress=false",
                 "train.max_steps=5"]) == 0
    assert json.loads((run / "summary.json").read_text())["eval"]["count"] == 200


def test_preprocess_without_a_mapping_records_none(tmp_path):
    (tmp_path / "a.csv").write_text("age,job,y\n30,a,1\n40,b,0\n")
    meta = preprocess_tabular([tmp_path / "a.csv"], tmp_path / "d", schema_path=schema(tmp_path), eval_parts=[])
    assert meta.preprocessing["label_map"] is None
