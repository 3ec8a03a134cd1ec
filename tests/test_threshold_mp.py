"""DCT-MP with a threshold over every sample's whole boundary vector (parallel/threshold_dist.py)."""

from __future__ import annotations

import pytest
import torch
from distributed import run_ranks
from test_codecs import BATCH, local_kjt, make_plan, tables

from hybridrec.comm.compress import refresh_due
from hybridrec.comm.ledger import CommLedger
from hybridrec.errors import ConfigError
from hybridrec.parallel.sharded_embedding import ShardedEmbeddingBagCollection
from hybridrec.parallel.threshold_dist import ThresholdMP, count_dtype
from hybridrec.train.backends import build_threshold_mp
from hybridrec.train.setup.configure import build_config


def test_selection_keeps_what_passes_within_the_budget():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 40, generator=g)
    x[3] = 0.0  # an all-zero row sends nothing
    x[5, :] = 10.0  # a row that passes everywhere is capped at its budget
    st = ThresholdMP(0.1, 4, cap=2.0)
    kept = st.select(x, training=True)
    assert st.budget(40) == 8 and kept.shape == (64, 40) and kept.dtype == torch.bool
    tau = x.abs().reshape(-1).topk(256).values.min()  # K = ceil(0.1 * 64 * 40)
    assert st.threshold() == pytest.approx(float(tau))
    assert not kept[3].any() and kept[5].sum() == 8
    passing = (x.abs() >= tau) & (x != 0)
    assert not (kept & ~passing).any()  # only entries at or above tau
    for r in range(64):  # a row under its budget sends every passing entry
        if passing[r].sum() <= 8:
            assert torch.equal(kept[r], passing[r]), r
        else:  # over it: the largest ones
            assert x[r].abs()[kept[r]].min() >= x[r].abs()[passing[r] & ~kept[r]].max()


def test_threshold_is_refreshed_on_the_ramp_then_every_l_and_never_in_evaluation():
    st = ThresholdMP(0.25, 5, values="fp16")
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(1))
    taus, refreshed = [], []
    for step in range(20):
        before = st.refreshes
        st.select(x * (0.9 ** step), training=True)
        refreshed.append(st.refreshes > before)
        taus.append(st.threshold())
        st.select(x * 100, training=False)  # evaluation uses the held threshold
        assert st.threshold() == taus[-1]
    assert refreshed == [refresh_due(s, 5, ramp=True) for s in range(20)]
    assert [s for s, r in enumerate(refreshed) if r] == [0, 1, 3, 7, 12, 17]
    assert taus[4] == taus[3] and taus[7] < taus[3]
    assert count_dtype(255) == torch.uint8 and count_dtype(256) == torch.int16


def _grads(ebc):
    return [(g, ids, rows.clone()) for rows_of in ebc.pop_sparse_grads().values() for g, ids, rows, _ in rows_of]


def hop_worker(topo, kind, eta, cap, values):
    plan = make_plan(kind)
    kjt = local_kjt(topo.rank, BATCH[topo.rank])
    w = torch.randn(BATCH[topo.rank], 4 * 8, generator=torch.Generator().manual_seed(9))
    out = {}
    ebc = ShardedEmbeddingBagCollection(tables(), plan, topo, seed=3,
                                        threshold=ThresholdMP(eta, 10, cap=cap, values=values))
    y = ebc(kjt).values
    (y * w).sum().backward()
    out["thr"] = (y.detach(), _grads(ebc), None)
    mask = (y != 0).float()
    for name, weight in (("plain", w), ("masked", w * mask)):
        ebc = ShardedEmbeddingBagCollection(tables(), plan, topo, seed=3)
        yp = ebc(kjt).values
        (yp * weight).sum().backward()
        out[name] = (yp.detach(), _grads(ebc))
    return out


@pytest.mark.distributed
@pytest.mark.parametrize("kind", ["table_wise", "column_wise"])
def test_hop_sends_the_kept_entries_and_their_gradients(kind):
    for out in run_ranks(hop_worker, 2, kind, 0.2, 1.5, "fp32"):
        (y, grads, _), (yp, _), (_, grads_masked) = out["thr"], out["plain"], out["masked"]
        # Forward: every received entry is the owner's value; the rest is 0.
        kept = y != 0
        assert 0 < kept.sum() < kept.numel()
        assert torch.equal(y[kept], yp[kept])
        # Backward: the embedding gradients are those of mask * dL/dy (exact chain rule).
        assert len(grads) == len(grads_masked) > 0
        for (g, ids, rows), (g2, ids2, rows2) in zip(grads, grads_masked):
            assert g == g2 and torch.equal(ids, ids2)
            torch.testing.assert_close(rows, rows2, rtol=0, atol=1e-6)


def ledger_worker(topo):
    plan = make_plan("table_wise")
    ledger = CommLedger()
    ebc = ShardedEmbeddingBagCollection(tables(), plan, topo, seed=3, ledger=ledger,
                                        threshold=ThresholdMP(0.2, 10, cap=1.5, values="fp16"))
    y = ebc(local_kjt(topo.rank, BATCH[topo.rank])).values
    y.sum().backward()
    # Table-wise on 2 ranks: rank 0 owns t0 (f0) and t2 (f3), rank 1 t1 (f1, f2); y is in
    # feature order, 8 columns each.
    theirs = y[:, 8:24] if topo.rank == 0 else torch.cat([y[:, :8], y[:, 24:]], 1)
    nnz = int((theirs != 0).sum())
    t = {d: ledger.totals(category="output_dist", direction=d) for d in ("fwd", "bwd")}
    return nnz, y.shape[0], {d: (c.sent, c.received) for d, c in t.items()}


@pytest.mark.distributed
def test_ledger_counts_the_bytes_moved():
    (nnz0, b0, t0), (nnz1, b1, t1) = run_ranks(ledger_worker, 2)
    # fp16 values (2 bytes), uint8 positions (widths <= 256), a uint8 count per row, 8-byte size.
    assert t0["fwd"][1] == nnz0 * 3 + b0 + 8 and t1["fwd"][1] == nnz1 * 3 + b1 + 8
    assert t0["fwd"][0] == t1["fwd"][1] and t1["fwd"][0] == t0["fwd"][1]
    # Backward: the receiver sends 2 bytes per entry it received, no size exchange.
    assert t0["bwd"][0] == nnz0 * 2 and t1["bwd"][0] == nnz1 * 2
    assert t0["bwd"][1] == t1["bwd"][0]


@pytest.mark.distributed
def test_eta_one_cap_one_fp32_is_the_uncompressed_hop():
    for out in run_ranks(hop_worker, 2, "row_wise", 1.0, 1.0, "fp32"):
        (y, grads, _), (yp, grads_plain) = out["thr"], out["plain"]
        assert torch.equal(y, yp)
        assert len(grads) == len(grads_plain) > 0
        for (g, ids, rows), (g2, ids2, rows2) in zip(grads, grads_plain):
            assert g == g2 and torch.equal(ids, ids2) and torch.equal(rows, rows2)


def test_config_builds_the_threshold_and_refuses_what_it_does_not_take():
    plan = make_plan("table_wise")
    cfg = build_config(None, overrides=["compress.embedding=dct", "compress.embedding_select=threshold",
                                        "compress.embedding_ratio=0.05", "compress.embedding_values=bf16"])
    st = build_threshold_mp(cfg, plan, total_steps=2500)
    assert (st.eta, st.refresh_every, st.cap, st.values) == (0.05, 25, 2.0, "bf16")
    topk = build_config(None, overrides=["compress.embedding=dct"])
    assert build_threshold_mp(topk, plan, 2500) is None
    for extra, words in (("compress.embedding_tables=t0", "embedding_tables"),
                         ("compress.embedding_min_rows=10", "embedding_min_rows"),
                         ("model.arch=deepfm", "model.arch=dlrm")):
        with pytest.raises(ConfigError, match=words):  # (the config rules, before anything is built)
            build_config(None, overrides=["compress.embedding=dct", "compress.embedding_select=threshold", extra])
    with pytest.raises(ConfigError, match="embedding_select"):
        build_config(None, overrides=["compress.embedding_select=global"])
