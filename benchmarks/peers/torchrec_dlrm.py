#!/usr/bin/env python3
"""Peer benchmark: TorchRec's DLRM trained on CPU, samples/s and peak RSS.

Runs in the TorchRec venv made by setup_torchrec.sh, not the project's venv:

    benchmarks/peers/.venv-torchrec/bin/python benchmarks/peers/torchrec_dlrm.py \
        --steps 30 --warmup 10 [--nproc 2] [--multi-hot 10] [--out result.json]

Under torchrun (RANK and WORLD_SIZE set, e.g. one rank per network namespace in
benchmarks/cluster_throughput.py) the process is one rank of WORLD_SIZE and joins the
group through env://; rank 0 prints the result.

Model (fixed, the benchmark model of benchmarks/throughput.py): 26 tables x 100,000 rows x
dim 64 (sum pooling), bottom MLP 13-512-256-64, top MLP 512-256-1, dot
interaction, BCE loss, SGD for dense and sparse parameters (--optimizers default: Adam
dense, row-wise Adagrad embeddings), batch 2048 per rank.

How the model is wrapped (what a TorchRec user does on CPU, and what works
with fbgemm-gpu-cpu 1.8):
  * DistributedModelParallel over a gloo process group, also for one process
    (a 1-rank group). The EBC is built on the meta device and materialised by
    DMP; dense parameters are wrapped in DDP by DMP.
  * Embeddings use the FUSED compute kernel (FBGEMM's table-batched embedding
    op, CPU build) with the optimizer fused into the backward pass, set through
    EmbeddingBagCollectionSharder(fused_params={"optimizer": EXACT_SGD, ...}).
    This is the standard, fastest path: no embedding gradient is materialised.
  * Dense parameters: torch.optim.SGD wrapped in KeyedOptimizerWrapper and
    combined with DMP's fused optimizer (CombinedOptimizer), as in TorchRec's
    DLRM example.
  * On CPU the sharders only offer data_parallel, table_wise, column_wise and
    table_column_wise (row_wise / table_row_wise / grid are CUDA-only).
    --sharding table_wise (default) constrains every table to table-wise;
    --sharding auto lets the default EmbeddingShardingPlanner choose.
Data: a small fixed list of pre-built random batches (uniform ids, fixed seed,
like TorchRec's own benchmarks) cycled, or the exact batches from --batches
FILE.npz (dense float32 [N,13], ids int64 [N,26*K], labels float32 [N]; ids of
feature f are columns f*K..f*K+K-1).
"""
import argparse
import json
import logging
import os
import resource
import sys
import tempfile
import time
import warnings
from types import SimpleNamespace

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from fbgemm_gpu.split_embedding_configs import EmbOptimType
from torchrec.datasets.utils import Batch
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.distributed.planner import EmbeddingShardingPlanner, Topology
from torchrec.distributed.planner.types import ParameterConstraints
from torchrec.distributed.types import ShardingType
from torchrec.models.dlrm import DLRM, DLRMTrain
from torchrec.modules.embedding_configs import EmbeddingBagConfig, PoolingType
from torchrec.modules.embedding_modules import EmbeddingBagCollection
from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizerWrapper
from torchrec.optim.optimizers import in_backward_optimizer_filter
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

NUM_DENSE = 13
NUM_TABLES = 26
NUM_ROWS = 100_000
EMB_DIM = 64
BOTTOM_MLP = [512, 256, 64]  # torchrec: dense_arch_layer_sizes excludes the 13 inputs
TOP_MLP = [512, 256, 1]  # torchrec: over_arch_layer_sizes excludes the interaction width
KEYS = [f"cat_{i}" for i in range(NUM_TABLES)]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--nproc", type=int, default=1, help="local ranks (gloo)")
    p.add_argument("--batch-size", type=int, default=2048, help="per rank")
    p.add_argument("--multi-hot", type=int, default=1, metavar="K", help="ids per feature")
    p.add_argument("--steps", type=int, default=30, help="timed steps")
    p.add_argument("--warmup", type=int, default=10, help="untimed steps first")
    p.add_argument("--lr", type=float, default=0.01, help="learning rate of --optimizers sgd")
    p.add_argument("--optimizers", choices=["sgd", "default"], default="sgd",
                   help="sgd: SGD at --lr for both parts (hybridrec's --recipe bench); default: "
                        "hybridrec's default optimizers, Adam 0.001 for the dense part and fused "
                        "EXACT_ROWWISE_ADAGRAD 0.05 (eps 1e-8) for the embeddings")
    p.add_argument("--num-batches", type=int, default=10,
                   help="pre-built random batches per rank, cycled")
    p.add_argument("--batches", metavar="FILE.npz", help="read batches from this file")
    p.add_argument("--sharding", choices=["table_wise", "auto"], default="table_wise")
    p.add_argument("--threads", type=int, default=0,
                   help="torch intra-op threads per rank (0: cores // nproc)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", metavar="FILE", help="also write the JSON result here")
    p.add_argument("--verbose", action="store_true", help="keep TorchRec's warnings and plan")
    a = p.parse_args(argv)
    for name in ("nproc", "batch_size", "multi_hot", "steps", "num_batches"):
        if getattr(a, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if a.warmup < 0:
        p.error("--warmup must be >= 0")
    if a.batches and not os.path.isfile(a.batches):
        p.error(f"--batches: no such file: {a.batches}")
    return a


def make_batch(dense, ids, labels, k):
    """numpy arrays of one batch -> torchrec Batch with a KeyedJaggedTensor."""
    b = dense.shape[0]
    # KJT values are feature-major: all ids of feature 0 for the whole batch, then feature 1...
    values = torch.from_numpy(np.ascontiguousarray(
        ids.reshape(b, NUM_TABLES, k).transpose(1, 0, 2)).reshape(-1).astype(np.int64))
    lengths = torch.full((NUM_TABLES * b,), k, dtype=torch.int32)
    kjt = KeyedJaggedTensor.from_lengths_sync(keys=KEYS, values=values, lengths=lengths)
    return Batch(dense_features=torch.from_numpy(np.ascontiguousarray(dense, np.float32)),
                 sparse_features=kjt,
                 labels=torch.from_numpy(np.ascontiguousarray(labels, np.float32)))


def make_jagged_batch(dense, values, lengths, labels):
    """A batch whose bags have any size: ``values``/``lengths`` already feature-major."""
    kjt = KeyedJaggedTensor.from_lengths_sync(
        keys=KEYS, values=torch.from_numpy(values.astype(np.int64)),
        lengths=torch.from_numpy(lengths.astype(np.int32)))
    return Batch(dense_features=torch.from_numpy(np.ascontiguousarray(dense, np.float32)),
                 sparse_features=kjt,
                 labels=torch.from_numpy(np.ascontiguousarray(labels, np.float32)))


def load_jagged_batches(f, rank, world):
    """Batches stored one by one (kjt_values / kjt_lengths [n, 26*b] / kjt_offsets [n+1]),
    batch i to rank i % world."""
    dense, labels = f["dense"], f["labels"]
    values, lengths, offsets = f["kjt_values"], f["kjt_lengths"], f["kjt_offsets"]
    b = lengths.shape[1] // NUM_TABLES
    return [make_jagged_batch(dense[i * b:(i + 1) * b], values[offsets[i]:offsets[i + 1]],
                              lengths[i], labels[i * b:(i + 1) * b])
            for i in range(rank, lengths.shape[0], world)]


def check_batches(args):
    """Validate --batches in the parent process; sets args.multi_hot from the file."""
    with np.load(args.batches) as f:
        if "kjt_values" in f.files:  # variable-size bags: checked when built
            return
        missing = {"dense", "ids", "labels"} - set(f.files)
        if missing:
            raise SystemExit(f"{args.batches}: missing arrays {sorted(missing)} (has {f.files})")
        dense, ids, labels = f["dense"], f["ids"], f["labels"]
    n = dense.shape[0]
    if dense.shape != (n, NUM_DENSE) or ids.ndim != 2 or ids.shape[0] != n \
            or ids.shape[1] % NUM_TABLES or ids.shape[1] == 0 or labels.shape != (n,):
        raise SystemExit(f"{args.batches}: expected dense [N,{NUM_DENSE}], ids [N,{NUM_TABLES}*K],"
                         f" labels [N]; got {dense.shape}, {ids.shape}, {labels.shape}")
    if n // args.batch_size < args.nproc:
        raise SystemExit(f"{args.batches}: {n} rows < {args.nproc} ranks x batch {args.batch_size}")
    if ids.min() < 0 or ids.max() >= NUM_ROWS:
        raise SystemExit(f"{args.batches}: ids must lie in [0, {NUM_ROWS})")
    k = ids.shape[1] // NUM_TABLES
    if args.multi_hot not in (1, k):
        raise SystemExit(f"--multi-hot {args.multi_hot} disagrees with {args.batches} (K={k})")
    args.multi_hot = k


def load_batches(args, rank, world):
    b, k = args.batch_size, args.multi_hot
    if args.batches is None:
        rng = np.random.default_rng([args.seed, rank])
        return [make_batch(rng.random((b, NUM_DENSE), np.float32),
                           rng.integers(0, NUM_ROWS, (b, NUM_TABLES * k), np.int64),
                           rng.integers(0, 2, b).astype(np.float32), k)
                for _ in range(args.num_batches)]
    with np.load(args.batches) as f:  # already checked by check_batches()
        if "kjt_values" in f.files:
            return load_jagged_batches(f, rank, world)
        dense, ids, labels = f["dense"], f["ids"], f["labels"]
    # Whole batches only; batch i goes to rank i % world (every rank gets >= 1).
    return [make_batch(dense[i * b:(i + 1) * b], ids[i * b:(i + 1) * b],
                       labels[i * b:(i + 1) * b], k)
            for i in range(rank, dense.shape[0] // b, world)]


def build_model(args, pg):
    tables = [EmbeddingBagConfig(name=f"t_{key}", embedding_dim=EMB_DIM, num_embeddings=NUM_ROWS,
                                 feature_names=[key], pooling=PoolingType.SUM) for key in KEYS]
    ebc = EmbeddingBagCollection(tables=tables, device=torch.device("meta"))
    model = DLRMTrain(DLRM(embedding_bag_collection=ebc, dense_in_features=NUM_DENSE,
                           dense_arch_layer_sizes=BOTTOM_MLP, over_arch_layer_sizes=TOP_MLP,
                           dense_device=torch.device("cpu")))
    if args.optimizers == "default":
        fused = {"optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD, "learning_rate": 0.05, "eps": 1e-8}
        make_dense = lambda params: torch.optim.Adam(params, lr=0.001)
    else:
        fused = {"optimizer": EmbOptimType.EXACT_SGD, "learning_rate": args.lr}
        make_dense = lambda params: torch.optim.SGD(params, lr=args.lr)
    sharder = EmbeddingBagCollectionSharder(fused_params=fused)
    constraints = None
    if args.sharding == "table_wise":
        constraints = {t.name: ParameterConstraints(sharding_types=[ShardingType.TABLE_WISE.value])
                       for t in tables}
    planner = EmbeddingShardingPlanner(
        topology=Topology(world_size=pg.size(), compute_device="cpu",
                          local_world_size=pg.size()),
        batch_size=args.batch_size, constraints=constraints, debug=args.verbose)
    plan = planner.collective_plan(model, [sharder], pg)
    model = DistributedModelParallel(model, device=torch.device("cpu"), plan=plan,
                                     sharders=[sharder])
    dense_opt = KeyedOptimizerWrapper(dict(in_backward_optimizer_filter(model.named_parameters())),
                                      make_dense)
    optimizer = CombinedOptimizer([model.fused_optimizer, dense_opt])
    return model, optimizer, plan


def quiet(verbose):
    if not verbose:  # TorchRec's planner/DDP warnings are noise for a benchmark
        warnings.filterwarnings("ignore")
        logging.getLogger("torchrec").setLevel(logging.ERROR)
        logging.getLogger("torch").setLevel(logging.ERROR)


def worker(rank, args, rdzv_file, queue):
    quiet(args.verbose)
    world = args.nproc
    threads = args.threads or max(1, (os.cpu_count() or 1) // world)
    torch.set_num_threads(threads)
    torch.manual_seed(args.seed)
    if rdzv_file is None:  # started by torchrun (one rank per machine / namespace): env://
        dist.init_process_group("gloo")
    else:
        # File rendezvous: a free TCP port picked up front can be taken by another job in between.
        dist.init_process_group("gloo", init_method=f"file://{rdzv_file}", rank=rank,
                                world_size=world)
    try:
        pg = dist.group.WORLD
        batches = load_batches(args, rank, world)
        model, optimizer, plan = build_model(args, pg)
        if args.verbose and rank == 0:
            print(plan, file=sys.stderr)
        model.train()
        times, losses = [], []
        dist.barrier()
        for step in range(args.warmup + args.steps):
            t0 = time.perf_counter()
            optimizer.zero_grad()
            loss, _ = model(batches[step % len(batches)])
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
            if step >= args.warmup:
                times.append(time.perf_counter() - t0)
        dist.barrier()  # every rank has finished its timed steps
        # Keep this small: it goes through a pipe that is read only after the ranks exit.
        stats = {"rank": rank, "time_s": float(sum(times)),
                 "step_ms_median": 1e3 * float(np.median(times)),
                 "step_ms_min": 1e3 * min(times), "step_ms_max": 1e3 * max(times),
                 "loss_first": losses[0], "loss_last": losses[-1],
                 "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}
        gathered = [None] * world
        dist.all_gather_object(gathered, stats)
        if rank == 0:
            sharding = sorted({ps.sharding_type for mod in plan.plan.values()
                               for ps in mod.values()})
            queue.put((gathered, sharding, threads))
        del model, optimizer
        dist.barrier()  # nobody tears gloo down while a peer is still using it
    finally:
        dist.destroy_process_group()


def spawned_worker(rank, args, rdzv_file, queue):
    worker(rank, args, rdzv_file, queue)
    # The result is already sent. Skip interpreter finalisation: about 1 run in 10-30 a
    # spawned rank aborts there ("terminate called without an active exception", no Python
    # frame on the stack: a C++ thread still joinable at static destruction), which makes
    # mp.spawn fail a run that has finished.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def main(argv=None):
    args = parse_args(argv)
    # Launched by torchrun, e.g. one rank per network namespace (benchmarks/
    # cluster_throughput.py): this process is one rank and the world replaces --nproc.
    launched = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    if launched:
        args.nproc = int(os.environ["WORLD_SIZE"])
    if args.batches:
        check_batches(args)
    if launched:
        rank, box = int(os.environ["RANK"]), []
        worker(rank, args, None, SimpleNamespace(put=box.append))
        if rank != 0:
            return 0
        ranks, sharding, threads = box[0]
    else:
        queue = mp.get_context("spawn").SimpleQueue()
        with tempfile.TemporaryDirectory(prefix="torchrec_dlrm-") as tmp:
            rdzv = os.path.join(tmp, "rendezvous")
            if args.nproc == 1:
                worker(0, args, rdzv, queue)  # in-process, 1-rank gloo group
            else:
                mp.spawn(spawned_worker, args=(args, rdzv, queue), nprocs=args.nproc, join=True)
        ranks, sharding, threads = queue.get()
    wall = max(r["time_s"] for r in ranks)  # the slowest rank bounds global throughput
    samples = args.nproc * args.batch_size * args.steps
    result = {
        "framework": "torchrec", "torchrec": _version("torchrec"),
        "fbgemm_gpu": _version("fbgemm-gpu-cpu"), "torch": torch.__version__,
        "samples_per_s": samples / wall,
        "samples_per_s_per_rank": samples / wall / args.nproc,
        # robust to a few slow steps caused by other load on the machine:
        "samples_per_s_from_median_step": args.nproc * args.batch_size * 1e3
        / max(r["step_ms_median"] for r in ranks),
        "step_ms_mean": 1e3 * wall / args.steps,
        "step_ms_median_rank0": ranks[0]["step_ms_median"],
        "step_ms_min_max_rank0": [ranks[0]["step_ms_min"], ranks[0]["step_ms_max"]],
        "peak_rss_mb_per_rank": [round(r["peak_rss_mb"], 1) for r in ranks],
        "peak_rss_mb_total": round(sum(r["peak_rss_mb"] for r in ranks), 1),
        "loss_first": ranks[0]["loss_first"], "loss_last": ranks[0]["loss_last"],
        "nproc": args.nproc, "threads_per_rank": threads, "batch_size_per_rank": args.batch_size,
        "multi_hot": args.multi_hot, "steps": args.steps, "warmup": args.warmup,
        "lr": args.lr, "sharding": args.sharding, "sharding_types_used": sharding,
        "data": args.batches or f"random uniform, {args.num_batches} batches/rank cycled",
        "model": {"tables": NUM_TABLES, "rows": NUM_ROWS, "dim": EMB_DIM,
                  "bottom_mlp": [NUM_DENSE] + BOTTOM_MLP,
                  "top_mlp": TOP_MLP,
                  "optimizer": ("Adam 0.001 dense, fused EXACT_ROWWISE_ADAGRAD 0.05 for embeddings"
                                if args.optimizers == "default" else "SGD (fused EXACT_SGD for embeddings)")},
        "host": {"cpu": _cpu_model(), "cores": os.cpu_count(),
                 "loadavg_after": os.getloadavg()},
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    line = json.dumps(result)
    print(line)
    if args.out:
        with open(args.out, "w") as f:
            f.write(line + "\n")
    return 0


def _version(dist_name):
    from importlib.metadata import version
    return version(dist_name)


def _cpu_model():
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown"


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # same finalisation abort as in spawned_worker, for --nproc 1
