"""`hybridrec data synth | preprocess | inspect` through the real entry point."""

from __future__ import annotations

import json

import pytest

from hybridrec.cli.main import main
from hybridrec.data.schema import DatasetMeta


def test_synth_preprocess_inspect(tmp_path, capsys):
    raw, ds = tmp_path / "raw", tmp_path / "ds"
    assert (
        main(
            [
                "data",
                "synth",
                "--out",
                str(raw),
                "--days",
                "3",
                "--rows-per-day",
                "1500",
                "--max-cardinality",
                "500",
                "--seed",
                "2",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "teacher AUC on day_2.tsv: 0." in out
    days = [str(raw / f"day_{d}.tsv") for d in range(3)]
    assert (
        main(
            [
                "data",
                "preprocess",
                *days,
                "--out",
                str(ds),
                "--table-size",
                "1000,C9=3",
                "--eval-parts",
                "-1",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "wrote 4500 rows (3 parts)" in out and "eval split: day_2.tsv" in out
    meta = DatasetMeta.load(ds)
    assert meta.num_embeddings["C9"] == 3 and meta.num_embeddings["C1"] == 1000
    assert meta.splits["eval"] == ["part-00002"]
    assert main(["data", "inspect", str(ds)]) == 0
    text = capsys.readouterr().out
    assert "train 3,000 rows in 2 parts" in text and "\nC26 " in text
    assert main(["data", "inspect", str(ds), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["format_version"] == 1


def test_errors_are_one_line_exit_2(tmp_path, capsys):
    bad = tmp_path / "bad.tsv"
    bad.write_text("1\t2\n")
    assert main(["data", "preprocess", str(bad), "--out", str(tmp_path / "ds")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("hybridrec: error: ") and "bad.tsv:1: expected 40" in err
    assert not (tmp_path / "ds").exists()
    assert main(["data", "inspect", str(tmp_path)]) == 2
    assert "no meta.json" in capsys.readouterr().err
    assert main(["data", "preprocess", str(bad), "--out", "x", "--format", "csv"]) == 2
    assert "needs --schema" in capsys.readouterr().err


def test_skip_mode_prints_examples(tmp_path, capsys):
    good = "\t".join(["1", *["1"] * 13, *["0000000a"] * 26])
    path = tmp_path / "d.tsv"
    path.write_text(f"{good}\n1\tx\n{good}\n")
    assert (
        main(
            [
                "data",
                "preprocess",
                str(path),
                "--out",
                str(tmp_path / "ds"),
                "--on-bad-line",
                "skip",
                "--min-count",
                "1",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "bad lines skipped: 1" in out and "d.tsv:2: expected 40" in out


def test_help_texts(capsys):
    for cmd in (["data"], ["data", "synth"], ["data", "preprocess"], ["data", "inspect"]):
        with pytest.raises(SystemExit) as e:
            main([*cmd, "--help"])
        assert e.value.code == 0
    assert "--min-count" in capsys.readouterr().out


def _synth(raw, days=2):
    return main(["data", "synth", "--out", str(raw), "--days", str(days), "--rows-per-day", "300",
                 "--max-cardinality", "50"])


def test_warnings_are_one_line_each(tmp_path, capsys):
    raw = tmp_path / "raw"
    assert _synth(raw) == 0
    capsys.readouterr()
    stale = tmp_path / "ds.tmp-4194304"  # above any Linux pid_max: no such process
    stale.mkdir()
    one = str(raw / "day_0.tsv")
    assert main(["data", "preprocess", one, "--out", str(tmp_path / "ds")]) == 0
    err = capsys.readouterr().err
    assert err.splitlines() == [
        f"hybridrec: warning: removed what an interrupted run left: {stale}",
        (f"hybridrec: warning: {one}: the only input, so there is no held-out split and training "
         "will report AUC n/a; give two or more inputs (the last one is held out for evaluation)"),
    ]
    assert not stale.exists()


def test_synth_rerun_names_the_cli_option(tmp_path, capsys):
    raw = tmp_path / "raw"
    assert _synth(raw, days=1) == 0
    capsys.readouterr()
    assert _synth(raw, days=1) == 2
    assert capsys.readouterr().err == (
        f"hybridrec: error: {raw}: not empty (use --overwrite to replace its day files)\n")
    assert main(["data", "preprocess", str(raw / "day_0.tsv"), "--out", str(tmp_path / "ds"),
                 "--eval-parts", "none"]) == 0
    capsys.readouterr()
    assert main(["data", "preprocess", str(raw / "day_0.tsv"), "--out", str(tmp_path / "ds"),
                 "--eval-parts", "none"]) == 2
    assert capsys.readouterr().err == (
        f"hybridrec: error: {tmp_path / 'ds'}: already exists (use --overwrite to replace it)\n")


def test_text_ordered_day_files_get_a_note(tmp_path, capsys):
    """day_*.tsv from a shell glob lists day_10 before day_2: the default eval split would be
    day_9, so preprocess says so (and says nothing when the days are in order)."""
    from pathlib import Path

    from hybridrec.data.inputs import text_order_note

    globbed = [Path(f"raw/day_{d}.tsv") for d in sorted(range(11), key=str)]
    note = text_order_note(globbed)
    assert note is not None and "day_9.tsv is last" in note and "--eval-parts day_10.tsv" in note
    assert text_order_note([Path(f"raw/day_{d}.tsv") for d in range(11)]) is None
    assert text_order_note([Path("a.tsv"), Path("b3.tsv")]) is None  # not one numbered stem
    assert text_order_note([Path("day_3.tsv")]) is None

    raw = tmp_path / "raw"
    assert main(["data", "synth", "--out", str(raw), "--days", "11", "--rows-per-day", "50",
                 "--max-cardinality", "50"]) == 0
    capsys.readouterr()
    files = [str(raw / f"day_{d}.tsv") for d in sorted(range(11), key=str)]
    assert main(["data", "preprocess", *files, "--out", str(tmp_path / "ds")]) == 0
    captured = capsys.readouterr()
    assert "eval split: day_9.tsv" in captured.out
    assert captured.err.count("\n") == 1 and "note: inputs are not in numeric order" in captured.err
    assert main(["data", "preprocess", *files, "--out", str(tmp_path / "ds2"), "--eval-parts", "day_10.tsv"]) == 0
    captured = capsys.readouterr()
    assert "eval split: day_10.tsv" in captured.out and captured.err == ""
