"""DCT-DP's exchange: the receive-first pairwise path, the size exchange overlapped with
backward (deferred to the next bucket's hook), and replicated tables' gradients through
the compressor. Two gloo ranks, one process start per worker below."""

from __future__ import annotations

import pytest
import torch
from distributed import run_ranks
from test_codecs import BATCH, local_kjt, make_plan, tables
from torch import nn

from hybridrec.comm.compress import DCTCompressor, TopKCompressor
from hybridrec.comm.ddp_hooks import CompressedAllReduce
from hybridrec.comm.ledger import CommLedger, ring_allreduce_bytes
from hybridrec.parallel.sharded_embedding import REPLICATED, ShardedEmbeddingBagCollection

pytestmark = pytest.mark.distributed

ROWS, DIM = 12, 8  # t2, the replicated table of the mixed plan
STEPS = 3


# -- replicated tables ------------------------------------------------------------------

REPLICATED_RUNS = {
    # name: (compressor, pairwise); None: the plain [rows, dim + 1] all-reduce
    "plain": (None, False),
    "dct_eta1": (lambda: DCTCompressor(1.0, 5), False),
    "topk": (lambda: TopKCompressor(0.1), False),
    "topk_pairwise": (lambda: TopKCompressor(0.1), True),
    "dct": (lambda: DCTCompressor(0.1, 2, ramp=True), False),
}


def replicated_worker(topo):
    """``STEPS`` forward/backward/reduce rounds of the mixed plan (t2 replicated) per run of
    :data:`REPLICATED_RUNS`: per step this rank's local row gradient, the residual before
    the step, the reduced rows (dense ``[rows, dim]``) and the touched rows; the run's
    bytes; its compressor state, and whether a compressor loaded from that state compresses
    the next gradient exactly as the trained one does."""
    torch.set_num_threads(1)
    out = {}
    for name, (make, pairwise) in REPLICATED_RUNS.items():
        ledger = CommLedger()
        reducer = None if make is None else CompressedAllReduce(make(), ledger, category="dp_table_allreduce",
                                                                 pairwise=pairwise)
        ebc = ShardedEmbeddingBagCollection(tables(), make_plan("mixed"), topo, seed=3, ledger=ledger,
                                            dp_reducer=reducer)
        rounds = []
        for step in range(STEPS):
            kjt = local_kjt(topo.rank, BATCH[topo.rank], step)
            w = torch.randn(BATCH[topo.rank], 4 * DIM, generator=torch.Generator().manual_seed(step))
            (ebc(kjt).values * w).sum().backward()
            grads = ebc.pop_sparse_grads()
            local = torch.zeros(ROWS, DIM)
            for _, ids, rows, _ in grads[REPLICATED]:
                local.index_add_(0, ids, rows)
            before = None if reducer is None else reducer.compressor.residual("replicated.0")
            (_, touched, rows, unique), = ebc.reduce_sparse_grads(grads)[REPLICATED]
            assert unique
            full = torch.zeros(ROWS, DIM)
            full[touched] = rows
            rounds.append((local, None if before is None else before.clone(), full, touched.clone()))
        state, resumes_alike = None, None
        if reducer is not None:
            state = reducer.state_dict()
            again = CompressedAllReduce(make())
            again.load_state_dict(state)
            g = torch.randn(ROWS * DIM, generator=torch.Generator().manual_seed(99))
            a, b = reducer.compressor.compress("replicated.0", g), again.compressor.compress("replicated.0", g)
            resumes_alike = (torch.equal(a.indices, b.indices) and torch.equal(a.values, b.values)
                             and torch.equal(reducer.compressor.residual("replicated.0"),
                                             again.compressor.residual("replicated.0")))
        out[name] = (rounds, ledger.totals(category="dp_table_allreduce"), state, resumes_alike)
    return out


@pytest.fixture(scope="module")
def replicated():
    return run_ranks(replicated_worker, 2)


def test_eta_one_equals_the_dense_all_reduce(replicated):
    for out in replicated:
        for (_, _, plain, touched), (_, _, comp, touched_c) in zip(out["plain"][0], out["dct_eta1"][0]):
            assert torch.equal(comp, plain)  # 0 + a + b in rank order; the all-reduce's a + b
            assert torch.equal(touched, touched_c)


def test_small_eta_sums_every_ranks_message_and_sends_fewer_bytes(replicated):
    for step in range(STEPS):
        # What each rank sent: gradient + residual before the step, top 10% of 96 entries.
        sent = []
        for out in replicated:
            local, residual, _, _ = out["topk"][0][step]
            x = local.reshape(-1) + (0 if residual is None else residual)
            idx = x.abs().topk(10).indices
            sent.append(torch.zeros(ROWS * DIM).index_put_((idx,), x[idx]))
        for out in replicated:
            _, _, total, touched = out["topk"][0][step]
            torch.testing.assert_close(total.reshape(-1), sent[0] + sent[1], rtol=0, atol=1e-6)
            # Touched rows: those with a nonzero entry in the sum.
            assert torch.equal(touched, total.ne(0).any(1).nonzero().squeeze(1))
    dense = ring_allreduce_bytes(ROWS * (DIM + 1) * 4, 2)  # the [12, 9] float32 all-reduce
    for out in replicated:
        plain = out["plain"][1]
        assert plain.sent == plain.original == STEPS * dense
        for name in ("topk", "dct", "dct_eta1"):
            comp = out[name][1]
            assert comp.original == STEPS * dense and comp.calls == STEPS
        assert out["topk"][1].sent < out["topk"][1].original / 3
        assert out["dct"][1].sent < out["dct"][1].original / 2


def test_replicated_pairwise_exchange_gives_the_same_sums_and_bytes(replicated):
    for out in replicated:
        for a, b in zip(out["topk"][0], out["topk_pairwise"][0]):
            assert all(torch.equal(x, y) for x, y in zip(a, b) if x is not None)
        assert out["topk"][1] == out["topk_pairwise"][1]


def test_replicated_compressor_state_round_trips(replicated):
    for out in replicated:
        for name in ("topk", "dct", "dct_eta1"):
            _, _, state, resumes_alike = out[name]
            assert resumes_alike, name
            assert state["tensors"]["replicated.0"]["step"] == STEPS
        assert out["dct"][2]["tensors"]["replicated.0"]["refreshes"] >= 2
    # The ranks' replicas of the reduced rows are identical.
    for (a, b) in zip(replicated[0]["dct"][0], replicated[1]["dct"][0]):
        assert torch.equal(a[2], b[2]) and torch.equal(a[3], b[3])


# -- DDP hooks: blocking or overlapped, collective or pairwise -------------------------

HOOK_RUNS = {  # name: (pairwise, overlap)
    "blocking": (False, False),
    "overlap": (False, True),
    "pairwise_blocking": (True, False),
    "pairwise_overlap": (True, True),
}


def ddp_worker(topo):
    """Five steps of a 4-layer MLP in DDP with a DCT hook (warm-up 1 step: step 0 is dense)
    and small buckets (several per step), per run of :data:`HOOK_RUNS`: per step the
    averaged gradients, the bytes, the buckets, and whether any non-last bucket's future was
    already done when its hook returned; the compressor state at the end."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    torch.set_num_threads(1)
    calls = {}

    def counting(name, fn):
        def counted(*a, **kw):
            calls[name] = calls.get(name, 0) + 1
            return fn(*a, **kw)
        return counted

    for name in ("all_to_all_single", "isend", "irecv", "all_reduce"):  # count what the hooks call
        setattr(dist, name, counting(name, getattr(dist, name)))
    out = {}
    for name, (pairwise, overlap) in HOOK_RUNS.items():
        calls.clear()
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(),
                              nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 1))
        ledger = CommLedger()
        # cap=None: the pure threshold, whose sizes are exchanged (bounded messages take the
        # fixed-size path instead: tests/test_dct_fixed_size.py)
        hooks = CompressedAllReduce(DCTCompressor(0.05, 2, ramp=True, warmup_steps=1, cap=None), ledger,
                                    pairwise=pairwise, overlap=overlap)
        hook = hooks("m", model)
        buckets, early = [], []

        def spy(group, bucket, hook=hook, buckets=buckets, early=early):
            buckets[-1] += 1
            fut = hook(group, bucket)
            early[-1] |= not bucket.is_last() and fut.done()
            return fut

        # 4 KiB buckets from step 1 on: each weight closes one (3 buckets)
        ddp = DistributedDataParallel(model, process_group=topo.group, bucket_cap_mb=4 / 1024)
        ddp.register_comm_hook(topo.group, spy)
        g = torch.Generator().manual_seed(topo.rank)
        steps = []
        for _ in range(5):
            buckets.append(0)
            early.append(False)
            ddp.zero_grad()
            ddp(torch.randn(16, 32, generator=g)).square().mean().backward()
            ledger.step_end()
            t = ledger.totals(scope="last_step")
            steps.append(([p.grad.clone() for p in model.parameters()], (t.sent, t.received, t.original, t.calls)))
        out[name] = {"steps": steps, "buckets": buckets, "early": early, "state": hooks.state_dict(),
                     "calls": dict(calls)}
    return out


@pytest.fixture(scope="module")
def hooked():
    return run_ranks(ddp_worker, 2)


def test_several_buckets_and_the_overlapped_hook_defers(hooked):
    for out in hooked:
        for name, (pairwise, _) in HOOK_RUNS.items():
            calls = out[name]["calls"]
            assert calls["all_reduce"] == 1  # the dense warm-up step
            if pairwise:  # sizes and messages by isend/irecv: no all-to-all at all
                assert "all_to_all_single" not in calls and calls["isend"] == calls["irecv"] > 0
            else:
                assert calls["all_to_all_single"] > 0 and "isend" not in calls
        # DDP's first step is one bucket; it rebuilds them after it, by the 4 KiB cap.
        assert min(out["overlap"]["buckets"][1:]) >= 3
        # Overlapped: a bucket's messages start in the next bucket's hook, so its future
        # cannot be done when its own hook returns (step 0 is the dense warm-up: no deferral).
        assert not any(out["overlap"]["early"][1:]) and not any(out["pairwise_overlap"]["early"][1:])


def _same(a, b):
    return (a is None and b is None) or (a is not None and b is not None and torch.equal(a, b))


def test_every_exchange_order_gives_bit_identical_gradients_bytes_and_state(hooked):
    for out in hooked:
        ref = out["blocking"]
        for name in ("overlap", "pairwise_blocking", "pairwise_overlap"):
            run = out[name]
            for s, ((grads, counted), (grads_r, counted_r)) in enumerate(zip(run["steps"], ref["steps"])):
                assert counted == counted_r, (name, s)
                assert all(torch.equal(a, b) for a, b in zip(grads, grads_r)), (name, s)
            assert ref["state"]["tensors"] and ref["state"]["tensors"].keys() == run["state"]["tensors"].keys()
            for key, st in ref["state"]["tensors"].items():
                other = run["state"]["tensors"][key]
                assert st["step"] == other["step"] == 5 and st["refreshes"] == other["refreshes"]
                assert _same(st["residual"], other["residual"]) and _same(st["tau"], other["tau"])
        sent = sum(c[0] for _, c in ref["steps"][1:])
        assert sent < sum(c[2] for _, c in ref["steps"][1:]) / 3  # compressed after the warm-up
    # The replicas are identical.
    for a, b in zip(hooked[0]["overlap"]["steps"][-1][0], hooked[1]["overlap"]["steps"][-1][0]):
        assert torch.equal(a, b)
