"""Training on a stream (``data.stream``): the stream loader, dynamic tables' key maps,
test-then-train metrics, publishing, exactly-once across kills."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from distributed import run_ranks

from hybridrec.cli.main import main
from hybridrec.data.chunk import ParseReport
from hybridrec.data.criteo import CriteoReader
from hybridrec.data.stream import StreamLoader, is_stream_file, stream_meta
from hybridrec.errors import ConfigError, DataError
from hybridrec.model.embedding import EmbeddingBagCollection
from hybridrec.train.build import build_tables
from hybridrec.train.loop.sparse_optim import combined_sparse_optimizer
from hybridrec.train.loop.stream import (
    DynamicTables,
    OwnSlots,
    SnapshotBusy,
    StreamFeed,
    key_initial_values,
)
from hybridrec.train.setup.configure import build_config


def _lines(path: Path) -> int:
    return sum(1 for _ in open(path, "rb"))


def _copy_hours(src: Path, dst: Path, names: list[str] | None = None) -> Path:
    dst.mkdir(parents=True, exist_ok=True)
    for p in sorted(src.glob("hour_*.tsv")):
        if names is None or p.name in names:
            shutil.copyfile(p, dst / f".{p.name}.tmp")
            os.replace(dst / f".{p.name}.tmp", dst / p.name)  # (landed: renamed into place)
    return dst


def _loader(directory: Path, **kw) -> StreamLoader:
    meta = stream_meta(directory, "dynamic", "1000")
    args = {"schema": meta.schema, "encode": None, "batch_size": 128, "stop": "idle:0", "poll_s": 0.01,
            **kw}
    return StreamLoader(directory, **args)


def _label_sums(directory: Path) -> dict[str, float]:
    out = {}
    for p in sorted(directory.glob("hour_*.tsv")):
        out[p.name] = float(sum(c.labels.sum() for c, _ in CriteoReader().read(p, ParseReport())))
    return out


def test_names_that_are_not_landed_files():
    assert is_stream_file("hour_0001.tsv") and is_stream_file("day_0.gz") and is_stream_file("part-0001")
    for name in (".hour_0001.tsv.tmp", "hour_0001.tsv.tmp", "x.part", "_SUCCESS", "stream.json",
                 "f._COPYING_", "~lock"):
        assert not is_stream_file(name), name


def test_every_row_once_in_name_order_and_resume_exact(shared_stream, tmp_path):
    src = shared_stream(hours=3, rows=1000)
    d = _copy_hours(src, tmp_path / "s")
    (d / ".hour_0009.tsv.tmp").write_text("not landed yet\n")  # a producer's file being written
    loader = _loader(d)
    batches = list(loader)
    assert sum(b.batch_size for b in batches) == 3000
    assert [b.batch_size for b in batches[:-1]] == [128] * (len(batches) - 1)  # (the last one partial)
    assert [f["name"] for f in loader.files] == ["hour_0000.tsv", "hour_0001.tsv", "hour_0002.tsv"]
    assert all(f["done"] and f["rows"] == 1000 for f in loader.files)
    assert loader.stopped == "idle:0"
    labels = torch.cat([b.labels for b in batches])
    sums = _label_sums(d)
    assert float(labels.sum()) == pytest.approx(sum(sums.values()))

    # stop after 9 batches (mid second file), resume a new loader from the state
    first = _loader(d)
    it = iter(first)
    head = [next(it) for _ in range(9)]
    state = json.loads(json.dumps(first.state_dict()))  # (what a checkpoint keeps: JSON-able)
    assert [f["rows"] for f in state["files"]] == [1000, 152]
    second = _loader(d)
    second.load_state_dict(state)
    tail = list(second)
    got = torch.cat([b.labels for b in head + tail])
    assert torch.equal(got, labels)  # every row once, in the same order
    assert torch.equal(torch.cat([b.dense for b in head + tail]), torch.cat([b.dense for b in batches]))


def test_files_stop_and_late_files(shared_stream, tmp_path):
    src = shared_stream(hours=3, rows=1000)
    d = _copy_hours(src, tmp_path / "s", ["hour_0001.tsv", "hour_0002.tsv"])
    loader = _loader(d, stop="files:1")
    assert sum(b.batch_size for b in loader) == 1000
    assert loader.stopped == "files:1" and [f["name"] for f in loader.files] == ["hour_0001.tsv"]
    _copy_hours(src, d, ["hour_0000.tsv"])  # lands after hour_0001 was taken: out of order
    later = _loader(d, stop="files:2")
    later.load_state_dict(loader.state_dict())
    with pytest.warns(UserWarning, match="hour_0000.tsv: landed after hour_0001.tsv"):
        assert sum(b.batch_size for b in later) == 1000
    assert later.late == ["hour_0000.tsv"] and [f["name"] for f in later.files] == ["hour_0001.tsv", "hour_0002.tsv"]


def test_a_file_that_changes_after_landing_is_refused(shared_stream, tmp_path):
    src = shared_stream(hours=3, rows=1000)
    d = _copy_hours(src, tmp_path / "s", ["hour_0000.tsv"])
    loader = _loader(d)
    it = iter(loader)
    next(it)
    state = loader.state_dict()
    with open(d / "hour_0000.tsv", "ab") as f:  # a producer that appends after the rename
        f.write(b"0\t" + b"\t" * 38 + b"\n")
    with pytest.raises(DataError, match=r"hour_0000.tsv: changed (while it was read|after it was picked up)"):
        list(it)
    again = _loader(d)
    again.load_state_dict(state)
    with pytest.raises(DataError, match="hour_0000.tsv: changed after it was picked up"):
        list(again)


def test_bad_lines_error_or_skip(shared_stream, tmp_path):
    src = shared_stream(hours=3, rows=1000)
    d = tmp_path / "s"
    d.mkdir()
    lines = (src / "hour_0000.tsv").read_bytes().splitlines(keepends=True)
    lines[5] = b"1\tnot-a-number" + b"\t" * 38 + b"\n"
    (d / "hour_0000.tsv").write_bytes(b"".join(lines[:300]))
    with pytest.raises(DataError, match=r"hour_0000.tsv:6:"):
        list(_loader(d))
    skip = _loader(d, on_bad_line="skip", show=lambda msg: None)
    assert sum(b.batch_size for b in skip) == 299
    assert skip.files[0]["bad_lines"] == 1 and skip.files[0]["rows"] == 299
    # a rank parses its own lines only: a bad field in another rank's line is not its error
    mine = CriteoReader(rows_of=lambda n: np.arange(1, n, 2))
    with pytest.raises(DataError, match=r"hour_0000.tsv:6:"):
        list(mine.read(d / "hour_0000.tsv", ParseReport()))
    other = CriteoReader(rows_of=lambda n: np.arange(0, n, 2))
    assert sum(len(c) for c, _ in other.read(d / "hour_0000.tsv", ParseReport())) == 150


def test_a_stream_option_without_its_tables_is_refused():
    with pytest.raises(ConfigError, match="model.tables=dynamic"):
        build_config(overrides=["data.stream=/x"])
    with pytest.raises(ConfigError, match="needs data.stream"):
        build_config(overrides=["data.path=/x", "model.tables=dynamic"])
    with pytest.raises(ConfigError, match="data.stream_stop"):
        build_config(overrides=["data.stream=/x", "model.tables=modulo", "data.stream_stop=soon"])
    with pytest.raises(ConfigError, match="no held-out split"):
        build_config(overrides=["data.stream=/x", "model.tables=modulo", "train.eval_every=10"])
    # parameter servers take a stream; partial recovery of one does not exist yet
    build_config(overrides=["data.stream=/x", "model.tables=dynamic", "dist.num_ps=2"])
    with pytest.raises(ConfigError, match="train.recovery=partial"):
        build_config(overrides=["data.stream=/x", "model.tables=dynamic", "dist.num_ps=2", "train.recovery=partial"])


def _dynamic(rows: int = 1001, topo=None, reset=None):
    cfg = build_config(overrides=["data.stream=/x", "model.tables=dynamic", f"model.table_rows={rows - 1}"])
    meta = stream_meta("/x", "dynamic", str(rows - 1))
    tables = build_tables(meta, cfg)
    ebc = EmbeddingBagCollection(tables, seed=0)
    opt = combined_sparse_optimizer("rowwise_adagrad", ebc, lr=0.1)
    dyn = DynamicTables({t.name: t.num_embeddings for t in tables}, admit_after=1, evict="lru", ttl_steps=0,
                        seed=0, model_sparse=ebc, sparse_opt=opt, topo=topo, reset=reset,
                        dims={t.name: t.embedding_dim for t in tables})
    return dyn, ebc, opt


def test_dynamic_tables_map_keys_to_their_own_rows_and_reset_fresh_rows(shared_stream, tmp_path):
    dyn, ebc, opt = _dynamic()
    batch = next(iter(_loader(shared_stream(hours=3, rows=1000), batch_size=64)))
    raw = batch.sparse.values.clone()
    weight = ebc.table_weight("C3")
    group, start, n = ebc.table_slice("C3")
    acc = opt.optimizers["tables"].row_state(group)["sum"][start:start + n]  # (C3's rows of its fused group)
    weight.data.fill_(7.0)
    acc.fill_(3.0)
    mapped = dyn.map_batch(batch)
    ids, keys = mapped.sparse.values.numpy(), raw.numpy()
    for f in range(26):
        k, r = keys[f * 64:(f + 1) * 64], ids[f * 64:(f + 1) * 64]
        pairs = set(zip(k.tolist(), r.tolist(), strict=True))
        live = {(a, b) for a, b in pairs if a >= 0}
        assert all(b > 0 for _, b in live)  # (room for every key: each admitted at its first sight)
        assert len({a for a, _ in live}) == len({b for _, b in live})  # collisionless: a row per key
        assert all(b == 0 for a, b in pairs if a < 0)  # missing -> the shared row
    c3 = slice(2 * 64, 3 * 64)
    rows, k3 = ids[c3], keys[c3]
    got = weight[torch.from_numpy(rows[rows > 0])]
    want = key_initial_values(k3[rows > 0], "C3", 16, 1001, 0)
    assert torch.equal(got, want)  # a fresh row: the key's own initial values
    assert torch.all(acc[torch.from_numpy(rows[rows > 0])] == 0) and acc[0] == 3.0  # its optimizer state reset
    again = dyn.map_batch(batch)  # the same keys again: the same rows, nothing fresh
    assert torch.equal(again.sparse.values, mapped.sparse.values)
    state = dyn.state_dict()
    other, _, _ = _dynamic()
    other.load_state_dict(state)
    assert torch.equal(other.map_batch(batch).sparse.values, mapped.sparse.values)


def test_a_checkpoint_during_a_chunks_mapping_resets_its_fresh_rows_after_a_load(shared_stream):
    """The feed holds the maps' lock only between a chunk's collectives, so a checkpoint can
    fall after a chunk's keys entered the maps and before its fresh rows were reset: the
    state names them (``pending``) and a load resets them before the next chunk (here the
    checkpoint is taken from inside the chunk's reset, the latest such moment)."""
    batch = next(iter(_loader(shared_stream(hours=3, rows=1000), batch_size=64)))
    taken = {}
    dyn, _, _ = _dynamic(reset=lambda step, rows: taken.setdefault("state", dyn.state_dict()))
    mapped = dyn.map_batch(batch)
    state = taken["state"]
    by_table = batch.sparse.values.view(26, 64)
    distinct = sum(len(torch.unique(k[k >= 0])) for k in by_table)  # (admit_after=1: each one fresh)
    assert state["step"] == 0 and len(state["pending"]) == distinct
    assert not len(dyn.state_dict()["pending"])  # (the chunk done: nothing pending)
    other, ebc, _ = _dynamic()
    other.load_state_dict(state)
    weight = ebc.table_weight("C3")
    weight.data.fill_(7.0)  # (the rows as a checkpoint taken before the reset holds them)
    again = other.map_batch(batch)  # (the keys are in the maps: not fresh, but reset as pending)
    assert torch.equal(again.sparse.values, mapped.sparse.values)
    rows = again.sparse.values[2 * 64:3 * 64]
    rows = rows[rows > 0]
    keys = batch.sparse.values[2 * 64:3 * 64]
    want = key_initial_values(keys[keys >= 0].numpy(), "C3", 16, 1001, 0)
    assert torch.equal(weight[rows], want) and other.fresh_rows == 0


def _save_while_the_peer_maps(topo, d: str) -> list:
    """Rank 0's feed is in its first chunk's key exchange when rank 1's loop takes its maps'
    lock and starts a checkpoint's collective; then rank 1's feed starts the same chunk."""
    import torch.distributed as dist

    stream_group = dist.new_group(backend="gloo")
    dyn, _, _ = _dynamic(topo=topo)
    feed = StreamFeed(_loader(Path(d), batch_size=64, rank=topo.rank, world_size=2, group=stream_group), dyn)
    out = {}
    taker = threading.Thread(target=lambda: out.setdefault("batch", next(iter(feed))))  # (starts the feed)
    if topo.rank == 0:
        taker.start()
        time.sleep(0.5)
        with dyn.lock:  # (a checkpoint's saving: the lock, then the collectives)
            state = dyn.state_dict()
    else:
        with dyn.lock:
            taker.start()
            time.sleep(0.5)
            state = dyn.state_dict()
    taker.join(30)
    assert not taker.is_alive(), "no batch came from the feed"
    return [state["step"], out["batch"].sparse.values]


@pytest.mark.distributed
def test_a_checkpoint_while_a_peers_feed_maps_does_not_deadlock(shared_stream):
    """Two ranks: the loop's checkpoint (lock held through its collectives) and the feed's
    key exchange (on the stream's group) at once, in the order that once deadlocked."""
    ranks = run_ranks(_save_while_the_peer_maps, 2, str(shared_stream(hours=3, rows=1000)), timeout_s=40)
    assert ranks[0][0] == ranks[1][0] == 0  # (no chunk mapped yet when the checkpoint's maps were taken)
    assert all(len(r[1]) == 26 * 64 and bool((r[1] >= 0).all()) for r in ranks)  # (mapped: rows, not keys)


def _same_maps(a: dict, b: dict) -> bool:
    return all(torch.equal(a["tables"][f][k], b["tables"][f][k]) for f in a["tables"] for k in a["tables"][f])


def test_a_recovery_snapshot_of_the_key_maps(shared_stream, monkeypatch):
    """Partial recovery's pieces: a survivor loads its own slots (OwnSlots, per rank) over the
    checkpoint's maps and the step from the donor; a failed rank keeps the checkpoint's maps
    with the donor's step; a checkpoint holds no second copy; a lock the mapping keeps is
    waited for a bounded time, then the snapshot is refused."""
    import hybridrec.train.loop.stream as stream_mod

    dyn, _, _ = _dynamic()
    batches = iter(_loader(shared_stream(hours=3, rows=1000), batch_size=64))
    dyn.map_batch(next(batches))
    checkpoint = dyn.state_dict()
    dyn.map_batches([next(batches), next(batches)])
    assert OwnSlots(dyn).state_dict() == {}  # (a checkpoint's: keymaps has the slots)
    donor, own = dyn.snapshot_state(), OwnSlots(dyn).snapshot_state()
    assert donor == {"step": 3}
    survivor, _, _ = _dynamic()
    survivor.load_state_dict(checkpoint)
    OwnSlots(survivor).load_state_dict(own)
    survivor.load_state_dict(donor)
    assert survivor.step == 3 and _same_maps(survivor.state_dict(), dyn.state_dict())
    failed, _, _ = _dynamic()
    failed.load_state_dict(checkpoint)
    OwnSlots(failed).load_state_dict({})  # (nothing of a checkpoint's)
    failed.load_state_dict(donor)
    assert failed.step == 3 and _same_maps(failed.state_dict(), checkpoint)
    assert not _same_maps(checkpoint, dyn.state_dict())  # (keys mapped since the checkpoint: forgotten)
    busy, _, _ = _dynamic()
    monkeypatch.setattr(stream_mod, "SNAPSHOT_LOCK_WAIT_S", 0.1)
    taken, release = threading.Event(), threading.Event()

    def hold() -> None:
        with busy.lock:
            taken.set()
            release.wait(5)

    holder = threading.Thread(target=hold)
    holder.start()
    taken.wait(5)
    try:
        with pytest.raises(SnapshotBusy, match="roll back to the checkpoint"):
            OwnSlots(busy).snapshot_state()
    finally:
        release.set()
        holder.join()


def _train(args: list[str]) -> dict:
    assert main(["train", *args]) == 0
    run = Path(next(a.split("=", 1)[1] for a in args if a.startswith("train.run_dir=")))
    return json.loads((run / "summary.json").read_text())


STREAM_ARGS = ["model.tables=dynamic", "model.table_rows=3000", "data.batch_size=128", "train.progress=false",
               "data.stream_stop=idle:0", "data.stream_poll_s=0.05", "train.threads=1", "train.log_every=5",
               "train.progressive_window=2000", "model.bottom_mlp=32,16", "model.top_mlp=32,1"]


@pytest.mark.slow
def test_train_on_a_stream_publish_and_predict(shared_stream, tmp_path):
    d = shared_stream(hours=3, rows=1000)
    run = tmp_path / "run"
    s = _train([f"data.stream={d}", f"train.run_dir={run}", "train.publish_every=10", *STREAM_ARGS])
    assert [f["rows"] for f in s["stream"]["files"]] == [_lines(p) for p in sorted(d.glob("hour_*.tsv"))]
    assert s["stream"]["rows"] == 3000 and s["step"] == 24  # ceil(3000 / 128)
    assert 0.0 < s["progressive"]["auc"] < 1.0 and 0.0 < s["progressive"]["logloss"] < 10.0
    assert s["progressive"]["samples"] == 3000
    assert s["dynamic_tables"]["live"] > 0
    records = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert any(r["split"] == "progressive" and r.get("progressive_auc") is not None for r in records)
    last = [r for r in records if r["split"] == "stream"][-1]  # (each table's counts beside the totals)
    for k in ("live", "admitted", "evicted"):
        assert sum(v for name, v in last.items() if name.startswith(f"keys_{k}/")) == last[f"keys_{k}"]
    assert last["keys_live/C1"] > 0 and len([n for n in last if n.startswith("keys_live/")]) == 26
    # the summary's counts are the run's end's: none below the last logged ones (counts only grow)
    assert all(s["dynamic_tables"][k] >= last[f"keys_{k}"] for k in ("admitted", "evicted"))
    # published every 10 steps and at the end; LATEST names the newest; freshness per file
    assert (run / "published" / "LATEST").read_text().strip() == "v3"
    assert s["published"]["versions"] == 3
    assert all(f["freshness_s"] is not None for f in s["stream"]["files"])
    info = json.loads((run / "published" / "v3" / "published.json").read_text())
    assert info["trained_step"] == 24 and [f["rows"] for f in info["files"]] == [1000, 1000, 1000]
    # predict and the export's score.py map raw keys as training did
    out = tmp_path / "p.csv"
    assert main(["predict", str(run), str(d / "hour_0002.tsv"), "--out", str(out)]) == 0
    p = np.loadtxt(out, skiprows=1)
    art = run / "published" / "v3"
    subprocess.run([sys.executable, str(art / "score.py"), str(d / "hour_0002.tsv"), str(tmp_path / "q.csv")],
                   capture_output=True, text=True, check=True, cwd=art)
    q = np.loadtxt(tmp_path / "q.csv", skiprows=1)
    assert p.shape == (1000,) and np.allclose(p, q, atol=1e-5)
    # the same command again: the stream's files are trained, nothing more to do
    again = _train([f"data.stream={d}", f"train.run_dir={run}", "train.publish_every=10", *STREAM_ARGS])
    assert again["stream"]["rows"] == 3000 and again["step"] == 24


def _killed_and_again(args: list[str], run: Path, after_step: int) -> dict:
    """``hybridrec train ARGS`` killed (-9) once its checkpoint of ``after_step`` is there,
    then the same command again to the stream's end: its summary."""
    _kill_during([sys.executable, "-m", "hybridrec", "train", *args, "data.stream_stop=idle:30"], run,
                 {**os.environ, "PYTHONUNBUFFERED": "1"}, after_step)
    return _train([*args, "data.stream_stop=idle:0"])


def _kill_during(cmd: list[str], run: Path, env: dict, after_step: int) -> None:
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.time() + 240
    try:
        while time.time() < deadline and proc.poll() is None:
            ckpts = sorted((run / "checkpoints").glob("step-*")) if (run / "checkpoints").is_dir() else []
            if ckpts and int(ckpts[-1].name.split("-")[1].split(".")[0]) >= after_step:
                break
            time.sleep(0.1)
        assert proc.poll() is None, proc.stderr.read().decode()[-2000:]
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.wait()


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("nproc", [1, 2])
def test_killed_and_started_again_trains_every_row_once(shared_stream, tmp_path, nproc):
    d = shared_stream(hours=3, rows=1000)
    run = tmp_path / "run"
    args = [f"data.stream={d}", f"train.run_dir={run}", "train.checkpoint_every=3", f"dist.nproc={nproc}",
            *STREAM_ARGS]
    args = [a.replace("data.batch_size=128", f"data.batch_size={128 // nproc}") for a in args]
    s = _killed_and_again(args, run, after_step=6)
    assert [f["rows"] for f in s["stream"]["files"]] == [1000, 1000, 1000]
    assert s["stream"]["rows"] == 3000 and s["step"] == 24
    assert s["run"]["samples"] == 3000 and s["run"]["invocations"] == 2  # (the rows the checkpoints count)


def test_a_csv_stream_with_a_schema_file(tmp_path):
    d = tmp_path / "csv"
    d.mkdir()
    schema = tmp_path / "schema.json"
    schema.write_text(json.dumps({"label": "click", "dense": ["age"], "categorical": ["city", "ad"]}))
    rng = np.random.default_rng(0)
    for i in range(2):
        rows = ["click,age,city,ad"] + [f"{rng.integers(0, 2)},{rng.integers(0, 90)},c{rng.integers(0, 50)},"
                                        f"a{rng.integers(0, 500)}" for _ in range(300)]
        (d / f"part-{i}.csv").write_text("\n".join(rows) + "\n")
    meta = stream_meta(d, "dynamic", "1000", schema_file=schema)
    assert meta.schema.feature_names == ["city", "ad"] and meta.schema.dense == ["age"]
    loader = StreamLoader(d, schema=meta.schema, encode=None, batch_size=128, stop="idle:0", poll_s=0.01,
                          schema_file=schema)
    batches = list(loader)
    assert sum(b.batch_size for b in batches) == 600 and batches[0].dense.shape == (128, 1)
    assert [f["rows"] for f in loader.files] == [300, 300]
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"label": "click", "multihot": ["tags"]}))
    with pytest.raises(DataError, match="multi-hot columns"):
        stream_meta(d, "dynamic", "1000", schema_file=bad)


def _row_keys(run: Path) -> dict[str, np.ndarray]:
    from hybridrec.train.evaluate import load_run_model

    extra = load_run_model(run, checkpoint="latest")[4]
    return {f: np.asarray(t["row_key"]) for f, t in extra["keymaps"]["tables"].items()}


@pytest.mark.slow
@pytest.mark.distributed
def test_two_ranks_map_keys_as_one_process_and_maps_reshard(shared_stream, tmp_path):
    """The slots make the maps a function of the global batches: 2 ranks (batch 64 each) end
    with one process's (batch 128) maps, and a run that changes world size between files
    (1 process, then 2 ranks) too, with every row trained once."""
    d = shared_stream(hours=3, rows=1000)
    small = ["model.table_rows=300", "model.admit_after=2"]  # (keys evicted and admitted on the way)
    args1 = [a.replace("data.batch_size=128", "data.batch_size=200") for a in STREAM_ARGS]  # (5 per file)
    args2 = [a.replace("data.batch_size=128", "data.batch_size=100") for a in STREAM_ARGS]
    one = tmp_path / "one"
    s1 = _train([f"data.stream={d}", f"train.run_dir={one}", *args1, *small])
    assert s1["dynamic_tables"]["evicted"] > 0
    two = tmp_path / "two"
    s2 = _train([f"data.stream={d}", f"train.run_dir={two}", "dist.nproc=2", *args2, *small])
    assert s2["dynamic_tables"]["evicted"] == s1["dynamic_tables"]["evicted"]
    assert {f: t["evicted"] for f, t in s2["dynamic_tables"]["tables"].items()} == \
        {f: t["evicted"] for f, t in s1["dynamic_tables"]["tables"].items()}  # (per table, summed over ranks)
    a, b = _row_keys(one), _row_keys(two)
    assert all(np.array_equal(a[f], b[f]) for f in a)
    # resharded: one file on one process, then the rest on 2 ranks (the same global batch)
    mixed = tmp_path / "mixed"
    first = _train([f"data.stream={d}", f"train.run_dir={mixed}", *args1, *small, "data.stream_stop=files:1"])
    assert [f["rows"] for f in first["stream"]["files"]] == [1000]
    rest = _train([f"data.stream={d}", f"train.run_dir={mixed}", "dist.nproc=2", *args2, *small])
    assert [f["rows"] for f in rest["stream"]["files"]] == [1000, 1000, 1000]
    c = _row_keys(mixed)
    assert all(np.array_equal(a[f], c[f]) for f in a)



def _rank_rows(topo, d: str, batch: int, cut: int, bad: str) -> list:
    """This rank's batches (labels, keys feature-major): ``cut`` batches, the position saved,
    a new loader resumed from it to the end; the files' state; whether it parsed its rows only."""
    kw = {"batch_size": batch, "rank": topo.rank, "world_size": topo.group_size, "group": topo.group,
          "on_bad_line": bad}
    first = _loader(Path(d), **kw)
    it = iter(first)
    head = [next(it) for _ in range(cut)]
    second = _loader(Path(d), **kw)
    second.load_state_dict(json.loads(json.dumps(first.state_dict())))
    return [[(b.labels, b.sparse.values) for b in head + list(second)], second.files, first._own_rows]


@pytest.mark.distributed
@pytest.mark.parametrize("bad", ["error", "skip"])
def test_ranks_parse_their_own_rows_and_resume_exact(shared_stream, tmp_path, bad):
    """Rank r's rows of global batch t are its rows numbered i % 2 == r, parsed by that rank
    alone with on_bad_line=error (with skip every rank parses all): together one process's
    batches of twice the size, every row once across a resume mid-file."""
    d = _copy_hours(shared_stream(hours=3, rows=1000), tmp_path / "s")
    one = list(_loader(d, batch_size=256))
    ranks = run_ranks(_rank_rows, 2, str(d), 128, 9, bad)
    assert [r[2] for r in ranks] == [bad == "error"] * 2
    assert all(f["done"] and f["rows"] == 1000 for r in ranks for f in r[1])
    assert len(ranks[0][0]) == len(ranks[1][0]) == len(one)
    for t, b in enumerate(one):
        whole = b.sparse.values.view(len(b.sparse.keys), b.batch_size)  # (one id per bag, feature-major)
        for r in (0, 1):
            labels, values = ranks[r][0][t]
            assert torch.equal(labels, b.labels[r::2]), (t, r)
            assert torch.equal(values.view(len(b.sparse.keys), -1), whole[:, r::2]), (t, r)


PS_STREAM_ARGS = ["model.tables=dynamic", "model.table_rows=300", "model.admit_after=2", "train.progress=false",
                  "data.stream_stop=idle:0", "data.stream_poll_s=0.05", "train.threads=1", "train.log_every=5",
                  "train.progressive_window=2000", "model.embedding_dim=8", "model.bottom_mlp=16,8",
                  "model.top_mlp=16,1"]
"""A small model and tables of 300 rows (keys evicted and admitted on the way)."""


def _weights(run: Path) -> dict[str, torch.Tensor]:
    from hybridrec.train.evaluate import load_run_model

    return load_run_model(run, checkpoint="latest")[2].state_dict()


@pytest.mark.slow
@pytest.mark.distributed
def test_a_stream_with_dynamic_tables_on_parameter_servers(shared_stream, tmp_path):
    """2 trainers and 2 servers in lockstep (batch 32 each) train one process's model (batch
    64) on a stream with dynamic tables: the fresh rows start again on the servers (the key's
    values, the optimizer's state), every trainer's reset applied once; every row trained once;
    the published model predicts as one process's. Modulo tables on servers train too."""
    d = shared_stream(hours=3, rows=1000)
    one = _train([f"data.stream={d}", f"train.run_dir={tmp_path / 'one'}", "data.batch_size=64", *PS_STREAM_ARGS])
    ps = _train([f"data.stream={d}", f"train.run_dir={tmp_path / 'ps'}", "data.batch_size=32", "dist.nproc=2",
                 "dist.num_ps=2", "dist.ps_max_staleness=0", "train.publish_every=20", *PS_STREAM_ARGS])
    assert [f["rows"] for f in ps["stream"]["files"]] == [_lines(p) for p in sorted(d.glob("hour_*.tsv"))]
    assert ps["stream"]["rows"] == 3000 and ps["step"] == one["step"] == 47  # ceil(3000 / 64)
    counts = ("live", "admitted", "evicted", "fresh_rows")
    assert ps["dynamic_tables"]["evicted"] > 0
    assert {k: ps["dynamic_tables"][k] for k in counts} == {k: one["dynamic_tables"][k] for k in counts}
    assert ps["ps"]["rows_reset"] == ps["dynamic_tables"]["fresh_rows"]
    a, b = _weights(tmp_path / "one"), _weights(tmp_path / "ps")
    assert all(torch.allclose(a[k], b[k], rtol=1e-4, atol=1e-6) for k in a), \
        max(((a[k] - b[k]).abs().max().item(), k) for k in a)
    # published (the servers' rows in the export): predict maps raw keys as training did
    assert (tmp_path / "ps" / "published" / "LATEST").read_text().strip() == "v3"
    for run in ("one", "ps"):
        assert main(["predict", str(tmp_path / run), str(d / "hour_0002.tsv"), "--out", str(tmp_path / f"{run}.csv")]) == 0
    p, q = (np.loadtxt(tmp_path / f"{run}.csv", skiprows=1) for run in ("one", "ps"))
    assert p.shape == (1000,) and np.allclose(p, q, atol=1e-5)
    # modulo tables on the servers: nothing to reset
    mod = _train([f"data.stream={d}", f"train.run_dir={tmp_path / 'mod'}", "data.batch_size=64", "dist.num_ps=1",
                  *[a.replace("tables=dynamic", "tables=modulo") for a in PS_STREAM_ARGS]])
    assert [f["rows"] for f in mod["stream"]["files"]] == [1000, 1000, 1000] and mod["ps"]["rows_reset"] == 0


@pytest.mark.slow
@pytest.mark.distributed
def test_parameter_servers_killed_and_started_again_train_every_row_once(shared_stream, tmp_path):
    """kill -9 of the launcher of 2 trainers and a server mid-stream, the same command again:
    the trainers' checkpoint (the stream's position, the key maps) and the servers' part
    (the rows, reset ones included) resume together, every row trained once."""
    d = shared_stream(hours=3, rows=1000)
    run = tmp_path / "run"
    args = [f"data.stream={d}", f"train.run_dir={run}", "train.checkpoint_every=6", "dist.nproc=2", "dist.num_ps=1",
            "data.batch_size=32", *PS_STREAM_ARGS]
    s = _killed_and_again(args, run, after_step=12)
    assert [f["rows"] for f in s["stream"]["files"]] == [1000, 1000, 1000]
    assert s["stream"]["rows"] == 3000 and s["step"] == 47
    assert s["run"]["samples"] == 3000 and s["run"]["invocations"] == 2
    assert s["dynamic_tables"]["live"] > 0 and s["dynamic_tables"]["evicted"] > 0


@pytest.mark.slow
@pytest.mark.distributed
def test_partial_recovery_of_a_stream_trains_every_row_once(shared_stream, tmp_path):
    """Rank 1 dies after step 9 (the checkpoint is step 6): the survivor's snapshot holds its
    own slots of the key maps and the stream's position after step 9; the restarted run goes
    on from step 9 (no step trained again) and every file's rows are trained once."""
    d = shared_stream(hours=3, rows=1000)
    run = tmp_path / "run"
    args = [f"data.stream={d}", f"train.run_dir={run}", "train.checkpoint_every=6", "dist.nproc=2",
            "train.recovery=partial", "train.inject_failure=1:9", "dist.max_restarts=1", *STREAM_ARGS]
    args = [a.replace("data.batch_size=128", "data.batch_size=64") for a in args]
    cmd = [sys.executable, "-m", "hybridrec", "train", *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, check=False,
                          env={**os.environ, "PYTHONUNBUFFERED": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "resumed from step 9 (partial recovery" in proc.stderr, proc.stderr[-3000:]
    s = json.loads((run / "summary.json").read_text())
    assert [f["rows"] for f in s["stream"]["files"]] == [_lines(p) for p in sorted(d.glob("hour_*.tsv"))]
    assert s["stream"]["rows"] == 3000 and s["step"] == 24  # ceil(3000 / 128): no step twice
    (event,) = s["recovery"]["events"]
    assert (event["mode"], event["checkpoint_step"], event["failed_at_step"], event["resumed_at_step"]) == \
        ("partial", 6, 9, 9)
    assert event["failed_ranks"] == [1] and event["survivors"] == [0] and event["dense_steps_lost"] == 0
    records = [json.loads(x) for x in (run / "recovery.jsonl").read_text().splitlines()]
    assert [r["mode"] for r in records] == ["partial"]
    assert s["dynamic_tables"]["live"] > 0
