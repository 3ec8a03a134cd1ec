#!/usr/bin/env python3
"""The measurement behind `hybridrec serve`'s stack: Starlette on uvicorn against LitServe.

    .venv/bin/python -m pip install -c scripts/constraints.txt litserve   # not a dependency
    .venv/bin/python benchmarks/serve_stack.py [--work DIR] [--seconds 8] [--rounds 2]

Serves one export (benchmarks/serve_load.py's run, made under --work) with a minimal
server of each stack doing the same work per request: parse the JSON rows, read them with
the export's own preprocessing (:meth:`hybridrec.serve.versions.ModelVersion.read`), and
make their ids and score them in batches (:meth:`~hybridrec.serve.versions.ModelVersion.score_rows`) (a 2 ms window; Starlette through a small asyncio queue, LitServe
through its own ``max_batch_size``/``batch_timeout``). Each server runs as its own process,
the stacks take turns for ``--rounds`` rounds, and each case is serve_load.py's closed loop
of N httpx clients. Prints one JSON line per case.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))


def _version(export: str):
    from hybridrec.serve.versions import load_version

    return load_version(export)


def _encode(version, body: dict):
    rows = body["rows"]
    return version.read({c: [r[c] for r in rows] for c in version.columns}, len(rows))


def run_starlette(export: str, port: int) -> None:
    import numpy as np
    import uvicorn
    from starlette.applications import Starlette
    from starlette.concurrency import run_in_threadpool
    from starlette.responses import JSONResponse
    from starlette.routing import Route

    version = _version(export)
    queue: asyncio.Queue = asyncio.Queue()

    async def batcher() -> None:
        loop = asyncio.get_running_loop()
        while True:
            items = [await queue.get()]
            deadline = loop.time() + 0.002
            while sum(i.rows for i, _ in items) < 1024 and (left := deadline - loop.time()) > 0:
                try:
                    items.append(await asyncio.wait_for(queue.get(), left))
                except (asyncio.TimeoutError, TimeoutError):
                    break
            probs = await run_in_threadpool(version.score_rows, [i for i, _ in items])
            at = 0
            for inputs, future in items:
                future.set_result(probs[at:at + inputs.rows])
                at += inputs.rows

    async def predict(request):
        inputs = await run_in_threadpool(_encode, version, json.loads(await request.body()))
        future = asyncio.get_running_loop().create_future()
        await queue.put((inputs, future))
        probs: np.ndarray = await future
        return JSONResponse({"version": version.name, "probabilities": probs.tolist()})

    @contextlib.asynccontextmanager
    async def lifespan(app):
        task = asyncio.create_task(batcher())
        yield
        task.cancel()

    app = Starlette(routes=[Route("/v1/predict", predict, methods=["POST"])], lifespan=lifespan)
    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning", access_log=False)


try:
    import litserve as ls
except ImportError:
    ls = None

if ls is not None:
    class Scorer(ls.LitAPI):
        """LitServe's side (at module level: its workers are spawned and unpickle it)."""

        export = ""

        def setup(self, device):
            self.version = _version(self.export)

        def decode_request(self, request):
            return _encode(self.version, request)

        def batch(self, inputs):
            return inputs

        def predict(self, batch):
            probs = self.version.score_rows(batch)
            out, at = [], 0
            for inputs in batch:
                out.append(probs[at:at + inputs.rows].tolist())
                at += inputs.rows
            return out

        def unbatch(self, output):
            return output

        def encode_response(self, probs):
            return {"version": self.version.name, "probabilities": probs}


def run_litserve(export: str, port: int) -> None:
    if ls is None:
        raise SystemExit("litserve is not installed (not a dependency of hybridrec): "
                         ".venv/bin/python -m pip install -c scripts/constraints.txt litserve")
    api = Scorer(max_batch_size=64, batch_timeout=0.002, api_path="/v1/predict")
    api.export = export
    server = ls.LitServer(api, accelerator="cpu", devices=1)
    server.run(host="127.0.0.1", port=port, generate_client_file=False, log_level="warning",
               num_api_servers=1)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--work", type=Path, default=ROOT / "runs" / "bench-serve-load")
    p.add_argument("--seconds", type=float, default=8.0)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--serve", choices=("starlette", "litserve"), help=argparse.SUPPRESS)
    p.add_argument("--export", help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, default=8850)
    args = p.parse_args()
    if args.serve:
        (run_starlette if args.serve == "starlette" else run_litserve)(args.export, args.port)
        return

    import httpx
    from serve_load import load, prepare, request_bodies

    _, exports, raw = prepare(args.work, 20_000)
    bodies = {rows: request_bodies(raw, rows) for rows in (1, 256)}
    for r in range(args.rounds):
        for stack in ("starlette", "litserve"):
            port = args.port + 2 * r + (stack == "litserve")
            proc = subprocess.Popen([sys.executable, __file__, "--serve", stack, "--export", str(exports[-1]),
                                     "--port", str(port)], start_new_session=True)
            url = f"http://127.0.0.1:{port}"
            try:
                for _ in range(300):  # (up to 5 minutes to start on a loaded machine)
                    with contextlib.suppress(httpx.HTTPError):
                        if httpx.post(f"{url}/v1/predict", content=bodies[1][0], timeout=5).status_code == 200:
                            break
                    if proc.poll() is not None:
                        raise SystemExit(f"the {stack} server exited ({proc.returncode})")
                    time.sleep(1)
                else:
                    raise SystemExit(f"the {stack} server did not answer in 5 minutes")
                for clients, rows in ((1, 1), (16, 1), (64, 1), (16, 256)):
                    result = asyncio.run(load(url, bodies[rows], clients, args.seconds, "httpx"))
                    print(json.dumps({"round": r, "stack": stack, **result}), flush=True)
            finally:
                os.killpg(proc.pid, signal.SIGTERM)
                proc.wait(timeout=60)


if __name__ == "__main__":
    main()
