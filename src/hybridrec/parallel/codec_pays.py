"""Whether compressing a hop pays here: the codecs' time, measured on this machine, against
the wire time they save, measured on this link. Two hops: the pooled embeddings'
(``compress.embedding_when=pays``, :func:`measure`) and the dense arches' gradients
(``compress.dense_when=pays``, :func:`measure_dense`). Each measures, then hands the numbers
to a pure function (:func:`decision`) that decides.

The pooled embeddings' hop. At start-up every rank times, on random rows of the step's real
shapes:

- the codecs' work of one step: encoding its block for the other ranks' samples, decoding
  every other owner's block for its own samples, and the same for the gradients (the best
  of ``reps``). What a rank keeps for its own samples is not coded (it does not travel:
  ``coded_dist``), so it is not timed;
- the exchange of one step's pooled rows, forward, and of their gradients, backward, as
  float32 and as encoded, through the hop's own all-to-all (``dist.exchange``), after a
  warm-up (the best of ``reps``); each with the split sizes of its hop (the float32 hop
  passes the rank's own rows through the all-to-all, the coded one sends itself nothing);
- the bottom MLP's forward and backward at the real batch: both exchanges travel behind it
  (the hop is asynchronous: ``coded_dist``'s start/finish pairs, docs/design.md "One
  training step"), so only the wire time beyond it costs the step.

Saved, per direction: ``max(0, plain - hidden) - max(0, coded - hidden)``, ``hidden`` the
bottom MLP's forward (for the rows) or backward (for their gradients): a link fast enough
to hide the plain hop behind the bottom MLP saves nothing by compressing it.

The dense arches' hop (DCT-DP, ``compress.dense=dct|topk``). Every rank times, on random
gradients of the real sizes (each arch's synced parameters, one message per arch):

- the compressor's work of one step: compressing every tensor, encoding each arch's message
  in its fixed-size buffer, and adding every rank's message into the arch's buffer (this
  rank's own encoded message stands in for its peers'). DCT: a refresh step (its top-k)
  and a step under a held threshold, weighed ``1 : L - 1`` (L its refresh period);
- the all-reduce of the arches' float32 gradients against the exchange of the fixed-size
  buffers (``all_to_all_single``, or pairwise with ``dist.exchange=pairwise``), through the
  group, after a warm-up (the best of ``reps``).

Saved: the all-reduce's time less the exchange's. Compressing pays, for either hop, when the
saving exceeds the codecs' time. The ranks take the slowest rank's numbers (an all-reduce of
their maxima), so every rank decides alike.

Simplifications, said:

- the overlap with the bottom MLP is counted as if the exchange and the MLP did not slow
  each other down (they share the rank's cores on a CPU), and the codecs' time is counted in
  full, none of it hidden; the bottom MLP is timed in float32 with the linear kernels it has
  before start-up tuning (``train.kernels``), whole even where ``dist.partition_dense`` will
  split it;
- the dense hop's overlap is not counted: with ``dist.dense_sync=ddp`` DDP's buckets travel
  during backward, partly behind it, so the saving is an upper bound there (exact for
  ``dist.dense_sync=allreduce``); an arch is one message, not DDP's buckets; DCT's ramp (its
  first refreshes sooner) is not weighed; random gradients stand for real ones (the count
  under a held threshold depends on them, up to the cap);
- a link whose rate varies during the run is measured once; on GPU ranks the embedding
  hop's timings are the host's;
- not measured (refused by the config check): the threshold variant of DCT-MP
  (``compress.embedding_select=threshold``), table_row_wise tables (whose in-host sums take
  a second hop), unbounded dense messages (``compress.dense_cap=0``, ratio 1), parameter
  servers (``dist.num_ps``); the replicated tables' compressed all-reduce
  (``compress.dense_replicated``) follows ``compress.dense`` as configured.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
from torch import nn

from hybridrec.comm import sparse_message as sm
from hybridrec.comm.compress import DCTCompressor, GradientCompressor
from hybridrec.comm.exchange import collective_device
from hybridrec.parallel.coded_dist import (
    decode_rows,
    encode_rows,
    exchange_splits,
    peer_splits,
    recv_order,
)


def _best_ms(fn, reps: int) -> float:
    best = float("inf")
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best * 1e3


def saving_ms(plain: float, coded: float, hidden: float = 0.0) -> float:
    """Milliseconds a step saves by sending ``coded`` instead of ``plain`` (each the
    exchange's time) when ``hidden`` ms of computation run while either travels: only the
    wire time beyond it costs the step."""
    return max(0.0, plain - hidden) - max(0.0, coded - hidden)


def decision(codec_ms: float, plain: Sequence[float], coded: Sequence[float],
             hidden: Sequence[float] | None = None) -> dict:
    """Whether compressing pays, from measured milliseconds: ``plain[i]`` / ``coded[i]`` the
    exchanges of direction ``i`` (forward, backward, ...), ``hidden[i]`` the computation
    they travel behind (None: none). ``{"saved_ms", "pays"}``: the saving summed over the
    directions, and whether it exceeds ``codec_ms``. A pure function: no timing."""
    hidden = [0.0] * len(plain) if hidden is None else hidden
    saved = sum(saving_ms(p, c, h) for p, c, h in zip(plain, coded, hidden, strict=True))
    return {"saved_ms": round(saved, 3), "pays": saved > codec_ms}


def _slowest(numbers: list[float], group, device) -> list[float]:
    """The maxima over ``group`` of every rank's ``numbers``, rounded to microseconds (a
    collective: every rank of ``group`` calls it with as many numbers)."""
    worst = torch.tensor(numbers, dtype=torch.float64, device=device)
    dist.all_reduce(worst, op=dist.ReduceOp.MAX, group=group)
    return [round(x, 3) for x in worst.tolist()]


# --- the pooled embeddings' hop ---------------------------------------------------------


def codec_ms(layout, batch_sizes: list[int], rank: int, *, reps: int = 3) -> float:
    """Milliseconds of the codecs' work of one step on ``rank`` (module docstring): its
    block's rows of the other ranks' samples encoded, and their gradients decoded; the
    other owners' blocks for its samples decoded, and their gradients encoded."""
    gen = torch.Generator().manual_seed(0)
    me, b = layout.coded_of(rank), batch_sizes[rank]
    others = sum(batch_sizes) - b  # (its own samples' rows are not coded)
    pooled = torch.randn(others, layout.blocks[rank].width, generator=gen)
    lays = [layout.coded_of(i) for o, i in recv_order(layout, rank) if o != rank]
    rows = [torch.randn(b, lay.width, generator=gen) for lay in lays]
    payloads = [encode_rows(x, lay, grad=False)[0] for x, lay in zip(rows, lays)]
    grads_back = torch.randn(others, me.bwd_bytes, generator=gen).to(torch.uint8)

    def step() -> None:
        _, own_states = encode_rows(pooled, me, grad=False)
        for x, lay, payload in zip(rows, lays, payloads):
            _, states = decode_rows(payload, lay, grad=False)
            encode_rows(x, lay, grad=True, states=states)
        decode_rows(grads_back, me, grad=True, states=own_states)

    step()  # (warm-up: first calls allocate)
    return _best_ms(step, reps)


def exchange_ms(layout, batch_sizes: list[int], topo, per_row, dtype: torch.dtype, *, reps: int = 3,
                backward: bool = False, coded: bool = False) -> float:
    """Milliseconds of one forward exchange of ``per_row(block)`` elements of ``dtype`` per
    sample and block, through ``topo``'s all-to-all, after a warm-up; ``backward``: the
    gradients' exchange, the other way round; ``coded``: the coded hop's splits (nothing to
    the rank itself), else the float32 hop's."""
    to, frm = (peer_splits if coded else exchange_splits)(layout, batch_sizes, topo.rank, per_row)
    if backward:
        to, frm = frm, to
    # (On the host as the codecs' timing is, except where NCCL takes device tensors only:
    # on GPU ranks this check compares host timings, a simplification.)
    send = torch.zeros(sum(to), dtype=dtype, device=topo.comm_device)
    recv = torch.empty(sum(frm), dtype=dtype, device=topo.comm_device)
    topo.all_to_all(recv, send, frm, to)  # (warm-up: every rank has arrived)
    return _best_ms(lambda: topo.all_to_all(recv, send, frm, to), reps)


def hidden_ms(bottom: nn.Module, batch_size: int, *, reps: int = 3) -> tuple[float, float]:
    """``(forward, backward)`` milliseconds of ``bottom`` (the bottom MLP: what the hop
    travels behind) on a random batch of ``batch_size`` rows. Its parameters' ``.grad`` are
    left as they were (the backward goes to ``torch.autograd.grad``)."""
    first = next(m for m in bottom.modules() if isinstance(m, nn.Linear))
    gen = torch.Generator().manual_seed(0)  # (not the global one: training draws from it)
    x = torch.randn(batch_size, first.in_features, generator=gen).to(first.weight.device).requires_grad_()
    inputs = [x, *(p for p in bottom.parameters() if p.requires_grad)]
    forward = _best_ms(lambda: bottom(x), reps + 1)  # (+1: the first call allocates)
    out = bottom(x)
    grad = torch.ones_like(out)
    torch.autograd.grad(out, inputs, grad, retain_graph=True)  # (warm-up)
    backward = _best_ms(lambda: torch.autograd.grad(out, inputs, grad, retain_graph=True), reps)
    return forward, backward


def measure(ebc, batch_size: int, bottom: nn.Module, *, reps: int = 3) -> dict:
    """Whether the codecs of ``ebc`` (a sharded collection) pay, every rank ``batch_size``
    samples, the hop travelling behind ``bottom`` (the bottom MLP): ``{"codec_ms",
    "float32_ms", "coded_ms", "float32_bwd_ms", "coded_bwd_ms", "hidden_fwd_ms",
    "hidden_bwd_ms", "saved_ms", "pays"}``, the slowest rank's numbers, the same on every
    rank (a collective: every rank of ``ebc.topo`` calls it)."""
    layout, topo = ebc.layout, ebc.topo
    sizes = [batch_size] * topo.group_size

    def wire(per_row, dtype, backward=False) -> float:
        return exchange_ms(layout, sizes, topo, per_row, dtype, reps=reps, backward=backward,
                           coded=dtype == torch.uint8)

    plain_row = lambda i: layout.all_blocks[i].width
    mine = [codec_ms(layout, sizes, topo.rank, reps=reps),
            wire(plain_row, torch.float32), wire(lambda i: layout.coded_of(i).fwd_bytes, torch.uint8),
            wire(plain_row, torch.float32, True), wire(lambda i: layout.coded_of(i).bwd_bytes, torch.uint8, True),
            *hidden_ms(bottom, batch_size, reps=reps)]
    codec, plain, coded, plain_bwd, coded_bwd, h_fwd, h_bwd = _slowest(mine, topo.group, topo.comm_device)
    return {"codec_ms": codec, "float32_ms": plain, "coded_ms": coded, "float32_bwd_ms": plain_bwd,
            "coded_bwd_ms": coded_bwd, "hidden_fwd_ms": h_fwd, "hidden_bwd_ms": h_bwd,
            **decision(codec, (plain, plain_bwd), (coded, coded_bwd), (h_fwd, h_bwd))}


# --- the dense arches' hop --------------------------------------------------------------


def _messages(compressor: GradientCompressor, arches: list[list[torch.Tensor]]) -> list[sm.SparseGrad]:
    """One step's message per arch: every tensor compressed (under its own key), joined."""
    out = []
    for a, grads in enumerate(arches):
        parts = [compressor.compress(f"{a}.{i}", g) for i, g in enumerate(grads)]
        out.append(sm.SparseGrad.cat([p if isinstance(p, sm.SparseGrad) else sm.SparseGrad.from_dense(p)
                                      for p in parts]))
    return out


def _layouts(msgs: list[sm.SparseGrad]) -> list[sm.FixedLayout]:
    for m in msgs:
        if m.capacity is None:  # (the config check refuses what sends these)
            raise ValueError("compress.dense_when=pays measures bounded messages only")
    return [sm.FixedLayout(m.capacity, m.numel, m.values.dtype) for m in msgs]


def dense_codec_ms(compressor: GradientCompressor, arches: list[list[torch.Tensor]], world: int, *,
                   reps: int = 3) -> float:
    """Milliseconds of ``compressor``'s work of one step on ``arches`` (per arch its
    gradients, each flat): compress, encode in the fixed layout, add ``world`` messages
    into the arch's buffer and average. ``compressor`` is used as given (a fresh one: its
    first step is a DCT refresh; the caller weighs refreshes)."""
    bufs = [torch.empty(sum(g.numel() for g in grads), device=grads[0].device) for grads in arches]

    def step() -> None:
        msgs = _messages(compressor, arches)
        for msg, layout, buf in zip(msgs, _layouts(msgs), bufs):
            raw = layout.encode(msg)
            buf.zero_()
            msg.add_to(buf)
            for _ in range(world - 1):
                layout.add_to(raw, buf)
            buf.div_(world)

    return _best_ms(step, reps)


def dense_compressor_ms(make: Callable[[], GradientCompressor], arches: list[list[torch.Tensor]], world: int, *,
                        reps: int = 3) -> tuple[float, float, float, int]:
    """``(per step, refresh, held, L)``: milliseconds of ``make()``'s compressor on ``arches``
    and its refresh period. DCT weighs a refresh step (a fresh compressor's, the best of ``reps`` fresh
    ones) and a step under a held threshold ``1 : L - 1``; top-k refreshes every step (L 1)."""
    proto = make()
    if not isinstance(proto, DCTCompressor):
        dense_codec_ms(proto, arches, world, reps=1)  # (warm-up)
        ms = dense_codec_ms(proto, arches, world, reps=reps)
        return ms, ms, ms, 1
    refresh = min(dense_codec_ms(make(), arches, world, reps=1) for _ in range(reps + 1))
    # The same compressor with a threshold that never refreshes after its first step.
    held_one = DCTCompressor(proto.ratio, 1 << 30, error_feedback=proto.error_feedback, cap=proto.cap)
    dense_codec_ms(held_one, arches, world, reps=1)  # (its refresh)
    held = dense_codec_ms(held_one, arches, world, reps=reps)
    every = proto.refresh_every
    return (refresh + (every - 1) * held) / every, refresh, held, every


def dense_exchange_ms(sizes: list[int], layouts: list[sm.FixedLayout], group, device: torch.device, *,
                      pairwise: bool = False, reps: int = 3) -> tuple[float, float]:
    """``(float32, coded)`` milliseconds of one step's exchange through ``group``: the
    all-reduce of every arch's ``sizes[a]`` float32 gradients, and the exchange of its
    ``layouts[a]`` fixed-size buffers (as the compressed hook sends them), after a warm-up."""
    world = group.size()
    plain = [torch.zeros(n, device=device) for n in sizes]
    coded = [torch.zeros(lay.nbytes, dtype=torch.uint8, device=device) for lay in layouts]
    start = sm.start_pairwise_exchange if pairwise else sm.start_exchange

    def all_reduce() -> None:
        for t in plain:
            dist.all_reduce(t, group=group)

    def exchange() -> None:
        futs = [start(raw, [raw.numel()] * world, group)[0] for raw in coded]
        for f in futs:
            f.wait()

    all_reduce()  # (warm-up: every rank has arrived)
    exchange()
    return _best_ms(all_reduce, reps), _best_ms(exchange, reps)


def measure_dense(make: Callable[[], GradientCompressor], sizes: list[list[int]], group, *,
                  device: torch.device, slowest_over=None, pairwise: bool = False, reps: int = 3) -> dict:
    """Whether ``make()``'s compressor pays on the dense arches' gradients (``sizes``: per
    arch, its tensors' sizes) through ``group``: ``{"codec_ms", "codec_refresh_ms",
    "codec_held_ms", "refresh_every", "float32_bytes", "coded_bytes", "float32_ms",
    "coded_ms", "saved_ms", "pays"}`` (bytes: one rank's gradients and buffers, per step),
    the slowest numbers over ``slowest_over`` (default ``group``), the same on every rank
    there (a collective: every rank of both groups calls it with the same sizes)."""
    gen = torch.Generator().manual_seed(0)
    arches = [[torch.randn(n, generator=gen).to(device) for n in arch] for arch in sizes]
    world = group.size()
    codec, refresh, held, every = dense_compressor_ms(make, arches, world, reps=reps)
    layouts = _layouts(_messages(make(), arches))
    plain_ms, coded_ms = dense_exchange_ms([sum(a) for a in sizes], layouts, group, device,
                                           pairwise=pairwise, reps=reps)
    over = slowest_over or group
    numbers = _slowest([codec, refresh, held, plain_ms, coded_ms], over, collective_device(over))
    codec, refresh, held, plain_ms, coded_ms = numbers
    return {"codec_ms": codec, "codec_refresh_ms": refresh, "codec_held_ms": held, "refresh_every": every,
            "float32_bytes": 4 * sum(sum(a) for a in sizes), "coded_bytes": sum(lay.nbytes for lay in layouts),
            "float32_ms": plain_ms, "coded_ms": coded_ms, **decision(codec, (plain_ms,), (coded_ms,))}
