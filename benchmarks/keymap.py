"""The dynamic tables' key map alone: microseconds per ``KeyMap.lookup`` call, and its memory.

Each call looks up the distinct ids of a prefix of a Zipf(``--zipf``) stream over a population of
1.25x the table's rows (the prefix that holds ``--keys`` distinct ids; each id's count is its
occurrences in the prefix), so the table stays full and evicts steadily. Before the timed calls
the map is filled, untimed, by calls of ``--fill-keys`` distinct ids of another stream of the
same law, their counts times admit_after (a warmed-up table), until it is full or after
``--fill-calls`` calls. Every policy (lru, lfu, ttl) with admit_after 1 and 3, on each table
size; the same calls in the same order for each; one thread.

Reported per setting: microseconds per call (wall: mean, median, p99, max; the eviction batches,
index rebuilds and, on a shared machine, the other processes make the slow calls), the thread's
CPU time per call, what a call did on average (keys given their own row, keys admitted, keys
evicted), and memory: the map's arrays (``KeyMap.nbytes``), and those plus the most allocated at
once during ``--mem-calls`` further calls, and during a rebuild of the index (tracemalloc, which
numpy reports to; traced after the timing, since tracing slows the calls).

    .venv/bin/python benchmarks/keymap.py
    .venv/bin/python benchmarks/keymap.py --rows 1000000 --calls 500 --policies lru
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
import time
import tracemalloc
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from throughput import machine  # this folder's: the CPU model

from hybridrec.sparse.keymap import KeyMap


class Stream:
    """Calls of distinct ids from a Zipf stream over ``population`` ids (seeded)."""

    def __init__(self, population: int, a: float, seed: int) -> None:
        w = 1.0 / np.arange(1, population + 1, dtype=np.float64) ** a
        self.cdf = np.cumsum(w) / w.sum()
        self.rng = np.random.default_rng(seed)
        self.population = population

    def call(self, distinct: int) -> tuple[np.ndarray, np.ndarray]:
        """(keys, counts): the distinct ids of the shortest prefix with ``distinct`` of them."""
        if distinct > self.population // 2:
            raise SystemExit(f"{distinct} distinct ids a call: more than half the population ({self.population})")
        draw = 2 * distinct
        while True:
            ranks = np.searchsorted(self.cdf, self.rng.random(draw), side="right")
            ranks = np.minimum(ranks, self.population - 1)
            u, first = np.unique(ranks, return_index=True)
            if len(u) >= distinct:
                break
            draw *= 2
        cut = np.sort(first)[distinct - 1] + 1
        u, counts = np.unique(ranks[:cut], return_counts=True)
        keys = (u.astype(np.uint64) * np.uint64(0x9E3779B97F4A7C15) >> np.uint64(1)).view(np.int64)
        return keys, counts.astype(np.int64)


def fill(m: KeyMap, stream: Stream, keys: int, calls: int) -> int:
    """Fill ``m`` (steps 0..), each count times ``admit_after`` so that the keys filled are
    admitted (a table warmed up); the next step."""
    step = 0
    for step in range(calls):
        k, c = stream.call(keys)
        m.lookup(k, c * m.admit_after, step)
        if m.stats()["live"] >= m.rows - 1:
            break
    return step + 1


def ttl_steps(rows: int, args) -> int:
    """``--ttl``, or (0) the steps that two tables' worth of keys take, at least 8."""
    return args.ttl or max(8, 2 * rows // args.keys)


def run(rows: int, policy: str, admit: int, args, calls: list) -> dict:
    kw = {"evict": policy, "admit_after": admit}
    if policy == "ttl":
        kw["ttl_steps"] = ttl_steps(rows, args)
    m = KeyMap(rows, **kw)
    fill_keys = min(args.fill_keys, rows // 4)
    step0 = fill(m, Stream(int(1.25 * rows), args.zipf, args.seed + 1), fill_keys, args.fill_calls)
    s0 = m.stats()
    times = np.zeros(len(calls))
    own = 0
    cpu = time.thread_time()
    for i, (k, c) in enumerate(calls):
        t = time.perf_counter()
        r = m.lookup(k, c, step0 + i)
        times[i] = time.perf_counter() - t
        own += int(np.count_nonzero(r.rows))
    cpu = time.thread_time() - cpu  # (includes the loop's own few operations)
    s1 = m.stats()
    n = len(calls)
    us = times * 1e6
    # memory: the map's arrays, plus the most allocated at once by calls (the same calls again,
    # later steps) and by a rebuild of the index, traced apart (tracing slows the calls)
    arrays = m.nbytes()
    tracemalloc.start()
    for i, (k, c) in enumerate(calls[: args.mem_calls]):
        m.lookup(k, c, step0 + n + i)
    calls_peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.reset_peak()
    m._rebuild_index()
    rebuild_peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    return {"rows": rows, "policy": policy, "admit": admit, "mean": us.mean(), "cpu": cpu / n * 1e6,
            "p50": float(np.median(us)), "p99": float(np.percentile(us, 99)), "max": us.max(),
            "own": own / n, "admitted": (s1["admitted"] - s0["admitted"]) / n,
            "evicted": (s1["evicted"] - s0["evicted"]) / n, "live": s1["live"],
            "rebuilds": s1["rebuilds"] - s0["rebuilds"], "arrays_mb": arrays / 2**20,
            "calls_mb": (arrays + calls_peak) / 2**20, "rebuild_mb": (arrays + rebuild_peak) / 2**20}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, nargs="+", default=[1_000_000, 10_000], help="table sizes")
    p.add_argument("--keys", type=int, default=2000, help="distinct keys per timed call")
    p.add_argument("--calls", type=int, default=2000, help="timed calls per setting")
    p.add_argument("--zipf", type=float, default=1.05, help="the stream's Zipf exponent")
    p.add_argument("--policies", nargs="+", default=["lru", "lfu", "ttl"])
    p.add_argument("--admit", type=int, nargs="+", default=[1, 3], help="admit_after values")
    p.add_argument("--ttl", type=int, default=0,
                   help="ttl_steps for the ttl policy (0: 2 x rows / keys a call, at least 8)")
    p.add_argument("--fill-keys", type=int, default=50_000, help="distinct keys per filling call")
    p.add_argument("--fill-calls", type=int, default=200, help="at most this many filling calls")
    p.add_argument("--mem-calls", type=int, default=200, help="calls of the traced memory pass")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)

    print(f"machine: {machine()}   date: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC   "
          f"numpy {np.__version__}, 1 thread, load average {os.getloadavg()[0]:.1f}")
    print(f"calls: {args.calls} timed x {args.keys} distinct keys, Zipf({args.zipf}) over 1.25x rows, "
          f"seed {args.seed}; ttl_steps {', '.join(str(ttl_steps(r, args)) for r in args.rows)}\n")
    print("| rows | evict | admit_after | us/call mean | p50 | p99 | max | CPU us/call | own rows/call "
          "| admitted/call | evicted/call | rebuilds | arrays MB | peak in calls MB | peak in a rebuild MB |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for rows in args.rows:
        stream = Stream(int(1.25 * rows), args.zipf, args.seed)
        calls = [stream.call(args.keys) for _ in range(args.calls)]
        for policy in args.policies:
            for admit in args.admit:
                r = run(rows, policy, admit, args, calls)
                print(f"| {rows:,} | {policy} | {admit} | {r['mean']:.0f} | {r['p50']:.0f} | {r['p99']:.0f} "
                      f"| {r['max']:.0f} | {r['cpu']:.0f} | {r['own']:.0f} | {r['admitted']:.1f} | {r['evicted']:.1f} "
                      f"| {r['rebuilds']} | {r['arrays_mb']:.1f} | {r['calls_mb']:.1f} | {r['rebuild_mb']:.1f} |", flush=True)
    print(f"\nload average at the end: {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
