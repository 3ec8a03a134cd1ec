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


# -- the line cap -------------------------------------------------------------------------
LONG = 8 << 20  # an 8 MiB line: 8 times the cap


def _gz_with_long_line(tmp_path, head: list[str], name="long.tsv.gz") -> str:
    """``head``'s lines, then one line of LONG bytes (no tab, no newline for 8 MiB), then a
    good line: 8 KiB on disk."""
    path = tmp_path / name
    with gzip.open(path, "wb") as f:
        f.write(("\n".join(head) + "\n").encode())
        for _ in range(LONG // (1 << 20)):
            f.write(b"7" * (1 << 20))
        f.write(("\n" + line() + "\n").encode())
    return str(path)


def _peak_bytes(fn) -> int:
    import tracemalloc

    tracemalloc.start()
    try:
        fn()
    finally:
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    return peak


def test_a_line_past_the_cap_is_one_error_naming_it_read_in_bounded_blocks(tmp_path):
    """A line longer than MAX_LINE_BYTES (1 MiB) ends the read in one line naming file and
    line number, having read little more than the cap of it (it was gathered whole: a 500
    MB line took 2.7 GB)."""
    from hybridrec.data.chunk import MAX_LINE_BYTES

    path = _gz_with_long_line(tmp_path, [line(), line("0")])
    reader, chunks = CriteoReader(), []

    def read():
        with pytest.raises(DataError) as e:
            chunks.extend(c for c, _ in reader.read(path, ParseReport()))
        assert str(e.value) == (f"{path}:3: line longer than 1,048,576 bytes, the most a line of a Criteo file "
                                "may hold (is this the right file and format?)")

    peak = _peak_bytes(read)
    assert MAX_LINE_BYTES == 1 << 20
    assert sum(len(c) for c in chunks) == 2  # the lines before it were read
    assert peak < LONG / 2, peak  # (the whole line: more than LONG)


@pytest.mark.parametrize("chunk_bytes", [64, 1 << 19])
def test_a_long_line_inside_a_block_and_the_errors_before_it(tmp_path, chunk_bytes):
    """The cap holds for a line whole inside one block too, and a bad line before the long
    one is the file's first error."""
    long = line(cats=["0000000a"] * 25 + [",".join(["0000000b"] * 40)])  # a bag of 40 ids: 578 bytes
    path = write(tmp_path, [line(), line(), long, line()])
    reader = CriteoReader(multihot=("C26",), chunk_bytes=chunk_bytes, max_line_bytes=300)
    with pytest.raises(DataError, match=r"day.tsv:3: line longer than 300 bytes, the most a line of a Criteo"):
        list(reader.read(path, ParseReport()))
    path = write(tmp_path, [line(), line("7"), long, line()])
    with pytest.raises(DataError, match=r"day.tsv:2: field label \(column 1\): label must be 0 or 1"):
        list(reader.read(path, ParseReport()))
    ok = CriteoReader(multihot=("C26",), chunk_bytes=chunk_bytes, max_line_bytes=len(long))  # at the cap: taken
    assert sum(len(c) for c, _ in ok.read(write(tmp_path, [line(), long, line()], end="\r\n"), ParseReport())) == 3


def test_a_csv_line_past_the_cap_is_one_error_naming_it(tmp_path):
    from hybridrec.data.tabular import CsvReader, TabularSpec

    spec = TabularSpec(label="y", dense=["x"], categorical=["c"])
    path = tmp_path / "long.csv.gz"
    with gzip.open(path, "wb") as f:
        f.write(b"y,x,c\n1,0.5,a\n")
        for _ in range(LONG // (1 << 20)):
            f.write(b"7" * (1 << 20))
        f.write(b"\n0,1,b\n")

    def read():
        with pytest.raises(DataError) as e:
            list(CsvReader(spec=spec).read(path, ParseReport()))
        assert str(e.value) == (f"{path}:3: line longer than 1,048,576 characters, the most a line of a CSV "
                                "file may hold (is this the right file and format?)")

    assert _peak_bytes(read) < LONG / 2
    short = tmp_path / "short.csv"
    short.write_text("y,x,c\r\n1,0.5," + "a" * 90 + "\r\n0,1,b\r\n")
    assert sum(len(c) for c, _ in CsvReader(spec=spec, max_line_bytes=96).read(short, ParseReport())) == 2
    with pytest.raises(DataError, match=r"short.csv:2: line longer than 95 characters"):
        list(CsvReader(spec=spec, max_line_bytes=95).read(short, ParseReport()))


def test_preprocess_refuses_a_long_line_in_one_line(tmp_path, capsys):
    from hybridrec.cli.main import main

    path = _gz_with_long_line(tmp_path, [line()])
    assert main(["data", "preprocess", path, "--out", str(tmp_path / "out")]) != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [(f"hybridrec: error: {path}:2: line longer than 1,048,576 bytes, the most a line of a "
                    "Criteo file may hold (is this the right file and format?)")]
    assert not (tmp_path / "out").exists()
