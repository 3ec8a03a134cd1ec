"""Recovery of a parameter-server run (CPR's own setting): a killed server's shards roll back
to the checkpoint while the trainers and the other server keep their state (partial), or
every process restarts from the checkpoint (full); the record names the server and what
its shards lost."""

import json
import subprocess
import sys

import pytest
import torch

from hybridrec.errors import ConfigError
from hybridrec.train.checkpointing.faults import FailureInjector, parse_inject_failure
from hybridrec.train.run import load_run_model
from hybridrec.train.setup.configure import build_config

SMALL = ["model.embedding_dim=8", "model.bottom_mlp=16,8", "model.top_mlp=16,1", "data.batch_size=64",
         "data.eval_batch_size=1000", "train.progress=false", "optim.sparse=rowwise_adagrad", "dist.timeout_s=30",
         "dist.nproc=2", "dist.num_ps=2", "dist.ps_max_staleness=0", "train.max_steps=6"]
_REFERENCE: dict = {}


@pytest.fixture(scope="module")
def dataset(shared_dataset):
    return shared_dataset(days=2, rows=2000)


def _args(dataset, run, *extra) -> list[str]:
    return ["train", "--recipe", "demo", f"data.path={dataset}", f"train.run_dir={run}", *SMALL, *extra]


def _train(dataset, run, *extra):
    """A run in a new interpreter, and what it and its ranks wrote to stderr (ranks forked from
    this process's fork server write where its stderr was when it started, not into a test's
    ``capfd``)."""
    proc = subprocess.run([sys.executable, "-m", "hybridrec", *_args(dataset, run, *extra)], capture_output=True,
                          text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc.stderr


def _weights(dataset, run, step):
    _, _, model, _, extra = load_run_model(run, checkpoint=str(run / "checkpoints" / f"step-{step:08d}"),
                                           data_path=str(dataset))
    assert extra["step"] == step
    return model.state_dict()


def _reference(dataset, tmp_path_factory):
    """The uninterrupted run (synchronous servers), a checkpoint after each of the last three steps."""
    if not _REFERENCE:
        ref = tmp_path_factory.mktemp("ref") / "ref"
        from hybridrec.cli.main import main

        # (its output is not read: through the CLI's entry in this process)
        assert main(_args(dataset, ref, "train.checkpoint_every=1", "train.keep_checkpoints=3")) == 0
        _REFERENCE.update({s: _weights(dataset, ref, s) for s in (4, 5, 6)})
    return _REFERENCE


def _block(weights, shard):
    rows = slice(shard["row_start"], shard["row_start"] + shard["rows"])
    cols = slice(shard["col_start"], shard["col_start"] + shard["cols"])
    return weights[f"sparse.tables.{shard['table']}.weight"][rows, cols]


@pytest.mark.distributed
def test_a_killed_parameter_server_alone_rolls_back_and_the_record_counts_its_lost_updates(
        dataset, tmp_path, tmp_path_factory):
    """Server ps1 dies once every trainer's push of step 6 (the last) reached it; the newest
    checkpoint is step 4. One command (the launcher restarts every process once): the
    trainers' dense part is that of the uninterrupted run at step 6, ps1's shards those at
    step 4, and the record says ps1's shards lost 2 steps of updates.

    ps0 holds the newest step every trainer's push of which it had applied when the run
    stopped under it: the trainers' pushes of step 6 go to both servers at once, and ps0
    may be stopped (the launcher's SIGTERM once ps1 died) before they reach it (on a loaded
    machine they may not): a push in flight is lost, as designed. Step 5 it has applied for
    sure (a trainer's pull of step 6 waited for its pushes of step 5). So ps0's shards are
    those of step 5 or 6, and its snapshot's line and the record agree on which."""
    refs = _reference(dataset, tmp_path_factory)
    run = tmp_path / "run"
    err = _train(dataset, run, "train.checkpoint_every=4", "train.recovery=partial", "train.inject_failure=ps1:6",
                 "dist.max_restarts=1")
    assert "parameter server ps1 kills itself (SIGKILL) after step 6" in err
    assert "resumed from step 6 (partial recovery" in err, err[-3000:]
    summary = json.loads((run / "summary.json").read_text())
    (event,) = summary["recovery"]["events"]
    assert (event["mode"], event["checkpoint_step"], event["failed_at_step"], event["resumed_at_step"]) == \
        ("partial", 4, 6, 6)
    assert event["failed_ranks"] == [] and event["survivors"] == [0, 1] and event["failed_servers"] == [1]
    held = event["servers"][0]["held_step"]
    assert held in (5, 6), event["servers"]  # 5 applied for sure; 6 applied, or in flight and lost
    assert [(s["server"], s["snapshot"], s["held_step"]) for s in event["servers"]] == [(0, True, held), (1, False, 4)]
    assert f"parameter server ps0: the run stopped with every push up to step {held} applied" in err, err[-3000:]
    assert not list((run / "recovery").glob("ps-*"))  # the snapshots, consumed
    now, got = refs[6], _weights(dataset, run, 6)
    for k in now:
        if ".tables." not in k:  # the dense part: the trainers'
            assert torch.equal(got[k], now[k]), k
    servers = {s["server"] for s in event["shards"]}
    assert servers == {0, 1}
    changed = 0
    for shard in event["shards"]:
        assert shard["samples_lost"] == shard["steps_lost"] * 64 * 2
        if shard["server"] == 0:
            assert shard["steps_lost"] == 6 - held and torch.equal(_block(got, shard), _block(refs[held], shard)), shard
            continue
        assert shard["steps_lost"] == 2 and torch.equal(_block(got, shard), _block(refs[4], shard)), shard
        changed += int((_block(now, shard) != _block(refs[4], shard)).any(dim=1).sum())
    assert changed > 0  # the updates counted as lost are real: ps1's rows changed after step 4


@pytest.mark.distributed
def test_full_recovery_of_a_killed_server_equals_the_uninterrupted_run(dataset, tmp_path, tmp_path_factory):
    refs = _reference(dataset, tmp_path_factory)
    run = tmp_path / "run"
    err = _train(dataset, run, "train.checkpoint_every=4", "train.inject_failure=ps0:5", "dist.max_restarts=1")
    assert "parameter server ps0 kills itself (SIGKILL) after step 5" in err
    (event,) = json.loads((run / "summary.json").read_text())["recovery"]["events"]
    assert (event["mode"], event["checkpoint_step"], event["resumed_at_step"]) == ("full", 4, 4)
    assert event["failed_servers"] == [0] and event["survivors"] == []
    got = _weights(dataset, run, 6)
    for k, v in refs[6].items():
        assert torch.equal(got[k], v), k


def test_server_failures_parse_and_are_checked_against_the_servers():
    assert parse_inject_failure("ps1:5,0:7") == [("ps1", 5), (0, 7)]
    with pytest.raises(ConfigError, match="RANK must be >= 0"):
        parse_inject_failure("ps-1:5")
    with pytest.raises(ConfigError, match="parameter server ps2 does not exist: this run has 2"):
        build_config(None, [], ["dist.nproc=2", "dist.num_ps=2", "train.inject_failure=ps2:3"])
    with pytest.raises(ConfigError, match=r"none \(dist.num_ps=0\)"):
        build_config(None, [], ["dist.nproc=2", "train.inject_failure=ps0:3"])
    # partial recovery with servers is allowed; their shards have no incremental saves
    build_config(None, [], ["dist.nproc=2", "dist.num_ps=1", "train.recovery=partial"])
    with pytest.raises(ConfigError, match="the servers' shards have no incremental saves"):
        build_config(None, [], ["dist.nproc=2", "dist.num_ps=1", "train.recovery=partial", "train.shard_delta_every=2"])


def test_a_server_injector_fires_only_for_its_own_entries(tmp_path):
    inj = FailureInjector("0:3,ps1:5", rank="ps1", run_dir=tmp_path)
    assert inj.steps == (5,)
    assert FailureInjector("0:3,ps1:5", rank=1, run_dir=tmp_path).steps == ()
    assert FailureInjector("0:3,ps1:5", rank=0, run_dir=tmp_path).steps == (3,)
