"""Every output is written whole or not at all, and an output that is an input is refused:
score.py, `hybridrec predict`, `export`, `data preprocess` and `data synth` through their
command lines, on a tiny synthetic dataset and run (hybridrec.data.outputs).

A full disk is a real one in small: the command runs in a child process whose files may not
grow past a few kilobytes (RLIMIT_FSIZE), so its writes fail with EFBIG as they would with
ENOSPC."""

from __future__ import annotations

import json
import os
import resource
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from hybridrec.cli.main import DEBUG_ENV, main
from hybridrec.data.schema import DatasetMeta
from hybridrec.errors import DataError
from hybridrec.serve import predict as predict_mod
from hybridrec.serve.predict import Predictor, predict_files

pq = pytest.importorskip("pyarrow.parquet")

ROWS = 600


@pytest.fixture(scope="module")
def made(shared_dataset, trained_run):
    """Three synthetic days (the last held out), a run trained on them and its export
    (shared: read-only)."""
    data = shared_dataset(days=3, rows=ROWS)
    run = trained_run(data, 12, "data.eval_batch_size=256", export=True)  # (test_predict.py's run)
    return {"data": data, "run": run, "art": run.parent / "art", "raw": data.parent / "raw"}


def _files(directory: Path) -> dict[str, bytes]:
    """Every file under ``directory`` by relative path, with its bytes."""
    return {str(p.relative_to(directory)): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


def _leftovers(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if ".tmp-" in p.name or ".old-" in p.name)


def _corrupt(src: Path, dst: Path, line_no: int) -> None:
    """``src`` with field C3 of line ``line_no`` (1-based) made no hexadecimal id."""
    lines = src.read_text().splitlines(keepends=True)
    fields = lines[line_no - 1].split("\t")
    fields[16] = "zz"
    lines[line_no - 1] = "\t".join(fields)
    dst.write_text("".join(lines))


def _file_size_limit(limit: int):
    """A child process whose files cannot grow past ``limit`` bytes (a write beyond fails
    with EFBIG instead of killing it with SIGXFSZ)."""
    def start() -> None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    return start


def _hybridrec(args: list[str], *, limit: int | None = None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in (DEBUG_ENV, "RANK", "WORLD_SIZE")}
    return subprocess.run([sys.executable, "-m", "hybridrec", *args], capture_output=True, text=True,
                          env=env, check=False, preexec_fn=_file_size_limit(limit) if limit else None)


def _score(art: Path, *args: str, limit: int | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(art / "score.py"), *args], capture_output=True, text=True,
                          check=False, preexec_fn=_file_size_limit(limit) if limit else None)


def _one_line(text: str) -> str:
    lines = text.strip().splitlines()
    assert len(lines) == 1, lines
    return lines[0]


# ---------------------------------------------------------------- score.py


@pytest.mark.slow
def test_score_py_refuses_its_input_as_its_output(made, tmp_path):
    raw = tmp_path / "in.tsv"
    shutil.copyfile(made["raw"] / "day_2.tsv", raw)
    original = raw.read_bytes()
    os.link(raw, tmp_path / "hard.csv")
    (tmp_path / "sym.csv").symlink_to(raw)
    for out in (raw, tmp_path / "hard.csv", tmp_path / "sym.csv", tmp_path / "." / "in.tsv"):
        r = _score(made["art"], str(raw), str(out))
        assert r.returncode == 2, r.stderr
        assert _one_line(r.stderr) == (f"score.py: error: {out}: is the input; write the probabilities "
                                       "to another file")
        assert raw.read_bytes() == original
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hard.csv", "in.tsv", "sym.csv"]


@pytest.fixture(scope="module")
def scored(made, tmp_path_factory) -> bytes:
    """What score.py writes for the held-out day (batches of 100 rows): the earlier output
    of the two tests below, scored once for both (each writes it into its own directory)."""
    out = tmp_path_factory.mktemp("scored") / "p.csv"
    r = _score(made["art"], str(made["raw"] / "day_2.tsv"), str(out), "--batch-rows", "100")
    assert r.returncode == 0, r.stderr
    earlier = out.read_bytes()
    assert len(earlier.splitlines()) == ROWS + 1
    return earlier


@pytest.mark.slow
def test_score_py_a_bad_line_keeps_the_earlier_output(made, scored, tmp_path):
    good, bad, out = tmp_path / "good.tsv", tmp_path / "bad.tsv", tmp_path / "p.csv"
    shutil.copyfile(made["raw"] / "day_2.tsv", good)
    _corrupt(good, bad, 450)
    out.write_bytes(scored)
    earlier = out.read_bytes()
    # 400 rows are scored and written before the bad line is read.
    r = _score(made["art"], str(bad), str(out), "--batch-rows", "100")
    assert r.returncode == 2
    assert _one_line(r.stderr).startswith(f"score.py: error: {bad}:450: field C3 (column 17): ")
    assert out.read_bytes() == earlier
    r = _score(made["art"], str(bad), str(tmp_path / "new.csv"), "--batch-rows", "100")
    assert r.returncode == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.tsv", "good.tsv", "p.csv"]


@pytest.mark.slow
def test_score_py_a_full_disk_keeps_the_earlier_output(made, scored, tmp_path):
    good, out = tmp_path / "good.tsv", tmp_path / "p.csv"
    shutil.copyfile(made["raw"] / "day_2.tsv", good)
    out.write_bytes(scored)
    earlier = out.read_bytes()
    r = _score(made["art"], str(good), str(out), "--batch-rows", "100", limit=len(earlier) // 2)
    assert r.returncode == 2 and "File too large" in _one_line(r.stderr), r.stderr
    assert out.read_bytes() == earlier
    assert sorted(p.name for p in tmp_path.iterdir()) == ["good.tsv", "p.csv"]


# ---------------------------------------------------------------- predict


def test_predict_refuses_its_input_as_its_output(made, tmp_path, capsys):
    raw = tmp_path / "in.csv"  # (Criteo text: the run's dataset decides the format, not the name)
    shutil.copyfile(made["raw"] / "day_2.tsv", raw)
    original = raw.read_bytes()
    os.link(raw, tmp_path / "hard.csv")
    (tmp_path / "sym.csv").symlink_to(raw)
    for out in (raw, tmp_path / "hard.csv", tmp_path / "sym.csv"):
        assert main(["predict", str(made["run"]), str(raw), "--out", str(out)]) == 2
        line = _one_line(capsys.readouterr().err)
        assert line == f"hybridrec: error: --out {out}: is the input {raw}; write the output elsewhere"
        assert raw.read_bytes() == original
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hard.csv", "in.csv", "sym.csv"]


def test_predict_a_bad_line_keeps_the_earlier_output(made, tmp_path, capsys, monkeypatch):
    good, bad, out = tmp_path / "good.tsv", tmp_path / "bad.tsv", tmp_path / "p.parquet"
    shutil.copyfile(made["raw"] / "day_2.tsv", good)
    _corrupt(good, bad, 300)
    assert main(["predict", str(made["run"]), str(good), "--out", str(out)]) == 0
    earlier = out.read_bytes()
    assert pq.read_table(out).num_rows == ROWS
    assert main(["predict", str(made["run"]), str(good), str(bad), "--out", str(out)]) == 2
    assert _one_line(capsys.readouterr().err).startswith(f"hybridrec: error: {bad}:300: field C3")
    assert out.read_bytes() == earlier
    assert main(["predict", str(made["run"]), str(good), str(bad), "--out", str(tmp_path / "new.csv")]) == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.tsv", "good.tsv", "p.parquet"]
    # Row groups of 128 rows: the first input's are written to the temporary file before the
    # second input's bad line is read.
    monkeypatch.setattr(predict_mod, "FLUSH_ROWS", 128)
    predictor = Predictor.load(made["run"])
    for name in ("p.parquet", "new.csv"):
        with pytest.raises(DataError, match=f"{bad}:300: field C3"):
            predict_files(predictor, [good, bad], tmp_path / name)
    assert out.read_bytes() == earlier
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.tsv", "good.tsv", "p.parquet"]


@pytest.mark.slow
def test_predict_a_full_disk_keeps_the_earlier_output(made, tmp_path):
    good, out = tmp_path / "good.tsv", tmp_path / "p.csv"
    shutil.copyfile(made["raw"] / "day_2.tsv", good)
    assert main(["predict", str(made["run"]), str(good), "--out", str(out)]) == 0  # (in this process)
    earlier = out.read_bytes()
    r = _hybridrec(["predict", str(made["run"]), str(good), "--out", str(out)], limit=len(earlier) // 2)
    assert r.returncode == 2
    assert _one_line(r.stderr).startswith("hybridrec: error: ") and "File too large" in r.stderr
    assert str(out) in r.stderr and ".tmp-" not in r.stderr
    assert out.read_bytes() == earlier
    assert sorted(p.name for p in tmp_path.iterdir()) == ["good.tsv", "p.csv"]


# ---------------------------------------------------------------- export


def test_export_overwrite_replaces_only_an_export(made, tmp_path, capsys):
    run = made["run"]
    fake = tmp_path / "fake"
    fake.mkdir()
    (fake / "export.json").write_text("{}")
    (fake / "notes.txt").write_text("mine")
    mixed = tmp_path / "mixed"
    shutil.copytree(made["art"], mixed)
    (mixed / "preprocess" / "notes.txt").write_text("mine")
    cases = [
        (fake, (f"{fake}: refusing to overwrite, it is not an export directory (export.json is not an "
                "export's record (no run_dir, checkpoint, arch, tables, inputs, format, model_bytes, held_out))")),
        (mixed, (f"{mixed}: refusing to overwrite, it is not an export directory "
                 "(preprocess/notes.txt is not a file of an export)")),
        (run, f"--out {run}: is the run directory {run}; write the output elsewhere"),
        (run.parent, (f"--out {run.parent}: holds the run directory {run}, which replacing it would "
                      "delete; write the output elsewhere")),
    ]
    before = {d: _files(d) for d in (fake, mixed, run)}
    for out, message in cases:
        assert main(["export", str(run), "--out", str(out), "--overwrite"]) == 2
        assert _one_line(capsys.readouterr().err) == f"hybridrec: error: {message}"
    assert {d: _files(d) for d in before} == before
    assert not _leftovers(tmp_path) and not _leftovers(run.parent)
    # An earlier export is replaced, whole.
    again = tmp_path / "again"
    shutil.copytree(made["art"], again)
    (again / "model.pt2").write_bytes(b"an earlier export")
    assert main(["export", str(run), "--out", str(again), "--overwrite", "--tables", "bf16"]) == 0
    assert json.loads((again / "export.json").read_text())["tables"] == "bf16"
    assert (again / "model.pt2").read_bytes() != b"an earlier export"
    assert not _leftovers(tmp_path)


# ---------------------------------------------------------------- preprocess


def test_preprocess_refuses_to_write_over_its_inputs(made, tmp_path, capsys):
    like = tmp_path / "D"
    shutil.copytree(made["data"], like)
    (tmp_path / "L").symlink_to(like)
    raw = tmp_path / "day.tsv"
    shutil.copyfile(made["raw"] / "day_2.tsv", raw)
    cases = [
        (["--like", str(like), "--out", str(like)], f"--out {like}: is the --like dataset {like}"),
        (["--like", str(like), "--out", str(tmp_path / "L")], f"--out {tmp_path / 'L'}: is the --like dataset {like}"),
        (["--like", str(like), "--out", str(tmp_path)],
         f"--out {tmp_path}: holds the input {raw}, which replacing it would delete"),
        (["--out", str(raw)], f"--out {raw}: is the input {raw}"),
    ]
    before = _files(tmp_path)
    for extra, message in cases:
        assert main(["data", "preprocess", str(raw), *extra, "--overwrite"]) == 2
        assert _one_line(capsys.readouterr().err).startswith(f"hybridrec: error: {message}")
    assert _files(tmp_path) == before
    assert DatasetMeta.load(like).splits == DatasetMeta.load(made["data"]).splits


def test_a_failed_preprocess_leaves_no_half_dataset(made, tmp_path, capsys):
    days = [made["raw"] / f"day_{i}.tsv" for i in range(3)]
    bad = tmp_path / "bad.tsv"
    _corrupt(days[2], bad, 500)
    out = tmp_path / "ds"
    assert main(["data", "preprocess", *map(str, days[:2]), str(bad), "--out", str(out)]) == 2
    assert _one_line(capsys.readouterr().err).startswith(f"hybridrec: error: {bad}:500: field C3")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.tsv"]
    assert main(["data", "preprocess", *map(str, days), "--out", str(out)]) == 0
    earlier = _files(out)
    assert main(["data", "preprocess", *map(str, days[:2]), str(bad), "--out", str(out), "--overwrite"]) == 2
    assert _files(out) == earlier
    # A full disk: the dataset's files may not grow past 16 KiB (the one-hot ids are 62 KB).
    r = _hybridrec(["data", "preprocess", *map(str, days), "--out", str(out), "--overwrite",
                    "--table-size", "1000"], limit=16 << 10)
    assert r.returncode == 2 and "File too large" in _one_line(r.stderr), r.stderr
    assert _files(out) == earlier
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.tsv", "ds"]


def test_preprocess_overwrite_replaces_only_a_dataset(made, tmp_path, capsys):
    day = str(made["raw"] / "day_0.tsv")
    mixed = tmp_path / "mixed"
    shutil.copytree(made["data"], mixed)
    (mixed / "stats" / "notes.txt").write_text("mine")
    fake = tmp_path / "fake"
    fake.mkdir()
    (fake / "meta.json").write_text("{}")
    (fake / "part-00000").mkdir()
    cases = [(mixed, "stats/notes.txt is not a dataset's file"),
             (fake, "meta.json is not one that preprocessing writes")]
    before = _files(tmp_path)
    for out, why in cases:
        assert main(["data", "preprocess", day, "--out", str(out), "--overwrite"]) == 2
        assert _one_line(capsys.readouterr().err) == (f"hybridrec: error: {out}: refusing to overwrite, "
                                                      f"it is not a hybridrec dataset ({why})")
    assert _files(tmp_path) == before and (fake / "part-00000").is_dir()
    (mixed / "stats" / "notes.txt").unlink()
    assert main(["data", "preprocess", day, "--out", str(mixed), "--overwrite", "--eval-parts", "none"]) == 0
    assert [p.name for p in DatasetMeta.load(mixed).parts] == ["part-00000"]
    assert not _leftovers(tmp_path)


# ---------------------------------------------------------------- synth


@pytest.mark.slow
def test_a_failed_synth_keeps_the_earlier_days(tmp_path):
    out = tmp_path / "raw"
    args = ["data", "synth", "--out", str(out), "--days", "2", "--rows-per-day", "300"]
    assert main(args) == 0
    (out / "notes.txt").write_text("mine")
    earlier = _files(out)
    r = _hybridrec([*args[:-3], "3", "--rows-per-day", "3000", "--seed", "1", "--overwrite"],
                   limit=len(earlier["day_0.tsv"]) * 2)
    assert r.returncode == 2 and "File too large" in _one_line(r.stderr), r.stderr
    assert str(out / "day_0.tsv") in r.stderr and ".tmp-" not in r.stderr
    assert _files(out) == earlier
    assert main([*args[:-3], "1", "--rows-per-day", "300", "--seed", "1", "--overwrite"]) == 0
    assert sorted(_files(out)) == ["day_0.tsv", "notes.txt", "teacher.json"]
    assert json.loads((out / "teacher.json").read_text())["files"] == ["day_0.tsv"]
    assert _files(out)["day_0.tsv"] != earlier["day_0.tsv"]
