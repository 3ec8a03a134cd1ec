"""The distributed path is device-generic: which backend and device a rank takes (a pure
function, every case of it), and, on real gloo ranks, that a sharded training step makes no
tensor except on the device it was given.

The second check needs no GPU: inside the step torch's default device is ``meta``, so a
tensor made without ``device=`` (what would land on the CPU of a GPU rank and fail there,
or stage through the host) becomes a meta tensor, which fails the step the moment it meets a
real one. The step must then train exactly what it trains without the meta default.
"""

import pytest
import test_sharded_embedding as T
import torch
import torch.distributed as dist
from distributed import run_ranks

from hybridrec.comm.exchange import collective_device
from hybridrec.errors import ConfigError
from hybridrec.parallel.dense_sync import AllReduceSync, DDPSync, NoSync
from hybridrec.parallel.devices import DeviceChoice, choose_backend
from hybridrec.parallel.parallelize import parallelize_dlrm
from hybridrec.parallel.topology import Topology
from hybridrec.train.loop.sparse_optim import combined_sparse_optimizer


# -- the choice: a pure function ---------------------------------------------------------
@pytest.mark.parametrize("setting, ranks, gpus, backend, devices, shared", [
    ("auto", 2, 0, "gloo", ["cpu", "cpu"], False),  # CPU machine (CI)
    ("auto", 2, 1, "gloo", ["cuda:0", "cuda:0"], True),  # the test machine: 2 ranks share a GPU
    ("auto", 3, 2, "gloo", ["cuda:0", "cuda:1", "cuda:0"], True),
    ("auto", 8, 8, "nccl", [f"cuda:{r}" for r in range(8)], False),  # one GPU per rank
    ("auto", 2, 8, "nccl", ["cuda:0", "cuda:1"], False),  # more GPUs than ranks
    ("nccl", 4, 4, "nccl", ["cuda:0", "cuda:1", "cuda:2", "cuda:3"], False),
    ("gloo", 2, 8, "gloo", ["cpu", "cpu"], False),  # gloo: the CPU always
    ("gloo", 1, 0, "gloo", ["cpu"], False),
])
def test_backend_and_device_per_rank(setting, ranks, gpus, backend, devices, shared):
    c = choose_backend(setting, ranks, gpus)
    assert (c.backend, c.shared) == (backend, shared)
    assert [c.device(r) for r in range(ranks)] == devices
    assert (c.note(ranks) is not None) == shared


def test_sharing_is_said_with_the_counts():
    note = choose_backend("auto", 2, 1).note(2)
    assert "2 ranks per machine share 1 GPU(s) over gloo" in note


@pytest.mark.parametrize("ranks, gpus, why", [
    (2, 0, "dist.backend=nccl: CUDA is not available here"),
    (2, 1, "dist.backend=nccl: 2 ranks per machine and 1 GPU(s): NCCL needs one GPU per rank"),
    (8, 4, "8 ranks per machine and 4 GPU(s)"),
])
def test_nccl_without_a_gpu_per_rank_is_one_clear_error(ranks, gpus, why):
    with pytest.raises(ConfigError, match=why.replace("(", r"\(").replace(")", r"\)")):
        choose_backend("nccl", ranks, gpus)


def test_unknown_backend_is_refused():
    with pytest.raises(ConfigError, match="dist.backend 'mpi': auto, gloo or nccl"):
        choose_backend("mpi", 2, 0)


def test_pairwise_exchange_is_refused_on_a_gpu_only():
    from hybridrec.train.setup.configure import build_config
    from hybridrec.train.setup.rules import RUN_RULES, RunFacts, check_run

    pairwise, collective = (build_config(overrides=[f"dist.exchange={e}", "train.run_dir=r"])
                            for e in ("pairwise", "collective"))
    check_run(pairwise, RunFacts(world=2, local_world=2, device="cpu"))
    check_run(collective, RunFacts(world=2, local_world=2, device="cuda", gpus=2))
    with pytest.raises(ConfigError, match="dist.exchange=pairwise on cuda: gloo's point-to-point"):
        check_run(pairwise, RunFacts(world=2, local_world=2, device="cuda", gpus=2))
    assert len(RUN_RULES) > 1


def test_choice_is_a_frozen_value():
    with pytest.raises(AttributeError):
        DeviceChoice("gloo", 0).backend = "nccl"


# -- on gloo ranks -----------------------------------------------------------------------
def topology_worker(topo):
    again = Topology.init(backend="auto")  # (joined already: the choice only)
    return (str(again.device), again.backend, str(again.comm_device), str(collective_device(topo.group)))


@pytest.mark.distributed
def test_cpu_ranks_use_gloo_on_the_cpu():
    if torch.cuda.is_available():
        pytest.skip("with CUDA, auto puts the ranks on the GPU (tests/test_gpu_distributed.py)")
    assert run_ranks(topology_worker, 2) == [("cpu", "gloo", "cpu", "cpu")] * 2


SYNCS = {"ddp": DDPSync, "allreduce": lambda topo: AllReduceSync(topo, _plain()), "none": lambda topo: NoSync()}


def _plain():
    from hybridrec.comm.compress import NoCompression
    from hybridrec.comm.ddp_hooks import CompressedAllReduce

    return CompressedAllReduce(NoCompression())


def meta_default_worker(topo, kind, sync_kind, meta):
    """Training steps of a sharded DLRM; with ``meta``, torch's default device is ``meta``
    during the steps (the model, its optimizers and the batches are made before)."""
    plan = T.make_plan(kind, topo.group_size)
    topo = T.plan_topology(topo, plan)
    sync = SYNCS[sync_kind](topo)
    model = parallelize_dlrm(T.build("sum"), plan, topo, dense_sync=sync)
    dense_opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    sparse = combined_sparse_optimizer("sgd", model.sparse, lr=0.1)
    per = T.GLOBAL_B // topo.group_size
    lo = topo.rank * per
    batches = T.global_batches(True)
    local = [T.local_batch(b, lo, lo + per) for b in batches]
    if meta:
        torch.set_default_device("meta")
    try:
        from hybridrec.train.loop.step import training_step

        losses = [training_step(model, b, dense_opt=dense_opt, sparse_opt=sparse, dense_sync=sync).item()
                  for b in local]
    finally:
        torch.set_default_device(None)
    dist.barrier()
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.mark.distributed
@pytest.mark.parametrize("kind, sync_kind", [("table_wise", "ddp"), ("row_wise", "allreduce"),
                                             ("column_wise", "ddp"), ("data_parallel", "none"),
                                             ("mixed", "allreduce")])
def test_sharded_step_makes_tensors_only_on_its_device(kind, sync_kind):
    plain = run_ranks(meta_default_worker, 2, kind, sync_kind, False)
    meta = run_ranks(meta_default_worker, 2, kind, sync_kind, True)
    for (la, sa), (lb, sb) in zip(plain, meta):
        assert la == lb
        assert sa.keys() == sb.keys()
        for k in sa:
            assert sb[k].device.type == "cpu", k
            assert torch.equal(sa[k], sb[k]), k
