"""``hybridrec data preprocess NEW --like DATASET [--grow]``: new days with a dataset's ids."""

from __future__ import annotations

import json

import numpy as np
import pytest

from hybridrec.cli.main import main
from hybridrec.data.like import preprocess_like
from hybridrec.data.preprocess import preprocess_criteo, preprocess_tabular
from hybridrec.data.schema import DatasetMeta
from hybridrec.errors import ConfigError


def line(label, c1, dense0="1") -> str:
    """A Criteo line: C1 varies, C2..C26 constant (``""``: C1 missing)."""
    return "\t".join([str(label), dense0, *["2"] * 12, c1, "0000000a", *["0000000b"] * 24])


def write_day(path, c1s, dense0="1"):
    path.write_text("".join(line(i % 2, c, dense0) + "\n" for i, c in enumerate(c1s)))
    return path


@pytest.fixture
def base(tmp_path):
    """A dataset of two days whose vocabulary (min_count 2) holds C1 keys 0xa and 0xb."""
    d0 = write_day(tmp_path / "day_0.tsv", ["a", "a", "b", "b", "c"])
    d1 = write_day(tmp_path / "day_1.tsv", ["a", "b", "c", "e"], dense0="7")
    meta = preprocess_criteo([d0, d1], tmp_path / "base", min_count=2)
    assert np.load(tmp_path / "base/vocab/C1.keys.npy").tolist() == [0xA, 0xB]
    return meta


def onehot(ds, part="part-00000"):
    return np.load(ds / part / "onehot.npy")


def test_like_encodes_with_the_dataset_ids_and_transform(base, tmp_path):
    # day_1 was base's eval part: made again --like base, its arrays are base's bit for bit.
    with pytest.warns(Warning, match="the only input"):
        new = preprocess_like([tmp_path / "day_1.tsv"], tmp_path / "again", like=base.path)
    assert new.schema.to_dict() == base.schema.to_dict()
    for name in ("onehot.npy", "dense.npy", "labels.npy"):
        assert np.array_equal(np.load(tmp_path / "again/part-00000" / name),
                              np.load(tmp_path / "base/part-00001" / name)), name
    pp = new.preprocessing
    assert (pp["categorical"], pp["min_count"], pp["dense_transform"]) == ("vocabulary", 2, "log1p")
    assert pp["like"] == str(base.path.resolve())
    assert np.load(tmp_path / "again/vocab/C1.keys.npy").tolist() == [0xA, 0xB]


def test_unseen_keys_map_to_zero_and_are_counted(base, tmp_path):
    day = write_day(tmp_path / "day_2.tsv", ["a", "d", "d", "d", "", "b"])
    new = preprocess_like([day], tmp_path / "new", like=base.path, eval_parts=[])
    assert onehot(tmp_path / "new")[:, 0].tolist() == [1, 0, 0, 0, 0, 2]
    assert new.num_embeddings == base.num_embeddings  # no row added
    # 5 present C1 values, 3 of them (d) unknown to the vocabulary; the missing one is not counted.
    assert new.preprocessing["ids_unseen"]["C1"] == pytest.approx(3 / 5)
    assert new.preprocessing["ids_unseen"]["C2"] == 0.0
    assert "grown_rows" not in new.preprocessing


def test_grow_appends_rows_for_new_frequent_keys_only(base, tmp_path):
    day = write_day(tmp_path / "day_2.tsv", ["a", "d", "d", "9", "9", "9", "f", ""])
    new = preprocess_like([day], tmp_path / "grown", like=base.path, grow=True, eval_parts=[])
    # 0x9 and 0xd seen >= 2 times: rows 3 and 4 (appended in key order); 0xf once: id 0.
    assert np.load(tmp_path / "grown/vocab/C1.keys.npy").tolist() == [0xA, 0xB, 0x9, 0xD]
    assert onehot(tmp_path / "grown")[:, 0].tolist() == [1, 4, 4, 3, 3, 3, 0, 0]
    assert new.num_embeddings["C1"] == base.num_embeddings["C1"] + 2
    assert new.num_embeddings["C2"] == base.num_embeddings["C2"]
    assert new.preprocessing["grown_rows"]["C1"] == 2 and new.preprocessing["grown_rows"]["C2"] == 0
    # The next day --like the grown dataset: the grown (unsorted) vocabulary keeps its ids.
    day3 = write_day(tmp_path / "day_3.tsv", ["d", "9", "a", "b", "f"])
    preprocess_like([day3], tmp_path / "next", like=tmp_path / "grown", eval_parts=[])
    assert onehot(tmp_path / "next")[:, 0].tolist() == [4, 3, 1, 2, 0]


def test_modulo_dataset_like_and_grow_refused(tmp_path):
    d0 = write_day(tmp_path / "d0.tsv", ["a", "b", "11"])
    base = preprocess_criteo([d0], tmp_path / "mod", table_size=16, eval_parts=[])
    day = write_day(tmp_path / "d1.tsv", ["25", "3"])
    new = preprocess_like([day], tmp_path / "new", like=base.path, eval_parts=[])
    assert onehot(tmp_path / "new")[:, 0].tolist() == [0x25 % 16, 3]
    assert new.preprocessing["table_size"]["C1"] == 16 and new.preprocessing["ids_unseen"] is None
    with pytest.raises(ConfigError, match="--grow: .* modulo its table sizes"):
        preprocess_like([day], tmp_path / "g", like=base.path, grow=True)


def test_cli_like_grow_and_its_errors(base, tmp_path, capsys):
    day = write_day(tmp_path / "day_2.tsv", ["d", "d", "a"])
    assert main(["data", "preprocess", str(day), "--like", str(base.path), "--grow",
                 "--out", str(tmp_path / "cli")]) == 0
    out = capsys.readouterr().out
    assert "grew the tables by 1 rows: C1 +1" in out
    assert DatasetMeta.load(tmp_path / "cli").num_embeddings["C1"] == base.num_embeddings["C1"] + 1
    for argv, words in [(["--grow"], "--grow adds rows to the tables of a --like DATASET"),
                        (["--like", str(base.path), "--min-count", "3"], "--min-count with --like"),
                        (["--like", str(tmp_path / "nope")], "dataset directory does not exist")]:
        assert main(["data", "preprocess", str(day), "--out", str(tmp_path / "x"), *argv]) != 0
        assert words in capsys.readouterr().err


def test_tabular_like_checks_the_columns(tmp_path):
    schema = {"label": "clicked", "dense": ["price"], "categorical": ["city"], "min_count": 1}
    (tmp_path / "s.json").write_text(json.dumps(schema))
    (tmp_path / "a.csv").write_text("clicked,price,city\n1,3,paris\n0,1,rome\n1,2,paris\n")
    base = preprocess_tabular([tmp_path / "a.csv"], tmp_path / "base", schema_path=tmp_path / "s.json",
                              eval_parts=[])
    (tmp_path / "b.csv").write_text("clicked,price,city\n0,5,rome\n1,1,oslo\n0,2,paris\n")
    preprocess_like([tmp_path / "b.csv"], tmp_path / "new", like=base.path, fmt="csv",
                    schema_path=tmp_path / "s.json", eval_parts=[])
    ids_a, ids_b = onehot(tmp_path / "base")[:, 0], onehot(tmp_path / "new")[:, 0]
    assert ids_b[0] == ids_a[1] and ids_b[1] == 0 and ids_b[2] == ids_a[0]  # rome, (oslo), paris
    other = {**schema, "dense": ["price", "age"]}
    (tmp_path / "o.json").write_text(json.dumps(other))
    with pytest.raises(ConfigError, match="its columns are not those of"):
        preprocess_like([tmp_path / "b.csv"], tmp_path / "x", like=base.path, fmt="csv",
                        schema_path=tmp_path / "o.json")
    with pytest.raises(ConfigError, match="not made from Criteo files"):
        preprocess_like([tmp_path / "b.csv"], tmp_path / "y", like=base.path)
