"""Codecs for model-parallel hops: what one row of a pooled-embedding piece costs on the wire.

A *piece* is one slot's pooled partial result: ``[rows, C]`` float32, one row per
sample, ``C`` the width of the feature's shard (table-wise and row-wise: the
table's dim; column-wise: the shard's columns). A codec turns every row into a
fixed number of bytes, forward (the activations) and backward (their gradients),
so the bytes of any block of rows are ``rows * row_bytes(C)``, known on both sides
of an all-to-all from batch sizes and widths alone: no size exchange is needed.

Every codec works on the last dim and keeps the leading dims, so ``n`` pieces of
the same width can be coded at once as ``[rows, n, C] -> [rows, n, row_bytes]``
uint8. The encoded rows are plain bytes (native byte order; both ends of a hop
run the same build): they are concatenated with other pieces' bytes into one
buffer per hop.

The round trip of a hop, with its backward::

    payload, sent_state = codec.encode(x)          # sender, x [..., C] -> uint8 [..., row_bytes]
    x_hat, recv_state = codec.decode(payload, C)   # receiver -> [..., C] float32
    gbytes = codec.encode_grad(g, recv_state)      # receiver, g = dL/dx_hat [..., C]
    gx = codec.decode_grad(gbytes, C, sent_state)  # sender -> dL/dx [..., C] float32

Codecs (name: forward row bytes / backward row bytes):

- ``fp32`` :class:`CastCodec` (float32): ``4C / 4C``, the identity (the uncompressed baseline).
- ``fp16`` / ``bf16`` :class:`CastCodec`: ``2C / 2C``; the backward casts the gradient to
  the same 16-bit type (TorchRec's FP16/BF16 qcomms, forward and backward precision equal);
  the cast is treated as the identity for the chain rule (straight-through).
- ``int8`` :class:`Int8RowwiseCodec`: ``C + 8 / 2C``; fbgemm's fused 8-bit row-wise layout
  (``C`` uint8 codes, then a float32 scale and a float32 bias per row); the backward sends
  bf16 gradients (straight-through for the quantizer; gradients are not 8-bit quantized).
- ``dct`` :class:`TopKCodec`: ``k (v + i) / k v`` with ``k = ceil(eta C)``, ``v`` the value
  bytes (4, or 2 for fp16/bf16 values) and ``i`` the index bytes (1 up to C = 256, 2 up to
  32768, else 4). DCT-MP: each row keeps its ``k`` entries of largest magnitude; the
  backward sends only the gradients at those positions, which the receiver already knows,
  so no index travels back. The gradient is exact by the chain rule: the decoded piece is
  ``x * mask``, so ``dL/dx = mask * dL/dx_hat``.

Example, ``C = 16``, ``eta = 0.05``: ``k = 1``; one row costs ``4 + 1 = 5`` bytes forward
(uncompressed: 64, ratio 12.8) and 4 bytes backward (ratio 16).

The selection is the costly part of a DCT hop on CPU: a per-row top-k of ``rows x n`` short
rows. It has four implementations (:func:`row_topk`): ``torch.topk`` (any device), numpy's
``argpartition`` (CPU, float32; about 3x faster than ``torch.topk`` on 64-wide rows on a Zen
4 or 5, where numpy's arg-selection has AVX-512 code; 1.4x on a Zen 3), ``keys``, a
values-only selection of int32 keys that carry magnitude and position (:func:`_key_topk`),
and ``native``, C built with the system's compiler on first use
(:mod:`hybridrec.comm.native_topk`; left out, with the reason, where no compiler runs). The
first three select, then torch gathers, casts, packs and (decoding) scatters; ``native`` runs
the whole codec in C, one pass per row each way, the same bytes. On a 2-core Zen 3, one rank's
codec work of the benchmark's step (4,096 rows x 13 pieces of 64, k 4, fp16 values): encode
5.8 ms against 15.3 with the C selection and torch's packing, 19.9 with ``keys``; decode 2.0
against 5.6 (docs/benchmarks.md). Which one a codec runs, per width, is chosen by measurement
at start-up of the codec's round trip on the shapes it will code (:func:`tune_topk`, cached
with the MLP kernels' choices, each candidate's decoded rows and gradients checked against
``torch``'s first); they differ only in how ties are broken.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch

from hybridrec.comm import native_topk
from hybridrec.model.kernels import Choice, Timing, choose, race_checked
from hybridrec.phases import phase

VALUE_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
"""Value types a codec may put on the wire, by config name."""


def index_dtype(cols: int) -> torch.dtype:
    """Smallest integer type that holds a column position ``0 .. cols - 1``."""
    if cols <= 256:
        return torch.uint8
    if cols <= 2**15:
        return torch.int16
    return torch.int32


def _item(dtype: torch.dtype) -> int:
    return torch.empty(0, dtype=dtype).element_size()


def to_bytes(x: torch.Tensor) -> torch.Tensor:
    """``[..., n]`` of any dtype -> uint8 ``[..., n * itemsize]`` (a view when contiguous;
    viewed flat, as :func:`from_bytes`: rows of size 1 or 0 may keep any strides)."""
    return x.contiguous().reshape(-1).view(torch.uint8).view(*x.shape[:-1], x.shape[-1] * x.element_size())


def from_bytes(b: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """uint8 ``[..., n * itemsize]`` -> ``[..., n]`` of ``dtype``. Copies when the bytes
    are a strided slice or start at an offset the dtype cannot be viewed from. (Viewed
    flat: a slice of one row, or of none, counts as contiguous with its parent's strides,
    which the dtype's view may refuse.)"""
    flat = b.contiguous().reshape(-1)
    if flat.storage_offset() % _item(dtype):
        flat = flat.clone()
    return flat.view(dtype).view(*b.shape[:-1], b.shape[-1] // _item(dtype))


class Codec:
    """Interface: fixed bytes per row, forward and backward; see the module docstring."""

    name: str = ""

    def row_bytes(self, cols: int) -> int:
        """Forward bytes of one row of width ``cols``."""
        raise NotImplementedError

    def grad_row_bytes(self, cols: int) -> int:
        """Backward bytes of one row of width ``cols``."""
        raise NotImplementedError

    def encoded_bytes(self, rows: int, cols: int) -> int:
        """Exact forward bytes of a ``[rows, cols]`` block."""
        return rows * self.row_bytes(cols)

    def grad_bytes(self, rows: int, cols: int) -> int:
        """Exact backward bytes of a ``[rows, cols]`` block."""
        return rows * self.grad_row_bytes(cols)

    def encode(self, x: torch.Tensor) -> tuple[torch.Tensor, Any]:
        """``x [..., C]`` float32 -> (uint8 ``[..., row_bytes(C)]``, state the sender keeps
        for :meth:`decode_grad`)."""
        raise NotImplementedError

    def decode(self, payload: torch.Tensor, cols: int) -> tuple[torch.Tensor, Any]:
        """uint8 ``[..., row_bytes(C)]`` -> (``[..., C]`` float32, state the receiver keeps
        for :meth:`encode_grad`)."""
        raise NotImplementedError

    def encode_grad(self, grad: torch.Tensor, state: Any) -> torch.Tensor:
        """Receiver: ``dL/dx_hat [..., C]`` -> uint8 ``[..., grad_row_bytes(C)]``."""
        raise NotImplementedError

    def decode_grad(self, payload: torch.Tensor, cols: int, state: Any, out: torch.Tensor | None = None) -> torch.Tensor:
        """Sender: uint8 ``[..., grad_row_bytes(C)]`` -> ``dL/dx [..., C]`` float32, written
        into ``out`` (float32 ``[..., C]``; returned) when given."""
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name})"


def _into(x: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    """``x``, or ``out`` holding a copy of it."""
    return x if out is None else out.copy_(x)


class CastCodec(Codec):
    """Every entry cast to ``dtype`` both ways; float32 is the uncompressed identity."""

    def __init__(self, dtype: torch.dtype = torch.float32) -> None:
        self.dtype = dtype
        self.name = {v: k for k, v in VALUE_DTYPES.items()}[dtype]

    def row_bytes(self, cols: int) -> int:
        return cols * _item(self.dtype)

    def grad_row_bytes(self, cols: int) -> int:
        return cols * _item(self.dtype)

    def encode(self, x):
        return to_bytes(x.to(self.dtype)), None

    def decode(self, payload, cols):
        return from_bytes(payload, self.dtype).to(torch.float32), None

    def encode_grad(self, grad, state):
        return to_bytes(grad.to(self.dtype))

    def decode_grad(self, payload, cols, state, out=None):
        return _into(from_bytes(payload, self.dtype).to(torch.float32), out)


class Int8RowwiseCodec(Codec):
    """8-bit codes per entry with a float32 scale and bias per row (fbgemm's
    ``FloatToFused8BitRowwiseQuantized`` layout and rounding: ``scale = range / 255``,
    codes ``round((x - min) * 255 / (range + 1e-8))``); gradients travel as bf16."""

    name = "int8"
    EPS = 1e-8  # fbgemm's kEpsilon: an all-equal row gets codes 0 and bias = its value
    GRAD = torch.bfloat16

    def row_bytes(self, cols: int) -> int:
        return cols + 8

    def grad_row_bytes(self, cols: int) -> int:
        return cols * _item(self.GRAD)

    def encode(self, x):
        lo, hi = x.amin(-1, keepdim=True), x.amax(-1, keepdim=True)
        rng = hi - lo
        codes = ((x - lo) * (255.0 / (rng + self.EPS))).round_().clamp_(0, 255).to(torch.uint8)
        return torch.cat([codes, to_bytes(rng / 255.0), to_bytes(lo)], dim=-1), None

    def decode(self, payload, cols):
        codes = payload[..., :cols].to(torch.float32)
        scale = from_bytes(payload[..., cols : cols + 4], torch.float32)
        bias = from_bytes(payload[..., cols + 4 :], torch.float32)
        return codes * scale + bias, None

    def encode_grad(self, grad, state):
        return to_bytes(grad.to(self.GRAD))

    def decode_grad(self, payload, cols, state, out=None):
        return _into(from_bytes(payload, self.GRAD).to(torch.float32), out)


TOPK_IMPLS = ("torch", "numpy", "keys", "native")
"""Implementations of :func:`row_topk`, in order of preference when timings tie."""

KEY_COLS = 256
"""The widest row ``keys`` selects in (8 bits of position: |x| keeps 15 of its 23 mantissa bits)."""


def _key_topk(x: torch.Tensor, k: int) -> torch.Tensor:
    """``keys``: every entry of float32 ``x [..., C]`` becomes one int32 key, the bits of ``|x|``
    (which order as the magnitudes do) with the lowest ``b = log2(C)`` bits replaced by the
    entry's column; numpy's ``partition`` of the keys in place (a values-only selection,
    SIMD on AVX2 too, where ``argpartition`` of floats is not) leaves the ``k`` largest last,
    and their low bits are the positions. One pass makes the keys (no ``abs`` copy, no int64
    index array). Ties among magnitudes equal in their top ``23 - b`` mantissa bits (relative
    2^-17 for C = 64) go to the higher column: the kept set is a top-k up to that rounding."""
    cols = x.shape[-1]
    bits = max(1, (cols - 1).bit_length())
    keys = torch.empty(x.shape, dtype=torch.int32)
    torch.bitwise_and(x.view(torch.int32), (0x7FFFFFFF >> bits) << bits, out=keys)
    keys.bitwise_or_(torch.arange(cols, dtype=torch.int32))
    keys.numpy().partition(cols - k, axis=-1)
    return keys[..., cols - k:].bitwise_and((1 << bits) - 1).long()


def row_topk(x: torch.Tensor, k: int, impl: str = "torch") -> torch.Tensor:
    """Positions of the ``k`` entries of largest magnitude of every row of ``x`` ``[..., C]``:
    int64 ``[..., k]``, in no particular order. ``impl``: ``torch`` (``torch.topk`` of
    ``|x|``), ``numpy`` (``numpy.argpartition`` of ``|x|``), ``keys`` (:func:`_key_topk`) or
    ``native`` (a C loop built on first use, :mod:`hybridrec.comm.native_topk`; raises where
    it cannot be built); the last three are taken for float32 CPU tensors (``keys`` up to
    :data:`KEY_COLS` wide), else ``torch``."""
    cols = x.shape[-1]
    if k >= cols:
        return torch.arange(cols, device=x.device).expand(*x.shape[:-1], cols).contiguous()
    cpu32 = x.device.type == "cpu" and x.dtype == torch.float32
    if impl == "keys" and cpu32 and cols <= KEY_COLS:
        return _key_topk(x, k)
    if impl == "native" and cpu32:  # (builds its C loop on first use; raises where it cannot)
        return native_topk.row_topk(x, k)
    if impl == "numpy" and cpu32:
        part = np.argpartition(x.abs().numpy(), cols - k, axis=-1)[..., cols - k:]
        return torch.from_numpy(np.ascontiguousarray(part))
    return x.abs().topk(k, dim=-1, sorted=False).indices


def time_topk_codec(codec: TopKCodec, rows: int, cols: int, impls: list[str], *, device: str = "cpu",
                    reps: int = 5, budget_s: float = 0.2) -> Timing:
    """Seconds of one round trip of ``codec``'s hop over ``[rows, cols]`` normal values (encode,
    decode, the gradients' encode and decode: what a step runs) with each of ``impls`` as the
    codec's implementation at that width (:func:`~hybridrec.model.kernels.race_checked`; what
    is compared is the decoded rows' magnitudes, sorted per row, and the gradient that comes
    back, sorted alike: ties may keep other positions)."""
    gen = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(rows, cols, device=device, generator=gen)
    g = torch.randn(rows, cols, device=device, generator=gen)

    def run(impl: str) -> tuple[torch.Tensor, torch.Tensor]:
        c = TopKCodec(codec.eta, codec.values)
        c.impls[cols] = impl
        payload, sent = c.encode(x)
        out, received = c.decode(payload, cols)
        return out, c.decode_grad(c.encode_grad(g, received), cols, sent)

    def probe(impl: str) -> tuple[torch.Tensor, torch.Tensor]:
        out, grad = run(impl)
        return out.abs().sort(-1).values, grad.abs().sort(-1).values

    return race_checked(impls, run, probe=probe, device=device, what=f"DCT-MP codec {codec.values}",
                        reps=reps, budget_s=budget_s)


class TopKCodec(Codec):
    """DCT-MP: every row keeps its ``k = ceil(eta * C)`` entries of largest magnitude.

    Row layout forward: ``k`` values (``values`` dtype), then their ``k`` column
    positions (:func:`index_dtype`); backward: the ``k`` gradients at those positions,
    in the same order. ``eta = 1`` with float32 values is the exact identity.
    Ties (e.g. an all-equal or all-zero row) are broken by the selection; any choice
    is a valid top-k and both directions use the same one.

    ``impls[C]`` names the implementation for width ``C`` (:func:`tune_topk`; ``torch`` when
    unset): ``torch``, ``numpy`` and ``keys`` select (:func:`row_topk`) and gather, cast, pack
    and scatter with torch; ``native`` runs the whole codec in C
    (:mod:`hybridrec.comm.native_topk`: one pass per row selects, casts and packs; decoding
    zeroes a row and writes its ``k`` values), the same bytes. The kept state is then the
    forward payload (uint8: the positions travel in it) instead of int64 positions.
    """

    name = "dct"

    def __init__(self, eta: float, values: str = "fp32") -> None:
        if not 0 < eta <= 1:
            raise ValueError(f"eta must be in (0, 1], got {eta}")
        if values not in VALUE_DTYPES:
            raise ValueError(f"values {values!r}: one of {sorted(VALUE_DTYPES)}")
        self.eta, self.values, self.dtype = eta, values, VALUE_DTYPES[values]
        self.impls: dict[int, str] = {}

    def k(self, cols: int) -> int:
        """Entries kept per row (at least 1, at most ``cols``)."""
        return min(cols, max(1, math.ceil(self.eta * cols - 1e-9)))

    def row_bytes(self, cols: int) -> int:
        return self.k(cols) * (_item(self.dtype) + _item(index_dtype(cols)))

    def grad_row_bytes(self, cols: int) -> int:
        return self.k(cols) * _item(self.dtype)

    def _native(self, cols: int, t: torch.Tensor) -> bool:
        return self.impls.get(cols) == "native" and t.device.type == "cpu"

    def _positions(self, state: torch.Tensor, cols: int) -> torch.Tensor:
        """int64 positions from a kept state (a native state is the forward payload)."""
        if state.dtype != torch.uint8:
            return state
        return from_bytes(state[..., self.k(cols) * _item(self.dtype):], index_dtype(cols)).to(torch.int64)

    def encode(self, x):
        cols = x.shape[-1]
        if self._native(cols, x) and x.dtype == torch.float32:
            with phase("mp_select"):  # (natively: selected, cast and packed at once)
                payload = native_topk.encode(x, self.k(cols), self.dtype, _item(index_dtype(cols)))
            return payload, payload
        with phase("mp_select"):
            idx = row_topk(x, self.k(cols), self.impls.get(cols, "torch"))
        vals = x.gather(-1, idx).to(self.dtype)
        return torch.cat([to_bytes(vals), to_bytes(idx.to(index_dtype(cols)))], dim=-1), idx

    def decode(self, payload, cols):
        if self._native(cols, payload):
            return native_topk.decode(payload, cols, self.k(cols), self.dtype, _item(index_dtype(cols))), payload
        split = self.k(cols) * _item(self.dtype)
        vals = from_bytes(payload[..., :split], self.dtype).to(torch.float32)
        idx = from_bytes(payload[..., split:], index_dtype(cols)).to(torch.int64)
        out = vals.new_zeros(*vals.shape[:-1], cols).scatter_(-1, idx, vals)
        return out, idx

    def encode_grad(self, grad, state):
        cols = grad.shape[-1]
        if state.dtype == torch.uint8 and grad.dtype == torch.float32 and grad.device.type == "cpu":
            return native_topk.gather(grad, state, self.k(cols), self.dtype, _item(index_dtype(cols)))
        return to_bytes(grad.gather(-1, self._positions(state, cols)).to(self.dtype))

    def decode_grad(self, payload, cols, state, out=None):
        if state.dtype == torch.uint8 and payload.device.type == "cpu":
            return native_topk.scatter(payload, state, cols, self.k(cols), self.dtype, _item(index_dtype(cols)),
                                       out=out)
        vals = from_bytes(payload, self.dtype).to(torch.float32)
        dst = vals.new_zeros(*vals.shape[:-1], cols) if out is None else out.zero_()
        return dst.scatter_(-1, self._positions(state, cols), vals)

    def __repr__(self) -> str:
        return f"TopKCodec(eta={self.eta}, values={self.values})"


def tune_topk(uses: list[tuple[TopKCodec, int, int]], *, mode: str = "auto",
              device: str = "cpu") -> list[Choice]:
    """Each ``(codec, rows, cols)`` (a codec that will encode ``[rows, cols]`` blocks, pieces
    flattened into rows): its implementation for that width, by measurement of the codec's
    round trip (:func:`time_topk_codec`; :func:`~hybridrec.model.kernels.choose`: cached per
    machine, shape and value type; ``mode`` ``measure`` measures again, the linears'
    ``torch``/``onednn`` overrides leave it measured). Sets ``codec.impls[cols]``; returns the
    choices."""
    cpu = torch.device(device).type == "cpu"

    def cands(cols: int) -> list[str]:  # (keys wider than KEY_COLS would run torch.topk again)
        return [i for i in TOPK_IMPLS if i == "torch" or (cpu and (i != "keys" or cols <= KEY_COLS))]

    keys = [f"dct_codec {device} {rows}x{cols} k{codec.k(cols)} {codec.values}" for codec, rows, cols in uses]
    shapes = {key: (codec, rows, cols) for key, (codec, rows, cols) in zip(keys, uses)}
    got = choose([(key, cands(shapes[key][2]), None) for key in shapes],
                 lambda key, cs, budget: time_topk_codec(*shapes[key], cs, device=device, budget_s=budget),
                 mode=mode, budget_s=0.3)
    for key, (codec, _, cols) in zip(keys, uses):
        codec.impls[cols] = got[key].impl
    return list(got.values())


CODECS = ("none", "dct", "fp16", "bf16", "int8")
"""Names accepted by :func:`make_codec` (``compress.embedding``)."""


def make_codec(name: str, *, eta: float = 0.05, values: str = "fp32") -> Codec | None:
    """A codec by config name; ``none`` -> None (the hop stays float32, untouched)."""
    if name == "none":
        return None
    if name == "dct":
        return TopKCodec(eta, values)
    if name in ("fp16", "bf16"):
        return CastCodec(VALUE_DTYPES[name])
    if name == "int8":
        return Int8RowwiseCodec()
    raise ValueError(f"unknown codec {name!r}; choose from {CODECS}")


class _RoundTrip(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, codec):
        payload, sent = codec.encode(x)
        out, received = codec.decode(payload, x.shape[-1])
        ctx.codec, ctx.states = codec, (sent, received)
        return out

    @staticmethod
    def backward(ctx, grad):
        codec, (sent, received) = ctx.codec, ctx.states
        payload = codec.encode_grad(grad.contiguous(), received)
        return codec.decode_grad(payload, grad.shape[-1], sent), None


def round_trip(x: torch.Tensor, codec: Codec) -> torch.Tensor:
    """``decode(encode(x))`` with the hop's backward (``decode_grad(encode_grad(g))``),
    in one process: what a coded hop does to a piece, without the collective."""
    return _RoundTrip.apply(x, codec)
