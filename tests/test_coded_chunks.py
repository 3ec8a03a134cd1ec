"""The coded output hop in row chunks (``compress.embedding_chunks``): one chunk coded while
another travels. In one process: the chunks' rows and the automatic count. On 2 gloo ranks
(uneven batches, every codec, both exchanges): a chunked hop gives the bits of the unchunked
one, outputs, row gradients and ledger bytes alike, in as many exchanges as chunks each
way; the owner encodes chunk ``i + 1`` after chunk ``i`` is sent and before it is waited
for, the receiver decodes chunk ``i`` before chunk ``i + 1`` is waited for, and backward
likewise. On 4 ranks in two hosts of 2: the same with table_row_wise sums on the hop."""

from __future__ import annotations

import pytest
import test_table_row_wise as trw
import torch
from distributed import run_ranks
from test_codecs import BATCH, CODECS, DIM, ledger_counts, local_kjt, make_plan, tables

from hybridrec.comm.codecs import TopKCodec
from hybridrec.comm.ledger import CommLedger
from hybridrec.errors import ConfigError
from hybridrec.model.embedding import TableConfig
from hybridrec.parallel import plan as P
from hybridrec.parallel.coded_dist import (
    AUTO,
    CHUNK_BYTES,
    MAX_AUTO_CHUNKS,
    _chunk_rows,
    _own_ranges,
    _ranges,
    coded_chunks,
)
from hybridrec.parallel.layout import build_layout
from hybridrec.parallel.sharded_embedding import ShardedEmbeddingBagCollection
from hybridrec.parallel.topology import Topology
from hybridrec.train.setup.configure import build_config

# -- one process ---------------------------------------------------------------------------


@pytest.mark.parametrize("sizes, chunks", [([5, 3], 2), ([5, 3], 5), ([4, 0, 7], 3), ([1], 1), ([6, 6], 4)])
def test_chunks_tile_every_ranks_rows(sizes, chunks):
    seen = [[] for _ in sizes]
    for i in range(chunks):
        for d, (lo, hi) in enumerate(_chunk_rows(sizes, chunks, i)):
            seen[d] += range(lo, hi)
    assert seen == [list(range(n)) for n in sizes]  # every row once, in order
    # The same rows as ranges of a buffer of every rank's samples one after another.
    covered = sorted(r for i in range(chunks) for a, b in _ranges(sizes, _chunk_rows(sizes, chunks, i))
                     for r in range(a, b))
    assert covered == list(range(sum(sizes)))
    assert _ranges(sizes, _chunk_rows(sizes, 1, 0)) == [(0, sum(sizes))]  # one chunk: the whole buffer
    assert _ranges([], []) == []  # no ranks served: no range
    assert _ranges([5, 3], [(2, 2), (0, 3)]) == [(5, 8)]  # empty ones left out
    assert _ranges([2, 0, 3], [(0, 2), (0, 0), (0, 3)]) == [(0, 5)]  # (neighbours across an empty rank)


def test_a_rank_codes_only_the_other_ranks_rows():
    """4 ranks in hosts of 2 (batches [2, 3, 4, 3]), table_row_wise tables on both hosts:
    the ranges a rank encodes in a chunk leave out its own samples' rows, in its block (every
    rank's samples) and in its TRW sums (member 1 serves ranks 1 and 3)."""
    layout, sizes = build_layout(trw.tables(), trw.make_plan(4, 2), {}), trw.BATCH[4]
    assert layout.served(1) == (1, 3)
    assert _own_ranges(layout, sizes, 1, _chunk_rows(sizes, 1, 0)) == ([(0, 2), (5, 12)], [(3, 6)])
    assert _own_ranges(layout, sizes, 3, _chunk_rows(sizes, 1, 0)) == ([(0, 9)], [(0, 3)])
    # Chunk 1 of 2: ranks' rows [1, 2), [1, 3), [2, 4), [1, 3).
    assert _own_ranges(layout, sizes, 1, _chunk_rows(sizes, 2, 1)) == ([(1, 2), (7, 9), (10, 12)], [(4, 6)])


def bench_layout(rows_per_rank=2048, codec=None):
    """The benchmark DLRM's tables (26 x 64) table-wise on 2 ranks, every one coded."""
    names = [f"t{i}" for i in range(26)]
    tabs = [TableConfig(name=n, num_embeddings=100, embedding_dim=64, features=[f"f{i}"])
            for i, n in enumerate(names)]
    plan = P.ShardingPlan(world_size=2, local_world_size=2,
                          tables={n: P.table_wise(n, 100, 64, i % 2) for i, n in enumerate(names)})
    codec = codec or TopKCodec(0.05, "fp16")
    return build_layout(tabs, plan, {n: codec for n in names}), [rows_per_rank] * 2


def test_auto_chunks_follow_the_hops_size():
    layout, sizes = bench_layout(4096)
    # A rank codes its block (13 x 64) for the other rank's 4096 samples: 13.6 MB of float32 rows.
    share = 4096 * 13 * 64 * 4
    assert coded_chunks(AUTO, layout, sizes) == min(MAX_AUTO_CHUNKS, share // CHUNK_BYTES) == 3
    assert coded_chunks(AUTO, *bench_layout(2048)) == 1  # 6.8 MB: its own samples' rows are not coded
    small, small_sizes = bench_layout(64)
    assert coded_chunks(AUTO, small, small_sizes) == 1  # too small to pay: one exchange
    assert coded_chunks(1, layout, sizes) == 1  # asked for: as asked
    assert coded_chunks(3, layout, sizes) == 3
    assert coded_chunks(9, layout, [5, 3]) == 5  # never more chunks than the largest batch
    with pytest.raises(ValueError, match="chunks must be >= 0"):
        coded_chunks(-1, layout, sizes)


def test_config_sets_the_chunks_and_refuses_what_does_not_take_them():
    assert build_config(None, overrides=["compress.embedding=dct", "compress.embedding_chunks=3"]
                        ).compress.embedding_chunks == 3
    assert build_config(None).compress.embedding_chunks == 1  # one exchange unless asked
    for overrides in (["compress.embedding=dct", "compress.embedding_chunks=-1"],
                      ["compress.embedding_chunks=2"],  # the float32 hop
                      ["compress.embedding=dct", "compress.embedding_select=threshold", "compress.embedding_chunks=2"]):
        with pytest.raises(ConfigError, match="embedding_chunks"):
            build_config(None, overrides=overrides)


# -- 2 gloo ranks --------------------------------------------------------------------------
CASES = [("table_wise", "dct", None), ("table_wise", "dct_fp16", "keys"), ("row_wise", "dct", "numpy"),
         ("column_wise", "dct_bf16", None), ("mixed", "int8", None), ("row_wise", "fp16", None)]
CHUNKS = (1, 2, 3, 8)  # 8: more than rank 1's 3 samples (some chunks carry none of them)


def make_codec_of(name, impl):
    codec = TopKCodec(0.25, "fp16") if name == "dct_fp16" else CODECS[name]()
    if impl is not None:
        codec.impls[DIM] = impl
    return codec


def counted_exchanges(topo):
    """Counts the coded hop's exchanges (uint8 buffers; input_dist's are ids and lengths)."""
    count = [0]
    start = topo.all_to_all_start

    def counting(out, inp, out_splits, in_splits):
        count[0] += inp.dtype == torch.uint8
        return start(out, inp, out_splits, in_splits)

    topo.all_to_all_start = counting
    return count


def one_step(topo, kind, codec, chunks):
    """One forward and backward of the collection: output, row gradients, ledger bytes, the
    ledger's prediction check, and the hop's exchanges forward and backward."""
    count = counted_exchanges(topo)
    kjt = local_kjt(topo.rank, BATCH[topo.rank])
    w = torch.randn(BATCH[topo.rank], 4 * DIM, generator=torch.Generator().manual_seed(9))
    ledger = CommLedger()
    ebc = ShardedEmbeddingBagCollection(tables(), make_plan(kind), topo, seed=3, ledger=ledger,
                                        codecs={"t0": codec, "t1": codec}, coded_chunks=chunks)
    y = ebc(kjt).values
    fwd = count[0]
    (y * w).sum().backward()
    grads = [(grp, ids, rows) for rows_of in ebc.pop_sparse_grads().values() for grp, ids, rows, _ in rows_of]
    ledger.step_end()
    matched = [v["match"] for v in ledger.summary()["predicted_vs_counted"].values()]
    return y.detach(), grads, ledger_counts(ledger), matched, (fwd, count[0] - fwd)


def hop_worker(topo):
    out = {}
    start = topo.all_to_all_start
    for exchange in ("collective", "pairwise"):
        topo.exchange = exchange
        for kind, name, impl in CASES:
            for chunks in CHUNKS if exchange == "collective" else (1, 3):
                topo.all_to_all_start = start
                out[exchange, kind, name, chunks] = one_step(topo, kind, make_codec_of(name, impl), chunks)
    return out


@pytest.fixture(scope="module")
def two_ranks():
    return run_ranks(hop_worker, 2, timeout_s=120)


@pytest.mark.distributed
def test_chunked_hop_gives_the_bits_of_one_exchange(two_ranks):
    for per_rank in two_ranks:
        for (exchange, kind, name, chunks), (y, grads, counts, matched, exchanges) in per_rank.items():
            case = (exchange, kind, name, chunks)
            y1, grads1, counts1, _, _ = per_rank[exchange, kind, name, 1]
            assert torch.equal(y, y1), case
            assert len(grads) == len(grads1) > 0, case
            for (g, ids, rows), (g1, ids1, rows1) in zip(grads, grads1):
                assert g == g1 and torch.equal(ids, ids1) and torch.equal(rows, rows1), case
            assert counts == counts1, case  # the ledger's bytes, both ways
            assert matched and all(matched), case  # and the cost model's prediction
            assert exchanges == (min(chunks, max(BATCH)),) * 2, case  # one exchange a chunk, each way


def order_worker(topo, chunks):
    """The order of one step's codec calls and the hop's exchanges, on this rank."""
    events = []
    start, hop = topo.all_to_all_start, [0]

    class Logged:
        def __init__(self, handle, n):
            self.handle, self.n = handle, n

        def wait(self):
            self.handle.wait()
            events.append(("wait", self.n))

    def logged_start(out, inp, out_splits, in_splits):
        handle = start(out, inp, out_splits, in_splits)
        if inp.dtype != torch.uint8:  # input_dist's ids and lengths
            return handle
        events.append(("start", hop[0]))
        hop[0] += 1
        return Logged(handle, hop[0] - 1)

    class LoggedCodec(TopKCodec):
        def encode(self, x):
            events.append(("encode", None))
            return super().encode(x)

        def decode(self, payload, cols):
            events.append(("decode", None))
            return super().decode(payload, cols)

        def encode_grad(self, grad, state):
            events.append(("encode_grad", None))
            return super().encode_grad(grad, state)

        def decode_grad(self, payload, cols, state, out=None):
            events.append(("decode_grad", None))
            return super().decode_grad(payload, cols, state, out=out)

    topo.all_to_all_start = logged_start
    codec = LoggedCodec(0.25, "fp16")
    ebc = ShardedEmbeddingBagCollection(tables(), make_plan("table_wise"), topo, seed=3,
                                        codecs={"t0": codec, "t1": codec}, coded_chunks=chunks)
    ebc(local_kjt(topo.rank, BATCH[topo.rank])).values.sum().backward()
    return events


def between(events, kind, first, last):
    """Whether an event ``kind`` comes after event ``first`` and before event ``last``."""
    a, b = events.index(first), events.index(last)
    return any(e == kind for e, _ in events[a + 1 : b])


@pytest.mark.distributed
def test_one_chunk_is_coded_while_another_travels():
    k = 3
    for events in run_ranks(order_worker, 2, k):
        assert sum(e == "start" for e, _ in events) == 2 * k, events  # forward, then backward
        for i in range(1, k):
            # forward: chunk i encoded after chunk i - 1 was sent, which is waited for later;
            assert between(events, "encode", ("start", i - 1), ("start", i)), events
            assert events.index(("start", i)) < events.index(("wait", i - 1)), events
            # chunk i - 1 decoded before chunk i is waited for
            assert between(events, "decode", ("wait", i - 1), ("wait", i)), events
            # backward: the receiver's gradients alike, then the owner's decode
            j = k + i
            assert between(events, "encode_grad", ("start", j - 1), ("start", j)), events
            assert events.index(("start", j)) < events.index(("wait", j - 1)), events
            assert between(events, "decode_grad", ("wait", j - 1), ("wait", j)), events


# -- 4 gloo ranks in two hosts of 2: table_row_wise sums on the hop --------------------------
def trw_worker(topo):
    topo = Topology.init(backend="gloo", local_world_size=2)
    plan = trw.make_plan(4, 2)
    sizes = trw.BATCH[4]
    kjt_of, weights = trw.global_batch(sizes)
    lo = sum(sizes[: topo.rank])
    codecs = {"a": CODECS["int8"](), "b": CODECS["fp16"](), "c": TopKCodec(0.5, "fp16"), "e": TopKCodec(0.25)}
    out = {}
    for chunks in (1, 2, 4):
        ledger = CommLedger()
        count = counted_exchanges(topo)
        ebc = ShardedEmbeddingBagCollection(trw.tables(), plan, topo, seed=trw.SEED, ledger=ledger,
                                            codecs=codecs, coded_chunks=chunks)
        y = ebc(kjt_of(lo, lo + sizes[topo.rank])).values
        (y * weights[lo : lo + sizes[topo.rank]]).sum().backward()
        grads = [(grp, ids, rows) for rows_of in ebc.pop_sparse_grads().values() for grp, ids, rows, _ in rows_of]
        ledger.step_end()
        out[chunks] = (y.detach(), grads, ledger_counts(ledger), count[0])
        topo.all_to_all_start = Topology.all_to_all_start.__get__(topo)
    return out


@pytest.mark.distributed
def test_chunked_hop_with_table_row_wise_sums_gives_the_same_bits():
    for per_rank in run_ranks(trw_worker, 4, timeout_s=120):
        y1, grads1, counts1, _ = per_rank[1]
        for chunks in (2, 4):
            y, grads, counts, exchanges = per_rank[chunks]
            assert torch.equal(y, y1), chunks
            assert len(grads) == len(grads1) > 0
            for (g, ids, rows), (g1, ids1, rows1) in zip(grads, grads1):
                assert g == g1 and torch.equal(ids, ids1) and torch.equal(rows, rows1), chunks
            assert counts == counts1, chunks
            assert exchanges == 2 * chunks  # (the in-host sums travel as float32, not counted)
