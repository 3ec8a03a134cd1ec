#!/usr/bin/env python3
"""Link rate reached by gloo collectives in the namespace cluster (root required).

    sudo .venv/bin/python benchmarks/linkrate.py                      # 2 ranks, 1gbit + 200mbit
    sudo .venv/bin/python benchmarks/linkrate.py --world 4 --rates 1gbit --sizes 4 16 64
    sudo .venv/bin/python benchmarks/linkrate.py --world 4 --group-size 2 --rates 1gbit \
        --cross-rate 100mbit --ops all_to_all all_reduce     # the hierarchical cluster's links

Each rank runs in its own network namespace; every rank's link is capped with tc tbf at
the given rate in both directions (hybridrec.bench.netns). One torchrun per namespace
starts the worker below, which times, for each message size S (MiB per rank, fp32):

  raw_tcp             plain TCP, one connection per pair made up front, every peer's
                      S/W sent and received at once (Python threads): the link's ceiling
  all_reduce          dist.all_reduce of S
  all_to_all          dist.all_to_all_single of S (S/W to every rank)
  sendrecv_sendfirst  dist.isend of S/W to every peer, then dist.irecv from every peer
  sendrecv_recvfirst  the same with every irecv posted before the first isend
  send_one_way        2 ranks only: rank 0 isend S, rank 1 irecv; the other direction idle
  exchange_K          hybridrec.comm.PairwiseExchange (receives first) on K gloo groups
                      (K=1: the default group; K>1: every block cut into K slices)

Each point runs with every rank entering together and with the last rank entering
--skew-ms later (a late peer, as in training). Reported per direction: the bytes each rank
puts on its uplink (= takes off its downlink) per call, from the algorithm (ring
all-reduce 2(W-1)/W*S; one-way S; everything else (W-1)/W*S), divided by the time from the
last rank's entry to the last rank's exit (one clock: all namespaces share the machine),
as a fraction of the link rate; the median of --reps calls after one warm-up call. Also
each rank's CPU seconds per call (the process's, every thread: gloo's socket work), the mean
over ranks, median over calls.

With --group-size M the ranks form groups of M joined by links capped at --cross-rate (the
namespace cluster of benchmarks/hierarchical.py: every rank's own link at the --rates rate,
each group's link to the others at --cross-rate, shared by its ranks' flows). Then the
share is of the cross rate, and the bytes are those each group's link carries per direction
per call, if every rank sends in rank order as the cost model prices it
(:mod:`hybridrec.bench.hier_cost`): all-to-all-like ops ``M (W-M)/W * S`` (M ranks, each
with a flow to each of the W-M outside), ring all-reduce ``2(W-1)/W * S`` (the ring leaves
and enters each group once), one-way S. This is the efficiency the cost model's
``Links.cross_a2a_efficiency`` takes: how much of a capped link several concurrent flows of
one all-to-all reach.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import throughput  # machine description
from cluster_throughput import _pythonpath, run_main

ROOT = Path(__file__).resolve().parents[1]
MIB = 2**20


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--world", type=int, nargs="+", default=[2], help="cluster sizes")
    p.add_argument("--rates", nargs="+", default=["1gbit", "200mbit"], help="tc rates")
    p.add_argument("--sizes", type=float, nargs="+", default=[1, 4, 16, 64],
                   help="message MiB per rank (at rates < 1gbit, sizes above 16 are skipped)")
    p.add_argument("--ops", nargs="+", default=[
        "raw_tcp", "all_reduce", "all_to_all", "sendrecv_sendfirst", "sendrecv_recvfirst",
        "send_one_way", "exchange_1", "exchange_2"])
    p.add_argument("--skew-ms", type=float, nargs="+", default=[0, 20],
                   help="the last rank enters every call this much later (0: together)")
    p.add_argument("--reps", type=int, default=3, help="timed repetitions per point")
    p.add_argument("--out", default=str(ROOT / "benchmarks/out/linkrate"), help="results dir")
    p.add_argument("--timeout", type=float, default=600, help="seconds per cluster run")
    p.add_argument("--group-size", type=int, help="ranks per group (needs --cross-rate)")
    p.add_argument("--cross-rate", help="tc rate of each group's link to the others")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    return p.parse_args(argv)


# -- worker (one per namespace, started by torchrun) -----------------------------------

class RawTcp:
    """One plain TCP connection per pair of ranks, made once: the link's ceiling."""

    def __init__(self, rank: int, addrs: list[str], port: int = 40000) -> None:
        srv = socket.create_server((addrs[rank], port))
        self.socks = {}
        for peer in range(len(addrs)):  # the lower rank accepts, the higher connects
            if peer > rank:
                self.socks[peer] = srv.accept()[0]
            elif peer < rank:
                for _ in range(500):
                    try:
                        self.socks[peer] = socket.create_connection((addrs[peer], port))
                        break
                    except ConnectionRefusedError:
                        time.sleep(0.02)
        srv.close()

    def exchange(self, nbytes_per_peer: int) -> None:
        """Send and receive ``nbytes_per_peer`` to/from every peer, all at once."""
        payload = memoryview(bytearray(nbytes_per_peer))

        def recv(s):
            left, buf = nbytes_per_peer, bytearray(1 << 20)
            while left:
                left -= s.recv_into(buf, min(left, len(buf)))

        threads = [threading.Thread(target=f, args=(s,)) for s in self.socks.values()
                   for f in (lambda s: s.sendall(payload), recv)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()


def wire_bytes(op: str, nbytes: int, world: int, group_size: int | None = None) -> float:
    """Bytes each rank puts on its uplink (= takes off its downlink) for one call; with
    ``group_size`` M < world: bytes each group's link carries per direction (module
    docstring)."""
    if op == "all_reduce":  # ring: reduce-scatter + all-gather
        return 2 * (world - 1) / world * nbytes
    if op == "send_one_way":
        return nbytes
    if group_size and group_size < world:  # M ranks' flows to the W - M outside
        return group_size * (world - group_size) / world * nbytes
    return (world - 1) / world * nbytes  # every all-to-all-like op keeps 1/world at home


def make_op(op: str, x, out, rank: int, world: int, raw: RawTcp, exchangers: dict):
    import torch.distributed as dist

    n = x.numel() // world
    peers = [p for p in range(world) if p != rank]
    if op == "raw_tcp":
        return lambda: raw.exchange(n * 4)
    if op == "all_reduce":
        return lambda: dist.all_reduce(x)
    if op == "all_to_all":
        return lambda: dist.all_to_all_single(out, x)
    if op == "send_one_way":
        return lambda: (dist.isend(x, 1) if rank == 0 else dist.irecv(out, 0)).wait()
    if op in ("sendrecv_sendfirst", "sendrecv_recvfirst"):
        def once():
            sends = [(dist.isend, x[p * n:(p + 1) * n], p) for p in peers]
            recvs = [(dist.irecv, out[p * n:(p + 1) * n], p) for p in peers]
            calls = sends + recvs if op == "sendrecv_sendfirst" else recvs + sends
            for w in [f(t, p) for f, t, p in calls]:
                w.wait()
        return once
    return lambda: exchangers[op].all_to_all_single(out, x).wait()


def worker(args) -> None:
    import torch
    import torch.distributed as dist

    from hybridrec.comm.exchange import PairwiseExchange
    from hybridrec.parallel.topology import Topology

    torch.set_num_threads(1)
    topo = Topology.init(backend="gloo")
    rank, world = topo.rank, topo.group_size
    addrs = [None] * world
    dist.all_gather_object(addrs, os.environ["HRC_ADDR"])
    raw = RawTcp(rank, addrs) if "raw_tcp" in args.ops else None
    exchangers = {}
    for op in args.ops:  # exchange_K: PairwiseExchange over K groups (1: the default group)
        if op.startswith("exchange_"):
            k = int(op.split("_")[1])
            groups = [topo.group] if k == 1 else topo.parallel_groups(k)
            exchangers[op] = PairwiseExchange(groups, rank=rank, world_size=world)
    results = []
    for size in args.sizes:
        nbytes = int(size * MIB) // (4 * world) * 4 * world
        x, out = torch.ones(nbytes // 4), torch.empty(nbytes // 4)
        for op in args.ops:
            if op == "send_one_way" and world != 2:
                continue
            once = make_op(op, x, out, rank, world, raw, exchangers)
            for skew in args.skew_ms:
                times, cpus = [], []
                for rep in range(args.reps + 1):
                    dist.barrier()
                    if rank == world - 1 and skew:  # a late peer, as in training
                        time.sleep(skew / 1e3)
                    c0 = time.process_time()  # this rank's CPU, every thread (gloo's too)
                    t0 = time.perf_counter()  # one clock for every namespace (same machine)
                    once()
                    t = torch.tensor([t0, time.perf_counter()], dtype=torch.float64)
                    cpu = torch.tensor([time.process_time() - c0], dtype=torch.float64)
                    dist.all_reduce(t, op=dist.ReduceOp.MAX)
                    dist.all_reduce(cpu)
                    if rep:  # the first is a warm-up (connections, buffers)
                        times.append(float(t[1] - t[0]))  # last end - last start
                        cpus.append(float(cpu) / world)
                sec = statistics.median(times)
                wire = wire_bytes(op, nbytes, world, args.group_size)
                results.append({"op": op, "mib": size, "skew_ms": skew, "bytes": nbytes,
                                "wire_bytes_per_dir": wire, "seconds": sec, "times": times,
                                "bytes_per_s_per_dir": wire / sec,
                                "cpu_s_per_rank": statistics.median(cpus)})
    if rank == 0:
        print(json.dumps({"world": world, "results": results}))
    dist.barrier()
    dist.destroy_process_group()


# -- driver ----------------------------------------------------------------------------

def run_cluster(args, world: int, rate: str) -> dict:
    from hybridrec.bench.netns import netns_cluster

    sizes = [s for s in args.sizes if s <= 16 or rate_bps(rate) >= 1e9]
    script = [__file__, "--worker", "--reps", str(args.reps), "--sizes", *map(str, sizes),
              "--ops", *args.ops, "--skew-ms", *map(str, args.skew_ms)]
    if args.group_size:
        script += ["--group-size", str(args.group_size)]
    log_dir = Path(args.out) / f"logs-w{world}-{rate}"
    with netns_cluster(world, rate, group_size=args.group_size,
                       cross_rate=args.cross_rate) as c:
        cmds = [c.torchrun_argv(r, script) for r in range(world)]
        print(f"# {rate}, {world} ranks; rank 0 runs:\n#   {' '.join(c.exec_argv(0, cmds[0]))}",
              file=sys.stderr)
        env = {"OMP_NUM_THREADS": "1",
               "PYTHONPATH": _pythonpath(str(ROOT / "src"))}
        # The worker needs its own address for the raw TCP baseline.
        res = c.run(cmds, timeout_s=args.timeout, log_dir=log_dir,
                    env=env, rank_env=[{"HRC_ADDR": n.address} for n in c.nodes])
    if not all(r.ok for r in res):
        bad = next(r for r in res if not r.ok)
        raise SystemExit(f"rank {bad.rank} failed (exit {bad.returncode}, timed out: "
                         f"{bad.timed_out}):\n{bad.stderr[-3000:]}")
    line = [ln for ln in res[0].stdout.splitlines() if ln.startswith("{")][-1]
    groups = {"group_size": args.group_size, "cross_rate": args.cross_rate,
              "cross_rate_bps": rate_bps(args.cross_rate)} if args.group_size else {}
    return {"rate": rate, "rate_bps": rate_bps(rate), **groups, **json.loads(line)}


def rate_bps(rate: str) -> int:
    from hybridrec.bench.netns import parse_rate

    return parse_rate(rate)


def format_table(runs: list[dict]) -> str:
    lines = [("| ranks | link | op | MiB/rank | late peer | MB/s per direction | of link rate | "
              "CPU s per rank and call |"), "|---|---|---|---|---|---|---|---|"]
    for run in runs:
        link = run.get("cross_rate_bps", run["rate_bps"]) / 8
        where = (f"{run['rate']}, groups of {run['group_size']} at {run['cross_rate']}"
                 if run.get("group_size") else run["rate"])
        for r in run["results"]:
            lines.append(f"| {run['world']} | {where} | {r['op']} | {r['mib']:g} | "
                         f"{r['skew_ms']:g} ms | "
                         f"{r['bytes_per_s_per_dir'] / 1e6:,.1f} | "
                         f"{r['bytes_per_s_per_dir'] / link:.0%} | "
                         f"{r.get('cpu_s_per_rank', float('nan')):.3f} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    runs = []
    for world in args.world:
        for rate in args.rates:
            runs.append(run_cluster(args, world, rate))
            print(format_table(runs[-1:]), file=sys.stderr)
    report = {"date": time.strftime("%Y-%m-%d"), "machine": machine(), "reps": args.reps,
              "command": " ".join([Path(sys.executable).name, *sys.argv]), "runs": runs}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "linkrate.json").write_text(json.dumps(report, indent=2))
    print(f"machine: {report['machine']}   date: {report['date']}\n")
    print(format_table(runs))
    print(f"\nwritten: {out / 'linkrate.json'}")
    return 0


def machine() -> str:
    return f"{throughput.machine()}, kernel {os.uname().release}"


if __name__ == "__main__":
    raise SystemExit(run_main(main))
