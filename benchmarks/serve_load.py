#!/usr/bin/env python3
"""`hybridrec serve` under HTTP load: requests/s, rows/s, p50/p99 latency and errors at 1, 16
and 64 concurrent clients with 1-row and 256-row requests, with and without a new model
version published every 5 s; then a burst of malformed requests, and `hybridrec predict` on
the same rows.

    .venv/bin/python benchmarks/serve_load.py [--work DIR] [--seconds 15] [--clients 1,16,64]
        [--rows 1,256] [--publish-every 5] [--publishing no,yes] [--serve-args "--threads 2"]
        [--client raw|httpx] [--malformed 1000] [--predict-rows 131072] [--out FILE]

Makes (or reuses, under --work) a synthetic Criteo dataset and a run of the default model
(``--recipe demo``, 20 steps, checkpoints at steps 10 and 20), exports both checkpoints
once, publishes the first as ``RUN/published/v1`` (:mod:`hybridrec.serve.published`) and
starts ``hybridrec serve RUN --port 0`` (and ``--serve-args``) as its own process. Each case
is a closed loop: N asyncio clients, one keep-alive connection each, post requests back to
back for --seconds, rows of the held-out day as ``{"rows": [...]}``; a request that is not
answered 200 is an error (``error_kinds`` counts them by status or exception). The clients
are :class:`RawClient` s (HTTP/1.1 written and read by hand: 0.05-0.1 ms of CPU a request)
unless ``--client httpx`` (about 2 ms a request on a 2-core Zen 4, more than the server's
own work, on the cores the server is measured on: the runs of 2026-12-06 12:24 used it). With
publishing on, a thread publishes a new version every --publish-every seconds (alternating
the two exports, copied: the server's load and swap are measured, not the export) and keeps
the newest 3. Client, server and publisher share this machine's cores. Beside each case:
the load average (``/proc/loadavg``'s three numbers) before and after it, and the server's
own mean time per request in each stage during it (``hybridrec_serve_stage_seconds`` from
``/metrics``: receive the body, wait for a thread (large bodies), read the rows, score; and
per batch, the model thread's ids and forward), and the CPU time per request of the server
process and of the clients.

Then ``--malformed`` bad requests of eight kinds (malformed JSON, a misspelt column, a word
as an integer, an object as a value, a non-hex id, two ids in a one-hot field, an integer
of 19 digits, a float as an id), 16 clients at a time: each must be answered 4xx, and the
server must still answer ``/healthz`` and a good request with the version and probabilities
it gave before the burst.

Last, ``hybridrec predict RUN FILE`` (its default threads) on the rows of the 256-row
requests, repeated to ``--predict-rows`` rows: its rows/s as it reports them (reading,
scoring and writing; start-up not counted), against the served rows/s of the 256-row cases.

Writes the results as JSON to benchmarks/results/serve_load-<UTC date>.json (or --out) and
prints Markdown tables.
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


def held_out_rows(raw: Path, count: int) -> list[dict]:
    """The first ``count`` rows of the held-out file (fewer if it has fewer), as JSON rows."""
    lines = raw.read_text().splitlines()[:count]
    return [{n: (None if v == "" else int(v) if n[0] in "lI" else v) for n, v in zip(NAMES, ln.split("\t"))}
            for ln in lines]


def request_bodies(raw: Path, rows: int, count: int = 64) -> list[bytes]:
    """``count`` distinct bodies of ``rows`` rows each from the held-out file."""
    objs = held_out_rows(raw, max(rows * count, 4096))
    return [json.dumps({"rows": [objs[(k * rows + i) % len(objs)] for i in range(rows)]}).encode()
            for k in range(count)]


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` so far (``/proc/PID/stat``)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def loadavg() -> list[float]:
    """``/proc/loadavg``'s 1-, 5- and 15-minute load averages."""
    return [round(x, 2) for x in os.getloadavg()]


def start_server(run: Path, log: Path, extra: list[str]) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen([sys.executable, "-m", "hybridrec", "serve", str(run), "--port", "0", *extra],
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


class RawClient:
    """One keep-alive HTTP/1.1 connection written and read by hand (asyncio streams): a
    POST and its response for about a tenth of httpx's CPU, so that on a machine of two
    cores the load generator does not take the cores the server is measured on."""

    def __init__(self, url: str) -> None:
        host, port = url.split("//", 1)[1].rsplit(":", 1)
        self.host, self.port = host.strip("[]"), int(port)
        self.reader = self.writer = None

    async def post(self, path: str, body: bytes) -> tuple[int, bytes]:
        for attempt in (0, 1):
            if self.writer is None:
                self.reader, self.writer = await asyncio.open_connection(self.host, self.port)
            self.writer.write(b"POST %s HTTP/1.1\r\nhost: %s\r\ncontent-type: application/json\r\n"
                              b"content-length: %d\r\n\r\n%s" % (path.encode(), self.host.encode(), len(body), body))
            try:
                head = await self.reader.readuntil(b"\r\n\r\n")
            except (asyncio.IncompleteReadError, ConnectionError):
                await self.close()  # (the server closed an idle connection: once more on a new one)
                if attempt:
                    raise
                continue
            m = re.search(rb"\r\ncontent-length: *(\d+)", head, re.IGNORECASE)
            data = await self.reader.readexactly(int(m.group(1)) if m else 0)
            return int(head[9:12]), data
        raise AssertionError("unreachable")

    async def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.reader = self.writer = None


async def load(url: str, bodies: list[bytes], clients: int, seconds: float, kind: str = "raw") -> dict:
    """``clients`` closed-loop clients for ``seconds`` (``kind``: :class:`RawClient` s, or one
    httpx client with a connection each): every request's latency and outcome."""
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

        async def post(raw: RawClient | None, body: bytes) -> tuple[int, bytes]:
            if raw is not None:
                return await asyncio.wait_for(raw.post("/v1/predict", body), 60)
            r = await client.post("/v1/predict", content=body)
            return r.status_code, r.content

        async def one(k: int) -> None:
            nonlocal errors
            raw = RawClient(url) if kind == "raw" else None
            i = k
            while time.perf_counter() < end:
                t = time.perf_counter()
                try:
                    status, data = await post(raw, bodies[i % len(bodies)])
                    ok = status == 200
                    if ok:
                        versions.add(json.loads(data)["version"])
                    else:
                        kinds[f"HTTP {status}: {data[:120].decode(errors='replace')}"] += 1
                except (httpx.HTTPError, OSError, asyncio.IncompleteReadError, asyncio.TimeoutError) as e:
                    ok = False
                    kinds[f"{type(e).__name__}: {e}"[:160]] += 1
                    if raw is not None:
                        await raw.close()
                latencies.append(time.perf_counter() - t)
                errors += not ok
                i += clients
            if raw is not None:
                await raw.close()

        start = time.perf_counter()
        await asyncio.gather(*(one(k) for k in range(clients)))
        elapsed = time.perf_counter() - start
    lat = np.array(latencies) * 1e3
    n = len(latencies)
    return {"clients": clients, "rows_per_request": rows, "client": kind, "seconds": round(elapsed, 2),
            "requests": n, "errors": errors, "requests_per_s": round(n / elapsed, 1),
            "rows_per_s": round((n - errors) * rows / elapsed, 1),
            "p50_ms": round(float(np.percentile(lat, 50)), 2) if n else None,
            "p99_ms": round(float(np.percentile(lat, 99)), 2) if n else None,
            "error_kinds": dict(kinds), "versions_seen": sorted(versions, key=lambda v: int(v[1:]) if v[1:].isdigit() else -1)}


def metric(url: str, name: str) -> float:
    import httpx

    text = httpx.get(f"{url}/metrics", timeout=30).text
    m = re.search(rf"^{name} ([0-9.e+-]+)$", text, re.MULTILINE)
    return float(m.group(1)) if m else 0.0


def stage_totals(url: str) -> dict[str, tuple[float, float]]:
    """``{stage: (seconds, count)}`` of the server's ``hybridrec_serve_stage_seconds``."""
    import httpx

    text = httpx.get(f"{url}/metrics", timeout=30).text
    out = {}
    for m in re.finditer(r'^hybridrec_serve_stage_seconds_(sum|count)\{stage="(\w+)"\} ([0-9.e+-]+)$', text,
                         re.MULTILINE):
        seconds, count = out.get(m.group(2), (0.0, 0.0))
        out[m.group(2)] = (float(m.group(3)), count) if m.group(1) == "sum" else (seconds, float(m.group(3)))
    return out


def stage_means(before: dict, after: dict) -> dict[str, float]:
    """Mean milliseconds per request (per batch for ``forward``) of each stage between two reads."""
    out = {}
    for stage, (seconds, count) in after.items():
        s0, c0 = before.get(stage, (0.0, 0.0))
        if count > c0:
            out[stage] = round((seconds - s0) / (count - c0) * 1e3, 3)
    return out


def malformed_bodies(raw: Path) -> list[tuple[str, bytes]]:
    """Eight kinds of bad requests, each about one row of the held-out file."""
    rows = held_out_rows(raw, 3)

    def changed(**values) -> bytes:
        out = [dict(r) for r in rows]
        for key, value in values.items():
            if key.startswith("drop_"):
                out[1][key[5:] + "x"] = out[1].pop(key[5:])  # (a misspelt column)
            else:
                out[2][key] = value
        return json.dumps({"rows": out}).encode()

    return [("malformed JSON", b'{"rows": [{"I1": 1,'), ("misspelt column", changed(drop_C7=True)),
            ("word as integer", changed(I5="many")), ("object as value", changed(I2={"v": 1})),
            ("non-hex id", changed(C9="zz12")), ("two ids in one", changed(C26=["68fd1e64", "80e26c9b"])),
            ("19-digit integer", changed(I13=10**19)), ("float as id", changed(C2=12.5))]


async def malformed(url: str, bodies: list[tuple[str, bytes]], good: bytes, count: int, clients: int = 16) -> dict:
    """``count`` bad requests (the kinds in turn), ``clients`` at a time: their statuses, then
    whether the server still answers ``/healthz`` and ``good`` as it did before."""
    import httpx

    statuses: Counter = Counter()
    by_kind: dict[str, Counter] = {k: Counter() for k, _ in bodies}
    async with httpx.AsyncClient(base_url=url, timeout=60, headers={"content-type": "application/json"},
                                 limits=httpx.Limits(max_connections=clients)) as client:
        await asyncio.sleep(1.5)  # (a version the last case published is swapped in by now)
        before = (await client.post("/v1/predict", content=good)).json()
        queue = list(range(count))
        start = time.perf_counter()

        async def one() -> None:
            while queue:
                kind, body = bodies[queue.pop() % len(bodies)]
                try:
                    r = await client.post("/v1/predict", content=body)
                    status = str(r.status_code)
                except httpx.HTTPError as e:
                    status = type(e).__name__
                statuses[status] += 1
                by_kind[kind][status] += 1

        await asyncio.gather(*(one() for _ in range(clients)))
        seconds = time.perf_counter() - start
        health = await client.get("/healthz")
        after = await client.post("/v1/predict", content=good)
    four = sum(n for s, n in statuses.items() if s.startswith("4"))
    same = after.status_code == 200 and after.json() == before
    return {"requests": count, "answered_4xx": four, "statuses": dict(statuses),
            "by_kind": {k: dict(v) for k, v in by_kind.items()}, "seconds": round(seconds, 2),
            "healthz_after": health.status_code, "good_after": after.status_code,
            "same_answer_after": same, "version": before["version"]}


def predict_rate(run: Path, raw: Path, rows: int, distinct: int, work: Path) -> dict:
    """``hybridrec predict RUN FILE``'s own rows/s on the first ``distinct`` held-out rows
    repeated to ``rows`` rows (written as TSV without the label, as requests have none)."""
    lines = [ln.split("\t", 1)[1] for ln in raw.read_text().splitlines()[:distinct]]
    path = work / "predict-rows.tsv"
    path.write_text("".join(lines[i % len(lines)] + "\n" for i in range(rows)))
    out = work / "predict-out.csv"
    load_before = loadavg()
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "hybridrec", "predict", str(run), str(path), "--out", str(out)],
                          check=False, capture_output=True, text=True, cwd=ROOT)
    wall = time.perf_counter() - start
    if done.returncode != 0:
        raise SystemExit(f"hybridrec predict failed: {done.stderr[-2000:]}")
    m = re.search(r"wrote (\d+) predictions .* in ([0-9.]+)s \(([0-9,]+) rows/s\)", done.stdout)
    return {"rows": int(m.group(1)), "seconds": float(m.group(2)), "rows_per_s": float(m.group(3).replace(",", "")),
            "wall_s_with_start_up": round(wall, 2), "distinct_rows": len(lines),
            "load_average": [load_before, loadavg()]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--work", type=Path, default=ROOT / "runs" / "bench-serve-load")
    p.add_argument("--rows-per-day", type=int, default=20_000)
    p.add_argument("--seconds", type=float, default=15.0, help="per case [15]")
    p.add_argument("--clients", default="1,16,64")
    p.add_argument("--rows", default="1,256", help="rows per request")
    p.add_argument("--publish-every", type=float, default=5.0)
    p.add_argument("--publishing", default="no,yes", help="cases without and/or with publishing [no,yes]")
    p.add_argument("--serve-args", default="", help="more options of `hybridrec serve`, e.g. '--threads 2'")
    p.add_argument("--malformed", type=int, default=1000, help="bad requests sent after the cases (0: none)")
    p.add_argument("--predict-rows", type=int, default=131_072,
                   help="rows for `hybridrec predict` (the 256-row requests' rows repeated; 0: skip)")
    p.add_argument("--client", choices=("raw", "httpx"), default="raw",
                   help="the load's HTTP client: raw (a hand-written keep-alive HTTP/1.1 client, light) or "
                        "httpx (about 2 ms of CPU a request here, on the cores the server runs on) [raw]")
    p.add_argument("--out", type=Path)
    args = p.parse_args()

    from hybridrec.serve import published

    args.work.mkdir(parents=True, exist_ok=True)
    run, exports, raw = prepare(args.work, args.rows_per_day)
    shutil.rmtree(run / "published", ignore_errors=True)
    published.publish(run, copier(exports[0]))
    proc, url = start_server(run, args.work / "serve.log", args.serve_args.split())
    started = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
    results, bad, rows_list = [], None, [int(x) for x in args.rows.split(",")]
    try:
        for publishing in [x.strip() == "yes" for x in args.publishing.split(",")]:
            for rows in rows_list:
                bodies = request_bodies(raw, rows)
                for clients in [int(x) for x in args.clients.split(",")]:
                    asyncio.run(load(url, bodies, clients, 1.0, args.client))  # warm-up
                    swaps = metric(url, "hybridrec_serve_swaps_total")
                    stages = stage_totals(url)
                    publisher = Publisher(run, exports, args.publish_every) if publishing else None
                    if publisher:
                        publisher.start()
                    load_before = loadavg()
                    cpu = cpu_seconds(proc.pid), time.process_time()
                    r = asyncio.run(load(url, bodies, clients, args.seconds, args.client))
                    server_cpu, client_cpu = cpu_seconds(proc.pid) - cpu[0], time.process_time() - cpu[1]
                    load_after = loadavg()
                    if publisher:
                        publisher.stop.set()
                        publisher.join()
                    r.update(publishing=publishing, published=publisher.published if publisher else [],
                             swaps=int(metric(url, "hybridrec_serve_swaps_total") - swaps),
                             load_average=[load_before, load_after],
                             cpu_ms_per_request={"server": round(server_cpu / r["requests"] * 1e3, 3),
                                                 "client": round(client_cpu / r["requests"] * 1e3, 3)},
                             server_stage_ms=stage_means(stages, stage_totals(url)))
                    results.append(r)
                    print(json.dumps(r), flush=True)
        if args.malformed:
            good = request_bodies(raw, 4, 1)[0]
            load_before = loadavg()
            bad = asyncio.run(malformed(url, malformed_bodies(raw), good, args.malformed))
            bad["load_average"] = [load_before, loadavg()]
            bad["server_alive"] = proc.poll() is None
            print(json.dumps(bad), flush=True)
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    predicted = None
    if args.predict_rows and 256 in rows_list:
        predicted = predict_rate(run, raw, args.predict_rows, 256 * 64, args.work)
        print(json.dumps({"predict": predicted}), flush=True)
    import torch

    record = {"benchmark": "serve_load", "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
              "started": started, "finished": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
              "cpu": machine(), "cpus": len(os.sched_getaffinity(0)), "torch": torch.__version__,
              "seconds_per_case": args.seconds, "publish_every_s": args.publish_every,
              "serve_args": args.serve_args, "model": "demo recipe DLRM, fp32 export",
              "refused_or_errors_in_log": (args.work / "serve.log").read_text().count("refused"),
              "results": results, "malformed": bad, "predict": predicted}
    out = args.out or ROOT / "benchmarks" / "results" / f"serve_load-{time.strftime('%Y-%m-%d', time.gmtime())}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=2) + "\n")
    print(f"\n{record['cpu']}, {started} - {record['finished']}\n")
    print("| publishing | clients | rows/request | requests/s | rows/s | p50 ms | p99 ms | errors | swaps | load before, after |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---|")
    for r in results:
        every = f"every {args.publish_every:g} s" if r["publishing"] else "no"
        lb, la = r["load_average"]
        print(f"| {every} | {r['clients']} | "
              f"{r['rows_per_request']} | {r['requests_per_s']:,} | {r['rows_per_s']:,.0f} | {r['p50_ms']} | "
              f"{r['p99_ms']} | {r['errors']} | {r['swaps']} | {lb[0]}, {la[0]} |")
    print("\nserver time per request, ms (model: per batch):")
    print("| publishing | clients | rows/request | " + " | ".join(STAGES) + " |")
    print("|---|---:|---:|" + "---:|" * len(STAGES))
    for r in results:
        st = r["server_stage_ms"]
        print(f"| {'yes' if r['publishing'] else 'no'} | {r['clients']} | {r['rows_per_request']} | "
              + " | ".join(str(st.get(k, "")) for k in STAGES) + " |")
    if bad:
        print(f"\nmalformed: {bad['answered_4xx']} of {bad['requests']} answered 4xx ({bad['statuses']}); "
              f"afterwards /healthz {bad['healthz_after']}, a good request {bad['good_after']} "
              f"(the same version and probabilities as before: {bad['same_answer_after']})")
    if predicted:
        rate = predicted["rows_per_s"]
        served = [r["rows_per_s"] for r in results if r["rows_per_request"] == 256 and not r["publishing"]]
        print(f"hybridrec predict: {rate:,.0f} rows/s ({predicted['rows']:,} rows); served "
              f"256-row requests: {', '.join(f'{x:,.0f}' for x in served)} rows/s "
              f"({', '.join(f'{x / rate:.2f}x' for x in served)})")
    print(f"\nwrote {out}")


STAGES = ("receive", "wait", "read", "score", "model")


if __name__ == "__main__":
    main()
