"""ShardedLoader: rank slices = one global batch, deterministic windowed shuffle, exact resume."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import torch

from hybridrec.data.loader import ShardedLoader, _Order
from hybridrec.data.preprocess import preprocess_criteo
from hybridrec.errors import ConfigError

PART_ROWS = [37, 50, 13, 23]  # the last part is the eval split
N_TRAIN = sum(PART_ROWS[:-1])


def _line(i: int) -> str:
    bag = ",".join(f"{i * 10 + k:08x}" for k in range(i % 3))  # C1: i % 3 ids (maybe none)
    return "\t".join([str(i % 2), str(i), *["1"] * 12, bag, f"{i:08x}", *["0000000b"] * 24])


@pytest.fixture(scope="module")
def ds(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("loader")
    paths, start = [], 0
    for p, rows in enumerate(PART_ROWS):
        path = tmp / f"day_{p}.tsv"
        path.write_text("".join(_line(i) + "\n" for i in range(start, start + rows)))
        paths.append(path)
        start += rows
    preprocess_criteo(paths, tmp / "ds", table_size=1 << 14, multi_hot_fields="C1")
    return tmp / "ds"


def row_ids(batch) -> np.ndarray:
    """Each row wrote its own index as I1 (stored as log(1+i))."""
    return np.rint(np.expm1(batch.dense[:, 0].double().numpy())).astype(np.int64)


def ids_of(loader, epoch_batches=None) -> list[np.ndarray]:
    return [row_ids(b) for b in loader]


def test_rank_slices_equal_one_global_batch(ds):
    kw = {"shuffle_window": 16, "seed": 3, "prefetch": 0}
    whole = list(ShardedLoader(ds, "train", batch_size=12, **kw))
    ranks = [
        list(ShardedLoader(ds, "train", batch_size=3, rank=r, world_size=4, **kw)) for r in range(4)
    ]
    assert len(whole) == N_TRAIN // 12 and all(len(r) == len(whole) for r in ranks)
    for step, big in enumerate(whole):
        parts = [ranks[r][step] for r in range(4)]
        assert all(p.batch_size == 3 for p in parts)
        torch.testing.assert_close(torch.cat([p.dense for p in parts]), big.dense)
        torch.testing.assert_close(torch.cat([p.labels for p in parts]), big.labels)
        for key, (values, lengths) in big.sparse.split_by_key().items():
            pieces = [p.sparse.split_by_key()[key] for p in parts]
            assert torch.equal(torch.cat([v for v, _ in pieces]), values)
            assert torch.equal(torch.cat([n for _, n in pieces]), lengths)


def test_batch_contents(ds):
    (batch,) = list(ShardedLoader(ds, "eval", batch_size=100, prefetch=0))
    ids = row_ids(batch)
    assert ids.tolist() == list(range(N_TRAIN, N_TRAIN + 23))  # eval: in order
    assert batch.labels.tolist() == (ids % 2).tolist()
    assert batch.sparse.keys[:3] == ["C1", "C2", "C3"]
    values, lengths = batch.sparse.split_by_key()["C1"]
    assert lengths.tolist() == (ids % 3).tolist()
    assert values.tolist() == [i * 10 + k for i in ids for k in range(i % 3)]
    assert batch.sparse.split_by_key()["C2"][0].tolist() == ids.tolist()


def test_shuffle_is_deterministic_and_a_permutation(ds):
    def order(epoch, seed=0):
        loader = ShardedLoader(
            ds, "train", batch_size=7, drop_last=False, shuffle_window=16, seed=seed, prefetch=0
        )
        loader.set_epoch(epoch)
        return np.concatenate(ids_of(loader))

    a = order(0)
    assert sorted(a.tolist()) == list(range(N_TRAIN))
    assert np.array_equal(a, order(0))
    assert not np.array_equal(a, order(1)) and not np.array_equal(a, order(0, seed=1))


def test_windows_are_permuted_blocks():
    o = _Order(100, 16, seed=0, epoch=0, shuffle=True)
    rows = o.rows(0, 100)
    assert sorted(rows.tolist()) == list(range(100))
    for i, w in enumerate(o.slots):  # consecutive order positions stay inside one window
        block = rows[o.cum[i] : o.cum[i + 1]]
        assert sorted(block.tolist()) == list(range(w * 16, min(w * 16 + 16, 100)))
    assert np.array_equal(o.rows(10, 40), rows[10:40])


@pytest.mark.parametrize("k", [0, 3, 8])
def test_resume_is_exact(ds, k):
    kw = {"batch_size": 5, "shuffle_window": 16, "seed": 1, "prefetch": 2}
    ref = ShardedLoader(ds, "train", **kw)
    expected = ids_of(ref) + ids_of(ref)  # two epochs
    first = ShardedLoader(ds, "train", **kw)
    it = iter(first)
    got = [row_ids(next(it)) for _ in range(k)]
    state = first.state_dict()
    del it
    second = ShardedLoader(ds, "train", **kw)
    second.load_state_dict(state)
    got += ids_of(second)  # the rest of the epoch
    got += ids_of(second)  # and the next one
    assert len(got) == len(expected)
    assert all(np.array_equal(a, b) for a, b in zip(got, expected))


def test_resume_refuses_a_different_order(ds):
    state = ShardedLoader(ds, "train", batch_size=5).state_dict()
    with pytest.raises(ConfigError, match="global_batch_size"):
        ShardedLoader(ds, "train", batch_size=6).load_state_dict(state)
    # Same global batch on more ranks is the same order: allowed.
    ShardedLoader(ds, "train", batch_size=1, rank=1, world_size=5).load_state_dict(state)


def test_eval_keeps_partial_batch_and_splits_it_evenly(ds):
    per_rank = [
        list(ShardedLoader(ds, "eval", batch_size=5, rank=r, world_size=2, prefetch=0))
        for r in range(2)
    ]
    assert [len(b) for b in per_rank] == [3, 3]  # 23 rows, global batch 10
    assert [b.batch_size for b in per_rank[0]] == [5, 5, 2]
    assert [b.batch_size for b in per_rank[1]] == [5, 5, 1]
    seen = np.concatenate([row_ids(per_rank[r][s]) for s in range(3) for r in range(2)])
    assert seen.tolist() == list(range(N_TRAIN, N_TRAIN + 23))


def test_thread_error_propagates_and_thread_stops(ds, monkeypatch):
    loader = ShardedLoader(ds, "train", batch_size=4, prefetch=2)
    real, calls = loader.batch, []

    def flaky(rows):
        calls.append(1)
        if len(calls) == 3:
            raise ValueError("bad shard")
        return real(rows)

    monkeypatch.setattr(loader, "batch", flaky)
    with pytest.raises(ValueError, match="bad shard"):
        list(loader)
    it = iter(ShardedLoader(ds, "train", batch_size=4, prefetch=2))
    next(it)
    assert any(t.name == "hybridrec-loader" for t in threading.enumerate())
    del it  # dropping the iterator stops its thread
    deadline = time.time() + 5
    while any(t.name == "hybridrec-loader" for t in threading.enumerate()):
        assert time.time() < deadline, "loader thread still running"
        time.sleep(0.01)


def test_bad_arguments(ds):
    with pytest.raises(ConfigError, match="rank"):
        ShardedLoader(ds, "train", batch_size=4, rank=2, world_size=2)
    with pytest.raises(Exception, match="no split 'test'"):
        ShardedLoader(ds, "test")
