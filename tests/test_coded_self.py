"""The coded output hop codes what travels, and only that: a rank's own samples' rows from
its own tables never cross a link, so they reach it as float32, bit for bit the float32
hop's, forward and backward, while every other owner's rows are the codec's round trip.
On real gloo ranks (2, and 3 with an empty batch; uneven batches; table-, row-, column-wise
and mixed plans; DCT and int8 beside float32 tables; 1 and several row chunks): the
outputs and the gradients to ``pooled`` against the float32 hop and a local round trip,
the hop's split to itself (0 bytes both ways), and the ledger's bytes against the codecs'
byte formulas (docs/design.md, the table of bytes per row). A world of one rank: the coded
hop is the float32 hop, exactly, and nothing is exchanged. (table_row_wise sums a rank
serves itself: tests/test_table_row_wise.py.)"""

from __future__ import annotations

import pytest
import torch
from distributed import run_ranks
from test_codecs import make_plan as codec_plan
from test_codecs import tables

from hybridrec.comm.codecs import make_codec
from hybridrec.comm.ledger import CommLedger
from hybridrec.parallel.coded_dist import (
    _chunk_rows,
    decode_rows,
    encode_rows,
    output_all_to_all_start,
)
from hybridrec.parallel.layout import build_layout

pytestmark = pytest.mark.distributed

CODECS = {"dct": lambda: make_codec("dct", eta=0.25), "dct_fp16": lambda: make_codec("dct", eta=0.25, values="fp16"),
          "int8": lambda: make_codec("int8")}


def make_plan(kind, world):
    return codec_plan(kind, world, replicated=False)  # (every table has a hop)


def weight(dest, owner, rows, cols):
    """The loss's weights of owner ``owner``'s block at rank ``dest``: every rank can make any."""
    return torch.randn(rows, cols, generator=torch.Generator().manual_seed(1000 + 10 * dest + owner))


def one_hop(topo, layout, sizes, chunks):
    """One exchange of a random block and its gradients (loss: every received block times
    :func:`weight`): ``(owners' blocks, pooled, pooled's gradient, ledger bytes, this rank's
    splits to itself in the coded exchanges)``."""
    me = topo.rank
    start, splits = topo.all_to_all_start, []

    def logged(out, inp, out_splits, in_splits):
        if inp.dtype == torch.uint8:  # the coded hop's buffers
            splits.append((in_splits[me], out_splits[me]))
        return start(out, inp, out_splits, in_splits)

    topo.all_to_all_start = logged
    try:
        gen = torch.Generator().manual_seed(50 + me)
        pooled = torch.randn(sum(sizes), layout.blocks[me].width, generator=gen).requires_grad_()
        ledger = CommLedger()
        owners, _ = output_all_to_all_start(pooled, pooled.new_zeros(0, 0), layout, sizes, topo, ledger,
                                            chunks=chunks).wait()
        sum((x * weight(me, o, *x.shape)).sum() for o, x in enumerate(owners)).backward()
        ledger.step_end()
    finally:
        topo.all_to_all_start = start
    counts = {d: (c.sent, c.received, c.original) for d in ("fwd", "bwd")
              for c in [ledger.totals(category="output_dist", direction=d)]}
    return [x.detach() for x in owners], pooled.detach(), pooled.grad, counts, splits


def hop_worker(topo, sizes, cases, chunk_counts):
    out = {}
    for kind, codec_name in cases:
        codec = CODECS[codec_name]()
        plan = make_plan(kind, topo.group_size)
        plain = one_hop(topo, build_layout(tables(), plan, {}), sizes, 1)
        coded_layout = build_layout(tables(), plan, {"t0": codec, "t1": codec})  # t2 stays float32
        for chunks in chunk_counts:
            out[kind, codec_name, chunks] = plain, one_hop(topo, coded_layout, sizes, chunks)
        # What the codecs make of the rows, locally: the reference for what crosses a link.
        me, lays = topo.rank, coded_layout.coded
        received = [decode_rows(encode_rows(x, lays[o], grad=False)[0], lays[o], grad=False)[0]
                    for o, x in enumerate(plain[0])]
        grads = []  # the gradients of this rank's block's rows of every rank's samples, as they come back
        for d, (x, (lo, hi)) in enumerate(zip(torch.split(plain[1], sizes), _chunk_rows(sizes, 1, 0))):
            payload, sent = encode_rows(x, lays[me], grad=False)
            _, got = decode_rows(payload, lays[me], grad=False)
            g = encode_rows(weight(d, me, hi - lo, x.shape[1]), lays[me], grad=True, states=got)[0]
            grads.append(decode_rows(g, lays[me], grad=True, states=sent)[0])
        out[kind, codec_name, "round trip"] = received, torch.cat(grads)
    return out


def check_hop(results, sizes, cases, chunk_counts):
    told_apart = 0  # checks of a kept block whose round trip is not the float32 hop's
    for me, per_rank in enumerate(results):
        lo, hi = sum(sizes[:me]), sum(sizes[: me + 1])  # this rank's samples' rows in its block
        for kind, codec_name in cases:
            received, grads = per_rank[kind, codec_name, "round trip"]
            for chunks in chunk_counts:
                case = (me, kind, codec_name, chunks)
                plain, coded = per_rank[kind, codec_name, chunks]
                (owners, pooled, grad, _, splits), (p_owners, p_pooled, p_grad, _, _) = coded, plain
                assert torch.equal(pooled, p_pooled), case  # (the same block in both hops)
                for o, (x, p, r) in enumerate(zip(owners, p_owners, received)):
                    if o == me:  # kept: the float32 hop's bits
                        assert torch.equal(x, p), case
                        told_apart += not torch.equal(r, p)
                    else:  # crossed a link: the codec's round trip
                        assert torch.equal(x, r), (case, o)
                # Gradients to pooled: the rank's own samples' rows exact, the rest through the codec.
                assert torch.equal(grad[lo:hi], p_grad[lo:hi]), case
                assert torch.equal(grad[lo:hi], weight(me, me, hi - lo, grad.shape[1])), case
                assert torch.equal(grad[:lo], grads[:lo]) and torch.equal(grad[hi:], grads[hi:]), case
                assert splits and all(s == (0, 0) for s in splits), case  # nothing to itself, both ways
                assert len(splits) == 2 * max(1, min(chunks, max(sizes)))  # one exchange a chunk each way
    assert told_apart > 0  # (had the kept rows been coded, the checks above would have failed)


CASES2 = [("table_wise", "dct"), ("row_wise", "dct_fp16"), ("column_wise", "dct"), ("mixed", "int8")]


@pytest.mark.parametrize("sizes", [[5, 3], [4, 0]])
def test_own_rows_arrive_exact_and_the_others_through_the_codec_on_two_ranks(sizes):
    chunks = (1, 3)
    check_hop(run_ranks(hop_worker, 2, sizes, CASES2, chunks, timeout_s=120), sizes, CASES2, chunks)


def test_own_rows_arrive_exact_on_three_ranks_one_without_samples():
    sizes, cases, chunks = [3, 0, 4], [("table_wise", "dct"), ("mixed", "dct_fp16")], (1, 2)
    check_hop(run_ranks(hop_worker, 3, sizes, cases, chunks, timeout_s=120), sizes, cases, chunks)


# -- the ledger: the bytes that cross links, as before --------------------------------------
def expected_bytes(rank, sizes, values):
    """The ledger's bytes of one step on ``rank`` of 2, table-wise (t0 and t2 on rank 0,
    t1 with its 2 features on rank 1; t0 and t1 coded), from the codecs' byte formulas: DCT
    at eta 0.25 keeps k = 2 of 8 columns, ``k (v + 1)`` bytes forward (uint8 positions) and
    ``k v`` backward per piece and row; a float32 piece 32 both ways. ``original``: 32 per
    piece. Only the other rank's rows: what a rank sends itself is not counted."""
    v = {"fp32": 4, "fp16": 2}[values]
    fwd_row = {0: 2 * (v + 1) + 32, 1: 2 * 2 * (v + 1)}  # per owner, per row of its block
    bwd_row = {0: 2 * v + 32, 1: 2 * 2 * v}
    other = 1 - rank
    return {"fwd": (sizes[other] * fwd_row[rank], sizes[rank] * fwd_row[other], sizes[other] * 64),
            "bwd": (sizes[rank] * bwd_row[other], sizes[other] * bwd_row[rank], sizes[rank] * 64)}


@pytest.mark.parametrize("sizes", [[5, 3], [4, 0]])
def test_ledger_counts_the_bytes_that_cross_links(sizes):
    cases = [("table_wise", "dct"), ("table_wise", "dct_fp16")]
    for rank, per_rank in enumerate(run_ranks(hop_worker, 2, sizes, cases, (1, 3))):
        for _, codec_name in cases:
            want = expected_bytes(rank, sizes, "fp16" if codec_name == "dct_fp16" else "fp32")
            for chunks in (1, 3):
                plain, coded = per_rank["table_wise", codec_name, chunks]
                assert coded[3] == want, (rank, codec_name, chunks, coded[3], want)
                assert plain[3]["fwd"][2] == plain[3]["fwd"][0] == want["fwd"][2]  # float32: original = sent


# -- one rank: nothing crosses -------------------------------------------------------------
def alone_worker(topo):
    out = {}
    for kind in ("table_wise", "row_wise"):
        plan = make_plan(kind, 1)
        plain = one_hop(topo, build_layout(tables(), plan, {}), [6], 1)
        codec = make_codec("dct", eta=0.25)
        for chunks in (1, 0, 3):  # (0: auto)
            out[kind, chunks] = plain, one_hop(topo, build_layout(tables(), plan, {"t0": codec, "t1": codec}),
                                               [6], chunks)
    return out


def test_one_rank_coded_hop_is_the_float32_hop():
    (per_rank,) = run_ranks(alone_worker, 1)
    for case, (plain, coded) in per_rank.items():
        (owners, _, grad, counts, splits), (p_owners, _, p_grad, p_counts, _) = coded, plain
        assert len(owners) == 1 and torch.equal(owners[0], p_owners[0]), case
        assert torch.equal(grad, p_grad), case
        assert splits == [], case  # no coded exchange at all
        assert counts == p_counts == {"fwd": (0, 0, 0), "bwd": (0, 0, 0)}, case
