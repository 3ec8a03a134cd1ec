"""`hybridrec report`: SVG charts and one HTML page of one run or several, from real runs
trained through the CLI; partial runs, errors, and the call at the end of training."""

import json
import logging
import re
import shutil
import subprocess
import sys
import time
import xml.etree.ElementTree as ET

import pytest

from hybridrec.bench import report
from hybridrec.bench.svg import Bar, BarGroup, Series, bar_svg, line_svg
from hybridrec.cli.main import main

SVG = "{http://www.w3.org/2000/svg}"
SMALL = ["model.embedding_dim=8", "model.bottom_mlp=16,8", "model.top_mlp=16,1",
         "data.batch_size=128", "data.eval_batch_size=1000", "train.progress=false",
         "train.epochs=2", "train.max_steps=20", "train.log_every=5", "train.eval_every=10"]
LINE_CHARTS = ("loss", "auc", "log_loss", "throughput")


@pytest.fixture(scope="module")
def runs(shared_dataset, tmp_path_factory):
    """Two finished one-process runs of 20 steps under one parent, another dense lr."""
    root = tmp_path_factory.mktemp("report")
    data = shared_dataset(days=2, rows=2000)
    out = []
    for name, lr in (("lr05", "0.05"), ("lr20", "0.2")):
        run = root / "runs" / name
        assert main(["train", "--recipe", "demo", f"data.path={data}", f"train.run_dir={run}",
                     *SMALL, f"optim.dense_lr={lr}"]) == 0
        out.append(run)
    return out


def _tree(path):
    return ET.parse(path).getroot()  # raises on anything that is not well-formed XML


def _series(path):
    """data-label -> [(x, y) pixels] of every line in an SVG."""
    return {p.get("data-label"): [tuple(map(float, xy.split(","))) for xy in
                                  p.get("points").split()]
            for p in _tree(path).iter(f"{SVG}polyline")}


def _records(run, split):
    return [r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())
            if r["split"] == split]


def test_one_run_report_has_every_chart_and_the_final_auc(runs, capsys):
    run = runs[0]
    assert main(["report", str(run)]) == 0
    out = run / "report"
    assert f"wrote {out / 'index.html'}" in capsys.readouterr().out
    summary = json.loads((run / "summary.json").read_text())
    auc = f"{summary['eval']['auc']:.4f}"
    html = (out / "index.html").read_text()
    page = _tree(out / "index.html")
    assert f"<th>final AUC</th><td>{auc}</td>" in html
    assert f"<th>final log loss</th><td>{summary['eval']['log_loss']:.4f}</td>" in html
    assert "<th>steps</th><td>20</td>" in html and "<th>world size</th><td>1</td>" in html
    assert "dim 8, bottom 16-8, top 16-1" in html and "partial" not in html
    assert "<th>failures</th><td>none recorded</td>" in html and "Failures and recoveries" not in html
    assert "<script" not in html and "http://" not in html.replace(
        'xmlns="http://www.w3.org/', "")  # self-contained: nothing fetched, no script
    for name in (*LINE_CHARTS, "bytes"):
        assert _tree(out / f"{name}.svg").tag == f"{SVG}svg"
    assert not (out / "predicted.svg").exists()  # one process: the ledger predicted nothing
    # The charts are inline too: one polyline per line chart, each labelled by the run.
    assert len(list(page.iter(f"{SVG}polyline"))) == len(LINE_CHARTS)
    for name in LINE_CHARTS:
        assert list(_series(out / f"{name}.svg")) == [run.name]
    # A point per record: loss at steps 5..20, AUC at the two evaluations (10 and 20).
    assert len(_series(out / "loss.svg")[run.name]) == len(_records(run, "train")) == 4
    assert len(_series(out / "auc.svg")[run.name]) == 2
    assert f">{auc}</text>" in (out / "auc.svg").read_text()  # the last AUC written beside it
    assert "nothing sent (one rank)" in (out / "bytes.svg").read_text()
    assert not list(out.glob(".*.tmp"))


def test_several_runs_side_by_side_one_line_per_run(runs, tmp_path, capsys):
    assert main(["report", *map(str, runs)]) == 0
    out = runs[0].parent / "report"  # default: the common parent + report
    assert f"wrote {out / 'index.html'} (2 runs)" in capsys.readouterr().out
    for name in LINE_CHARTS:
        lines = _series(out / f"{name}.svg")
        assert sorted(lines) == ["lr05", "lr20"], name
        assert lines["lr05"] != lines["lr20"]
    html = (out / "index.html").read_text()
    assert "<tr><th></th><th>lr05</th><th>lr20</th></tr>" in html
    assert '<tr class="differs"><th>optimizers</th>' in html  # dense lr 0.05 vs 0.2
    assert "<tr><th>model</th>" in html  # the same model: not marked
    for run in runs:
        auc = json.loads((run / "summary.json").read_text())["eval"]["auc"]
        assert f"<td>{auc:.4f}</td>" in html
    assert len(list(_tree(out / "index.html").iter(f"{SVG}polyline"))) == 2 * len(LINE_CHARTS)
    # --out elsewhere
    assert main(["report", *map(str, runs), "--out", str(tmp_path / "cmp")]) == 0
    assert sorted(_series(tmp_path / "cmp" / "auc.svg")) == ["lr05", "lr20"]


def test_runs_with_one_name_are_told_apart_by_their_parents(tmp_path):
    paths = [tmp_path / "dct" / "seed0", tmp_path / "base" / "seed0", tmp_path / "seed1"]
    assert report.labels(paths) == ["dct/seed0", "base/seed0", "seed1"]
    assert report.default_out(paths) == tmp_path / "report"


def test_a_directory_that_is_no_run_is_one_line_error(runs, tmp_path, capsys):
    assert main(["report", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert f"{tmp_path}: not a run directory (no metrics.jsonl and no summary.json)" in err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert main(["report", str(runs[0]), str(tmp_path / "missing"), "--out",
                 str(tmp_path / "out")]) == 2
    assert "missing: no such run directory" in capsys.readouterr().err
    assert not (tmp_path / "report").exists() and not (tmp_path / "out").exists()


def test_a_run_still_training_is_reported_as_partial(runs, tmp_path, capsys):
    run = tmp_path / "live"
    run.mkdir()
    shutil.copy(runs[0] / "config.json", run)
    lines = (runs[0] / "metrics.jsonl").read_text().splitlines()
    kept = [x for x in lines if json.loads(x)["step"] <= 10]  # stopped after step 10
    (run / "metrics.jsonl").write_text("\n".join(kept) + '\n{"step": 15, "spl')  # half a line
    assert main(["report", str(run)]) == 0
    err = capsys.readouterr().err
    assert "partial: no summary.json yet" in err and "up to step 10" in err
    html = (run / "report" / "index.html").read_text()
    assert "<th>status</th><td>partial</td>" in html and "partial: no summary.json yet" in html
    assert len(_series(run / "report" / "loss.svg")["live"]) == 2  # steps 5 and 10
    assert len(_series(run / "report" / "auc.svg")["live"]) == 1  # step 10
    assert "not JSON" not in html  # the unfinished last line is no fault


def test_summary_without_metrics_still_shows_final_numbers(runs, tmp_path, capsys):
    run = tmp_path / "copied"
    run.mkdir()
    shutil.copy(runs[0] / "summary.json", run)
    assert main(["report", str(run)]) == 0
    assert "no metrics.jsonl" in capsys.readouterr().err
    auc = json.loads((run / "summary.json").read_text())["eval"]["auc"]
    assert f"<th>final AUC</th><td>{auc:.4f}</td>" in (run / "report" / "index.html").read_text()
    assert len(_series(run / "report" / "auc.svg")["copied"]) == 2  # eval history + final
    assert _series(run / "report" / "loss.svg") == {}
    assert "no train records" in (run / "report" / "loss.svg").read_text()


def test_resumed_log_keeps_the_latest_records_of_each_step(tmp_path):
    def rec(step, split="train", loss=0.5):
        return json.dumps({"step": step, "split": split, "loss": loss})

    # Logged to step 30, resumed from the checkpoint at 20: steps 25 and 30 again.
    lines = [rec(10), rec(20), rec(20, "eval"), rec(25, loss=9.0), rec(30, loss=9.0),
             rec(30, "eval"), "garbage", rec(25, loss=0.25), rec(30, loss=0.3), rec(30, "eval")]
    (tmp_path / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    train, evals, notes = report.read_metrics(tmp_path / "metrics.jsonl")
    assert [(r["step"], r["loss"]) for r in train] == [(10, 0.5), (20, 0.5), (25, 0.25),
                                                       (30, 0.3)]
    assert [r["step"] for r in evals] == [20, 30]
    assert any("1 line(s) that are not JSON" in n for n in notes)
    assert any("went back to an earlier step 1 time(s)" in n for n in notes)


def test_write_report_never_raises_and_says_why(runs, tmp_path, caplog):
    reasons = []
    assert report.write_report(tmp_path, on_error=reasons.append) is None
    assert len(reasons) == 1 and "not a run directory" in reasons[0]
    run = tmp_path / "run"
    shutil.copytree(runs[0], run, ignore=shutil.ignore_patterns("report", "checkpoints"))
    (run / "report").write_text("a file where the report directory goes")
    with caplog.at_level(logging.WARNING, logger="hybridrec.bench.report"):
        assert report.write_report(run) is None
    assert f"report for {run} not written: {run / 'report'}: is a file, not a directory" in caplog.text
    (run / "report").unlink()
    assert report.write_report(run) == run / "report" / "index.html"


def test_write_report_is_fast_on_a_long_log_and_thins_lines_keeping_spikes(runs, tmp_path):
    run = tmp_path / "long"
    run.mkdir()
    shutil.copy(runs[0] / "summary.json", run)
    with open(run / "metrics.jsonl", "w") as f:
        for step in range(1, 10_001):
            loss = 5.0 if step == 5_003 else 0.5 + (step % 7) / 100
            f.write(json.dumps({"step": step, "split": "train", "time": 1.0 + step,
                                "loss": loss, "samples_per_sec": 20_000.0 + step}) + "\n")
    # (this process's CPU seconds, which other processes on a loaded machine do not stretch as
    # they stretch the wall clock; 0.08-0.32 s of wall clock on a loaded 2-core machine)
    start = time.process_time()
    assert report.write_report(run) is not None
    assert time.process_time() - start < 1.0
    points = _series(run / "report" / "loss.svg")["long"]
    assert 100 < len(points) <= 1500
    # The spike (loss 5 against 0.5-0.56) is the top of the axis: a point near the top.
    assert min(y for _, y in points) < 44 + 0.2 * 300


def test_charts_escape_labels_and_say_when_there_is_nothing():
    svg = line_svg([Series("a<b&c", [(0, 1.0), (10, 2.0)])], title="t", x_label="x",
                   y_label="y")
    assert ET.fromstring(svg.split("\n", 1)[1]).find(f".//{SVG}polyline").get(
        "data-label") == "a<b&c"
    assert "no data" in line_svg([Series("s", [])], title="t", x_label="x", y_label="y")
    assert "nothing here" in bar_svg([], title="t", x_label="x", empty="nothing here")
    bars = bar_svg([BarGroup("g<1>", [Bar("r", 10.0, second=40.0, second_text="before")])],
                   title="t", x_label="x")
    rects = ET.fromstring(bars.split("\n", 1)[1]).findall(f".//{SVG}rect[@data-group]")
    assert [(r.get("class"), r.get("data-group")) for r in rects] == [("bar", "g<1>"),
                                                                      ("bar second", "g<1>")]
    assert float(rects[0].get("width")) * 4 == pytest.approx(float(rects[1].get("width")), 0.02)


@pytest.mark.distributed
def test_two_rank_run_bytes_by_category_and_predicted_vs_counted(runs, tmp_path):
    data = json.loads((runs[0] / "config.json").read_text())["data"]["path"]
    run = tmp_path / "two"
    assert main(["train", "--recipe", "demo", f"data.path={data}", f"train.run_dir={run}",
                 *SMALL, "dist.nproc=2", "compress.embedding=fp16"]) == 0
    assert report.write_report(run) == run / "report" / "index.html"
    comm = json.loads((run / "summary.json").read_text())["comm"]
    bars = {(r.get("data-group"), r.get("class")) for r in
            _tree(run / "report" / "bytes.svg").iter(f"{SVG}rect") if r.get("data-group")}
    sent = comm["per_step"]["mean_by_category"]
    assert {g for g, _ in bars} == set(sent)
    # fp16 pooled embeddings: half the bytes, the float32 bytes drawn beside.
    assert ("output_dist", "bar second") in bars
    assert all(cls == "bar" for g, cls in bars if sent[g]["sent"] == sent[g]["original"])
    predicted = {r.get("data-group") for r in _tree(run / "report" / "predicted.svg").iter(
        f"{SVG}rect") if r.get("class") == "bar second"}
    assert predicted == set(comm["predicted_vs_counted"])
    html = (run / "report" / "index.html").read_text()
    assert "<th>world size</th><td>2</td>" in html and "embedding=fp16" in html
    assert re.search(r"<th>predicted = counted bytes</th><td>yes, all \d+ categories", html)


def _clock(t: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t))


@pytest.mark.distributed
def test_a_failure_and_its_partial_recovery_are_listed(runs, tmp_path, capsys):
    """Rank 1 killed after step 6 of 6 (checkpoint at 4), the ranks restarted, partial
    recovery: the report names when, the step, the rank, what the recovery kept and lost,
    and how long from the kill until training went on, from the run's own records."""
    data = json.loads((runs[0] / "config.json").read_text())["data"]["path"]
    run = tmp_path / "failed"
    proc = subprocess.run([sys.executable, "-m", "hybridrec", "train", "--recipe", "demo",
                           f"data.path={data}", f"train.run_dir={run}", *SMALL[:5],
                           "train.max_steps=6", "train.checkpoint_every=4", "dist.nproc=2",
                           "dist.timeout_s=30", "train.recovery=partial",
                           "train.inject_failure=1:6", "dist.max_restarts=1"],
                          capture_output=True, text=True, timeout=240, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    kill = json.loads((run / "failure_injected.json").read_text())
    (event,) = map(json.loads, (run / "recovery.jsonl").read_text().splitlines())
    took = f"{event['resumed_time'] - kill['time']:.1f} s ({event['restore_seconds']:.1f} s loading the state)"
    recovery = ("partial: rank 0 kept its state at step 6; the shards of rank 1 rolled back to "
                "step 4 (")
    assert main(["report", str(run)]) == 0
    out = capsys.readouterr().out
    assert (f"failed: {_clock(kill['time'])}: rank 1 killed after step 6 (train.inject_failure); "
            f"recovered in {took}: {recovery}") in out, out
    html = (run / "report" / "index.html").read_text()
    assert "<th>failures</th><td>1 (1 recovered; see below)</td>" in html
    assert "<h2>Failures and recoveries</h2>" in html
    row = re.search(r"<tr><td>([^<]*)</td><td>6</td><td>1</td><td>rank 1 killed after step 6 "
                    r"\(train.inject_failure\)</td><td>([^<]*)</td><td>([^<]*)</td></tr>", html)
    assert row is not None, html
    assert row[1] == _clock(kill["time"]) and row[2].startswith(recovery) and row[3] == took
    lost = sum(1 for s in event["shards"] if s["steps_lost"] == 2)
    assert lost > 0 and f"({lost} shards lost up to 2 steps of updates)" in row[2]


def test_failures_pair_each_recovery_with_the_kill_before_it():
    """Kills at steps 3, 5 and 9; recoveries after the second and the third: the first kill
    had none (e.g. the run stopped and was started again by hand from its checkpoint)."""
    kills = [{"rank": r, "step": s, "time": t} for r, s, t in ((0, 3, 100.0), (1, 5, 200.0), (1, 9, 300.0))]
    full = {"mode": "full", "checkpoint_step": 4, "failed_at_step": 5, "failed_ranks": [1], "survivors": [],
            "failed_at_time": 200.5, "resumed_at_step": 4, "restore_seconds": 0.25, "resumed_time": 203.0}
    partial = {"mode": "partial", "checkpoint_step": 8, "failed_at_step": 9, "failed_ranks": [1],
               "survivors": [0, 2], "failed_at_time": 300.2, "resumed_at_step": 9, "restore_seconds": 0.5,
               "resumed_time": 301.5, "deltas": {"1": {"step": 9, "pending_rows": 0}},
               "shards": [{"rank": 1, "steps_lost": 0}]}
    got = report.failures(list(reversed(kills)), [full, partial])
    assert [(f.step, f.ranks, f.took_s) for f in got] == [(3, [0], None), (5, [1], 3.0), (9, [1], 1.5)]
    assert got[0].recovery == "" and got[0].line().endswith("no recovery recorded")
    assert got[1].recovery == "full: every rank resumed from step 4; steps 5..5 trained again"
    assert got[2].recovery == ("partial: ranks 0, 2 kept their state at step 9; the shards of rank 1 "
                               "rolled back to their incremental saves (rank 1 to step 9)")
    # A recovery with no injected kill before it: the ranks its record names, from its own time.
    (crash,) = report.failures([], [full])
    assert (crash.what, crash.time, crash.took_s) == ("rank 1 failed after step 5", 200.5, 2.5)


def test_the_recovery_file_is_the_one_training_writes():
    from hybridrec.train.checkpointing.lost_work import EVENTS

    assert report.RECOVERY_FILE == EVENTS


def test_a_killed_parameter_server_and_its_partial_recovery_in_words():
    kill = {"rank": "ps1", "step": 6, "time": 100.0}
    partial = {"mode": "partial", "checkpoint_step": 4, "failed_at_step": 6, "failed_ranks": [], "survivors": [0, 1],
               "failed_servers": [1], "failed_at_time": 100.2, "resumed_at_step": 6, "restore_seconds": 0.4,
               "resumed_time": 102.0, "shards": [{"server": 1, "steps_lost": 2}, {"server": 0, "steps_lost": 0}]}
    (got,) = report.failures([kill], [partial])
    assert (got.what, got.ranks, got.took_s) == ("parameter server ps1 killed after step 6 (train.inject_failure)",
                                                  [], 2.0)
    assert got.recovery == ("partial: ranks 0, 1 kept their state at step 6; the shards of parameter server ps1 "
                            "rolled back to step 4 (1 shard lost up to 2 steps of updates)")
