"""End to end through the CLI: synth -> preprocess -> train -> eval, resume exactness, errors."""

import json
import signal
import subprocess
import sys
import time

import pytest
import torch
from processor import needs_bf16

from hybridrec.cli.main import main
from hybridrec.train.checkpointing import checkpoint as ckpt
from hybridrec.train.run import load_run_model

SMALL = ["model.embedding_dim=8", "model.bottom_mlp=16,8", "model.top_mlp=16,1",
         "data.batch_size=128", "data.eval_batch_size=1000", "train.progress=false"]


@pytest.fixture(scope="module")
def dataset(shared_dataset):
    return shared_dataset(days=3, rows=3000)


def _train(dataset, run_dir, *extra):
    return main(["train", "--recipe", "demo", f"data.path={dataset}", f"train.run_dir={run_dir}",
                 *SMALL, *extra])


@pytest.mark.slow
def test_train_writes_run_directory_and_eval_reads_it(dataset, tmp_path, capsys):
    run = tmp_path / "run"
    assert _train(dataset, run, "train.max_steps=30", "train.log_every=10", "train.eval_every=15") == 0
    out = capsys.readouterr().out
    assert "AUC" in out and "samples/s" in out
    summary = json.loads((run / "summary.json").read_text())
    assert summary["step"] == 30
    assert 0.5 < summary["eval"]["auc"] <= 1.0
    assert summary["eval"]["count"] == 3000  # the whole held-out day, last partial batch included
    for key in ("throughput", "peak_memory_bytes", "comm", "config", "versions"):
        assert key in summary
    helpers = summary["kernels"]["helper_threads"]  # (hybridrec.threads)
    assert helpers["single_threaded"] == ("OpenMP" in torch.__config__.parallel_info()), helpers
    lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines if x["split"] == "train"] == [10, 20, 30]
    assert [x["step"] for x in lines if x["split"] == "eval"] == [15, 30]
    assert json.loads((run / "config.json").read_text())["data"]["path"] == str(dataset)

    assert main(["eval", str(run)]) == 0
    ev = json.loads((run / "eval.json").read_text())
    assert ev["auc"] == pytest.approx(summary["eval"]["auc"], abs=1e-12)


def _final_state(run):
    *_, model, _, extra = load_run_model(run)
    return {"step": extra["step"], "model": model.state_dict()}


def _assert_same_run(full, cut):
    a, b = _final_state(full), _final_state(cut)
    assert a["step"] == b["step"]
    for k in a["model"]:
        assert torch.equal(a["model"][k], b["model"][k]), k
    ea = json.loads((full / "summary.json").read_text())["eval"]
    eb = json.loads((cut / "summary.json").read_text())["eval"]
    for k in ("auc", "log_loss", "ne", "calibration", "accuracy", "count"):
        assert ea[k] == eb[k], k


@pytest.mark.slow
@pytest.mark.parametrize("optim", [["optim.sparse=sgd", "optim.dense=sgd"],
                                   ["optim.sparse=lazy_adam", "optim.dense=adam"], [],
                                   ["model.embedding_dtype=bf16"],  # stochastic rounding, on every CPU
                                   pytest.param(["model.embedding_dtype=bf16", "train.precision=bf16"],
                                                marks=needs_bf16)],
                         ids=["sgd", "adam", "default", "bf16_tables", "bf16"])
def test_resume_equals_uninterrupted(dataset, tmp_path, optim):
    # decay=none: the schedule must not depend on max_steps, which differs between the runs.
    # threads=1: the thread governor's count follows the step times (a loaded machine's too),
    # and another count sums in another order: two runs compared bit for bit take one count.
    common = ["train.checkpoint_every=7", "optim.warmup_steps=5", "train.threads=1", *optim]
    full, cut = tmp_path / "full", tmp_path / "cut"
    assert _train(dataset, full, "train.max_steps=30", *common) == 0
    assert _train(dataset, cut, "train.max_steps=14", *common) == 0  # stops at a checkpoint
    assert _train(dataset, cut, "train.max_steps=30", *common) == 0  # resumes from step 14
    assert json.loads((cut / "summary.json").read_text())["resumed_from"] == 14
    _assert_same_run(full, cut)


@pytest.mark.slow
def test_resume_after_a_killed_process(dataset, tmp_path):
    """A process killed (SIGKILL) mid-run resumes from its last checkpoint and ends
    exactly where an uninterrupted run ends, learning-rate decay included. The kill comes
    from outside once the first checkpoint is listed, wherever the run is then; a slow
    poll (a loaded machine) would let the run finish first, so the run also kills itself
    after step 17 (``train.inject_failure``), whichever comes first: it is always cut
    before its end."""
    args = [sys.executable, "-m", "hybridrec", "train", "--recipe", "demo", f"data.path={dataset}",
            *SMALL, "train.max_steps=20", "train.checkpoint_every=5", "train.keep_checkpoints=20",
            "optim.decay=linear", "optim.warmup_steps=3"]
    full, cut = tmp_path / "full", tmp_path / "cut"
    subprocess.run([*args, f"train.run_dir={full}"], check=True, capture_output=True)
    proc = subprocess.Popen([*args, f"train.run_dir={cut}", "train.inject_failure=0:17"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while not ckpt.list_checkpoints(cut) and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.005)
    proc.kill()
    proc.wait()
    assert proc.returncode == -signal.SIGKILL
    killed_at = ckpt.list_checkpoints(cut)[-1][0]
    assert killed_at in (5, 10, 15)
    subprocess.run([*args, f"train.run_dir={cut}"], check=True, capture_output=True)
    assert json.loads((cut / "summary.json").read_text())["resumed_from"] == killed_at
    _assert_same_run(full, cut)


@pytest.mark.slow
def test_demo_command(tmp_path, capsys):
    assert main(["demo", "--out", str(tmp_path / "demo"), "--days", "3", "--rows-per-day", "4000",
                 "train.progress=false"]) == 0
    out = capsys.readouterr().out
    assert "teacher AUC (ceiling)" in out
    summary = json.loads((tmp_path / "demo/run/summary.json").read_text())
    assert summary["teacher"]["auc"] > 0.6 and summary["eval"]["auc"] > 0.55


@pytest.mark.parametrize("args, message", [
    (["train", "data.path=/nonexistent/dataset"], "/nonexistent/dataset"),
    (["train", "optim.dense_lr=fast"], "optim.dense_lr"),
    (["train", "train.epochz=2"], "did you mean 'epochs'"),
    (["eval", "/nonexistent/run"], "not a run directory"),
])
def test_cli_errors_are_one_clear_line(args, message, capsys):
    assert main(args) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


@pytest.mark.skipif(torch.cuda.is_available(), reason="with CUDA, dist.backend=nccl trains on the GPU")
def test_nccl_without_cuda_is_one_clear_line(dataset, tmp_path, capsys):
    assert _train(dataset, tmp_path / "run", "dist.backend=nccl", "train.max_steps=2") == 2
    err = capsys.readouterr().err
    assert "dist.backend=nccl: CUDA is not available here" in err and "Traceback" not in err
    assert not (tmp_path / "run" / "summary.json").exists()


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.device_count() >= 2, reason="with a GPU per rank, dist.backend=nccl trains")
def test_nccl_with_several_ranks_is_refused_before_any_group(dataset, tmp_path):
    """Several ranks with dist.backend=nccl and no GPU per rank (here: none, or fewer GPUs than
    ranks) stop at once with one line (each rank refuses before it joins a process group: no
    hang)."""
    proc = subprocess.run([sys.executable, "-m", "hybridrec", "train", "--recipe", "demo", f"data.path={dataset}",
                           f"train.run_dir={tmp_path / 'run'}", *SMALL, "dist.nproc=2", "dist.backend=nccl",
                           "train.max_steps=2"], capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode != 0
    assert "dist.backend=nccl: " in proc.stderr
    assert "CUDA is not available here" in proc.stderr or "NCCL needs one GPU per rank" in proc.stderr
    assert not (tmp_path / "run" / "summary.json").exists()
