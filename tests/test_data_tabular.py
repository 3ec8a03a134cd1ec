"""CSV and Parquet inputs with a declared schema."""

from __future__ import annotations

import hashlib
import json
import sys

import numpy as np
import pytest

from hybridrec.data.chunk import MISSING, ParseReport
from hybridrec.data.preprocess import preprocess_tabular
from hybridrec.data.tabular import CsvReader, ParquetReader, TabularSpec, hash_strings
from hybridrec.errors import DataError

SPEC = {
    "label": "click",
    "dense": ["price"],
    "categorical": ["city", "shop"],
    "multihot": ["tags"],
    "table_size": 1000,
}
CSV = """click,price,city,shop,tags,unused
1,3,paris,7,a|b,x
0,,berlin,,,y
1,-2,paris,9,c,z
"""


def spec_file(tmp_path, **changes) -> str:
    path = tmp_path / "schema.json"
    path.write_text(json.dumps({**SPEC, **changes}))
    return str(path)


def read(reader, path):
    return [c for c, _ in reader.read(path, ParseReport())]


def test_csv_values(tmp_path):
    (tmp_path / "a.csv").write_text(CSV)
    spec = TabularSpec.load(spec_file(tmp_path))
    (chunk,) = read(CsvReader(spec=spec), tmp_path / "a.csv")
    assert chunk.labels.tolist() == [1, 0, 1]
    np.testing.assert_allclose(chunk.dense[:, 0], np.log1p([3.0, 0.0, 0.0]).astype(np.float32))
    city = chunk.onehot[:, 0]
    assert city[0] == city[2] != city[1]
    assert city[0] == hash_strings(np.array(["paris"]))[0]  # stable, not Python's salted hash
    assert chunk.onehot[1, 1] == MISSING
    keys, lengths = chunk.multihot["tags"]
    assert lengths.tolist() == [2, 0, 1]
    assert keys.tolist() == hash_strings(np.array(["a", "b", "c"])).tolist()


def test_hash_is_deterministic_and_63_bit():
    words = ["paris", "berlin", ""]
    h = hash_strings(np.array(words))
    # The same key in every process and on every machine (Python's hash() is salted per
    # process): BLAKE2b of the UTF-8 text, 8 bytes, little-endian, shifted right to 63 bits.
    assert h.tolist() == [int.from_bytes(hashlib.blake2b(w.encode(), digest_size=8).digest(), "little") >> 1
                          for w in words]
    assert (h >= 0).all() and len(set(h.tolist())) == 3


def test_schema_naming_missing_column(tmp_path):
    (tmp_path / "a.csv").write_text(CSV)
    spec = TabularSpec.load(spec_file(tmp_path, dense=["price", "age"]))
    with pytest.raises(DataError, match=r"a.csv: column 'age' named in .*schema.json is not in"):
        read(CsvReader(spec=spec), tmp_path / "a.csv")


def test_csv_bad_values_name_line_and_field(tmp_path):
    (tmp_path / "a.csv").write_text(CSV + "1,abc,rome,1,d,w\n2,1,rome,1,d,w\n1,2\n")
    spec = TabularSpec.load(spec_file(tmp_path))
    with pytest.raises(
        DataError, match=r"a.csv:5: field price \(column 2\): not a finite number: 'abc'"
    ):
        read(CsvReader(spec=spec), tmp_path / "a.csv")
    report = ParseReport()
    chunks = [
        c for c, _ in CsvReader(spec=spec, on_bad_line="skip").read(tmp_path / "a.csv", report)
    ]
    assert sum(len(c) for c in chunks) == 3 and report.bad_lines_skipped == 3
    ex = report.bad_line_examples
    assert any(
        e.endswith("a.csv:6: field click (column 1): label must be 0 or 1, got '2'") for e in ex
    )
    assert any(e.endswith("a.csv:7: expected 6 fields, got 2") for e in ex)


def test_unknown_schema_key_and_missing_label(tmp_path):
    path = tmp_path / "s.json"
    path.write_text(json.dumps({"label": "y", "dense_cols": []}))
    with pytest.raises(DataError, match="unknown schema keys \\['dense_cols'\\]"):
        TabularSpec.load(path)
    path.write_text(json.dumps({"dense": []}))
    with pytest.raises(DataError, match="must name the 'label'"):
        TabularSpec.load(path)


def _write_parquet(path, **cols):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    pq.write_table(pa.table(cols), path)


def test_parquet_values_and_list_columns(tmp_path):
    _write_parquet(
        tmp_path / "a.parquet",
        click=[1, 0, 1],
        price=[3.0, None, -2.0],
        city=["paris", None, "paris"],
        shop=[7, 8, None],
        tags=[["a", "b"], None, ["c", None]],
    )
    spec = TabularSpec.load(spec_file(tmp_path))
    (chunk,) = read(ParquetReader(spec=spec), tmp_path / "a.parquet")
    assert chunk.labels.tolist() == [1, 0, 1]
    np.testing.assert_allclose(chunk.dense[:, 0], np.log1p([3.0, 0.0, 0.0]).astype(np.float32))
    assert chunk.onehot[:, 0].tolist()[1] == MISSING and chunk.onehot[0, 0] == chunk.onehot[2, 0]
    assert chunk.onehot[:, 1].tolist() == [7, 8, MISSING]  # integer ids kept as they are
    keys, lengths = chunk.multihot["tags"]
    assert lengths.tolist() == [2, 0, 1]  # null list -> empty, null element dropped
    assert keys.tolist() == hash_strings(np.array(["a", "b", "c"])).tolist()


def test_parquet_missing_column_and_bad_label(tmp_path):
    _write_parquet(
        tmp_path / "a.parquet", click=[1, 3], price=[1.0, 2.0], city=["a", "b"], tags=[[1], [2]]
    )
    spec = TabularSpec.load(spec_file(tmp_path))
    with pytest.raises(DataError, match=r"a.parquet: column 'shop' named in"):
        read(ParquetReader(spec=spec), tmp_path / "a.parquet")
    spec = TabularSpec.load(spec_file(tmp_path, categorical=["city"]))
    with pytest.raises(DataError, match=r"a.parquet: row 2: field click \(column 1\): label must"):
        read(ParquetReader(spec=spec), tmp_path / "a.parquet")


def test_preprocess_tabular_csv_end_to_end(tmp_path):
    for i in range(2):
        (tmp_path / f"d{i}.csv").write_text(CSV)
    meta = preprocess_tabular(
        [tmp_path / "d0.csv", tmp_path / "d1.csv"],
        tmp_path / "ds",
        schema_path=spec_file(tmp_path),
        fmt="csv",
    )
    assert meta.feature_names == ["city", "shop", "tags"]
    assert meta.num_embeddings == {"city": 1000, "shop": 1000, "tags": 1000}
    assert [f.kind for f in meta.schema.features] == ["onehot", "onehot", "multihot"]
    offsets = np.load(tmp_path / "ds/part-00000/mh-tags.offsets.npy")
    assert offsets.tolist() == [0, 2, 2, 3]
    values = np.load(tmp_path / "ds/part-00000/mh-tags.values.npy")
    assert values.tolist() == (hash_strings(np.array(["a", "b", "c"])) % 1000).tolist()


def test_parquet_without_pyarrow_says_how_to_install(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "pyarrow", None)  # makes `import pyarrow` fail
    spec = TabularSpec.load(spec_file(tmp_path))
    with pytest.raises(DataError, match="pip install pyarrow"):
        read(ParquetReader(spec=spec), tmp_path / "a.parquet")
