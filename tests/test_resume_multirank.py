"""A compressed 2-rank run (DCT on the dense gradients and on the pooled embeddings),
stopped at a checkpoint and resumed, ends exactly where the uninterrupted run ends;
resumed on another world size, the per-rank compressor state is reset with a warning."""

import json
import shutil

import pytest

from hybridrec.cli.main import main

pytestmark = pytest.mark.distributed

SMALL = ["model.embedding_dim=8", "model.bottom_mlp=16,8", "model.top_mlp=16,1",
         "data.batch_size=64", "data.eval_batch_size=1000", "train.progress=false"]
DCT = ["compress.dense=dct", "compress.dense_ratio=0.05", "compress.dense_refresh_every=7",
       "compress.embedding=dct", "compress.embedding_ratio=0.25", "train.checkpoint_every=10",
       "optim.decay=none", "train.epochs=4"]


@pytest.fixture(scope="module")
def dataset(shared_dataset):
    return shared_dataset(days=2, rows=2000)


def _train(dataset, run, nproc, *extra):
    """The run through the CLI's entry in this process (the ranks start through the same
    launcher). What a 1-rank run prints is this process's (``capfd`` reads it); the ranks of
    a 2-rank run write where this process's fork server's stderr was when it started."""
    code = main(["train", "--recipe", "demo", f"data.path={dataset}", f"train.run_dir={run}",
                 f"dist.nproc={nproc}", "dist.sharding=row_wise", *SMALL, *DCT, *extra])
    assert code == 0
    return json.loads((run / "summary.json").read_text())


@pytest.fixture(scope="module")
def stopped(dataset, tmp_path_factory):
    """``stopped(dense_sync, dest)``: a copy at ``dest`` of a 2-rank run stopped at step 15
    (checkpoints at 10 and 15). Each run is trained once and each test resumes its own copy:
    the ddp one serves both the same-world-size and the other-world-size resume."""
    made = {}

    def copy(dense_sync, dest):
        if dense_sync not in made:
            run = tmp_path_factory.mktemp(f"stopped_{dense_sync}") / "run"
            _train(dataset, run, 2, "train.max_steps=15", f"dist.dense_sync={dense_sync}")
            made[dense_sync] = run
        shutil.copytree(made[dense_sync], dest)
        return dest

    return copy


@pytest.mark.parametrize("dense_sync", ["ddp", "allreduce"])
def test_compressed_two_rank_resume_equals_uninterrupted(dataset, stopped, tmp_path, dense_sync):
    full = tmp_path / "full"
    a = _train(dataset, full, 2, "train.max_steps=30", f"dist.dense_sync={dense_sync}")
    cut = stopped(dense_sync, tmp_path / "cut")  # saved 10, 15
    b = _train(dataset, cut, 2, "train.max_steps=30", f"dist.dense_sync={dense_sync}")
    assert b["resumed_from"] == 15 and b["step"] == a["step"] == 30
    for k in ("log_loss", "auc", "calibration"):
        assert b["eval"][k] == a["eval"][k], k
    # The compressors did compress: the residuals and thresholds that made this exact are real.
    assert a["comm"]["by_category"]["dense_allreduce"]["ratio"] > 5
    assert a["comm"]["by_category"]["output_dist"]["ratio"] > 1


def test_resume_on_another_world_size_resets_compressor_state_with_a_warning(dataset, stopped, tmp_path,
                                                                             capfd):
    run = stopped("ddp", tmp_path / "run")  # 2 ranks, dist.dense_sync's default
    capfd.readouterr()  # (the stopped run's output, where this test trained it)
    summary = _train(dataset, run, 1, "train.max_steps=17", "data.batch_size=128")  # same global batch
    err = capfd.readouterr().err
    assert summary["resumed_from"] == 15 and summary["step"] == 17
    assert "dense_sync: saved by 2 ranks, this run has 1" in err
    assert "rng: saved by 2 ranks" in err
