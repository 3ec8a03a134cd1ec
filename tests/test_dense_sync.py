"""Dense synchronization strategies on 2 gloo ranks: DDP and the explicit all-reduce train
the same model (plain and DCT-compressed), "none" keeps replicas apart, and the plain
strategies' predicted dense bytes equal the counted ones."""

import pytest
import torch
from distributed import run_ranks
from test_sharded_embedding import GLOBAL_B, build, global_batches, local_batch, make_plan

from hybridrec.comm.compress import DCTCompressor, NoCompression
from hybridrec.comm.ddp_hooks import CompressedAllReduce
from hybridrec.comm.ledger import CommLedger
from hybridrec.parallel.dense_sync import AllReduceSync, DDPSync, NoSync, dense_arches
from hybridrec.parallel.parallelize import parallelize_dlrm
from hybridrec.train.loop.optim import dense_parameters
from hybridrec.train.loop.sparse_optim import combined_sparse_optimizer
from hybridrec.train.loop.step import training_step

pytestmark = pytest.mark.distributed


def _sync(kind, compressor, topo, ledger):
    if kind == "ddp":
        hooks = None if compressor is None else CompressedAllReduce(compressor, ledger)
        return DDPSync(topo, hooks=hooks, ledger=ledger)
    if kind == "allreduce":
        plain = compressor is None
        return AllReduceSync(topo, CompressedAllReduce(compressor or NoCompression(), ledger),
                             ledger=ledger, predict=plain)
    return NoSync()


def worker(topo, kind, dct):
    ledger = CommLedger()
    sync = _sync(kind, DCTCompressor(0.2, 2) if dct else None, topo, ledger)
    model = parallelize_dlrm(build("sum"), make_plan("table_wise", topo.group_size), topo, ledger=ledger,
                             dense_sync=sync)
    dense_opt = torch.optim.SGD(dense_parameters(model), lr=0.1)
    sparse_opt = combined_sparse_optimizer("sgd", model.sparse, lr=0.1)
    b = GLOBAL_B // topo.group_size
    for g in global_batches(False):
        training_step(model, local_batch(g, topo.rank * b, (topo.rank + 1) * b), dense_opt=dense_opt,
                      sparse_opt=sparse_opt, dense_sync=sync)
        ledger.step_end()
    dense = {f"{a}.{n}": p.detach().clone() for a, m in dense_arches(model).items()
             for n, p in m.named_parameters()}
    return dense, ledger.summary(), sync.state_dict()


@pytest.fixture(scope="module")
def trained():
    """``trained(kind, dct)``: the 2 ranks' results of ``worker``, run once per arguments
    (the plain ddp and allreduce runs serve two tests each)."""
    runs = {}

    def get(kind, dct):
        if (kind, dct) not in runs:
            runs[kind, dct] = run_ranks(worker, 2, kind, dct)
        return runs[kind, dct]

    return get


@pytest.mark.parametrize("dct", [False, True])
def test_ddp_and_explicit_allreduce_train_the_same_model(trained, dct):
    ddp = trained("ddp", dct)
    explicit = trained("allreduce", dct)
    for (a, _, sa), (b, _, sb) in zip(ddp, explicit):
        assert a.keys() == b.keys()
        for k in a:
            assert torch.equal(a[k], b[k]), k
        if dct:  # the same per-parameter compressor state, whichever strategy carried it
            ta, tb = sa["compressor"]["tensors"], sb["compressor"]["tensors"]
            assert ta and ta.keys() == tb.keys(), (ta.keys(), tb.keys())
            for key, st in ta.items():
                other = tb[key]
                assert st["step"] == other["step"] and torch.equal(st["residual"], other["residual"])
    for k in ddp[0][0]:  # averaged gradients: the replicas are identical
        assert torch.equal(ddp[0][0][k], ddp[1][0][k]), k


@pytest.mark.parametrize("kind", ["ddp", "allreduce"])
def test_plain_dense_bytes_are_predicted_exactly(trained, kind):
    for _, summary, _ in trained(kind, False):
        entry = summary["predicted_vs_counted"]["dense_allreduce"]
        counted = summary["by_category"]["dense_allreduce"]
        assert entry["match"] and entry["mismatched_steps"] == 0
        assert entry["predicted"]["sent"] == entry["counted"]["sent"] == counted["sent"] > 0
        assert entry["predicted"]["received"] == counted["received"]


def test_none_keeps_replicas_apart_and_sends_no_dense_bytes(trained):
    (a, sa, _), (b, sb, _) = trained("none", False)
    assert any(not torch.equal(a[k], b[k]) for k in a)  # each rank trained its own replica
    assert "dense_allreduce" not in sa["by_category"] and "dense_allreduce" not in sb["by_category"]
