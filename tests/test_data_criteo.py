"""Criteo TSV parsing: exact values, and every malformed input naming file, line and field."""

from __future__ import annotations

import gzip

import numpy as np
import pytest

from hybridrec.data.chunk import ParseReport
from hybridrec.data.criteo import CriteoReader, read_criteo
from hybridrec.errors import DataError


def line(label="1", dense=None, cats=None) -> str:
    dense = ["1"] * 13 if dense is None else dense
    cats = ["0000000a"] * 26 if cats is None else cats
    return "\t".join([label, *dense, *cats])


def write(tmp_path, lines, name="day.tsv", end="\n") -> str:
    path = tmp_path / name
    path.write_text("\n".join(lines) + end)
    return str(path)


def read_all(path, **kw):
    chunks = list(read_criteo(path, **kw))
    return (
        np.concatenate([c.labels for c in chunks]),
        np.concatenate([c.dense for c in chunks]),
        np.concatenate([c.onehot for c in chunks]),
    )


def test_exact_values_missing_negative_and_hex(tmp_path):
    dense = ["5", "", "-3", "0", "123456789", *["7"] * 8]
    cats = ["a1b2c3d4", "", "FFFFFFFF", "00000000", *["0000000f"] * 22]
    path = write(tmp_path, [line("1", dense, cats), line("0")], end="")  # no final newline
    labels, d, c = read_all(path)
    assert labels.tolist() == [1, 0]
    want = np.log1p(np.array([5, 0, 0, 0, 123456789, *[7] * 8], np.float64)).astype(np.float32)
    np.testing.assert_array_equal(d[0], want)
    assert d.dtype == np.float32
    assert c[0, :5].tolist() == [0xA1B2C3D4, -1, 0xFFFFFFFF, 0, 15]  # -1 = missing
    assert c.shape == (2, 26)


def test_short_hex_and_blocks_smaller_than_a_line(tmp_path):
    lines = [line(str(i % 2), cats=[f"{i:x}", *["abc"] * 25]) for i in range(50)]
    path = write(tmp_path, lines)
    reader = CriteoReader(chunk_bytes=64)  # lines straddle every block boundary
    chunks = [c for c, _ in reader.read(path, ParseReport())]
    keys = np.concatenate([c.onehot for c in chunks])
    assert keys[:, 0].tolist() == list(range(50))
    assert (keys[:, 1:] == 0xABC).all()


def test_gzip_and_crlf(tmp_path):
    path = tmp_path / "day.tsv.gz"
    with gzip.open(path, "wt") as f:
        f.write("\r\n".join([line("1"), line("0")]) + "\r\n")
    labels, _, c = read_all(path)
    assert labels.tolist() == [1, 0] and (c == 10).all()


def test_multihot_fields(tmp_path):
    cats = ["1,2,3", "", *["0000000a"] * 24]
    path = write(tmp_path, [line(cats=cats), line()])
    (chunk,) = read_criteo(path, multihot=("C1", "C2"))
    keys, lengths = chunk.multihot["C1"]
    assert keys.tolist() == [1, 2, 3, 10] and lengths.tolist() == [3, 1]
    keys, lengths = chunk.multihot["C2"]
    assert keys.tolist() == [10] and lengths.tolist() == [0, 1]
    assert chunk.onehot.shape == (2, 24)


@pytest.mark.parametrize(
    "bad, expect",
    [
        (line("2"), "day.tsv:2: field label (column 1): label must be 0 or 1, got '2'"),
        (
            line(dense=["1", "x1", *["1"] * 11]),
            "day.tsv:2: field I2 (column 3): not an integer: 'x1'",
        ),
        (line(dense=["1.5", *["1"] * 12]), "day.tsv:2: field I1 (column 2): not an integer"),
        (
            line(cats=["0000000a", "zzzzzzzz", *["1"] * 24]),
            "day.tsv:2: field C2 (column 16): not a hex",
        ),
        (line(cats=["123456789", *["1"] * 25]), "day.tsv:2: field C1 (column 15): not a hex"),
        ("1\t2\t3", "day.tsv:2: expected 40 tab-separated fields, got 3"),
        (line() + "\t", "day.tsv:2: expected 40 tab-separated fields, got 41"),
        ("", "day.tsv:2: empty line"),
    ],
)
def test_bad_line_names_file_line_field(tmp_path, bad, expect):
    path = write(tmp_path, [line(), bad, line("2")])  # the later bad line must not win
    with pytest.raises(DataError, match="^" + str(tmp_path).replace("\\", "\\\\") + "/") as e:
        read_all(path)
    assert expect in str(e.value)


def test_bad_multihot_list(tmp_path):
    path = write(tmp_path, [line(cats=["1,,2", *["1"] * 25])])
    with pytest.raises(
        DataError, match=r"day.tsv:1: field C1 \(column 15\): not a comma-separated"
    ):
        read_all(path, multihot=("C1",))


def test_skip_mode_counts_and_keeps_examples(tmp_path):
    lines = [line("1"), line("2"), "x", line("0"), line(dense=["a", *["1"] * 12]), line("1")]
    path = write(tmp_path, lines)
    report = ParseReport()
    labels, _, _ = read_all(path, on_bad_line="skip", report=report)
    assert labels.tolist() == [1, 0, 1]
    assert report.lines_read == 6 and report.bad_lines_skipped == 3
    assert [e.split(": ")[0].split(":")[-1] for e in report.bad_line_examples] == ["2", "3", "5"]
    assert "field I1 (column 2)" in report.bad_line_examples[2]


def test_truncated_gzip_is_a_clear_error(tmp_path):
    data = gzip.compress(("\n".join([line()] * 2000) + "\n").encode())
    path = tmp_path / "day.tsv.gz"
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(DataError, match=r"day.tsv.gz: truncated or corrupt gzip"):
        read_all(path)


def test_empty_file(tmp_path):
    path = tmp_path / "empty.tsv"
    path.write_text("")
    with pytest.raises(DataError, match=r"empty.tsv: empty file"):
        read_all(path)


def test_unknown_multihot_field():
    with pytest.raises(DataError, match="C27"):
        CriteoReader(multihot=("C27",))
