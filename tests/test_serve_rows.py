"""`hybridrec serve`'s direct path from JSON values to a RowChunk (serve/json_rows.py) against
the text path it replaces (serve/inputs.py: table_chunks writes the values as Criteo or CSV
text, or an Arrow table, and parses them with the dataset's reader). On random rows of every
raw format, with missing values, negative and odd numbers, integer and string ids, multi-hot
bags and values of unusual types, the two chunks are bit-identical wherever the text path
accepts the rows, and both refuse the same rows (Criteo and CSV: with the same message).
Then the errors of the direct path: wrong types, non-hex keys, too many values, each one
line naming the row and field."""

from __future__ import annotations

import random
import re

import numpy as np
import pytest

from hybridrec.data.chunk import ParseReport
from hybridrec.data.criteo import CATEGORICAL, DENSE
from hybridrec.data.encode import ModuloEncoder
from hybridrec.data.preprocess import encode_chunk
from hybridrec.data.schema import DatasetMeta, FeatureSpec, PartInfo, Schema
from hybridrec.errors import DataError
from hybridrec.serve.inputs import table_chunks
from hybridrec.serve.json_rows import json_chunk

pytest.importorskip("pyarrow")


def meta_of(fmt: str, multihot: tuple[str, ...] = (), transform: str = "log1p") -> DatasetMeta:
    if fmt == "criteo":
        features = [FeatureSpec(name=c, kind="multihot" if c in multihot else "onehot", num_embeddings=1000)
                    for c in CATEGORICAL]
        schema, source = Schema(label="label", dense=list(DENSE), features=features), "day_0.tsv"
    else:
        features = [FeatureSpec(name="city", num_embeddings=1000), FeatureSpec(name="device", num_embeddings=1000),
                    FeatureSpec(name="tags", kind="multihot", num_embeddings=1000)]
        schema = Schema(label="clicked", dense=["price", "age", "score"], features=features)
        source = f"train.{fmt}"
    return DatasetMeta(schema=schema, parts=[PartInfo(name="part-00000", rows=0, source=source)], splits={},
                       preprocessing={"categorical": "modulo", "format": fmt, "table_size": None,
                                      "dense_transform": transform})


def columns_of(meta: DatasetMeta) -> list[str]:
    s = meta.schema
    return [*s.dense, *s.feature_names]


class Crashed(str):
    """What the text path raised that was no DataError (the server answered 500)."""


def text_path(columns: dict, meta: DatasetMeta):
    """The chunk of the text path (one block), or its message as the server words it."""
    try:
        chunks = [c for c, *_ in table_chunks(columns, meta, ParseReport())]
    except (UnicodeEncodeError, OverflowError, ValueError, TypeError) as e:  # (pyarrow's are ValueErrors)
        return Crashed(f"{type(e).__name__}: {e}")
    except DataError as e:
        text = str(e)
        m = re.match(r"^input:(\d+):\s*", text)
        if m:
            first = 2 if meta.parts[0].source.endswith(".csv") else 1
            return f"row {int(m.group(1)) - first}: {text[m.end():]}"
        m = re.match(r"^input: row (\d+):\s*", text)
        return f"row {int(m.group(1)) - 1}: {text[m.end():]}" if m else text
    assert len(chunks) == 1
    return chunks[0]


def direct_path(columns: dict, n: int, meta: DatasetMeta):
    try:
        return json_chunk(columns, n, meta)
    except DataError as e:
        return str(e)


def bits(a: np.ndarray) -> np.ndarray:
    return a.view(np.uint8) if a.dtype.kind == "f" else a


def assert_same_chunk(a, b, meta: DatasetMeta) -> None:
    assert len(a) == len(b)
    for name in ("labels", "dense", "onehot"):
        x, y = getattr(a, name), getattr(b, name)
        assert x.dtype == y.dtype and x.shape == y.shape, (name, x.dtype, y.dtype, x.shape, y.shape)
        assert np.array_equal(bits(np.ascontiguousarray(x)), bits(np.ascontiguousarray(y))), name
    assert a.multihot.keys() == b.multihot.keys()
    for name, (keys, lengths) in a.multihot.items():
        assert np.array_equal(keys, b.multihot[name][0]) and keys.dtype == b.multihot[name][0].dtype, name
        assert np.array_equal(lengths, b.multihot[name][1]) and lengths.dtype == b.multihot[name][1].dtype, name
    # ... and so the same ids (the encode step that follows both)
    encoders = {f.name: ModuloEncoder(997) for f in meta.schema.features}
    ids_a, ids_b = encode_chunk(a, meta.schema, encoders), encode_chunk(b, meta.schema, encoders)
    assert np.array_equal(ids_a[0], ids_b[0])


# ---------------------------------------------------------------- random values


def pick(rng, choices):
    return choices[rng.randrange(len(choices))]


def criteo_dense(rng, bad: float):
    k = rng.random()
    if k < bad:
        return pick(rng, ["many", "1.5", 1.5, "+3", "-", "--1", 10**18, -(10**17), 2**70, "１",
                          [1, 2], "0x1f", " 4", float("inf"), "\ud800"])
    return pick(rng, [None, None, 0, -1, 7, rng.randrange(-10**9, 10**9), 10**18 - 1, -(10**17 - 1),
                      True, False, 3.0, -0.0, float("nan"), "12", "-5", "007", "", "-0", [], [9], [None],
                      [[4]], rng.randrange(0, 1000)])


def _hex_ids(count: int = 2000) -> list[str]:
    rng = np.random.default_rng(0)
    digits = np.array(list("0123456789abcdefABCDEF"))
    widths = rng.choice([8, 8, 8, 1, 3, 7], count)
    return ["".join(digits[rng.integers(0, len(digits), w)]) for w in widths]


HEX_IDS = _hex_ids()


def hex_id(rng) -> str:
    return HEX_IDS[rng.randrange(len(HEX_IDS))]


def criteo_id(rng, bad: float):
    if rng.random() < bad:
        return pick(rng, ["xyz", "123456789", -1, 2**32, "0x12", "a b", "é", 1.5, ["aa", "bb"], "\ud800", ""])
    return pick(rng, [None, hex_id(rng), hex_id(rng), hex_id(rng), "", rng.randrange(0, 2**32), 0,
                      2**32 - 1, True, 5.0, [hex_id(rng)], []])


def criteo_bag(rng, bad: float):
    if rng.random() < bad:
        return pick(rng, ["a,,b", "a,", ",", "zz", [None, "a"], ["a", ""]])
    k = rng.randrange(0, 4)
    return pick(rng, [None, "", [], [hex_id(rng) for _ in range(k)], ",".join(hex_id(rng) for _ in range(k + 1)),
                      [rng.randrange(0, 2**32) for _ in range(k)], [None], [[hex_id(rng), hex_id(rng)]]])


TEXTS = ["", "a", "Paris", "São Paulo", "a,b", 'say "hi"', "x|y", "line\nbreak", "cr\rlf\r\n", " pad ",
         "tab\there", "nul\x00", "nul at end\x00", "émoji 🎉", "-0", "0", "1.0", "1e3"]


def csv_dense(rng, bad: float):
    if rng.random() < bad:
        return pick(rng, ["abc", float("inf"), -float("inf"), "1e400", 10**400, [1, 2], "0x10"])
    return pick(rng, [None, 0, -3, rng.randrange(-10**12, 10**12), 2**53 + 1, 2**70, -(10**30), 1.5, -0.0, 0.0,
                      float("nan"), 1e-320, rng.gauss(0, 1) * 1e3, True, False, "2.5", " 3 ", "nan", "",
                      "-1e3", "1_000", [], [7], 12.0])


def csv_id(rng, bad: float):
    return pick(rng, [None, pick(rng, TEXTS), pick(rng, TEXTS), rng.randrange(-10**6, 10**6), 2**70, 3.0,
                      2.5, -0.0, float("nan"), True, [], ["a", "b"], ["a", ["b", "c"]]])


def csv_bag(rng, bad: float):
    if rng.random() < bad:
        return pick(rng, ["a||b", "a|", ["a", ""], [None, "x"]])
    k = rng.randrange(0, 4)
    return pick(rng, [None, "", [], [pick(rng, TEXTS[1:]) for _ in range(k)], "a|b|c", "one",
                      [rng.randrange(0, 100) for _ in range(k)], ["a,b", "c"], [1.0, 2]])


def random_columns(fmt: str, meta: DatasetMeta, n: int, rng, bad: float) -> dict:
    s = meta.schema
    multi = {f.name for f in s.multihot}
    cols = {}
    for name in columns_of(meta):
        if fmt == "criteo":
            make = criteo_dense if name in s.dense else criteo_bag if name in multi else criteo_id
        elif fmt == "csv":
            make = csv_dense if name in s.dense else csv_bag if name in multi else csv_id
        else:
            cols[name] = parquet_column(name, s, multi, n, rng, bad)
            continue
        cols[name] = [make(rng, bad) for _ in range(n)]
    return cols


def parquet_column(name, s, multi, n: int, rng, bad: float) -> list:
    """Values of one type per column (what pyarrow's inference takes), nulls among them."""
    none = [rng.random() < 0.2 for _ in range(n)]
    none[rng.randrange(n)] = False  # (a column of nulls only is one the text path refuses)
    if name in s.dense:
        kind = pick(rng, ["int", "float", "mixed", "bool"])
        values = [None if z else
                  rng.randrange(-2**53, 2**53) if kind == "int" or (kind == "mixed" and k % 2) else
                  rng.random() < 0.5 if kind == "bool" else
                  pick(rng, [rng.gauss(0, 1), -0.0, float("nan"), 1e30, 0.0, 5.0])
                  for k, z in enumerate(none)]
        if kind == "float" and rng.random() < bad * n:
            values[rng.randrange(n)] = float("inf")
        return values
    ints = rng.random() < 0.5
    one = (lambda: rng.randrange(-2**63, 2**63 - 1)) if ints else (lambda: pick(rng, TEXTS))
    if name in multi:
        values = [None if z else [None if rng.random() < 0.1 else one() for _ in range(rng.randrange(0, 4))]
                  for z in none]
        values[none.index(False)] = [one()]
        return values
    return [None if z else one() for z in none]


@pytest.mark.parametrize("fmt, multihot, transform", [
    ("criteo", (), "log1p"), ("criteo", ("C3", "C20"), "log1p"),
    ("csv", (), "log1p"), ("csv", (), "none"), ("parquet", (), "log1p"), ("parquet", (), "none"),
])
def test_random_rows_give_the_text_paths_chunk_bit_for_bit(fmt, multihot, transform):
    meta = meta_of(fmt, multihot, transform)
    rng = random.Random(f"{fmt} {multihot} {transform}")
    compared = refused = 0
    for trial in range(300):
        n = rng.randrange(1, 40)
        bad = 0.0 if trial < 200 else 0.02  # (then some rows with a bad value)
        cols = random_columns(fmt, meta, n, rng, bad)
        want, got = text_path(cols, meta), direct_path(cols, n, meta)
        if isinstance(want, str):
            refused += 1
            assert isinstance(got, str), (trial, want)
            if fmt != "parquet" and not isinstance(want, Crashed) and "where the field takes one" not in got:
                if fmt == "csv" and any(isinstance(v, str) and ("\n" in v or "\r" in v) for v in _values(cols)):
                    # (the text path numbers CSV lines, and a value's line break made two of one)
                    want, got = want.split(":", 1)[1], got.split(":", 1)[1]
                assert got == want
            continue
        assert not isinstance(got, str), (trial, got)
        assert_same_chunk(want, got, meta)
        compared += 1
    assert compared >= 150 and refused >= 10, (compared, refused)


def _values(cols: dict):
    for values in cols.values():
        for v in values:
            yield from (v if isinstance(v, list) else [v])


def test_a_big_request_is_one_chunk_and_equal():
    meta = meta_of("criteo", ("C5",))
    cols = random_columns("criteo", meta, 3000, random.Random(7), 0.0)
    assert_same_chunk(text_path(cols, meta), json_chunk(cols, 3000, meta), meta)


# ---------------------------------------------------------------- errors


def good_row(fmt: str) -> dict:
    if fmt == "criteo":
        return {**{c: 1 for c in DENSE}, **{c: "68fd1e64" for c in CATEGORICAL}}
    return {"price": 1.5, "age": 30, "score": None, "city": "Paris", "device": 3, "tags": ["a", "b"]}


def one_bad(fmt: str, rows: int, at: int, field: str, value, multihot=()) -> str:
    meta = meta_of(fmt, multihot)
    cols = {c: [good_row(fmt)[c]] * rows for c in columns_of(meta)}
    cols[field] = list(cols[field])
    cols[field][at] = value
    with pytest.raises(DataError) as e:
        json_chunk(cols, rows, meta)
    message = str(e.value)
    assert "\n" not in message and message.startswith(f"row {at}: field {field} (column "), message
    return message


def test_criteo_errors_name_the_row_the_field_and_why():
    assert "not an integer: 'many'" in one_bad("criteo", 5, 3, "I5", "many")
    assert "not an integer: '1.5'" in one_bad("criteo", 2, 1, "I1", 1.5)
    assert "(column 6)" in one_bad("criteo", 2, 1, "I5", "x")  # (the label is column 1)
    assert "more than 18 digits" in one_bad("criteo", 3, 0, "I2", 10**18)
    assert "more than 18 digits" in one_bad("criteo", 3, 0, "I2", 2**80)
    assert "not a hexadecimal id of at most 8 digits: 'xyz'" in one_bad("criteo", 4, 2, "C7", "xyz")
    assert "'123456789'" in one_bad("criteo", 4, 2, "C7", "123456789")
    assert "'100000000'" in one_bad("criteo", 1, 0, "C1", 2**32)  # (an integer id: as 8 hex digits)
    assert "'-0000001'" in one_bad("criteo", 1, 0, "C1", -1)
    assert "2 values where the field takes one" in one_bad("criteo", 3, 1, "C2", ["aa", "bb"])
    assert "3 values where the field takes one" in one_bad("criteo", 3, 1, "I2", [1, 2, 3])
    assert "not a comma-separated list" in one_bad("criteo", 3, 2, "C4", "a,,b", multihot=("C4",))
    # The first bad row, and in it the first bad field, is the one named.
    meta = meta_of("criteo")
    cols = {c: [good_row("criteo")[c]] * 4 for c in columns_of(meta)}
    cols["C9"] = ["a", "b", "zz", "zz"]
    cols["I3"] = [1, 2, "x", "y"]
    with pytest.raises(DataError, match=r"^row 2: field I3 \(column 4\): not an integer: 'x'$"):
        json_chunk(cols, 4, meta)


def test_csv_and_parquet_errors_name_the_row_the_field_and_why():
    assert one_bad("csv", 3, 1, "price", "cheap").endswith("(column 1): not a finite number: 'cheap'")
    assert one_bad("csv", 3, 2, "age", float("inf")).endswith("not a finite number: 'inf'")
    assert "empty id in list 'a||b'" in one_bad("csv", 2, 1, "tags", "a||b")
    assert one_bad("parquet", 3, 1, "price", "cheap").endswith("(column 1): expected a number, got a string: 'cheap'")
    assert one_bad("parquet", 3, 1, "price", float("inf")).endswith("not a finite number")
    assert "expected an integer or a string id, got a boolean" in one_bad("parquet", 2, 0, "city", True)
    assert "expected an integer or a string id, got a list" in one_bad("parquet", 2, 1, "device", ["a", "b"])
    assert "out of range" in one_bad("parquet", 2, 1, "device", 2**64)
    assert "expected a list of ids, got a string" in one_bad("parquet", 2, 1, "tags", "a|b")
    assert "expected a list of integer or string ids" in one_bad("parquet", 2, 1, "tags", ["a", 1.5])
    assert "not Unicode text" in one_bad("csv", 2, 1, "city", "\ud800")
    assert "not Unicode text" in one_bad("parquet", 2, 1, "city", "\ud800")


def test_values_the_text_path_refused_for_nothing_are_taken():
    """Parquet through pyarrow's inference refused a column of nulls only (type null)."""
    meta = meta_of("parquet")
    cols = {c: [None, None] for c in columns_of(meta)}
    chunk = json_chunk(cols, 2, meta)
    assert isinstance(text_path(cols, meta), str)
    assert (chunk.dense == 0).all() and (chunk.onehot == -1).all() and (chunk.multihot["tags"][1] == 0).all()


def test_a_request_body_becomes_columns_or_one_line_naming_what_is_wrong():
    from hybridrec.serve.server import BadRequest, parse_request

    names = ["I1", "C1"]
    body = b'{"rows": [{"I1": 1, "C1": "a", "label": 0, "extra": 2}, {"C1": null, "I1": -3}]}'
    assert parse_request(body, names, 10) == ({"I1": [1, -3], "C1": ["a", None]}, 2)
    assert parse_request(b'{"rows": [{"I1": 5}]}', ["I1"], 10) == ({"I1": [5]}, 1)
    assert parse_request(b'{"columns": {"I1": [1], "C1": ["b"]}}', names, 10) == ({"I1": [1], "C1": ["b"]}, 1)
    assert parse_request(b'{"rows": []}', names, 10) == ({"I1": [], "C1": []}, 0)
    for body, status, words in [
        (b'{"rows": [{"I1": 1, "C1": "a"}, 7]}', 400, ["rows[1]: expected an object", "a number"]),
        (b'{"rows": [{"I1": 1, "C1": "a"}, {"I1": 2, "c1": "b"}]}', 400,
         ["rows[1]: no column C1", "given c1, which the model does not take"]),
        (b'{"rows": [{"I1": 1, "C1": "a", "label": 1}, {"I1": 2, "label": 0}]}', 400, ["rows[1]: no column C1 ("]),
        (b'{"columns": {"I1": [1], "C_1": ["b"]}}', 400, ["columns: no column C1", "given C_1"]),
        (b'{"rows": [{"I1": 1, "C1": "a"}, {"I1": 1, "C1": "a"}]}', 413, ["2 rows", "--max-rows"]),
    ]:
        with pytest.raises(BadRequest) as e:
            parse_request(body, names, 1 if status == 413 else 10)
        assert e.value.status == status and all(w in e.value.message for w in words), e.value.message
        assert "given" not in e.value.message or "label" not in e.value.message
