"""DCT-DP beyond the dense arches: replicated tables' gradients through the compressor."""

from __future__ import annotations

import pytest
import torch

from distributed import run_ranks
from hybridrec.comm.compress import DCTCompressor, TopKCompressor
from hybridrec.comm.ddp_hooks import CompressedAllReduce
from hybridrec.comm.ledger import CommLedger
from hybridrec.parallel.sharded_embedding import REPLICATED, ShardedEmbeddingBagCollection
from test_codecs import BATCH, local_kjt, make_plan, tables


def dct_eta_one():
    return DCTCompressor(1.0, 5)


def topk_tenth():
    return TopKCompressor(0.1)


def replicated_worker(topo, make, steps):
    """``steps`` forward/backward/reduce rounds of the mixed plan (t2 replicated), with the
    plain all-reduce and with ``make()``'s compressor; per step the reduced replicated rows,
    and the compressed run's own decompressed message and bytes."""
    plan = make_plan("mixed")
    out = {}
    for name in ("plain", "compressed"):
        ledger = CommLedger()
        reducer = CompressedAllReduce(make(), ledger, category="dp_table_allreduce") if name == "compressed" else None
        ebc = ShardedEmbeddingBagCollection(tables(), plan, topo, seed=3, ledger=ledger, dp_reducer=reducer)
        rounds = []
        for step in range(steps):
            kjt = local_kjt(topo.rank, BATCH[topo.rank], step)
            w = torch.randn(BATCH[topo.rank], 4 * 8, generator=torch.Generator().manual_seed(step))
            (ebc(kjt).values * w).sum().backward()
            grads = ebc.pop_sparse_grads()
            local = torch.zeros(12, 8)
            for _, ids, rows, _ in grads[REPLICATED]:
                local.index_add_(0, ids, rows)
            residual_before = None if reducer is None else reducer.compressor.residual("replicated.0")
            reduced = ebc.reduce_sparse_grads(grads)[REPLICATED]
            (group, touched, rows, unique), = reduced
            full = torch.zeros(12, 8)
            full[touched] = rows
            rounds.append((local, None if residual_before is None else residual_before.clone(), full,
                           touched.clone()))
        state = None if reducer is None else reducer.state_dict()
        out[name] = (rounds, ledger.totals(category="dp_table_allreduce"), state)
    return out


@pytest.mark.distributed
def test_eta_one_equals_the_dense_all_reduce():
    for out in run_ranks(replicated_worker, 2, dct_eta_one, 3):
        for (_, _, plain, touched), (_, _, comp, touched_c) in zip(out["plain"][0], out["compressed"][0]):
            torch.testing.assert_close(comp, plain, rtol=0, atol=1e-6)
            assert torch.equal(touched, touched_c)


@pytest.mark.distributed
def test_small_eta_sums_every_ranks_message_and_sends_fewer_bytes():
    per_rank = run_ranks(replicated_worker, 2, topk_tenth, 3)
    for step in range(3):
        # What each rank sent: gradient + residual before the step, top 10% of 96 entries.
        sent = []
        for out in per_rank:
            local, residual, _, _ = out["compressed"][0][step]
            x = local.reshape(-1) + (0 if residual is None else residual)
            idx = x.abs().topk(10).indices
            sent.append(torch.zeros(96).index_put_((idx,), x[idx]))
        for out in per_rank:
            _, _, total, touched = out["compressed"][0][step]
            torch.testing.assert_close(total.reshape(-1), sent[0] + sent[1], rtol=0, atol=1e-6)
            assert torch.equal(touched, total.ne(0).any(1).nonzero().squeeze(1))
    for out in per_rank:
        plain, comp = out["plain"][1], out["compressed"][1]
        # original: the ring all-reduce of the [12, 8] float32 gradient (on 2 ranks, its bytes)
        # per step; the plain all-reduce also carries the touched-row counts, [12, 9].
        assert comp.original == 3 * 12 * 8 * 4 and plain.sent == 3 * 12 * 9 * 4
        assert comp.sent < comp.original / 2
    # The compressor's state (residuals, steps) round-trips.
    state = per_rank[0]["compressed"][2]
    again = CompressedAllReduce(TopKCompressor(0.1))
    again.load_state_dict(state)
    assert torch.equal(again.compressor.residual("replicated.0"), state["tensors"]["replicated.0"]["residual"])


def ddp_worker(topo):
    """Four steps of a DDP model with a DCT hook, exchanged by all_to_all and
    by the receive-first pairwise path: the averaged gradients and the bytes of each step."""
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel

    out = {}
    for pairwise in (False, True):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(64, 512), nn.ReLU(), nn.Linear(512, 1))
        ledger = CommLedger()
        hooks = CompressedAllReduce(DCTCompressor(0.05, 2, ramp=True), ledger, pairwise=pairwise)
        ddp = DistributedDataParallel(model, process_group=topo.group)
        ddp.register_comm_hook(topo.group, hooks("m", model))
        g = torch.Generator().manual_seed(topo.rank)
        steps = []
        for _ in range(4):
            ddp.zero_grad()
            ddp(torch.randn(16, 64, generator=g)).square().mean().backward()
            ledger.step_end()
            t = ledger.totals(scope="last_step")
            steps.append(([p.grad.clone() for p in model.parameters()], (t.sent, t.received, t.calls)))
        out[pairwise] = steps
    return out


@pytest.mark.distributed
def test_pairwise_exchange_gives_the_same_sums_and_bytes():
    for out in run_ranks(ddp_worker, 2):
        for (grads, counted), (grads_p, counted_p) in zip(out[False], out[True]):
            assert counted == counted_p
            for a, b in zip(grads, grads_p):
                assert torch.equal(a, b)
