"""Recovery after a failure (``train.recovery``): partial recovery keeps the survivors' state
and rolls back only the failed rank's shards; full recovery equals the uninterrupted run."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hybridrec.cli.main import main
from hybridrec.errors import ConfigError
from hybridrec.model.embedding import EmbeddingBagCollection, TableConfig
from hybridrec.parallel.sharded_embedding import SHARDS
from hybridrec.train.checkpointing.checkpoint_interval import (
    partial_recovery_interval,
    young_daly_interval,
)
from hybridrec.train.checkpointing.deltas import OBSOLETE, ShardDeltas, _largest
from hybridrec.train.loop.sparse_optim import RowWiseAdagrad
from hybridrec.train.run import load_run_model
from hybridrec.train.setup.configure import build_config

SMALL = ["model.embedding_dim=8", "model.bottom_mlp=16,8", "model.top_mlp=16,1",
         "data.batch_size=64", "data.eval_batch_size=1000", "train.progress=false",
         "optim.sparse=rowwise_adagrad", "dist.timeout_s=30"]


@pytest.fixture(scope="module")
def dataset(shared_dataset):
    return shared_dataset(days=2, rows=2000)


def _train(dataset, run, nproc, *extra):
    argv = [sys.executable, "-m", "hybridrec", "train", "--recipe", "demo", f"data.path={dataset}",
            f"train.run_dir={run}", f"dist.nproc={nproc}", *SMALL, *extra]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=240, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stderr


def _train_here(capfd, dataset, run, nproc, *extra):
    """``hybridrec train`` in this process, for a test that reads none of its output: the
    launcher forks the ranks from this process's fork server, whose output goes where this
    process's went when that server started, not to ``capfd`` (what the ranks print is read
    through :func:`_train`)."""
    capfd.readouterr()
    status = main(["train", "--recipe", "demo", f"data.path={dataset}", f"train.run_dir={run}",
                   f"dist.nproc={nproc}", *SMALL, *extra])
    assert status == 0, capfd.readouterr().err[-3000:]  # (the launcher's lines: a failed rank's named)


def _weights(dataset, run, step):
    _, _, model, _, extra = load_run_model(run, checkpoint=str(run / "checkpoints" / f"step-{step:08d}"),
                                           data_path=str(dataset))
    assert extra["step"] == step
    return model.state_dict()


# -- the interval -----------------------------------------------------------------------
def test_partial_recovery_interval_keeps_the_lost_fraction():
    # 2 x 4 ranks x 3600 s x 0.02 = 576 s = 5,760 steps of 0.1 s; Young/Daly: 1,200
    got = partial_recovery_interval(save_s=2.0, step_s=0.1, mtbf_s=3600.0, total_steps=100_000, ranks=4,
                                    lost_fraction=0.02)
    assert got["steps"] == 5760 and got["lost_fraction"] == pytest.approx(0.02)
    assert "partial recovery" in got["reason"]
    # A bound shorter than Young/Daly's: the bound (the target holds), 2 x 2 x 3600 x 0.008 = 115.2 s,
    # while saving that often costs less than full recovery (2 / 115.2 against 2 / 120 + 120 / 7200) ...
    yd = young_daly_interval(save_s=2.0, step_s=0.1, mtbf_s=3600.0, total_steps=100_000)
    short = partial_recovery_interval(save_s=2.0, step_s=0.1, mtbf_s=3600.0, total_steps=100_000, ranks=2,
                                      lost_fraction=0.008)
    assert yd["steps"] == 1200 and short["steps"] == 1152 and short["fallback"] is None
    # ... else full recovery at Young/Daly's interval, said (7.2 s: 0.28 of the time saving)
    tiny = partial_recovery_interval(save_s=2.0, step_s=0.1, mtbf_s=3600.0, total_steps=100_000, ranks=1,
                                     lost_fraction=0.001)
    assert tiny["steps"] == 1200 and tiny["fallback"] == "full" and "Young/Daly" in tiny["reason"]
    assert partial_recovery_interval(save_s=2.0, step_s=0.1, mtbf_s=3600.0, total_steps=3000, ranks=4,
                                     lost_fraction=0.02)["steps"] == 3000  # clamped to the run
    # Incremental saves every 50 steps of a quarter of the rows: sqrt(2 x 5 s x 3600 s / 0.25) = 379.5 s
    d = partial_recovery_interval(save_s=2.0, step_s=0.1, mtbf_s=3600.0, total_steps=100_000, ranks=4,
                                  lost_fraction=0.02, delta_steps=50, delta_share=0.25)
    assert d["steps"] == 3795 and d["lost_fraction"] == pytest.approx(5 / (2 * 4 * 3600))
    assert "incremental saves every 50 steps" in d["reason"] and d["replay_s"] is None
    # A replay measured at 0.01 s (a quarter of the rows would cost 0.5 s at the save's rate):
    # sqrt(2 x 5 s x 3600 s x 2 s / 0.01 s) = 2,683.3 s
    m = partial_recovery_interval(save_s=2.0, step_s=0.1, mtbf_s=3600.0, total_steps=100_000, ranks=4,
                                  lost_fraction=0.02, delta_steps=50, delta_share=0.25, replay_s=0.01)
    assert m["steps"] == 26833 and m["replay_s"] == 0.01 and "measured" in m["reason"]
    # priced at exactly a share of the save, the two agree
    same = partial_recovery_interval(save_s=2.0, step_s=0.1, mtbf_s=3600.0, total_steps=100_000, ranks=4,
                                     lost_fraction=0.02, delta_steps=50, replay_s=0.25 * 2.0)
    assert same["steps"] == d["steps"]
    with pytest.raises(ValueError, match="replay_s"):
        partial_recovery_interval(save_s=1, step_s=1, mtbf_s=1, total_steps=1, ranks=2, lost_fraction=0.1,
                                  delta_steps=1, replay_s=0.0)
    with pytest.raises(ValueError, match="lost_fraction"):
        partial_recovery_interval(save_s=1, step_s=1, mtbf_s=1, total_steps=1, ranks=2, lost_fraction=1.5)


@pytest.mark.parametrize("overrides, message", [
    (["train.recovery=some"], "train.recovery 'some': full or partial"),
    (["train.recovery=partial", "train.save_checkpoints=false"], "no checkpoint to roll back to"),
    (["train.recovery=partial", "sync.algorithm=ma"], "the replicas differ between synchronizations"),
    (["train.recovery=partial", "train.lost_fraction=0"], "train.lost_fraction must be in"),
])
def test_recovery_config_errors(overrides, message):
    with pytest.raises(ConfigError, match=message):
        build_config(overrides=overrides)


# -- partial and full recovery after an injected failure -----------------------------------
_REFERENCES = {}


def _reference(capfd, dataset, tmp_path_factory, nproc, sharding):
    """The uninterrupted run (7 steps, a checkpoint after each of the last four), once per
    world size and sharding."""
    key = (nproc, sharding)
    if key not in _REFERENCES:
        ref = tmp_path_factory.mktemp("ref") / "ref"
        _train_here(capfd, dataset, ref, nproc, f"dist.sharding={sharding}", "train.max_steps=7",
                    "train.checkpoint_every=1", "train.keep_checkpoints=4")
        _REFERENCES[key] = {s: _weights(dataset, ref, s) for s in (4, 5, 6, 7)}
    return _REFERENCES[key]


@pytest.mark.distributed
@pytest.mark.parametrize("nproc, sharding, deltas", [(2, "table_wise", "none"), (3, "row_wise", "touched"),
                                                     (2, "table_wise", "hot")])
def test_partial_recovery_loses_only_the_failed_shards_updates(dataset, tmp_path, tmp_path_factory, capfd, nproc,
                                                               sharding, deltas):
    """Rank 1 dies after step 7 (the last); the newest checkpoint is step 4. After the
    restart, the survivors' shards and the dense part are those of the uninterrupted run at
    step 7; rank 1's shards those at step 4, or with incremental saves after every step
    those at its newest complete delta, and the record counts the steps they lost.

    What a delta in flight promises: deltas are written in the background, one at a time,
    and a kill is a crash (nothing of the step is finished first). The delta of step 5 is
    on disk (the delta of step 6 waited for it before it started); the delta of step 6
    may still be being written when rank 1 dies after step 7 (on a loaded machine it is):
    then it is lost whole, never half-applied, and the shards hold step 5. So the step
    they hold is 5 or 6, and the shards, the record (``deltas``, ``steps_lost``,
    ``held_rows``) and what is left on disk agree on which. With ``hot``, each row holds
    its own newest save: the rows left out of the delta hold an older step, counted so."""
    refs = _reference(capfd, dataset, tmp_path_factory, nproc, sharding)
    run = tmp_path / "run"
    extra = [] if deltas == "none" else ["train.shard_delta_every=1", f"train.shard_delta_rows={deltas}",
                                         "train.shard_delta_hot=0.5"]
    err = _train(dataset, run, nproc, f"dist.sharding={sharding}", "train.max_steps=7", "train.checkpoint_every=4",
                 "train.recovery=partial", "train.inject_failure=1:7", "dist.max_restarts=1", *extra)
    assert "rank 1 kills itself (SIGKILL) after step 7" in err
    assert "resumed from step 7 (partial recovery" in err, err[-3000:]
    summary = json.loads((run / "summary.json").read_text())
    (event,) = summary["recovery"]["events"]
    survivors = [r for r in range(nproc) if r != 1]
    assert (event["mode"], event["checkpoint_step"], event["failed_at_step"], event["resumed_at_step"]) == \
        ("partial", 4, 7, 7)
    assert event["failed_ranks"] == [1] and event["survivors"] == survivors and event["donor"] == 0
    if Path("/dev/shm").is_dir():  # the survivors' shards lived in files of local memory: taken, not copied
        assert event["shards_kept_in_memory"] == survivors
    assert not (run / "recovery" / "rank-00000").exists()  # the snapshots, consumed
    held = 4
    if deltas != "none":
        held = event["deltas"]["1"]["step"]
        assert held in (5, 6), event["deltas"]  # 5 complete for sure; 6 complete, or lost whole in flight
        assert (event["deltas"]["1"]["pending_rows"] > 0) == (deltas == "hot")
        # a delta cut off by the kill left no half-written directory behind (the restart removed it)
        assert not list((run / "recovery" / "deltas").rglob(".tmp-*"))
    now, got = refs[7], _weights(dataset, run, 7)
    for k in now:
        if ".tables." not in k:  # the dense part: a survivor's
            assert torch.equal(got[k], now[k]), k
    lost_rows = saved_hot = left_out = 0
    assert {s["rank"] for s in event["shards"]} == set(range(nproc)), event["shards"]  # survivors' too
    for shard in event["shards"]:
        key = f"sparse.tables.{shard['table']}.weight"
        rows = slice(shard["row_start"], shard["row_start"] + shard["rows"])
        cols = slice(shard["col_start"], shard["col_start"] + shard["cols"])
        block, failed = got[key][rows, cols], shard["rank"] == 1
        assert shard["samples_lost"] == shard["steps_lost"] * 64 * nproc
        if not failed:
            assert shard["steps_lost"] == 0 and torch.equal(block, now[key][rows, cols]), shard
            continue
        at = {s: (block == refs[s][key][rows, cols]).all(dim=1) for s in range(4, held + 1)}
        if deltas == "hot":
            # a row that differs from the delta's step was left out of it (touched since its own newest
            # save) and holds that save: the checkpoint's or an earlier delta's, the first step it equals
            older = ~at[held]
            since: dict[int, int] = {}
            for s in range(4, held):
                mine = older & at[s]
                since[7 - s] = since.get(7 - s, 0) + int(mine.sum())
                older &= ~mine
            assert not bool(older.any()), shard  # every row holds some save
            since = {k: n for k, n in since.items() if n}
            left = sum(since.values())
            want = {**since, 7 - held: shard["rows"] - left} if left < shard["rows"] else since
            # (the record names the rows by steps lost only where they differ)
            assert shard.get("held_rows") == ({str(k): n for k, n in sorted(want.items())} if len(want) > 1
                                              else None), shard
            assert shard["steps_lost"] == max(want)
            assert shard["mean_steps_lost"] == pytest.approx(sum(k * n for k, n in want.items()) / shard["rows"])
            saved_hot += int((at[held] & ~at[4]).sum())  # (saved by a delta)
            left_out += left
        else:
            assert shard["steps_lost"] == 7 - held and shard["mean_steps_lost"] == 7 - held, shard
            assert bool(at[held].all()), shard
        # the updates counted as lost are real: the rows changed since the step they hold
        lost_rows += int((now[key][rows, cols] != block).any(dim=1).sum())
    assert lost_rows > 0
    if deltas == "hot":
        assert saved_hot > 0 and left_out > 0


@pytest.mark.distributed
def test_full_recovery_equals_the_uninterrupted_run(dataset, tmp_path, tmp_path_factory, capfd):
    """The uninterrupted run is the partial-recovery tests' 2-rank reference (made once)."""
    refs = _reference(capfd, dataset, tmp_path_factory, 2, "table_wise")
    run = tmp_path / "run"
    # (train.resume=false starts this command's run over, not its restart after the failure)
    err = _train(dataset, run, 2, "dist.sharding=table_wise", "train.max_steps=7", "train.checkpoint_every=4",
                 "train.inject_failure=0:6", "dist.max_restarts=1", "train.resume=false")
    assert "resumed from step 4" in err
    (event,) = json.loads((run / "summary.json").read_text())["recovery"]["events"]
    assert (event["mode"], event["checkpoint_step"], event["failed_at_step"], event["resumed_at_step"]) == \
        ("full", 4, 6, 4)
    assert {s["steps_lost"] for s in event["shards"]} == {2}  # every shard trains steps 5-6 again
    a, b = refs[7], _weights(dataset, run, 7)
    for k in a:
        assert torch.equal(a[k], b[k]), k


SNAPSHOT_KEPT = ["train.max_steps=6", "train.checkpoint_every=4", "train.recovery=partial", "train.inject_failure=1:6"]


@pytest.fixture(scope="module")
def failed_for_good(dataset, tmp_path_factory):
    """A 2-rank run whose rank 1 kills itself after step 6, with no restart: it fails for
    good, once for both tests below (each recovers its own copy). Returns the run and the
    launcher's process."""
    run = tmp_path_factory.mktemp("failed_for_good") / "run"
    argv = [sys.executable, "-m", "hybridrec", "train", "--recipe", "demo", f"data.path={dataset}",
            f"train.run_dir={run}", "dist.nproc=2", *SMALL, *SNAPSHOT_KEPT]
    return run, subprocess.run(argv, capture_output=True, text=True, timeout=240, check=False)


@pytest.mark.distributed
@pytest.mark.parametrize("rebooted", [False, True])
def test_the_same_command_again_recovers_from_the_snapshot_the_launcher_kept(dataset, failed_for_good, tmp_path,
                                                                             rebooted):
    """The survivor writes its snapshot to the launcher's directory in /dev/shm; the run
    fails for good (no restarts), and the launcher moves the snapshot into RUN/recovery/
    and removes its directory. The same command again recovers partially from it. A
    snapshot is not synced to disk: its ``rank-R.json`` records the boot it was written in,
    and after another boot (``rebooted``) that rank rolls back like the failed one (here
    none is left: a full recovery)."""
    failed, proc = failed_for_good
    assert proc.returncode != 0 and "kills itself" in proc.stderr, proc.stderr[-3000:]
    written = json.loads((failed / "recovery" / "rank-00000.json").read_text())
    assert written["snapshot"] and written["step"] == 6 and written["boot"]
    fast = Path(written["path"]).parent
    if Path("/dev/shm").is_dir():  # (else written to RUN/recovery/ directly)
        assert fast.parent == Path("/dev/shm") and fast.name.startswith("hybridrec-"), written["path"]
        assert not fast.exists()  # moved: nothing is left in memory
    assert (failed / "recovery" / "rank-00000" / ".metadata").is_file()
    run = tmp_path / "run"
    shutil.copytree(failed, run, symlinks=True)  # (the same command, on this test's own copy)
    progress = run / "recovery" / "rank-00000.json"
    if rebooted:
        progress.write_text(json.dumps({**written, "boot": "another-boot"}))
    err = _train(dataset, run, 2, *SNAPSHOT_KEPT)  # (the injection is recorded: it does not happen again)
    (event,) = json.loads((run / "summary.json").read_text())["recovery"]["events"]
    if rebooted:
        assert "written before the machine restarted" in err, err[-3000:]
        assert (event["survivors"], event["resumed_at_step"]) == ([], 4)  # no survivor: every rank from step 4
        assert {s["steps_lost"] for s in event["shards"]} == {2}
    else:
        assert (event["survivors"], event["failed_ranks"], event["resumed_at_step"]) == ([0], [1], 6), err[-3000:]
        assert event["shards_kept_in_memory"] == []  # (its shards' files were moved to disk: read back)
    assert not (run / "recovery" / "rank-00000").exists()  # consumed


@pytest.mark.distributed
def test_restarted_ranks_keep_the_interval_chosen_before_the_failure(dataset, tmp_path):
    """``train.checkpoint_every=auto``: the first invocation saves at its probe step (10)
    and chooses (here the whole run: a long MTBF); the ranks restarted after the failure
    take that choice instead of probing with one more save (which would be at step 20)."""
    run = tmp_path / "run"
    err = _train(dataset, run, 2, "train.max_steps=24", "train.epochs=20", "train.checkpoint_every=auto",
                 "train.mtbf_hours=1000", "train.inject_failure=0:15", "dist.max_restarts=1")
    assert "resumed from step 10" in err and "as chosen before the restart" in err, err[-3000:]
    saves = [r["step"] for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())
             if r.get("split") == "checkpoint"]
    assert saves == [10, 24]
    assert json.loads((run / "summary.json").read_text())["checkpoint_interval"]["steps"] == 24


@pytest.mark.distributed
def test_auto_interval_prices_a_replay_at_a_measured_read(dataset, tmp_path):
    """``checkpoint_every=auto`` with partial recovery and deltas: the probe's choice (a
    replay priced at a share of the save), then, at the delta after the first one that
    saved rows, the interval again from that delta's timed read-back (rank 0's): the
    summary's choice is the arithmetic on its own recorded inputs."""
    run = tmp_path / "run"
    err = _train(dataset, run, 2, "train.max_steps=40", "train.epochs=20", "train.checkpoint_every=auto",
                 "train.mtbf_hours=0.05", "train.recovery=partial", "train.shard_delta_every=5")
    lines = [ln for ln in err.splitlines() if ln.startswith("checkpoint interval: every")]
    assert len(lines) == 2 and "of the rows, each replay priced" in lines[0] and "(measured)" in lines[1], err
    choice = json.loads((run / "summary.json").read_text())["checkpoint_interval"]
    assert choice["replay_s"] > 0
    again = partial_recovery_interval(save_s=choice["save_s"], step_s=choice["step_s"], mtbf_s=choice["mtbf_s"],
                                      total_steps=40, ranks=2, lost_fraction=0.02, delta_steps=5,
                                      replay_s=choice["replay_s"])
    assert again["steps"] == choice["steps"] and again["reason"] == choice["reason"]
    kept = json.loads((run / "checkpoint_interval.json").read_text())["choice"]
    assert kept["replay_s"] == choice["replay_s"]  # what restarted ranks take
    # no delta where a full checkpoint follows at the same step (the probe's, periodic ones, the final one)
    records = [r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())
               if r.get("split") == "checkpoint"]
    saved = {r["step"] for r in records if "save_seconds" in r}
    assert {10, 40} <= saved
    assert [r["step"] for r in records if "delta_seconds" in r] == [s for s in range(5, 40, 5) if s not in saved]


def test_deltas_time_the_read_of_the_next_delta_with_rows(tmp_path):
    """``ShardDeltas.time_next_read``: the next delta that saves rows is read back once
    written and timed; an empty one does not count, and only one is timed."""
    ebc = EmbeddingBagCollection([TableConfig(name="t0", num_embeddings=40, embedding_dim=4)], seed=0)
    opt = RowWiseAdagrad(ebc, lr=0.1)
    deltas = ShardDeltas(ebc, opt, directory=tmp_path / "d", plan=None, every=1)
    deltas.checkpointed(0)
    deltas.time_next_read()
    deltas.save(1)  # nothing touched: an empty delta
    deltas.wait()
    assert deltas.read_probe is None
    deltas.counts[0][torch.tensor([3, 7, 9])] = 1
    deltas.save(2)
    deltas.wait()
    assert deltas.read_probe["rows"] == 3 and deltas.read_probe["seconds"] > 0
    first = deltas.read_probe
    deltas.counts[0][torch.tensor([1, 2])] = 1
    deltas.save(3)
    deltas.wait()
    assert deltas.read_probe is first


@pytest.mark.parametrize("seed", range(4))
def test_hot_rows_are_the_most_looked_up(seed):
    """CPR-MFU's pick of a delta's rows (``_largest``): ``k`` distinct indices, ascending,
    whose counts are the ``k`` largest (ties at the k-th: the first of them), for counts
    with many ties, a long tail and a few large ones."""
    gen = torch.Generator().manual_seed(seed)
    for _ in range(50):
        n = int(torch.randint(1, 400, (), generator=gen))
        counts = torch.randint(0, int(torch.randint(1, 12, (), generator=gen)), (n,), generator=gen,
                               dtype=torch.int32)
        counts[torch.randint(0, n, (3,), generator=gen)] = 1000  # (a few hot rows: a long histogram)
        k = int(torch.randint(0, n + 2, (), generator=gen))
        got = _largest(counts, k)
        want = min(k, n)
        assert got.numel() == want and torch.equal(got, got.unique())
        assert torch.equal(counts[got].sort(descending=True).values, counts.sort(descending=True).values[:want])
        if 0 < want < n:  # ties at the k-th largest: the first ones
            kth = counts[got].min()
            assert torch.equal(got[counts[got] == kth], (counts == kth).nonzero().squeeze(1)[:int((counts[got] == kth).sum())])


def test_a_checkpoint_deletes_the_older_deltas_off_the_training_thread(tmp_path):
    """After a checkpoint the deltas it made obsolete are no longer listed at once, are
    deleted by :meth:`wait`, and a leftover of a process that ended first goes on resume."""
    ebc = EmbeddingBagCollection([TableConfig(name="t0", num_embeddings=40, embedding_dim=4)], seed=0)
    deltas = ShardDeltas(ebc, RowWiseAdagrad(ebc, lr=0.1), directory=tmp_path / "d", plan=None, every=1)
    deltas.checkpointed(0)
    for step in (1, 2):
        deltas.counts[0][torch.tensor([step, 10 + step])] = 1
        deltas.save(step)
    deltas.wait()
    assert [s for s, _ in deltas.list()] == [1, 2]
    deltas.checkpointed(2)
    assert deltas.list() == [] and len(list((tmp_path / "d").glob(f"{OBSOLETE}*"))) <= 1
    deltas.counts[0][torch.tensor([5])] = 1
    deltas.save(3)
    deltas.wait()
    assert not list((tmp_path / "d").glob(f"{OBSOLETE}*"))
    assert sorted(p.name for p in (tmp_path / "d").iterdir()) == ["step-00000003"]
    (tmp_path / "d" / f"{OBSOLETE}00000002-1" / "step-00000001").mkdir(parents=True)  # (a killed process's)
    deltas.resumed(checkpoint_step=2, step=3)
    assert sorted(p.name for p in (tmp_path / "d").iterdir()) == ["step-00000003"]


def test_a_delta_cut_off_by_a_kill_is_lost_whole(tmp_path):
    """A rank killed while its delta is written leaves a ``.tmp-step-*`` directory (a partial
    ``rows.pt``, no manifest): it is not listed, recovery applies the newest complete delta
    (its rows, not the cut-off one's), and the restarted rank deletes it."""
    ebc = EmbeddingBagCollection([TableConfig(name="t0", num_embeddings=40, embedding_dim=4)], seed=0)
    opt = RowWiseAdagrad(ebc, lr=0.1)
    deltas = ShardDeltas(ebc, opt, directory=tmp_path / "d", plan=None, every=1)
    deltas.checkpointed(0)
    w = ebc.group_weight(0)
    start = w.detach().clone()
    with torch.no_grad():
        w[3] += 1.0
    deltas.counts[0][3] = 1
    deltas.save(1)
    deltas.wait()
    at1 = w.detach().clone()
    with torch.no_grad():  # step 2 changes row 3 again; its delta is cut off
        w[3] += 1.0
    deltas.counts[0][3] = 1
    deltas.save(2)
    deltas.wait()
    cut = tmp_path / "d" / "step-00000002"
    killed = tmp_path / "d" / ".tmp-step-00000002-99999"  # (as a killed process left it)
    cut.rename(killed)
    (killed / "manifest.json").unlink()
    rows = (killed / "rows.pt").read_bytes()
    (killed / "rows.pt").write_bytes(rows[:len(rows) // 2])
    assert [s for s, _ in deltas.list()] == [1]
    with torch.no_grad():
        w.copy_(start)  # (the checkpoint's values)
    assert deltas.apply(0, 2)[0] == 1
    assert torch.equal(w, at1)
    deltas.resumed(checkpoint_step=0, step=2)
    assert sorted(p.name for p in (tmp_path / "d").iterdir()) == ["step-00000001"]


def test_deltas_read_ahead_apply_as_one_by_one(tmp_path):
    """A rank that rolls back reads its deltas while the checkpoint restores (newest first,
    keeping of each only the rows no newer delta has): the tables and the optimizer state
    it ends with are those of applying every delta in turn, oldest first."""
    torch.manual_seed(0)
    ebc = EmbeddingBagCollection([TableConfig(name="t0", num_embeddings=50, embedding_dim=4),
                                  TableConfig(name="t1", num_embeddings=30, embedding_dim=8)], seed=0)
    opt = RowWiseAdagrad(ebc, lr=0.1)
    deltas = ShardDeltas(ebc, opt, directory=tmp_path / "d", plan=None, every=1, rows="hot", hot=0.6)
    deltas.checkpointed(3)
    start = [ebc.group_weight(g).clone() for g in range(ebc.num_groups)]
    for step in range(4, 9):  # overlapping rows from delta to delta, some in every one
        for g in range(ebc.num_groups):
            w = ebc.group_weight(g)
            ids = torch.cat([torch.tensor([0, 1]), torch.randint(0, w.shape[0], (12,))]).unique()
            with torch.no_grad():
                w.index_add_(0, ids, torch.randn(ids.numel(), w.shape[1]))
                for v in opt.row_state(g).values():
                    v.index_add_(0, ids, torch.rand(ids.numel(), *v.shape[1:]))
            deltas.track({SHARDS: [(g, ids, None, None)]})
        deltas.save(step)
    deltas.wait()
    results = []
    for ahead in (False, True):
        with torch.no_grad():
            for g in range(ebc.num_groups):
                ebc.group_weight(g).copy_(start[g])
                for v in opt.row_state(g).values():
                    v.zero_()
        if ahead:
            deltas.prefetch(3)
        assert deltas.apply(3, 8)[0] == 8
        results.append([t.clone() for g in range(ebc.num_groups)
                        for t in (ebc.group_weight(g), *opt.row_state(g).values())])
    assert all(torch.equal(a, b) for a, b in zip(*results, strict=True))
    assert any(not torch.equal(a, b) for a, b in zip(results[0][::2], start))  # (the deltas did apply)


def test_deltas_of_the_earlier_layout_are_still_applied(tmp_path):
    """A delta written as a torch.distributed.checkpoint directory (the layout before
    ``rows.pt``) is found and applied like one of today's."""
    import torch.distributed.checkpoint as dcp

    from hybridrec.parallel.checkpoint_io import FORMAT, MANIFEST, quiet, write_json
    from hybridrec.train.checkpointing.deltas import DELTA_KIND, ROWS

    ebc = EmbeddingBagCollection([TableConfig(name="t0", num_embeddings=20, embedding_dim=4)], seed=0)
    opt = RowWiseAdagrad(ebc, lr=0.1)
    deltas = ShardDeltas(ebc, opt, directory=tmp_path / "d", plan=None, every=1)
    ids = torch.tensor([2, 5, 11])
    rows = {"g0.ids": ids, "g0.weight": torch.full((3, 4), 7.0),
            **{f"g0.state.{k}": torch.full((3, *v.shape[1:]), 3.0) for k, v in opt.row_state(0).items()}}
    old = deltas.dir / "step-00000004"
    old.mkdir(parents=True)
    with quiet():
        dcp.save(rows, storage_writer=dcp.FileSystemWriter(old), no_dist=True)
    write_json(old / MANIFEST, {"format": FORMAT, "kind": DELTA_KIND, "step": 4, "base_step": 2, "plan": None,
                                "rows": 3, "pending_rows": 0, "mode": "touched", "groups": [0]})
    assert not (old / ROWS).exists() and [s for s, _ in deltas.list()] == [4]
    assert deltas.apply(2, 9) == (4, 0, {})
    w = ebc.group_weight(0)
    assert torch.equal(w[ids], rows["g0.weight"]) and not torch.equal(w[0], torch.full((4,), 7.0))
    for k, v in opt.row_state(0).items():
        assert torch.equal(v[ids], rows[f"g0.state.{k}"])


@pytest.mark.distributed
def test_incremental_saves_outlive_a_recovery_and_serve_the_next_failure(dataset, tmp_path, capfd):
    """Rank 1 fails at step 5, rank 0 at 7 (rank 1 survives it), rank 1 again at 8: its
    shards roll back to its newest delta, written after its recovery at 5, which the
    recovery at 7 must not have deleted, and lose the steps since it (not the three since
    its recovery at 5).

    Which delta that is: rank 1 staged its delta of step 6 before it trained step 7, and it
    is on disk (the delta of step 7 waited for it, or else the stopped rank did before it
    ended); its delta of step 7 is there too unless the launcher stopped rank 1 before it
    staged it (on a loaded machine it can). So step 6 or 7, and the record says which."""
    run = tmp_path / "run"
    _train_here(capfd, dataset, run, 2, "dist.sharding=table_wise", "train.max_steps=9", "train.checkpoint_every=4",
                "train.recovery=partial", "train.shard_delta_every=1", "train.inject_failure=1:5,0:7,1:8",
                "dist.max_restarts=3")
    events = json.loads((run / "summary.json").read_text())["recovery"]["events"]
    assert [(e["failed_ranks"], e["failed_at_step"], e["resumed_at_step"]) for e in events] == \
        [([1], 5, 5), ([0], 7, 7), ([1], 8, 8)], events
    last = events[-1]
    held = last["deltas"]["1"]["step"]
    assert held in (6, 7), last["deltas"]
    assert {s["steps_lost"] for s in last["shards"] if s["rank"] == 1} == {8 - held}
    assert {s["steps_lost"] for s in last["shards"] if s["rank"] == 0} == {0}
