#!/usr/bin/env python3
"""Loader throughput: batches/s read from the binary shards, no training.

    .venv/bin/python benchmarks/loader.py [--data DIR] [--batch-size 2048] [--batches 300]

Without --data it uses (and if needed creates) the throughput benchmark's dataset
(26 one-hot features, 100,000-row tables). Reports shuffled and sequential reading,
with and without the prefetch thread, after one warm-up pass (page cache warm).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data", help="preprocessed dataset (default: the throughput benchmark's)")
    p.add_argument("--batch-size", type=int, default=2048)
    p.add_argument("--batches", type=int, default=300)
    args = p.parse_args(argv)
    from hybridrec.data.loader import ShardedLoader
    from hybridrec.data.schema import DatasetMeta

    data = args.data
    if data is None:
        sys.path.insert(0, str(ROOT / "benchmarks"))
        import throughput

        data = throughput.prepare_data(throughput.parse_args([]))
    meta = DatasetMeta.load(data)
    results = {}
    for shuffle in (True, False):
        for prefetch in (0, 2):
            loader = ShardedLoader(meta, split="train", batch_size=args.batch_size, shuffle=shuffle,
                                   prefetch=prefetch)
            n = min(args.batches, len(loader))
            for _ in zip(range(n), loader):  # warm the page cache
                pass
            start = time.perf_counter()
            for _ in zip(range(n), loader):
                pass
            rate = n / (time.perf_counter() - start)
            results[f"shuffle={shuffle} prefetch={prefetch}"] = rate
            print(f"shuffle={shuffle!s:5} prefetch={prefetch}: {rate:,.0f} batches/s "
                  f"({rate * args.batch_size:,.0f} samples/s)")
    print(json.dumps({"data": str(data), "batch_size": args.batch_size, "batches_per_sec": results}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
