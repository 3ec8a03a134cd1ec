"""One process on one CUDA device (``dist.backend=auto`` on a machine with a GPU) against the
same run on the CPU (``dist.backend=gloo``): the same steps from the same initial values, so
the models may differ only by the order of floating-point sums (CUDA's atomic adds in the
embedding backward and the row updates). Skipped where there is no GPU (CI's machines).

Tolerances, stated: after 40 steps every weight within 2e-4 + 1e-3 x |w| of the CPU's, the
held-out AUC within 0.002 and the log loss within 0.2% (fp32); bf16 on the GPU within 0.01
AUC of fp32 on this tiny model and data.
"""

import json
import os
import traceback
import warnings
from pathlib import Path

import pytest
import torch

from hybridrec.cli.main import main
from hybridrec.train.build import build_trainer
from hybridrec.train.run import load_run_model
from hybridrec.train.setup import recipes
from hybridrec.train.setup.configure import build_config

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

SMALL = ["model.embedding_dim=8", "model.bottom_mlp=16,8", "model.top_mlp=16,1",
         "data.batch_size=128", "data.eval_batch_size=1000", "train.progress=false",
         "train.max_steps=40"]


@pytest.fixture(scope="module")
def dataset(shared_dataset):
    return shared_dataset(days=3, rows=3000)


def _train(dataset, run, *extra) -> dict:
    assert main(["train", "--recipe", "demo", f"data.path={dataset}", f"train.run_dir={run}",
                 *SMALL, *extra]) == 0
    return json.loads((run / "summary.json").read_text())


def _weights(run) -> dict[str, torch.Tensor]:
    *_, model, _, extra = load_run_model(run)  # (saved from the GPU, loaded on the CPU)
    assert extra["step"] == 40
    return model.state_dict()


@pytest.mark.parametrize("arch,optim", [("dlrm", "adagrad"), ("dlrm", "sgd"), ("deepfm", "adagrad"),
                                        ("dlrm-dcn", "adagrad")])
def test_one_process_trains_on_the_gpu_as_on_the_cpu(dataset, tmp_path, arch, optim):
    opts = ["model.arch=dlrm", "model.interaction=dcn"] if arch == "dlrm-dcn" else [f"model.arch={arch}"]
    if optim == "sgd":
        opts += ["optim.dense=sgd", "optim.sparse=sgd", "optim.dense_lr=0.1", "optim.sparse_lr=0.1"]
    cpu = _train(dataset, tmp_path / "cpu", "dist.backend=gloo", *opts)
    gpu = _train(dataset, tmp_path / "gpu", "dist.backend=auto", *opts)
    assert cpu["device"] == "cpu" and gpu["device"].startswith("cuda")
    assert gpu["cuda_peak_memory_bytes"] > 0
    assert all(c["shape"].split()[0] == "cuda" for c in gpu["kernels"]["linear"]), gpu["kernels"]["linear"]
    assert gpu["eval"]["auc"] == pytest.approx(cpu["eval"]["auc"], abs=0.002)
    assert gpu["eval"]["log_loss"] == pytest.approx(cpu["eval"]["log_loss"], rel=0.002)
    a, b = _weights(tmp_path / "cpu"), _weights(tmp_path / "gpu")
    assert a.keys() == b.keys()
    for k in a:
        assert b[k].device.type == "cpu"
        torch.testing.assert_close(b[k], a[k], rtol=1e-3, atol=2e-4, msg=k)
    # the GPU run's checkpoint evaluates on the CPU to the AUC it reported
    assert main(["eval", str(tmp_path / "gpu")]) == 0
    ev = json.loads((tmp_path / "gpu" / "eval.json").read_text())
    assert ev["auc"] == pytest.approx(gpu["eval"]["auc"], abs=1e-4)


@pytest.mark.parametrize("interaction", ["dot", "dcn"])
def test_bf16_on_the_gpu(dataset, tmp_path, interaction):
    fp32 = _train(dataset, tmp_path / "fp32", "dist.backend=auto", f"model.interaction={interaction}")
    bf16 = _train(dataset, tmp_path / "bf16", "dist.backend=auto", "train.precision=bf16",
                  f"model.interaction={interaction}")
    assert {c["shape"].split()[1] for c in bf16["kernels"]["linear"]} == {"bfloat16"}
    if interaction == "dcn":  # the cross layers ran on the GPU, in bf16
        assert [c["shape"].split()[:3] for c in bf16["kernels"]["interaction"]] == [["cross_net", "cuda", "bfloat16"]]
    assert bf16["eval"]["auc"] == pytest.approx(fp32["eval"]["auc"], abs=0.01)


def test_resume_on_the_gpu(dataset, tmp_path):
    """Stopped at step 20 and resumed to 40 equals the run through, up to the sums' order."""
    common = ["dist.backend=auto", "train.checkpoint_every=20", "optim.warmup_steps=5"]
    full = _train(dataset, tmp_path / "full", *common)
    _train(dataset, tmp_path / "cut", *common, "train.max_steps=20")
    cut = _train(dataset, tmp_path / "cut", *common)
    assert cut["resumed_from"] == 20 and cut["device"].startswith("cuda")
    a, b = _weights(tmp_path / "full"), _weights(tmp_path / "cut")
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=1e-4, atol=1e-5, msg=k)
    assert cut["eval"]["auc"] == pytest.approx(full["eval"]["auc"], abs=1e-3)


def test_hogwild_threads_are_refused_on_the_gpu(dataset, tmp_path, capsys):
    assert main(["train", "--recipe", "demo", f"data.path={dataset}", f"train.run_dir={tmp_path / 'run'}",
                 *SMALL, "train.workers=2"]) == 2
    assert "Hogwild threads share CPU cores and are not supported on a GPU" in capsys.readouterr().err


def _waits(dataset, run, *extra) -> list[str]:
    """Where 4 training steps (after 2 untimed ones), the next batch's copy included, made the
    host wait for the GPU: torch's synchronization warnings, each by the innermost line of
    hybridrec's own code on the stack (``file:line function``)."""
    cfg = build_config(recipes.recipe("demo"), overrides=[
        f"data.path={dataset}", f"train.run_dir={run}", "train.resume=false", "dist.backend=auto",
        *SMALL, *extra])
    trainer = build_trainer(cfg)
    assert trainer.topo.device.type == "cuda"
    it = trainer.pipeline.batches(6)
    for _ in range(2):
        trainer.train_step(*next(it))
    torch.cuda.synchronize()
    found = set()

    def hook(message, category, filename, lineno, file=None, line=None):
        if "called a synchronizing CUDA operation" not in str(message):
            return  # (e.g. the mode's own notice that it is a prototype)
        ours = [f for f in traceback.extract_stack() if f"{os.sep}hybridrec{os.sep}" in f.filename]
        where = ours[-1] if ours else None
        found.add(f"{Path(where.filename).name}:{where.lineno} {where.name}" if where
                  else f"{Path(filename).name}:{lineno}")

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = hook
        torch.cuda.set_sync_debug_mode("warn")
        try:
            for item in it:
                trainer.train_step(*item)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sorted(found)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_a_one_hot_sgd_step_never_waits_for_the_gpu(dataset, tmp_path, precision):
    """The loader pins, the copy is queued, the ids' facts come from the host: nothing in the
    step of one-hot data with SGD makes the host wait (docs/design.md, "Device")."""
    waits = _waits(dataset, tmp_path / "run", "optim.dense=sgd", "optim.sparse=sgd", f"train.precision={precision}")
    assert waits == []


def test_row_wise_adagrad_waits_only_to_count_distinct_ids(dataset, tmp_path):
    """The named exception: summing repeated ids first needs their number on the host
    (``group_ids``' unique_consecutive), once per fused table and step; nothing else waits."""
    waits = _waits(dataset, tmp_path / "run")  # (the demo recipe: row-wise Adagrad)
    assert waits and all(w.startswith("id_groups.py") and w.endswith(" group_ids") for w in waits), waits
