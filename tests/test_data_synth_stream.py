"""A drifting stream of synthetic Criteo hours (`hybridrec data synth --stream`)."""

from __future__ import annotations

import gzip
import json
import threading
import time

import numpy as np
import pytest

from hybridrec.cli.main import main
from hybridrec.data.chunk import ParseReport
from hybridrec.data.criteo import CATEGORICAL, CriteoReader
from hybridrec.data.synth import SynthConfig
from hybridrec.data.synth_stream import StreamTeacher, generate_stream
from hybridrec.errors import ConfigError, DataError, HybridrecWarning

SMALL = {"rows_per_hour": 3000, "scale": 0.003, "max_cardinality": 2000}
HOURS = ["hour_0000.tsv", "hour_0001.tsv", "hour_0002.tsv"]


def _read(path):
    """Labels and keys ``[n, 26]`` (-1 missing) of one file, parsed as strict Criteo."""
    chunks = [c for c, _ in CriteoReader().read(path, ParseReport())]
    return np.concatenate([c.labels for c in chunks]), np.concatenate([c.onehot for c in chunks])


def _keys(onehot, f):
    col = onehot[:, f]
    return set(col[col >= 0].tolist())


def test_hours_land_parse_and_report(tmp_path):
    out = tmp_path / "s"
    report = generate_stream(out, hours=3, seed=1, **SMALL)
    assert sorted(p.name for p in out.iterdir()) == [*HOURS, "stream.json"]  # no temporaries
    assert json.loads((out / "stream.json").read_text()) == report and report["complete"]
    assert [h["file"] for h in report["hours"]] == HOURS
    for name, h in zip(HOURS, report["hours"]):
        labels, keys = _read(out / name)
        assert labels.size == h["rows"] == 3000
        assert h["ctr"] == pytest.approx(labels.mean(), abs=1e-12)
        assert 0.2 < h["ctr"] < 0.3  # the intercept is calibrated again every hour
        assert 0.7 < h["teacher_auc"] < 0.97  # the ceiling: far above chance
        assert (keys == -1).any() and keys.max() > 2**24  # missing values, 32-bit hashes
    mtimes = [(out / n).stat().st_mtime_ns for n in HOURS]
    assert mtimes == sorted(mtimes)  # written one after the other


def test_deterministic_by_seed_and_a_longer_stream_starts_alike(tmp_path):
    generate_stream(tmp_path / "a", hours=3, seed=5, **SMALL)
    generate_stream(tmp_path / "b", hours=2, seed=5, **SMALL)
    generate_stream(tmp_path / "c", hours=3, seed=6, **SMALL)
    generate_stream(tmp_path / "z", hours=2, seed=5, gzip=True, **SMALL)
    generate_stream(tmp_path / "z2", hours=2, seed=5, gzip=True, **SMALL)
    for name in HOURS[:2]:
        a = (tmp_path / "a" / name).read_bytes()
        assert a == (tmp_path / "b" / name).read_bytes()
        assert a != (tmp_path / "c" / name).read_bytes()
        z = (tmp_path / "z" / f"{name}.gz").read_bytes()
        assert z == (tmp_path / "z2" / f"{name}.gz").read_bytes()  # no time stamp in the gzip
        assert gzip.decompress(z) == a
    ra, rb = (json.loads((tmp_path / d / "stream.json").read_text()) for d in "ab")
    assert ra["hours"][:2] == rb["hours"]


def test_live_and_distinct_ids_match_the_files(tmp_path):
    out = tmp_path / "s"
    report = generate_stream(out, hours=3, seed=2, drift=0.2, **SMALL)
    teacher = StreamTeacher(SynthConfig(seed=2, scale=0.003, max_cardinality=2000))
    so_far = [set() for _ in CATEGORICAL]
    for hour, h in enumerate(report["hours"]):
        if hour:
            births = teacher.advance(0.2)
            assert h["born"]["total"] == sum(births) > 0
        _, keys = _read(out / h["file"])
        assert h["live_ids"]["total"] == sum(live.size for live in teacher.live)
        for f, name in enumerate(CATEGORICAL):
            live = set(teacher.hex_values[f][teacher.live[f]].tolist())
            assert h["live_ids"][name] == len(live) == teacher.cards[f]
            seen = _keys(keys, f)
            assert seen <= live  # only live ids occur
            so_far[f] |= seen
            assert h["ids_in_hour"][name] == len(seen)
            assert h["distinct_ids_so_far"][name] == len(so_far[f])
            assert h["ids_born_so_far"][name] == teacher.hex_values[f].size
        assert h["distinct_ids_so_far"]["total"] == sum(map(len, so_far))
    for values in teacher.hex_values:  # a new id's key was never used before
        assert np.unique(values).size == values.size


def test_ids_die_and_are_born(tmp_path):
    out = tmp_path / "s"
    generate_stream(out, hours=4, seed=3, drift=0.3, **SMALL)
    hours = [_read(out / f"hour_{h:04d}.tsv")[1] for h in range(4)]
    teacher = StreamTeacher(SynthConfig(seed=3, scale=0.003, max_cardinality=2000))
    initial = [set(v.tolist()) for v in teacher.hex_values]
    f = CATEGORICAL.index("C4")  # 2000 live ids at this scale (capped)
    first = _keys(hours[0], f)
    later = set().union(*(_keys(k, f) for k in hours[1:]))
    assert len(first - later) > 100  # keys of hour 0 that never come back: their ids died
    coverage = []
    for hour, keys in enumerate(hours):
        if hour:
            teacher.advance(0.3)
            born = set(teacher.hex_values[f][-(teacher.hex_values[f].size - len(initial[f])):].tolist())
            earlier = set().union(*(_keys(k, f) for k in hours[:hour]))
            new = _keys(keys, f) - earlier - initial[f]
            assert len(new) > 50 and new <= born  # new keys, of ids born since hour 0
        col = keys[:, f]
        coverage.append(np.isin(col[col >= 0], list(first)).mean())
    # A vocabulary frozen on hour 0 covers less of every later hour.
    assert coverage[0] == 1.0 and coverage[1] > coverage[2] > coverage[3] and coverage[3] < 0.7


def test_no_drift_keeps_the_vocabulary(tmp_path):
    report = generate_stream(tmp_path / "s", hours=2, seed=4, drift=0.0, **SMALL)
    assert report["hours"][1]["born"]["total"] == 0
    assert report["hours"][1]["ids_born_so_far"] == report["hours"][0]["live_ids"]


def test_land_every_spaces_the_landings(tmp_path):
    out = tmp_path / "s"
    landed, done = {}, threading.Event()

    def watch():  # (a last look after the generator returned: a busy machine may starve this thread)
        while True:
            last = done.is_set()
            for p in out.glob("hour_*.tsv") if out.is_dir() else ():
                landed.setdefault(p.name, time.monotonic())
            if last:
                return
            time.sleep(0.005)

    watcher = threading.Thread(target=watch)
    watcher.start()
    start = time.monotonic()
    try:
        generate_stream(out, hours=3, seed=0, land_every=0.3, rows_per_hour=500,
                        scale=0.003, max_cardinality=500)
    finally:
        done.set()
        watcher.join()
    took = time.monotonic() - start
    assert sorted(landed, key=landed.get) == HOURS  # in order
    gaps = np.diff([landed[n] for n in HOURS])
    assert (gaps > 0.2).all() and (gaps < 1.5).all(), gaps
    assert 0.55 < took < 10


def test_refuses_another_streams_hours_and_overwrite_touches_only_its_own(tmp_path):
    out = tmp_path / "s"
    out.mkdir()
    (out / "hour_0007.tsv").write_text("old\n")
    (out / "notes.txt").write_text("mine\n")
    with pytest.raises(DataError) as e:
        generate_stream(out, hours=1, **SMALL)
    assert str(e.value) == (f"{out}: holds hour files of another stream (hour_0007.tsv); "
                            "use --overwrite to replace them")
    assert sorted(p.name for p in out.iterdir()) == ["hour_0007.tsv", "notes.txt"]
    generate_stream(out, hours=1, overwrite=True, **SMALL)
    assert sorted(p.name for p in out.iterdir()) == ["hour_0000.tsv", "notes.txt", "stream.json"]
    assert (out / "notes.txt").read_text() == "mine\n"


def test_a_killed_streams_temporary_is_removed(tmp_path):
    out = tmp_path / "s"
    out.mkdir()
    (out / ".hour_0003.tsv.tmp").write_text("partial")
    with pytest.warns(HybridrecWarning, match="removed what an interrupted stream left"):
        generate_stream(out, hours=1, **SMALL)
    assert sorted(p.name for p in out.iterdir()) == ["hour_0000.tsv", "stream.json"]


def test_bad_settings_are_one_line():
    with pytest.raises(ConfigError, match="--drift 1.0 is not in"):
        generate_stream("unused", hours=1, drift=1.0)
    with pytest.raises(ConfigError, match="--hours and --rows-per-hour must be >= 1"):
        generate_stream("unused", hours=0)


def test_cli(tmp_path, capsys):
    out = tmp_path / "s"
    assert main(["data", "synth", "--stream", "--out", str(out), "--hours", "2",
                 "--rows-per-hour", "400", "--max-cardinality", "300", "--seed", "3",
                 "--drift", "0.2", "--gzip"]) == 0
    printed = capsys.readouterr().out.splitlines()
    assert len(printed) == 1 and printed[0].startswith("wrote 2 hour files (800 rows, ")
    assert sorted(p.name for p in out.iterdir()) == ["hour_0000.tsv.gz", "hour_0001.tsv.gz",
                                                     "stream.json"]
    report = json.loads((out / "stream.json").read_text())
    assert report["config"]["drift"] == 0.2 and report["config"]["teacher"]["scale"] == 0.003
    assert main(["data", "synth", "--stream", "--out", str(out), "--days", "2"]) == 2
    assert capsys.readouterr().err.strip() == ("hybridrec: error: --days: for day files; --stream "
                                               "writes hours (--hours, --rows-per-hour)")
    assert main(["data", "synth", "--out", str(tmp_path / "d"), "--land-every", "1"]) == 2
    assert capsys.readouterr().err.strip() == "hybridrec: error: --land-every: for a stream (add --stream)"
    assert main(["data", "synth", "--stream", "--out", str(out), "--hours", "1"]) == 2
    assert "use --overwrite" in capsys.readouterr().err
