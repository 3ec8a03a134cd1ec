"""`hybridrec train --nproc 2`: real torchrun launch, 2 gloo ranks, and a dying rank."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from distributed import free_port, launched_ranks

from hybridrec.cli.launch import PEER_LOST, oom_kill_count
from hybridrec.cli.main import main

pytestmark = pytest.mark.distributed

SMALL = ["model.embedding_dim=8", "model.bottom_mlp=16,8", "model.top_mlp=16,1",
         "data.batch_size=64", "data.eval_batch_size=1000", "train.progress=false"]


@pytest.fixture(scope="module")
def dataset(shared_dataset):
    return shared_dataset(days=2, rows=2000)


def _args(dataset, run, *extra):
    return ["train", "--recipe", "demo", f"data.path={dataset}", f"train.run_dir={run}", "dist.nproc=2", *SMALL,
            *extra]


def _cmd(dataset, run, *extra):
    return [sys.executable, "-m", "hybridrec", *_args(dataset, run, *extra)]


RESUME = ["dist.sharding=row_wise", "train.checkpoint_every=4", "optim.sparse=rowwise_adagrad"]


@pytest.fixture(scope="module")
def two_rank_run(dataset, tmp_path_factory):
    """An uninterrupted 2-rank run, launched once for two tests: the end-to-end test checks
    what it wrote, the resume test compares the interrupted runs with it."""
    run = tmp_path_factory.mktemp("launch_full") / "full"
    proc = subprocess.run(_cmd(dataset, run, *RESUME, "train.max_steps=12", "dist.pipeline=false"),
                          capture_output=True, text=True, timeout=240, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return run, proc.stdout


def test_two_ranks_train_end_to_end(two_rank_run):
    run, stdout = two_rank_run
    assert "AUC" in stdout
    summary = json.loads((run / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["step"] == 12
    assert summary["eval"]["count"] == 2000  # both ranks' eval rows, gathered
    plan = json.loads((run / "plan.json").read_text())
    assert {t["sharding_type"] for t in plan["tables"].values()} == {"row_wise"}
    cats = summary["comm"]["by_category"]
    assert cats["output_dist"]["sent"] > 0 and cats["dense_allreduce"]["sent"] > 0
    # One process evaluates the 2-rank run's sharded checkpoint: the same held-out metrics.
    assert main(["eval", str(run)]) == 0
    ev = json.loads((run / "eval.json").read_text())
    assert ev["count"] == 2000 and abs(ev["auc"] - summary["eval"]["auc"]) < 1e-6


def test_a_dead_rank_ends_the_run_with_an_error(dataset, tmp_path):
    proc = subprocess.Popen(_cmd(dataset, tmp_path / "run", "train.epochs=50", "dist.timeout_s=30"),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    # Wait until the launcher (torch's elastic agent, in the hybridrec process) has started
    # its workers and they are training: metrics.jsonl is first written at step 50
    # (train.log_every), not at the setup's end as plan.json is.
    deadline = time.monotonic() + 120
    workers = {}
    while time.monotonic() < deadline and proc.poll() is None:
        workers = launched_ranks(proc.pid)
        if len(workers) == 2 and (tmp_path / "run" / "metrics.jsonl").exists():
            break
        time.sleep(0.1)
    assert sorted(workers) == [0, 1] and (tmp_path / "run" / "metrics.jsonl").exists(), "workers did not train"
    rank = 1
    victim = workers[rank]
    os.kill(victim, signal.SIGKILL)
    try:
        _, err = proc.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        proc.kill()
        pytest.fail("the surviving rank hung after its peer died")
    assert proc.returncode == 1
    # One line names the dead rank, its pid and the signal; the surviving rank, whose
    # collective lost its peer, and the agent say nothing more.
    lines = err.splitlines()
    assert lines[0].startswith("launching 2 ranks: hybridrec train "), err[-3000:]
    why = ("(by another process, or by the kernel's out-of-memory killer)" if oom_kill_count() is None
           else "(by another process: not the out-of-memory killer, which counted no kill)")
    assert lines[1:] == [f"hybridrec: error: rank {rank} (pid {victim}) was killed by SIGKILL {why}"], err[-3000:]


def test_a_rank_that_loses_its_peer_says_so_in_one_line(dataset, tmp_path):
    """Ranks started by another launcher (torchrun across machines): the rank whose
    collective finds its peer gone says so in one line, without gloo's traceback."""
    port = str(free_port())
    run = tmp_path / "run"
    argv = _cmd(dataset, run, "train.epochs=50", "dist.timeout_s=30")
    argv.remove("dist.nproc=2")
    ranks = [subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                              env={**os.environ, "RANK": str(r), "LOCAL_RANK": str(r), "WORLD_SIZE": "2",
                                   "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port})
             for r in range(2)]
    try:
        deadline = time.monotonic() + 120  # training: metrics.jsonl is first written at step 50
        while not (run / "metrics.jsonl").exists() and time.monotonic() < deadline and ranks[0].poll() is None:
            time.sleep(0.1)
        assert (run / "metrics.jsonl").exists(), "the ranks did not train"
        ranks[1].kill()
        _, err = ranks[0].communicate(timeout=60)
    finally:
        for p in ranks:
            p.kill()
            p.wait()
    assert ranks[0].returncode == PEER_LOST, err[-3000:]
    assert err.splitlines() == [("hybridrec: error: lost the connection to another rank: it exited or "
                                 "was killed (its own error, or its launcher's report, says why)")], err[-3000:]


def _load_single(dataset, run):
    """A run's newest checkpoint (sharded or not), loaded into one process."""
    from hybridrec.train.run import load_run_model

    _, _, model, _, extra = load_run_model(run, data_path=str(dataset))
    return extra["step"], model.state_dict()


def _records(run, split):
    return [r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())
            if r["split"] == split]


def test_two_rank_resume_equals_uninterrupted_and_reshards_to_one(dataset, two_rank_run, tmp_path):
    """The uninterrupted run (12 steps, the fixture's) has the input pipeline off, the
    interrupted one on: stopping, resuming and pipelining must all leave the result unchanged."""
    full, cut = two_rank_run[0], tmp_path / "cut"
    for steps in (8, 12):  # (in this process: the same launcher)
        assert main(_args(dataset, cut, *RESUME, f"train.max_steps={steps}", "dist.pipeline=true")) == 0
    (sa, a), (sb, b) = _load_single(dataset, full), _load_single(dataset, cut)
    assert sa == sb == 12
    for k in a:
        assert torch.equal(a[k], b[k]), k
    # The same run continues on ONE process with the same global batch (2 x 64): the
    # sharded checkpoint reshards into the single-process model. (One process: trained in
    # this one, as tests/conftest.py's trained_run does, without starting an interpreter.)
    one_process = ["train", "--recipe", "demo", f"data.path={dataset}", *SMALL, "data.batch_size=128",
                   "optim.sparse=rowwise_adagrad", "train.max_steps=14"]
    assert main([*one_process, f"train.run_dir={cut}"]) == 0
    summary = json.loads((cut / "summary.json").read_text())
    assert summary["resumed_from"] == 12 and summary["step"] == 14
    assert summary["world_size"] == 1
    # Its metrics continue the same log: every logged step once per split, in order, to 14.
    for split in ("train", "eval"):
        steps = [r["step"] for r in _records(cut, split)]
        assert steps == sorted(set(steps)) and steps[-1] == 14 and 12 in steps, (split, steps)
    # The uninterrupted reference: one process, the same global batch, 14 steps. The
    # world size changes the order of float sums, so equal up to rounding (the tolerance
    # of the sharded-vs-single-process tests), not bit for bit.
    one = tmp_path / "one"
    assert main([*one_process, f"train.run_dir={one}"]) == 0
    (sc, c), (so, o) = _load_single(dataset, cut), _load_single(dataset, one)
    assert sc == so == 14 and c.keys() == o.keys()
    for k in o:
        torch.testing.assert_close(c[k], o[k], rtol=1e-5, atol=1e-6, msg=lambda m, k=k: f"{k}: {m}")
    ref_eval = json.loads((one / "summary.json").read_text())["eval"]
    assert summary["eval"]["count"] == ref_eval["count"]
    assert summary["eval"]["auc"] == pytest.approx(ref_eval["auc"], abs=1e-6)
    assert summary["eval"]["log_loss"] == pytest.approx(ref_eval["log_loss"], abs=1e-6)
    assert _records(cut, "eval")[-1]["log_loss"] == pytest.approx(ref_eval["log_loss"], abs=1e-6)


def _machine(dataset, run, port, node_rank, nnodes, join_timeout_s):
    """One machine's launcher of a launch of ``nnodes`` on loopback (this machine stands for
    them all), one rank each."""
    argv = _cmd(dataset, run, f"dist.nnodes={nnodes}", f"dist.node_rank={node_rank}", f"dist.master=127.0.0.1:{port}",
                "dist.interface=lo", f"dist.join_timeout_s={join_timeout_s}")
    argv.remove("dist.nproc=2")
    return subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def _ended(proc, within_s=180):
    try:
        _, err = proc.communicate(timeout=within_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        pytest.fail("the launcher did not give up waiting for the other machines")
    return proc.returncode, err


def test_a_launch_whose_machines_do_not_come_gives_up_naming_them(dataset, tmp_path):
    """Machine 0 of 2 alone: after dist.join_timeout_s it exits non-zero with one line
    naming the machine that did not join (it waited silently for 600 s and more)."""
    port = free_port()
    status, err = _ended(_machine(dataset, tmp_path / "run", port, 0, 2, 2))
    assert status != 0, err[-3000:]
    lines = err.splitlines()
    assert lines[0].startswith("launching 1 rank of machine 0 of 2 "), err[-3000:]
    assert lines[1:] == [(f"hybridrec: error: gave up after dist.join_timeout_s=2 s: machine with dist.node_rank 1 "
                          f"did not join the launch at 127.0.0.1:{port} (1 of 2 joined)")], err[-3000:]


def test_a_machine_whose_host_does_not_come_gives_up_naming_it(dataset, tmp_path):
    port = free_port()
    status, err = _ended(_machine(dataset, tmp_path / "run", port, 1, 2, 2))
    assert status != 0, err[-3000:]
    assert err.splitlines()[1:] == [
        ("hybridrec: error: gave up after dist.join_timeout_s=2 s: machine 0 (dist.node_rank 0), which hosts the "
         f"launch's rendezvous at 127.0.0.1:{port}, was not reachable (Connection refused)")], err[-3000:]


def test_machines_that_came_name_the_one_that_did_not(dataset, tmp_path):
    """Machines 0 and 1 of 3: both end, each in one line naming machine 2 (the one that
    gives up first closes the launch; the other says so), and nothing else but the lines
    of the wait (no C++ log of a store gone under the other)."""
    port = free_port()
    machines = [_machine(dataset, tmp_path / "run", port, r, 3, 8) for r in (0, 1)]
    ended = [_ended(m, within_s=240) for m in machines]
    missing = (f"machine with dist.node_rank 2 did not join the launch at 127.0.0.1:{port} (2 of 3 joined)")
    for status, err in ended:
        assert status != 0, err[-3000:]
        lines = err.splitlines()  # (a wait over 30 s says so at 30 s: test_a_waiting_machine_says_so_every_30_s)
        assert all(line.startswith("waiting for machines (dist.nnodes=3, ") for line in lines[1:-1]), err[-3000:]
        assert lines[-1].startswith("hybridrec: error: ") and lines[-1].endswith(missing), err[-3000:]


def test_a_waiting_machine_says_so_every_30_s():
    from hybridrec.cli.rendezvous import JoinReport

    report = JoinReport(3, "10.0.0.1:29500", 600, start=100.0)
    lines = {t: report.progress(1 if t < 70 else 2, 100.0 + t) for t in (1, 29.9, 30, 31, 59, 75, 76, 155)}
    assert [t for t, line in lines.items() if line] == [30, 75, 155]  # (one line per 30 s, late ones not repeated)
    assert lines[30] == "waiting for machines (dist.nnodes=3, rendezvous at 10.0.0.1:29500): 1 of 3 joined, 30 s"
    assert lines[75].endswith(": 2 of 3 joined, 75 s")
    assert report.deadline == 700.0
    waiting_for_host = JoinReport(2, "10.0.0.1:29500", 600, start=0.0)
    assert waiting_for_host.progress(0, 31.0, host_unreachable=True).endswith(
        ": 0 of 2 joined, 31 s (machine 0, which hosts it, is not reachable yet)")
