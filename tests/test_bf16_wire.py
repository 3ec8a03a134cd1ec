"""bf16 precision sends the pooled embeddings and their gradients as bf16 where the
receiver only places them: the same training as with float32 on the wire, half the bytes."""

import pytest
import torch
from distributed import run_ranks
from test_sharded_embedding import DIM, GLOBAL_B, global_batches, make_plan, tables, train

from hybridrec.comm.ledger import CommLedger
from hybridrec.model.dlrm import DLRM
from hybridrec.parallel.dense_sync import DDPSync
from hybridrec.parallel.sharded_embedding import ShardedEmbeddingBagCollection
from hybridrec.train.loop.sparse_optim import combined_sparse_optimizer

pytestmark = pytest.mark.distributed


def worker(topo, kind, wire):
    plan = make_plan(kind, topo.group_size)
    ledger = CommLedger()
    torch.manual_seed(0)
    ebc = ShardedEmbeddingBagCollection(tables(), plan, topo, seed=7, ledger=ledger, wire_dtype=wire)
    sync = DDPSync(topo)
    model = sync.wrap(DLRM(num_dense=3, sparse=ebc, bottom_mlp=[8, DIM], top_mlp=[6, 1], precision="bf16"))
    dense_opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    sparse = combined_sparse_optimizer("sgd", model.sparse, lr=0.1)
    per = GLOBAL_B // topo.group_size
    lo = topo.rank * per
    losses = train(model, (dense_opt, sparse), global_batches(True), lo, lo + per, sync=sync)
    shards = {k: w.detach().clone() for k, (_, w) in model.sparse.local_shards().items()}
    dense = {k: v.detach().clone() for k, v in model.state_dict().items() if "sparse" not in k}
    ledger.step_end()
    hop = {d: ledger.totals(category="output_dist", direction=d) for d in ("fwd", "bwd")}
    pred = ledger.summary()["predicted_vs_counted"]["output_dist"]
    counts = {d: (c.sent, c.received, c.original) for d, c in hop.items()}
    counts["check"] = (pred["predicted"]["sent"], pred["counted"]["sent"], pred["mismatched_steps"])
    return losses, shards, dense, counts, ebc.wire_dtype


@pytest.mark.parametrize("kind, world", [("mixed_placed", 2), ("column_wise", 3)])
def test_bf16_wire_trains_the_same_with_half_the_bytes(kind, world):
    low = run_ranks(worker, world, kind, torch.bfloat16)
    ref = run_ranks(worker, world, kind, None)
    for (l_loss, l_shards, l_dense, l_counts, l_wire), (r_loss, r_shards, r_dense, r_counts, r_wire) in zip(low, ref):
        assert l_wire == torch.bfloat16 and r_wire is None
        if world == 2:  # the gradients' 1/world scale is exact in bf16: bit for bit
            assert l_loss == r_loss
            for k in r_shards:
                assert torch.equal(l_shards[k], r_shards[k]), k
            for k in r_dense:
                assert torch.equal(l_dense[k], r_dense[k]), k
        else:  # 1/3 rounds once more in bf16
            torch.testing.assert_close(torch.tensor(l_loss), torch.tensor(r_loss), rtol=1e-2, atol=1e-3)
        for d in ("fwd", "bwd"):
            sent, received, original = l_counts[d]
            r_sent, r_received, r_original = r_counts[d]
            assert r_sent > 0 and sent * 2 == r_sent and received * 2 == r_received
            assert original == r_original == r_sent  # float32 bytes of the same rows
        for predicted, counted, mismatched in (l_counts["check"], r_counts["check"]):
            assert predicted == counted > 0 and mismatched == 0  # the cost model agrees


def placement_worker(topo, kind):
    ebc = ShardedEmbeddingBagCollection(tables(), make_plan(kind, topo.group_size), topo, seed=7,
                                        wire_dtype=torch.bfloat16)
    return ebc.wire_dtype


@pytest.mark.parametrize("kind", ["row_wise", "mixed"])
def test_bf16_wire_only_where_values_are_placed(kind):
    """Row-wise partials are added at the receiver: they stay float32 on the wire."""
    assert run_ranks(placement_worker, 2, kind) == [None, None]
