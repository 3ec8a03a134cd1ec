"""DCT-DP's bounded message: at most a cap of entries per tensor (the rest wait in the
residual), sent in buffers of one fixed size, so no message sizes are exchanged before it.
In one process: the layout and the compressor's cap; on two gloo ranks: the sums against
hand-computed ones, through ``reduce`` and through DDP hooks (collective and pairwise), the
collectives counted."""

from __future__ import annotations

import copy

import pytest
import torch
from distributed import run_ranks
from torch import nn

from hybridrec.comm import sparse_message as sm
from hybridrec.comm.compress import DCTCompressor, TopKCompressor
from hybridrec.comm.ddp_hooks import CompressedAllReduce
from hybridrec.comm.ledger import CommLedger
from hybridrec.comm.sparse_message import FixedLayout, SparseGrad

# -- one process: the layout and the cap ------------------------------------------------


@pytest.mark.parametrize("capacity,numel", [(3, 300), (5, 40), (30, 40), (7, 70_000)])
def test_fixed_layout_round_trips_and_its_padding_changes_nothing(capacity, numel):
    layout = FixedLayout(capacity, numel, torch.float32)
    assert layout.nbytes % sm.ALIGN == 0
    g = torch.Generator().manual_seed(capacity)
    for count in (0, 1, capacity):
        idx = torch.randperm(numel - 1, generator=g)[:count].sort().values + 1  # entry 0 left out
        msg = SparseGrad(idx, torch.randn(count, generator=g), numel, capacity)
        raw = layout.encode(msg)
        assert raw.numel() == layout.nbytes
        base = torch.randn(numel, generator=g)
        base[0] = -0.0  # the padding goes into entry 0: -0.0 + (-0.0) stays -0.0
        out = layout.add_to(raw, base.clone())
        assert torch.equal(out, msg.add_to(base.clone()))
        assert torch.equal(out[:1].view(torch.int32), base[:1].view(torch.int32))  # bit for bit


def test_fixed_layout_sizes_and_errors():
    # 5 entries of 40: 20 value bytes -> 24, 5 uint8 indices -> 8 (the bitmap's 5 bytes do not win a tie)
    assert FixedLayout(5, 40, torch.float32).nbytes == 32 and not FixedLayout(5, 40, torch.float32).bitmap
    assert FixedLayout(30, 40, torch.float32).bitmap  # 5 bitmap bytes against 30 indices
    layout = FixedLayout(2, 10, torch.float32)
    with pytest.raises(ValueError, match="does not fit"):
        layout.encode(SparseGrad(torch.arange(3), torch.ones(3), 10))
    with pytest.raises(ValueError, match="expected"):
        layout.add_to(torch.zeros(layout.nbytes + 8, dtype=torch.uint8), torch.zeros(10))
    parts = [SparseGrad(torch.tensor([1]), torch.ones(1), 10, 2), SparseGrad.from_dense(torch.ones(4))]
    assert SparseGrad.cat(parts).capacity == 2 + 4  # an unbounded part counts its numel
    assert SparseGrad.cat([SparseGrad.from_dense(torch.ones(4))]).capacity is None


def test_capacity_of_each_compressor():
    assert DCTCompressor(0.1, 10).capacity(40) == 5  # ceil(1.25 * 4)
    assert DCTCompressor(0.1, 10, cap=2).capacity(40) == 8
    assert DCTCompressor(0.1, 10, cap=None).capacity(40) is None  # the pure threshold
    assert DCTCompressor(1.0, 10).capacity(40) is None  # everything kept: the nonzero entries travel
    assert DCTCompressor(0.5, 10, cap=3).capacity(40) == 40
    assert DCTCompressor(0.05, 10).capacity(1) == 1  # a bias of one entry: bounded by its size
    assert TopKCompressor(0.1).capacity(40) == 4 and TopKCompressor(1.0).capacity(40) is None
    with pytest.raises(ValueError, match="cap"):
        DCTCompressor(0.1, 10, cap=0.5)


def _gradients(rank: int) -> list[torch.Tensor]:
    """Per step, rank ``rank``'s gradient of 40 entries (K = 4, cap 5, tau set at step 0 and
    held: refresh every 10): step 0 four entries (tau = the 4th), step 1 eight over tau (the
    cap holds back the 3 smallest) and ten small ones under it, step 2 nothing (the 3 go)."""
    s = float(rank + 1)
    g0, g1 = torch.zeros(40), torch.zeros(40)
    g0[:4] = torch.tensor([10.0, 9, 8, 7]) * s
    g1[10:18] = torch.arange(20.0, 12, -1) * s
    g1[20:30] = 1.0
    return [g0, g1, torch.zeros(40)]


def test_over_cap_entries_wait_in_the_residual():
    comp = DCTCompressor(0.1, 10)
    grads = _gradients(0)
    sent = [comp.compress("w", g) for g in grads]
    assert sent[1].indices.tolist() == [10, 11, 12, 13, 14]  # the cap's 5 largest of the 8 over tau
    assert comp.capped_steps == 1 and comp.capped_entries == 3
    assert sent[2].indices.tolist() == [15, 16, 17]  # held back, sent at the next step
    # Error feedback: what was sent plus what is held is what came in, entry by entry.
    total = sum(m.to_dense() for m in sent) + comp.residual("w")
    assert torch.equal(total, sum(grads))
    assert all(m.capacity == 5 for m in sent)


def test_state_saved_before_the_cap_loads():
    a = DCTCompressor(0.1, 10)
    for g in _gradients(0)[:2]:
        a.compress("w", g)
    state = a.state_dict()
    del state["hyperparameters"]["cap"]  # as a checkpoint from before the cap holds it
    b = DCTCompressor(0.1, 10)
    b.load_state_dict(state)
    assert torch.equal(b.residual("w"), a.residual("w")) and b.threshold("w") == a.threshold("w")
    with pytest.raises(ValueError, match="loaded into"):
        DCTCompressor(0.2, 10).load_state_dict(state)


# -- two ranks -------------------------------------------------------------------------

def _count_collectives(calls: dict) -> None:
    """Counts (and still makes, unchanged) the calls the hooks make to these collectives."""
    import torch.distributed as dist

    def counting(name, fn):
        def counted(*a, **kw):
            calls[name] = calls.get(name, 0) + 1
            return fn(*a, **kw)
        return counted

    for name in ("all_to_all_single", "isend", "irecv", "all_reduce"):
        setattr(dist, name, counting(name, getattr(dist, name)))


def reduce_worker(topo):
    """``reduce`` (the path of ``dist.dense_sync=allreduce``) of :func:`_gradients` over
    the steps, collective and pairwise: per step the average, the bytes and the calls;
    what this rank sent, its residual and the cap's count."""
    torch.set_num_threads(1)
    calls: dict = {}
    _count_collectives(calls)
    out = {}
    for pairwise in (False, True):
        ledger = CommLedger()
        reducer = CompressedAllReduce(DCTCompressor(0.1, 10), ledger, pairwise=pairwise)
        steps = []
        for g in _gradients(topo.rank):
            calls.clear()
            buf = g.clone()
            reducer.reduce(topo.group, buf, ["w"], [buf]).wait()
            ledger.step_end()
            t = ledger.totals(scope="last_step")
            steps.append((buf, (t.sent, t.received, t.calls), dict(calls)))
        comp = reducer.compressor
        out[pairwise] = {"steps": steps, "residual": comp.residual("w"), "capped": comp.capped_entries}
    return out


@pytest.fixture(scope="module")
def reduced():
    return run_ranks(reduce_worker, 2)


@pytest.mark.distributed
def test_reduce_sums_both_ranks_bounded_messages(reduced):
    # By hand: rank r's gradient is (r + 1) times rank 0's, so each sum is 1 + 2 = 3 times
    # what rank 0 sent, halved.
    sent0 = torch.zeros(3, 40)
    sent0[0, :4] = torch.tensor([10.0, 9, 8, 7])
    sent0[1, 10:15] = torch.arange(20.0, 15, -1)
    sent0[2, 15:18] = torch.tensor([15.0, 14, 13])
    nbytes = FixedLayout(5, 40, torch.float32).nbytes
    for rank, out in enumerate(reduced):
        for pairwise in (False, True):
            run = out[pairwise]
            for step, (avg, counted, calls) in enumerate(run["steps"]):
                assert torch.equal(avg, (0 + sent0[step] + 2 * sent0[step]) / 2), (rank, pairwise, step)
                assert counted == (nbytes, nbytes, 1)  # one fixed buffer each way, padding included
                # One exchange per step and no size exchange before it.
                assert calls == ({"isend": 1, "irecv": 1} if pairwise else {"all_to_all_single": 1})
            # The 10 small entries never passed tau; the 3 over the cap left at step 2.
            held = torch.zeros(40)
            held[20:30] = 1.0
            assert torch.equal(run["residual"], held) and run["capped"] == 3
    for pairwise in (False, True):  # identical on both ranks
        for a, b in zip(reduced[0][pairwise]["steps"], reduced[1][pairwise]["steps"]):
            assert torch.equal(a[0], b[0])


STEPS = 5


def ddp_worker(topo):
    """``STEPS`` steps of a small MLP in DDP with a capped DCT hook and small buckets, inputs
    growing 2x a step (so that, the threshold held from step 0, the cap binds), collective
    and pairwise. Beside it a reference compressor fed the same local gradients per
    parameter; its messages gathered from both ranks and summed in rank order by hand."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    torch.set_num_threads(1)
    calls: dict = {}
    _count_collectives(calls)
    world = topo.group_size
    out = {}
    for pairwise in (False, True):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 1))
        ref_model = copy.deepcopy(model)
        comp, ref, ledger = DCTCompressor(0.05, 10), DCTCompressor(0.05, 10), CommLedger()
        hook = CompressedAllReduce(comp, ledger, pairwise=pairwise)("m", model)
        names = {id(p): n for n, p in model.named_parameters()}
        layouts: list = []

        def spy(group, bucket, hook=hook, layouts=layouts, names=names):
            layouts[-1].append([names[id(p)] for p in bucket.parameters()])
            return hook(group, bucket)

        # ~100 B buckets: one per layer or tensor
        ddp = DistributedDataParallel(model, process_group=topo.group, bucket_cap_mb=0.1 / 1024)
        ddp.register_comm_hook(topo.group, spy)
        g = torch.Generator().manual_seed(topo.rank)
        steps, fed, sent_sum = [], {}, {}
        for step in range(STEPS):
            x = torch.randn(8, 16, generator=g) * 2.0 ** step
            ref_model.zero_grad()
            ref_model(x).square().mean().backward()
            expected = {}
            for n, p in ref_model.named_parameters():
                mine = ref.compress(f"m.{n}", p.grad).to_dense()
                every = [torch.empty_like(mine) for _ in range(world)]
                dist.all_gather(every, mine, group=topo.group)  # (not counted)
                total = torch.zeros_like(mine)
                for r in range(world):
                    total += every[r]
                expected[n] = total / world
                fed[n] = fed.get(n, 0) + p.grad.reshape(-1)
                sent_sum[n] = sent_sum.get(n, 0) + mine
            calls.clear()
            layouts.append([])
            ddp.zero_grad()
            ddp(x).square().mean().backward()
            ledger.step_end()
            t = ledger.totals(scope="last_step")
            steps.append({"grads": {n: p.grad.reshape(-1).clone() for n, p in model.named_parameters()},
                          "expected": expected, "bytes": (t.sent, t.received), "calls": dict(calls)})
        sizes = {n: p.numel() for n, p in model.named_parameters()}
        residuals_equal = all(torch.equal(comp.residual(f"m.{n}"), ref.residual(f"m.{n}")) for n in sizes)
        # Error feedback: sent over the steps + what is held = every gradient fed, per entry.
        feedback_err = max((sent_sum[n] + ref.residual(f"m.{n}") - fed[n]).abs().max().item() for n in sizes)
        out[pairwise] = {"steps": steps, "layouts": layouts, "sizes": sizes,
                         "residuals_equal": residuals_equal, "feedback_err": feedback_err,
                         "capped": (comp.capped_steps, ref.capped_steps),
                         "capacity": {n: comp.capacity(k) for n, k in sizes.items()}}
    return out


@pytest.fixture(scope="module")
def hooked():
    return run_ranks(ddp_worker, 2)


@pytest.mark.distributed
def test_ddp_hooks_sum_the_ranks_bounded_messages_without_a_size_exchange(hooked):
    for rank, out in enumerate(hooked):
        for pairwise in (False, True):
            run = out[pairwise]
            assert run["residuals_equal"] and run["feedback_err"] < 1e-4
            capped, ref_capped = run["capped"]
            assert capped == ref_capped > 0  # the cap held entries back on some steps
            assert len(run["layouts"][-1]) >= 3  # several buckets after DDP's rebuild
            for s, step in enumerate(run["steps"]):
                for n, grad in step["grads"].items():  # the same bits as the sum by hand
                    assert torch.equal(grad, step["expected"][n]), (rank, pairwise, s, n)
                buckets = run["layouts"][s]
                # One fixed-size exchange per bucket, no sizes: 1 collective (or 1 send and
                # 1 receive to the one peer) per bucket; the variable path makes 2.
                want = ({"isend": len(buckets), "irecv": len(buckets)} if pairwise
                        else {"all_to_all_single": len(buckets)})
                assert step["calls"] == want, (rank, pairwise, s)
                nbytes = sum(FixedLayout(sum(run["capacity"][n] for n in b), sum(run["sizes"][n] for n in b),
                                         torch.float32).nbytes for b in buckets)
                assert step["bytes"] == (nbytes, nbytes)
    for pairwise in (False, True):  # identical replicas, and the same in both exchanges
        for a, b in zip(hooked[0][pairwise]["steps"], hooked[1][pairwise]["steps"]):
            assert all(torch.equal(a["grads"][n], b["grads"][n]) for n in a["grads"])
        for a, b in zip(hooked[0][False]["steps"], hooked[0][True]["steps"]):
            assert all(torch.equal(a["grads"][n], b["grads"][n]) for n in a["grads"])



def test_the_config_sets_the_cap():
    from hybridrec.errors import ConfigError
    from hybridrec.train.build import build_dense_compressor
    from hybridrec.train.setup.config import CompressConfig
    from hybridrec.train.setup.configure import build_config

    assert build_dense_compressor(CompressConfig(dense="dct", dense_ratio=0.01)).cap == 1.25
    assert build_dense_compressor(CompressConfig(dense="dct", dense_ratio=0.01, dense_cap=2.0)).cap == 2.0
    assert build_dense_compressor(CompressConfig(dense="dct", dense_ratio=0.01, dense_cap=0)).cap is None
    with pytest.raises(ConfigError, match="compress.dense_cap must be 0"):
        build_config(overrides=["compress.dense=dct", "compress.dense_cap=0.5"])
