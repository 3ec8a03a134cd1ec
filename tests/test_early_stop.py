"""Early stopping on held-out AUC (``train.early_stop``): the counting, a real run that
stops at the evaluation the patience says, its best checkpoint kept and loaded by
``hybridrec eval`` and ``load_run_model``, resume and finished-run handling, the config
errors, Hogwild threads, and two ranks that stop at the same step."""

import json
import math
from pathlib import Path

import pytest
from distributed import run_ranks

from hybridrec.cli.main import main
from hybridrec.errors import ConfigError
from hybridrec.train.loop.early_stop import EarlyStopping
from hybridrec.train.run import load_run_model
from hybridrec.train.setup.configure import build_config

SMALL = ["model.embedding_dim=8", "model.bottom_mlp=16,8", "model.top_mlp=16,1",
         "data.batch_size=64", "data.eval_batch_size=1000", "train.progress=false", "train.log_every=0"]
# An AUC never beats the best by more than 1: the first evaluation is the best, and the
# run stops after `patience` more.
NEVER_BETTER = ["train.early_stop_min_delta=1"]


@pytest.fixture(scope="module")
def dataset(shared_dataset):
    return shared_dataset(days=2, rows=1000)


def _train(dataset, run, *extra) -> int:
    return main(["train", "--recipe", "demo", f"data.path={dataset}", *SMALL, f"train.run_dir={run}", *extra])


def _summary(run: Path) -> dict:
    return json.loads((run / "summary.json").read_text())


def _eval_steps(run: Path) -> list[int]:
    return [r["step"] for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())
            if r["split"] == "eval"]


def _checkpoint_steps(run: Path) -> list[int]:
    return sorted(int(p.name.removeprefix("step-")) for p in (run / "checkpoints").iterdir())


# -- the counting ---------------------------------------------------------------------
def test_patience_counts_evaluations_without_an_improvement():
    es = EarlyStopping(patience=2)
    seen = [(step, es.update(step, {"auc": auc}), es.stopped)
            for step, auc in [(10, 0.60), (20, 0.70), (30, 0.69), (40, 0.70), (50, 0.71), (60, 0.71),
                              (70, float("nan"))]]
    assert seen == [(10, True, False), (20, True, False), (30, False, False), (40, False, True),
                    (50, True, False), (60, False, False), (70, False, True)]
    assert (es.best_step, es.best_auc, es.since_best, es.evaluations) == (50, 0.71, 2, 7)
    assert es.update(70, {"auc": 0.99}) is False and es.evaluations == 7  # a step counted already
    again = EarlyStopping(patience=3)
    again.load_state_dict(json.loads(json.dumps(es.state_dict())))  # a checkpoint's JSON
    assert again.state_dict() == es.state_dict() and not again.stopped  # a larger patience trains on
    strict = EarlyStopping(patience=1, min_delta=0.01)
    assert strict.update(1, {"auc": 0.5}) and not strict.update(2, {"auc": 0.505}) and strict.stopped


# -- a real run -----------------------------------------------------------------------
@pytest.mark.slow
def test_a_run_stops_at_the_patience_keeps_the_best_checkpoint_and_eval_loads_it(dataset, tmp_path, capsys):
    run = tmp_path / "run"
    assert _train(dataset, run, "train.eval_every=2", "train.early_stop=2", *NEVER_BETTER,
                  "train.checkpoint_every=1", "train.keep_checkpoints=1") == 0
    out = capsys.readouterr().out
    assert "best AUC (step 2)" in out and "6 (stopped early)" in out
    s = _summary(run)
    es = s["early_stop"]
    # Evaluations at 2 (the best), 4 and 6 (two without an improvement): stop at 6 of 15.
    assert s["step"] == 6 and s["stop_reason"] == "early_stop" and es["stopped_early"]
    assert (es["best_step"], es["evaluations"], es["evaluations_since_best"], es["planned_steps"]) == (2, 3, 2, 15)
    assert es["best_auc"] == pytest.approx(s["eval_history"][0]["auc"])
    assert "early stop at step 6" in es["reason"] and "best AUC" in es["reason"]
    assert [h["step"] for h in s["eval_history"]] == [2, 4] and s["eval"]["step"] == 6
    assert _eval_steps(run) == [2, 4, 6]  # each evaluation once, the last one the final
    # keep_checkpoints=1 keeps the newest (the final one) and the best besides it.
    assert _checkpoint_steps(run) == [2, 6]
    assert es["best_checkpoint"] == str(run / "checkpoints" / "step-00000002")

    # hybridrec eval: the best checkpoint by default, the newest on request.
    assert main(["eval", str(run)]) == 0
    best = json.loads((run / "eval.json").read_text())
    assert (best["which"], best["step"]) == ("best", 2) and best["auc"] == pytest.approx(es["best_auc"], abs=1e-6)
    assert "(best, step 2)" in capsys.readouterr().out
    assert main(["eval", str(run), "--checkpoint", "latest"]) == 0
    latest = json.loads((run / "eval.json").read_text())
    assert (latest["which"], latest["step"]) == ("latest", 6)
    assert latest["auc"] == pytest.approx(s["eval"]["auc"], abs=1e-6)
    assert load_run_model(run)[4]["step"] == 2 and load_run_model(run, checkpoint="latest")[4]["step"] == 6

    # Named again: finished. With a larger patience it resumes where it stopped and trains on.
    capsys.readouterr()
    assert _train(dataset, run, "train.eval_every=2", "train.early_stop=2", *NEVER_BETTER) == 0
    assert "is finished (step 6 of 15, stopped early; best AUC" in capsys.readouterr().out
    assert _train(dataset, run, "train.eval_every=2", "train.early_stop=3", *NEVER_BETTER,
                  "train.keep_checkpoints=1") == 0
    s = _summary(run)
    assert (s["step"], s["resumed_from"], s["early_stop"]["best_step"]) == (8, 6, 2)
    assert _eval_steps(run) == [2, 4, 6, 8] and _checkpoint_steps(run) == [2, 8]


def test_the_stop_follows_the_recorded_evaluations(dataset, tmp_path):
    """Without forcing: whatever AUCs the run measures, it stops (or not) where the rule
    applied to its own eval history says, and its best is the history's best."""
    run = tmp_path / "run"
    assert _train(dataset, run, "train.eval_every=1", "train.early_stop=1", "optim.dense_lr=2",
                  "optim.sparse_lr=2", "train.save_checkpoints=false") == 0
    s = _summary(run)
    evals = [*s["eval_history"], s["eval"]]
    best, expected_stop = None, None
    for e in evals:
        if best is None or e["auc"] > best["auc"]:
            best = e
        elif e["step"] < 15:
            expected_stop = e["step"]
            break
    assert s["step"] == (expected_stop or 15) and evals[-1]["step"] == s["step"]
    assert (s["early_stop"]["best_step"], s["early_stop"]["best_auc"]) == (best["step"], best["auc"])
    assert s["stop_reason"] == ("early_stop" if expected_stop else "planned_steps")
    assert s["early_stop"]["best_checkpoint"] is None  # train.save_checkpoints=false


def test_hogwild_threads_stop_at_the_same_evaluation(dataset, tmp_path):
    run = tmp_path / "run"
    assert _train(dataset, run, "train.eval_every=3", "train.early_stop=1", *NEVER_BETTER,
                  "train.workers=2", "train.threads=1") == 0
    s = _summary(run)
    assert (s["step"], s["early_stop"]["best_step"]) == (6, 3) and _checkpoint_steps(run) == [3, 6]


# -- errors -----------------------------------------------------------------------------
@pytest.mark.parametrize("overrides, message", [
    (["train.early_stop=-1"], ("train.early_stop must be >= 0 (evaluations without an AUC improvement "
      "before stopping; 0 = off), got -1")),
    (["train.early_stop=3"], ("train.early_stop=3 counts the evaluations of train.eval_every, which is 0 "
      "(only at the end): set train.eval_every=N")),
    (["train.early_stop=3", "train.eval_every=5", "train.early_stop_min_delta=-0.1"],
     "train.early_stop_min_delta must be >= 0, got -0.1"),
])
def test_bad_values_are_config_errors(overrides, message):
    with pytest.raises(ConfigError) as e:
        build_config(overrides=overrides)
    assert str(e.value) == message


def test_early_stop_without_held_out_rows_is_one_line(dataset, tmp_path, capsys):
    no_eval = tmp_path / "no_eval"  # the dataset with an empty eval split (shards linked)
    no_eval.mkdir()
    for p in dataset.iterdir():
        if p.name != "meta.json":
            (no_eval / p.name).symlink_to(p)
    meta = json.loads((dataset / "meta.json").read_text())
    meta["splits"]["eval"] = []
    (no_eval / "meta.json").write_text(json.dumps(meta))
    run = tmp_path / "run"
    assert _train(no_eval, run, "train.eval_every=2", "train.early_stop=2") == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [(f"hybridrec: error: train.early_stop=2: the dataset {no_eval} has no held-out rows "
                    "(its eval split is empty), so there is no AUC to watch; preprocess with a held-out "
                    "part (--eval-parts), or train.early_stop=0")]
    assert not run.exists()


def test_eval_of_the_best_checkpoint_of_a_run_without_one_says_so(dataset, tmp_path, capsys):
    run = tmp_path / "run"
    assert _train(dataset, run, "train.max_steps=2") == 0
    assert _summary(run)["early_stop"] is None and _summary(run)["stop_reason"] == "planned_steps"
    capsys.readouterr()
    assert main(["eval", str(run), "--checkpoint", "best"]) == 2
    assert "no best checkpoint recorded" in capsys.readouterr().err
    assert main(["eval", str(run)]) == 0  # the default: the newest
    assert json.loads((run / "eval.json").read_text())["which"] == "latest"


# -- two ranks ------------------------------------------------------------------------
def _two_rank_worker(topo, data, run_dir):
    from hybridrec.train.build import build_trainer

    cfg = build_config(overrides=[
        f"data.path={data}", f"train.run_dir={run_dir}", *SMALL, "data.batch_size=32",
        "dist.sharding=row_wise", "dist.pipeline=true", "train.eval_every=2", "train.early_stop=2",
        *NEVER_BETTER])
    trainer = build_trainer(cfg, topo=topo)
    result = trainer.fit()
    es = result.parts["early_stop"]  # (the early stopping part's summary entry)
    return result.step, es["best_step"], es["best_auc"], result.eval_metrics["auc"], trainer.total_steps


@pytest.mark.distributed
def test_two_ranks_stop_at_the_same_step(dataset, tmp_path):
    (a, b) = run_ranks(_two_rank_worker, 2, str(dataset), str(tmp_path / "run"), timeout_s=120)
    assert a == b  # the same step, best step and AUCs on both ranks
    step, best_step, best_auc, final_auc, total = a
    assert (step, best_step, total) == (6, 2, 15) and math.isfinite(best_auc) and math.isfinite(final_auc)
    assert [int(p.name.removeprefix("step-")) for p in sorted((tmp_path / "run" / "checkpoints").iterdir())] == [2, 6]
