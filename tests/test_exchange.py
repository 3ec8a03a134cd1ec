"""PairwiseExchange equals dist.all_to_all_single (uneven splits, 1 and N groups, 2-3 ranks)."""

import pytest
import torch
import torch.distributed as dist
from distributed import run_ranks

from hybridrec.comm.exchange import PairwiseExchange, _slices


def test_slices_cover_the_block_in_order():
    flat = torch.arange(10.0)
    for k in (1, 2, 3, 4, 10, 13):
        pieces = _slices(flat, k)
        assert torch.equal(torch.cat(pieces), flat)
        assert len(pieces) == min(k, 10) and all(p.numel() for p in pieces)
        sizes = [p.numel() for p in pieces]
        assert max(sizes) - min(sizes) <= 1  # near-equal
        # Views, no copies: the same storage, each piece starting where the previous ended.
        offset = 0
        for p in pieces:
            assert p.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr()
            assert p.storage_offset() == offset and p.is_contiguous()
            offset += p.numel()
    # Writing through the views writes the block (what the receives rely on).
    flat = torch.zeros(7)
    for g, p in enumerate(_slices(flat, 3)):
        p.fill_(g + 1)
    assert flat.tolist() == [1, 1, 2, 2, 3, 3, 3]
    assert _slices(torch.empty(0), 3) == []


def _compare(topo):
    """One group and one group per rank: the same results as gloo's all_to_all_single."""
    return [_compare_with(topo, [topo.group]),
            _compare_with(topo, topo.parallel_groups(topo.group_size))]


def _compare_with(topo, groups):
    rank, world = topo.rank, topo.group_size
    ex = PairwiseExchange(groups, rank=rank, world_size=world)
    g = torch.Generator().manual_seed(rank)
    # Rows rank r sends to rank p: (r + 2p) % 4, a zero among them (an empty block).
    in_splits = [(rank + 2 * p) % 4 for p in range(world)]
    out_splits = [(r + 2 * rank) % 4 for r in range(world)]
    x = torch.randn(sum(in_splits), 3, 5, generator=g)
    ours = torch.full((sum(out_splits), 3, 5), float("nan"))
    ref = torch.empty_like(ours)
    handle = ex.all_to_all_single(ours, x, out_splits, in_splits)
    assert handle.wait() is ours
    dist.all_to_all_single(ref, x, out_splits, in_splits, group=topo.group)
    even = torch.arange(4.0 * world) + 100 * rank  # default (even) splits, 1-D
    got = ex.all_to_all_single(torch.empty_like(even), even).wait()
    want = torch.empty_like(even)
    dist.all_to_all_single(want, even, group=topo.group)
    return torch.equal(ours, ref), torch.equal(got, want)


@pytest.mark.distributed
@pytest.mark.timeout(120)
@pytest.mark.parametrize("world", [2, 3])
def test_equals_all_to_all_single(world):
    assert run_ranks(_compare, world) == [[(True, True)] * 2] * world


def _bad_splits(topo):
    ex = PairwiseExchange([topo.group], rank=topo.rank, world_size=topo.group_size)
    with pytest.raises(ValueError, match="do not cover"):
        ex.all_to_all_single(torch.empty(4), torch.empty(4), [1, 1], [2, 1])
    with pytest.raises(ValueError, match="not divisible"):
        ex.all_to_all_single(torch.empty(3), torch.empty(3))
    with pytest.raises(ValueError, match="contiguous"):
        ex.all_to_all_single(torch.empty(4), torch.empty(2, 4).t())
    # Nothing of the refused calls is in flight: the next exchange gets exactly its own rows.
    return ex.all_to_all_single(torch.empty(4), torch.arange(4.0) + 10 * topo.rank).wait().tolist()


@pytest.mark.distributed
@pytest.mark.timeout(120)
def test_bad_splits_are_refused_before_anything_is_sent():
    assert run_ranks(_bad_splits, 2) == [[0.0, 1.0, 10.0, 11.0], [2.0, 3.0, 12.0, 13.0]]
