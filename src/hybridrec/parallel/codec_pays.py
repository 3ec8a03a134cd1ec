"""Whether compressing the pooled embeddings' hop pays here: the codecs' time, measured on this
machine, against the wire time they save, measured on this link (``compress.embedding_when=pays``).

At start-up every rank times, on random rows of the step's real shapes:

- the codecs' work of one step: encoding its block for every rank's samples, decoding every
  owner's block for its own samples, and the same for the gradients (the best of ``reps``);
- the exchange of one step's pooled rows as float32 and as encoded, through the hop's own
  all-to-all (``dist.exchange``), after a warm-up (the best of ``reps``).

The ranks take the slowest rank's numbers (an all-reduce of their maxima), so every rank
decides alike. Saved: twice the difference of the two exchanges (the rows forward and their
gradients backward; the coded gradients are smaller than the coded rows, so this is a lower
bound). Compressing pays when the saving exceeds the codecs' time.

Simplifications, said: both exchanges travel while the bottom MLP runs (the hop is
asynchronous), so the part of the wire time that hides behind it is counted as saved; a link
whose rate varies during the run is measured once; the threshold variant of DCT-MP
(``compress.embedding_select=threshold``) and table_row_wise tables (whose in-host sums take
a second hop) are not measured (refused by the config check).
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from hybridrec.parallel.coded_dist import _decode, _encode, _recv_order, _splits


def _best_ms(fn, reps: int) -> float:
    best = float("inf")
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best * 1e3


def codec_ms(layout, batch_sizes: list[int], rank: int, *, reps: int = 3) -> float:
    """Milliseconds of the codecs' work of one step on ``rank`` (module docstring)."""
    gen = torch.Generator().manual_seed(0)
    me, b = layout.coded_of(rank), batch_sizes[rank]
    pooled = torch.randn(sum(batch_sizes), layout.blocks[rank].width, generator=gen)
    lays = [layout.coded_of(i) for _, i in _recv_order(layout, rank)]
    rows = [torch.randn(b, lay.width, generator=gen) for lay in lays]
    payloads = [_encode(x, lay, grad=False)[0] for x, lay in zip(rows, lays)]
    grads_back = torch.randn(sum(batch_sizes), me.bwd_bytes, generator=gen).to(torch.uint8)

    def step() -> None:
        _, own_states = _encode(pooled, me, grad=False)
        for x, lay, payload in zip(rows, lays, payloads):
            _, states = _decode(payload, lay, grad=False)
            _encode(x, lay, grad=True, states=states)
        _decode(grads_back, me, grad=True, states=own_states)

    step()  # (warm-up: first calls allocate)
    return _best_ms(step, reps)


def exchange_ms(layout, batch_sizes: list[int], topo, per_row, dtype: torch.dtype, *, reps: int = 3) -> float:
    """Milliseconds of one forward exchange of ``per_row(block)`` elements of ``dtype`` per
    sample and block, through ``topo``'s all-to-all, after a warm-up."""
    to, frm = _splits(layout, batch_sizes, topo.rank, per_row)
    # (On the host as the codecs' timing is, except where NCCL takes device tensors only:
    # on GPU ranks this check compares host timings, a simplification.)
    send = torch.zeros(sum(to), dtype=dtype, device=topo.comm_device)
    recv = torch.empty(sum(frm), dtype=dtype, device=topo.comm_device)
    topo.all_to_all(recv, send, frm, to)  # (warm-up: every rank has arrived)
    return _best_ms(lambda: topo.all_to_all(recv, send, frm, to), reps)


def measure(ebc, batch_size: int, *, reps: int = 3) -> dict:
    """Whether the codecs of ``ebc`` (a sharded collection) pay, every rank ``batch_size``
    samples: ``{"codec_ms", "float32_ms", "coded_ms", "saved_ms", "pays"}``, the slowest rank's
    numbers, the same on every rank (a collective: every rank of ``ebc.topo`` calls it)."""
    layout, topo = ebc.layout, ebc.topo
    sizes = [batch_size] * topo.group_size
    mine = [codec_ms(layout, sizes, topo.rank, reps=reps),
            exchange_ms(layout, sizes, topo, lambda i: layout.all_blocks[i].width, torch.float32, reps=reps),
            exchange_ms(layout, sizes, topo, lambda i: layout.coded_of(i).fwd_bytes, torch.uint8, reps=reps)]
    worst = torch.tensor(mine, dtype=torch.float64, device=topo.comm_device)
    dist.all_reduce(worst, op=dist.ReduceOp.MAX, group=topo.group)
    codec, plain, coded = worst.tolist()
    saved = 2 * (plain - coded)
    return {"codec_ms": round(codec, 3), "float32_ms": round(plain, 3), "coded_ms": round(coded, 3),
            "saved_ms": round(saved, 3), "pays": saved > codec}
