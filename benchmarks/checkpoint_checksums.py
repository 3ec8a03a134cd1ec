#!/usr/bin/env python3
"""What the checkpoint checksums cost: save and load of a ~1 GB checkpoint with and without them.

    .venv/bin/python benchmarks/checkpoint_checksums.py                 # 1.03 GB, 3 rounds
    .venv/bin/python benchmarks/checkpoint_checksums.py --rows 1000000 --rounds 1

One process: a DLRM with one table of ``--rows`` x 64 float32 (4,000,000 rows: 1.02 GB)
and row-wise Adagrad, saved with :func:`~hybridrec.parallel.checkpoint.save_sharded`
(synchronous; "async": :func:`save_sharded_async`, where the checksums are computed in the
writing thread: its seconds until published, and the seconds it blocked) and loaded as a
resume loads it: :func:`~hybridrec.train.checkpointing.checkpoint.problem` (the checks before a tensor is
read, the files' contents included), then :func:`load_state`. "Without": the same with the
checksums switched off (no file read back at the save, a manifest without them, as one saved
before them, so ``problem`` reads no file's contents).
The files are in the page cache (just written): the CRC's own cost, not the disk's. Rounds
alternate with and without; the table shows each one's median (min-max).
"""

from __future__ import annotations

import argparse
import contextlib
import shutil
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
from throughput import machine  # benchmarks/ is not a package

OUT = ROOT / "benchmarks/out/checkpoint_checksums"


def build(rows: int, seed: int):
    import torch

    from hybridrec.model.dlrm import DLRM
    from hybridrec.model.embedding import EmbeddingBagCollection, TableConfig
    from hybridrec.train.loop.sparse_optim import build_sparse_optimizer

    torch.manual_seed(seed)
    model = DLRM(num_dense=3, sparse=EmbeddingBagCollection([TableConfig(name="big", num_embeddings=rows,
                                                                         embedding_dim=64)], seed=seed),
                 bottom_mlp=[64], top_mlp=[16, 1])
    return model, [build_sparse_optimizer("rowwise_adagrad", model.sparse, lr=0.1)]


@contextlib.contextmanager
def checksums(on: bool):
    """Off: no file checksummed at the save, a manifest without checksums (as one saved
    before them), so that the load reads no file to check it."""
    from hybridrec.parallel import checkpoint_io

    original = checkpoint_io.checksum_files, checkpoint_io.seal
    if not on:
        checkpoint_io.checksum_files = lambda d, names: {}
        checkpoint_io.seal = lambda meta, files: meta
    try:
        yield
    finally:
        checkpoint_io.checksum_files, checkpoint_io.seal = original


def one_round(out: Path, model, opts, target, target_opts, on: bool) -> dict[str, float]:
    import torch.distributed as dist  # noqa: F401 - (imported before timing)

    from hybridrec.parallel.checkpoint import load_state, save_sharded, save_sharded_async
    from hybridrec.parallel.topology import Topology
    from hybridrec.train.checkpointing.checkpoint import problem

    topo, path = Topology.single(), out / f"ck-{'on' if on else 'off'}"
    shutil.rmtree(path, ignore_errors=True)
    got = {}
    with checksums(on):
        t = time.perf_counter()
        save_sharded(path, model=model, dense_opt=None, sparse_opts=opts, extra={"step": 1}, topo=topo)
        got["save s"] = time.perf_counter() - t
        t = time.perf_counter()
        pending = save_sharded_async(out / "async", model=model, dense_opt=None, sparse_opts=opts,
                                     extra={"step": 1}, topo=topo, group=None)
        got["async blocking s"] = time.perf_counter() - t
        pending.wait()
        got["async until published s"] = time.perf_counter() - t
        t = time.perf_counter()
        why = problem(path)
        got["checks s"] = time.perf_counter() - t
        assert why is None, why
        load_state(path, model=target, dense_opt=None, sparse_opts=target_opts, topo=topo)
        got["load s (checks + load_state)"] = time.perf_counter() - t
    got["GB"] = sum(p.stat().st_size for p in path.iterdir()) / 1e9
    return got


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--rows", type=int, default=4_000_000)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", default=str(OUT))
    a = p.parse_args(argv)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    model, opts = build(a.rows, 0)
    target, target_opts = build(a.rows, 1)
    rows: dict[bool, list[dict]] = {True: [], False: []}
    for _ in range(a.rounds):
        for on in (False, True):
            rows[on].append(one_round(out, model, opts, target, target_opts, on))
    print(f"{machine()}; {rows[True][0]['GB']:.2f} GB checkpoint, {a.rounds} rounds, page cache warm")
    print("| | without checksums | with checksums |\n|---|---|---|")
    for key in rows[True][0]:
        if key == "GB":
            continue
        cells = []
        for on in (False, True):
            v = [r[key] for r in rows[on]]
            cells.append(f"{statistics.median(v):.2f} ({min(v):.2f}-{max(v):.2f})")
        print(f"| {key} | {' | '.join(cells)} |")
    shutil.rmtree(out, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
