#!/usr/bin/env python3
"""The cost model's table for the MLPerf-sized DLRM on GPUs: 8 GPUs of one machine (NVLink)
and 16 machines x 8 GPUs (400 Gbit/s between machines), with and without DCT.

    .venv/bin/python benchmarks/gpu_cost_table.py            # prints the Markdown table

Pure arithmetic (:mod:`hybridrec.bench.hier_cost`, the bytes of
:mod:`hybridrec.parallel.cost_model`'s layout), calibrated on one measurement only: the
one-GPU step of this model at batch 65,536 on an H200 (benchmarks/results/gpu-2026-11-27,
fp32 24.90 ms, bf16 6.48 ms), taken as every rank's computation at that batch per GPU.
Assumptions (none measured here: NCCL has never run with more than one rank in this project):

- model: benchmarks/gpu.py's ``mlperf``: 26 tables x 1,000,000 rows x dim 128, one id per bag,
  bottom 13-512-256-128, top 479-1024-1024-512-256-1; batch 65,536 per GPU (the measured one:
  weak scaling, a global batch of 0.5M on 8 GPUs and 8.4M on 128); tables placed by
  :func:`column_plan` (whole tables on 8 GPUs, column shards on 128), float32 on the wire;
- links per direction: NVLink 4 through NVSwitch, 450 GB/s per GPU; 400 Gbit/s (50 GB/s)
  per machine to the others, shared by its 8 GPUs (one NIC per machine, as the issue states
  it; machines with a NIC per GPU have 8x that); NCCL reaching 70% of a link in an all-to-all
  and 80% in a ring all-reduce (assumed);
- no overlap (hier_cost's step: compute, input, output forward and backward, dense sync one
  after another); the "overlapped" column is the other bound, ``max(compute, communication)``;
- DCT: the pooled embeddings both ways by the ``dct`` codec at ``compress.embedding_ratio``
  0.05, the dense gradients by DCT-DP at ``compress.dense_ratio`` 0.01: every rank sends its
  sparse message (values and positions, ``sparse_message.encoded_size``) to every other rank,
  as ``CompressedAllReduce`` does (an all-gather, not a ring).
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import torch

from hybridrec.bench.hier_cost import (
    Links,
    dlrm_dense_params,
    plan_owners,
    step_phases,
    to_owners,
)
from hybridrec.comm.codecs import make_codec
from hybridrec.comm.sparse_message import encoded_size
from hybridrec.model.embedding import TableConfig
from hybridrec.parallel import plan as P

TABLES, ROWS, DIM = 26, 1_000_000, 128
BOTTOM, TOP, NUM_DENSE = [512, 256, 128], [1024, 1024, 512, 256, 1], 13
BATCH = 65_536  # per GPU
COMPUTE_S = {"fp32": 24.90e-3, "bf16": 6.48e-3}  # measured: one H200, benchmarks/results/gpu-2026-11-27
NVLINK, NIC = 450e9, 400e9 / 8
A2A_EFF, RING_EFF = 0.7, 0.8
EMB_RATIO, DENSE_RATIO = 0.05, 0.01
SETTINGS = {"8 GPUs, 1 machine (NVLink)": (1, 8, Links(intra=NVLINK, cross=NVLINK, a2a_efficiency=A2A_EFF,
                                                           allreduce_efficiency=RING_EFF)),
            "16 machines x 8 GPUs (400 Gbit/s)": (16, 8, Links(intra=NVLINK, cross=NIC, a2a_efficiency=A2A_EFF,
                                                               allreduce_efficiency=RING_EFF))}


def tables() -> list[TableConfig]:
    return [TableConfig(name=f"t{i}", num_embeddings=ROWS, embedding_dim=DIM, features=[f"f{i}"])
            for i in range(TABLES)]


def column_plan(ts: list[TableConfig], n: int) -> dict[str, P.TablePlan]:
    """Table ``i`` in ``k = max(1, round(n / 26))`` column shards on ranks ``i*k .. i*k+k-1``
    (mod n): 8 ranks: table-wise (ranks of 4 and of 3 tables); 128 ranks: 5 column shards of
    25-26 columns per table (two ranks hold two shards). The busiest rank sets a phase's time."""
    k = max(1, round(n / len(ts)))
    return {t.name: P.column_wise(t.name, ROWS, DIM, [(i * k + j) % n for j in range(k)])
            for i, t in enumerate(ts)}


def phases_s(n: int, m: int, links: Links, dct: bool) -> dict[str, float]:
    """Seconds of every communication phase of one step on ``n`` ranks in machines of ``m``."""
    ts = tables()
    plan = P.ShardingPlan(world_size=n, local_world_size=m, tables=column_plan(ts, n))
    codecs = {t.name: make_codec("dct", eta=EMB_RATIO) for t in ts} if dct else None
    owners = plan_owners(ts, plan, 1.0, codecs)
    params = dlrm_dense_params(NUM_DENSE, TABLES, DIM, BOTTOM, TOP)
    phases = step_phases(owners, BATCH, params * 4, m)
    if dct:  # DCT-DP: every rank's sparse message to every other rank
        message = encoded_size(math.ceil(DENSE_RATIO * params), params, torch.float32)
        phases["dense"] = (to_owners([0.0] * n, message, 0, m), "a2a")
    effs = {"a2a": links.a2a_efficiency, "allreduce": links.allreduce_efficiency}
    return {k: loads.time_s(links, effs[kind]) for k, (loads, kind) in phases.items()}


def rows() -> list[str]:
    out = [("| cluster | DCT | compute (measured, 1 GPU) | comm ms/step (in, out fwd, out bwd, dense) "
            "| predicted samples/s, no overlap | share in communication | samples/s, overlapped |"),
           "|---|---|---|---|---|---|---|"]
    for name, (g, m, links) in SETTINGS.items():
        n = g * m
        for dct in (False, True):
            comm = phases_s(n, m, links, dct)
            total = sum(comm.values())
            parts = ", ".join(f"{1e3 * comm[k]:.2f}" for k in ("input", "output_fwd", "output_bwd", "dense"))
            for precision, compute in COMPUTE_S.items():
                step = compute + total
                out.append(f"| {name} | {'yes' if dct else 'no'} | {precision} {1e3 * compute:.2f} ms "
                           f"| {1e3 * total:.2f} ({parts}) | {n * BATCH / step / 1e6:.1f}M "
                           f"| {total / step:.0%} | {n * BATCH / max(compute, total) / 1e6:.1f}M |")
    return out


if __name__ == "__main__":
    print("\n".join(rows()))
