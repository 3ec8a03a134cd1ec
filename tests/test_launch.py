"""`hybridrec train --nproc 2`: real torchrun launch, 2 gloo ranks, and a dying rank."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from hybridrec.cli.main import main

pytestmark = pytest.mark.distributed

SMALL = ["model.embedding_dim=8", "model.bottom_mlp=16,8", "model.top_mlp=16,1",
         "data.batch_size=64", "data.eval_batch_size=1000", "train.progress=false"]


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    root = tmp_path_factory.mktemp("launch")
    assert main(["data", "synth", "--out", str(root / "raw"), "--days", "2", "--rows-per-day", "2000"]) == 0
    assert main(["data", "preprocess", *sorted(str(p) for p in (root / "raw").glob("day_*")),
                 "--out", str(root / "data")]) == 0
    return root / "data"


def _cmd(dataset, run, *extra):
    return [sys.executable, "-m", "hybridrec", "train", "--recipe", "demo", f"data.path={dataset}",
            f"train.run_dir={run}", "dist.nproc=2", *SMALL, *extra]


def test_two_ranks_train_end_to_end(dataset, tmp_path):
    run = tmp_path / "run"
    proc = subprocess.run(_cmd(dataset, run, "dist.sharding=row_wise", "train.max_steps=10"),
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "AUC" in proc.stdout
    summary = json.loads((run / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["step"] == 10
    assert summary["eval"]["count"] == 2000  # both ranks' eval rows, gathered
    plan = json.loads((run / "plan.json").read_text())
    assert {t["sharding_type"] for t in plan["tables"].values()} == {"row_wise"}
    cats = summary["comm"]["by_category"]
    assert cats["output_dist"]["sent"] > 0 and cats["dense_allreduce"]["sent"] > 0
    # One process evaluates the 2-rank run's sharded checkpoint: the same held-out metrics.
    assert main(["eval", str(run)]) == 0
    ev = json.loads((run / "eval.json").read_text())
    assert ev["count"] == 2000 and abs(ev["auc"] - summary["eval"]["auc"]) < 1e-6


def _children(pid):
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout
    return [int(x) for x in out.split()]


def test_a_dead_rank_ends_the_run_with_an_error(dataset, tmp_path):
    proc = subprocess.Popen(_cmd(dataset, tmp_path / "run", "train.epochs=50", "dist.timeout_s=30"),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    # Wait until torchrun has started its workers and they are training.
    deadline = time.monotonic() + 120
    workers = []
    while time.monotonic() < deadline and proc.poll() is None:
        launcher = _children(proc.pid)
        workers = [w for lp in launcher for w in _children(lp)]
        if len(workers) == 2 and (tmp_path / "run" / "plan.json").exists():
            break
        time.sleep(0.2)
    assert len(workers) == 2, "workers did not start"
    time.sleep(2)
    os.kill(workers[1], signal.SIGKILL)
    try:
        _, err = proc.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        proc.kill()
        pytest.fail("the surviving rank hung after its peer died")
    assert proc.returncode != 0
    assert "failed" in err.lower() or "error" in err.lower()


def _load_single(dataset, run):
    """A multi-rank run's newest (sharded) checkpoint, loaded into one process."""
    from hybridrec.parallel.checkpoint import load_sharded
    from hybridrec.parallel.topology import Topology
    from hybridrec.train import checkpoint as ckpt
    from hybridrec.train.build import build_model
    from hybridrec.train.run import load_run_config
    from hybridrec.data.schema import DatasetMeta

    cfg = load_run_config(run)
    model = build_model(cfg, DatasetMeta.load(dataset))
    extra = load_sharded(ckpt.latest_checkpoint(run), model=model, dense_opt=None, sparse_opts=None,
                         topo=Topology.single())
    return extra["step"], model.state_dict()


def test_two_rank_resume_equals_uninterrupted_and_reshards_to_one(dataset, tmp_path):
    """The uninterrupted run has the input pipeline off, the interrupted one on:
    stopping, resuming and pipelining must all leave the result unchanged."""
    common = ["dist.sharding=row_wise", "train.checkpoint_every=4", "optim.sparse=rowwise_adagrad"]
    full, cut = tmp_path / "full", tmp_path / "cut"
    for run, steps, pipe in ((full, 12, "false"), (cut, 8, "true"), (cut, 12, "true")):
        proc = subprocess.run(_cmd(dataset, run, *common, f"train.max_steps={steps}", f"dist.pipeline={pipe}"),
                              capture_output=True, text=True, timeout=240)
        assert proc.returncode == 0, proc.stderr[-3000:]
    (sa, a), (sb, b) = _load_single(dataset, full), _load_single(dataset, cut)
    assert sa == sb == 12
    for k in a:
        assert torch.equal(a[k], b[k]), k
    # The same run continues on ONE process with the same global batch (2 x 64): the
    # sharded checkpoint reshards into the single-process model.
    more = [sys.executable, "-m", "hybridrec", "train", "--recipe", "demo", f"data.path={dataset}",
            f"train.run_dir={cut}", *SMALL, "data.batch_size=128", "optim.sparse=rowwise_adagrad",
            "train.max_steps=14"]
    proc = subprocess.run(more, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads((cut / "summary.json").read_text())["resumed_from"] == 12
