"""`hybridrec serve`: an HTTP scoring server for an export or a run's published versions
(parsing only; the work is in :mod:`hybridrec.serve.server`)."""

from __future__ import annotations

import argparse

_EPILOG = """\
examples:
  hybridrec serve runs/kaggle                  # its newest published version, or its best checkpoint
  hybridrec serve artifacts/kaggle --port 9000 # an export directory (hybridrec export)
  curl -s localhost:8000/v1/predict -d '{"rows": [{"I1": 3, "I2": 1, ..., "C26": "68fd1e64"}]}'

PATH is an export directory (`hybridrec export RUN --out DIR`) or a run directory: then its
newest published version (RUN/published/LATEST), followed as new versions are published
and swapped in without failing a request, or else an export of its best checkpoint made
now into RUN/serving/. Endpoints: POST /v1/predict ({"rows": [...]} or {"columns": {...}}
with the run's raw columns), GET /v1/model, GET /healthz, GET /metrics (Prometheus).
Listens on 127.0.0.1 unless --host says otherwise; there is no authentication.
"""


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="serve a model over HTTP, following a run's published versions",
                       description="Score raw rows over HTTP with an exported model, batching "
                       "concurrent requests, and swap in each new version a run publishes.",
                       epilog=_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("path", metavar="PATH", help="an export directory or a run directory")
    p.add_argument("--host", default="127.0.0.1",
                   help="address to listen on [127.0.0.1]; another exposes the unauthenticated API")
    p.add_argument("--port", type=int, default=8000, help="port (0: a free one, printed) [8000]")
    p.add_argument("--max-batch-rows", type=int, default=1024, metavar="N",
                   help="rows scored in one forward pass, from several requests [1024]")
    p.add_argument("--max-wait-ms", type=float, default=2.0, metavar="MS",
                   help="how long a request waits for others to batch with [2]")
    p.add_argument("--max-rows", type=int, default=10_000, metavar="N",
                   help="rows of one request; more gets 413 [10000]")
    p.add_argument("--max-body-mb", type=float, default=16.0, metavar="MB",
                   help="size of one request's body; more gets 413 [16]")
    p.add_argument("--poll-s", type=float, default=0.5, metavar="S",
                   help="how often RUN/published/LATEST is read for a new version [0.5]")
    p.add_argument("--threads", type=int, default=1, metavar="N",
                   help="torch threads of the model thread (0: every CPU this process may use) [1]: "
                        "one leaves the other cores to the event loop that reads requests")
    p.set_defaults(func=_serve)


def _serve(args: argparse.Namespace) -> int:
    from hybridrec.serve.server import Limits, serve

    limits = Limits(max_batch_rows=args.max_batch_rows, max_wait_s=args.max_wait_ms / 1000,
                    max_rows=args.max_rows, max_body_bytes=int(args.max_body_mb * 2**20),
                    poll_s=args.poll_s)
    serve(args.path, host=args.host, port=args.port, limits=limits, threads=args.threads)
    return 0
