#!/usr/bin/env python3
"""A request's JSON rows to the model's inputs: the direct path against the text path.

    .venv/bin/python benchmarks/serve_rows.py [--work DIR] [--rows 1,16,256,4096] [--reps 3000]

On the held-out Criteo rows of benchmarks/serve_load.py's run (made once under --work), as
``hybridrec serve`` has them after parsing a request's JSON (``{column: values}``), the
median time of:

- ``text``: :func:`hybridrec.serve.inputs.table_chunks`, the rows written as Criteo text
  and parsed by the reader (what the server did before);
- ``direct``: :func:`hybridrec.serve.json_rows.json_chunk`, the values straight to the chunk;
- ``ids``: the chunk's ids and the program's inputs (``ModelVersion.inputs``: encode_chunk,
  keyed_ids, batch_inputs), which follow either.

The variants take turns call by call (load on a shared machine falls on both alike), on one
thread (torch too). Prints one JSON line per request size and a Markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serve_load import held_out_rows, prepare
from throughput import machine

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--work", type=Path, default=ROOT / "runs" / "bench-serve-load")
    p.add_argument("--rows-per-day", type=int, default=20_000)
    p.add_argument("--rows", default="1,16,256,4096", help="rows per request")
    p.add_argument("--reps", type=int, default=3000, help="rows timed per size (at least 20 calls)")
    args = p.parse_args()

    import torch

    from hybridrec.data.chunk import ParseReport
    from hybridrec.serve.inputs import table_chunks
    from hybridrec.serve.json_rows import json_chunk
    from hybridrec.serve.versions import load_version

    torch.set_num_threads(1)
    _, exports, raw = prepare(args.work, args.rows_per_day)
    version = load_version(exports[-1])
    sizes = [int(x) for x in args.rows.split(",")]
    rows = held_out_rows(raw, max(sizes))
    started, load_before = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), os.getloadavg()
    results = []
    for n in sizes:
        cols = {c: [r[c] for r in rows[:n]] for c in version.columns}
        times: dict[str, list[float]] = {"text": [], "direct": [], "ids": []}
        for _ in range(max(20, args.reps // n)):
            t0 = time.perf_counter()
            text = [c for c, *_ in table_chunks(cols, version.meta, ParseReport())]
            t1 = time.perf_counter()
            chunk = json_chunk(cols, n, version.meta)
            t2 = time.perf_counter()
            version.inputs([chunk])
            t3 = time.perf_counter()
            times["text"].append(t1 - t0)
            times["direct"].append(t2 - t1)
            times["ids"].append(t3 - t2)
        assert len(text) == 1 and np.array_equal(text[0].onehot, chunk.onehot)
        r = {"rows": n, **{f"{k}_us_per_row": round(float(np.median(v)) / n * 1e6, 2) for k, v in times.items()},
             **{f"{k}_ms": round(float(np.median(v)) * 1e3, 3) for k, v in times.items()}}
        results.append(r)
        print(json.dumps(r), flush=True)
    load_after = os.getloadavg()
    print(f"\n{machine()}, {started}, load average {load_before[0]:.2f} before, {load_after[0]:.2f} after\n")
    print("| rows/request | text path us/row | direct us/row | text / direct | then ids us/row |")
    print("|---:|---:|---:|---:|---:|")
    for r in results:
        print(f"| {r['rows']:,} | {r['text_us_per_row']} | {r['direct_us_per_row']} | "
              f"{r['text_us_per_row'] / r['direct_us_per_row']:.1f}x | {r['ids_us_per_row']} |")


if __name__ == "__main__":
    main()
