"""Dense gradient compressors: invariants in one process, the DDP hooks on 3 gloo ranks
against a plain all-reduce of what each rank sent, and every compressor through the
config path (build_trainer) on 2 ranks."""

import copy
import math

import pytest
import torch
import torch.distributed as dist
from distributed import run_ranks
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from hybridrec.comm import sparse_message as sm
from hybridrec.comm.compress import (
    CastCompressor,
    DCTCompressor,
    GradientCompressor,
    NoCompression,
    TopKCompressor,
    keep_count,
)
from hybridrec.comm.ddp_hooks import CompressedAllReduce, PowerSGDHooks
from hybridrec.comm.ledger import CommLedger, ring_allreduce_bytes
from hybridrec.comm.sparse_message import SparseGrad


def _grads(steps, n=200, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(n, generator=g) * (1 + i % 3) for i in range(steps)]


# -- sparse messages -----------------------------------------------------------------

@pytest.mark.parametrize("numel,count", [(1, 1), (200, 3), (200, 150), (256, 40), (257, 2),
                                         (3000, 10), (3000, 2000), (70_000, 5)])
def test_encode_decode_round_trip_in_the_smaller_layout(numel, count):
    g = torch.Generator().manual_seed(numel + count)
    idx = torch.randperm(numel, generator=g)[:count].sort().values
    msg = SparseGrad(idx, torch.randn(count, generator=g), numel)
    buf = sm.encode(msg)
    ib = sm.index_dtype(numel).itemsize
    list_bytes, bitmap_bytes = 1 + count * ib + 4 * count, 1 + math.ceil(numel / 8) + 4 * count
    assert buf.numel() == sm.encoded_size(count, numel, torch.float32) == min(list_bytes, bitmap_bytes)
    assert int(buf[0]) == (sm.TAG_BITMAP if bitmap_bytes < list_bytes else sm.TAG_INDEX_LIST)
    out = sm.decode(buf, numel, torch.float32)
    assert torch.equal(out.indices, idx) and torch.equal(out.values, msg.values)
    # A message starting at an odd byte of a received buffer decodes the same.
    shifted = torch.cat([torch.zeros(3, dtype=torch.uint8), buf])[3:]
    assert torch.equal(sm.decode(shifted, numel, torch.float32).to_dense(), msg.to_dense())


def test_index_dtype_is_the_smallest_that_fits_and_empty_messages_are_one_byte():
    assert [sm.index_dtype(n) for n in (256, 257, 65536, 65537, 2**32 + 1)] == [
        torch.uint8, torch.uint16, torch.uint16, torch.uint32, torch.int64]
    empty = SparseGrad(torch.zeros(0, dtype=torch.int64), torch.zeros(0), 1000)
    assert sm.encode(empty).numel() == 1 == sm.encoded_size(0, 1000, torch.float32)
    assert sm.decode(sm.encode(empty), 1000, torch.float32).count == 0
    bf = SparseGrad(torch.tensor([0, 9]), torch.tensor([1.5, -2.0], dtype=torch.bfloat16), 10)
    assert sm.encode(bf).numel() == sm.encoded_size(2, 10, torch.bfloat16) == 1 + 2 + 4


def test_decode_rejects_malformed_messages():
    good = sm.encode(SparseGrad(torch.tensor([1, 5]), torch.tensor([1.0, 2.0]), 300))
    for bad in (good[:-1], torch.tensor([7, 0, 0], dtype=torch.uint8), torch.zeros(0, dtype=torch.uint8)):
        with pytest.raises(ValueError):
            sm.decode(bad, 300, torch.float32)
    bitmap = sm.encode(SparseGrad(torch.arange(8), torch.ones(8), 10))
    assert int(bitmap[0]) == sm.TAG_BITMAP
    with pytest.raises(ValueError):  # one value short of the bitmap's 8
        sm.decode(bitmap[:-4], 10, torch.float32)


# -- compressors in one process --------------------------------------------------------

@pytest.mark.parametrize("make", [lambda: DCTCompressor(0.05, refresh_every=3), lambda: TopKCompressor(0.05)])
def test_sent_plus_residual_is_gradient_plus_previous_residual(make):
    comp = make()
    prev = torch.zeros(200)
    for grad in _grads(7):
        sent = comp.compress("w", grad)
        assert isinstance(sent, SparseGrad) and sent.count > 0
        assert torch.equal(sent.indices, sent.indices.sort().values)
        res = comp.residual("w")
        assert torch.equal(sent.to_dense() + res, grad + prev)
        assert torch.all(res[sent.indices] == 0)
        prev = res


def test_without_error_feedback_nothing_is_held_back():
    comp = DCTCompressor(0.05, refresh_every=2, error_feedback=False)
    for grad in _grads(3):
        sent = comp.compress("w", grad)
        assert comp.residual("w") is None
        assert torch.equal(sent.values, grad[sent.indices])


def test_dct_refreshes_the_threshold_only_every_L_steps():
    L, n = 4, 200
    comp = DCTCompressor(0.05, refresh_every=L)
    k = keep_count(0.05, n)
    taus, counts, refreshes = [], [], []
    for grad in _grads(2 * L + 2, n):
        counts.append(comp.compress("w", grad).count)
        taus.append(comp.threshold("w"))
        refreshes.append(comp.states["w"].refreshes)
    changed = [s for s in range(1, len(taus)) if taus[s] != taus[s - 1]]
    assert changed == [L, 2 * L]
    assert refreshes == [1] * L + [2] * L + [3] * 2
    assert counts[0] == counts[L] == counts[2 * L] == k
    between = [c for s, c in enumerate(counts) if s % L]
    assert len(set(between)) > 1 and set(between) != {k}  # the count sent varies in between


def test_topk_sends_exactly_k_every_step():
    comp = TopKCompressor(0.05)
    k = keep_count(0.05, 200)
    for grad in _grads(4):
        sent = comp.compress("w", grad)
        x = comp.residual("w") + sent.to_dense()  # gradient + previous residual, what it chose from
        assert sent.count == k
        assert sent.values.abs().min() >= x.abs().kthvalue(200 - k + 1).values


@pytest.mark.parametrize("make", [lambda: DCTCompressor(0.05, refresh_every=5), lambda: TopKCompressor(0.05)])
def test_all_zero_gradient_sends_nothing(make):
    comp = make()
    sent = comp.compress("w", torch.zeros(200))
    assert sent.count == 0 and torch.equal(comp.residual("w"), torch.zeros(200))
    assert sm.encode(sent).numel() == 1
    if isinstance(comp, DCTCompressor):
        assert comp.threshold("w") is None  # a zero threshold is not held...
    grad = _grads(1)[0]
    assert comp.compress("w", grad).count == keep_count(0.05, 200)  # ...so step 1 refreshes


def test_all_equal_gradient():
    grad, k = torch.full((200,), 0.5), keep_count(0.05, 200)
    topk, dct = TopKCompressor(0.05), DCTCompressor(0.05, refresh_every=5, cap=None)  # the pure threshold
    assert topk.compress("w", grad).count == k
    assert dct.compress("w", grad).count == k  # a refresh sends exactly K, ties or not
    assert dct.threshold("w") == 0.5
    first = dct.residual("w").clone()  # 0.5 where not sent, 0 where sent
    # Between refreshes every entry at or above the threshold goes: 1.0 (0.5 held back
    # + 0.5) and 0.5 alike.
    sent = dct.compress("w", grad)
    assert sent.count == 200 and torch.equal(sent.to_dense(), grad + first)
    assert torch.equal(dct.residual("w"), torch.zeros(200))


def test_warmup_sends_everything_then_compresses():
    comp = DCTCompressor(0.05, refresh_every=3, warmup_steps=2)
    grads = _grads(4)
    for grad in grads[:2]:
        sent = comp.compress("w", grad)
        assert isinstance(sent, torch.Tensor) and torch.equal(sent, grad)
        assert comp.residual("w") is None and comp.threshold("w") is None
    assert comp.compress("w", grads[2]).count == keep_count(0.05, 200)  # refresh at the first compressed step
    assert comp.states["w"].refreshes == 1


def test_ratio_one_sends_every_nonzero_entry():
    grad = _grads(1)[0]
    grad[::7] = 0
    for comp in (DCTCompressor(1.0, refresh_every=10), TopKCompressor(1.0)):
        for _ in range(3):
            sent = comp.compress("w", grad)
            assert torch.equal(sent.indices, grad.nonzero().squeeze(1))
            assert torch.equal(sent.to_dense(), grad) and not comp.residual("w").any()


def test_casts_and_no_compression():
    grad = _grads(1)[0]
    assert torch.equal(NoCompression().compress("w", grad), grad)
    for name, dt in (("fp16", torch.float16), ("bf16", torch.bfloat16)):
        sent = CastCompressor(name).compress("w", grad)
        assert sent.dtype == dt and torch.equal(GradientCompressor.decompress(sent), grad.to(dt).float())


@pytest.mark.parametrize("make", [lambda: DCTCompressor(0.05, refresh_every=3, min_numel=50),
                                  lambda: TopKCompressor(0.05, min_numel=50)])
def test_tensors_under_min_numel_go_whole_and_hold_nothing_back(make):
    comp = make()
    small, large = _grads(3, n=49), _grads(3, n=200, seed=1)
    for s, l in zip(small, large):
        sent = comp.compress("bias", s)
        assert isinstance(sent, torch.Tensor) and torch.equal(sent, s) and sent is not s
        assert comp.residual("bias") is None
        big = comp.compress("w", l)  # 50 entries and more are compressed as before
        assert isinstance(big, SparseGrad) and 0 < big.count <= big.capacity < 200
        assert comp.residual("w") is not None
    assert comp.hyperparameters()["min_numel"] == 50
    assert "min_numel" not in DCTCompressor(0.05, refresh_every=3).hyperparameters()  # old states load
    with pytest.raises(ValueError):
        TopKCompressor(0.05, min_numel=-1)


def test_constructors_validate_and_state_round_trips():
    for bad in (lambda: DCTCompressor(0.0, 1), lambda: DCTCompressor(0.1, 0), lambda: TopKCompressor(1.5),
                lambda: CastCompressor("int8"), lambda: NoCompression(warmup_steps=-1),
                lambda: PowerSGDHooks(warmup_steps=1), lambda: PowerSGDHooks(rank=0)):
        with pytest.raises(ValueError):
            bad()
    a = DCTCompressor(0.05, refresh_every=3)
    grads = _grads(5)
    for grad in grads[:2]:
        a.compress("w", grad)
    b = DCTCompressor(0.05, refresh_every=3)
    b.load_state_dict(copy.deepcopy(a.state_dict()))
    for grad in grads[2:]:
        assert torch.equal(a.compress("w", grad).to_dense(), b.compress("w", grad).to_dense())
    with pytest.raises(ValueError):
        TopKCompressor(0.05).load_state_dict(a.state_dict())
    with pytest.raises(ValueError):  # a key's tensor changed size
        a.compress("w", torch.ones(3))


# -- the DDP hooks on 3 ranks ----------------------------------------------------------

def _hook_run(topo, make):
    """DDP with a compression hook beside a reference: the same compressor fed each
    rank's local gradients, what it sent averaged by a plain all-reduce."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 5), nn.ReLU(), nn.Linear(5, 1))
    ref_model = copy.deepcopy(model)
    ledger, comp, ref = CommLedger(), make(), make()
    hook = CompressedAllReduce(comp, ledger)("m", model)
    names = {id(p): n for n, p in model.named_parameters()}
    layouts = []

    def spy(group, bucket):
        layouts.append([names[id(p)] for p in bucket.parameters()])
        return hook(group, bucket)

    ddp = DistributedDataParallel(model, process_group=topo.group)
    ddp.register_comm_hook(topo.group, spy)
    g = torch.Generator().manual_seed(topo.rank)
    steps = []
    for _ in range(5):
        x = torch.randn(8, 6, generator=g)
        ref_model.zero_grad()
        ref_model(x).square().mean().backward()
        sent = {n: ref.compress(f"m.{n}", p.grad) for n, p in ref_model.named_parameters()}
        ddp.zero_grad()
        ddp(x).square().mean().backward()
        ledger.step_end()
        sparse = [s for s in sent.values() if isinstance(s, SparseGrad)]
        whole = [s for s in sent.values() if not isinstance(s, SparseGrad)]  # sent whole: their size counts
        step = {"ledger": ledger.totals(scope="last_step"), "count": sum(s.count for s in sparse),
                "capacity": SparseGrad.cat(sparse + [SparseGrad.from_dense(w) for w in whole]).capacity
                if sparse else None,
                "numel": sum(p.numel() for p in model.parameters()), "max_err": 0.0, "residuals_equal": True}
        for n, p in model.named_parameters():
            avg = GradientCompressor.decompress(sent[n])
            dist.all_reduce(avg, group=topo.group)
            step["max_err"] = max(step["max_err"], (p.grad.reshape(-1) - avg / topo.group_size).abs().max().item())
            a, b = comp.residual(f"m.{n}"), ref.residual(f"m.{n}")
            step["residuals_equal"] &= (a is None and b is None) or torch.equal(a, b)
        steps.append(step)
    return {"layouts": layouts, "steps": steps, "grads": [p.grad.clone() for p in model.parameters()]}


def _powersgd_run(topo):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 16), nn.ReLU(), nn.Linear(16, 1))
    ledger = CommLedger()
    hooks = PowerSGDHooks(rank=1, warmup_steps=2, ledger=ledger)
    ddp = DistributedDataParallel(model, process_group=topo.group)
    ddp.register_comm_hook(topo.group, hooks("m", model))
    g = torch.Generator().manual_seed(topo.rank)
    out = []
    for _ in range(4):
        before = hooks.states["m"].total_numel_after_compression if "m" in hooks.states else 0
        ddp.zero_grad()
        ddp(torch.randn(8, 32, generator=g)).square().mean().backward()
        ledger.step_end()
        out.append((ledger.totals(scope="last_step"), hooks.states["m"].total_numel_after_compression - before))
    return {"steps": out, "grads": [p.grad.clone() for p in model.parameters()]}


def _hooks_on_ranks(topo):
    torch.set_num_threads(1)  # three ranks share the machine's cores
    return {"dct": _hook_run(topo, lambda: DCTCompressor(0.2, refresh_every=2)),
            "topk": _hook_run(topo, lambda: TopKCompressor(0.1)),
            "dct_warm": _hook_run(topo, lambda: DCTCompressor(0.3, refresh_every=3, warmup_steps=2, cap=None)),
            # the biases and the 5-entry output weight go whole beside the compressed 30-entry weight
            "dct_min": _hook_run(topo, lambda: DCTCompressor(0.2, refresh_every=2, min_numel=6)),
            "powersgd": _powersgd_run(topo)}


@pytest.mark.distributed
def test_hooks_on_three_ranks():
    world = 3
    results = run_ranks(_hooks_on_ranks, world)
    for kind in ("dct", "topk", "dct_warm", "dct_min"):
        runs = [r[kind] for r in results]
        # DDP rebuilt its bucket after step 0 in another order; residuals keyed by
        # parameter follow it, so every step matches the per-parameter reference.
        assert runs[0]["layouts"][0] != runs[0]["layouts"][1]
        for rank, run in enumerate(runs):
            for s, step in enumerate(run["steps"]):
                assert step["residuals_equal"] and step["max_err"] < 1e-6, (kind, rank, s)
                ring = ring_allreduce_bytes(4 * step["numel"], world)
                led = step["ledger"]
                assert led.original == ring and led.calls == 1
                if kind == "dct_warm" and s < 2:  # warm-up: a plain fp32 all-reduce
                    assert led.sent == led.received == ring
                    continue
                if step["capacity"] is not None:  # bounded (top-k, capped DCT): fixed-size buffers, no sizes
                    fixed = sm.FixedLayout(step["capacity"], step["numel"], torch.float32).nbytes
                    assert led.sent == led.received == (world - 1) * fixed
                    continue
                mine = sm.encoded_size(step["count"], step["numel"], torch.float32)
                assert led.sent == (world - 1) * (sm.SIZE_BYTES + mine)
                others = sum(sm.encoded_size(r["steps"][s]["count"], step["numel"], torch.float32)
                             for q, r in enumerate(runs) if q != rank)
                assert led.received == (world - 1) * sm.SIZE_BYTES + others
        for a, b in zip(runs[0]["grads"], runs[2]["grads"]):
            assert torch.equal(a, b)  # summed in rank order everywhere: identical replicas
    # PowerSGD: Linear(32,16).weight is compressed (P 16 + Q 32 floats); its bias and the
    # second layer (16 + 16 + 1 floats) go uncompressed; before step 2 a plain all-reduce.
    total = 4 * (32 * 16 + 16 + 16 + 1)
    for run in (r["powersgd"] for r in results):
        for s, (led, numel_after) in enumerate(run["steps"]):
            assert led.original == ring_allreduce_bytes(total, world)
            if s < 2:
                assert led.sent == led.original
            else:
                assert numel_after == 33 + 16 + 32
                assert led.sent == led.received == sum(ring_allreduce_bytes(4 * n, world) for n in (33, 16, 32))
    for a, b in zip(results[0]["powersgd"]["grads"], results[1]["powersgd"]["grads"]):
        assert torch.equal(a, b)


# -- every compressor through the config path on 2 ranks --------------------------------

SETTINGS = {
    "none": [],
    "dct_eta1": ["compress.dense=dct", "compress.dense_ratio=1", "compress.dense_refresh_every=2"],
    "topk_eta1": ["compress.dense=topk", "compress.dense_ratio=1"],
    "dct": ["compress.dense=dct", "compress.dense_ratio=0.05", "compress.dense_refresh_every=3"],
    "dct_pairwise": ["compress.dense=dct", "compress.dense_ratio=0.05", "compress.dense_refresh_every=3",
                     "dist.exchange=pairwise"],
    "topk": ["compress.dense=topk", "compress.dense_ratio=0.05"],
    "fp16": ["compress.dense=fp16"],
    "bf16": ["compress.dense=bf16"],
    "powersgd": ["compress.dense=powersgd", "compress.powersgd_rank=2"],
}
STEPS = 5


@pytest.fixture(scope="module")
def dataset(shared_dataset):
    return shared_dataset(days=2, rows=1000)


def _train_settings(topo, data, run_root):
    from hybridrec.train.build import build_trainer
    from hybridrec.train.setup.configure import build_config
    from hybridrec.train.setup.recipes import recipe

    out = {}
    for name, extra in SETTINGS.items():
        cfg = build_config(recipe("demo"), overrides=[
            f"data.path={data}", f"train.run_dir={run_root}/{name}", "model.embedding_dim=8",
            "model.bottom_mlp=32,8", "model.top_mlp=32,1", "data.batch_size=32", "train.threads=1",
            "train.progress=false", *extra])
        trainer = build_trainer(cfg, topo=topo)
        losses = []
        for step, batch in zip(range(STEPS), trainer.pipeline.loader):
            losses.append(float(trainer.train_step(batch)))
        dense = {k: v.clone() for k, v in trainer.model.state_dict().items() if k.startswith(("bottom", "top"))}
        out[name] = {"losses": losses, "dense": dense,
                     "comm": trainer.ledger.totals(category="dense_allreduce")}
    return out


@pytest.mark.distributed
def test_every_compressor_through_the_config_on_two_ranks(dataset, tmp_path):
    ranks = run_ranks(_train_settings, 2, str(dataset), str(tmp_path), timeout_s=120)
    r0 = ranks[0]
    for name, res in r0.items():
        assert len(res["losses"]) == STEPS and all(math.isfinite(x) for x in res["losses"]), name
        assert res["comm"].calls >= 2 * STEPS, name  # at least one bucket per arch per step
        for k, v in res["dense"].items():  # the replicas agree
            assert torch.equal(v, ranks[1][name]["dense"][k]), (name, k)
    # eta = 1 sends every nonzero entry: the same training as the plain all-reduce, bit for bit.
    for name in ("dct_eta1", "topk_eta1"):
        assert r0[name]["losses"] == r0["none"]["losses"]
        for k, v in r0["none"]["dense"].items():
            assert torch.equal(v, r0[name]["dense"][k]), (name, k)
    # The receive-first pairwise exchange moves the same bytes to the same sums.
    assert r0["dct_pairwise"]["losses"] == r0["dct"]["losses"] and r0["dct_pairwise"]["comm"] == r0["dct"]["comm"]
    for k, v in r0["dct"]["dense"].items():
        assert torch.equal(v, r0["dct_pairwise"]["dense"][k]), k
    ratio = {name: res["comm"].ratio for name, res in r0.items()}
    assert ratio["none"] == 1.0
    assert ratio["fp16"] == ratio["bf16"] == 2.0
    assert ratio["dct"] > 3 and ratio["topk"] > 3
    assert ratio["powersgd"] > 1  # after its 2 warm-up steps
