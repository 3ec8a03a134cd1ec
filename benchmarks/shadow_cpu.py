#!/usr/bin/env python3
"""CPU seconds of one background sync round, by replica size (the cost model's shadow CPU).

    .venv/bin/python benchmarks/shadow_cpu.py                        # 2 ranks, loopback gloo
    .venv/bin/python benchmarks/shadow_cpu.py --mib 16 64 256 --compress none dct --reps 3

Two processes on this machine (gloo over 127.0.0.1, one torch thread each, as a shadow
thread runs: :func:`hybridrec.threads.single_threaded`) each hold a replica of --mib MiB
(float32: a 2 MiB dense part and the rest as one shard) and run, --reps times after one
warm-up, the work of one background round of :class:`hybridrec.sync.runners.BackgroundRunner`:

  snapshot    ``flat()``: the replica copied into one flat tensor
  round       MA's round: the exact mean (:class:`~hybridrec.sync.algorithms.GroupMean`, one
              all-reduce) or, with ``dct``, :class:`~hybridrec.sync.compressed.CompressedMean`
              at --ratio (threshold, sparse message, error feedback, anchor update)
  write_back  the delta write-back ``p += target - snapshot`` (on the training thread)

Each phase is timed as the whole process's CPU seconds (user + system, every thread: gloo
does the reduction and the socket work in threads of its own) and wall seconds; between
rounds 1% of the entries move (as a round's training moves few rows), untimed. The process
does nothing else, so its CPU is the round's. Prints a table and the per-MiB slopes the cost
model takes (``hybridrec.bench.hier_cost.ShadowCpu``): CPU seconds per MiB of replica for
the thread's part (snapshot + round) and for the training thread's (write-back). Also the
wall time of an 8-byte all-reduce (the members' per-step agreement), median of 200.

Loopback, not a capped link: the socket work per byte is the same, only its pace differs
(a capped link spreads the same CPU over a longer round).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from itertools import pairwise
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import throughput  # machine description

ROOT = Path(__file__).resolve().parents[1]
MIB = 2**20
DENSE_MIB = 2.0  # the bench model's dense arches: 0.5M float32 parameters


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mib", type=float, nargs="+", default=[16, 64, 256], help="replica MiB")
    p.add_argument("--compress", nargs="+", default=["none", "dct"], choices=["none", "dct"])
    p.add_argument("--ratio", type=float, default=0.01, help="dct: share of entries kept")
    p.add_argument("--reps", type=int, default=3, help="timed rounds per point")
    p.add_argument("--port", type=int, default=29611)
    p.add_argument("--out", default=str(ROOT / "benchmarks/out/shadow_cpu.json"))
    return p.parse_args(argv)


def _cpu() -> float:
    return time.process_time()  # every thread of the process, user + system, ns resolution


def _mean(kind: str, group, ratio: float, parts: tuple[int, ...]):
    from hybridrec.comm.compress import DCTCompressor
    from hybridrec.comm.ddp_hooks import CompressedAllReduce
    from hybridrec.sync.algorithms import GroupMean
    from hybridrec.sync.compressed import CompressedMean
    from hybridrec.train.build import SYNC_REFRESH_EVERY

    if kind == "none":
        return GroupMean(group, None, parts)
    reducer = CompressedAllReduce(DCTCompressor(ratio, SYNC_REFRESH_EVERY), None,
                                  category="sync", direction="sync")
    return CompressedMean(group, reducer, None, parts)


def _one_point(mib: float, kind: str, args, rank: int) -> dict:
    import torch
    import torch.distributed as dist

    from hybridrec.sync.algorithms import ModelAveraging

    gen = torch.Generator().manual_seed(rank)
    dense = int(DENSE_MIB * MIB) // 4
    params = [torch.randn(dense, generator=gen), torch.randn(int(mib * MIB) // 4 - dense, generator=gen)]
    mean, sync = _mean(kind, dist.group.WORLD, args.ratio, (dense,)), ModelAveraging()
    if hasattr(mean, "start"):
        mean.start(torch.cat([p.reshape(-1) for p in params]))
    phases = {k: [] for k in ("snapshot", "round", "write_back")}
    walls = {k: [] for k in phases}
    for rep in range(args.reps + 1):
        for p in params:  # a round's training: 1% of the entries move (untimed)
            idx = torch.randint(0, p.numel(), (max(1, p.numel() // 100),), generator=gen)
            p[idx] += 0.01 * torch.randn(idx.numel(), generator=gen)
        dist.barrier()
        marks = [(_cpu(), time.perf_counter())]
        with torch.no_grad():
            snapshot = torch.cat([p.reshape(-1) for p in params])
            marks.append((_cpu(), time.perf_counter()))
            target = sync.round(snapshot, mean)
            marks.append((_cpu(), time.perf_counter()))
            at = 0
            for p in params:
                n = p.numel()
                p.add_(target[at:at + n].view_as(p) - snapshot[at:at + n].view_as(p))
                at += n
            marks.append((_cpu(), time.perf_counter()))
        if rep:  # the first is a warm-up (the anchor's first compressed round, buffers)
            for k, (a, b) in zip(phases, pairwise(marks)):
                phases[k].append(b[0] - a[0])
                walls[k].append(b[1] - a[1])
        del snapshot, target
    return {"mib": mib, "compress": kind, "rank": rank,
            "cpu_s": {k: statistics.median(v) for k, v in phases.items()},
            "wall_s": {k: statistics.median(v) for k, v in walls.items()},
            "cpu_all": phases}


def worker(rank: int, args, queue) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(args.port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    out = [_one_point(mib, kind, args, rank) for mib in args.mib for kind in args.compress]
    flag, lat = torch.zeros(2, dtype=torch.int32), []
    for _ in range(201):
        dist.barrier()
        t0 = time.perf_counter()
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
        lat.append(time.perf_counter() - t0)
    queue.put({"rank": rank, "points": out, "agree_s": statistics.median(lat[1:])})
    dist.barrier()
    dist.destroy_process_group()


def slopes(points: list[dict], kind: str) -> tuple[float, float]:
    """Least-squares CPU seconds per MiB through the origin: (thread's, write-back's)."""
    pts = [p for p in points if p["compress"] == kind]
    mm = sum(p["mib"] ** 2 for p in pts)
    thread = sum(p["mib"] * (p["cpu_s"]["snapshot"] + p["cpu_s"]["round"]) for p in pts) / mm
    back = sum(p["mib"] * p["cpu_s"]["write_back"] for p in pts) / mm
    return thread, back


def main(argv=None) -> int:
    import torch.multiprocessing as mp

    args = parse_args(argv)
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=worker, args=(r, args, queue)) for r in range(2)]
    for p in procs:
        p.start()
    results = sorted((queue.get() for _ in procs), key=lambda r: r["rank"])
    for p in procs:
        p.join()
    if any(p.exitcode for p in procs):
        raise SystemExit(f"a rank failed: exit codes {[p.exitcode for p in procs]}")
    points = [pt for r in results for pt in r["points"]]
    lines = [("| replica MiB | sync.compress | rank | snapshot CPU s | round CPU s (wall) | "
              "write-back CPU s | thread CPU s per MiB |"), "|---|---|---|---|---|---|---|"]
    for pt in sorted(points, key=lambda p: (p["compress"], p["mib"], p["rank"])):
        c, w = pt["cpu_s"], pt["wall_s"]
        lines.append(f"| {pt['mib']:g} | {pt['compress']} | {pt['rank']} | {c['snapshot']:.3f} | "
                     f"{c['round']:.3f} ({w['round']:.3f}) | {c['write_back']:.3f} | "
                     f"{(c['snapshot'] + c['round']) / pt['mib'] * 1e3:.2f} ms |")
    fits = {k: slopes(points, k) for k in args.compress}
    report = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
              "machine": throughput.machine(), "load": os.getloadavg(),
              "command": " ".join([Path(sys.executable).name, *sys.argv]), "reps": args.reps,
              "ratio": args.ratio, "points": points,
              "agree_s": [r["agree_s"] for r in results],
              "cpu_s_per_mib": {k: {"thread": t, "write_back": b} for k, (t, b) in fits.items()}}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2))
    print(f"machine: {report['machine']}   {report['date']}   load {report['load']}\n")
    print("\n".join(lines))
    for k, (t, b) in fits.items():
        print(f"\n{k}: shadow thread {t * 1e3:.2f} ms CPU per MiB of replica, "
              f"write-back {b * 1e3:.2f} ms per MiB")
    print(f"8-byte all-reduce (the per-step agreement): {report['agree_s']} s (median of 200)")
    print(f"written: {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
