"""Parameter servers' bookkeeping under real RPC: the staleness a trainer reports (a server
not read in a step gets no update and no staleness from it), and pulls held back by the
staleness bound that hold no RPC thread (so the push that releases them always runs)."""

from __future__ import annotations

import threading
import time

import pytest
import torch
from distributed import free_port, run_ranks
from torch.distributed import rpc

from hybridrec.model.embedding import TableConfig
from hybridrec.parallel.topology import Topology
from hybridrec.ps import server as srv
from hybridrec.ps.client import RemoteEmbeddingCollection, ServerError, wait_reply
from hybridrec.ps.world import server_name
from hybridrec.sparse.keyed_jagged import KeyedJagged
from hybridrec.train.loop.sparse_optim import combined_sparse_optimizer
from hybridrec.train.setup.tables import uniform_plan

pytestmark = pytest.mark.distributed

TABLES = [TableConfig(name="t0", num_embeddings=20, embedding_dim=4),
          TableConfig(name="t1", num_embeddings=20, embedding_dim=4)]


def _server(tables, num_trainers: int, max_staleness: int, timeout_s: float = 30.0) -> srv.EmbeddingServer:
    """A server holding ``tables`` whole (one process's shards)."""
    return srv.EmbeddingServer(tables, uniform_plan("row_wise", tables, 1, 1), Topology.single(),
                               optimizer=lambda ebc: combined_sparse_optimizer("sgd", ebc, lr=1.0),
                               num_trainers=num_trainers, max_staleness=max_staleness, timeout_s=timeout_s)


def _join(name: str, rank: int, world: int, port: int, threads: int = 16) -> None:
    options = rpc.TensorPipeRpcBackendOptions(init_method=f"tcp://127.0.0.1:{port}", rpc_timeout=30,
                                              num_worker_threads=threads)
    rpc.init_rpc(name, rank=rank, world_size=world, rpc_backend_options=options)


# -- staleness -------------------------------------------------------------------------
def _batch(with_t1: bool) -> KeyedJagged:
    """4 bags per feature; without t1: t1's bags are empty (its server is not read)."""
    t0 = torch.tensor([1, 2, 3, 1])
    t1 = torch.tensor([5, 6, 7, 8]) if with_t1 else torch.tensor([], dtype=torch.int64)
    lengths = torch.tensor([1, 1, 1, 1] + ([1, 1, 1, 1] if with_t1 else [0, 0, 0, 0]))
    return KeyedJagged(["t0", "t1"], torch.cat([t0, t1]), lengths)


def staleness_worker(topo, port):
    """Rank 0: one trainer; ranks 1, 2: the servers of t0 and t1 (table-wise). Step 2 reads
    nothing of t1. Returns the trainer's summary, or a server's version."""
    if topo.rank > 0:
        table = TABLES[topo.rank - 1]
        server = _server([table], num_trainers=1, max_staleness=-1)
        srv.serve(server)
        _join(server_name(topo.rank - 1), topo.rank, 3, port)
        rpc.shutdown()  # (graceful: once the trainer is done)
        return server.version
    _join("trainer0", 0, 3, port)
    remote = RemoteEmbeddingCollection(TABLES, uniform_plan("table_wise", TABLES, 2, 2), trainer=0)
    remote.train()
    for with_t1 in (True, False, True, True):
        remote(_batch(with_t1)).values.sum().backward()
        remote.push(remote.pop_sparse_grads(), lr=0.1)
    remote.flush_pushes(every_thread=True)
    summary = remote.summary()
    rpc.shutdown()
    return summary


def test_one_trainer_with_two_table_wise_servers_reports_staleness_zero():
    """The server of t1, not read in step 2, gets a push without rows: no update (its
    version counts 3, not 4) and no staleness; one trainer's true staleness is 0."""
    summary, v0, v1 = run_ranks(staleness_worker, 3, free_port())
    assert summary["staleness_mean"] == 0.0 and summary["staleness_max"] == 0.0, summary
    assert summary["steps_pushed"] == 4
    assert (v0, v1) == (4, 3)


def test_a_push_without_rows_is_no_update():
    s = _server(TABLES[:1], num_trainers=2, max_staleness=-1)
    assert s.push(0, 1, 0.5, {}, None) is None and s.version == 0 and s.pushed == [1, 0]
    v, _ = s.pull(1, 1, {"t0": torch.tensor([1])})
    assert s.push(1, 1, 0.5, {"t0": (torch.tensor([1]), torch.ones(1, 4))}, v) == 0 and s.version == 1


# -- held pulls ----------------------------------------------------------------------------
def test_held_pulls_hold_no_thread():
    """40 pulls held back by the bound (lockstep, 2 trainers) are futures, not waiting
    threads (at most the one expiry thread more); the pushes of step 1 complete them."""
    s = _server(TABLES[:1], num_trainers=2, max_staleness=0)
    before = threading.active_count()
    futs = [s.pull_later(i % 2, 2, {"t0": torch.tensor([i % 20])}) for i in range(40)]
    assert not any(f.done() for f in futs)
    assert threading.active_count() <= before + 1
    s.push(0, 1, 1.0, {"t0": (torch.tensor([0]), torch.ones(1, 4))}, 0)
    assert not any(f.done() for f in futs)  # trainer 1 has not pushed step 1 yet
    s.push(1, 1, 1.0, {"t0": (torch.tensor([0]), torch.ones(1, 4))}, 0)
    assert all(f.done() and f.value()[0] == 1 for f in futs)  # the step's one update, then read


def starvation_worker(topo, port, pulls):
    """Rank 1: a server whose RPC agent has only 2 worker threads (lockstep, 2 trainers);
    rank 0 sends ``pulls`` pulls for step 2 (held back: nobody pushed step 1), then both
    trainers' pushes of step 1. Returns the pulls' versions."""
    if topo.rank == 1:
        srv.serve(_server(TABLES[:1], num_trainers=2, max_staleness=0, timeout_s=20))
        _join(server_name(0), 1, 2, port, threads=2)
        rpc.shutdown()
        return None
    _join("trainer0", 0, 2, port, threads=2)
    ids = {"t0": torch.tensor([3])}
    held = [rpc.rpc_async(server_name(0), srv.rpc_pull, args=(i % 2, 2, ids), timeout=15) for i in range(pulls)]
    time.sleep(0.5)  # (the pulls are at the server, held)
    grads = {"t0": (torch.tensor([3]), torch.ones(1, 4))}
    pushes = [rpc.rpc_async(server_name(0), srv.rpc_push, args=(t, 1, 1.0, grads, 0), timeout=15) for t in (0, 1)]
    out = [wait_reply(f, "pull", "ps0")[0] for f in held]
    for f in pushes:
        wait_reply(f, "push", "ps0")
    # An error raised by the asynchronous handler itself still reaches the trainer as one line.
    bad = rpc.rpc_async(server_name(0), srv.rpc_pull, args=(0, None, {"nope": torch.tensor([0])}), timeout=15)
    try:
        wait_reply(bad, "pull", "ps0")
        error = None
    except ServerError as e:
        error = str(e)
    rpc.shutdown()
    return out, error


def test_held_pulls_do_not_starve_the_push_that_releases_them():
    """More held pulls (6) than the server's RPC threads (2): with pulls that blocked in
    their handler, the pushes found no thread and every pull timed out."""
    (versions, error), _ = run_ranks(starvation_worker, 2, free_port(), 6)
    assert versions == [1] * 6
    assert error == "parameter server ps0: pull failed: ValueError(\"server 0 holds no rows of table 'nope'\")"
