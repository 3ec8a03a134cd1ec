"""Codecs of the pooled-embedding hop: invariants in one process; the coded output
all-to-all on 2 gloo ranks against the float32 hop plus a local round trip; byte
counts against the cost model; eta = 1 equals uncompressed training; the config path."""

import math

import pytest
import torch
import torch.nn.functional as F
from distributed import run_ranks

from hybridrec.comm import native_topk
from hybridrec.comm.codecs import (
    KEY_COLS,
    TOPK_IMPLS,
    CastCodec,
    Int8RowwiseCodec,
    TopKCodec,
    from_bytes,
    index_dtype,
    make_codec,
    round_trip,
    row_topk,
    to_bytes,
    tune_topk,
)
from hybridrec.comm.ledger import CommLedger
from hybridrec.model.dlrm import DLRM
from hybridrec.model.embedding import EmbeddingBagCollection, TableConfig
from hybridrec.parallel import plan as P
from hybridrec.parallel.cost_model import predict_step_bytes
from hybridrec.parallel.layout import build_layout, owner_layout
from hybridrec.parallel.parallelize import parallelize_dlrm
from hybridrec.parallel.sharded_embedding import ShardedEmbeddingBagCollection
from hybridrec.sparse.keyed_jagged import Batch, KeyedJagged
from hybridrec.train.loop.sparse_optim import combined_sparse_optimizer
from hybridrec.train.loop.step import sparse_grads

CODECS = {
    "fp32": lambda: CastCodec(torch.float32),
    "fp16": lambda: make_codec("fp16"),
    "bf16": lambda: make_codec("bf16"),
    "int8": lambda: make_codec("int8"),
    "dct": lambda: make_codec("dct", eta=0.25),
    "dct_bf16": lambda: make_codec("dct", eta=0.1, values="bf16"),
}


def check_decoded(name, codec, x, y):
    """What each codec promises about decode(encode(x)), row by row."""
    if name == "fp32":
        assert torch.equal(y, x)
    elif name in ("fp16", "bf16"):
        assert torch.equal(y, x.to(codec.dtype).float())
    elif name == "int8":
        rng = x.amax(-1, keepdim=True) - x.amin(-1, keepdim=True)
        assert ((y - x).abs() <= rng / 255 / 2 * (1 + 1e-4) + 1e-6).all()
    else:
        kept = y != 0  # x has no zeros
        assert (kept.sum(-1) == codec.k(x.shape[-1])).all()
        assert torch.equal(y[kept], x.to(codec.dtype).float()[kept])
        # The kept magnitudes are the row's largest.
        inf = torch.tensor(float("inf"))
        smallest_kept = torch.where(kept, x.abs(), inf).amin(-1)
        assert (smallest_kept >= torch.where(kept, -inf, x.abs()).amax(-1)).all()


@pytest.mark.parametrize("name", CODECS)
@pytest.mark.parametrize("cols", [1, 3, 16, 300])
def test_round_trip_and_exact_sizes(name, cols):
    codec = CODECS[name]()
    x = torch.randn(7, 2, cols, generator=torch.Generator().manual_seed(cols))
    payload, _ = codec.encode(x)
    assert payload.dtype == torch.uint8 and payload.shape == (7, 2, codec.row_bytes(cols))
    assert payload.numel() == codec.encoded_bytes(14, cols)
    y, state = codec.decode(payload, cols)
    assert y.dtype == torch.float32 and y.shape == x.shape
    check_decoded(name, codec, x, y)
    g = codec.encode_grad(torch.randn_like(x), state)
    assert g.dtype == torch.uint8 and g.numel() == codec.grad_bytes(14, cols)


@pytest.mark.parametrize("name", CODECS)
@pytest.mark.parametrize("value", [0.0, 1.5, -3.25])
def test_all_equal_and_all_zero_rows(name, value):
    codec = CODECS[name]()
    x = torch.full((4, 16), value)
    y, _ = codec.decode(codec.encode(x)[0], 16)
    if isinstance(codec, TopKCodec):  # k entries kept, all of the same value
        assert ((y == value) | (y == 0)).all()
        assert ((y != 0).sum(1) == (codec.k(16) if value else 0)).all()
    else:  # every other codec represents a constant row exactly
        assert torch.equal(y, x)


def test_sizes_by_formula():
    assert [index_dtype(c) for c in (1, 256, 257, 2**15, 2**15 + 1)] == [
        torch.uint8, torch.uint8, torch.int16, torch.int16, torch.int32]
    dct = TopKCodec(0.05)
    assert (dct.k(16), dct.row_bytes(16), dct.grad_row_bytes(16)) == (1, 5, 4)
    assert (dct.k(64), dct.row_bytes(64), dct.grad_row_bytes(64)) == (4, 20, 16)
    assert TopKCodec(0.05).k(20) == 1  # 0.05 * 20 is 1.0000000000000002 in floats
    assert (TopKCodec(0.1, "fp16").row_bytes(300), TopKCodec(1.0).k(1)) == (30 * 4, 1)
    assert (Int8RowwiseCodec().row_bytes(16), Int8RowwiseCodec().grad_row_bytes(16)) == (24, 32)
    assert make_codec("none") is None
    with pytest.raises(ValueError):
        make_codec("fp8")
    with pytest.raises(ValueError):
        TopKCodec(0.0)


def _native_or_skip(impl):
    if impl == "native":
        try:
            native_topk.library()
        except RuntimeError as e:
            pytest.skip(str(e))


@pytest.mark.parametrize("impl", TOPK_IMPLS)
def test_row_topk_keeps_the_largest_entries_of_every_row(impl):
    _native_or_skip(impl)
    mag = torch.randn(50, 3, 64, generator=torch.Generator().manual_seed(0)).abs()  # no ties
    idx = row_topk(mag, 4, impl)
    assert idx.shape == (50, 3, 4) and idx.dtype == torch.int64
    assert torch.equal(idx.sort(-1).values, mag.topk(4, -1).indices.sort(-1).values)
    # Ties: k distinct positions holding the row's k largest magnitudes.
    tied = torch.tensor([[1.0, 2.0, 2.0, 2.0, 0.0, 3.0]])
    got = row_topk(tied, 3, impl)[0]
    assert got.unique().numel() == 3 and sorted(tied[0, got].tolist()) == [2.0, 2.0, 3.0]
    assert torch.equal(row_topk(mag[..., :4], 4, impl).sort(-1).values, torch.arange(4).expand(50, 3, 4))
    half = row_topk(mag.half(), 4, impl)  # numpy takes float32 only: the others go to torch.topk
    assert torch.equal(half.sort(-1).values, mag.half().topk(4, -1).indices.sort(-1).values)


def test_codec_encodes_the_same_with_either_selection():
    x = torch.randn(32, 5, 16, generator=torch.Generator().manual_seed(1))
    codec = TopKCodec(0.2, "fp16")
    out = {}
    _native_or_skip("native")
    for impl in TOPK_IMPLS:
        codec.impls[16] = impl
        out[impl] = codec.decode(codec.encode(x)[0], 16)[0]
    for impl in TOPK_IMPLS[1:]:
        assert torch.equal(out["torch"], out[impl]), impl


def test_key_selection_signs_zeros_and_the_widest_rows():
    """``keys`` selects by magnitude whatever the sign, keeps k distinct positions among exact
    zeros and -0.0, and works up to KEY_COLS wide (wider rows go to torch.topk)."""
    x = torch.tensor([[-5.0, 1.0, -0.0, 0.0, 4.0, -3.0]])
    assert sorted(row_topk(x, 3, "keys")[0].tolist()) == [0, 4, 5]
    zeros = torch.tensor([[0.0, -0.0, 0.0, -0.0]])
    assert sorted(row_topk(zeros, 2, "keys")[0].tolist()) == [2, 3]  # ties: the higher columns
    for cols in (2, 255, KEY_COLS, KEY_COLS + 1):
        x = torch.randn(40, cols, generator=torch.Generator().manual_seed(cols))
        got = x.abs().gather(-1, row_topk(x, 2, "keys")).sort(-1).values
        torch.testing.assert_close(got, x.abs().topk(2, -1).values.sort(-1).values, rtol=2**-15, atol=0)


def test_tune_topk_chooses_by_measurement_and_caches(tmp_path, monkeypatch):
    monkeypatch.setenv("HYBRIDREC_CACHE_DIR", str(tmp_path))
    codec = TopKCodec(0.05, "fp16")
    (choice,) = tune_topk([(codec, 512, 64)])
    assert choice.source == "measured" and set(choice.seconds) | set(choice.excluded) == set(TOPK_IMPLS)
    assert set(choice.excluded) <= {"native"}  # (only where no C compiler runs)
    assert choice.impl == min(choice.seconds, key=lambda i: (choice.seconds[i], TOPK_IMPLS.index(i)))
    assert codec.impls == {64: choice.impl} and choice.key == "dct_codec cpu 512x64 k4 fp16"
    other = TopKCodec(0.05, "fp16")
    (again,) = tune_topk([(other, 512, 64)])
    assert again.source == "cached" and other.impls == {64: choice.impl}
    (remeasured,) = tune_topk([(other, 512, 64)], mode="measure")
    assert remeasured.source == "measured"


def test_native_selection_signs_nan_ties_and_widths():
    """``native`` keeps the k largest magnitudes whatever the sign and the width, the earlier
    column among ties, a NaN as the largest (as torch.topk)."""
    _native_or_skip("native")
    x = torch.tensor([[-5.0, 1.0, -0.0, 0.0, 4.0, -3.0]])
    assert sorted(row_topk(x, 3, "native")[0].tolist()) == [0, 4, 5]
    assert row_topk(torch.tensor([[0.0, -0.0, 0.0, -0.0]]), 2, "native")[0].tolist() == [0, 1]
    nan = torch.tensor([[1.0, float("nan"), -7.0, 2.0]])
    assert sorted(row_topk(nan, 2, "native")[0].tolist()) == sorted(nan.abs().topk(2, -1).indices[0].tolist())
    for cols, k in ((1, 1), (3, 2), (7, 3), (64, 4), (65, 5), (200, 10), (300, 299)):
        x = torch.randn(30, cols, generator=torch.Generator().manual_seed(cols))
        x[::4] = x[::4].round()  # rows with ties
        got = x.abs().gather(-1, row_topk(x, k, "native")).sort(-1).values
        assert torch.equal(got, x.abs().topk(k, -1).values.sort(-1).values), (cols, k)
    with pytest.raises(ValueError):
        native_topk.row_topk(torch.ones(2, 3), 4)


@pytest.mark.parametrize("values", ["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("cols, eta", [(16, 0.2), (64, 0.05), (300, 0.02), (33000, 0.0001)])
def test_native_codec_gives_the_torch_paths_bytes_both_ways(values, cols, eta):
    """``native`` runs the whole codec in C: the same payload as the torch path with the same
    selection, the same decoded rows, and the same gradients' bytes and rows, whatever the
    value type and the positions' integer type (uint8, int16, int32); NaN, infinities,
    subnormals and values beyond float16's range included."""
    _native_or_skip("native")
    gen = torch.Generator().manual_seed(cols)
    x = torch.randn(40, 3, cols, generator=gen) * torch.logspace(-9, 6, 40).view(40, 1, 1)
    x[0, 0, :3] = torch.tensor([float("nan"), float("inf"), -float("inf")])
    x[1, 1, :2] = torch.tensor([7e4, -1e-7])  # beyond float16's max; a float16 subnormal
    grad = torch.randn(40, 3, cols, generator=gen) * 1e3
    native, ref = TopKCodec(eta, values), TopKCodec(eta, values)
    native.impls[cols], ref.impls[cols] = "native", "native"
    payload, sent = native.encode(x)
    ref_idx = row_topk(x, ref.k(cols), "native")  # the torch path, step by step
    ref_payload = torch.cat([to_bytes(x.gather(-1, ref_idx).to(ref.dtype)),
                             to_bytes(ref_idx.to(index_dtype(cols)))], dim=-1)
    split = ref.k(cols) * torch.empty(0, dtype=ref.dtype).element_size()
    assert torch.equal(payload[1:], ref_payload[1:]) and torch.equal(payload[0, 1:], ref_payload[0, 1:])
    assert torch.equal(payload[0, 0, split:], ref_payload[0, 0, split:])  # (a NaN's bits may differ)
    out, received = native.decode(payload, cols)
    ref.impls.clear()  # (decode with torch)
    ref_out, ref_received = ref.decode(ref_payload, cols)
    assert torch.equal(out.isnan(), ref_out.isnan()) and torch.equal(out.nan_to_num(), ref_out.nan_to_num())
    gbytes = native.encode_grad(grad, received)
    assert torch.equal(gbytes, ref.encode_grad(grad, ref_received))
    want = ref.decode_grad(gbytes, cols, ref_idx)
    assert torch.equal(native.decode_grad(gbytes, cols, sent), want)
    # written into a given tensor: in place where it is contiguous, else through a copy;
    # whatever it held before is overwritten (zeros but the k entries)
    for codec, state in ((native, sent), (ref, ref_idx)):
        into = torch.full((40, 3, cols), 7.0)
        assert codec.decode_grad(gbytes, cols, state, out=into) is into and torch.equal(into, want)
        wide = torch.full((40, 3, cols + 5), 7.0)
        got = codec.decode_grad(gbytes, cols, state, out=wide[..., 2 : cols + 2])
        assert torch.equal(got, want) and torch.equal(wide[..., 2 : cols + 2], want)
        assert (wide[..., :2] == 7).all() and (wide[..., cols + 2 :] == 7).all()
    # a gradient the C codec does not take (not float32) goes through torch with the same positions
    assert torch.equal(native.encode_grad(grad.double(), received), ref.encode_grad(grad.double(), ref_received))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_native_casts_round_to_nearest_even_as_torch(dtype):
    """The C codec's float16 and bfloat16 casts give torch's bits for every non-NaN float32
    (random bit patterns, and the float16 range's edges and subnormals densely), and a NaN
    stays a NaN; decoding gives torch's float32 back."""
    _native_or_skip("native")
    bits = torch.cat([torch.randint(-2**31, 2**31 - 1, (400_000,), generator=torch.Generator().manual_seed(3)),
                      torch.arange(0x33000000 - 5000, 0x48000000, 9973),
                      torch.tensor([0x477fefff, 0x477ff000, 0x477fe000, 0x387fffff, 0x38800000, 0x33000000,
                                    0x33000001, 0x32ffffff, 0x7f7fffff, 0x7f800000, 0x7fc00000, 1, 0])])
    x = bits.to(torch.int32).view(torch.float32).reshape(-1, 1)
    payload = native_topk.encode(x, 1, dtype, 1)
    got = payload[:, :2].contiguous().view(dtype)
    nan = x.isnan()
    assert torch.equal(got.isnan(), nan)
    assert torch.equal(got[~nan].view(torch.int16), x[~nan].to(dtype).view(torch.int16))
    back = native_topk.decode(payload, 1, 1, dtype, 1)
    assert torch.equal(back[~nan].view(torch.int32), x[~nan].to(dtype).float().view(torch.int32))


def test_native_codec_refuses_a_message_with_a_column_outside_its_rows():
    _native_or_skip("native")
    codec = TopKCodec(0.25, "fp16")
    codec.impls[8] = "native"
    payload, _ = codec.encode(torch.randn(5, 8))
    payload[3, -1] = 8  # a position past the row's 8 columns
    with pytest.raises(ValueError, match="column"):
        codec.decode(payload, 8)
    with pytest.raises(ValueError, match="column"):
        codec.encode_grad(torch.randn(5, 8), payload)


def test_native_selection_left_out_where_it_cannot_be_built(tmp_path, monkeypatch):
    """No compiler: calling it raises with the reason, and the race leaves it out, saying why;
    a cache directory others may write is refused (no code loaded from it)."""
    monkeypatch.setenv("HYBRIDREC_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(native_topk, "_LIB", None)
    monkeypatch.setattr(native_topk, "_ERROR", None)
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    with pytest.raises(RuntimeError, match="no C compiler"):
        row_topk(torch.randn(4, 8), 2, "native")
    with pytest.warns(RuntimeWarning, match="native"):
        (choice,) = tune_topk([(TopKCodec(0.25), 64, 8)], mode="measure")
    assert "no C compiler" in choice.excluded["native"] and choice.impl != "native"
    monkeypatch.setattr(native_topk, "_ERROR", None)
    monkeypatch.delenv("CC")
    (tmp_path / "native").mkdir(mode=0o777)
    (tmp_path / "native").chmod(0o777)
    with pytest.raises(RuntimeError, match="only this user may write"):
        native_topk.row_topk(torch.randn(4, 8), 2)


def test_from_bytes_at_an_unaligned_offset():
    x = torch.randn(5)
    buf = torch.cat([torch.zeros(3, dtype=torch.uint8), x.view(torch.uint8)])
    assert torch.equal(from_bytes(buf[3:], torch.float32), x)


def test_eta_one_is_the_exact_identity_both_ways():
    x = torch.randn(9, 16, requires_grad=True)
    y = round_trip(x, TopKCodec(1.0))
    assert torch.equal(y, x)
    g = torch.randn(9, 16)
    y.backward(g)
    assert torch.equal(x.grad, g)


@pytest.mark.parametrize("values", ["fp32", "fp16"])
def test_backward_sends_the_gradient_at_the_kept_positions(values):
    codec = TopKCodec(0.2, values)
    x = torch.randn(6, 3, 10, requires_grad=True)
    y = round_trip(x, codec)
    mask = torch.zeros_like(x).scatter_(-1, x.abs().topk(codec.k(10), -1).indices, 1.0)
    g = torch.randn_like(x)
    y.backward(g)
    assert torch.equal(x.grad, (g.to(codec.dtype).float()) * mask)
    if values == "fp32":  # the chain rule through x * mask
        x2 = x.detach().clone().requires_grad_()
        (x2 * mask).backward(g)
        assert torch.equal(x.grad, x2.grad)


def test_quantizers_backward_is_straight_through_in_their_grad_dtype():
    x = torch.randn(4, 8, requires_grad=True)
    g = torch.randn(4, 8)
    for codec, dtype in ((make_codec("fp16"), torch.float16), (make_codec("int8"), torch.bfloat16)):
        x.grad = None
        round_trip(x, codec).backward(g)
        assert torch.equal(x.grad, g.to(dtype).float())


def test_owner_layout_groups_neighbours_with_the_same_codec_and_width():
    a, b = TopKCodec(0.5), CastCodec()
    lay = owner_layout([(4, a), (4, a), (2, a), (4, b)])
    assert [(g.start, g.n, g.cols) for g in lay.groups] == [(0, 2, 4), (8, 1, 2), (10, 1, 4)]
    assert lay.width == 14
    assert lay.fwd_bytes == 2 * a.row_bytes(4) + a.row_bytes(2) + 16
    assert lay.bwd_bytes == 2 * a.grad_row_bytes(4) + a.grad_row_bytes(2) + 16


def test_policy_picks_tables_by_name_and_rows():
    from hybridrec.errors import ConfigError
    from hybridrec.train.backends import build_embedding_codecs
    from hybridrec.train.setup.configure import build_config

    plan = make_plan("mixed")  # t2 is data-parallel: it has no hop to code

    def chosen(*overrides):
        cfg = build_config(overrides=list(overrides))
        return sorted(build_embedding_codecs(cfg, tables(), plan))

    assert chosen() == []
    assert chosen("compress.embedding=dct") == ["t0", "t1"]
    assert chosen("compress.embedding=int8", "compress.embedding_min_rows=30") == ["t1"]
    assert chosen("compress.embedding=fp16", "compress.embedding_tables=t0,t2") == ["t0"]
    from hybridrec.train.setup.rules import check_plan  # (a table the plan lacks: a plan rule)

    with pytest.raises(ConfigError, match="t9"):
        check_plan(build_config(overrides=["compress.embedding=dct", "compress.embedding_tables=t9"]), plan)


# -- 2 gloo ranks ----------------------------------------------------------------------
DIM = 8
TABLES = [("t0", 24, ["f0"]), ("t1", 40, ["f1", "f2"]), ("t2", 12, ["f3"])]
BATCH = [5, 3]  # uneven local batches on purpose


def tables():
    return [TableConfig(name=n, num_embeddings=r, embedding_dim=DIM, features=f)
            for n, r, f in TABLES]


def make_plan(kind, world=2, replicated=True):
    """``kind``: table_wise, row_wise, column_wise or mixed (a row-wise, a column-wise and a
    third table: replicated, which has no hop, or with ``replicated=False`` table-wise on the
    last rank)."""
    every = list(range(world))
    tp = {}
    for i, (n, rows, _) in enumerate(TABLES):
        if kind == "table_wise":
            tp[n] = P.table_wise(n, rows, DIM, i % world)
        elif kind == "row_wise":
            tp[n] = P.row_wise(n, rows, DIM, every)
        elif kind == "column_wise":
            tp[n] = P.column_wise(n, rows, DIM, every)
        else:  # mixed
            third = P.data_parallel(n, rows, DIM, world) if replicated else P.table_wise(n, rows, DIM, world - 1)
            tp[n] = [P.row_wise(n, rows, DIM, every), P.column_wise(n, rows, DIM, every), third][i]
    plan = P.ShardingPlan(world_size=world, local_world_size=world, tables=tp)
    plan.validate()
    return plan


def local_kjt(rank, b, step=0):
    g = torch.Generator().manual_seed(100 * step + rank)
    keys, vals, lens = [], [], []
    for _, rows, feats in TABLES:
        for f in feats:
            ln = torch.randint(1, 4, (b,), generator=g)
            keys.append(f)
            lens.append(ln)
            vals.append(torch.randint(0, rows, (int(ln.sum()),), generator=g))
    return KeyedJagged.from_lengths_per_key(keys, vals, lens)


def local_mask(x, codec):
    """DCT-MP by plain autograd: ``x * mask`` (float32 values); otherwise the codec's
    own round trip in one process."""
    if isinstance(codec, TopKCodec) and codec.values == "fp32":
        idx = x.detach().abs().topk(codec.k(x.shape[-1]), dim=-1).indices
        return x * torch.zeros_like(x).scatter_(-1, idx, 1.0)
    return round_trip(x, codec)


class RoundTripReference(ShardedEmbeddingBagCollection):
    """The float32 hop, then every piece received from another rank through
    :func:`local_mask` (a rank's own block does not travel: it is not coded)."""

    def __init__(self, tables, plan, *args, codecs, **kwargs):
        super().__init__(tables, plan, *args, **kwargs)
        self.ref_layouts = build_layout(tables, plan, codecs).coded

    def _output(self, blocks, kjt):
        coded = []
        for owner, (block, lay) in enumerate(zip(blocks, self.ref_layouts)):
            pieces = [local_mask(block[:, g.start : g.start + g.width].reshape(-1, g.n, g.cols),
                                 g.codec).reshape(-1, g.width) for g in lay.groups]
            coded.append(torch.cat(pieces, 1) if pieces and owner != self.topo.rank else block)
        return super()._output(coded + blocks[len(self.ref_layouts):], kjt)


def ledger_counts(ledger):
    return {d: (c.sent, c.received, c.original) for d in ("fwd", "bwd")
            for c in [ledger.totals(category="output_dist", direction=d)]}


HOP_CASES = [("table_wise", "dct"), ("row_wise", "dct"), ("column_wise", "dct"),
             ("column_wise", "dct_bf16"), ("mixed", "int8"), ("row_wise", "fp16")]


def hop_worker(topo):
    return {case: hop_case(topo, *case) for case in HOP_CASES}


def hop_case(topo, kind, codec_name):
    codec = CODECS[codec_name]()
    codecs = {"t0": codec, "t1": codec}  # t2 stays float32: a per-table policy
    plan = make_plan(kind)
    kjt = local_kjt(topo.rank, BATCH[topo.rank])
    w = torch.randn(BATCH[topo.rank], 4 * DIM, generator=torch.Generator().manual_seed(9))
    out = {}
    for name, cls, kw in (("coded", ShardedEmbeddingBagCollection, {"codecs": codecs}),
                          ("ref", RoundTripReference, {"codecs": codecs}),
                          ("plain", ShardedEmbeddingBagCollection, {})):
        ledger = CommLedger()
        ebc = cls(tables(), plan, topo, seed=3, ledger=ledger, **kw)
        y = ebc(kjt).values
        (y * w).sum().backward()
        grads = [(grp, ids, rows.clone()) for rows_of in ebc.pop_sparse_grads().values()
                 for grp, ids, rows, _ in rows_of]
        ledger.step_end()
        matched = [v["match"] for v in ledger.summary()["predicted_vs_counted"].values()]
        out[name] = (y.detach(), grads, ledger_counts(ledger), matched)
    pred = predict_step_bytes(plan, tables(), rank=topo.rank, batch_sizes=BATCH, codecs=codecs)
    plain = predict_step_bytes(plan, tables(), rank=topo.rank, batch_sizes=BATCH)
    return out, pred, plain


@pytest.mark.distributed
def test_coded_hop_equals_float32_hop_plus_local_mask():
    for case, (out, pred, plain) in ((c, r) for per_rank in run_ranks(hop_worker, 2)
                                     for c, r in per_rank.items()):
        (y, grads, counts, matched), (y_ref, grads_ref, counts_ref, _) = out["coded"], out["ref"]
        assert matched and all(matched), case  # the collection's own per-step prediction
        torch.testing.assert_close(y, y_ref, rtol=0, atol=1e-6)  # row-wise: summed in a new order
        assert len(grads) == len(grads_ref)
        for (g, ids, rows), (g2, ids2, rows2) in zip(grads, grads_ref):
            assert g == g2 and torch.equal(ids, ids2)
            torch.testing.assert_close(rows, rows2, rtol=0, atol=1e-6)
        # Measured bytes: what the cost model predicts, both directions; original = float32.
        for d in ("fwd", "bwd"):
            assert counts[d][:2] == pred[("output_dist", d)], (d, counts, pred)
            assert counts[d][2] == out["plain"][2][d][0] == plain[("output_dist", d)][0]
            assert counts_ref[d] == out["plain"][2][d]
        assert counts["fwd"][0] < counts["fwd"][2], case


def train_worker(topo, codec_name, kind):
    plan = make_plan(kind)
    results = []
    for codecs in ({}, {t: make_codec(codec_name, eta=1.0) for t in ("t0", "t1", "t2")}):
        torch.manual_seed(0)
        model = DLRM(num_dense=3, sparse=EmbeddingBagCollection(tables(), seed=5),
                     bottom_mlp=[8, DIM], top_mlp=[6, 1])
        model = parallelize_dlrm(model, plan, topo, codecs=codecs)
        dense_opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
        sparse = combined_sparse_optimizer("rowwise_adagrad", model.sparse, lr=0.1)
        losses = []
        for step in range(3):
            b = BATCH[topo.rank]
            g = torch.Generator().manual_seed(step * 10 + topo.rank)
            batch = Batch(torch.randn(b, 3, generator=g), local_kjt(topo.rank, b, step),
                          torch.randint(0, 2, (b,), generator=g).float())
            loss = F.binary_cross_entropy_with_logits(model(batch), batch.labels)
            dense_opt.zero_grad()
            loss.backward()
            dense_opt.step()
            sparse.step(sparse_grads(model.sparse))
            losses.append(loss.item())
        shards = {k: w.detach().clone() for k, (_, w) in model.sparse.local_shards().items()}
        results.append((losses, shards, {k: v.clone() for k, v in model.state_dict().items()}))
    return results


@pytest.mark.distributed
def test_eta_one_fp32_trains_exactly_like_uncompressed():
    for plain, coded in run_ranks(train_worker, 2, "dct", "mixed"):  # row-, column-wise, replicated
        assert plain[0] == coded[0]
        for k in plain[1]:
            assert torch.equal(plain[1][k], coded[1][k]), k
        for k in plain[2]:
            assert torch.equal(plain[2][k], coded[2][k]), k


# -- the config path, 2 ranks ------------------------------------------------------------
@pytest.fixture(scope="module")
def dataset(shared_dataset):
    return shared_dataset(days=2, rows=800)


def config_worker(topo, data, run_root):
    from hybridrec.train.build import build_trainer
    from hybridrec.train.setup.configure import build_config
    from hybridrec.train.setup.recipes import demo

    out = {}
    for codec in ("dct", "fp16", "bf16", "int8"):
        cfg = build_config(demo(), overrides=[
            f"data.path={data}", f"train.run_dir={run_root}/{codec}", "train.max_steps=6",
            "train.log_every=0", "train.progress=false", "data.batch_size=64",
            "data.eval_batch_size=400", "model.embedding_dim=8", "model.bottom_mlp=16,8",
            "model.top_mlp=16,1", "dist.sharding=row_wise", f"compress.embedding={codec}",
            "compress.embedding_ratio=0.25", "compress.embedding_min_rows=2"])
        trainer = build_trainer(cfg, topo=topo)
        result = trainer.fit()
        total = trainer.ledger.totals(category="output_dist")
        out[codec] = (result.train_loss, result.eval_metrics["log_loss"], total.original,
                      total.sent, sorted(trainer.model.sparse.codecs))
    return out


@pytest.mark.distributed
def test_each_codec_trains_through_the_config_on_two_ranks(dataset, tmp_path):
    for out in run_ranks(config_worker, 2, str(dataset), str(tmp_path), timeout_s=120):
        for codec, (loss, log_loss, original, sent, compressed) in out.items():
            assert math.isfinite(loss) and math.isfinite(log_loss), codec
            assert compressed and original > sent > 0, codec
        # Every table is row-wise and compressed. Dim 8, eta 0.25: k = 2, so a row costs
        # 2 * (4 + 1) bytes forward and 2 * 4 backward (uncompressed: 32 each way).
        assert out["dct"][2] * (10 + 8) == out["dct"][3] * (32 + 32)
