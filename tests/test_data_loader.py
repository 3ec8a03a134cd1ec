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


# -- the same batches, bit for bit, as the loader made them before its fast paths -----------
# FINGERPRINTS were computed with the row-by-row loader (argsort, gather, scatter; one
# torch.cat of the keys' values): a change that makes batches faster must not change a bit
# of them, nor the order a seed trains.
MH_FIELDS = ("C1", "C3", "C4", "C9")  # runs of one-hot keys between them, one at the start


def _wide_line(i: int, multi_hot: bool) -> str:
    def bag(field: int) -> str:
        if not multi_hot or f"C{field}" not in MH_FIELDS:
            return f"{(i * 7 + field * 13) % 997:08x}"
        return ",".join(f"{(i * 31 + field * 5 + k) % 883:08x}" for k in range((i + field) % 4))

    dense = [str(i), str(i % 5), *[str((i * k) % 11) for k in range(11)]]
    return "\t".join([str(i % 2), *dense, *[bag(f) for f in range(1, 27)]])


@pytest.fixture(scope="module", params=["one-hot", "multi-hot"])
def wide(request, tmp_path_factory):
    """1,300 training rows in two parts and 300 held out; 26 one-hot features, or four of
    them multi-hot (bags of 0-3 ids)."""
    multi = request.param == "multi-hot"
    tmp = tmp_path_factory.mktemp(request.param)
    paths, start = [], 0
    for p, rows in enumerate([700, 600, 300]):
        path = tmp / f"day_{p}.tsv"
        path.write_text("".join(_wide_line(i, multi) + "\n" for i in range(start, start + rows)))
        paths.append(path)
        start += rows
    preprocess_criteo(paths, tmp / "ds", table_size=1 << 10, multi_hot_fields=MH_FIELDS if multi else ())
    return request.param, tmp / "ds"


def fingerprint(batches) -> str:
    """sha256 of every tensor's dtype, shape and bytes, and the keys, of ``batches``."""
    import hashlib

    h = hashlib.sha256()
    for b in batches:
        kjt = b.sparse
        h.update(repr(kjt.keys).encode())
        for t in (b.dense, b.labels, kjt.values, kjt.lengths):
            h.update(f"{t.dtype}{tuple(t.shape)}".encode())
            h.update(t.contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


LOADERS = {  # name: (split, loader arguments)
    "shuffled": ("train", {"batch_size": 64, "shuffle_window": 100, "seed": 3}),
    "shuffled-one-window": ("train", {"batch_size": 96, "seed": 5}),
    "shuffled-rank1": ("train", {"batch_size": 40, "rank": 1, "world_size": 3, "shuffle_window": 256}),
    "shuffled-epoch2": ("train", {"batch_size": 128, "shuffle_window": 512, "seed": 1, "epoch": 2}),
    "unshuffled": ("train", {"batch_size": 96, "shuffle": False}),
    "eval-rank0": ("eval", {"batch_size": 70, "rank": 0, "world_size": 2}),
    "eval-rank1": ("eval", {"batch_size": 70, "rank": 1, "world_size": 2}),
    "eval-rank6-of-7": ("eval", {"batch_size": 1, "rank": 6, "world_size": 7}),  # last batch empty
    "eval-rank0-of-7": ("eval", {"batch_size": 1, "rank": 0, "world_size": 7}),
}
FINGERPRINTS = {
    ("one-hot", "shuffled"): "b28ae7d6ed6584a5",
    ("one-hot", "shuffled-one-window"): "baa59ac6190d4ecb",
    ("one-hot", "shuffled-rank1"): "09ba498391d78103",
    ("one-hot", "shuffled-epoch2"): "7d0cc95a28be1ad3",
    ("one-hot", "unshuffled"): "8ac9464272137644",
    ("one-hot", "eval-rank0"): "da520a0b61dd341f",
    ("one-hot", "eval-rank1"): "be455ccb9b4be2b2",
    ("one-hot", "eval-rank6-of-7"): "7561bea7258957b2",
    ("one-hot", "eval-rank0-of-7"): "8335dae846bf105c",
    ("multi-hot", "shuffled"): "d7293f9820fe109f",
    ("multi-hot", "shuffled-one-window"): "4ce927bf7e0a0828",
    ("multi-hot", "shuffled-rank1"): "a91da66cb70eb38c",
    ("multi-hot", "shuffled-epoch2"): "9dee004281f86d4c",
    ("multi-hot", "unshuffled"): "8493b6069956551f",
    ("multi-hot", "eval-rank0"): "e81ad8ef82400bd5",
    ("multi-hot", "eval-rank1"): "8f8d03be8c56fc8e",
    ("multi-hot", "eval-rank6-of-7"): "6cbc246474a32c29",
    ("multi-hot", "eval-rank0-of-7"): "f5e518d0012eb92c",
}


def _epoch(ds, split: str, kw: dict, **extra) -> list:
    kw = dict(kw)
    epoch = kw.pop("epoch", 0)
    loader = ShardedLoader(ds, split, **kw, **extra)
    loader.set_epoch(epoch)
    return list(loader)


@pytest.mark.parametrize("name", list(LOADERS))
def test_batches_are_bit_identical_to_the_row_by_row_loader(wide, name):
    kind, ds = wide
    split, kw = LOADERS[name]
    got = fingerprint(_epoch(ds, split, kw, prefetch=0))
    assert got == FINGERPRINTS[kind, name]


@pytest.mark.parametrize("workers, prefetch", [(2, 1), (3, 2)])
def test_worker_threads_yield_the_same_batches_in_order(wide, workers, prefetch):
    kind, ds = wide
    for name in ("shuffled", "shuffled-rank1", "eval-rank1"):
        split, kw = LOADERS[name]
        got = fingerprint(_epoch(ds, split, kw, prefetch=prefetch, workers=workers))
        assert got == FINGERPRINTS[kind, name], name


def test_a_batch_brings_its_facts_and_they_are_right(wide):
    from hybridrec.sparse.keyed_jagged import KeyedJagged

    kind, ds = wide
    for batch in ShardedLoader(ds, "train", batch_size=100, shuffle_window=64, prefetch=0):
        kjt = batch.sparse
        fresh = KeyedJagged(kjt.keys, kjt.values, kjt.lengths)  # works them out from the tensors
        assert kjt.length_per_key() == fresh.length_per_key()
        assert kjt.one_id_per_bag() == fresh.one_id_per_bag() == (kind == "one-hot")


@pytest.mark.parametrize("k", [0, 5])
def test_resume_with_worker_threads_is_exact(wide, k):
    _, ds = wide
    kw = {"batch_size": 48, "shuffle_window": 200, "seed": 4, "prefetch": 1, "workers": 3}
    expected = [fingerprint([b]) for b in _epoch(ds, "train", kw) + _epoch(ds, "train", {**kw, "epoch": 1})]
    first = ShardedLoader(ds, "train", **kw)
    it = iter(first)
    got = [fingerprint([next(it)]) for _ in range(k)]
    state = first.state_dict()
    del it
    second = ShardedLoader(ds, "train", **kw)
    second.load_state_dict(state)
    got += [fingerprint([b]) for b in second] + [fingerprint([b]) for b in second]
    assert got == expected


def test_worker_error_propagates_and_threads_stop(ds, monkeypatch):
    loader = ShardedLoader(ds, "train", batch_size=4, prefetch=1, workers=3)
    real = loader.batch

    def flaky(rows):
        if 5 in rows.tolist():
            raise ValueError("bad shard")
        return real(rows)

    monkeypatch.setattr(loader, "batch", flaky)
    with pytest.raises(ValueError, match="bad shard"):
        list(loader)
    it = iter(ShardedLoader(ds, "train", batch_size=4, prefetch=1, workers=3))
    next(it)
    assert any(t.name.startswith("hybridrec-loader") for t in threading.enumerate())
    del it  # dropping the iterator stops its threads
    deadline = time.time() + 5
    while any(t.name.startswith("hybridrec-loader") for t in threading.enumerate()):
        assert time.time() < deadline, "loader threads still running"
        time.sleep(0.01)


def test_default_workers_share_the_cores_among_local_ranks(ds, monkeypatch):
    from hybridrec.data.loader import default_workers

    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(16)))
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert default_workers(pin_memory=False) == 1  # beside a CPU step: the step has the cores
    assert default_workers(pin_memory=True) == 15
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert default_workers(pin_memory=True) == 3
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "32")
    assert default_workers(pin_memory=True) == 1
    assert ShardedLoader(ds, "train").workers == 1
    with pytest.raises(ConfigError, match="workers must be >= 1"):
        ShardedLoader(ds, "train", workers=0)


def test_keyed_ids_refuses_bags_that_do_not_add_up(ds):
    from hybridrec.data.loader import keyed_ids
    from hybridrec.data.schema import DatasetMeta
    from hybridrec.errors import DataError

    schema = DatasetMeta.load(ds).schema  # C1 multi-hot, C2..C26 one-hot
    onehot = np.zeros((3, 25), np.int32)
    kjt = keyed_ids(schema, onehot, {"C1": (np.arange(3), np.array([2, 0, 1]))})
    assert kjt.values[:3].tolist() == [0, 1, 2] and kjt.lengths[:3].tolist() == [2, 0, 1]
    with pytest.raises(DataError, match="C1: 4 ids for 3 bags of 3 ids"):
        keyed_ids(schema, onehot, {"C1": (np.arange(4), np.array([1, 1, 1]))})
