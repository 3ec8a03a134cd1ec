"""Ids outside their tables are refused before any step: the per-file scan, its cache, the
check against meta.json (train and eval splits), preprocessing's own check, and
``hybridrec train`` / ``hybridrec data inspect`` ending in one line naming the file."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

from hybridrec.cli.main import main
from hybridrec.data import id_ranges
from hybridrec.data.encode import ModuloEncoder
from hybridrec.data.loader import ShardedLoader
from hybridrec.data.preprocess import preprocess_criteo
from hybridrec.errors import DataError

TABLE = 1000
ROWS = [300, 200]  # part-00000 is the train split, part-00001 the eval split


def _lines(rng: np.random.Generator, rows: int) -> str:
    """Criteo lines; C1 is multi-hot (0-2 ids), the rest one id each."""
    out = []
    for _ in range(rows):
        ids = rng.integers(0, 1 << 31, size=27)
        bag = ",".join(f"{k:08x}" for k in ids[: rng.integers(0, 3)])
        dense = [str(v) for v in rng.integers(0, 20, size=13)]
        out.append("\t".join([str(int(rng.integers(0, 2))), *dense, bag,
                              *(f"{k:08x}" for k in ids[1:26])]))
    return "\n".join(out) + "\n"


@pytest.fixture(scope="module")
def clean(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("id_ranges")
    rng = np.random.default_rng(0)
    days = []
    for d, rows in enumerate(ROWS):
        days.append(tmp / f"day_{d}.tsv")
        days[-1].write_text(_lines(rng, rows))
    preprocess_criteo(days, tmp / "ds", table_size=TABLE, multi_hot_fields="C1")
    return tmp / "ds"


@pytest.fixture
def ds(clean, tmp_path) -> Path:
    """A fresh copy to corrupt, opened once: a copy is new files (new inodes), which the
    cache, keyed by inode, size, mtime and ctime, scans once and then holds."""
    copy = Path(shutil.copytree(clean, tmp_path / "ds"))
    _open(copy, "train"), _open(copy, "eval")
    return copy


def _poke(path: Path, index: tuple, value: int) -> None:
    """Write one id in place (as a corrupted file would hold it)."""
    a = np.load(path, mmap_mode="r+")
    a[index] = value
    a.flush()
    del a


def _open(ds: Path, split: str = "train") -> ShardedLoader:
    return ShardedLoader(ds, split=split, batch_size=8, prefetch=0)


def _scans(monkeypatch) -> list:
    """Count the scans of id files (calls of column_ranges by the check)."""
    calls = []
    real = id_ranges.column_ranges

    def spy(ids):
        calls.append(ids.shape)
        return real(ids)

    monkeypatch.setattr(id_ranges, "column_ranges", spy)
    return calls


# -- the scan ---------------------------------------------------------------------------
def test_column_ranges_in_blocks_equal_numpy(monkeypatch):
    a = np.random.default_rng(1).integers(-5, 10**9, size=(1001, 7)).astype(np.int32)
    monkeypatch.setattr(id_ranges, "SCAN_BYTES", 7 * 4 * 64)  # 64 rows a block: 16 blocks
    assert id_ranges.column_ranges(a) == list(zip(a.min(0).tolist(), a.max(0).tolist()))
    assert id_ranges.column_ranges(a[:, 3]) == [(int(a[:, 3].min()), int(a[:, 3].max()))]
    assert id_ranges.column_ranges(np.zeros((0, 3), np.int32)) == [None] * 3


def test_range_problem_names_feature_id_and_table():
    assert id_ranges.range_problem("C7", (0, 99_999), 100_000) is None
    assert id_ranges.range_problem("C7", None, 1) is None
    assert (id_ranges.range_problem("C7", (3, 10**9), 100_000)
            == "feature C7 holds id 1000000000, past its table of 100,000 rows")
    assert id_ranges.range_problem("C7", (0, 100_000), 100_000).startswith("feature C7 holds id 100000,")
    assert (id_ranges.range_problem("C2", (-4, 7), 10)
            == "feature C2 holds id -4, a negative id (its table's rows are 0 to 9)")


# -- the check at load --------------------------------------------------------------------
def test_a_clean_dataset_opens_from_the_cache_preprocessing_wrote(clean, monkeypatch):
    cache = json.loads((clean / "part-00000" / id_ranges.CACHE_NAME).read_text())
    assert sorted(cache["files"]) == ["mh-C1.values.npy", "onehot.npy"]
    onehot = np.load(clean / "part-00000/onehot.npy")
    assert cache["files"]["onehot.npy"]["ranges"]["C2"] == [int(onehot[:, 0].min()), int(onehot[:, 0].max())]
    scans = _scans(monkeypatch)
    _open(clean, "train"), _open(clean, "eval")
    assert scans == []  # nothing rescanned: every file's key matches the cache


def test_a_same_size_rewrite_with_its_old_mtime_put_back_is_rescanned(ds, monkeypatch):
    """A shard rewritten at the same size, its mtime set back (``touch -r``), is not the
    file the cache describes: its bad id is found (the key of size and mtime alone kept
    the old ranges, and the id failed deep in torch)."""
    shard = ds / "part-00000/onehot.npy"
    before = shard.stat()
    bad = np.load(shard)
    bad[17, 6] = 10**9  # column 6 = C8
    tmp = ds / "onehot.tmp.npy"
    np.save(tmp, bad)
    assert tmp.stat().st_size == before.st_size
    shard.write_bytes(tmp.read_bytes())  # in place: the same inode
    tmp.unlink()
    os.utime(shard, ns=(before.st_atime_ns, before.st_mtime_ns))
    after = shard.stat()
    assert (after.st_ino, after.st_size, after.st_mtime_ns) == (before.st_ino, before.st_size, before.st_mtime_ns)
    scans = _scans(monkeypatch)
    with pytest.raises(DataError, match=r"part-00000/onehot.npy: feature C8 holds id 1000000000, past"):
        _open(ds)
    assert scans == [(ROWS[0], 25)]
    # replaced by another file of the same size and mtime (a new inode): rescanned too
    good = np.load(ds / "part-00000/onehot.npy")
    good[17, 6] = 0
    np.save(tmp, good)
    os.utime(tmp, ns=(before.st_atime_ns, before.st_mtime_ns))
    os.replace(tmp, shard)
    _open(ds)
    assert len(scans) == 2


def test_an_id_past_its_table_is_refused_naming_file_feature_id_and_size(ds, monkeypatch):
    _poke(ds / "part-00000/onehot.npy", (17, 6), 10**9)  # column 6 = C8 (C1 is multi-hot)
    scans = _scans(monkeypatch)
    with pytest.raises(DataError) as e:
        _open(ds)
    assert str(e.value) == (f"{ds}/part-00000/onehot.npy: feature C8 holds id 1000000000, past its "
                            f"table of 1,000 rows (meta.json num_embeddings)")
    assert scans == [(ROWS[0], 25)]  # the changed file only, once
    with pytest.raises(DataError, match="feature C8 holds id 1000000000"):
        _open(ds)  # again, now from the rewritten cache
    assert len(scans) == 1


def test_an_id_at_the_table_size_and_a_negative_id(ds):
    _poke(ds / "part-00001/onehot.npy", (0, 0), TABLE)  # the eval split's first C2
    with pytest.raises(DataError, match=r"part-00001/onehot.npy: feature C2 holds id 1000, past"):
        _open(ds, "eval")
    _open(ds, "train")  # the other split is fine
    # (Another file: one changed twice within the clock's tick could keep its mtime.)
    _poke(ds / "part-00000/onehot.npy", (3, 1), -3)
    with pytest.raises(DataError, match=r"part-00000/onehot.npy: feature C3 holds id -3, a negative id"):
        _open(ds, "train")


def test_a_multi_hot_id_past_its_table(ds):
    values = ds / "part-00000/mh-C1.values.npy"
    assert np.load(values).size > 0
    _poke(values, (-1,), TABLE + 5)
    with pytest.raises(DataError, match=r"mh-C1.values.npy: feature C1 holds id 1005, past its table"):
        _open(ds)


def test_a_lowered_num_embeddings_is_caught_with_the_cache(ds, monkeypatch):
    meta = json.loads((ds / "meta.json").read_text())
    top = int(np.load(ds / "part-00000/onehot.npy")[:, 4].max())  # C6
    meta["schema"]["features"][5]["num_embeddings"] = top  # one row too few
    (ds / "meta.json").write_text(json.dumps(meta))
    scans = _scans(monkeypatch)
    with pytest.raises(DataError, match=f"feature C6 holds id {top}, past its table of {top:,} rows"):
        _open(ds)
    assert scans == []


def test_a_cache_that_cannot_be_written_scans_every_time(ds, monkeypatch):
    for part in ("part-00000", "part-00001"):
        (ds / part / id_ranges.CACHE_NAME).unlink()
        (ds / part / id_ranges.CACHE_NAME).mkdir()  # neither readable nor replaceable
    scans = _scans(monkeypatch)
    _open(ds)
    _open(ds)
    assert len(scans) == 4  # two files, twice: no error, no cache
    assert not [p for p in (ds / "part-00000").iterdir() if ".tmp-" in p.name]
    _poke(ds / "part-00000/onehot.npy", (1, 1), TABLE)
    with pytest.raises(DataError, match="feature C3 holds id 1000"):
        _open(ds)


def test_a_read_only_dataset(ds, tmp_path, monkeypatch):
    """On a read-only mount (root only) opening scans and succeeds; nothing is written."""
    if shutil.which("mount") is None:
        pytest.skip("no mount command")
    for part in ("part-00000", "part-00001"):
        (ds / part / id_ranges.CACHE_NAME).unlink()
    ro = tmp_path / "ro"
    ro.mkdir()
    if subprocess.run(["mount", "--bind", str(ds), str(ro)], check=False, capture_output=True).returncode:
        pytest.skip("cannot bind-mount here")
    try:
        if subprocess.run(["mount", "-o", "remount,ro,bind", str(ro)],
                          check=False, capture_output=True).returncode:
            pytest.skip("cannot remount read-only here")
        scans = _scans(monkeypatch)
        _open(ro)
        assert len(scans) == 2 and not (ro / "part-00000" / id_ranges.CACHE_NAME).exists()
    finally:
        subprocess.run(["umount", str(ro)], check=True)


def test_a_stale_or_broken_cache_is_rescanned(ds, monkeypatch):
    cache = ds / "part-00000" / id_ranges.CACHE_NAME
    d = json.loads(cache.read_text())
    d["files"]["onehot.npy"]["ranges"]["C2"] = [0, "x"]
    cache.write_text(json.dumps(d))
    scans = _scans(monkeypatch)
    _open(ds)
    assert scans == [(ROWS[0], 25)]
    cache.write_text("{not json")
    _open(ds)
    assert len(scans) == 3


# -- preprocessing --------------------------------------------------------------------------
def test_preprocessing_refuses_an_id_its_encoder_got_wrong(tmp_path, monkeypatch):
    day = tmp_path / "day_0.tsv"
    day.write_text(_lines(np.random.default_rng(2), 20))

    def broken(self, keys):  # one id past the table, as a bug would write it
        ids = np.remainder(keys, self.table_size).astype(np.int32)
        ids[-1] = self.table_size
        return ids

    monkeypatch.setattr(ModuloEncoder, "__call__", broken)
    with pytest.raises(DataError) as e:
        preprocess_criteo([day], tmp_path / "ds", table_size=50, multi_hot_fields="C1")
    assert str(e.value).startswith(f"{day}: the encoding wrote an id out of its table: "
                                   "feature C2 holds id 50, past its table of 50 rows")
    assert not (tmp_path / "ds").exists()


# -- the command line ---------------------------------------------------------------------
def _error_line(capsys) -> str:
    err = capsys.readouterr().err
    lines = [x for x in err.splitlines() if x.startswith("hybridrec: error: ")]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0].removeprefix("hybridrec: error: ")


def test_train_refuses_a_corrupt_eval_shard_before_the_first_step(ds, tmp_path, capsys):
    _poke(ds / "part-00001/onehot.npy", (150, 3), 10**9)  # C5, in the eval split
    run = tmp_path / "run"
    code = main(["train", "--recipe", "demo", f"data.path={ds}", f"train.run_dir={run}",
                 "model.embedding_dim=4", "model.bottom_mlp=8,4", "model.top_mlp=8,1",
                 "data.batch_size=32", "train.max_steps=2", "train.progress=false"])
    assert code == 2
    assert _error_line(capsys) == (f"{ds}/part-00001/onehot.npy: feature C5 holds id 1000000000, past "
                                   "its table of 1,000 rows (meta.json num_embeddings)")
    assert not (run / "metrics.jsonl").exists() and not (run / "checkpoints").exists()


def test_inspect_checks_every_part(ds, capsys):
    assert main(["data", "inspect", str(ds)]) == 0
    assert "checked: 2 parts, their files whole and every id inside its table" in capsys.readouterr().out
    _poke(ds / "part-00001/onehot.npy", (0, 0), TABLE)
    assert main(["data", "inspect", str(ds)]) == 2
    assert _error_line(capsys).endswith("part-00001/onehot.npy: feature C2 holds id 1000, past its "
                                        "table of 1,000 rows (meta.json num_embeddings)")


def test_inspect_finds_a_shard_cut_short(ds, capsys):
    dense = ds / "part-00000/dense.npy"
    size = dense.stat().st_size
    os.truncate(dense, size - 100)
    assert main(["data", "inspect", str(ds)]) == 2
    assert _error_line(capsys) == (f"{dense}: truncated: {size - 100:,} bytes, its header's shape "
                                   f"({ROWS[0]}, 13) of float32 takes {size:,}")
    assert main(["data", "inspect", str(ds), "--json"]) == 2
    assert "truncated" in _error_line(capsys)


def test_inspect_finds_a_missing_shard(ds, capsys):
    (ds / "part-00001/mh-C1.offsets.npy").unlink()
    assert main(["data", "inspect", str(ds)]) == 2
    assert _error_line(capsys) == f"{ds}/part-00001/mh-C1.offsets.npy: missing"
    shutil.rmtree(ds / "part-00001")
    assert main(["data", "inspect", str(ds)]) == 2
    assert _error_line(capsys) == f"{ds}/meta.json: part directory part-00001 is missing"


def test_inspect_finds_a_header_that_is_not_npy(ds, capsys):
    (ds / "part-00000/labels.npy").write_bytes(b"not an array")
    assert main(["data", "inspect", str(ds)]) == 2
    assert _error_line(capsys).startswith(f"{ds}/part-00000/labels.npy: cannot read array (")

