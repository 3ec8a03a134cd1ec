#!/usr/bin/env python3
"""One GPU: hybridrec's training step against a plain PyTorch DLRM, and the physical bound.

    python3 benchmarks/gpu.py                                  # CUDA: d64 and MLPerf-sized, fp32 and bf16
    python3 benchmarks/gpu.py --models d64 --batch-size 65536 --rounds 3
    python3 benchmarks/gpu.py --device cpu --batch-size 256 --steps 2 --warmup 1 --rounds 1 \\
        --rows 1000 --mlperf-rows 1000                          # a smoke run on any machine

Models (both SGD, lr 0.01, one-hot ids):

- ``d64``: the benchmark DLRM of benchmarks/throughput.py: 26 tables x 100,000 rows x dim 64,
  bottom MLP 13-512-256-64, top 415-512-256-1 (dot interaction).
- ``mlperf``: MLPerf's DLRM shapes: dim 128, bottom 13-512-256-128, top 479-1024-1024-512-256-1,
  26 tables x ``--mlperf-rows`` rows (1,000,000 by default; MLPerf's Terabyte tables hold up to
  40 million rows, ~100 GB in fp32: more than one H100 holds with a second model beside it).

Data: batches of ids drawn on the device from a Zipf law of exponent 1 (``rank = floor((rows +
1)^u) - 1``, u uniform, then a fixed random permutation of each table's rows, so hot rows are
scattered), and dense features from a log-normal law; a pool of ``--pool`` batches is cycled, so
the loader is not in the measurement (benchmarks/loader.py measures the loader).

Runs, each in fp32 and in bf16 (``--precisions``):

- ``hybridrec``: the library's DLRM (fused tables, row-sparse SGD, kernels chosen at start-up
  as a run chooses them) stepped by ``hybridrec.train.loop.step.training_step``, the function
  ``hybridrec train`` runs each step (the learning-rate schedule, the loader and the metric
  log are left out). bf16: ``train.precision=bf16`` (fp32 tables and master weights).
- ``plain``: the DLRM reference's structure in plain PyTorch: one ``nn.EmbeddingBag(mode="sum",
  sparse=True)`` per table, ``nn.Sequential`` MLPs, the dot interaction as ``bmm`` and
  lower-triangle indices, and one ``torch.optim.SGD`` over every parameter (sparse gradients for
  the tables, as the reference trains). bf16: ``torch.autocast`` around the forward.
- ``plain-split`` (``--split``): the same model with the dense parameters under a fused
  ``torch.optim.SGD`` and the tables under a second ``torch.optim.SGD`` for their sparse
  gradients: the fastest plain-PyTorch arrangement we know of.

Rounds alternate the runs. Each run also reports where its step's GPU time goes (torch.profiler
over a few steps: each kernel is charged to the innermost named range its launch fell in) and
the physical bound: the HBM bytes of the embedding reads and updates (lookup read, update read
and write of every row touched: 3 x dim x 4 bytes per id in fp32) at the device-to-device copy
bandwidth measured here, plus the MLP and interaction FLOPs (forward and backward) at the bf16
matrix rate measured here, one after the other.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import statistics
import sys
import time
from collections import defaultdict
from itertools import pairwise
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.profiler import record_function

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))  # (runs from a checkout without an install too)

NUM_DENSE, NUM_TABLES = 13, 26
MODELS = {
    "d64": {"dim": 64, "bottom": [512, 256, 64], "top": [512, 256, 1]},
    "mlperf": {"dim": 128, "bottom": [512, 256, 128], "top": [1024, 1024, 512, 256, 1]},
}
PHASES = ("embeddings", "bottom_mlp", "interaction", "top_mlp", "forward", "backward", "grad_sync",
          "dense_update", "sparse_update", "optimizer")
"""Named ranges of a step (hybridrec's training_step and model, and the plain step below)."""


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda", help="cuda (default) or cpu (a smoke run)")
    p.add_argument("--models", default="d64,mlperf", help="comma-separated: d64, mlperf")
    p.add_argument("--precisions", default="fp32,bf16", help="comma-separated: fp32, bf16")
    p.add_argument("--batch-size", type=int, default=65536)
    p.add_argument("--rows", type=int, default=100_000, help="rows per table of d64")
    p.add_argument("--mlperf-rows", type=int, default=1_000_000, help="rows per table of mlperf")
    p.add_argument("--steps", type=int, default=30, help="timed steps per round")
    p.add_argument("--warmup", type=int, default=5, help="untimed steps before the first round")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--pool", type=int, default=4, help="distinct batches cycled")
    p.add_argument("--profile-steps", type=int, default=3, help="steps profiled per run (0: none)")
    p.add_argument("--micro", action=argparse.BooleanOptionalAction, default=True,
                   help="also time the d64 embedding kernels alone")
    p.add_argument("--split", action=argparse.BooleanOptionalAction, default=True,
                   help="also run plain-split")
    p.add_argument("--variant", action="append", default=[], metavar="NAME=KEY=VALUE,...",
                   help="another hybridrec configuration, e.g. bf16tables=model.embedding_dtype=bf16")
    p.add_argument("--out", default=str(ROOT / "benchmarks/out/gpu"), help="where results go")
    return p.parse_args(argv)


# -- data -------------------------------------------------------------------------

def make_batches(n: int, batch: int, rows: int, device: torch.device, seed: int = 0):
    """``n`` batches: ``(dense [B, 13], ids [26, B] int64 per table, labels [B])`` on ``device``."""
    g = torch.Generator(device=device).manual_seed(seed)
    perms = [torch.randperm(rows, generator=g, device=device) for _ in range(NUM_TABLES)]
    out = []
    for _ in range(n):
        u = torch.rand(NUM_TABLES, batch, generator=g, device=device, dtype=torch.float64)
        rank = (torch.exp(u * math.log(rows + 1)).floor().long() - 1).clamp_(0, rows - 1)
        ids = torch.stack([perms[t][rank[t]] for t in range(NUM_TABLES)])
        dense = torch.log1p(torch.exp(torch.randn(batch, NUM_DENSE, generator=g, device=device) * 2))
        labels = (torch.rand(batch, generator=g, device=device) < 0.25).float()
        out.append((dense, ids, labels))
    return out


def hybridrec_batches(raw):
    from hybridrec.sparse.keyed_jagged import Batch, KeyedJagged

    keys = [f"C{t + 1}" for t in range(NUM_TABLES)]
    out = []
    for dense, ids, labels in raw:
        kjt = KeyedJagged(keys, ids.reshape(-1), torch.ones(ids.numel(), dtype=torch.int32, device=ids.device))
        kjt.length_per_key(), kjt.one_id_per_bag()  # (facts a loader's batch brings from the host)
        out.append(Batch(dense, kjt, labels))
    return out


# -- the two models ---------------------------------------------------------------

def build_hybridrec(spec: dict, rows: int, batch: int, precision: str, device: torch.device, overrides=()):
    """``(step(batch), kernel choices)`` of hybridrec's DLRM, built from the library's parts."""
    from hybridrec.model.dlrm import DLRM
    from hybridrec.model.embedding import WEIGHT_DTYPES, EmbeddingBagCollection, TableConfig
    from hybridrec.model.kernels import PRECISIONS
    from hybridrec.parallel.dense_sync import NoSync
    from hybridrec.parallel.topology import Topology
    from hybridrec.train.backends import build_sparse_optimizers
    from hybridrec.train.build import tune_kernels
    from hybridrec.train.loop.optim import build_dense_optimizer, dense_parameters
    from hybridrec.train.loop.step import training_step
    from hybridrec.train.setup import recipes
    from hybridrec.train.setup.configure import build_config

    cfg = build_config(recipes.recipe("bench"), overrides=[
        f"model.embedding_dim={spec['dim']}", "model.bottom_mlp=" + ",".join(map(str, spec["bottom"])),
        "model.top_mlp=" + ",".join(map(str, spec["top"])), f"data.batch_size={batch}",
        f"train.precision={precision}", *overrides])
    tables = [TableConfig(name=f"C{t + 1}", num_embeddings=rows, embedding_dim=spec["dim"])
              for t in range(NUM_TABLES)]
    bound = 1 / math.sqrt(rows)

    def init(table, weight):  # (drawn on the device: seconds for GBs of tables)
        weight.uniform_(-bound, bound)

    weight = WEIGHT_DTYPES[cfg.model.embedding_dtype]
    out = weight if PRECISIONS[precision] == weight else torch.float32
    torch.manual_seed(0)
    ebc = EmbeddingBagCollection(tables, device=device, init=init, weight_dtype=weight, output_dtype=out)
    model = DLRM(num_dense=NUM_DENSE, sparse=ebc, bottom_mlp=cfg.model.bottom_mlp, top_mlp=cfg.model.top_mlp,
                 precision=precision).to(device)
    dense_opt = build_dense_optimizer(dense_parameters(model), cfg.optim)
    sparse_opt = build_sparse_optimizers(cfg, model.sparse)
    kernels = tune_kernels(cfg, model, Topology.single(device), sparse_opt)
    sync = NoSync()

    def step(b):
        return training_step(model, b, dense_opt=dense_opt, sparse_opt=sparse_opt, dense_sync=sync)

    return step, kernels


class PlainDLRM(nn.Module):
    """The DLRM reference's model in plain PyTorch (its ``dlrm_s_pytorch.py`` structure)."""

    def __init__(self, spec: dict, rows: int, device: torch.device) -> None:
        super().__init__()
        d = spec["dim"]
        self.emb = nn.ModuleList(nn.EmbeddingBag(rows, d, mode="sum", sparse=True, device=device)
                                 for _ in range(NUM_TABLES))
        bound = 1 / math.sqrt(rows)
        for e in self.emb:
            nn.init.uniform_(e.weight, -bound, bound)

        def mlp(sizes, last_relu):
            layers = []
            for i, (a, b) in enumerate(pairwise(sizes)):
                layers.append(nn.Linear(a, b, device=device))
                if i < len(sizes) - 2 or last_relu:
                    layers.append(nn.ReLU())
            return nn.Sequential(*layers)

        n = NUM_TABLES + 1
        self.bot = mlp([NUM_DENSE, *spec["bottom"]], True)
        self.top = mlp([d + n * (n - 1) // 2, *spec["top"]], False)
        li, lj = torch.tril_indices(n, n, offset=-1, device=device)
        self.register_buffer("li", li)
        self.register_buffer("lj", lj)
        self.register_buffer("offsets", torch.empty(0, dtype=torch.int64, device=device))

    def forward(self, dense, ids):
        b = dense.shape[0]
        if self.offsets.numel() != b:
            self.offsets = torch.arange(b, device=dense.device)
        with record_function("bottom_mlp"):
            x = self.bot(dense)
        with record_function("embeddings"):
            ly = [e(ids[t], self.offsets) for t, e in enumerate(self.emb)]
        with record_function("interaction"):
            t = torch.cat([x] + ly, dim=1).view(b, -1, x.shape[1])
            z = torch.bmm(t, t.transpose(1, 2))
            r = torch.cat([x, z[:, self.li, self.lj]], dim=1)
        with record_function("top_mlp"):
            return self.top(r).squeeze(1)


def build_plain(spec: dict, rows: int, precision: str, device: torch.device, split: bool):
    model = PlainDLRM(spec, rows, device)
    lr = 0.01
    if split:
        dense = [p for n, p in model.named_parameters() if not n.startswith("emb.")]
        opts = [("dense_update", torch.optim.SGD(dense, lr=lr, **({"fused": True} if device.type == "cuda" else {}))),
                ("sparse_update", torch.optim.SGD(model.emb.parameters(), lr=lr))]
    else:
        opts = [("optimizer", torch.optim.SGD(model.parameters(), lr=lr))]
    bf16 = precision == "bf16"

    def step(item):
        dense, ids, labels = item
        with record_function("forward"):
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
                logits = model(dense, ids)
            loss = F.binary_cross_entropy_with_logits(logits.float(), labels)
        for _, o in opts:
            o.zero_grad(set_to_none=True)
        with record_function("backward"):
            loss.backward()
        for name, o in opts:
            with record_function(name):
                o.step()
        return loss.detach()

    return step


# -- measuring ----------------------------------------------------------------------

def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(step, batches, steps: int, device: torch.device) -> float:
    """Samples per second over ``steps`` steps (the batches cycled)."""
    sync(device)
    start = time.perf_counter()
    for i in range(steps):
        step(batches[i % len(batches)])
    sync(device)
    secs = time.perf_counter() - start
    return steps * batch_size(batches[0]) / secs


def batch_size(b) -> int:
    return b.labels.numel() if hasattr(b, "labels") else b[2].numel()


def _self_device_us(e) -> float:
    for name in ("self_device_time_total", "self_cuda_time_total"):
        v = getattr(e, name, None)
        if v is not None:
            return float(v)
    return 0.0


def phase_profile(step, batches, steps: int, device: torch.device) -> tuple[dict, str]:
    """``({phase: device ms per step}, the profiler's kernel table)``: every kernel is
    charged to the innermost range of :data:`PHASES` that was open when it was launched
    (by time: the backward's kernels are launched from autograd's own thread; Triton's
    kernels, which no operator launches, by :func:`_unowned_kernels`). On the CPU, each
    operator's own CPU time instead."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    sync(device)
    with profile(activities=acts) as prof:
        for i in range(steps):
            step(batches[i % len(batches)])
        sync(device)
    events = [e for e in prof.events() if getattr(e.device_type, "name", "CPU") == "CPU"]
    ranges = sorted(((e.time_range.start, e.time_range.end, e.name) for e in events if e.name in PHASES),
                    key=lambda r: r[1] - r[0])  # innermost (shortest) first
    per = defaultdict(float)
    for e in events:
        us = _self_device_us(e) if device.type == "cuda" else float(e.self_cpu_time_total)
        if e.name in PHASES or us <= 0:
            continue
        t = e.time_range.start
        name = next((r[2] for r in ranges if r[0] <= t <= r[1]), "other")
        per[name] += us
    if device.type == "cuda":  # kernels no operator launched (Triton's): by the phase whose GPU span holds them
        for phase, us in _unowned_kernels(prof, [e for e in events if getattr(e, "kernels", None)]).items():
            per[phase] += us
    ms = {k: v / 1e3 / steps for k, v in sorted(per.items(), key=lambda kv: -kv[1])}
    table = "(no table)"
    sorts = ("self_device_time_total", "self_cuda_time_total") if device.type == "cuda" else ("self_cpu_time_total",)
    for sort in sorts:  # (the key's name differs between torch versions)
        try:
            table = prof.key_averages().table(sort_by=sort, row_limit=30)
            break
        except Exception as e:  # noqa: BLE001 (a table is a diagnostic; its absence is said)
            table = f"(no table: {e})"
    return ms, table


def _unowned_kernels(prof, launchers) -> dict[str, float]:
    """``{phase: us}`` of the GPU kernels that no profiled operator owns (a Triton kernel is
    launched outside torch's operators), each charged to the innermost range of :data:`PHASES`
    whose span on the GPU's timeline holds its start. Kernels outside every such span are left
    out: in the plain runs they were ~1 ms of work that operators had already been charged
    with under other names (the phases then summed to more than the step)."""
    owned = {k.name for e in launchers for k in e.kernels}
    gpu = [e for e in prof.events() if getattr(e.device_type, "name", "CPU") == "CUDA"]
    spans = sorted(((e.time_range.start, e.time_range.end, e.name) for e in gpu if e.name in PHASES),
                   key=lambda r: r[1] - r[0])
    out = defaultdict(float)
    for e in gpu:
        if e.name in PHASES or e.name in owned:
            continue
        t = e.time_range.start
        phase = next((r[2] for r in spans if r[0] <= t <= r[1]), None)
        if phase is not None:
            out[phase] += e.time_range.elapsed_us()
    return out


def rates(device: torch.device) -> dict:
    """This device's copy bandwidth (bytes read + written per second) and bf16 matrix rate."""
    if device.type != "cuda":
        return {"copy_bytes_per_s": float("nan"), "bf16_flops_per_s": float("nan")}
    a = torch.empty(1 << 30, dtype=torch.float32, device=device)  # 4 GiB
    b = torch.empty_like(a)
    n = 8192
    x = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    y = torch.randn(n, n, device=device, dtype=torch.bfloat16)

    def best(fn, reps=10):
        fn()
        sync(device)
        ev = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
        ev[0].record()
        for _ in range(reps):
            fn()
        ev[1].record()
        sync(device)
        return ev[0].elapsed_time(ev[1]) / 1e3 / reps

    copy_s = best(lambda: b.copy_(a))
    mm_s = best(lambda: torch.mm(x, y))
    return {"copy_bytes_per_s": 2 * a.numel() * 4 / copy_s, "bf16_flops_per_s": 2 * n**3 / mm_s}


def work_per_sample(spec: dict, weight_bytes: int = 4) -> dict:
    """The bound's bytes and FLOPs per sample (module docstring)."""
    d, n = spec["dim"], NUM_TABLES + 1
    bottom = [NUM_DENSE, *spec["bottom"]]
    top = [d + n * (n - 1) // 2, *spec["top"]]
    mac_b = sum(a * b for a, b in pairwise(bottom))
    mac_t = sum(a * b for a, b in pairwise(top))
    # forward 2 MAC; backward: dW 2 MAC each layer, dX 2 MAC except the bottom's first layer
    flops = 2 * (mac_b + mac_t) + 2 * (mac_b + mac_t) + 2 * (mac_b - bottom[0] * bottom[1] + mac_t)
    flops += 2 * 2 * n * n * d  # the interaction's Gram matrix, forward and backward
    return {"embedding_bytes": NUM_TABLES * d * weight_bytes * 3, "flops": flops}


def bound_per_sample_s(work: dict, r: dict) -> float:
    return work["embedding_bytes"] / r["copy_bytes_per_s"] + work["flops"] / r["bf16_flops_per_s"]


# -- the embedding kernels alone --------------------------------------------------------

def best_seconds(fn, device: torch.device, reps: int = 5) -> float:
    """The fastest of ``reps`` calls of ``fn`` after one untimed call."""
    fn()
    best = float("inf")
    for _ in range(reps):
        sync(device)
        t = time.perf_counter()
        fn()
        sync(device)
        best = min(best, time.perf_counter() - t)
    return best


def micro_kernels(args, device: torch.device) -> list[dict]:
    """The d64 model's embedding work at the benchmark batch, each candidate alone: the lookup
    (one id per bag) and the SGD row update, with Zipf and with uniform ids; bytes are the
    least each must move (lookup: read and write every row; update: read the delta, read and
    write every touched row)."""
    from hybridrec.model.embedding import lookup_impls, lookup_rows
    from hybridrec.model.id_groups import aggregate_rows
    from hybridrec.model.kernels import rows_add_

    d, rows = MODELS["d64"]["dim"], args.rows
    n = args.batch_size * NUM_TABLES
    w = torch.empty(rows * NUM_TABLES, d, device=device).uniform_(-0.01, 0.01)
    delta = torch.randn(n, d, device=device) * 1e-3
    offsets = torch.arange(n + 1, device=device)
    row_bytes = n * d * 4

    def candidates(ids: torch.Tensor) -> dict:
        """The kernels timed on ``ids``, with the bytes each moves (a function, so that every
        closure holds its own law's ids, not the loop's latest)."""
        return {
            "lookup embedding_bag": (lambda: F.embedding_bag(ids, w, offsets, mode="sum", include_last_offset=True),
                                     2 * row_bytes),
            "lookup index_select": (lambda: w.index_select(0, ids), 2 * row_bytes),
            "lookup triton": (lambda: lookup_rows(w, ids, "triton"), 2 * row_bytes),
            "update scatter_add_": (lambda: w.scatter_add_(0, ids.unsqueeze(1).expand(-1, d), delta), 3 * row_bytes),
            "update index_add_": (lambda: w.index_add_(0, ids, delta), 3 * row_bytes),
            "update mul_ + index_add_": (lambda: w.index_add_(0, ids, delta.mul(-0.01)), 3 * row_bytes),
            "update index_add_ alpha": (lambda: w.index_add_(0, ids, delta, alpha=-0.01), 3 * row_bytes),
            "update triton (scale fused)": (lambda: rows_add_(w, ids, delta, "triton", alpha=-0.01), 3 * row_bytes),
            "update sort + sum + index_add_": (lambda: w.index_add_(0, *aggregate_rows(ids, delta, bound=w.shape[0])),
                                               3 * row_bytes),
            "copy (reference)": (lambda: delta.clone(), 2 * row_bytes),
        }

    out = []
    for law in ("zipf", "uniform"):
        if law == "zipf":
            ids = make_batches(1, args.batch_size, rows, device)[0][1]
        else:
            ids = torch.randint(0, rows, (NUM_TABLES, args.batch_size), device=device)
        ids = (ids + torch.arange(NUM_TABLES, device=device).unsqueeze(1) * rows).t().reshape(-1)
        cands = candidates(ids)
        if "triton" not in lookup_impls(device):
            del cands["lookup triton"], cands["update triton (scale fused)"]
        for name, (fn, nbytes) in cands.items():
            secs = best_seconds(fn, device)
            out.append({"ids": law, "kernel": name, "ms": secs * 1e3, "bytes_per_s": nbytes / secs})
            print(f"micro {law} {name}: {secs * 1e3:.3f} ms, {nbytes / secs / 1e9:,.0f} GB/s", file=sys.stderr, flush=True)
    return out


# -- the benchmark ----------------------------------------------------------------------

def run_model(name: str, args, device: torch.device, r: dict) -> dict:
    spec = MODELS[name]
    rows = args.rows if name == "d64" else args.mlperf_rows
    raw = make_batches(args.pool, args.batch_size, rows, device)
    hb = hybridrec_batches(raw)
    work = work_per_sample(spec)
    results = {}
    for precision in args.precisions.split(","):
        runs = {}
        kernels = {}
        step, kernels["hybridrec"] = build_hybridrec(spec, rows, args.batch_size, precision, device)
        runs["hybridrec"] = (step, hb)
        for v in args.variant:
            vname, _, rest = v.partition("=")
            step, kernels[vname] = build_hybridrec(spec, rows, args.batch_size, precision, device,
                                                   [kv for kv in rest.split(",") if kv])
            runs[vname] = (step, hb)
        runs["plain"] = (build_plain(spec, rows, precision, device, split=False), raw)
        if args.split:
            runs["plain-split"] = (build_plain(spec, rows, precision, device, split=True), raw)
        for step, batches in runs.values():
            for i in range(args.warmup):
                step(batches[i % len(batches)])
        sps = {k: [] for k in runs}
        for rnd in range(args.rounds):
            for k, (step, batches) in runs.items():
                sps[k].append(timed(step, batches, args.steps, device))
            print(f"{name} {precision} round {rnd + 1}/{args.rounds}: "
                  + ", ".join(f"{k} {v[-1]:,.0f}" for k, v in sps.items()), file=sys.stderr, flush=True)
        for k, (step, batches) in runs.items():
            med = statistics.median(sps[k])
            entry = {"median_samples_per_sec": med, "runs": sps[k], "step_ms": 1e3 * args.batch_size / med}
            if k in kernels:
                entry["kernels"] = {c["shape"]: c["impl"] for part in ("linear", "interaction", "embedding_update", "embedding_lookup")
                                    for c in kernels[k].get(part, []) if c.get("shape")}
            if args.profile_steps:
                entry["phases_ms"], table = phase_profile(step, batches, args.profile_steps, device)
                with open(Path(args.out) / "kernels.txt", "a") as f:  # (one file: every run's table)
                    f.write(f"\n## {name} {precision} {k} ({args.profile_steps} steps)\n{table}\n")
            results.setdefault(precision, {})[k] = entry
        plain_best = max(results[precision][k]["median_samples_per_sec"] for k in runs if k.startswith("plain"))
        for k, e in results[precision].items():
            e["vs_plain_best"] = e["median_samples_per_sec"] / plain_best
        del runs, step, batches
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    bound_s = bound_per_sample_s(work, r) if device.type == "cuda" else float("nan")
    return {"rows": rows, "spec": spec, "work_per_sample": work, "bound_samples_per_sec": 1 / bound_s,
            "bound_step_ms": 1e3 * bound_s * args.batch_size, "results": results}


def main(argv=None) -> int:
    args = parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("no CUDA device here: pass --device cpu for a smoke run", file=sys.stderr)
        return 2
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "kernels.txt").unlink(missing_ok=True)
    r = rates(device)
    if args.micro:
        report_micro = micro_kernels(args, device)
    if device.type == "cuda":
        torch.cuda.empty_cache()  # (the measurements' tensors)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    report = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "device": name,
              "torch": torch.__version__, "rates": r, "batch_size": args.batch_size,
              "settings": {k: getattr(args, k) for k in ("steps", "warmup", "rounds", "pool", "profile_steps")},
              "models": {}}
    if args.micro:
        report["micro"] = report_micro
    for m in args.models.split(","):
        report["models"][m] = run_model(m, args, device, r)
    out = Path(args.out) / "gpu.json"
    out.write_text(json.dumps(report, indent=2))
    text = format_report(report)
    (Path(args.out) / "gpu.md").write_text(text + "\n")
    print(text)
    print(f"\nwritten: {out}")
    return 0


def format_report(rep: dict) -> str:
    r = rep["rates"]
    lines = [f"device: {rep['device']}   torch {rep['torch']}   date: {rep['date']}   batch {rep['batch_size']:,}",
             (f"measured here: copy {r['copy_bytes_per_s'] / 1e12:.2f} TB/s (read + write), "
              f"bf16 matmul {r['bf16_flops_per_s'] / 1e12:.0f} TFLOP/s"), ""]
    for m, v in rep["models"].items():
        w = v["work_per_sample"]
        lines += [(f"### {m} ({v['rows']:,} rows per table; bound: {w['embedding_bytes']:,} embedding bytes and "
                   f"{w['flops'] / 1e6:.2f} MFLOP per sample -> {v['bound_samples_per_sec']:,.0f} samples/s, "
                   f"{v['bound_step_ms']:.3f} ms per step)"), "",
                  ("| precision | run | samples/s (median) | runs | ms/step | vs best plain | bound / achieved |"
                   " GPU ms per step by phase |"),
                  "|---|---|---|---|---|---|---|---|"]
        for precision, runs in v["results"].items():
            for k, e in runs.items():
                phases = ", ".join(f"{p} {t:.2f}" for p, t in e.get("phases_ms", {}).items())
                ratio = v["bound_samples_per_sec"] / e["median_samples_per_sec"]
                lines.append(f"| {precision} | {k} | {e['median_samples_per_sec']:,.0f} | "
                             f"{', '.join(f'{x:,.0f}' for x in e['runs'])} | {e['step_ms']:.2f} | "
                             f"{e['vs_plain_best']:.2f}x | {ratio:.1f}x | {phases} |")
        lines.append("")
    if rep.get("micro"):
        lines += ["### The d64 embedding kernels alone (one id per bag)", "",
                  "| ids | kernel | ms | GB/s (least bytes) |", "|---|---|---|---|"]
        lines += [f"| {m['ids']} | {m['kernel']} | {m['ms']:.3f} | {m['bytes_per_s'] / 1e9:,.0f} |" for m in rep["micro"]]
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
