#!/usr/bin/env python3
"""The input pipeline alone: samples/s the loader delivers, and where its time goes.

    .venv/bin/python benchmarks/input_pipeline.py                       # both datasets, 2 batch sizes
    .venv/bin/python benchmarks/input_pipeline.py --workers 1,2 --reps 3 --batches 12
    .venv/bin/python benchmarks/input_pipeline.py --data one-hot --batch-size 65536
    git show HEAD~1:src/hybridrec/data/loader.py > /tmp/old_loader.py
    .venv/bin/python benchmarks/input_pipeline.py --baseline /tmp/old_loader.py   # before/after

Data (made once, cached under ``--cache``, default ``$TMPDIR/hybridrec-input-pipeline``):
``hybridrec data synth`` days preprocessed as ``hybridrec data preprocess`` does, 100,000-row
tables as the benchmark DLRM's:

- ``one-hot``: 3 days x 1,000,000 rows (2,000,000 training rows in two parts), 26 one-hot
  features: what ``hybridrec train --recipe bench`` reads.
- ``multi-hot``: 3 days x 200,000 rows (400,000 training rows), C1..C4 multi-hot (bags of
  about 4 ids), the other 22 one-hot.

What is timed (after one untimed pass over the same batches, so the page cache is warm):

- ``loader``: ``ShardedLoader`` as training iterates it (shuffled, windowed as the default
  ``data.shuffle_window``), for each ``--workers`` count; ``pin`` adds ``pin_memory=True``
  when CUDA exists, and ``copy`` the copy to the GPU that ``train/loop/pipeline.py: to_device``
  queues (with a synchronize per batch, so the copy is counted).
- The breakdown of one batch on one thread, phase by phase, as ``ShardedLoader.batch`` does
  them, in CPU time of the thread: the rows of the step, the gather of the rows' dense
  features, labels, one-hot ids and bags from the memory-mapped shards, the KeyedJagged
  assembly (the ids key-major in int64, the lengths), the window permutation's share (one
  is drawn per ``data.shuffle_window`` rows), and with CUDA pinning and the copy to the GPU
  (wall time).

Each figure is the median of ``--reps`` repetitions. The machine this runs on may be shared:
the JSON line at the end has every repetition.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path

DATASETS = {
    # name: (days, rows per day, multi-hot ids per bag, multi-hot fields)
    "one-hot": (3, 1_000_000, 0, None),
    "multi-hot": (3, 200_000, 4, ("C1", "C2", "C3", "C4")),
}
TABLE_ROWS = 100_000


def prepare(cache: Path, name: str) -> Path:
    """The preprocessed dataset ``name``, made once under ``cache``."""
    from hybridrec.data.preprocess import preprocess_criteo
    from hybridrec.data.synth import generate

    days, rows, multi_hot, fields = DATASETS[name]
    data = cache / f"{name}-{days}x{rows}"
    if (data / "meta.json").is_file():
        return data
    raw = cache / f"raw-{name}"
    extra = {"multi_hot_fields": fields} if fields else {}
    generate(raw, days=days, rows_per_day=rows, seed=0, multi_hot=multi_hot, scale=1.0,
             overwrite=True, **extra)
    preprocess_criteo(sorted(raw.glob("day_*")), data, table_size=TABLE_ROWS,
                      multi_hot_fields=fields or (), overwrite=True)
    for f in raw.iterdir():  # the TSV days are not needed once preprocessed
        f.unlink()
    raw.rmdir()
    return data


def timed(fn, reps: int) -> tuple[float, list[float], float]:
    """Median wall seconds of ``fn()`` over ``reps`` calls, every call's, and the median CPU
    seconds of the process (all its threads) per call: on a shared machine the CPU time
    says what the work costs when the wall clock also counts waiting for a core."""
    runs, cpu = [], []
    for _ in range(reps):
        start, c0 = time.perf_counter(), time.process_time()
        fn()
        runs.append(time.perf_counter() - start)
        cpu.append(time.process_time() - c0)
    return statistics.median(runs), runs, statistics.median(cpu)


def loader_rate(meta, batch: int, batches: int, reps: int, *, workers: int, pin: bool,
                copy: bool) -> dict:
    """Batches/s of a shuffled training loader over its first ``batches`` batches."""
    import torch

    from hybridrec.data.loader import ShardedLoader
    from hybridrec.train.loop.pipeline import to_device

    device = torch.device("cuda") if copy else None

    def one_pass():
        loader = ShardedLoader(meta, "train", batch_size=batch, seed=0, workers=workers,
                               prefetch=max(2, workers), pin_memory=pin)
        for _, b in zip(range(batches), loader):
            if device is not None:
                to_device(b, device)
                torch.cuda.synchronize()

    one_pass()  # page cache warm, allocator warm
    sec, runs, cpu = timed(one_pass, reps)
    return {"batches_per_s": batches / sec, "samples_per_s": batches * batch / sec,
            "cpu_ms_per_batch": cpu / batches * 1e3, "runs_s": [round(r, 4) for r in runs]}


def breakdown(meta, batch: int, batches: int, reps: int) -> dict:
    """CPU milliseconds per batch (this thread's: the machine may be shared) of each phase of
    ``ShardedLoader.batch`` on one thread; with CUDA, pinning and the copy in wall time."""
    import numpy as np
    import torch

    from hybridrec.data.loader import ShardedLoader
    from hybridrec.threads import single_threaded

    single_threaded()  # as the loader's threads run (hybridrec.threads)
    loader = ShardedLoader(meta, "train", batch_size=batch, seed=0, prefetch=0)
    steps = range(min(batches, len(loader)))
    cuda = torch.cuda.is_available()
    clock = time.thread_time
    phases: dict[str, list[float]] = {}
    order = loader._order(0)
    for step in steps:  # warm: pages mapped, the windows' permutations drawn
        loader.batch(loader.rows(step, order=order))
    for _ in range(reps):
        totals: dict[str, float] = {}
        for step in steps:
            t0 = clock()
            rows = loader.rows(step, order=order)
            t1 = clock()
            cols = loader.gather(rows)
            t2 = clock()
            b = loader.assemble(cols)
            t3 = clock()
            parts = {"rows of the step": t1 - t0, "gather (shards, shuffled rows)": t2 - t1,
                     "KeyedJagged assembly": t3 - t2}
            if cuda:
                w0 = time.perf_counter()
                pinned = b.pin_memory()
                w1 = time.perf_counter()
                pinned.to("cuda", non_blocking=True)
                torch.cuda.synchronize()
                w2 = time.perf_counter()
                parts.update({"pin_memory (wall)": w1 - w0, "copy to GPU (wall)": w2 - w1})
            for k, v in parts.items():
                totals[k] = totals.get(k, 0.0) + v
        for k, v in totals.items():
            phases.setdefault(k, []).append(v / len(steps))
        # The window permutation: drawn once per window of rows, its share of a batch.
        window = min(loader.shuffle_window, loader.num_rows)
        t0 = clock()
        np.random.default_rng([0, 0, 1, 0]).permutation(window)
        phases.setdefault("window permutation (share)", []).append((clock() - t0) * batch / window)
    return {k: round(statistics.median(v) * 1e3, 3) for k, v in phases.items()}


def against_baseline(meta, batch: int, batches: int, reps: int, path: str, shuffle: bool) -> dict:
    """CPU ms per batch on one thread of ``ShardedLoader.batch`` from another copy of
    ``data/loader.py`` (e.g. ``git show HEAD~1:src/hybridrec/data/loader.py``) and of this
    tree's, the same rows, interleaved rep by rep (median of ``reps`` after one warm rep)."""
    import importlib.util

    from hybridrec.data.loader import ShardedLoader
    from hybridrec.threads import single_threaded

    single_threaded()
    spec = importlib.util.spec_from_file_location("baseline_loader", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    loaders = {"baseline": module.ShardedLoader(meta, "train", batch_size=batch, seed=0, prefetch=0, shuffle=shuffle),
               "this tree": ShardedLoader(meta, "train", batch_size=batch, seed=0, prefetch=0, shuffle=shuffle)}
    order = loaders["this tree"]._order(0)
    rows = [loaders["this tree"].rows(step, order=order) for step in range(batches)]
    runs: dict[str, list[float]] = {k: [] for k in loaders}
    for _ in range(reps + 1):
        for name, loader in loaders.items():
            t0 = time.thread_time()
            for r in rows:
                loader.batch(r)
            runs[name].append((time.thread_time() - t0) / len(rows) * 1e3)
    return {name: round(statistics.median(v[1:]), 2) for name, v in runs.items()}


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--cache", default=os.path.join(tempfile.gettempdir(), "hybridrec-input-pipeline"),
                   help="where the datasets are made once and kept")
    p.add_argument("--data", default="one-hot,multi-hot", help="datasets, comma-separated")
    p.add_argument("--batch-size", default="65536,2048", help="batch sizes, comma-separated")
    p.add_argument("--batches", type=int, default=12, help="batches per timed pass (at batch 65,536; "
                   "32x as many at 2,048, the same rows)")
    p.add_argument("--reps", type=int, default=3, help="timed passes; the median is reported")
    p.add_argument("--workers", default="1,2", help="loader worker threads to time, comma-separated")
    p.add_argument("--no-breakdown", action="store_true", help="only the loader's rate")
    p.add_argument("--baseline", metavar="LOADER_PY", help="also time ShardedLoader.batch from this copy "
                   "of data/loader.py against this tree's, shuffled and not (CPU ms per batch, one thread)")
    args = p.parse_args(argv)

    import torch

    from hybridrec.data.schema import DatasetMeta

    cache = Path(args.cache)
    cache.mkdir(parents=True, exist_ok=True)
    cuda = torch.cuda.is_available()
    out = {"cpu": cpu_model(), "cores": len(os.sched_getaffinity(0)), "cuda": cuda,
           "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "results": []}
    print(f"# {out['cpu']}, {out['cores']} cores, CUDA {cuda}, {out['date']}")
    for name in args.data.split(","):
        meta = DatasetMeta.load(prepare(cache, name))
        for batch in (int(b) for b in args.batch_size.split(",")):
            n = max(1, args.batches * 65536 // batch)
            n = min(n, meta.split_rows("train") // batch)
            for w in (int(x) for x in args.workers.split(",")):
                variants = [("loader", False, False)]
                if cuda:
                    variants += [("loader+pin", True, False), ("loader+pin+copy", True, True)]
                for label, pin, copy in variants:
                    r = loader_rate(meta, batch, n, args.reps, workers=w, pin=pin, copy=copy)
                    r.update({"data": name, "batch": batch, "workers": w, "what": label})
                    out["results"].append(r)
                    print(f"{name:9} batch {batch:6} {label:16} workers {w}: "
                          f"{r['batches_per_s']:8.1f} batches/s {r['samples_per_s'] / 1e6:7.2f} M samples/s "
                          f"(CPU {r['cpu_ms_per_batch']:.2f} ms/batch)")
            if args.baseline:
                for shuffle in (True, False):
                    ms = against_baseline(meta, batch, n, args.reps, args.baseline, shuffle)
                    out["results"].append({"data": name, "batch": batch, "shuffle": shuffle,
                                           "what": "baseline_cpu_ms", **ms})
                    print(f"{name:9} batch {batch:6} shuffle {shuffle!s:5} CPU ms per batch, one thread: "
                          + ", ".join(f"{k} {v:.2f}" for k, v in ms.items()))
            if not args.no_breakdown:
                ms = breakdown(meta, batch, min(n, 8), args.reps)
                out["results"].append({"data": name, "batch": batch, "what": "breakdown_ms", **ms})
                print(f"{name:9} batch {batch:6} CPU ms per batch, one thread: "
                      + ", ".join(f"{k} {v:.2f}" for k, v in ms.items()))
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
