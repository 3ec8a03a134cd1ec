"""`hybridrec bench compression`: grammar, Pareto front, SVG writer, and short sweeps
(one process; two gloo ranks through torchrun)."""

import json
import xml.etree.ElementTree as ET

import pytest

from hybridrec.bench import compression_report as report
from hybridrec.bench.compression import (
    SweepSpec,
    build_settings,
    parse_grid,
    parse_seeds,
    parse_setting,
    run_sweep,
)
from hybridrec.bench.svg import Panel, Point, scatter_svg
from hybridrec.cli.main import main
from hybridrec.errors import ConfigError

SMALL = ["model.embedding_dim=8", "model.bottom_mlp=16,8", "model.top_mlp=16,1",
         "data.batch_size=64", "data.eval_batch_size=1000"]


# ---------------------------------------------------------------- grammar


def test_named_setting_bare_keys_are_compress_keys_and_lists_continue():
    s = parse_setting("big:embedding=dct, embedding_ratio=0.05,embedding_tables=C1,C2,"
                      "optim.dense_lr=0.05")
    assert s.name == "big"
    assert s.overrides == ("compress.embedding=dct", "compress.embedding_ratio=0.05",
                           "compress.embedding_tables=C1,C2", "optim.dense_lr=0.05")


def test_grids_one_setting_per_value_each_compressing_its_own_hop():
    dct = parse_grid("dense", "dct:0.01,0.001")
    assert [s.name for s in dct] == ["dense-dct-0.01", "dense-dct-0.001"]
    assert dct[1].overrides == ("compress.dense=dct", "compress.embedding=none",
                                "compress.dense_ratio=0.001")
    (psgd,) = parse_grid("dense", "powersgd:4")
    assert psgd.name == "dense-powersgd-r4" and "compress.powersgd_rank=4" in psgd.overrides
    (emb,) = parse_grid("embedding", "dct-fp16:0.05")
    assert emb.name == "emb-dct-fp16-0.05"
    assert emb.overrides == ("compress.dense=none", "compress.embedding=dct",
                             "compress.embedding_values=fp16", "compress.embedding_ratio=0.05")
    assert [s.name for s in parse_grid("embedding", "int8")] == ["emb-int8"]


def test_settings_start_with_the_baseline_and_cross_combines_the_hops():
    plain = build_settings(dense=["fp16"], embedding=["dct:0.1,0.2"], named=["x:embedding=bf16"])
    assert [s.name for s in plain] == ["baseline", "dense-fp16", "emb-dct-0.1", "emb-dct-0.2", "x"]
    assert plain[0].overrides == ("compress.dense=none", "compress.embedding=none")
    crossed = build_settings(dense=["topk:0.01"], embedding=["fp16", "dct:0.1"], cross=True)
    assert [s.name for s in crossed] == ["baseline", "dense-topk-0.01+emb-fp16",
                                         "dense-topk-0.01+emb-dct-0.1"]
    assert set(crossed[2].overrides) == {"compress.dense=topk", "compress.dense_ratio=0.01",
                                         "compress.embedding=dct", "compress.embedding_ratio=0.1"}


@pytest.mark.parametrize("kwargs, message", [
    ({"named": ["nocolon"]}, "expected NAME:KEY=VALUE"),
    ({"named": ["x:"]}, "expected NAME:KEY=VALUE"),
    ({"named": ["x:novalue"]}, "'novalue' is not KEY=VALUE"),
    ({"named": ["x:=3"]}, "has no key"),
    ({"named": ["a/b:embedding=fp16"]}, "names a directory"),
    ({"named": ["baseline:embedding=fp16"]}, "always included"),
    ({"named": ["x:train.seed=3"]}, "use --seeds"),
    ({"named": ["x:embedding=fp16", "x:embedding=bf16"]}, "defined twice"),
    ({"dense": ["gzip:0.1"]}, "unknown compressor 'gzip'; choose from dct"),
    ({"dense": ["none"]}, "baseline is always included"),
    ({"dense": ["dct"]}, "dct needs eta values, e.g. dct:0.01"),
    ({"dense": ["dct:0"]}, "'0' is not an eta in (0, 1]"),
    ({"dense": ["topk:1.5"]}, "is not an eta"),
    ({"dense": ["dct:abc"]}, "'abc' is not an eta"),
    ({"dense": ["dct:0.1,0.1"]}, "listed twice"),
    ({"dense": ["powersgd:0.5"]}, "'0.5' is not a rank >= 1"),
    ({"dense": ["fp16:0.5"]}, "fp16 takes no values"),
    ({"embedding": ["topk:0.1"]}, "unknown codec 'topk'"),
    ({"embedding": ["fp16"], "cross": True}, "--cross needs both"),
])
def test_bad_settings_are_clear_errors(kwargs, message):
    with pytest.raises(ConfigError, match=None) as e:
        build_settings(**kwargs)
    assert message in str(e.value)


def test_seeds():
    assert parse_seeds("0, 1,2") == [0, 1, 2]
    for bad in ("", "a", "1,1", "-1"):
        with pytest.raises(ConfigError, match="--seeds"):
            parse_seeds(bad)


def test_bad_keys_and_values_stop_the_sweep_before_any_run(dataset, tmp_path):
    def spec(*named, overrides=()):
        return SweepSpec(data=dataset, out=tmp_path / "s", settings=build_settings(named=named),
                         overrides=list(overrides))

    with pytest.raises(ConfigError, match="setting 'x': unknown config key 'compress.embeding'"):
        run_sweep(spec("x:embeding=dct"), echo=lambda _: None)
    with pytest.raises(ConfigError, match="setting 'x': compress.embedding_ratio must be in"):
        run_sweep(spec("x:embedding=dct,embedding_ratio=2"), echo=lambda _: None)
    with pytest.raises(ConfigError, match="train.max_steps is set by the sweep; use --max-steps"):
        run_sweep(spec(overrides=["train.max_steps=3"]), echo=lambda _: None)
    with pytest.raises(ConfigError, match="not a preprocessed dataset"):
        run_sweep(SweepSpec(data=tmp_path, out=tmp_path / "s", settings=build_settings()),
                  echo=lambda _: None)
    assert not (tmp_path / "s").exists()


# ---------------------------------------------------------------- Pareto front and plot


def test_a_failed_runs_error_is_the_ranks_own_line(tmp_path):
    from hybridrec.bench.compression import _last_error

    log = tmp_path / "train.log"
    log.write_text("$ python -m hybridrec train ...\nlaunching 2 ranks: hybridrec train ...\n"
                   "hybridrec: error: /data: dataset directory does not exist\n"
                   "hybridrec: error: rank 1 exited with code 2 (see above)\n")
    assert _last_error(log, 2) == "hybridrec: error: /data: dataset directory does not exist"


def test_pareto_front():
    pts = [(10.0, 0.70), (20.0, 0.75), (30.0, 0.74), (5.0, 0.60), (20.0, 0.75), (40.0, 0.76)]
    assert report.pareto_front(pts) == [True, True, False, True, True, True]
    # Same cost, lower quality: dominated. Lower is better for log loss.
    assert report.pareto_front([(1, 0.5), (1, 0.6)]) == [False, True]
    assert report.pareto_front([(1, 0.5), (1, 0.6)], maximize_y=False) == [True, False]
    assert report.pareto_front([]) == []


def _summary(sent: float, original: float, auc: float) -> dict:
    """A run's summary.json as far as the report reads it (one dense category)."""
    cat = {"sent": sent, "original": original}
    run = {"sent": 10 * sent, "original": 10 * original, "ratio": original / sent}
    return {"eval": {"auc": auc, "log_loss": 0.5, "ne": 0.9}, "step": 10, "world_size": 2,
            "throughput": {"samples_per_sec_overall": 1000.0},
            "comm": {"per_step": {"mean": cat, "mean_by_category": {"dense_allreduce": cat}},
                     "by_category": {"dense_allreduce": run}}}


def test_ratios_are_the_ratio_of_mean_bytes_not_the_mean_of_per_seed_ratios():
    # Seed 0 sends 100 B, seed 1 300 B of the same 30,000 original bytes per step:
    # per-seed ratios 300x and 100x (their mean, 200x, overstates); mean bytes give 150x.
    runs = [report.run_record({"seed": k, "status": "ok", "compress": {"dense": "topk",
                                                                       "dense_ratio": 0.01},
                               "summary": _summary(sent, 30_000.0, 0.75)})
            for k, sent in enumerate((100.0, 300.0))]
    assert [r["ratio"]["dense_allreduce"] for r in runs] == [300.0, 100.0]
    row = report.aggregate("dense-topk-0.01", runs)
    assert row["sent_per_step"]["dense_allreduce"] == 200.0
    assert row["ratio"]["dense_allreduce"] == pytest.approx(150.0)
    assert row["original_per_step"]["dense_allreduce"] == 30_000.0
    assert row["ratio"]["output_dist"] is None  # nothing sent: no ratio
    assert "200 B (150.0x)" in report._bytes_cell(row, "dense_allreduce")
    # A failed run's bytes do not enter the means.
    failed = {"seed": 2, "status": "failed", "compress": {}}
    assert report.aggregate("x", [*runs, failed])["ratio"] == row["ratio"]


def test_modelled_time_on_a_link_adds_the_bytes_at_line_rate():
    # 100 steps of 0.2 s each; rank 0 sends 1.25 MB and receives 2.5 MB per step: at 1 Gbit/s
    # the larger direction takes 20 ms, at 100 Mbit/s 200 ms.
    summary = _summary(1_250_000.0, 2_500_000.0, 0.75)
    summary["comm"]["per_step"]["mean"]["received"] = 2_500_000.0
    summary.update(step=100, throughput={"samples_per_sec_overall": 1.0, "measured_steps": 50,
                                         "measured_seconds": 10.0})
    rec = report.run_record({"seed": 0, "status": "ok", "compress": {}, "summary": summary})
    assert rec["step_seconds"] == pytest.approx(0.2)
    assert rec["modelled_seconds"]["1gbit"] == pytest.approx(100 * 0.22)
    assert rec["modelled_seconds"]["100mbit"] == pytest.approx(100 * 0.4)
    row = report.aggregate("x", [rec])
    assert report._time_cell(row, row, "100mbit") == "0.7 min (1.00x)"
    # A summary without the measured seconds has no modelled time.
    bare = report.run_record({"seed": 0, "status": "ok", "compress": {}, "summary": _summary(1.0, 1.0, 0.7)})
    assert "modelled_seconds" not in bare
    assert report._time_cell(report.aggregate("y", [bare]), row, "1gbit") == "n/a"


def _points(tree, panel):
    g = tree.findall("{http://www.w3.org/2000/svg}g")[panel]
    return {c.get("data-label"): "front" in c.get("class")
            for c in g.iter("{http://www.w3.org/2000/svg}circle")}


def test_svg_is_valid_xml_with_one_labelled_point_per_setting():
    pts = [Point("baseline", 80_000, 0.75, 0.002, True), Point("emb-dct-0.05", 9_000, 0.749),
           Point("a<b&c", 0, 0.70, 0.0, True)]  # 0 bytes (one process) and markup in a label
    svg = scatter_svg([Panel("AUC", "AUC", pts), Panel("empty", "log loss", [])], title="t & t",
                      x_label="bytes", x_format=report.fmt_bytes, x_base=1024)
    tree = ET.fromstring(svg.split("\n", 1)[1])
    assert _points(tree, 0) == {"baseline": True, "emb-dct-0.05": False, "a<b&c": True}
    assert _points(tree, 1) == {}
    assert "no finished runs" in svg and "a&lt;b&amp;c" in svg and ">0 B</text>" in svg
    assert len(tree.findall(".//{http://www.w3.org/2000/svg}polyline")) == 1
    ET.fromstring(scatter_svg([Panel("one", "y", [Point("only", 5, 1.0)])], title="",
                              x_label="x").split("\n", 1)[1])


def test_results_of_an_unfinished_sweep_say_so(tmp_path):
    spec = SweepSpec(data=tmp_path / "data", out=tmp_path, seeds=[0, 1],
                     settings=build_settings(embedding=["fp16"]))
    failed = {"seed": 0, "status": "failed", "seconds": 1.0, "error": "boom", "log": "x.log",
              "run_dir": "x", "compress": {"dense": "none", "embedding": "none"}}
    res = report.write_results(spec, {"baseline": [failed]}, complete=False)
    assert not res["complete"] and (res["runs_finished"], res["runs_total"]) == (1, 4)
    assert json.loads((tmp_path / "results.json").read_text()) == res
    md = (tmp_path / "results.md").read_text()
    assert "Partial: 1 of 4 runs finished" in md and "- `baseline` seed 0: boom" in md
    ET.fromstring((tmp_path / "pareto.svg").read_text().split("\n", 1)[1])
    assert not list(tmp_path.glob(".*.tmp"))  # no temporary file left behind


# ---------------------------------------------------------------- sweeps


@pytest.fixture(scope="module")
def dataset(shared_dataset):
    return shared_dataset(days=2, rows=2000)


@pytest.mark.slow
def test_one_process_sweep_reports_a_failure_continues_and_reuses_finished_runs(
        dataset, tmp_path, capsys):
    out = tmp_path / "sweep"

    def argv(*settings, steps=3):
        return ["bench", "compression", "--data", str(dataset), "--out", str(out),
                "--seeds", "0,1", "--max-steps", str(steps), *settings, "--", *SMALL]

    # data.shuffle_window=0 passes the config check and fails inside the run.
    assert main(argv("--setting", "broken:data.shuffle_window=0")) == 1
    printed = capsys.readouterr().out
    assert "[4/4] broken seed 1: FAILED" in printed and "shuffle_window" in printed
    res = json.loads((out / "results.json").read_text())
    assert res["complete"] and res["runs_finished"] == 4
    rows = {s["name"]: s for s in res["settings"]}
    assert list(rows) == ["baseline", "broken"]
    assert [r["status"] for r in rows["baseline"]["runs"]] == ["ok", "ok"]
    assert rows["baseline"]["auc"] is not None and rows["baseline"]["auc_std"] is not None
    assert rows["broken"]["runs_failed"] == 2 and rows["broken"]["auc"] is None
    assert (out / "broken" / "seed0.log").is_file()
    md = (out / "results.md").read_text()
    assert "| baseline | none | none |" in md and "| broken (2 failed) | none | none |" in md
    assert "Failed runs:" in md and "Partial" not in md
    tree = ET.fromstring((out / "pareto.svg").read_text().split("\n", 1)[1])
    assert set(_points(tree, 0)) == {"baseline"}  # one process: 0 bytes sent, at the edge
    # Again, without the broken setting: the finished runs are reused, not retrained.
    assert main(argv()) == 0
    assert capsys.readouterr().out.count("(reused)") == 2
    # Another step count: the finished runs are not silently mixed in.
    assert main(argv(steps=4)) == 1
    assert "pass --overwrite" in capsys.readouterr().out


@pytest.mark.distributed
def test_two_rank_sweep_codec_sends_fewer_pooled_embedding_bytes(dataset, tmp_path):
    out = tmp_path / "sweep"
    spec = SweepSpec(data=dataset, out=out, nproc=2, max_steps=4, overrides=SMALL,
                     settings=build_settings(embedding=["dct:0.25"]))
    lines = []
    res = run_sweep(spec, echo=lines.append)
    assert res["complete"] and len(lines) == 5  # a header, then two lines per run
    base, dct = res["settings"]
    assert base["name"] == "baseline" and dct["name"] == "emb-dct-0.25"
    assert 0 < dct["sent_per_step"]["output_dist"] < base["sent_per_step"]["output_dist"]
    assert dct["ratio"]["output_dist"] > 2 and base["ratio"]["output_dist"] == 1
    assert dct["sent_per_step"]["dense_allreduce"] == base["sent_per_step"]["dense_allreduce"]
    assert dct["pareto"]  # the fewest bytes: always on the front
    md = (out / "results.md").read_text()
    assert "| emb-dct-0.25 | none | dct η=0.25 |" in md
    tree = ET.fromstring((out / "pareto.svg").read_text().split("\n", 1)[1])
    assert set(_points(tree, 0)) == {"baseline", "emb-dct-0.25"}
