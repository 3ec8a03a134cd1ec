"""Device exactness of the compression parts and the sparse row optimizers: each computation
runs on the target device and on the CPU from the same inputs, and the results are compared.

The target device is ``HYBRIDREC_TEST_DEVICE`` (default ``cuda``); the module is skipped
where it is not available. ``HYBRIDREC_TEST_DEVICE=cpu`` runs the same comparisons CPU
against CPU (a check of the tests themselves).

Tolerances, stated:

- Codecs (``comm/codecs.py``): casts (fp32, fp16, bf16) are correctly rounded on every
  device, so payloads and decoded values are bit-identical. int8: the row's bias (its min)
  is bit-identical and its scale (range / 255) within one float32 ulp (a GPU divides by a
  scalar through its reciprocal); a code may differ by 1 where the quantizer's rounding
  lands near a tie, so decoded values agree within one quantization step (the row's scale);
  the bf16 gradients are bit-identical. Top-k: the inputs have distinct magnitudes, so the
  kept positions are the same set (their order in the payload is not specified) and the
  decoded values and gradients are bit-identical. Byte counts are equal and equal to the
  codec's formula.
- Gradient compressors (``comm/compress.py``): elementwise adds, casts and a selection
  without ties (checked on the inputs), so payloads, decompressed values, residuals and
  DCT's thresholds are bit-identical.
- DCT-MP's threshold selection (``parallel/threshold_dist.py``): the same masks and
  thresholds, bit-identical.
- Sparse optimizers on float32 tables: the row gradients, tables and optimizer state within
  rtol 1e-5 / atol 1e-6 of the CPU's (a GPU's atomic adds change the order of sums).
- bf16 tables with SGD: stochastic rounding draws random numbers, so the values are not
  compared bit for bit: every touched entry lies within two bf16 steps of its exact float32
  update (at least 99% on one of its two bf16 neighbours), the mean rounding error is below
  a quarter of a step (signed, and signed toward the value's sign), between 10% and 40% of
  the entries take the farther neighbour (stochastic, not to nearest), entries whose update
  is over two steps move the right way, untouched rows are bit-identical, and after all
  the steps device and CPU differ by at most ``2 * steps`` bf16 steps (at the table's
  largest magnitude) per entry and by half a step on average.
- ``group_ids`` / ``aggregate_rows``: ids, offsets and permutations bit-identical (a stable
  sort); the summed rows within rtol 1e-5 / atol 1e-6.
- The lookup of one id per bag (``embedding.LOOKUPS``: ``embedding_bag``, ``index_select``
  and, on a GPU with Triton, ``triton``): copies of the rows, bit-identical to the CPU's.
- The kernel candidates that pad to multiples of 8 (the interaction's ``gather_pad`` and the
  linear ``torch_pad8``): the same values as the unpadded ones on the device within rtol 1e-5 /
  atol 1e-6 in fp32 (another summation blocking), and within bf16's rounding (rtol 2e-2) in bf16.
"""

import math
import os

import pytest
import torch

from hybridrec.comm.codecs import TOPK_IMPLS, CastCodec, Int8RowwiseCodec, TopKCodec
from hybridrec.comm.compress import (
    CastCompressor,
    DCTCompressor,
    NoCompression,
    TopKCompressor,
    keep_count,
)
from hybridrec.comm.sparse_message import SparseGrad
from hybridrec.model.embedding import EmbeddingBagCollection, TableConfig
from hybridrec.model.id_groups import aggregate_rows, group_ids
from hybridrec.parallel.threshold_dist import ThresholdMP
from hybridrec.sparse.keyed_jagged import KeyedJagged
from hybridrec.train.loop.sparse_optim import build_sparse_optimizer

DEV = os.environ.get("HYBRIDREC_TEST_DEVICE", "cuda")


def _available(dev: str) -> bool:
    try:
        kind = torch.device(dev).type
    except RuntimeError:
        return False
    if kind == "cpu":
        return True
    if kind == "cuda":
        return torch.cuda.is_available()
    backend = getattr(torch, kind, None)
    return bool(backend is not None and hasattr(backend, "is_available") and backend.is_available())


pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not _available(DEV), reason=f"needs device {DEV!r} (HYBRIDREC_TEST_DEVICE)")]

KIND = torch.device(DEV).type if _available(DEV) else DEV
EXACT = {"rtol": 0.0, "atol": 0.0}
CLOSE = {"rtol": 1e-5, "atol": 1e-6}


def on(dev: str, t: torch.Tensor) -> torch.Tensor:
    """A copy of ``t`` on ``dev`` (a copy even on the same device: the two runs share nothing)."""
    return t.to(dev, copy=True)


def assert_on_dev(*tensors: torch.Tensor) -> None:
    for t in tensors:
        assert t.device.type == KIND, (t.device, DEV)


def same(a: torch.Tensor, b: torch.Tensor, msg: str = "") -> None:
    """Bit-identical (device tensor ``a`` against CPU tensor ``b``), dtype and shape included."""
    assert a.dtype == b.dtype and a.shape == b.shape, (msg, a.dtype, b.dtype, a.shape, b.shape)
    torch.testing.assert_close(a.cpu(), b, **EXACT, equal_nan=True, msg=msg or None)


def f32(b: torch.Tensor) -> torch.Tensor:
    """uint8 ``[..., 4n]`` -> float32 ``[..., n]``."""
    return b.contiguous().view(torch.float32)


def distinct(shape, gen: torch.Generator, scale: float = 3.0) -> torch.Tensor:
    """float32 of ``shape`` with random signs and pairwise distinct nonzero magnitudes (no
    ties anywhere for a top-k to break)."""
    n = math.prod(shape)
    mag = torch.randperm(n, generator=gen).float() + 1 + 0.5 * torch.rand(n, generator=gen)
    sign = torch.randint(0, 2, (n,), generator=gen).float() * 2 - 1
    return (sign * mag * (scale / n)).view(shape)


# -- codecs ---------------------------------------------------------------------------------

CODECS = {
    "fp32": lambda: CastCodec(torch.float32),
    "fp16": lambda: CastCodec(torch.float16),
    "bf16": lambda: CastCodec(torch.bfloat16),
    "int8": lambda: Int8RowwiseCodec(),
    "dct-0.05": lambda: TopKCodec(0.05),
    "dct-0.25-fp16": lambda: TopKCodec(0.25, "fp16"),
    "dct-0.25-bf16": lambda: TopKCodec(0.25, "bf16"),
    "dct-1.0": lambda: TopKCodec(1.0),
}
ROWS, PIECES = 24, 3


def _hop(codec, x: torch.Tensor, g: torch.Tensor, dev: str):
    """One coded hop of ``x`` forward and ``g`` backward on ``dev``, with the size checks."""
    rows, cols = x.shape[0] * x.shape[1], x.shape[-1]
    payload, sent = codec.encode(on(dev, x))
    assert payload.dtype == torch.uint8 and payload.shape == (*x.shape[:-1], codec.row_bytes(cols))
    assert payload.numel() * payload.element_size() == codec.encoded_bytes(rows, cols)
    decoded, received = codec.decode(payload, cols)
    assert decoded.dtype == torch.float32 and decoded.shape == x.shape
    gbytes = codec.encode_grad(on(dev, g), received)
    assert gbytes.dtype == torch.uint8 and gbytes.shape == (*x.shape[:-1], codec.grad_row_bytes(cols))
    assert gbytes.numel() * gbytes.element_size() == codec.grad_bytes(rows, cols)
    gx = codec.decode_grad(gbytes, cols, sent)
    assert gx.dtype == torch.float32 and gx.shape == x.shape
    return payload, sent, decoded, received, gbytes, gx


@pytest.mark.parametrize("cols", [16, 300])
@pytest.mark.parametrize("name", CODECS)
def test_codec_on_the_device_as_on_the_cpu(name, cols):
    gen = torch.Generator().manual_seed(cols)
    x = distinct((ROWS, PIECES, cols), gen)
    g = torch.randn(ROWS, PIECES, cols, generator=gen)
    codec = CODECS[name]()
    payload, sent, dec, recv, gbytes, gx = _hop(codec, x, g, DEV)
    assert_on_dev(payload, dec, gbytes, gx)
    cpu_impls = TOPK_IMPLS if isinstance(codec, TopKCodec) else ("torch",)
    for impl in cpu_impls:  # the CPU reference with each top-k selection
        ref = CODECS[name]()
        if isinstance(ref, TopKCodec):
            ref.impls[cols] = impl
        c_payload, c_sent, c_dec, c_recv, c_gbytes, c_gx = _hop(ref, x, g, "cpu")
        assert payload.shape == c_payload.shape and gbytes.shape == c_gbytes.shape

        if isinstance(codec, CastCodec):
            same(payload, c_payload, "payload")
            same(dec, c_dec, "decoded")
            same(gbytes, c_gbytes, "gradient payload")
            same(gx, c_gx, "gradient")
            same(dec, x.to(codec.dtype).float(), "decoded = the cast")
            same(gx, g.to(codec.dtype).float(), "gradient = the cast")
            if codec.dtype == torch.float32:
                same(dec, x, "fp32 is the identity")

        elif isinstance(codec, Int8RowwiseCodec):
            scale, c_scale = f32(payload[..., cols : cols + 4]).cpu(), f32(c_payload[..., cols : cols + 4])
            torch.testing.assert_close(scale, c_scale, rtol=2.5e-7, atol=0.0, msg="scale")  # 1 ulp
            same(payload[..., cols + 4 :], c_payload[..., cols + 4 :], "bias (the row's min)")
            codes = payload[..., :cols].cpu().to(torch.int32)
            c_codes = c_payload[..., :cols].to(torch.int32)
            assert (codes - c_codes).abs().max() <= 1
            scale = c_scale  # [..., 1]
            err = (dec.cpu() - c_dec).abs()
            assert (err <= scale * (1 + 1e-5) + 1e-7).all(), float((err / scale).max())
            # and both reconstruct x to half a step (the quantizer's rounding)
            for d in (dec.cpu(), c_dec):
                assert ((d - x).abs() <= scale * (0.5 + 1e-3) + 1e-6).all()
            same(gbytes, c_gbytes, "gradient payload (bf16)")
            same(gx, c_gx, "gradient")
            same(gx, g.to(torch.bfloat16).float(), "gradient = the bf16 cast")

        else:  # TopKCodec
            k = codec.k(cols)
            assert sent.shape == (ROWS, PIECES, k) and c_sent.shape == sent.shape
            same(sent.sort(-1).values, c_sent.sort(-1).values, "kept positions (encode)")
            same(recv.sort(-1).values, c_recv.sort(-1).values, "kept positions (decode)")
            same(dec, c_dec, "decoded")
            same(gx, c_gx, "gradient")
            # what it is: x at the row's k largest magnitudes (in the value dtype), else 0
            top = x.abs().topk(k, dim=-1).indices
            mask = torch.zeros_like(x, dtype=torch.bool).scatter_(-1, top, True)
            same(dec, torch.where(mask, x.to(codec.dtype).float(), 0.0), "decoded = masked x")
            same(gx, torch.where(mask, g.to(codec.dtype).float(), 0.0), "gradient = masked g")
            assert ((dec.cpu() != 0).sum(-1) == k).all()
            if k == cols and codec.dtype == torch.float32:
                same(dec, x, "eta = 1 is the identity")


# -- gradient compressors -------------------------------------------------------------------

COMPRESSORS = {
    "none": lambda: NoCompression(),
    "none-warmup": lambda: NoCompression(warmup_steps=2),
    "fp16": lambda: CastCompressor("fp16"),
    "bf16": lambda: CastCompressor("bf16", warmup_steps=1),
    "topk": lambda: TopKCompressor(0.05),
    "topk-no-feedback": lambda: TopKCompressor(0.1, error_feedback=False),
    "dct": lambda: DCTCompressor(0.05, refresh_every=2),
    "dct-ramp-warmup": lambda: DCTCompressor(0.1, refresh_every=3, ramp=True, warmup_steps=1),
    "dct-all": lambda: DCTCompressor(1.0, refresh_every=3),
}
STEPS = 5
SHAPES = {"w": (64, 48), "b": (37,)}


def _gradient(key: str, step: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(100 * step + len(key))
    g = torch.randn(SHAPES[key], generator=gen) * (1 + step % 3)
    if key == "b":
        g[::5] = 0.0  # exact zeros are never sent
    return g


def _unambiguous_top(x: torch.Tensor, k: int) -> None:
    """A top-k of ``x``'s magnitudes has one answer: the k-th largest is above the next."""
    if k < x.numel():
        mags = x.abs().reshape(-1).topk(k + 1).values
        assert mags[k - 1] > mags[k], "test data: a tie at the top-k's boundary"


@pytest.mark.parametrize("name", COMPRESSORS)
def test_compressor_on_the_device_as_on_the_cpu(name):
    dev, cpu = COMPRESSORS[name](), COMPRESSORS[name]()
    for step in range(STEPS):
        for key in SHAPES:
            g = _gradient(key, step)
            prev = cpu.residual(key)
            x = g.reshape(-1) if prev is None else g.reshape(-1) + prev
            if isinstance(cpu, (TopKCompressor, DCTCompressor)):
                _unambiguous_top(x, keep_count(cpu.ratio, x.numel()))
            gd = on(DEV, g)
            p, c = dev.compress(key, gd), cpu.compress(key, g.clone())
            same(gd, g, "the gradient is left as it was")
            msg = f"{name} step {step} {key}"
            assert type(p) is type(c), msg
            if isinstance(c, SparseGrad):
                assert_on_dev(p.indices, p.values)
                assert p.numel == c.numel == g.numel()
                same(p.indices, c.indices, msg + " indices")
                same(p.values, c.values, msg + " values")
                assert c.count <= g.numel()
                if name.startswith("topk"):
                    assert c.count == keep_count(cpu.ratio, g.numel())
            else:
                assert_on_dev(p)
                same(p, c, msg + " payload")
            dp, dc = dev.decompress(p), cpu.decompress(c)
            assert_on_dev(dp)
            same(dp, dc, msg + " decompressed")
            rd, rc = dev.residual(key), cpu.residual(key)
            assert (rd is None) == (rc is None), msg
            if rc is not None:
                assert_on_dev(rd)
                same(rd, rc, msg + " residual")
                # error feedback: what is sent plus what is held back is the input
                same(dp + rd, x, msg + " sent + residual")
            if isinstance(cpu, DCTCompressor):
                td, tc = dev.threshold(key), cpu.threshold(key)
                assert (td is None) == (tc is None), msg
                if tc is not None:
                    assert td == pytest.approx(tc, rel=0, abs=0), msg
                assert dev.states[key].refreshes == cpu.states[key].refreshes, msg
    sd, sc = dev.state_dict(), cpu.state_dict()
    assert sd["hyperparameters"] == sc["hyperparameters"]
    for key in SHAPES:
        assert sd["tensors"][key]["step"] == sc["tensors"][key]["step"] == STEPS
    if isinstance(cpu, DCTCompressor) and cpu.ratio < 1:
        assert cpu.states["w"].refreshes >= 2  # the threshold was held and recomputed


def test_dct_mp_threshold_selection_on_the_device_as_on_the_cpu():
    dev, cpu = ThresholdMP(0.1, 2, cap=1.5), ThresholdMP(0.1, 2, cap=1.5)
    gen = torch.Generator().manual_seed(7)
    for step in range(6):
        x = distinct((32, 40), gen)
        x[3] = 0.0  # an all-zero row keeps nothing
        x[5] *= 100.0  # a row over its budget keeps the budget's largest
        training = step < 5  # then one evaluation with the held threshold
        kd, kc = dev.select(on(DEV, x), training), cpu.select(x.clone(), training)
        assert_on_dev(kd)
        same(kd, kc, f"step {step} mask")
        assert dev.threshold() == cpu.threshold() and dev.refreshes == cpu.refreshes
        assert not kc[3].any() and kc[5].sum() == cpu.budget(40)
        assert (kc.sum(1) <= cpu.budget(40)).all()
    assert cpu.refreshes >= 3


# -- sparse optimizers ----------------------------------------------------------------------

TABLES = [
    TableConfig(name="t0", num_embeddings=40, embedding_dim=8, features=["f0", "f1"]),
    TableConfig(name="t1", num_embeddings=25, embedding_dim=8),
    TableConfig(name="t2", num_embeddings=30, embedding_dim=4, pooling="mean"),
]
KEYS = ["f0", "f1", "t1", "t2"]
OUT_DIM = 8 * 3 + 4
BATCH, ID_RANGE = 16, 12  # ids below 12 of tables of 25+ rows: many repeats, many untouched rows
KINDS = {"one-id": ["one"] * 4, "multi-id": ["multi"] * 4, "mixed": ["one", "multi", "one", "multi"]}


def _batch(kind: str, seed: int) -> tuple[KeyedJagged, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    if kind == "one":
        kjt = KeyedJagged.from_dense(KEYS, torch.randint(0, ID_RANGE, (BATCH, len(KEYS)), generator=gen))
    else:  # bags of 0 to 4 ids
        lengths = torch.randint(0, 5, (len(KEYS) * BATCH,), generator=gen).to(torch.int32)
        values = torch.randint(0, ID_RANGE, (int(lengths.sum()),), generator=gen)
        kjt = KeyedJagged(KEYS, values, lengths)
    assert kjt.one_id_per_bag() == (kind == "one")
    return kjt, torch.randn(BATCH, OUT_DIM, generator=gen)


def _forward_backward(ebc, kjt: KeyedJagged, coef: torch.Tensor, dev: str):
    out = ebc(kjt.to(dev)).values
    assert out.shape == (BATCH, OUT_DIM) and out.device.type == torch.device(dev).type
    loss = (out * on(dev, coef)).sum() + 0.5 * out.pow(2).sum()  # the gradient depends on the tables
    loss.backward()
    return ebc.pop_sparse_grads()


def _compare_grads(gd, gc, msg: str) -> None:
    assert len(gd) == len(gc), msg
    for (grp, ids, rows, uniq), (c_grp, c_ids, c_rows, c_uniq) in zip(gd, gc):
        assert (grp, uniq) == (c_grp, c_uniq), msg
        assert_on_dev(ids, rows)
        same(ids, c_ids, f"{msg} group {grp} ids")
        torch.testing.assert_close(rows.cpu(), c_rows, **CLOSE, msg=f"{msg} group {grp} rows")


def _tables(ebc) -> dict[str, torch.Tensor]:
    return {n: ebc.table_weight(n).detach() for n in ebc.tables}


OPTIMIZERS = {
    "sgd": ("sgd", 0.1, None),
    "sgd-index_add": ("sgd", 0.1, "index_add"),
    "sgd-triton": ("sgd", 0.1, "triton"),  # (on the device; the CPU adds with scatter_add)
    "rowwise_adagrad": ("rowwise_adagrad", 0.1, None),
    "lazy_adam": ("lazy_adam", 0.01, None),
}


@pytest.mark.parametrize("kinds", KINDS)
@pytest.mark.parametrize("optim", OPTIMIZERS)
def test_sparse_optimizer_on_the_device_as_on_the_cpu(optim, kinds):
    from hybridrec.model.kernels import row_add_impls

    name, lr, row_add = OPTIMIZERS[optim]
    if row_add is not None and row_add not in row_add_impls(DEV):
        pytest.skip(f"row update {row_add!r} does not run on {DEV}")
    ebc_d = EmbeddingBagCollection(TABLES, device=torch.device(DEV), seed=3)
    ebc_c = EmbeddingBagCollection(TABLES, seed=3)
    opt_d = build_sparse_optimizer(name, ebc_d, lr=lr)
    opt_c = build_sparse_optimizer(name, ebc_c, lr=lr)
    if row_add is not None:
        opt_d.row_adds = [row_add] * ebc_d.num_groups
        opt_c.row_adds = [row_add if row_add != "triton" else "scatter_add"] * ebc_c.num_groups
    init = {n: w.clone() for n, w in _tables(ebc_c).items()}
    for n, w in _tables(ebc_d).items():
        assert_on_dev(w)
        same(w, init[n], f"initial {n}")  # the seeded initialisation does not depend on the device
    for step, kind in enumerate(KINDS[kinds]):
        kjt, coef = _batch(kind, seed=10 + step)
        gd = _forward_backward(ebc_d, kjt, coef, DEV)
        gc = _forward_backward(ebc_c, kjt, coef, "cpu")
        msg = f"{optim} step {step} ({kind})"
        _compare_grads(gd, gc, msg)
        assert all(u == (kind == "multi") for _, _, _, u in gc), msg
        opt_d.step(gd)
        opt_c.step(gc)
        for n, w in _tables(ebc_d).items():
            assert_on_dev(w)
            torch.testing.assert_close(w.cpu(), ebc_c.table_weight(n).detach(), **CLOSE,
                                       msg=f"{msg} table {n}")
        sd, sc = opt_d.state_dict(), opt_c.state_dict()
        assert sd["step"] == sc["step"] == step + 1
        for n in sc["tables"]:
            assert sd["tables"][n].keys() == sc["tables"][n].keys()
            for k, v in sc["tables"][n].items():
                assert_on_dev(sd["tables"][n][k])
                torch.testing.assert_close(sd["tables"][n][k].cpu(), v, **CLOSE, msg=f"{msg} {n}.{k}")
    # the steps did something: the first ids' rows moved, the rows past ID_RANGE did not
    for n, w in _tables(ebc_c).items():
        assert not torch.equal(w[:ID_RANGE], init[n][:ID_RANGE]), n
        same(w[ID_RANGE:], init[n][ID_RANGE:], f"untouched rows of {n}")
    if name != "sgd":
        assert any(v.abs().sum() > 0 for t in opt_c.state_dict()["tables"].values() for v in t.values())


def _bf16_bracket(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The bf16 values around float32 ``t``: toward zero, and the next one away from zero."""
    bits = t.contiguous().view(torch.int32) & -65536
    return bits.view(torch.float32), (bits + 65536).view(torch.float32)


def _bf16_run(dev: str, kind: str, seed: int, lr: float = 0.05, steps: int = 3) -> dict[str, torch.Tensor]:
    """SGD on bf16 tables on ``dev``; checks every step's stochastic rounding against the
    exact float32 update of that step's row gradients. Returns the final tables (CPU)."""
    torch.manual_seed(seed)
    ebc = EmbeddingBagCollection(TABLES, device=torch.device(dev), seed=3, weight_dtype=torch.bfloat16)
    opt = build_sparse_optimizer("sgd", ebc, lr=lr)
    touched_ever = [torch.zeros(ebc.group_weight(g).shape[0], dtype=torch.bool)
                    for g in range(ebc.num_groups)]
    init = [ebc.group_weight(g).detach().cpu().clone() for g in range(ebc.num_groups)]
    errors, signed, far, moved, bracketed, total = [], [], [], 0, 0, 0
    for step in range(steps):
        kjt, coef = _batch(kind, seed=20 + step)
        grads = _forward_backward(ebc, kjt, coef, dev)
        assert grads
        before = [ebc.group_weight(g).detach().cpu().clone() for g in range(ebc.num_groups)]
        saved = [(grp, ids.cpu(), rows.detach().cpu().clone()) for grp, ids, rows, _ in grads]
        opt.step(grads)
        for grp, ids, rows in saved:
            w = ebc.group_weight(grp).detach()
            assert w.dtype == torch.bfloat16 and w.device.type == torch.device(dev).type
            new = w.cpu().float()
            delta = torch.zeros(new.shape).index_add_(0, ids, rows * -lr)
            target = before[grp].float() + delta  # the exact float32 update, before rounding
            touched = torch.zeros(new.shape[0], dtype=torch.bool)
            touched[ids] = True
            touched_ever[grp] |= touched
            same(new[~touched], before[grp][~touched].float(), f"untouched rows, step {step}")
            t, r, d, w0 = target[touched], new[touched], delta[touched], before[grp][touched].float()
            down, up = _bf16_bracket(t)
            spacing = (up - down).abs()
            assert ((r - t).abs() <= 2 * spacing).all(), float(((r - t).abs() / spacing).max())
            lo, hi = torch.minimum(down, up), torch.maximum(down, up)
            bracketed += int(((r >= lo) & (r <= hi)).sum())
            total += r.numel()
            inexact = down != t  # (t a bf16 value already: nothing to round)
            err = ((r - t) / spacing)[inexact]
            errors.append(err)
            signed.append(err * torch.sign(t[inexact]))  # rounding away from zero > 0
            # the farther neighbour taken: never when rounding to nearest, a quarter of the
            # time for stochastic rounding of uniformly spread fractions
            far.append(((r - t).abs() > (spacing / 2))[inexact])
            # an update over two bf16 steps cannot be rounded away: it moves the entry its way
            _, w0_up = _bf16_bracket(w0)
            big = d.abs() > 2 * (w0_up - w0).abs()
            assert (torch.sign(r - w0)[big] == torch.sign(d)[big]).all()
            moved += int(big.sum())
    assert bracketed >= 0.99 * total, (bracketed, total)
    assert abs(float(torch.cat(errors).mean())) < 0.25  # unbiased rounding
    assert abs(float(torch.cat(signed).mean())) < 0.25  # (not toward zero, not away from it)
    assert 0.1 < float(torch.cat(far).float().mean()) < 0.4  # stochastic, not to nearest
    assert moved > total // 2, (moved, total)
    for g in range(ebc.num_groups):
        untouched = ~touched_ever[g]
        assert untouched.any()
        same(ebc.group_weight(g).detach()[untouched], init[g][untouched], "rows never touched")
    return {n: w.cpu().float() for n, w in _tables(ebc).items()}


@pytest.mark.parametrize("kind", ["one", "multi"])
def test_bf16_tables_sgd_on_the_device_and_on_the_cpu(kind):
    steps = 3
    # different seeds: the random numbers of the rounding differ, as they do across devices
    dev = _bf16_run(DEV, kind, seed=1, steps=steps)
    cpu = _bf16_run("cpu", kind, seed=2, steps=steps)
    for n, c in cpu.items():
        # the bf16 step at the table's largest magnitude: no rounding of its entries is larger
        top = torch.maximum(c.abs().max(), dev[n].abs().max()).reshape(1)
        spacing = float(_bf16_bracket(top)[1] - top)
        diff = (dev[n] - c).abs()
        assert float(diff.max()) <= 2 * steps * spacing, (n, float(diff.max()) / spacing)
        assert float(diff.mean()) <= 0.5 * spacing, (n, float(diff.mean()) / spacing)


# -- group_ids / aggregate_rows ---------------------------------------------------------------

def _ids(case: str) -> tuple[torch.Tensor, list]:
    """Ids of a case and the ``bound`` values to try (None: the largest id is looked at)."""
    gen = torch.Generator().manual_seed(5)
    if case == "empty":
        return torch.empty(0, dtype=torch.int64), [None, 10]
    ids = torch.randint(0, 50, (400,), generator=gen)
    if case == "small":  # bound 2^31 + 7 sorts the 64-bit keys: the same result
        return ids, [None, 50, 2**31 + 7]
    ids[::3] += 2**33  # beyond 32 bits
    return ids, [None, 2**34]


@pytest.mark.parametrize("case", ["small", "large", "empty"])
def test_group_ids_and_aggregate_rows_on_the_device_as_on_the_cpu(case):
    ids, bounds = _ids(case)
    rows = torch.randn(ids.numel(), 5, generator=torch.Generator().manual_seed(6))
    first = None
    for bound in bounds:
        kw = {} if bound is None else {"bound": bound}
        u, off, perm = group_ids(on(DEV, ids), **kw)
        cu, coff, cperm = group_ids(ids.clone(), **kw)
        assert_on_dev(u, off, perm)
        same(u, cu, f"unique, bound={bound}")
        same(off, coff, f"offsets, bound={bound}")
        same(perm.to(torch.int64), cperm.to(torch.int64), f"perm, bound={bound}")
        # what they are: ascending distinct ids, their occurrences in order (a stable sort)
        assert cu.dtype == torch.int64 and off.dtype == torch.int64
        same(cu, torch.unique(ids), "unique ids")
        assert int(coff[0]) == 0 and int(coff[-1]) == ids.numel()
        same(coff.diff(), torch.bincount(torch.searchsorted(cu, ids), minlength=cu.numel()), "counts")
        p = cperm.to(torch.int64)
        same(ids[p], torch.repeat_interleave(cu, coff.diff()), "grouped ids")
        for i in range(cu.numel()):
            assert (p[coff[i] : coff[i + 1]].diff() > 0).all()
        su, summed = aggregate_rows(on(DEV, ids), on(DEV, rows), **kw)
        csu, csummed = aggregate_rows(ids.clone(), rows.clone(), **kw)
        assert_on_dev(su, summed)
        same(su, csu, f"aggregated ids, bound={bound}")
        assert summed.shape == (cu.numel(), 5)
        torch.testing.assert_close(summed.cpu(), csummed, **CLOSE)
        ref = torch.zeros(cu.numel(), 5, dtype=torch.float64).index_add_(
            0, torch.searchsorted(cu, ids), rows.double())
        torch.testing.assert_close(csummed.double(), ref, rtol=1e-5, atol=1e-5)
        # with and without the bound: the same answer
        got = (cu, coff, cperm.to(torch.int64), csu, csummed)
        if first is None:
            first = got
        else:
            for a, b in zip(got, first):
                same(a, b, f"bound={bound} against none")


@pytest.mark.parametrize("dim", [16, 64, 65])
def test_every_lookup_copies_the_rows(dim):
    from hybridrec.model.embedding import lookup_impls, lookup_rows

    gen = torch.Generator().manual_seed(dim)
    weight = torch.randn(1000, dim, generator=gen)
    ids = torch.randint(0, 1000, (4099,), generator=gen)
    ref = weight[ids]
    w, i = weight.to(DEV), ids.to(DEV)
    impls = lookup_impls(DEV)
    assert impls[:2] == ["embedding_bag", "index_select"]
    for impl in impls[1:]:
        got = lookup_rows(w, i, impl)
        assert got.device.type == torch.device(DEV).type and got.dtype == weight.dtype
        assert torch.equal(got.cpu(), ref), impl
    bag = torch.nn.functional.embedding_bag(i, w, torch.arange(i.numel() + 1, device=i.device), mode="sum",
                                            include_last_offset=True)
    assert torch.equal(bag.cpu(), ref)
    assert lookup_rows(w, i[:0], impls[-1]).shape == (0, dim)


def test_a_collection_trains_alike_with_every_lookup():
    """The forward's pooled output and the row gradients do not depend on the lookup chosen."""
    from hybridrec.model.embedding import lookup_impls

    tables = [TableConfig(name=f"t{i}", num_embeddings=50, embedding_dim=8) for i in range(3)]
    ids = torch.randint(0, 50, (3 * 7,), generator=torch.Generator().manual_seed(1))
    kjt = KeyedJagged([f"t{i}" for i in range(3)], ids, torch.ones(21, dtype=torch.int32)).to(DEV)
    outs = []
    for impl in lookup_impls(DEV):
        ebc = EmbeddingBagCollection(tables, device=torch.device(DEV), seed=3)
        ebc.lookups = [impl] * ebc.num_groups
        out = ebc(kjt)
        (out.values * torch.arange(out.values.numel(), device=out.values.device).view(out.values.shape)).sum().backward()
        outs.append((out.values.detach().cpu(), [(g, i.cpu(), r.cpu()) for g, i, r, _ in ebc.pop_sparse_grads()]))
    for values, grads in outs[1:]:
        assert torch.equal(values, outs[0][0])
        assert len(grads) == len(outs[0][1]) > 0
        for (g, i, r), (g0, i0, r0) in zip(grads, outs[0][1]):
            assert g == g0 and torch.equal(i, i0) and torch.equal(r, r0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_padded_candidates_compute_the_same_on_the_device(dtype):
    from hybridrec.model.interaction import DotInteraction
    from hybridrec.model.kernels import PADDED, linear

    gen = torch.Generator().manual_seed(0)
    tol = {} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 2e-2}
    low = dtype != torch.float32
    # the interaction: 26 features + 1 (27 rows, padded to 32)
    dense = torch.randn(64, 16, generator=gen).to(DEV).requires_grad_()
    sparse = torch.randn(64, 26, 16, generator=gen).to(DEV).requires_grad_()
    mod, res = DotInteraction(26, 16).to(DEV), {}
    for impl in ("gather", "gather_pad"):
        mod.impl = impl
        with torch.autocast(torch.device(DEV).type, dtype=torch.bfloat16, enabled=low):
            out = mod(dense, sparse)
        go = torch.linspace(-1, 1, out.numel(), device=out.device).view(out.shape)
        res[impl] = (out.float(), torch.autograd.grad((out.float() * go).sum(), (dense, sparse)))
    torch.testing.assert_close(res["gather_pad"][0], res["gather"][0], **tol)
    for a, b in zip(res["gather_pad"][1], res["gather"][1]):
        torch.testing.assert_close(a, b, **tol)
    # a linear of fan-in 13 (padded to 16)
    x = torch.randn(128, 13, generator=gen).to(DEV).requires_grad_()
    w = torch.randn(32, 13, generator=gen).to(DEV).requires_grad_()
    b = torch.randn(32, generator=gen).to(DEV).requires_grad_()
    got = {}
    for impl in ("torch", PADDED):
        with torch.autocast(torch.device(DEV).type, dtype=torch.bfloat16, enabled=low):
            y = linear(x, w, b, relu=True, impl=impl)
        got[impl] = (y.float(), torch.autograd.grad(y.float().square().sum(), (x, w, b)))
    assert got[PADDED][0].shape == (128, 32)
    torch.testing.assert_close(got[PADDED][0], got["torch"][0], **tol)
    for a, c in zip(got[PADDED][1], got["torch"][1]):
        assert a.shape == c.shape
        torch.testing.assert_close(a, c, **tol)
