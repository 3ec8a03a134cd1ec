"""``hybridrec serve``: an HTTP scoring server that follows a run's published model versions.

Endpoints (JSON unless said):

- ``POST /v1/predict``: ``{"rows": [{"I1": 3, ..., "C1": "68fd1e64", ...}, ...]}`` or, for
  large requests, ``{"columns": {"I1": [...], ...}}``: the raw columns of the run's data (a
  label, and any column the model does not take, is ignored; ``null`` is a missing value).
  Returns ``{"version": "v3", "probabilities": [...]}``, ``hybridrec predict``'s numbers
  (:mod:`hybridrec.serve.versions`). A bad request gets a 4xx and ``{"error": "one line"}``
  naming the problem: malformed JSON, a missing column, a value the run's parser refuses
  (naming the row and column), too many rows (413), a body over the size cap (413).
- ``GET /v1/model``: the served version, its path, step, rows trained on and freshness
  (seconds since it was published) where known, and the columns it takes.
- ``GET /healthz``: ``{"status": "ok", "version": ...}``.
- ``GET /metrics``: Prometheus text (prometheus-client): requests by endpoint and status,
  rows scored, request latency, batch sizes, errors by kind, the served version, swaps
  and refused versions.

**Batching.** Concurrent requests are scored together. Each request's JSON is read into
checked rows (:meth:`ModelVersion.read`: the values straight to the dataset reader's raw
keys and dense values, :mod:`hybridrec.serve.json_rows`) on the event loop itself when its
body is small (``inline_bytes``, 64 KiB: a 1-row request takes about 0.1 ms there, and
handing it to a thread cost more: the hand-off, then the GIL shared by many threads) and on
a worker thread (Starlette's thread pool) when it is larger; then it is queued. One batcher
task takes what is queued, up to ``max_batch_rows`` rows, waiting at most ``max_wait_s``
for more after the first while other requests are being read (none: no wait), and on a
single model thread makes the batch's ids (once for all its requests) and runs one forward,
with ``threads`` torch threads (default 1: the other core is the event loop's, which reads
requests meanwhile). While a forward runs the next batch gathers, so under load batches
grow by themselves. A request is never split; one larger than ``max_batch_rows`` is a batch
of its own. Starlette has no batching of its own, so this is a small asyncio queue
(:class:`Batcher`). ``hybridrec_serve_stage_seconds`` (``/metrics``) times the stages.

**Versions and hot swap.** A request is read by the version serving when it arrives and
is scored, its ids made with its vocabularies, by that same version: a batch holds one version's
requests only (:class:`Batcher` keeps others for the next batch), and each response names
the version that scored it. For a run directory the server polls ``RUN/published/LATEST``
(:mod:`hybridrec.serve.published`) every ``poll_s``; a new name is loaded on a thread
beside the serving version, checked (it loads, scores made-up inputs, and takes the same
raw columns) and then swapped in with one assignment; requests already read by the old
version finish on it. A version that fails is refused with one log line and the old one
keeps serving; the same name is not retried (the next publication is).

**Why Starlette on uvicorn** (not LitServe, not FastAPI). Measured with
``benchmarks/serve_stack.py`` (docs/benchmarks.md, "Serving over HTTP"): a minimal server of
each stack doing the same work per request (this module's encoding and scoring, a 2 ms
batching window), closed-loop httpx clients, two alternating rounds on a shared 2-core Zen 4;
requests/s, round 1 and round 2:

    ================  ====================  =================
    clients x rows    Starlette + uvicorn   LitServe 0.2.19
    ================  ====================  =================
    1 x 1             77.6, 114.8           112.0, 42.6
    16 x 1            212.1, 192.9          113.8, 68.3
    64 x 1            85.4, 129.2           44.4, 60.8
    16 x 256          42.5, 73.8            24.0, 7.2
    ================  ====================  =================

Starlette answered 1.7-2.8x the requests at 16 clients and more in every loaded case (one
client: the machine's spread). It also fits: the model runs in this process, where a swap
is one assignment, and the dependencies are three small packages (starlette, uvicorn,
prometheus-client). LitServe scores in worker processes behind a queue, so a hot swap and
the version each response names would have to be coordinated across processes; its batches
count requests, not rows (a 256-row request weighs as much as a 1-row one); it listens on
0.0.0.0 unless told otherwise and brings FastAPI, pydantic and pyzmq. FastAPI's request
models would add nothing: the columns are the run's, known when a version loads.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import json
import operator
import os
import sys
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from hybridrec.errors import ConfigError, DataError, HybridrecError
from hybridrec.serve import published
from hybridrec.serve.versions import ModelVersion, Rows, load_version


@dataclass
class Limits:
    """What one server accepts and how it batches (``hybridrec serve`` options)."""

    max_batch_rows: int = 1024
    """Rows of one forward (a larger single request is a batch of its own)."""
    max_wait_s: float = 0.002
    """How long the first request of a batch waits for others."""
    max_rows: int = 10_000
    """Rows of one request."""
    max_body_bytes: int = 16 << 20
    """Bytes of one request's body."""
    inline_bytes: int = 64 << 10
    """Bodies up to this size (about 90 Criteo rows) are read on the event loop itself,
    larger ones on a worker thread (see the module docstring)."""
    poll_s: float = 0.5
    """How often ``RUN/published/LATEST`` is read."""


class BadRequest(Exception):
    """A request the server refuses: ``status`` (4xx) and one line."""

    def __init__(self, status: int, message: str, kind: str = "bad_request") -> None:
        super().__init__(message)
        self.status, self.message, self.kind = status, message, kind


def log(message: str) -> None:
    """One line of the server's own log (stderr)."""
    with contextlib.suppress(OSError, ValueError):
        print(f"hybridrec serve: {message}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------- where versions come from


@dataclass
class Source:
    """What ``hybridrec serve PATH`` serves: an export directory (``run`` None, never
    changes) or a run directory (``run``: its ``published/LATEST`` is followed)."""

    first: Path
    name: str
    run: Path | None = None


def resolve(path: str | os.PathLike) -> Source:
    """PATH as :class:`Source`: an export directory (has ``export.json``) as it is; a run
    directory's newest published version (``RUN/published/LATEST``), or else an export of
    its best checkpoint (the newest without early stopping) written on the fly to
    ``RUN/serving/<checkpoint>`` (reused when it is there)."""
    path = Path(path)
    if (path / "export.json").is_file():
        return Source(path, path.name)
    if path.name == published.PUBLISHED and (path / published.LATEST).is_file():
        path = path.parent
    if not (path / "config.json").is_file():
        raise ConfigError(f"{path}: neither an export directory (no export.json) nor a run directory "
                          "(no config.json); give `hybridrec export`'s --out or a run")
    newest = published.latest(path)
    if newest is not None:
        return Source(newest, newest.name, run=path)
    return Source(*_export_on_the_fly(path), run=path)


def _export_on_the_fly(run: Path) -> tuple[Path, str]:
    from hybridrec.serve.export import export_run
    from hybridrec.train.loop.early_stop import resolve_checkpoint

    checkpoint, _ = resolve_checkpoint(run, None)
    if checkpoint is None:
        raise ConfigError(f"{run}: nothing published (no published/LATEST) and no checkpoint to export")
    out = run / "serving" / checkpoint.name
    if not (out / "export.json").is_file():
        log(f"{run}: nothing published; exporting {checkpoint.name} to {out}")
        out.parent.mkdir(exist_ok=True)
        export_run(run, out, checkpoint=str(checkpoint), eval_rows=2048)
    return out, checkpoint.name


# ---------------------------------------------------------------- metrics


class Metrics:
    """The server's Prometheus metrics, in a registry of its own."""

    def __init__(self) -> None:
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self.registry = r = CollectorRegistry()
        self.requests = Counter("hybridrec_serve_requests", "HTTP requests", ["endpoint", "status"], registry=r)
        self.rows = Counter("hybridrec_serve_rows", "rows scored", registry=r)
        self.latency = Histogram("hybridrec_serve_request_seconds", "POST /v1/predict latency, seconds",
                                 buckets=(.001, .0025, .005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10),
                                 registry=r)
        self.batch_rows = Histogram("hybridrec_serve_batch_rows", "rows per forward",
                                    buckets=(1, 4, 16, 64, 256, 1024, 4096, 16384), registry=r)
        self.stages = Histogram("hybridrec_serve_stage_seconds",
                                "POST /v1/predict's stages, seconds: receive (the body), wait (for a "
                                "thread to read it on, large bodies), read (JSON to checked rows), "
                                "score (queued, batched, scored); model: one batch's ids and forward",
                                ["stage"], buckets=(.0001, .00025, .0005, .001, .0025, .005, .01, .025,
                                                    .05, .1, .25, .5, 1, 2.5), registry=r)
        self.errors = Counter("hybridrec_serve_errors", "refused or failed predict requests", ["kind"],
                              registry=r)
        self.version = Gauge("hybridrec_serve_model_version", "1 for the version being served",
                             ["version"], registry=r)
        self.swaps = Counter("hybridrec_serve_swaps", "versions swapped in", registry=r)
        self.refused = Counter("hybridrec_serve_refused_versions", "published versions refused", registry=r)

    def serving(self, new: str, old: str | None) -> None:
        if old is not None:
            with contextlib.suppress(KeyError):
                self.version.remove(old)
        self.version.labels(version=new).set(1)

    def text(self) -> bytes:
        from prometheus_client import generate_latest

        return generate_latest(self.registry)


# ---------------------------------------------------------------- batching


class Batcher:
    """Requests' inputs into batches of one version (see the module docstring)."""

    def __init__(self, limits: Limits, metrics: Metrics) -> None:
        self.limits, self.metrics = limits, metrics
        self.queue: asyncio.Queue = asyncio.Queue()
        self.waiting: deque = deque()  # taken from the queue, left for a later batch
        self.coming = 0  # requests being received and read (they will be queued soon)
        self.model_thread = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="hybridrec-model")

    async def score(self, rows: Rows) -> np.ndarray:
        future = asyncio.get_running_loop().create_future()
        await self.queue.put((rows, future))
        return await future

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            batch = await self._gather(loop)
            try:
                self.metrics.batch_rows.observe(sum(i.rows for i, _ in batch))
                start = time.perf_counter()
                probs = await loop.run_in_executor(self.model_thread, batch[0][0].version.score_rows,
                                                   [r for r, _ in batch])
                self.metrics.stages.labels(stage="model").observe(time.perf_counter() - start)
            except Exception as e:  # noqa: BLE001 (the requests of this batch fail; the server goes on)
                for _, future in batch:
                    if not future.done():
                        future.set_exception(e)
                continue
            at = 0
            for inputs, future in batch:
                if not future.done():  # (a client that went away cancelled it)
                    future.set_result(probs[at:at + inputs.rows])
                at += inputs.rows

    async def _gather(self, loop) -> list:
        """The next batch: the oldest request, then more of its version (waiting ones
        first, then the queue's) until the rows or the wait run out."""
        first = self.waiting.popleft() if self.waiting else await self.queue.get()
        version, room = first[0].version, self.limits.max_batch_rows - first[0].rows
        batch, later = [first], deque()
        while self.waiting:
            item = self.waiting.popleft()
            if item[0].version is version and item[0].rows <= room:
                batch.append(item)
                room -= item[0].rows
            else:
                later.append(item)
        self.waiting = later
        deadline = loop.time() + self.limits.max_wait_s
        while room > 0:
            try:
                item = self.queue.get_nowait()
            except asyncio.QueueEmpty:
                left = deadline - loop.time()
                if left <= 0 or not self.coming:  # (no other request on its way: no wait)
                    break
                try:
                    item = await asyncio.wait_for(self.queue.get(), left)
                except (asyncio.TimeoutError, TimeoutError):
                    break
            if item[0].version is version and item[0].rows <= room:
                batch.append(item)
                room -= item[0].rows
            else:
                self.waiting.append(item)
                if item[0].version is version:
                    break  # full: this one starts the next batch
        return batch

    def close(self) -> None:
        self.model_thread.shutdown(wait=False, cancel_futures=True)


# ---------------------------------------------------------------- requests


def parse_request(body: bytes, columns: list[str], max_rows: int,
                  label: str = "label") -> tuple[dict[str, list], int]:
    """A predict body as ``({column: values}, rows)``; :class:`BadRequest` says what is wrong
    (a missing column named with the names given that the model does not take, ``label``
    aside: a misspelt one shows)."""
    try:
        data = json.loads(body)
    except UnicodeDecodeError:
        raise BadRequest(400, "malformed JSON: the body is not UTF-8 text") from None
    except ValueError as e:
        raise BadRequest(400, f"malformed JSON: {e}") from None
    if not isinstance(data, dict) or ("rows" in data) == ("columns" in data):
        raise BadRequest(400, 'the body must be a JSON object with "rows" (a list of objects, one per '
                         'row) or "columns" (an object of equally long lists)')
    if "rows" in data:
        return _rows(data["rows"], columns, max_rows, label)
    return _columns(data["columns"], columns, max_rows, label)


def _too_many(n: int, max_rows: int) -> None:
    if n > max_rows:
        raise BadRequest(413, f"{n} rows: over the limit of {max_rows} rows per request (--max-rows)",
                         "too_many_rows")


def _rows(rows, columns: list[str], max_rows: int, label: str) -> tuple[dict[str, list], int]:
    if not isinstance(rows, list):
        raise BadRequest(400, f'"rows" must be a list of objects, got {_kind(rows)}')
    _too_many(len(rows), max_rows)
    if not rows:
        return {c: [] for c in columns}, 0
    try:  # (every row's values at C speed; a row that is no object, or lacks a column, raises)
        values = list(map(operator.itemgetter(*columns), rows)) if all(type(r) is dict for r in rows) else None
    except KeyError:
        values = None
    if values is None:
        for i, row in enumerate(rows):
            if not isinstance(row, dict):
                raise BadRequest(400, f"rows[{i}]: expected an object of column values, got {_kind(row)}")
            missing = [c for c in columns if c not in row]
            if missing:
                raise BadRequest(400, f"rows[{i}]: no column {_names(missing)} ({_expected(columns)})"
                                 f"{_unknown(row, columns, label)}", "missing_column")
        values = [tuple(row[c] for c in columns) for row in rows]  # (dict subclasses: not from JSON)
    if len(columns) == 1:
        return {columns[0]: values}, len(rows)
    return dict(zip(columns, map(list, zip(*values)))), len(rows)


def _columns(cols, columns: list[str], max_rows: int, label: str) -> tuple[dict[str, list], int]:
    if not isinstance(cols, dict):
        raise BadRequest(400, f'"columns" must be an object of lists, got {_kind(cols)}')
    missing = [c for c in columns if c not in cols]
    if missing:
        raise BadRequest(400, f"columns: no column {_names(missing)} ({_expected(columns)})"
                         f"{_unknown(cols, columns, label)}", "missing_column")
    for c in columns:
        if not isinstance(cols[c], list):
            raise BadRequest(400, f"columns.{c}: expected a list of values, got {_kind(cols[c])}")
    sizes = {c: len(cols[c]) for c in columns}
    n = sizes[columns[0]]
    _too_many(max(sizes.values()), max_rows)
    uneven = [c for c in columns if sizes[c] != n]
    if uneven:
        raise BadRequest(400, f"columns: {uneven[0]} has {sizes[uneven[0]]} values, {columns[0]} has {n}")
    return {c: cols[c] for c in columns}, n


def check_values(columns: dict[str, list], fmt: str) -> None:
    """What the in-memory readers cannot see: in Criteo's tab-separated text a tab or line
    break inside a value would split it, and an object is no value in any format (CSV
    would hash its text)."""
    for name, values in columns.items():
        types = set(map(type, values))
        if dict in types:
            i = next(i for i, v in enumerate(values) if isinstance(v, dict))
            raise BadRequest(400, f"row {i}: column {name}: an object is not a value")
        if fmt == "criteo" and str in types:
            text = "".join(values) if len(types) == 1 else "".join(v for v in values if type(v) is str)
            if "\t" in text or "\n" in text or "\r" in text:
                i = next(i for i, v in enumerate(values) if isinstance(v, str) and set(v) & set("\t\n\r"))
                raise BadRequest(400, f"row {i}: column {name}: a tab or line break inside a value")


def _unknown(given: dict, columns: list[str], label: str) -> str:
    """What a request names that the model does not take (extra columns are ignored, but
    beside a missing one they are likely its misspelling)."""
    known = {*columns, label}
    unknown = [str(k) for k in given if k not in known]
    return f"; given {_names(unknown)}, which the model does not take" if unknown else ""


def _kind(value) -> str:
    return {dict: "an object", list: "a list", str: "a string", type(None): "null"}.get(type(value), "a number")


def _names(names: list[str]) -> str:
    return ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")


def _expected(columns: list[str]) -> str:
    shown = ", ".join(columns[:5]) + (f", ... {columns[-1]}" if len(columns) > 5 else "")
    return f"the model takes {len(columns)} columns: {shown}"


async def read_body(request, cap: int) -> bytes:
    """The body, refused (413) as soon as it is known to exceed ``cap`` bytes."""
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > cap:
        raise BadRequest(413, f"a body of {int(length)} bytes: over the cap of {cap} bytes (--max-body-mb)",
                         "body_too_large")
    parts, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > cap:
            raise BadRequest(413, f"a body of over {cap} bytes: over the cap (--max-body-mb)", "body_too_large")
        parts.append(chunk)
    return b"".join(parts)


# ---------------------------------------------------------------- the server


class Server:
    """The serving state: the current version, the batcher, the watcher of ``LATEST``."""

    def __init__(self, source: Source, version: ModelVersion, limits: Limits | None = None) -> None:
        self.source, self.current, self.limits = source, version, limits or Limits()
        self.metrics = Metrics()
        self.metrics.serving(version.name, None)
        self.refused: str | None = None  # the last version refused (not tried again)
        self.unreadable: str | None = None  # why LATEST could not be read (said once)
        self.batcher: Batcher | None = None
        self.tasks: list[asyncio.Task] = []

    def app(self):
        from starlette.applications import Starlette
        from starlette.routing import Route

        @contextlib.asynccontextmanager
        async def lifespan(app):
            self.batcher = Batcher(self.limits, self.metrics)
            self.tasks = [asyncio.create_task(self.batcher.run(), name="hybridrec-batcher")]
            if self.source.run is not None:
                self.tasks.append(asyncio.create_task(self.watch(), name="hybridrec-watch"))
            try:
                yield
            finally:
                for t in self.tasks:
                    t.cancel()
                await asyncio.gather(*self.tasks, return_exceptions=True)
                self.batcher.close()

        return Starlette(lifespan=lifespan, routes=[
            Route("/v1/predict", self.predict, methods=["POST"]),
            Route("/v1/model", self.model, methods=["GET"]),
            Route("/healthz", self.health, methods=["GET"]),
            Route("/metrics", self.prometheus, methods=["GET"]),
        ])

    # ------------------------------------------------------------ endpoints

    async def predict(self, request):
        from starlette.concurrency import run_in_threadpool
        from starlette.responses import JSONResponse

        start = time.perf_counter()
        version = self.current
        stage = self.metrics.stages
        try:
            self.batcher.coming += 1
            try:
                body = await read_body(request, self.limits.max_body_bytes)
                received = time.perf_counter()
                if len(body) <= self.limits.inline_bytes:
                    rows, began, read = self._rows(version, body)
                else:
                    rows, began, read = await run_in_threadpool(self._rows, version, body)
            finally:
                self.batcher.coming -= 1
            stage.labels(stage="receive").observe(received - start)
            stage.labels(stage="wait").observe(began - received)
            stage.labels(stage="read").observe(read - began)
            probs = await self.batcher.score(rows) if rows.rows else np.zeros(0, np.float32)
            stage.labels(stage="score").observe(time.perf_counter() - read)
        except BadRequest as e:
            return self._error(e.status, e.message, e.kind)
        except DataError as e:  # a value the run's parser refuses
            return self._error(400, str(e), "bad_value")
        except Exception as e:  # noqa: BLE001 (one line to the client and the log; the server goes on)
            text = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
            log(f"predict failed: {text}")
            return self._error(500, f"internal error: {text}", "internal")
        self.metrics.rows.inc(rows.rows)
        self.metrics.latency.observe(time.perf_counter() - start)
        self.metrics.requests.labels(endpoint="predict", status="200").inc()
        return JSONResponse({"version": version.name, "probabilities": probs.tolist()})

    def _rows(self, version: ModelVersion, body: bytes) -> tuple[Rows, float, float]:
        """The request's rows as ``version`` reads them, and when reading began and ended."""
        began = time.perf_counter()
        columns, n = parse_request(body, version.columns, self.limits.max_rows, version.meta.schema.label)
        check_values(columns, version.format)
        return version.read(columns, n), began, time.perf_counter()

    def _error(self, status: int, message: str, kind: str):
        from starlette.responses import JSONResponse

        self.metrics.errors.labels(kind=kind).inc()
        self.metrics.requests.labels(endpoint="predict", status=str(status)).inc()
        return JSONResponse({"error": message}, status_code=status)

    async def model(self, request):
        from starlette.responses import JSONResponse

        self.metrics.requests.labels(endpoint="model", status="200").inc()
        body = self.current.describe()
        body["following"] = str(published.published_dir(self.source.run) / published.LATEST) \
            if self.source.run is not None else None
        return JSONResponse(body)

    async def health(self, request):
        from starlette.responses import JSONResponse

        stopped = [t.get_name() for t in self.tasks if t.done()]
        status = 503 if stopped else 200  # (a task that ended is a bug; a probe should see it)
        self.metrics.requests.labels(endpoint="healthz", status=str(status)).inc()
        return JSONResponse({"status": f"{', '.join(stopped)} stopped" if stopped else "ok",
                             "version": self.current.name}, status_code=status)

    async def prometheus(self, request):
        from prometheus_client import CONTENT_TYPE_LATEST
        from starlette.responses import Response

        self.metrics.requests.labels(endpoint="metrics", status="200").inc()
        return Response(self.metrics.text(), media_type=CONTENT_TYPE_LATEST)

    # ------------------------------------------------------------ hot swap

    async def watch(self) -> None:
        """Poll ``LATEST``; load a new name beside the serving version and swap it in."""
        while True:
            await asyncio.sleep(self.limits.poll_s)
            try:
                name = await asyncio.to_thread(published.latest_name, self.source.run)
            except (HybridrecError, OSError) as e:
                if self.unreadable != str(e):
                    log(f"cannot read {published.LATEST}: {e}; still serving {self.current.name}")
                    self.unreadable = str(e)
                continue
            self.unreadable = None
            if name is None or name in (self.current.name, self.refused):
                continue
            await self.swap_to(name)

    async def swap_to(self, name: str) -> bool:
        old = self.current
        path = published.published_dir(self.source.run) / name
        start = time.perf_counter()
        try:
            new = await asyncio.to_thread(load_version, path, name)
            why = old.same_columns(new)
            if why is not None:
                raise DataError(f"{path}: {why}")
        except (HybridrecError, OSError) as e:
            self.refused = name
            self.metrics.refused.inc()
            log(f"refused version {name}: {e}; still serving {old.name}")
            return False
        except Exception as e:  # noqa: BLE001 (whatever a broken version raises: refused, not fatal)
            self.refused = name
            self.metrics.refused.inc()
            log(f"refused version {name}: {type(e).__name__}: {e}; still serving {old.name}")
            return False
        self.current = new  # (one assignment: the next request is read by the new version)
        self.refused = None
        self.metrics.swaps.inc()
        self.metrics.serving(new.name, old.name)
        log(f"now serving {new.name} (was {old.name}; loaded in {time.perf_counter() - start:.1f} s)")
        return True


# ---------------------------------------------------------------- running it


def is_loopback(host: str) -> bool:
    import ipaddress
    import socket

    try:
        infos = socket.getaddrinfo(host, None)
    except OSError:
        return False
    return bool(infos) and all(ipaddress.ip_address(i[4][0].split("%")[0]).is_loopback for i in infos)


def listen(host: str, port: int):
    """A socket listening on ``host:port`` (port 0: a free one). It listens from here on, so
    a client that connects once the address is printed waits in the backlog until uvicorn
    accepts (rather than being refused)."""
    import socket

    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                             flags=socket.AI_PASSIVE)[0]
        sock = socket.socket(family, kind, proto)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(2048)
    except OSError as e:
        raise ConfigError(f"--host {host} --port {port}: cannot listen there ({e.strerror or e})") from None
    sock.set_inheritable(True)
    return sock


def set_threads(threads: int | None) -> int:
    """torch's threads: ``threads`` (0: every CPU this process may run on), default 1."""
    import torch

    if threads is None:
        threads = 1
    if not threads:
        threads = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    torch.set_num_threads(max(1, threads))
    return torch.get_num_threads()


def serve(path: str | os.PathLike, *, host: str = "127.0.0.1", port: int = 8000,
          limits: Limits | None = None, threads: int | None = None) -> None:
    """Load PATH (:func:`resolve`), listen on ``host:port`` and serve until SIGINT/SIGTERM."""
    try:
        import prometheus_client  # noqa: F401
        import starlette  # noqa: F401
        import uvicorn
    except ImportError as e:
        raise ConfigError(f"hybridrec serve needs starlette, uvicorn and prometheus-client ({e.name} is "
                          "not installed): pip install 'hybridrec[serve]'") from None

    limits = limits or Limits()
    _check_limits(limits)
    n_threads = set_threads(threads)
    source = resolve(path)
    version = load_version(source.first, source.name)
    server = Server(source, version, limits)
    sock = listen(host, port)
    bound_host, bound_port = sock.getsockname()[:2]
    shown = f"[{bound_host}]" if ":" in bound_host else bound_host
    if not is_loopback(bound_host):
        import warnings

        from hybridrec.errors import HybridrecWarning

        warnings.warn(f"serving on {host} port {bound_port}, beyond this machine: there is no "
                      "authentication, anyone who reaches the port can query the model", HybridrecWarning,
                      stacklevel=2)
    following = f", following {source.run / published.PUBLISHED / published.LATEST}" if source.run else ""
    print(f"hybridrec serve: serving {version.name} ({source.first}) on http://{shown}:{bound_port}"
          f"{following}; {n_threads} torch threads", flush=True)
    # (keep-alive longer than clients' and proxies' own idle timeouts, e.g. httpx's 5 s and a
    # load balancer's 60 s: a connection the server closes as the client reuses it fails a request)
    config = uvicorn.Config(server.app(), log_level="warning", access_log=False, lifespan="on",
                            timeout_graceful_shutdown=10, timeout_keep_alive=75)
    uvicorn.Server(config).run(sockets=[sock])


def _check_limits(limits: Limits) -> None:
    for name in ("max_batch_rows", "max_rows", "max_body_bytes"):
        if getattr(limits, name) < 1:
            raise ConfigError(f"{name.replace('_', '-')} must be >= 1, got {getattr(limits, name)}")
    if limits.max_wait_s < 0 or limits.poll_s <= 0:
        raise ConfigError(f"the batch wait ({limits.max_wait_s}) must be >= 0 and the poll interval "
                          f"({limits.poll_s}) > 0 seconds")
