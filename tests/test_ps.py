"""Parameter-server mode, end to end: real trainer and server processes started by the
command (torch's elastic agent), RPC over TensorPipe on the loopback interface."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from distributed import launched_ranks

from hybridrec.cli.main import main
from hybridrec.train.run import load_run_model

SMALL = ["model.bottom_mlp=[32,16]", "model.top_mlp=[32,1]", "data.batch_size=256", "data.prefetch=0",
         "train.progress=false"]


@pytest.fixture(scope="module")
def data(shared_dataset) -> Path:
    return shared_dataset(days=2, rows=4000)


def _summary(run: Path) -> dict:
    return json.loads((run / "summary.json").read_text())


def test_one_trainer_equals_one_process(data, tmp_path):
    """One trainer, two servers (each table's rows split over both): every pull waits for the
    trainer's previous push, so this is one-process training up to the order of a row's
    gradient sums."""
    common = [f"data.path={data}", "train.max_steps=12", "optim.sparse=rowwise_adagrad", *SMALL]
    assert main(["train", *common, f"train.run_dir={tmp_path / 'one'}"]) == 0
    assert main(["train", *common, "dist.num_ps=2", f"train.run_dir={tmp_path / 'ps'}"]) == 0
    _, _, one, _, _ = load_run_model(tmp_path / "one")
    _, _, ps, path, extra = load_run_model(tmp_path / "ps")
    assert (path / "ps" / "manifest.json").is_file() and extra["step"] == 12
    a, b = one.state_dict(), ps.state_dict()
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=1e-4, atol=1e-6, msg=k)
    s1, s2 = _summary(tmp_path / "one"), _summary(tmp_path / "ps")
    assert s2["eval"]["auc"] == pytest.approx(s1["eval"]["auc"], abs=1e-4)
    assert s2["ps"] == {"servers": 2, "steps_pushed": 12, "staleness_mean": 0.0, "staleness_max": 0.0}
    cats = s2["comm"]["by_category"]
    assert cats["ps_pull"]["sent"] > 0 and cats["ps_pull"]["received"] > cats["ps_pull"]["sent"]
    assert cats["ps_push"]["sent"] > cats["ps_pull"]["sent"]  # ids and their gradient rows


@pytest.mark.distributed
def test_two_synchronous_trainers_equal_one_process_across_a_resume(data, tmp_path):
    """Staleness bound 0: each step's pushes are summed into one update, so 2 trainers of
    batch B train what one process trains with batch 2B (row-wise Adagrad included), also
    when stopped and resumed in between."""
    run = tmp_path / "run"
    common = [f"data.path={data}", "optim.sparse=rowwise_adagrad", *SMALL]
    ps = [*common, "dist.nproc=2", "dist.num_ps=1", "dist.ps_max_staleness=0", "train.checkpoint_every=3",
          f"train.run_dir={run}"]
    assert main(["train", *ps, "train.max_steps=5"]) == 0
    assert main(["train", *ps, "train.max_steps=7"]) == 0
    assert main(["train", *common, "data.batch_size=512", "train.max_steps=7", f"train.run_dir={tmp_path / 'one'}"]) == 0
    a, b = load_run_model(tmp_path / "one")[2].state_dict(), load_run_model(run)[2].state_dict()
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=1e-4, atol=1e-6, msg=k)
    s = _summary(run)
    assert s["step"] == 7 and s["resumed_from"] == 5
    assert s["ps"]["steps_pushed"] == 7 and s["ps"]["staleness_max"] == 0
    assert json.loads((run / "plan.json").read_text())["world_size"] == 1  # the servers' placement
    assert main(["eval", str(run)]) == 0
    assert json.loads((run / "eval.json").read_text())["auc"] == pytest.approx(s["eval"]["auc"], abs=1e-6)


def _launch(data: Path, run: Path, *extra: str) -> subprocess.Popen:
    args = [sys.executable, "-m", "hybridrec", "train", f"data.path={data}", f"train.run_dir={run}",
            "train.epochs=1000", "train.save_checkpoints=false", "dist.timeout_s=20", *SMALL, *extra]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)


def _process_of_rank(parent: int, rank: int) -> int:
    """The pid of the launched process with RANK=rank (under the launcher ``parent``)."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if (pid := launched_ranks(parent).get(rank)) is not None:
            return pid
        time.sleep(0.2)
    raise AssertionError(f"no process of rank {rank}")


def _wait_for_training(proc: subprocess.Popen, run: Path) -> list[str]:
    lines = []
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:  # training has begun once a step is logged
        if (run / "metrics.jsonl").is_file() and (run / "metrics.jsonl").read_text().strip():
            return lines
        time.sleep(0.2)
    proc.kill()
    raise AssertionError(proc.communicate()[0])


@pytest.mark.distributed
@pytest.mark.parametrize("victim", ["server", "trainer"])
def test_a_dead_process_ends_the_run(data, tmp_path, victim):
    """A server or a trainer killed mid-run: the others stop with an error, no hang."""
    run = tmp_path / "run"
    proc = _launch(data, run, "dist.nproc=2", "dist.num_ps=1", "train.log_every=1")
    try:
        _wait_for_training(proc, run)
        os.kill(_process_of_rank(proc.pid, 2 if victim == "server" else 1), signal.SIGKILL)
        out, _ = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode not in (0, None)
    assert "hybridrec: error:" in out, out
    assert "Traceback" not in out, out
    assert "tensorpipe" not in out.lower(), out  # no RPC internals: the server, and that it went away
    if victim == "server":  # the launcher's line alone: the trainers that lost it stay quiet under it
        lines = [ln for ln in out.splitlines() if ln.startswith("hybridrec: error: ")]
        assert len(lines) == 1 and lines[0].startswith("hybridrec: error: parameter server ps0 (rank 2) (pid ") \
            and "was killed by SIGKILL" in lines[0], out


GONE = ("hybridrec: error: parameter server ps0 went away: the connection to it closed (the server exited "
        "or was killed)")


@pytest.mark.parametrize("text", [  # what TensorPipe's transports raise (shared memory, TCP) for a killed server
    "eof (this error originated at tensorpipe/transport/shm/connection_impl.cc:259)",
    "EOF: end of file (this error originated at tensorpipe/transport/uv/connection_impl.cc:132)",
    # (the same-machine channel that reads the dead server's memory)
    "process_vm_readv: No such process (this error originated at tensorpipe/channel/cma/context_impl.cc:442)",
])
def test_a_server_that_went_away_is_one_line_naming_it(text):
    from hybridrec.errors import PeerGone, error_line
    from hybridrec.ps.client import ServerError, wait_reply

    fut = torch.futures.Future()
    fut.set_exception(RuntimeError(text))
    with pytest.raises(ServerError) as e:
        wait_reply(fut, "push", "ps0")
    assert f"hybridrec: error: {error_line(e.value)}" == GONE
    assert isinstance(e.value, PeerGone)  # (quiet under the launcher, whose line names the server)


def test_other_server_failures_keep_their_first_line_without_rpc_internals():
    from hybridrec.errors import error_line
    from hybridrec.ps.client import ServerError, wait_reply

    for text, line in [
        ("RPC ran for more than set timeout (20000 ms) and will now be marked with an error",
         "parameter server ps1: pull: no answer within dist.timeout_s (the server hung, or is far slower)"),
        ("On WorkerInfo(id=3, name=ps1):\nValueError('bad ids')\nTraceback ...",
         "parameter server ps1: pull failed: ValueError('bad ids')"),
        ("oops (this error originated at tensorpipe/core/pipe_impl.cc:1)", "parameter server ps1: pull failed: oops"),
    ]:
        fut = torch.futures.Future()
        fut.set_exception(RuntimeError(text))
        with pytest.raises(ServerError) as e:
            wait_reply(fut, "pull", "ps1")
        assert error_line(e.value) == line


def _server(num_trainers: int, max_staleness: int, timeout_s: float = 30.0):
    from hybridrec.model.embedding import TableConfig
    from hybridrec.parallel.topology import Topology
    from hybridrec.ps.server import EmbeddingServer
    from hybridrec.train.setup.tables import uniform_plan

    tables = [TableConfig(name="t", num_embeddings=10, embedding_dim=2)]
    from hybridrec.train.loop.sparse_optim import combined_sparse_optimizer

    return EmbeddingServer(tables, uniform_plan("row_wise", tables, 1, 1), Topology.single(),
                           optimizer=lambda ebc: combined_sparse_optimizer("sgd", ebc, lr=1.0),
                           num_trainers=num_trainers, max_staleness=max_staleness, timeout_s=timeout_s)


def test_server_applies_pushes_and_counts_staleness():
    s = _server(2, -1)
    ids = torch.tensor([1, 3])
    v0, rows = s.pull(0, 1, {"t": ids})
    s.pull(1, 1, {"t": ids})
    assert s.push(1, 1, 0.5, {"t": (ids, torch.ones(2, 2))}, v0) == 0  # nothing in between
    assert s.push(0, 1, 0.5, {"t": (ids, torch.ones(2, 2))}, v0) == 1  # trainer 1's push in between
    _, after = s.pull(0, 2, {"t": ids})
    torch.testing.assert_close(after["t"], rows["t"] - 1.0)  # two pushes of lr 0.5 x 1


def test_server_staleness_bound_holds_a_trainer_back():
    import threading

    s = _server(2, 0)
    ids = torch.tensor([0])
    s.push(0, 1, 1.0, {"t": (ids, torch.zeros(1, 2))}, 0)  # trainer 0 finished step 1
    got = []
    t = threading.Thread(target=lambda: got.append(s.pull(0, 2, {"t": ids})))
    t.start()
    t.join(0.5)
    assert t.is_alive() and not got  # lockstep: step 2 waits for trainer 1's step 1
    s.push(1, 1, 1.0, {"t": (ids, torch.zeros(1, 2))}, 0)
    t.join(10)
    assert got and got[0][0] == 1  # synchronous: the step's two pushes are one update
    late = _server(2, 0, timeout_s=0.3)
    with pytest.raises(TimeoutError, match="trainer\\(s\\) \\[0, 1\\] did not push step 2"):
        late.pull(0, 3, {"t": ids})


def test_a_taken_rendezvous_port_is_one_line(data, tmp_path, capsys):
    import socket

    with socket.socket() as s:
        s.bind(("localhost", 0))
        s.listen()
        port = s.getsockname()[1]
        code = main(["train", f"data.path={data}", "dist.num_ps=1", f"dist.port={port}",
                     f"train.run_dir={tmp_path / 'run'}", *SMALL])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and err[-1] == f"hybridrec: error: localhost:{port}: address already in use (dist.port; 0 picks a free port)"
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_servers_that_cannot_hold_their_shards_refuse_before_allocating(data, tmp_path, capsys):
    code = main(["train", f"data.path={data}", "dist.num_ps=1", "train.memory_limit_gb=0.0001",
                 f"train.run_dir={tmp_path / 'run'}", *SMALL])
    err = capsys.readouterr().err
    assert code != 0
    assert ("not enough memory: the 1 parameter server(s) on this machine need " in err
            and "train.memory_limit_gb=0.0001 is 100.0 kB; add servers" in err), err
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_a_server_counts_only_the_servers_of_its_machine(data):
    """torchrun over machines: each server checks its own machine's servers."""
    from hybridrec.data.schema import DatasetMeta
    from hybridrec.parallel.topology import Topology
    from hybridrec.train.ps_run import ps_plan, server_memory_problem
    from hybridrec.train.setup.configure import build_config, replace
    from hybridrec.train.setup.tables import build_tables

    cfg = build_config(None, [], [f"data.path={data}", "dist.num_ps=2", "dist.ps_sharding=row_wise"])
    plan = ps_plan(cfg, build_tables(DatasetMeta.load(data), cfg), 2)

    def need(rank, local):
        topo = Topology(rank, 2, rank % local, local, torch.device("cpu"), "none", None, None)
        text = server_memory_problem(cfg, plan, topo)
        return text.split(" need ")[1].split(" (")[0], text.split(" on this machine")[0]

    cfg = replace(cfg, {"train.memory_limit_gb": 1e-6})
    (alone, who1), (both, who2) = need(1, 1), need(0, 2)
    assert who1.endswith("the 1 parameter server(s)") and who2.endswith("the 2 parameter server(s)")
    assert float(both.split()[0]) > 1.9 * float(alone.split()[0])  # two halves of every table
    cfg = replace(cfg, {"train.memory_limit_gb": 100.0})
    assert server_memory_problem(cfg, plan, Topology(0, 2, 0, 2, torch.device("cpu"), "none", None, None)) is None
