"""Preprocessing: shards, meta.json, stats, vocabularies, atomicity."""

from __future__ import annotations

import json
import re
import warnings

import numpy as np
import pytest

from hybridrec.data import preprocess as pp
from hybridrec.data.preprocess import preprocess_criteo
from hybridrec.data.schema import DatasetMeta, FeatureSpec, Schema
from hybridrec.data.shards import read_id_counts, summarize_counts
from hybridrec.errors import ConfigError, DataError, HybridrecWarning


def line(label, c1, dense0="1", c2="0000000a") -> str:
    return "\t".join([str(label), dense0, *["2"] * 12, c1, c2, *["0000000b"] * 24])


@pytest.fixture
def days(tmp_path):
    spec = [
        [("1", "1"), ("0", "2"), ("0", "5"), ("1", "1")],  # day 0
        [("1", "3"), ("0", "7")],  # day 1
        [("0", "1"), ("1", "9")],
    ]  # day 2 (eval)
    paths = []
    for d, rows in enumerate(spec):
        p = tmp_path / f"day_{d}.tsv"
        p.write_text("".join(line(lab, c1, dense0=str(d)) + "\n" for lab, c1 in rows))
        paths.append(p)
    return paths


def test_modulo_shards_meta_and_stats(days, tmp_path):
    meta = preprocess_criteo(days, tmp_path / "ds", table_size=4)
    assert meta.path == tmp_path / "ds" and not list(tmp_path.glob("ds.tmp-*"))
    assert [p.rows for p in meta.parts] == [4, 2, 2]
    assert meta.splits == {"train": ["part-00000", "part-00001"], "eval": ["part-00002"]}
    part = tmp_path / "ds/part-00000"
    assert np.load(part / "labels.npy").tolist() == [1, 0, 0, 1]
    onehot = np.load(part / "onehot.npy", mmap_mode="r")
    assert onehot.dtype == np.int32 and onehot.shape == (4, 26)
    assert onehot[:, 0].tolist() == [1, 2, 1, 1] and (onehot[:, 1] == 10 % 4).all()
    dense = np.load(tmp_path / "ds/part-00001/dense.npy")
    assert dense.dtype == np.float32 and dense[0, 0] == np.float32(np.log(2.0))
    # Stats over the train split only: C1 ids 1,2,1,1,3,3.
    s = meta.stats["C1"]
    assert (s["num_embeddings"], s["distinct"], s["total_ids"]) == (4, 3, 6)
    assert s["mean_ids_per_sample"] == 1.0 and s["top1pct_share"] == 0.5
    assert s["top10pct_share"] == 0.5
    ids, counts = read_id_counts(tmp_path / "ds", s)
    assert (ids.tolist(), counts.tolist()) == ([1, 2, 3], [3, 1, 2])
    assert s["id_counts_file"] == "stats/C1.id_counts.npy"
    loaded = DatasetMeta.load(tmp_path / "ds")
    assert loaded.to_dict() == meta.to_dict()
    assert loaded.preprocessing["categorical"] == "modulo"


def test_min_count_vocabulary(days, tmp_path):
    meta = preprocess_criteo(days, tmp_path / "ds", min_count=2, table_size=None)
    assert meta.num_embeddings["C1"] == 2  # key 1 seen twice in train; rest -> 0
    assert np.load(tmp_path / "ds/part-00000/onehot.npy")[:, 0].tolist() == [1, 0, 0, 1]
    assert np.load(tmp_path / "ds/part-00002/onehot.npy")[:, 0].tolist() == [1, 0]
    assert np.load(tmp_path / "ds/vocab/C1.keys.npy").tolist() == [1]
    # With a table size too, keys are reduced first: 1,2,1,1,3,3 -> vocabulary {1, 3}.
    meta = preprocess_criteo(days, tmp_path / "ds2", min_count=2, table_size=4)
    assert meta.num_embeddings["C1"] == 3
    assert np.load(tmp_path / "ds2/part-00001/onehot.npy")[:, 0].tolist() == [2, 2]


def test_skip_mode_report_and_eval_parts(days, tmp_path):
    with open(days[1], "a") as f:
        f.write("1\tnot\ta\tline\n")
    meta = preprocess_criteo(
        days, tmp_path / "ds", table_size=8, on_bad_line="skip", eval_parts="day_0.tsv"
    )
    assert meta.report["bad_lines_skipped"] == 1 and meta.report["lines_read"] == 9
    assert "day_1.tsv:3: expected 40" in meta.report["bad_line_examples"][0]
    assert meta.splits == {"train": ["part-00001", "part-00002"], "eval": ["part-00000"]}


def test_multihot_shards(tmp_path):
    path = tmp_path / "d.tsv"
    path.write_text(line(1, "1,2,3") + "\n" + line(0, "") + "\n" + line(1, "4") + "\n")
    with pytest.warns(HybridrecWarning, match="no held-out split"):
        meta = preprocess_criteo([path], tmp_path / "ds", table_size=100, multi_hot_fields="C1")
    assert meta.schema.feature("C1").kind == "multihot" and len(meta.schema.onehot) == 25
    assert meta.splits == {"train": ["part-00000"], "eval": []}
    part = tmp_path / "ds/part-00000"
    assert np.load(part / "mh-C1.values.npy").tolist() == [1, 2, 3, 4]
    assert np.load(part / "mh-C1.offsets.npy").tolist() == [0, 3, 3, 4]
    assert meta.stats["C1"]["mean_ids_per_sample"] == pytest.approx(4 / 3)


def test_interrupted_run_leaves_nothing(days, tmp_path, monkeypatch):
    calls = []
    real = pp.PartWriter.append

    def failing(self, *a):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("disk full")
        real(self, *a)

    monkeypatch.setattr(pp.PartWriter, "append", failing)
    with pytest.raises(RuntimeError, match="disk full"):
        preprocess_criteo(days, tmp_path / "ds", table_size=4)
    assert not (tmp_path / "ds").exists()
    assert not list(tmp_path.glob("ds.tmp-*"))


def test_overwrite_rules(days, tmp_path):
    preprocess_criteo(days, tmp_path / "ds", table_size=4)
    with pytest.raises(DataError, match="already exists"):
        preprocess_criteo(days, tmp_path / "ds", table_size=4)
    meta = preprocess_criteo(days, tmp_path / "ds", table_size=8, overwrite=True)
    assert DatasetMeta.load(tmp_path / "ds").num_embeddings["C1"] == meta.num_embeddings["C1"] == 8
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine/notes.txt").write_text("keep me")
    with pytest.raises(DataError, match="not a hybridrec dataset"):
        preprocess_criteo(days, tmp_path / "mine", table_size=4, overwrite=True)
    assert (tmp_path / "mine/notes.txt").exists()


def test_bad_arguments(days, tmp_path):
    with pytest.raises(DataError, match="does not exist"):
        preprocess_criteo([tmp_path / "nope.tsv"], tmp_path / "ds", table_size=4)
    with pytest.raises(ConfigError, match="table_size"):
        preprocess_criteo(days, tmp_path / "ds", table_size=[4, 4])
    with pytest.raises(ConfigError, match="C99"):
        preprocess_criteo(days, tmp_path / "ds", table_size=4, multi_hot_fields="C99")


def test_meta_refuses_incomplete_or_foreign_dirs(days, tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match="no meta.json"):
        DatasetMeta.load(tmp_path / "empty")
    preprocess_criteo(days, tmp_path / "ds", table_size=4)
    meta_file = tmp_path / "ds/meta.json"
    d = json.loads(meta_file.read_text())
    meta_file.write_text(json.dumps({**d, "format_version": 99}))
    with pytest.raises(DataError, match="format_version 99 is not supported"):
        DatasetMeta.load(tmp_path / "ds")
    meta_file.write_text("{not json")
    with pytest.raises(DataError, match="meta.json:1: invalid JSON"):
        DatasetMeta.load(tmp_path / "ds")


def test_schema_json_round_trip():
    s = Schema(
        label="y",
        dense=["a"],
        features=[
            FeatureSpec(name="f", num_embeddings=10),
            FeatureSpec(name="g", kind="multihot", num_embeddings=3),
        ],
    )
    assert Schema.from_json(s.to_json()) == s
    assert [f.name for f in s.onehot] == ["f"] and s.num_embeddings == {"f": 10, "g": 3}
    with pytest.raises(DataError, match="kind"):
        FeatureSpec(name="h", kind="dense", num_embeddings=1)
    with pytest.raises(DataError, match="duplicate"):
        Schema(label="f", features=[FeatureSpec(name="f", num_embeddings=1)])


def _dead_pid() -> int:
    """The pid of a process that has exited (and been reaped)."""
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)
    return int(proc.stdout)


def test_a_killed_runs_leftover_is_removed_with_a_warning(days, tmp_path):
    stale = tmp_path / f"ds.tmp-{_dead_pid()}"
    (stale / "part-00000").mkdir(parents=True)
    other = tmp_path / f"dsx.tmp-{_dead_pid()}"  # another output's: not ours to touch
    other.mkdir()
    with pytest.warns(HybridrecWarning, match=re.escape(f"removed what an interrupted run left: {stale}") + "$"):
        preprocess_criteo(days, tmp_path / "ds", table_size=4)
    assert not stale.exists() and other.exists()
    assert DatasetMeta.load(tmp_path / "ds").splits["eval"] == ["part-00002"]


def test_a_running_processes_tmp_dir_is_named_not_removed(days, tmp_path):
    import subprocess
    import sys

    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        live = tmp_path / f"ds.tmp-{proc.pid}"
        live.mkdir()
        with pytest.warns(HybridrecWarning, match=re.escape(f"{live}: being written by another process")):
            preprocess_criteo(days, tmp_path / "ds", table_size=4)
        assert live.is_dir()
    finally:
        proc.kill()
        proc.wait()


def test_one_input_warns_that_there_is_no_held_out_split(days, tmp_path):
    with pytest.warns(HybridrecWarning, match=r"day_0.tsv: the only input, so there is no held-out "
                      r"split and training will report AUC n/a; give two or more inputs"):
        meta = preprocess_criteo(days[:1], tmp_path / "ds", table_size=4)
    assert meta.splits["eval"] == []
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # named explicitly: no warning
        preprocess_criteo(days[:1], tmp_path / "ds2", table_size=4, eval_parts="none")
        preprocess_criteo(days[:2], tmp_path / "ds3", table_size=4)


def test_overwrite_message_names_the_cli_option(days, tmp_path):
    preprocess_criteo(days, tmp_path / "ds", table_size=4)
    with pytest.raises(DataError) as e:
        preprocess_criteo(days, tmp_path / "ds", table_size=4)
    assert str(e.value) == f"{tmp_path / 'ds'}: already exists (use --overwrite to replace it)"


class _DenseFeatureStats:
    """The counting of earlier versions, kept as the reference: one int64 count per table
    row in a memory-mapped ``stats/<feature>.counts.npy`` (so memory and files grew with
    the table size)."""

    def __init__(self, name, num_embeddings, stats_dir):
        stats_dir.mkdir(exist_ok=True)
        self.num_embeddings, self.rows = num_embeddings, 0
        self.counts_file = stats_dir / f"{name}.counts.npy"
        self._counts = np.lib.format.open_memmap(self.counts_file, mode="w+", dtype=np.int64,
                                                 shape=(num_embeddings,))

    def add(self, ids, rows):
        self.rows += rows
        u, c = np.unique(ids, return_counts=True)
        self._counts[u] += c

    def finish(self, dataset_dir):
        self._counts.flush()
        out = summarize_counts(np.asarray(self._counts), self.num_embeddings, self.rows)
        out["counts_file"] = str(self.counts_file.relative_to(dataset_dir))
        return out


@pytest.mark.slow
def test_sparse_counts_give_the_dense_counts_shards_and_meta(tmp_path, monkeypatch):
    """Tables far larger than the ids seen: the same shards and meta.json as the dense
    counts gave, and counts files that hold only the ids seen."""
    rng = np.random.default_rng(5)
    days = []
    for d in range(3):
        days.append(tmp_path / f"day_{d}.tsv")
        rows = []
        for _ in range(60):
            ids = rng.zipf(1.3, size=27) * 7919 + rng.integers(0, 3)
            bag = ",".join(f"{k % 2**32:08x}" for k in ids[: rng.integers(0, 4)])
            rows.append("\t".join([str(rng.integers(0, 2)), *map(str, rng.integers(0, 9, 13)),
                                   bag, *(f"{k % 2**32:08x}" for k in ids[1:26])]))
        days[-1].write_text("\n".join(rows) + "\n")
    sizes = "300000,C3=7,C9=1000"  # C3: more distinct ids than rows (dense is smaller there)
    new = preprocess_criteo(days, tmp_path / "new", table_size=sizes, multi_hot_fields="C1,C4")
    monkeypatch.setattr(pp, "FeatureStats", _DenseFeatureStats)
    old = preprocess_criteo(days, tmp_path / "old", table_size=sizes, multi_hot_fields="C1,C4")

    for path in sorted((tmp_path / "old").glob("part-*/*.npy")):
        assert path.read_bytes() == (tmp_path / "new" / path.relative_to(tmp_path / "old")).read_bytes()
    a, b = old.to_dict(), new.to_dict()
    for d in (a, b):
        d["report"].pop("seconds")
    a_stats, b_stats = a.pop("stats"), b.pop("stats")
    assert a == b
    assert list(a_stats) == list(b_stats) == [f"C{i}" for i in range(1, 27)]
    for name, s_old in a_stats.items():
        s_new = dict(b_stats[name])
        dense = np.load(tmp_path / "old" / s_old.pop("counts_file"))
        ids, counts = read_id_counts(tmp_path / "new", s_new)
        s_new.pop("id_counts_file")
        assert s_new == s_old, name
        assert ids.tolist() == np.flatnonzero(dense).tolist() and counts.tolist() == dense[ids].tolist()
        old_ids, old_counts = read_id_counts(tmp_path / "old", {"counts_file": f"stats/{name}.counts.npy"})
        assert (old_ids.tolist(), old_counts.tolist()) == (ids.tolist(), counts.tolist())
    c2 = a_stats["C2"]
    assert c2["num_embeddings"] == 300000 and 0 < c2["distinct"] <= 120 and c2["top1pct_share"] == 1.0
    assert a_stats["C3"]["distinct"] == 7 and a_stats["C3"]["top10pct_share"] < 1.0
    assert (tmp_path / "new/stats/C2.id_counts.npy").stat().st_size < 128 + 16 * 120
    assert (tmp_path / "old/stats/C2.counts.npy").stat().st_size > 8 * 300000
