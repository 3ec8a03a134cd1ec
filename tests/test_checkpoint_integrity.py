"""Checkpoints that fail their integrity checks (truncated, unreadable, of another model)
are skipped with one warning each and the newest good one is used, for resuming and for
``hybridrec eval``; when none is good, one error line. A save that fails leaves the
previous checkpoint whole and loadable."""

from __future__ import annotations

import errno
import json
import os
import shutil
from pathlib import Path

import pytest
import torch

from hybridrec.cli.main import main
from hybridrec.parallel import checkpoint_io
from hybridrec.parallel.checkpoint import read_manifest
from hybridrec.parallel.checkpoint_io import CHECKSUMS, MANIFEST, CheckpointError
from hybridrec.parallel.topology import Topology
from hybridrec.train.checkpointing import checkpoint as ckpt
from hybridrec.train.checkpointing.checkpointer import Checkpointer
from hybridrec.train.run import load_run_model


@pytest.fixture(scope="module")
def data(tiny_data):
    return tiny_data


def _args(data: Path, run: Path, steps: int, *extra: str) -> list[str]:
    return ["train", "--recipe", "demo", f"data.path={data}", f"train.run_dir={run}", "data.batch_size=64",
            f"train.max_steps={steps}", "train.checkpoint_every=2", "train.keep_checkpoints=3", *extra]


@pytest.fixture(scope="module")
def two_checkpoints(data, trained_run, tmp_path_factory):
    """A run interrupted after step 4, with checkpoints at steps 2 and 4 (a copy of the
    shared run test_trust_payloads.py reads)."""
    shared = trained_run(data, 4, "train.checkpoint_every=2", "train.keep_checkpoints=3", export=True)
    run = shutil.copytree(shared, tmp_path_factory.mktemp("two") / "run")
    (run / "summary.json").unlink()  # as if it had stopped before the end
    assert [s for s, _ in ckpt.list_checkpoints(run)] == [2, 4]
    return run


@pytest.fixture(scope="module")
def other_model(data, tmp_path_factory):
    """A checkpoint at step 4 of a model with another embedding dim."""
    run = tmp_path_factory.mktemp("other") / "run"
    assert main(_args(data, run, 4, "model.embedding_dim=8", "model.bottom_mlp=64,8")) == 0
    return ckpt.step_dir(run, 4)


def _copy(run: Path, dest: Path) -> Path:
    shutil.copytree(run, dest)
    return dest


def _truncate(step_dir: Path) -> Path:
    (tensors,) = step_dir.glob("*.distcp")
    os.truncate(tensors, 1000)
    return tensors


def _error_line(err: str) -> str:
    assert "Traceback" not in err, err
    lines = [x for x in err.splitlines() if x.startswith("hybridrec: error: ")]
    assert len(lines) == 1, err
    return lines[0].removeprefix("hybridrec: error: ")


def _steps_logged(run: Path) -> list[int]:
    return [r["step"] for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())
            if r.get("split") == "train"]


def test_a_truncated_newest_checkpoint_is_set_aside_and_the_previous_one_resumed(data, two_checkpoints,
                                                                                tmp_path, capsys):
    run = _copy(two_checkpoints, tmp_path / "run")
    tensors = _truncate(ckpt.step_dir(run, 4))
    capsys.readouterr()
    assert main(_args(data, run, 6, "train.log_every=1")) == 0
    err = capsys.readouterr().err
    warned = [x for x in err.splitlines() if "skipped the checkpoint" in x]
    assert len(warned) == 1, err
    assert (f"skipped the checkpoint {ckpt.step_dir(run, 4)} ({tensors.name}: truncated (1,000 of "
            in warned[0]), warned[0]
    assert "renamed to step-00000004.bad; resuming from step-00000002" in warned[0], warned[0]
    assert f"resumed from step 2 ({ckpt.step_dir(run, 2)})" in err
    assert (ckpt.checkpoint_dir(run) / "step-00000004.bad").is_dir()  # kept, for a look
    assert [s for s, _ in ckpt.list_checkpoints(run)] == [2, 4, 6]  # step 4 saved again, whole
    assert ckpt.problem(ckpt.step_dir(run, 4)) is None
    assert json.loads((run / "summary.json").read_text())["step"] == 6
    logged = _steps_logged(run)
    assert sorted(set(logged)) == logged and logged[-1] == 6 and {3, 4} <= set(logged)  # steps 3 and 4 logged once


def test_a_checkpoint_of_another_model_is_refused_with_the_reason(data, two_checkpoints, other_model,
                                                                  tmp_path, capsys):
    run = _copy(two_checkpoints, tmp_path / "run")
    shutil.rmtree(ckpt.step_dir(run, 4))
    shutil.copytree(other_model, ckpt.step_dir(run, 4))
    capsys.readouterr()
    assert main(_args(data, run, 6)) == 0
    err = capsys.readouterr().err
    (warned,) = [x for x in err.splitlines() if "skipped the checkpoint" in x]
    assert "a checkpoint of another model: model." in warned and "(this model: " in warned, warned
    assert "resumed from step 2 " in err


def test_only_a_checkpoint_of_another_model_is_one_error_line(data, two_checkpoints, other_model,
                                                               tmp_path, capsys):
    run = _copy(two_checkpoints, tmp_path / "run")
    for _, p in ckpt.list_checkpoints(run):
        shutil.rmtree(p)
    shutil.copytree(other_model, ckpt.step_dir(run, 4))
    capsys.readouterr()
    assert main(_args(data, run, 6)) == 2
    line = _error_line(capsys.readouterr().err)
    assert line.startswith(f"{ckpt.step_dir(run, 4)}: loading the checkpoint failed: a checkpoint of "
                           "another model: model.bottom.layers.1.bias 8 (this model: 16), "
                           "model.bottom.layers.1.weight 8x64 (this model: 16x64), model.sparse.tables."), line
    assert line.endswith(" more"), line
    assert ckpt.step_dir(run, 4).is_dir()  # nothing renamed when nothing loads


def test_every_checkpoint_bad_is_one_error_line_and_nothing_moves(data, two_checkpoints, tmp_path, capsys):
    run = _copy(two_checkpoints, tmp_path / "run")
    t4 = _truncate(ckpt.step_dir(run, 4))
    (ckpt.step_dir(run, 2) / MANIFEST).write_text('{"format": "hybridrec-d')  # cut short
    capsys.readouterr()
    assert main(_args(data, run, 6)) == 2
    line = _error_line(capsys.readouterr().err)
    assert line == (f"{ckpt.step_dir(run, 4)}: loading the checkpoint failed: {t4.name}: truncated "
                    f"(1,000 of {line.split(' of ')[1].split(' bytes')[0]} bytes); no older checkpoint "
                    f"loads either: step-00000002: {MANIFEST}: unreadable (Unterminated string starting "
                    "at: line 1 column 12 (char 11))"), line
    assert [s for s, _ in ckpt.list_checkpoints(run)] == [2, 4]
    assert not list(ckpt.checkpoint_dir(run).glob("*.bad*"))


def test_eval_falls_back_to_the_previous_checkpoint(two_checkpoints, tmp_path, capsys):
    run = _copy(two_checkpoints, tmp_path / "run")
    tensors = _truncate(ckpt.step_dir(run, 4))
    with pytest.warns(UserWarning, match=rf"skipped the checkpoint .*step-00000004 \({tensors.name}: "
                                         r"truncated .*; using step-00000002"):
        *_, path, extra = load_run_model(run)
    assert path == ckpt.step_dir(run, 2) and extra["step"] == 2
    assert ckpt.step_dir(run, 4).is_dir()  # evaluating renames nothing
    capsys.readouterr()
    assert main(["eval", str(run)]) == 0
    result = json.loads((run / "eval.json").read_text())
    assert (result["step"], result["which"]) == (2, "fallback")
    assert "skipped the checkpoint" in capsys.readouterr().err
    with pytest.raises(CheckpointError, match="truncated"):  # one named explicitly: no fallback
        load_run_model(run, checkpoint=str(ckpt.step_dir(run, 4)))


def test_the_manifest_holds_a_fingerprint_and_old_checkpoints_without_one_load(two_checkpoints, tmp_path):
    run = _copy(two_checkpoints, tmp_path / "run")
    step4, step2 = ckpt.step_dir(run, 4), ckpt.step_dir(run, 2)
    meta = read_manifest(step4)
    assert meta["model"]["fingerprint"].startswith("sha256:") and meta["model"]["tensors"] > 0
    del meta["model"], meta[CHECKSUMS]  # (saved before either)
    (step4 / MANIFEST).write_text(json.dumps(meta))
    assert load_run_model(run)[4]["step"] == 4
    meta["model"] = {"fingerprint": "sha256:0000000000000000", "tensors": 1}  # not these tensors
    (step4 / MANIFEST).write_text(json.dumps(meta))
    with pytest.warns(UserWarning, match="its model fingerprint sha256:0000000000000000 is not that"):
        assert load_run_model(run)[3] == step2


# -- saving fails: the previous checkpoint stays ---------------------------------------------------
def _tiny_checkpointer(run: Path):
    from hybridrec.model.dlrm import DLRM
    from hybridrec.model.embedding import EmbeddingBagCollection, TableConfig
    from hybridrec.train.loop.optim import dense_parameters
    from hybridrec.train.loop.sparse_optim import CombinedSparseOptimizer, build_sparse_optimizer

    torch.manual_seed(0)
    tables = [TableConfig(name="a", num_embeddings=20, embedding_dim=4)]
    model = DLRM(num_dense=3, sparse=EmbeddingBagCollection(tables, seed=0), bottom_mlp=[4], top_mlp=[4, 1])
    dense = torch.optim.Adam(dense_parameters(model), lr=0.1)
    sparse = CombinedSparseOptimizer({"t": build_sparse_optimizer("rowwise_adagrad", model.sparse, lr=0.1)})
    return model, Checkpointer(run, Topology.single(), model=model, dense_opt=dense, sparse_opt=sparse,
                               components=[])


def _full(*_a, **_k):
    raise OSError(errno.ENOSPC, "No space left on device")


@pytest.mark.parametrize("where", ["tensors", "manifest"])
def test_a_save_on_a_full_disk_leaves_the_previous_checkpoint_loadable(tmp_path, monkeypatch, where):
    model, c = _tiny_checkpointer(tmp_path)
    c.save(1)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    with monkeypatch.context() as m:
        if where == "tensors":
            m.setattr(checkpoint_io.dcp, "save", _full)
        else:
            m.setattr(checkpoint_io, "write_json", _full)
        with pytest.raises(CheckpointError, match=r"step-00000002: saving the checkpoint failed: "
                                                  r"No space left on device"):
            c.save(2)
    assert sorted(p.name for p in ckpt.checkpoint_dir(tmp_path).iterdir()) == ["step-00000001"]
    assert ckpt.problem(ckpt.step_dir(tmp_path, 1)) is None
    assert c.restore_newest() == (1, ckpt.step_dir(tmp_path, 1))
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


@pytest.mark.distributed
@pytest.mark.timeout(180)
def test_two_ranks_skip_the_same_bad_checkpoint(data, tmp_path):
    """Only rank 1's file of the newest checkpoint is damaged: both ranks must still skip it
    together (a rank that loaded it while the other fell back would train apart or hang)."""
    import subprocess
    import sys

    run = tmp_path / "run"

    def args(epochs: int) -> list[str]:
        # 400 training rows, 2 ranks x 64: an epoch is 3 steps (checkpoints at 2, 3, 4, 6)
        return _args(data, run, 0, "dist.nproc=2", f"train.epochs={epochs}")

    # The first run's output is not read: through the CLI's entry in this process.
    assert main(args(1)) == 0
    (run / "summary.json").unlink()
    assert [s for s, _ in ckpt.list_checkpoints(run)] == [2, 3]
    files = sorted(ckpt.step_dir(run, 3).glob("*.distcp"))
    assert [f.name for f in files] == ["__0_0.distcp", "__1_0.distcp"]  # one file per rank
    os.truncate(files[1], 1000)
    # The second one's is, ranks' lines included: in a new interpreter (ranks forked from this
    # process's fork server write where its stderr was when it started, not into capfd).
    again = subprocess.run([sys.executable, "-m", "hybridrec", *args(2)], capture_output=True, text=True,
                           timeout=170, check=False)
    assert again.returncode == 0, again.stderr[-2000:]
    assert "skipped the checkpoint" in again.stderr and "resumed from step 2" in again.stderr, again.stderr
    assert json.loads((run / "summary.json").read_text())["step"] == 6
    assert (ckpt.checkpoint_dir(run) / "step-00000003.bad").is_dir()
