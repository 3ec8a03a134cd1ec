#!/usr/bin/env python3
"""`hybridrec serve` under HTTP load: requests/s, rows/s, p50/p99 latency and errors at 1, 16
and 64 concurrent clients with 1-row and 256-row requests, with and without a new model
version published every 5 s.

    .venv/bin/python benchmarks/serve_load.py [--work DIR] [--seconds 15] [--clients 1,16,64]
                                              [--rows 1,256] [--publish-every 5] [--out FILE]

Makes (or reuses, under --work) a synthetic Criteo dataset and a run of the default model
(``--recipe demo``, 20 steps, checkpoints at steps 10 and 20), exports both checkpoints
once, publishes the first as ``RUN/published/v1`` (:mod:`hybridrec.serve.published`) and
starts ``hybridrec serve RUN --port 0`` as its own process. Each case is a closed loop: N
asyncio clients (httpx, one connection each) post requests back to back for --seconds,
rows of the held-out day as ``{"rows": [...]}``; a request that is not answered 200 is an
error (``error_kinds`` counts them by status or exception). With publishing on, a thread
publishes a new version every --publish-every seconds
(alternating the two exports, copied: the server's load and swap are measured, not the
export) and keeps the newest 3. Client, server and publisher share this machine's cores.

Writes the results as JSON to benchmarks/results/serve_load-<UTC date>.json (or --out) and
prints a Markdown table.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serve import prepare as prepare_run  # the benchmark's run, made once
from throughput import machine

ROOT = Path(__file__).resolve().parents[1]
NAMES = ["label", *(f"I{i}" for i in range(1, 14)), *(f"C{i}" for i in range(1, 27))]


def prepare(work: Path, rows_per_day: int) -> tuple[Path, list[Path], Path]:
    """The run (3 synthetic days, the last held out; checkpoints at steps 10 and 20), an
    export of each checkpoint, and the held-out raw file; made once under ``work``."""
    from hybridrec.cli.main import main

    run = prepare_run(work, rows_per_day, "train.checkpoint_every=10")
    exports = []
    for ckpt in sorted((run / "checkpoints").iterdir())[-2:]:
        out = work / f"export-{ckpt.name}"
        if not (out / "export.json").is_file():
            assert main(["export", str(run), "--out", str(out), "--checkpoint", str(ckpt),
                         "--eval-rows", "2048", "--overwrite"]) == 0
        exports.append(out)
    return run, exports, work / "raw" / "day_2.tsv"


def request_bodies(raw: Path, rows: int, count: int = 64) -> list[bytes]:
    """``count`` distinct bodies of ``rows`` rows each from the held-out file."""
    lines = raw.read_text().splitlines()[: max(rows * count, 4096)]
    objs = [{n: (None if v == "" else int(v) if n[0] in "lI" else v) for n, v in zip(NAMES, ln.split("\t"))}
            for ln in lines]
    return [json.dumps({"rows": [objs[(k * rows + i) % len(objs)] for i in range(rows)]}).encode()
            for k in range(count)]


def start_server(run: Path, log: Path) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen([sys.executable, "-m", "hybridrec", "serve", str(run), "--port", "0"],
                            stdout=subprocess.PIPE, stderr=open(log, "w"), text=True,  # noqa: SIM115
                            start_new_session=True, cwd=ROOT)
    line = proc.stdout.readline()
    m = re.search(r"on (http://\S+?:\d+)", line)
    if not m:
        proc.kill()
        raise SystemExit(f"the server did not start: {line!r} {log.read_text()[-2000:]}")
    return proc, m.group(1)


def copier(export: Path):
    """A maker for :func:`hybridrec.serve.published.publish`: a copy of ``export``."""

    def make(out: Path) -> None:
        shutil.copytree(export, out)

    return make


class Publisher(threading.Thread):
    """A new version every ``every`` seconds (the exports copied in turn), newest 3 kept."""

    def __init__(self, run: Path, exports: list[Path], every: float) -> None:
        super().__init__(daemon=True)
        self.run_dir, self.exports, self.every = run, exports, every
        self.stop = threading.Event()
        self.published: list[str] = []

    def run(self) -> None:
        from hybridrec.serve import published

        k = 0
        while not self.stop.wait(self.every):
            src = self.exports[k % len(self.exports)]
            k += 1
            name = published.publish(self.run_dir, copier(src), info={"benchmark": "serve_load"}, keep=3)
            self.published.append(name)


async def load(url: str, bodies: list[bytes], clients: int, seconds: float) -> dict:
    """``clients`` closed-loop clients for ``seconds``: every request's latency and outcome."""
    import httpx

    latencies: list[float] = []
    versions: set[str] = set()
    errors = 0
    kinds: Counter = Counter()
    rows = len(json.loads(bodies[0])["rows"])
    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)
    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=60,
                                 headers={"content-type": "application/json"}) as client:
        end = time.perf_counter() + seconds

        async def one(k: int) -> None:
            nonlocal errors
            i = k
            while time.perf_counter() < end:
                t = time.perf_counter()
                try:
                    r = await client.post("/v1/predict", content=bodies[i % len(bodies)])
                    ok = r.status_code == 200
                    if ok:
                        versions.add(r.json()["version"])
                    else:
                        kinds[f"HTTP {r.status_code}: {r.text[:120]}"] += 1
                except httpx.HTTPError as e:
                    ok = False
                    kinds[f"{type(e).__name__}: {e}"[:160]] += 1
                latencies.append(time.perf_counter() - t)
                errors += not ok
                i += clients

        start = time.perf_counter()
        await asyncio.gather(*(one(k) for k in range(clients)))
        elapsed = time.perf_counter() - start
    lat = np.array(latencies) * 1e3
    n = len(latencies)
    return {"clients": clients, "rows_per_request": rows, "seconds": round(elapsed, 2), "requests": n,
            "errors": errors, "requests_per_s": round(n / elapsed, 1),
            "rows_per_s": round((n - errors) * rows / elapsed, 1),
            "p50_ms": round(float(np.percentile(lat, 50)), 2) if n else None,
            "p99_ms": round(float(np.percentile(lat, 99)), 2) if n else None,
            "error_kinds": dict(kinds), "versions_seen": sorted(versions, key=lambda v: int(v[1:]) if v[1:].isdigit() else -1)}


def metric(url: str, name: str) -> float:
    import httpx

    text = httpx.get(f"{url}/metrics", timeout=30).text
    m = re.search(rf"^{name} ([0-9.e+-]+)$", text, re.MULTILINE)
    return float(m.group(1)) if m else 0.0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--work", type=Path, default=ROOT / "runs" / "bench-serve-load")
    p.add_argument("--rows-per-day", type=int, default=20_000)
    p.add_argument("--seconds", type=float, default=15.0, help="per case [15]")
    p.add_argument("--clients", default="1,16,64")
    p.add_argument("--rows", default="1,256", help="rows per request")
    p.add_argument("--publish-every", type=float, default=5.0)
    p.add_argument("--out", type=Path)
    args = p.parse_args()

    from hybridrec.serve import published

    args.work.mkdir(parents=True, exist_ok=True)
    run, exports, raw = prepare(args.work, args.rows_per_day)
    shutil.rmtree(run / "published", ignore_errors=True)
    published.publish(run, copier(exports[0]))
    proc, url = start_server(run, args.work / "serve.log")
    started = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
    results = []
    try:
        for publishing in (False, True):
            for rows in [int(x) for x in args.rows.split(",")]:
                bodies = request_bodies(raw, rows)
                for clients in [int(x) for x in args.clients.split(",")]:
                    asyncio.run(load(url, bodies, clients, 1.0))  # warm-up
                    swaps = metric(url, "hybridrec_serve_swaps_total")
                    publisher = Publisher(run, exports, args.publish_every) if publishing else None
                    if publisher:
                        publisher.start()
                    load_before = os.getloadavg()[0]
                    r = asyncio.run(load(url, bodies, clients, args.seconds))
                    if publisher:
                        publisher.stop.set()
                        publisher.join()
                    r.update(publishing=publishing, published=publisher.published if publisher else [],
                             swaps=int(metric(url, "hybridrec_serve_swaps_total") - swaps),
                             load_average=[round(load_before, 2), round(os.getloadavg()[0], 2)])
                    results.append(r)
                    print(json.dumps(r), flush=True)
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    import torch

    record = {"benchmark": "serve_load", "started": started,
              "finished": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), "cpu": machine(),
              "cpus": len(os.sched_getaffinity(0)), "torch": torch.__version__, "seconds_per_case": args.seconds,
              "publish_every_s": args.publish_every, "model": "demo recipe DLRM, fp32 export",
              "refused_or_errors_in_log": (args.work / "serve.log").read_text().count("refused"),
              "results": results}
    out = args.out or ROOT / "benchmarks" / "results" / f"serve_load-{time.strftime('%Y-%m-%d', time.gmtime())}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=2) + "\n")
    print(f"\n{record['cpu']}, {record['cpus']} CPUs, {started}\n")
    print("| publishing | clients | rows/request | requests/s | rows/s | p50 ms | p99 ms | errors | swaps |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in results:
        every = f"every {args.publish_every:g} s" if r["publishing"] else "no"
        print(f"| {every} | {r['clients']} | "
              f"{r['rows_per_request']} | {r['requests_per_s']:,} | {r['rows_per_s']:,.0f} | {r['p50_ms']} | "
              f"{r['p99_ms']} | {r['errors']} | {r['swaps']} |")
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
