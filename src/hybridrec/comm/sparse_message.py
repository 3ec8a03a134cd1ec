"""Sparse gradient messages: which entries of a flat tensor are sent, how they are laid
out in bytes, and how every rank's message reaches every other rank.

A :class:`SparseGrad` is the logical message (indices, values). :func:`encode` turns it
into bytes in whichever of two layouts is smaller, :func:`decode` reverses it, and
:func:`encoded_size` gives the exact byte count without encoding::

    index list:  [tag=1][k indices, smallest unsigned dtype that holds numel-1][k values]
    bitmap:      [tag=0][ceil(numel/8) bytes, bit i%8 of byte i//8 = entry i][k values]

Values are in ascending index order in both layouts. The decoder is told ``numel`` and
the value dtype (every rank knows the tensor it is decoding); ``k`` follows from the
message length, so the whole header is the one tag byte.

:func:`start_sizes` and :func:`start_exchange` send one rank's encoded message to
every other rank with two all-to-alls (the sizes, then the bytes with uneven splits),
so each rank receives exactly the other ranks' messages and nothing is padded;
:func:`start_pairwise_exchange` sends the bytes by receive-first isend/irecv instead
(``dist.exchange=pairwise``).

A message with a ``capacity`` (a bound every rank knows from the tensor alone: top-k's K,
DCT's cap) can travel in a buffer of fixed size instead (:class:`FixedLayout`, padded):
then no sizes are exchanged, the same two exchange functions take ``[nbytes] * world`` as
the sizes, and the received buffers are summed without reading anything on the host.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from hybridrec.comm.exchange import PairwiseExchange, collective_device

TAG_BITMAP = 0
TAG_INDEX_LIST = 1
HEADER_BYTES = 1
SIZE_BYTES = 8
"""Bytes per rank pair of the size exchange (one int64)."""

_SHIFTS = torch.arange(8, dtype=torch.uint8)


@dataclass(frozen=True)
class SparseGrad:
    """The entries of a flat tensor of ``numel`` elements that are sent; the rest are 0.

    Attributes:
        indices: ``[k]`` int64, strictly ascending, each in ``[0, numel)``.
        values: ``[k]`` the tensor's float dtype, ``values[j]`` is entry ``indices[j]``.
        numel: length of the dense tensor.

    Example: ``SparseGrad(indices=[1, 4], values=[0.5, -2.0], numel=6)`` is the dense
    tensor ``[0, 0.5, 0, 0, -2.0, 0]``.
    """

    indices: torch.Tensor
    values: torch.Tensor
    numel: int
    capacity: int | None = None
    """At most this many entries, whatever the gradient: a bound the compressor keeps and
    every rank knows from the tensor alone, so the message can travel in a fixed-size buffer
    (:class:`FixedLayout`) with no size exchange. None: no bound below ``numel`` (only the
    entries sent travel, their count exchanged first)."""

    @property
    def count(self) -> int:
        """``k``, the number of entries sent."""
        return self.indices.numel()

    @staticmethod
    def from_dense(x: torch.Tensor) -> SparseGrad:
        """The nonzero entries of ``x`` (any shape, read flat)."""
        flat = x.reshape(-1)
        idx = flat.nonzero().squeeze(1)
        return SparseGrad(idx, flat[idx], flat.numel())

    @staticmethod
    def cat(parts: list[SparseGrad]) -> SparseGrad:
        """Messages of consecutive pieces of one flat tensor, joined: part ``i``'s indices
        are shifted by the lengths of parts ``0..i-1``. The capacity is the parts' sum (an
        unbounded part counts its ``numel``), or None when no part has one."""
        offset, idx = 0, []
        for p in parts:
            idx.append(p.indices + offset)
            offset += p.numel
        bounded = any(p.capacity is not None for p in parts)
        capacity = sum(p.numel if p.capacity is None else p.capacity for p in parts) if bounded else None
        return SparseGrad(torch.cat(idx), torch.cat([p.values for p in parts]), offset, capacity)

    def add_to(self, out: torch.Tensor) -> torch.Tensor:
        """``out[indices] += values`` for a flat ``out`` of ``numel`` elements; returns it."""
        if out.numel() != self.numel:
            raise ValueError(f"SparseGrad of {self.numel} entries added to a tensor of {out.numel()}")
        return out.index_add_(0, self.indices, self.values.to(out.dtype))

    def to_dense(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The ``[numel]`` dense tensor."""
        out = torch.zeros(self.numel, dtype=dtype or self.values.dtype, device=self.values.device)
        return self.add_to(out)


def index_dtype(numel: int) -> torch.dtype:
    """The smallest unsigned integer dtype that holds every index of a ``numel`` tensor."""
    for dt, bits in ((torch.uint8, 8), (torch.uint16, 16), (torch.uint32, 32)):
        if numel <= 1 << bits:
            return dt
    return torch.int64


def _bitmap_bytes(numel: int) -> int:
    return (numel + 7) // 8


def uses_bitmap(count: int, numel: int) -> bool:
    """True when a bitmap is smaller than an index list for ``count`` of ``numel`` entries
    (ties go to the index list)."""
    return _bitmap_bytes(numel) < count * index_dtype(numel).itemsize


def encoded_size(count: int, numel: int, value_dtype: torch.dtype) -> int:
    """Exact bytes of :func:`encode` for ``count`` entries of a ``numel`` tensor."""
    body = min(_bitmap_bytes(numel), count * index_dtype(numel).itemsize)
    return HEADER_BYTES + body + count * value_dtype.itemsize


def pack_bits(mask: torch.Tensor) -> torch.Tensor:
    """``[n]`` bool -> ``[ceil(n/8)]`` uint8; entry ``i`` is bit ``i % 8`` of byte ``i // 8``.
    On the CPU numpy's ``packbits`` (a tenth of the time of the shifts and sums below on
    300,000 entries)."""
    if mask.device.type == "cpu":
        return torch.from_numpy(np.packbits(mask.contiguous().numpy(), bitorder="little"))
    n = mask.numel()
    bits = torch.zeros(_bitmap_bytes(n) * 8, dtype=torch.uint8, device=mask.device)
    bits[:n] = mask
    return (bits.view(-1, 8) << _SHIFTS.to(mask.device)).sum(1).to(torch.uint8)


def unpack_bits(packed: torch.Tensor, n: int) -> torch.Tensor:
    """Inverse of :func:`pack_bits`: ``[ceil(n/8)]`` uint8 -> ``[n]`` bool."""
    if packed.device.type == "cpu":
        return torch.from_numpy(np.unpackbits(packed.contiguous().numpy(), count=n, bitorder="little").view(np.bool_))
    return ((packed.unsqueeze(1) >> _SHIFTS.to(packed.device)) & 1).view(-1)[:n].bool()


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def encode(msg: SparseGrad) -> torch.Tensor:
    """The message as ``[encoded_size(...)]`` uint8, in the smaller of the two layouts."""
    if uses_bitmap(msg.count, msg.numel):
        mask = torch.zeros(msg.numel, dtype=torch.bool, device=msg.indices.device)
        mask[msg.indices] = True
        tag, body = TAG_BITMAP, pack_bits(mask)
    else:
        tag, body = TAG_INDEX_LIST, _as_bytes(msg.indices.to(index_dtype(msg.numel)))
    return torch.cat([torch.tensor([tag], dtype=torch.uint8, device=body.device), body, _as_bytes(msg.values)])


def _view(raw: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    # A slice of a received buffer may start at any byte; a copy is aligned for the view.
    return raw.clone().view(dtype)


def decode(buf: torch.Tensor, numel: int, value_dtype: torch.dtype) -> SparseGrad:
    """Inverse of :func:`encode` for a message of a ``numel`` tensor with ``value_dtype``
    values. Raises ValueError on a message whose length does not fit its layout."""
    if buf.dtype != torch.uint8 or buf.dim() != 1 or buf.numel() < HEADER_BYTES:
        raise ValueError("a sparse message is a non-empty 1-D uint8 tensor")
    tag = int(buf[0])  # host read: the layout of the rest depends on it
    body, vb = buf[HEADER_BYTES:], value_dtype.itemsize
    if tag == TAG_BITMAP:
        nb = _bitmap_bytes(numel)
        if body.numel() < nb or (body.numel() - nb) % vb:
            raise ValueError(f"bitmap message of {buf.numel()} bytes does not fit {numel} entries")
        indices = unpack_bits(body[:nb], numel).nonzero().squeeze(1)
        raw_values = body[nb:]
        if indices.numel() * vb != raw_values.numel():
            raise ValueError("bitmap message: the bitmap and the number of values disagree")
    elif tag == TAG_INDEX_LIST:
        idt = index_dtype(numel)
        k, rem = divmod(body.numel(), idt.itemsize + vb)
        if rem:
            raise ValueError(f"index-list message of {buf.numel()} bytes is not a whole number of entries")
        indices = _view(body[: k * idt.itemsize], idt).to(torch.int64)
        raw_values = body[k * idt.itemsize:]
    else:
        raise ValueError(f"unknown sparse message tag {tag}")
    return SparseGrad(indices, _view(raw_values, value_dtype), numel)


ALIGN = 8
"""Bytes a fixed-size message's sections (and the message) are padded to: every section
of every rank's buffer, back to back in a received one, can then be viewed in its dtype."""


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


@dataclass(frozen=True)
class FixedLayout:
    """The fixed-size form of messages of at most ``capacity`` entries of a ``numel`` tensor
    with ``value_dtype`` values. Every rank derives it from the tensor alone, so no sizes
    travel, and a received buffer is added without a host read::

        [capacity values][pad to 8][capacity indices (index_dtype(numel)) | bitmap][pad to 8]

    The smaller of an index list and a bitmap for ``capacity`` entries (as :func:`encode`
    chooses for ``count``); no tag byte: both sides know which. Unused value slots hold
    ``-0.0`` and unused index slots 0: ``x + (-0.0)`` is ``x`` bit for bit, so the padding is
    added into entry 0 without changing it. With a bitmap, the ``k`` set bits take the
    first ``k`` values (a host read of ``k``).

    Example: capacity 3, numel 300, float32: 12 value bytes padded to 16, three uint16
    indices (6 bytes) padded to 8: 24 bytes. ``SparseGrad([1, 4], [0.5, -2.0], 300)`` is
    encoded as the values ``[0.5, -2.0, -0.0]`` and the indices ``[1, 4, 0]``.
    """

    capacity: int
    numel: int
    value_dtype: torch.dtype

    @property
    def bitmap(self) -> bool:
        return uses_bitmap(self.capacity, self.numel)

    @property
    def _values_bytes(self) -> int:
        return _aligned(self.capacity * self.value_dtype.itemsize)

    @property
    def _body_bytes(self) -> int:
        return _bitmap_bytes(self.numel) if self.bitmap else self.capacity * index_dtype(self.numel).itemsize

    @property
    def nbytes(self) -> int:
        """The size of every rank's buffer, padding included (what goes on the wire)."""
        return self._values_bytes + _aligned(self._body_bytes)

    def encode(self, msg: SparseGrad) -> torch.Tensor:
        """``msg`` as ``[nbytes]`` uint8. Raises ValueError when it does not fit."""
        if msg.numel != self.numel or msg.count > self.capacity or msg.values.dtype != self.value_dtype:
            raise ValueError(f"a message of {msg.count} {msg.values.dtype} entries of {msg.numel} does "
                             f"not fit a fixed layout of {self.capacity} {self.value_dtype} entries "
                             f"of {self.numel}")
        k = msg.count
        out = torch.zeros(self.nbytes, dtype=torch.uint8, device=msg.values.device)
        values = out[: self.capacity * self.value_dtype.itemsize].view(self.value_dtype)
        values[:k] = msg.values
        values[k:] = -0.0  # the additive identity: the padding changes no sum
        body = out[self._values_bytes: self._values_bytes + self._body_bytes]
        if self.bitmap:
            mask = torch.zeros(self.numel, dtype=torch.bool, device=msg.indices.device)
            mask[msg.indices] = True
            body.copy_(pack_bits(mask))
        else:  # unused slots stay index 0
            body.view(index_dtype(self.numel))[:k] = msg.indices.to(index_dtype(self.numel))
        return out

    def add_to(self, raw: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """``out += `` the message in ``raw`` (``[nbytes]`` uint8, from :meth:`encode`) for a
        flat ``out`` of ``numel`` elements; returns ``out``."""
        if raw.numel() != self.nbytes or out.numel() != self.numel:
            raise ValueError(f"fixed message of {raw.numel()} bytes into {out.numel()} entries: expected "
                             f"{self.nbytes} bytes into {self.numel}")
        if raw.storage_offset() % ALIGN:  # a view in a dtype wider than a byte needs it
            raw = raw.clone()
        values = raw[: self.capacity * self.value_dtype.itemsize].view(self.value_dtype)
        body = raw[self._values_bytes: self._values_bytes + self._body_bytes]
        if self.bitmap:
            bits = unpack_bits(body, self.numel)
            indices = (torch.from_numpy(np.flatnonzero(bits.numpy())) if bits.device.type == "cpu"
                       else bits.nonzero().squeeze(1))
            values = values[: indices.numel()]
        else:
            indices = body.view(index_dtype(self.numel)).to(torch.int64)
        return out.index_add_(0, indices, values.to(out.dtype))


class PendingSizes:
    """A size exchange under way (:func:`start_sizes`); :meth:`wait` gives the sizes."""

    def __init__(self, work, out: torch.Tensor, send: torch.Tensor) -> None:
        self._work, self._out, self._send = work, out, send  # both buffers live until the wait
        self._sizes: list[int] | None = None

    def wait(self) -> list[int]:
        """Every rank's message size, by rank (blocks until they are in; a host read)."""
        if self._sizes is None:
            self._work.wait()
            self._sizes = self._out.tolist()
            self._work = self._send = None
        return self._sizes


def start_sizes(size: int, group: dist.ProcessGroup, *, pairwise: bool = False) -> PendingSizes:
    """Starts the exchange of every rank's message size: an all-to-all of one int64 per
    rank pair (``pairwise``: through the receive-first isend/irecv exchange of
    :mod:`hybridrec.comm.exchange`, ``dist.exchange=pairwise``). Does not block; the
    byte exchange needs the result (its splits), so a caller that has other work first
    starts this, does the work, then waits."""
    world, device = group.size(), collective_device(group)
    out = torch.empty(world, dtype=torch.int64, device=device)
    send = torch.full((world,), size, dtype=torch.int64, device=device)
    if pairwise:
        work = PairwiseExchange([group], rank=group.rank(), world_size=world).all_to_all_single(out, send)
    else:
        work = dist.all_to_all_single(out, send, group=group, async_op=True)
    return PendingSizes(work, out, send)


def start_exchange(message: torch.Tensor, sizes: list[int], group: dist.ProcessGroup):
    """Sends ``message`` (this rank's, ``[sizes[rank]]`` uint8) to every other rank.

    Returns ``(future, received)``: when ``future`` completes, ``received`` holds the
    other ranks' messages back to back in rank order (``[sum of others' sizes]`` uint8;
    this rank's own message is not sent to itself).
    """
    rank, world = group.rank(), group.size()
    mine = sizes[rank]
    in_splits = [0 if r == rank else mine for r in range(world)]
    out_splits = [0 if r == rank else sizes[r] for r in range(world)]
    received = torch.empty(sum(out_splits), dtype=torch.uint8, device=message.device)
    send = message.repeat(world - 1)  # one copy per destination, as all_to_all_single wants
    work = dist.all_to_all_single(received, send, out_splits, in_splits, group=group, async_op=True)
    return work.get_future(), received


def start_pairwise_exchange(message: torch.Tensor, sizes: list[int], group: dist.ProcessGroup):
    """:func:`start_exchange` as pairwise isend/irecv, every receive posted before any send
    (:mod:`hybridrec.comm.exchange`), the same buffer sent to every peer (no copy per
    destination). gloo's point-to-point works have no future: a thread waits for them and
    completes the returned one. Same ``(future, received)`` as :func:`start_exchange`."""
    rank, world = group.rank(), group.size()
    received = torch.empty(sum(n for r, n in enumerate(sizes) if r != rank), dtype=torch.uint8,
                           device=message.device)
    parts = split_received(received, sizes, rank)
    works = [dist.irecv(part, group=group, group_src=p) for p, part in parts.items() if part.numel()]
    if message.numel():
        works += [dist.isend(message, group=group, group_dst=p) for p in range(world) if p != rank]
    fut: torch.futures.Future = torch.futures.Future()

    def wait() -> None:
        try:
            for w in works:
                w.wait()
        except Exception as e:  # noqa: BLE001 - handed to whoever waits on the future
            fut.set_exception(e)
        else:
            fut.set_result(None)

    threading.Thread(target=wait, name="sparse-exchange", daemon=True).start()
    return fut, received


def split_received(received: torch.Tensor, sizes: list[int], rank: int) -> dict[int, torch.Tensor]:
    """The other ranks' messages out of :func:`start_exchange`'s buffer, by rank."""
    out, start = {}, 0
    for r, n in enumerate(sizes):
        if r != rank:
            out[r] = received[start:start + n]
            start += n
    return out


def exchange_bytes(sizes: list[int], rank: int) -> tuple[int, int]:
    """``(sent, received)`` bytes on the wire of one exchange, for this rank: the size
    all-to-all (8 bytes per peer each way) and the messages."""
    peers = len(sizes) - 1
    sent = peers * (SIZE_BYTES + sizes[rank])
    received = peers * SIZE_BYTES + sum(n for r, n in enumerate(sizes) if r != rank)
    return sent, received
