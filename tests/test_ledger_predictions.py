"""Every training step predicts its bytes (cost model over the collection's layout, the
step's batch sizes and id counts) and counts them (the collectives, as moved): on 2 gloo
ranks, over several steps of skewed ids, predicted == counted in every entry of the
ledger's comparison, step by step; row-wise, table-wise with a codec, DeepFM with one;
table_row_wise in one host and in two (its in-host bytes under ``trw_intra``)."""

import pytest
import test_deepfm as fm_case
import test_sharded_embedding as dlrm_case
import torch
from distributed import run_ranks

from hybridrec.comm.codecs import make_codec
from hybridrec.comm.ledger import CommLedger
from hybridrec.parallel.cost_model import predict_step_bytes
from hybridrec.parallel.dense_sync import DDPSync
from hybridrec.parallel.parallelize import parallelize_dlrm
from hybridrec.sparse.keyed_jagged import Batch, KeyedJagged
from hybridrec.train.loop.sparse_optim import combined_sparse_optimizer
from hybridrec.train.loop.step import training_step

pytestmark = pytest.mark.distributed

STEPS, B = 4, 6


def skewed_batch(tables, rank, step):
    """Multi-hot bags whose ids crowd the low rows (more of them fall in row shard 0),
    differently every step and rank."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    keys, vals, lens = [], [], []
    for name, rows in tables:
        ln = torch.randint(0, 5, (B,), generator=g)
        ids = (torch.rand(int(ln.sum()), generator=g).pow(3) * rows).long().clamp(max=rows - 1)
        keys.append(f"f_{name}")
        vals.append(ids)
        lens.append(ln)
    return Batch(torch.randn(B, 3, generator=g), KeyedJagged.from_lengths_per_key(keys, vals, lens),
                 torch.randint(0, 2, (B,), generator=g).float())


def worker(topo, arch, kind, codec, pipeline):
    case = fm_case if arch == "deepfm" else dlrm_case
    plan = case.make_plan(kind, topo.group_size)
    topo = dlrm_case.plan_topology(topo, plan)  # table_row_wise: the plan's host groups
    codecs = {} if codec is None else {n: make_codec(codec, eta=0.25) for n, _ in case.TABLES
                                       if plan.tables[n].sharding_type != "data_parallel"}
    ledger = CommLedger()
    sync = DDPSync(topo, ledger=ledger)  # the plain all-reduce predicts its own bytes
    model = parallelize_dlrm(case.build() if arch == "deepfm" else case.build("sum"), plan, topo,
                             ledger=ledger, codecs=codecs, dense_sync=sync)
    dense_opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.05)
    opts = combined_sparse_optimizer("rowwise_adagrad", model.sparse, lr=0.1)
    batches = [skewed_batch(case.TABLES, topo.rank, s) for s in range(STEPS)]
    pending = model.sparse.start_input_dist(batches[0].sparse) if pipeline else None
    input_bytes = []
    for i, batch in enumerate(batches):
        nxt = model.sparse.start_input_dist(batches[i + 1].sparse) if pipeline and i + 1 < STEPS else None
        training_step(model, batch, dense_opt=dense_opt, sparse_opt=opts, dense_sync=sync, pending=pending)
        ledger.step_end()
        input_bytes.append(ledger.totals(scope="last_step", category="input_dist").sent)
        if i == 1:  # evaluation between steps, a prefetch in flight: neither counted nor predicted
            model.eval()
            with ledger.suspended(), torch.no_grad():
                model(batch)
            model.train()
        pending = nxt
    static = predict_step_bytes(plan, case.tables(), rank=topo.rank, batch_sizes=[B] * topo.group_size,
                                ids_per_bag=2.0, codecs=codecs)
    return ledger.summary(), input_bytes, static


CASES = [("dlrm", "row_wise", None, True), ("dlrm", "row_wise", None, False),
         ("dlrm", "table_wise", "dct", True), ("dlrm", "mixed", "int8", False),
         ("deepfm", "mixed", "dct", True), ("deepfm", "row_wise", "dct", False)]


@pytest.mark.parametrize("arch, kind, codec, pipeline", CASES)
def test_every_step_predicts_what_it_counts(arch, kind, codec, pipeline):
    for summary, input_bytes, static in run_ranks(worker, 2, arch, kind, codec, pipeline):
        assert summary["steps"] == STEPS
        cmp = summary["predicted_vs_counted"]
        counted = {e["category"] for e in summary["entries"]}
        assert set(cmp) == counted, (cmp.keys(), counted)  # every category here is predicted
        assert {"input_dist", "input_dist_counts", "output_dist", "dense_allreduce"} <= set(cmp)
        assert set(cmp["output_dist"]["by_direction"]) == {"fwd", "bwd"}
        for category, entry in cmp.items():
            assert entry["match"], (category, entry)
            assert entry["predicted"] == entry["counted"], category
            for direction, d in entry["by_direction"].items():
                assert d["match"] and d["mismatched_steps"] == 0, (category, direction, d)
        if kind == "mixed":
            assert "dp_table_allreduce" in cmp
        if kind == "row_wise":  # data-dependent: the ids per row shard change step by step
            assert len(set(input_bytes)) > 1, input_bytes
            assert any(static[("input_dist", "fwd")][0] != n for n in input_bytes)


@pytest.mark.parametrize("world, codec", [(2, None), (4, "int8")])
def test_table_row_wise_predicts_what_it_counts(world, codec):
    """2 ranks in one host: every partial is summed inside it (``trw_intra``), nothing is
    left to cross; 4 ranks in hosts of 2: the sums cross hosts, coded."""
    for summary, _, _ in run_ranks(worker, world, "dlrm", "table_row_wise", codec, True):
        assert summary["steps"] == STEPS
        cmp = summary["predicted_vs_counted"]
        assert set(cmp) == {e["category"] for e in summary["entries"]}
        assert {"input_dist", "input_dist_counts", "trw_intra", "dense_allreduce"} <= set(cmp)
        assert ("output_dist" in cmp) == (world == 4)
        if world == 4:  # the sums that cross hosts are coded: fewer bytes than they stand for
            assert summary["by_category"]["output_dist"]["ratio"] > 1
        assert set(cmp["trw_intra"]["by_direction"]) == {"fwd", "bwd"}
        for category, entry in cmp.items():
            assert entry["match"] and entry["predicted"] == entry["counted"], (category, entry)
