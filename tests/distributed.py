"""Run a function on N real gloo ranks (new processes, forked from a server that has
imported torch) and collect results."""

from __future__ import annotations

import io
import os
import socket
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def launched_ranks(launcher: int) -> dict[int, int]:
    """``{rank: pid}`` of the ranks `hybridrec train` started under the process
    ``launcher`` (forked from its fork server, so grandchildren; each names itself
    ``hybridrec-rRANK``, Linux's /proc/PID/comm)."""
    out: dict[int, int] = {}
    todo = [launcher]
    while todo:
        parent = todo.pop()
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                stat = Path(f"/proc/{pid}/stat").read_text()
                ppid = int(stat.rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            if ppid != parent:
                continue
            todo.append(int(pid))
            name = stat[stat.index("(") + 1:stat.rindex(")")]
            if name.startswith("hybridrec-r") and name[len("hybridrec-r"):].isdigit():
                out[int(name[len("hybridrec-r"):])] = int(pid)
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# The ranks are forked from a server process that has imported torch and hybridrec once
# (``spawn`` imported them again in every rank, about 2 s of CPU each). Each rank still
# starts as a fresh process would: nothing has run in the server but these imports, and
# the rank takes the environment of the test that starts it (see ``_entry``).
_PRELOAD = ["torch", "torch.distributed", "torch.distributed.checkpoint", "hybridrec.parallel.topology",
            "hybridrec.parallel.parallelize", "hybridrec.parallel.checkpoint", "hybridrec.model.dlrm",
            "hybridrec.train.run", "hybridrec.train.loop.trainer", "hybridrec.sync.runners", "pytest"]


def _context():
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)  # read when the server starts, on the first call
    return ctx


def _entry(rank, world, port, fn, args, queue, timeout_s, environ):
    os.environ.clear()  # as spawn gives it: the starting test's environment, not the server's
    os.environ.update(environ)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    try:
        from hybridrec.parallel.topology import Topology

        topo = Topology.init(backend="gloo", timeout_s=timeout_s)
        buf = io.BytesIO()  # tensors through a Queue would share memory that dies with the child
        torch.save(fn(topo, *args), buf)
        queue.put((rank, "ok", buf.getvalue()))
    except BaseException:  # noqa: BLE001 - any end (SystemExit too) is reported, never hangs the parent
        queue.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_ranks(fn, world: int, *args, timeout_s: float = 60.0) -> list:
    """``fn(topo, *args)`` on ``world`` ranks; returns the per-rank results in rank order."""
    ctx = _context()
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_entry, args=(r, world, port, fn, args, queue, timeout_s, dict(os.environ)))
             for r in range(world)]
    for p in procs:
        p.start()
    results, errors = {}, []
    try:
        for _ in range(world):
            rank, status, value = queue.get(timeout=timeout_s + 60)
            if status == "ok":  # our own test results, produced by the child processes above
                results[rank] = torch.load(io.BytesIO(value), weights_only=False)
            else:
                errors.append(f"rank {rank}:\n{value}")
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    if errors:
        raise AssertionError("\n".join(errors))
    return [results[r] for r in range(world)]
