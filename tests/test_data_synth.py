"""Synthetic Criteo days from a planted teacher."""

from __future__ import annotations

import gzip
import json
import re

import numpy as np
import pytest

from hybridrec.data import synth
from hybridrec.data.criteo import read_criteo
from hybridrec.data.synth import SynthConfig, Teacher, format_tsv, generate
from hybridrec.errors import DataError, HybridrecWarning
from hybridrec.metrics import classification

SMALL = {"days": 2, "rows_per_day": 4000, "max_cardinality": 2000}


def test_ctr_auc_files_and_format(tmp_path):
    report = generate(tmp_path / "raw", seed=0, **SMALL)
    assert report["files"] == ["day_0.tsv", "day_1.tsv"]
    assert 0.21 < report["ctr"] < 0.29
    assert 0.7 < report["teacher_auc"] < 0.95
    assert report["teacher_ne"] < 1.0
    assert (
        json.loads((tmp_path / "raw/teacher.json").read_text())["teacher_auc"]
        == report["teacher_auc"]
    )
    chunks = list(read_criteo(tmp_path / "raw/day_1.tsv"))  # parses as strict Criteo
    labels = np.concatenate([c.labels for c in chunks])
    keys = np.concatenate([c.onehot for c in chunks])
    assert labels.size == 4000 and abs(labels.mean() - report["ctr_last_day"]) < 1e-12
    assert (keys == -1).any()  # missing categorical values occur
    assert keys.max() > 2**24  # ids are spread over 32-bit hashes
    distinct = [np.unique(keys[:, f][keys[:, f] >= 0]).size for f in range(26)]
    assert max(distinct) <= 2000 and distinct[8] <= 3  # cap, and C9 keeps Kaggle's 3 values
    text = (tmp_path / "raw/day_0.tsv").read_text()
    assert "\t\t" in text and "\t-" in text  # empty fields and negative counts, as in Criteo


def test_deterministic_by_seed(tmp_path):
    generate(tmp_path / "a", seed=5, **SMALL)
    generate(tmp_path / "b", seed=5, **SMALL)
    generate(tmp_path / "c", seed=6, **SMALL)
    a = (tmp_path / "a/day_1.tsv").read_bytes()
    assert a == (tmp_path / "b/day_1.tsv").read_bytes()
    assert a != (tmp_path / "c/day_1.tsv").read_bytes()


def test_multihot_gzip(tmp_path):
    report = generate(
        tmp_path / "raw",
        seed=1,
        multi_hot=3,
        multi_hot_fields=("C1", "C3"),
        gzip=True,
        days=1,
        rows_per_day=2000,
        max_cardinality=500,
    )
    assert report["files"] == ["day_0.tsv.gz"] and report["multi_hot_fields"] == ["C1", "C3"]
    with gzip.open(tmp_path / "raw/day_0.tsv.gz", "rt") as f:
        assert "," in f.readline()
    chunks = list(read_criteo(tmp_path / "raw/day_0.tsv.gz", multihot=("C1", "C3")))
    lengths = np.concatenate([c.multihot["C3"][1] for c in chunks])
    assert 2.0 < lengths[lengths > 0].mean() < 4.0 and lengths.max() <= 9


def test_refuses_non_empty_out(tmp_path):
    (tmp_path / "raw").mkdir()
    (tmp_path / "raw/x").write_text("")
    with pytest.raises(DataError, match="not empty"):
        generate(tmp_path / "raw", **SMALL)


def test_teacher_auc_is_the_metrics_auc():
    # One AUC in the code base: the generator reports the teacher with metrics' (tested
    # in test_metrics.py), not a copy of its own.
    assert synth.auc is classification.auc


def test_format_tsv_matches_python_formatting():
    cfg = SynthConfig(max_cardinality=300, multi_hot=2, multi_hot_fields=("C2",))
    teacher = Teacher(cfg)
    rows, _, labels = teacher.sample(np.random.default_rng(7), 500)
    rows["dense"][:4, 0] = [-3, 0, 999_999_999, 12345]  # sign, zero and the widest value
    expected = []
    for i in range(500):
        fields = [str(labels[i])] + ["" if v == -9 else str(v) for v in rows["dense"][i]]
        for f, c in enumerate(rows["cats"]):
            if teacher.multihot[f]:
                ids, lengths = c
                start = lengths[:i].sum()
                bag = ids[start : start + lengths[i]]
                fields.append(",".join(f"{teacher.hex_values[f][k]:08x}" for k in bag))
            else:
                fields.append("" if c[i] < 0 else f"{teacher.hex_values[f][c[i]]:08x}")
        expected.append("\t".join(fields) + "\n")
    assert format_tsv(teacher, rows, labels).decode() == "".join(expected)


def test_a_killed_runs_leftovers_are_removed_and_the_rerun_goes_on(tmp_path):
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)
    dead = int(proc.stdout)  # exited and reaped: what a killed run's pid is
    out = tmp_path / "raw"
    out.mkdir()
    stale = [out / f"day_0.tsv.tmp-{dead}", out / f"teacher.json.tmp-{dead}"]
    for p in stale:
        p.write_text("partial")
    with pytest.warns(HybridrecWarning, match=re.escape(f"removed what an interrupted run left: {stale[0]}, {stale[1]}") + "$"):
        generate(out, days=1, rows_per_day=100, max_cardinality=50)
    assert sorted(p.name for p in out.iterdir()) == ["day_0.tsv", "teacher.json"]


def test_rerun_message_names_the_cli_option(tmp_path):
    generate(tmp_path / "raw", days=1, rows_per_day=100, max_cardinality=50)
    with pytest.raises(DataError) as e:
        generate(tmp_path / "raw", days=1, rows_per_day=100, max_cardinality=50)
    assert str(e.value) == f"{tmp_path / 'raw'}: not empty (use --overwrite to replace its day files)"
