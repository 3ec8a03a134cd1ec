"""Hierarchical training (dist.group_size): groups synchronous inside, a synchronizer
across. The identities: MA after every step with SGD equals flat synchronous training on
the same ranks (dense and every table); a background synchronizer keeps the dense part of
the members of a group bitwise equal; the compressed cross-group mean keeps its anchor equal
everywhere; groups that do not fit are refused before any process group is made."""

import pytest
import torch
from distributed import run_ranks
from test_sharded_embedding import (
    GLOBAL_B,
    build,
    full_tables_from_shards,
    global_batches,
    local_batch,
    make_plan,
)

from hybridrec.comm.compress import DCTCompressor
from hybridrec.comm.ddp_hooks import CompressedAllReduce
from hybridrec.comm.ledger import CommLedger
from hybridrec.parallel.dense_sync import DDPSync
from hybridrec.parallel.parallelize import parallelize_dlrm
from hybridrec.parallel.topology import Topology, group_problem
from hybridrec.sync import ForegroundRunner, make_synchronizer
from hybridrec.sync.algorithms import GroupMean
from hybridrec.sync.compressed import CompressedMean
from hybridrec.sync.grouped import GroupedBackgroundRunner
from hybridrec.train.loop.optim import dense_parameters
from hybridrec.train.loop.sparse_optim import combined_sparse_optimizer
from hybridrec.train.loop.step import training_step
from hybridrec.train.setup.config import Config
from hybridrec.train.setup.rules import hierarchy_problem

pytestmark = pytest.mark.distributed


def _train(topo, model, sync, steps, after_step=None):
    dense_opt = torch.optim.SGD(dense_parameters(model), lr=0.1)
    sparse_opt = combined_sparse_optimizer("sgd", model.sparse, lr=0.1)
    batches, b = global_batches(True), GLOBAL_B // topo.job_size
    lo = topo.job_rank * b
    for step in range(1, steps + 1):
        batch = local_batch(batches[step % len(batches)], lo, lo + b)
        training_step(model, batch, dense_opt=dense_opt, sparse_opt=sparse_opt, dense_sync=sync)
        if after_step is not None:
            after_step(step)


def _result(model):
    shards = {k: (s, w.detach().clone()) for k, (s, w) in model.sparse.local_shards().items()}
    dense = torch.cat([p.detach().reshape(-1) for p in dense_parameters(model)])
    return shards, dense


def flat_worker(topo, steps):
    sync = DDPSync(topo)
    model = parallelize_dlrm(build("sum"), make_plan("table_wise", topo.group_size), topo, dense_sync=sync)
    _train(topo, model, sync, steps)
    return _result(model)


def hier_worker(topo, steps, mode="foreground", compress=None, rows="all"):
    """Groups of 2 over the ranks ``run_ranks`` started; MA across groups of the whole
    replica (dense part, then the member's shards), after every step (foreground) or in
    the background. ``rows="all"``: the table rows' plain mean, SGD's exact one (the
    default for adaptive optimizers, over the groups that touched a row: test_hier_rows)."""
    h = Topology.init(backend="gloo", group_size=2)
    ledger = CommLedger()
    sync = DDPSync(h, ledger=ledger)
    model = parallelize_dlrm(build("sum"), make_plan("table_wise", h.group_size), h, ledger=ledger, dense_sync=sync)
    dense = dense_parameters(model)
    params, parts = dense + list(model.sparse.parameters()), (sum(p.numel() for p in dense),)
    group = h.cross_groups(1)[0]
    mean = GroupMean(group, ledger, parts)
    if compress == "dct":
        mean = CompressedMean(group, CompressedAllReduce(DCTCompressor(0.3, 2), ledger, category="sync"),
                              ledger, parts)
    if mode == "foreground":
        runner = ForegroundRunner(make_synchronizer("ma"), params, group, ledger=ledger, mean=mean, rows=rows)
    else:
        flags = torch.distributed.new_group(list(range(h.job_size)), backend="gloo")
        runner = GroupedBackgroundRunner(make_synchronizer("ma"), params, group, ledger=ledger, mean=mean,
                                         members=h.group, flag_group=flags, rows=rows)
    runner.start()
    _train(h, model, sync, steps, runner.after_step)
    if mode == "background":
        runner.stop()
    before_finish = _result(model)
    runner.finish()
    anchor = getattr(mean, "anchor", None)
    return (h.group_index, h.rank), before_finish, _result(model), runner.summary(), ledger.summary(), anchor


def test_groups_with_ma_every_step_equal_flat_synchronous_training():
    steps = 4
    flat = run_ranks(flat_worker, 4, steps, timeout_s=120)
    hier = run_ranks(hier_worker, 4, steps, timeout_s=120)
    assert [h[0] for h in hier] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    want_tables = full_tables_from_shards([s for s, _ in flat])
    for g in (0, 1):
        got = full_tables_from_shards([hier[2 * g][1][0], hier[2 * g + 1][1][0]])
        for name, t in want_tables.items():
            torch.testing.assert_close(got[name], t, rtol=1e-5, atol=1e-6, msg=f"group {g}, table {name}")
    for r in range(4):
        torch.testing.assert_close(hier[r][1][1], flat[0][1], rtol=1e-5, atol=1e-6)
    # The round moved the whole replica of each member over its cross group, counted as sync.
    s, comm = hier[0][3], hier[0][4]
    assert s["rounds"] == steps and comm["by_category"]["sync"]["sent"] > 0


def test_background_groups_keep_each_groups_dense_part_bitwise_equal():
    out = run_ranks(hier_worker, 4, 12, "background", timeout_s=120)
    for g in (0, 1):
        a, b = out[2 * g], out[2 * g + 1]
        assert torch.equal(a[1][1], b[1][1]), "members of a group diverged before the final average"
        assert a[3]["rounds"] == b[3]["rounds"] >= 1
    for r in range(4):  # after the final exact average: one model everywhere
        assert torch.equal(out[r][2][1], out[0][2][1])
    # The per-step agreement inside the group is counted apart from the cross-group rounds.
    assert out[0][4]["by_category"]["sync_members"]["sent"] == 8 * 12


def test_compressed_cross_group_mean_keeps_one_anchor_and_sends_less():
    out = run_ranks(hier_worker, 4, 6, "foreground", "dct", timeout_s=120)
    for j in (0, 1):  # member j of both groups: the same anchor
        assert torch.equal(out[j][5], out[2 + j][5])
    for g in (0, 1):  # and the members of a group the same dense part
        assert torch.equal(out[2 * g][1][1], out[2 * g + 1][1][1])
    sync = out[0][4]["by_category"]["sync"]
    assert sync["sent"] < sync["original"]
    for r in range(4):  # the last average is exact: one dense model everywhere
        torch.testing.assert_close(out[r][2][1], out[0][2][1], rtol=0, atol=1e-6)


def test_groups_that_do_not_fit_are_refused_before_any_process_group():
    assert group_problem(4, 2, 4) is None and group_problem(8, 4, 2) is None
    assert "does not divide" in group_problem(6, 4, 6)
    assert "one must divide the other" in group_problem(12, 4, 6)
    cfg = Config()
    cfg.dist.group_size = 2
    assert "nothing keeps them together" in hierarchy_problem(cfg, 4, 4)
    cfg.sync.algorithm = "ma"
    assert hierarchy_problem(cfg, 4, 4) is None
    assert "does not divide" in hierarchy_problem(cfg, 3, 3)
    cfg.dist.num_ps = 1  # groups of trainers sharing the servers
    assert hierarchy_problem(cfg, 4, 4) is None
    cfg.train.workers = 2
    assert "one rank only" in hierarchy_problem(cfg, 4, 4)


def test_default_group_is_one_machine_only_with_a_synchronizer_across_machines():
    from hybridrec.train.setup.rules import group_size

    cfg = Config()
    assert group_size(cfg, 8, 4) == 8  # no synchronizer: flat
    cfg.sync.algorithm = "ma"
    assert group_size(cfg, 8, 4) == 4 and group_size(cfg, 4, 4) == 4
    cfg.dist.group_size = 2
    assert group_size(cfg, 8, 4) == 2


# -- end to end through the CLI: 2 groups x 2 ranks --------------------------------------
SMALL = ["model.embedding_dim=8", "model.bottom_mlp=16,8", "model.top_mlp=16,1",
         "data.batch_size=64", "data.eval_batch_size=1000", "train.progress=false"]


@pytest.fixture(scope="module")
def dataset(shared_dataset):
    
    return shared_dataset(days=2, rows=4000)  # 15 steps of 4 x 64


def _args(dataset, run, *extra) -> list[str]:
    return ["train", "--recipe", "demo", f"data.path={dataset}", f"train.run_dir={run}", *SMALL, "dist.nproc=4",
            "dist.group_size=2", "sync.algorithm=ma", "dist.timeout_s=30", "train.max_steps=12",
            "train.checkpoint_every=4", *extra]


def _launch(dataset, run, *extra, timeout=240):
    """In a new interpreter: for a test that reads what the ranks print (ranks forked from
    this process's fork server, if one runs, write where its stderr was when it started,
    not into a test's ``capfd``)."""
    import subprocess
    import sys

    return subprocess.run([sys.executable, "-m", "hybridrec", *_args(dataset, run, *extra)], capture_output=True,
                          text=True, timeout=timeout, check=False)


def _refused(capfd, dataset, run, *extra) -> tuple[int, str]:
    """A launch refused before any rank starts, through the CLI's entry in this process: its
    exit status and what it wrote to stderr."""
    from hybridrec.cli.main import main

    capfd.readouterr()  # (what came before is not this launch's)
    status = main(_args(dataset, run, *extra))
    return status, capfd.readouterr().err


def test_cli_a_group_size_that_does_not_divide_the_ranks_is_one_line_before_launch(dataset, tmp_path, capfd):
    status, err = _refused(capfd, dataset, tmp_path / "run", "dist.group_size=3")
    assert status == 2, err[-2000:]
    assert err.strip().splitlines()[-1] == (
        "hybridrec: error: dist.group_size=3 does not divide the 4 ranks of this run into equal groups")
    assert "launching" not in err and not (tmp_path / "run").exists()


def test_cli_a_dead_group_member_ends_the_run_and_the_same_command_resumes(dataset, tmp_path):
    import json

    from hybridrec.train.checkpointing import checkpoint as ckpt
    from hybridrec.train.checkpointing.faults import read_marker

    run = tmp_path / "run"
    proc = _launch(dataset, run, "train.inject_failure=3:6")
    assert proc.returncode == 1, proc.stderr[-3000:]
    pid = read_marker(run)["pid"]
    assert proc.stderr.splitlines()[-1] == (f"hybridrec: error: rank 3 (pid {pid}) was killed by SIGKILL "
                                            "(injected: train.inject_failure)"), proc.stderr[-3000:]
    # Group 0's checkpoints, for every group: step 4 at least (no rank passed a checkpoint's
    # step before it was saved); group 0 may have saved step 8 before the agent stopped it.
    saved = [s for s, _ in ckpt.list_checkpoints(run)]
    assert saved in ([4], [4, 8]), saved
    proc = _launch(dataset, run, "train.inject_failure=3:6")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"resumed from step {saved[-1]}" in proc.stderr
    summary = json.loads((run / "summary.json").read_text())
    assert summary["step"] == 12 and summary["world_size"] == 4
    assert summary["hierarchy"] == {"groups": 2, "group_size": 2}
    levels = summary["bytes_by_level"]
    assert levels["cross"]["categories"] == ["sync"] and levels["cross"]["sent"] > 0
    assert "output_dist" in levels["intra"]["categories"]


def test_cli_groups_share_parameter_servers(dataset, tmp_path):
    import json

    from hybridrec.cli.main import main

    run = tmp_path / "run"
    assert main(_args(dataset, run, "dist.num_ps=1", "train.max_steps=8")) == 0
    summary = json.loads((run / "summary.json").read_text())
    assert summary["hierarchy"] == {"groups": 2, "group_size": 2} and summary["step"] == 8
    levels = summary["bytes_by_level"]
    assert levels["cross"]["categories"] == ["sync"] and levels["cross"]["sent"] > 0
    assert set(levels["servers"]["categories"]) == {"ps_pull", "ps_push"}
    assert "dense_allreduce" in levels["intra"]["categories"]


def test_cli_a_plan_for_other_ranks_or_with_missing_members_is_one_line_before_launch(dataset, tmp_path, capfd):
    import json

    from hybridrec.cli.main import main

    plan = tmp_path / "plan.json"
    assert main(["plan", "--nproc", "4", "--data", str(dataset), "--dim", "8", "--out", str(plan)]) == 0
    status, err = _refused(capfd, dataset, tmp_path / "run", f"dist.plan={plan}")  # groups of 2, a plan for 4
    assert status == 2, err[-2000:]
    assert err.strip().splitlines()[-1] == (
        f"hybridrec: error: dist.plan {plan} is for 4 ranks, each group of this run has 2")
    doc = json.loads(plan.read_text())
    doc["world_size"] = 2
    first = next(iter(doc["tables"].values()))
    first["shards"][0]["rank"] = 3  # a member group 0 does not have
    plan.write_text(json.dumps(doc))
    status, err = _refused(capfd, dataset, tmp_path / "run", f"dist.plan={plan}")
    assert status == 2, err[-2000:]
    last = err.strip().splitlines()[-1]
    assert last.startswith(f"hybridrec: error: dist.plan {plan}: ") and "rank 3 outside world of 2" in last, last
    assert "launching" not in err


def one_group_worker(topo):
    h = Topology.init(backend="gloo", group_size=topo.group_size)
    return h.hierarchical, h.group is torch.distributed.group.WORLD, h.cross_group, h.job_rank == h.rank


def test_one_group_is_the_flat_topology():
    """dist.group_size equal to the world: the flat topology itself (the same world group, no
    cross group), so the run is the flat synchronous run, unchanged."""
    assert run_ranks(one_group_worker, 2) == [(False, True, None, True)] * 2
