"""Rank-sharded, deterministic, resumable batches from a preprocessed dataset.

The rows of a split's parts form one global index space ``[0, N)``. An epoch is
a permutation ``order`` of it; step ``t`` is the *global* batch
``order[t*G : (t+1)*G]`` with ``G = batch_size * world_size``, and rank ``r``
takes the ``r``-th contiguous slice of it. So N ranks together see exactly what
one process with batch ``G`` sees, in the same order (the equivalence the
synchronous trainers rely on), and resuming at step ``t`` needs only ``(epoch, t)``.

Worked example, N = 10, batch_size = 2, world_size = 2 (G = 4), no shuffle::

    step 0: global rows 0 1 2 3   -> rank 0: [0, 1]   rank 1: [2, 3]
    step 1: global rows 4 5 6 7   -> rank 0: [4, 5]   rank 1: [6, 7]
    step 2: global rows 8 9       -> drop_last: not yielded; else rank 0: [8]  rank 1: [9]

A partial last global batch is split as evenly as possible (rank r gets one more
row than the later ranks when it does not divide); every rank runs the same number
of steps, which keeps collectives in lockstep (a rank may get an empty batch
only when fewer rows than ranks remain).

Shuffling is windowed so memory stays O(window), not O(N): the index space is cut
into windows of ``shuffle_window`` rows; an epoch visits the windows in a
permuted order and each window's rows in a permuted order, every permutation
drawn from ``(seed, epoch, window)`` only, so any step can be recomputed.

Making a batch (what it costs: docs/benchmarks.md, "Input pipeline"): each column (dense,
labels, one-hot ids, a multi-hot feature's bag bounds and ids) is one ``np.take`` from the
part's memory map straight into batch order (a slice copy for consecutive rows; rows of
several parts are taken part by part, then ordered by one more take), and the ids become
the :class:`KeyedJagged` in one int64 buffer: the one-hot columns transposed once, each run
of one-hot keys and each multi-hot key copied into place (:func:`keyed_ids`). The rows and
their order are the row-by-row loader's, so every batch is bit for bit what it was
(``tests/test_data_loader.py`` holds the fingerprints). With ``prefetch`` and ``workers``
> 1, threads make whole batches side by side (numpy's takes and copies release the GIL),
yielded in step order. The shuffle itself is unchanged: reading shuffled rows as contiguous
blocks would be faster, but it would change what a seed trains.
"""

from __future__ import annotations

import collections
import os
import queue
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch

from hybridrec import launch_env
from hybridrec.data.id_ranges import check_part_ids
from hybridrec.data.schema import DatasetMeta, Schema
from hybridrec.errors import ConfigError, DataError
from hybridrec.sparse.keyed_jagged import Batch, KeyedJagged
from hybridrec.threads import single_threaded


def open_array(path: Path) -> np.ndarray:
    """``path`` memory-mapped, or a :class:`DataError` saying what is wrong with the file:
    missing, not an ``.npy``, or shorter or longer than its header's shape (a copy cut
    short would otherwise fail only when a batch reaches its end, or not at all)."""
    try:
        with open(path, "rb") as f:
            fmt = np.lib.format
            version = fmt.read_magic(f)
            read = fmt.read_array_header_1_0 if version == (1, 0) else fmt.read_array_header_2_0
            shape, _, dtype = read(f)
            offset = f.tell()
        size = path.stat().st_size
    except FileNotFoundError:
        raise DataError(f"{path}: missing") from None
    except (OSError, ValueError) as e:
        raise DataError(f"{path}: cannot read array ({e})") from None
    if dtype.hasobject:
        raise DataError(f"{path}: cannot read array (it holds Python objects)")
    expected = offset + int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    if size != expected:
        what = "truncated" if size < expected else "longer than its header says"
        raise DataError(f"{path}: {what}: {size:,} bytes, its header's shape {tuple(shape)} "
                        f"of {dtype} takes {expected:,}")
    try:
        return np.load(path, mmap_mode="r")
    except (OSError, ValueError) as e:
        raise DataError(f"{path}: cannot read array ({e})") from None


class _Part:
    """The memory-mapped arrays of one part directory, their shapes and ids checked
    (:mod:`hybridrec.data.id_ranges`)."""

    def __init__(self, directory: Path, schema: Schema, rows: int) -> None:
        def load(name: str) -> np.ndarray:
            return open_array(directory / name)

        self.labels = load("labels.npy")
        self.dense = load("dense.npy")
        self.onehot = load("onehot.npy")
        self.mh = {
            f.name: (load(f"mh-{f.name}.values.npy"), load(f"mh-{f.name}.offsets.npy"))
            for f in schema.multihot
        }
        expect = {
            "labels.npy": (self.labels, (rows,)),
            "dense.npy": (self.dense, (rows, len(schema.dense))),
            "onehot.npy": (self.onehot, (rows, len(schema.onehot))),
        }
        for name, (values, offsets) in self.mh.items():
            expect[f"mh-{name}.offsets.npy"] = (offsets, (rows + 1,))
            expect[f"mh-{name}.values.npy"] = (values, (int(offsets[-1]) if offsets.size else 0,))
        for name, (array, shape) in expect.items():
            if array.shape != shape:
                raise DataError(f"{directory / name}: shape {array.shape}, expected {shape}")
        ids = {"onehot.npy": (self.onehot, [f.name for f in schema.onehot])}
        ids.update({f"mh-{name}.values.npy": (values, [name]) for name, (values, _) in self.mh.items()})
        check_part_ids(directory, ids, schema.num_embeddings)


def check_parts(meta: DatasetMeta) -> None:
    """Open every part of ``meta`` as a loader does: each file present and as long as its
    header says, shapes as meta.json's rows, every id inside its table. The first
    problem is a :class:`DataError` naming the file."""
    for p in meta.parts:
        _Part(meta.part_dir(p.name), meta.schema, p.rows)


class _Order:
    """The epoch's row order, computed window by window on demand."""

    def __init__(self, n: int, window: int, seed: int, epoch: int, shuffle: bool) -> None:
        self.n, self.window, self.seed, self.epoch, self.shuffle = n, window, seed, epoch, shuffle
        n_windows = -(-n // window) if n else 0
        if shuffle:
            slots = np.random.default_rng([seed, epoch, 0]).permutation(n_windows)
        else:
            slots = np.arange(n_windows)
        self.slots = slots  # slots[i] = the window visited i-th
        lengths = np.minimum(window, n - slots * window)
        self.cum = np.concatenate([[0], np.cumsum(lengths)])
        self._cache: dict[int, np.ndarray] = {}
        self._lock = threading.Lock()

    def _window(self, w: int) -> np.ndarray:
        with self._lock:  # (the loader's worker threads share the order)
            if w not in self._cache:
                if len(self._cache) >= 4:  # a batch spans few windows; keep the recent ones
                    self._cache.pop(next(iter(self._cache)))
                lo = w * self.window
                size = min(self.window, self.n - lo)
                perm = np.random.default_rng([self.seed, self.epoch, 1, w]).permutation(size)
                self._cache[w] = perm + lo
            return self._cache[w]

    def rows(self, lo: int, hi: int) -> np.ndarray:
        """Global row ids at order positions ``[lo, hi)``."""
        if not self.shuffle or hi <= lo:
            return np.arange(lo, hi, dtype=np.int64)
        first = int(np.searchsorted(self.cum, lo, side="right")) - 1
        last = int(np.searchsorted(self.cum, hi - 1, side="right")) - 1
        pieces = []
        for i in range(first, last + 1):
            a, b = max(lo, self.cum[i]) - self.cum[i], min(hi, self.cum[i + 1]) - self.cum[i]
            pieces.append(self._window(int(self.slots[i]))[a:b])
        return np.concatenate(pieces).astype(np.int64, copy=False)


def default_workers(pin_memory: bool) -> int:
    """Loader threads of a rank: 1 beside a step on the CPU (the step has the cores); beside a
    step on a GPU (``pin_memory``) this rank's share of the cores it may run on
    (``LOCAL_WORLD_SIZE`` ranks share them), less one for the thread that runs the step."""
    if not pin_memory:
        return 1
    local = max(1, launch_env.local_world_size(1))
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, cores // local - 1)


def steps_per_epoch(rows: int, batch_size: int, world_size: int, *, drop_last: bool = True) -> int:
    """Steps in one epoch of ``rows`` rows read ``batch_size`` rows per rank by ``world_size``
    ranks: whole global batches (``drop_last``), else the last one partial. The one home of
    this arithmetic: the loader's length, and the checks and plans made before a loader exists."""
    g = batch_size * world_size
    return rows // g if drop_last else -(-rows // g)


def rank_slice(total: int, rank: int, world_size: int) -> tuple[int, int]:
    """Rank ``rank``'s contiguous piece of ``total`` rows (near-equal, earlier ranks larger)."""
    base, extra = divmod(total, world_size)
    start = rank * base + min(rank, extra)
    return start, start + base + (rank < extra)


class ShardedLoader:
    """Iterate this rank's :class:`~hybridrec.sparse.keyed_jagged.Batch` es of a split.

    Args:
        dataset: dataset directory or a loaded :class:`DatasetMeta`.
        split: "train" or "eval" (any split named in meta.json).
        batch_size: rows per rank per step.
        rank, world_size: this process's place among the data-parallel ranks.
        shuffle: default True for "train", False otherwise.
        shuffle_window: rows per shuffle window (memory and randomness trade-off).
        seed: with the epoch, fixes every permutation.
        drop_last: drop a partial last global batch; default True for "train", else False.
        prefetch: batches prepared ahead by a background thread (0: none, no thread).
        pin_memory: yield batches in page-locked memory (made there by the prefetch
            threads, when there are some), for a copy to a GPU that does not block the host.
        workers: threads that make batches, each a whole batch, when ``prefetch`` > 0
            (batches are yielded in order whatever thread made them). None:
            :func:`default_workers`: one beside a CPU step, this rank's share of the
            machine's cores beside a GPU step (``pin_memory``).

    ``len(loader)`` is the number of steps per epoch (the same on every rank).
    ``state_dict()`` is ``{"epoch", "step"}`` of the next batch to yield; a loader
    given it by ``load_state_dict`` continues exactly there.
    """

    def __init__(
        self,
        dataset: str | os.PathLike | DatasetMeta,
        split: str = "train",
        batch_size: int = 2048,
        rank: int = 0,
        world_size: int = 1,
        *,
        shuffle: bool | None = None,
        shuffle_window: int = 1 << 20,
        seed: int = 0,
        drop_last: bool | None = None,
        prefetch: int = 2,
        pin_memory: bool = False,
        workers: int | None = None,
    ) -> None:
        self.meta = dataset if isinstance(dataset, DatasetMeta) else DatasetMeta.load(dataset)
        if batch_size < 1 or world_size < 1 or not 0 <= rank < world_size:
            raise ConfigError(
                f"loader: need batch_size >= 1 and 0 <= rank < world_size "
                f"(got batch_size={batch_size}, rank={rank}, world_size={world_size})"
            )
        if shuffle_window < 1 or seed < 0 or prefetch < 0:
            raise ConfigError("loader: shuffle_window >= 1, seed >= 0 and prefetch >= 0 please")
        if workers is not None and workers < 1:
            raise ConfigError(f"loader: workers must be >= 1 (got {workers})")
        self.workers = default_workers(pin_memory) if workers is None else workers
        self.split, self.batch_size, self.rank, self.world_size = (
            split,
            batch_size,
            rank,
            world_size,
        )
        self.shuffle = (split == "train") if shuffle is None else bool(shuffle)
        self.drop_last = (split == "train") if drop_last is None else bool(drop_last)
        self.shuffle_window, self.seed, self.prefetch = shuffle_window, seed, prefetch
        self.pin_memory = pin_memory
        self.schema = self.meta.schema
        infos = self.meta.split_parts(split)
        self._parts = [_Part(self.meta.part_dir(p.name), self.schema, p.rows) for p in infos]
        self._bounds = np.concatenate([[0], np.cumsum([p.rows for p in infos])]).astype(np.int64)
        self.num_rows = int(self._bounds[-1])
        self.global_batch_size = batch_size * world_size
        self.epoch = 0
        self._step = 0

    def __len__(self) -> int:
        return steps_per_epoch(self.num_rows, self.global_batch_size, 1, drop_last=self.drop_last)

    def set_epoch(self, epoch: int) -> None:
        """Start ``epoch`` from its first step (its shuffle depends on it)."""
        self.epoch, self._step = int(epoch), 0

    def state_dict(self) -> dict:
        return {
            "epoch": self.epoch,
            "step": self._step,
            "seed": self.seed,
            "global_batch_size": self.global_batch_size,
            "num_rows": self.num_rows,
            "shuffle": self.shuffle,
            "shuffle_window": self.shuffle_window,
        }

    def load_state_dict(self, state: dict) -> None:
        mine = self.state_dict()
        for key in ("seed", "global_batch_size", "num_rows", "shuffle", "shuffle_window"):
            if key in state and state[key] != mine[key]:
                raise ConfigError(
                    f"loader state: {key} was {state[key]!r} when saved, is {mine[key]!r} now; "
                    "the row order would differ"
                )
        self.epoch, self._step = int(state["epoch"]), int(state["step"])

    def rows(self, step: int, epoch: int | None = None, order: _Order | None = None) -> np.ndarray:
        """Global row ids of this rank's batch at ``step`` (in batch order)."""
        if order is None:
            order = self._order(self.epoch if epoch is None else epoch)
        g = self.global_batch_size
        lo, hi = step * g, min((step + 1) * g, self.num_rows)
        a, b = rank_slice(max(hi - lo, 0), self.rank, self.world_size)
        return order.rows(lo + a, lo + b)

    def _order(self, epoch: int) -> _Order:
        return _Order(self.num_rows, self.shuffle_window, self.seed, epoch, self.shuffle)

    def __iter__(self) -> Iterator[Batch]:
        if self._step >= len(self):  # saved right after the last batch: next epoch
            self.epoch, self._step = self.epoch + 1, 0
        epoch, start = self.epoch, self._step
        prefetcher = self._prefetcher(epoch, start)
        try:
            for step, batch in prefetcher or self._produce(epoch, start):
                self._step = step + 1  # the consumer has this batch: resume after it
                yield batch
            self.epoch, self._step = epoch + 1, 0
        finally:
            if prefetcher is not None:
                prefetcher.close()  # also when the consumer drops the iterator mid-epoch

    def _prefetcher(self, epoch: int, start: int) -> _Prefetcher | _Workers | None:
        """The threads that make this pass's batches ahead (None: each made when taken)."""
        if not self.prefetch:
            return None
        if self.workers == 1:
            return _Prefetcher(self._produce(epoch, start), self.prefetch)
        order = self._order(epoch)
        return _Workers(lambda step: self.batch(self.rows(step, order=order)),
                        range(start, len(self)), self.workers, self.prefetch)

    def _produce(self, epoch: int, start: int) -> Iterator[tuple[int, Batch]]:
        order = self._order(epoch)
        for step in range(start, len(self)):
            yield step, self.batch(self.rows(step, order=order))  # (pinned as made)

    def batch(self, rows: np.ndarray) -> Batch:
        """The Batch of the given global rows, in that order."""
        return self.assemble(self.gather(rows))

    def gather(self, rows: np.ndarray) -> _Gathered:
        """The rows' columns read from the shards, in the order given: dense features and
        labels (into the batch's own tensors, page-locked with ``pin_memory``), the one-hot
        ids row by row, and each multi-hot feature's bags. A column is one ``np.take`` per
        part the rows fall in (a slice when the rows are consecutive); rows from several
        parts are taken part by part, then put in batch order by one more ``np.take``."""
        n = rows.size
        dense = _empty((n, len(self.schema.dense)), torch.float32, self.pin_memory)
        labels = _empty((n,), torch.float32, self.pin_memory)
        onehot = np.empty((n, len(self.schema.onehot)), np.int32)
        segs, inv = self._segments(rows)
        _take_rows(segs, "dense", inv, dense.numpy())
        _take_rows(segs, "labels", inv, labels.numpy())
        _take_rows(segs, "onehot", inv, onehot)
        bags = {f.name: _gather_bags(f.name, segs, inv) for f in self.schema.multihot}
        return _Gathered(dense, labels, onehot, bags)

    def assemble(self, g: _Gathered) -> Batch:
        """The Batch of gathered columns: the ids key-major in one int64 buffer."""
        return Batch(dense=g.dense, sparse=keyed_ids(self.schema, g.onehot, g.bags, pin=self.pin_memory),
                     labels=g.labels)

    def _segments(self, rows: np.ndarray) -> tuple[list[tuple[_Part, slice | np.ndarray]], np.ndarray | None]:
        """``[(part, its rows)]`` of the parts the rows fall in (rows as a slice when they are
        consecutive), and the batch order of their concatenation: None when it is already
        in batch order, else ``inv`` with batch row ``i`` at position ``inv[i]``."""
        n = rows.size
        if n == 0:
            return [], None
        bounds = self._bounds
        first, last = int(rows[0]), int(rows[-1])
        if last - first == n - 1 and (n == 1 or bool((np.diff(rows) == 1).all())):
            segs = []
            for p, part in enumerate(self._parts):
                a, b = max(first, int(bounds[p])), min(last + 1, int(bounds[p + 1]))
                if a < b:
                    segs.append((part, slice(a - int(bounds[p]), b - int(bounds[p]))))
            return segs, None
        lo, hi = np.searchsorted(bounds, [rows.min(), rows.max()], side="right") - 1
        if lo == hi:
            return [(self._parts[lo], rows - bounds[lo])], None
        which = np.searchsorted(bounds, rows, side="right") - 1
        segs, positions = [], []
        for p in range(int(lo), int(hi) + 1):
            pos = np.flatnonzero(which == p)  # batch positions of the part's rows
            if pos.size:
                segs.append((self._parts[p], rows[pos] - bounds[p]))
                positions.append(pos)
        inv = np.empty(n, np.int64)
        inv[np.concatenate(positions)] = np.arange(n)
        return segs, inv


class _Gathered(NamedTuple):
    """A batch's columns as read (:meth:`ShardedLoader.gather`)."""

    dense: torch.Tensor
    labels: torch.Tensor
    onehot: np.ndarray
    bags: dict[str, tuple[np.ndarray, np.ndarray]]


def _empty(shape: tuple[int, ...], dtype: torch.dtype, pin: bool) -> torch.Tensor:
    """A new tensor, page-locked when ``pin`` (the batch is then made where it is copied
    from, not copied once more to pin it)."""
    return torch.empty(shape, dtype=dtype, pin_memory=pin)


def _take_rows(segs: list, column: str, inv: np.ndarray | None, out: np.ndarray) -> None:
    """``out`` = the rows ``segs`` name of one column of the parts, in batch order (``inv``:
    :meth:`ShardedLoader._segments`). ``np.take``, not indexing: indexing a memory map by
    an array, or assigning through one, is several times slower."""
    into = out if inv is None else np.empty(out.shape, getattr(segs[0][0], column).dtype)
    at = 0
    for part, local in segs:
        src = getattr(part, column)
        size = local.stop - local.start if isinstance(local, slice) else local.size
        dst = into[at : at + size]
        if isinstance(local, slice):
            dst[...] = src[local]
        elif dst.dtype == src.dtype:
            np.take(src, local, axis=0, out=dst)
        else:
            dst[...] = np.take(src, local, axis=0)
        at += size
    if inv is not None:
        if out.dtype == into.dtype:
            np.take(into, inv, axis=0, out=out)
        else:
            out[...] = np.take(into, inv, axis=0)


def keyed_ids(schema: Schema, onehot: np.ndarray, mh: dict, *, pin: bool = False) -> KeyedJagged:
    """A batch's ids as the model takes them: one-hot ids ``[n, n_onehot]`` and
    ``{feature: (ids, bag sizes [n])}`` (the loader's batches and prediction's).

    Made in one int64 values buffer and one int32 lengths buffer (page-locked with
    ``pin``): the one-hot columns transposed once, then each run of consecutive one-hot
    keys and each multi-hot key copied into its place, so a batch costs a few copies
    whatever its number of features. The facts the forward asks of a batch (ids per key,
    one id per bag) are known here and handed to it."""
    n = onehot.shape[0]
    bags = {name: (np.asarray(ids), np.asarray(sizes)) for name, (ids, sizes) in mh.items()}
    per_key = []
    for f in schema.features:
        if f.kind == "onehot":
            per_key.append(n)
            continue
        ids, sizes = bags[f.name]
        if ids.size != int(sizes.sum()) or sizes.shape != (n,):
            raise DataError(f"{f.name}: {ids.size} ids for {sizes.size} bags of {int(sizes.sum())} "
                            f"ids in a batch of {n}")
        per_key.append(ids.size)
    values = _empty((sum(per_key),), torch.int64, pin)
    lengths = _empty((len(per_key) * n,), torch.int32, pin)
    v, ln = values.numpy(), lengths.numpy()
    cols = torch.from_numpy(np.ascontiguousarray(onehot)).t().contiguous().numpy()  # [n_onehot, n]
    at = 0
    for first, count, source in _runs(schema):
        key_lengths = ln[first * n : (first + count) * n]
        if isinstance(source, int):  # one-hot columns source .. source + count - 1
            v[at : at + count * n].reshape(count, n)[...] = cols[source : source + count]
            key_lengths[:] = 1
            at += count * n
        else:
            ids, sizes = bags[source]
            v[at : at + ids.size] = ids
            key_lengths[:] = sizes
            at += ids.size
    one_id = all(bool((sizes == 1).all()) for _, sizes in bags.values())
    return KeyedJagged(schema.feature_names, values, lengths, length_per_key=per_key,
                       one_id_per_bag=one_id)


def _runs(schema: Schema) -> tuple[tuple[int, int, int | str], ...]:
    """The keys in order as ``(first key, keys, source)``: a run of consecutive one-hot
    keys (source: its first column of the one-hot ids) or one multi-hot key (its name)."""
    runs: list[tuple[int, int, int | str]] = []
    column = 0
    for key, f in enumerate(schema.features):
        if f.kind != "onehot":
            runs.append((key, 1, f.name))
        elif runs and isinstance(runs[-1][2], int) and runs[-1][0] + runs[-1][1] == key:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1, runs[-1][2])
        else:
            runs.append((key, 1, column))
        column += f.kind == "onehot"
    return tuple(runs)


def _gather_bags(name: str, segs: list, inv: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
    """Bags of a multi-hot feature for the batch, in batch order: (ids as stored, int32
    lengths). Consecutive rows' bags are one slice of a part's ids; other rows' are taken
    with :func:`_jagged_take`, part by part, then put in batch order by ``inv``."""
    if not segs:
        return np.empty(0, np.int64), np.empty(0, np.int32)
    ids, lengths = [], []
    for part, local in segs:
        src, offsets = part.mh[name]
        if isinstance(local, slice):
            edges = np.asarray(offsets[local.start : local.stop + 1])
            lengths.append(np.diff(edges))
            ids.append(np.asarray(src[int(edges[0]) : int(edges[-1])]))
        else:
            starts = np.take(offsets, local)
            lengths.append(np.take(offsets, local + 1) - starts)
            ids.append(_jagged_take(src, starts, lengths[-1]))
    values, sizes = (ids[0], lengths[0]) if len(segs) == 1 else (np.concatenate(ids), np.concatenate(lengths))
    if inv is not None:
        starts = np.cumsum(sizes) - sizes
        sizes = np.take(sizes, inv)
        values = _jagged_take(values, np.take(starts, inv), sizes)
    return values, sizes.astype(np.int32)


def _jagged_take(src: np.ndarray, starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """``concatenate([src[s : s + n] for s, n in zip(starts, lengths)])``, vectorized."""
    total = int(lengths.sum())
    if total == 0:
        return np.empty(0, src.dtype)
    index = np.repeat(starts - (np.cumsum(lengths) - lengths), lengths)  # start - bag's place
    index += np.arange(total)
    return np.take(src, index)


class _Workers:
    """Batches made by ``n`` threads, one whole batch each, yielded in step order.

    ``make(step)`` runs in the threads; at most ``n + depth`` steps are under way or made
    and not yet taken. numpy's gathers and copies release the GIL, so the threads make
    batches side by side. An exception in a thread is re-raised in the consumer when its
    step is due; :meth:`close` drops the steps not started and waits for those running.
    """

    def __init__(self, make: Callable[[int], Batch], steps: range, n: int, depth: int) -> None:
        self._make, self._steps, self._ahead = make, steps, n + depth
        self._pool = ThreadPoolExecutor(n, thread_name_prefix="hybridrec-loader",
                                        initializer=single_threaded)  # (the step has the cores)
        self._pending: collections.deque = collections.deque()

    def __iter__(self) -> Iterator[tuple[int, Batch]]:
        steps = iter(self._steps)
        for step in steps:
            self._pending.append((step, self._pool.submit(self._make, step)))
            if len(self._pending) >= self._ahead:
                break
        while self._pending:
            step, future = self._pending.popleft()
            batch = future.result()
            nxt = next(steps, None)
            if nxt is not None:
                self._pending.append((nxt, self._pool.submit(self._make, nxt)))
            yield step, batch

    def close(self) -> None:
        for _, future in self._pending:
            future.cancel()
        self._pending.clear()
        self._pool.shutdown(wait=True, cancel_futures=True)


_END = object()


class _Failure:
    def __init__(self, exc: BaseException) -> None:
        self.exc = exc


class _Prefetcher:
    """Runs a generator in a daemon thread, ``depth`` items ahead.

    numpy gathers and torch conversions release the GIL, so this overlaps with the
    training step. An exception in the thread is re-raised in the consumer;
    :meth:`close` stops the thread (it checks the stop flag while waiting to put).
    """

    def __init__(self, source: Iterator, depth: int) -> None:
        self._q: queue.Queue = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._run, args=(source,), name="hybridrec-loader", daemon=True
        )
        self._thread.start()

    def _run(self, source: Iterator) -> None:
        single_threaded()  # (the step has the cores; hybridrec.threads)
        try:
            for item in source:
                if not self._put(item):
                    return
            self._put(_END)
        except BaseException as e:  # noqa: BLE001 (handed to the consumer)
            self._put(_Failure(e))

    def _put(self, item) -> bool:
        while not self._stop.is_set():
            try:
                self._q.put(item, timeout=0.05)
                return True
            except queue.Full:
                continue
        return False

    def __iter__(self):
        while True:
            try:
                item = self._q.get(timeout=1.0)
            except queue.Empty:
                if not self._thread.is_alive():
                    raise RuntimeError("loader thread ended without a result") from None
                continue
            if item is _END:
                return
            if isinstance(item, _Failure):
                raise item.exc
            yield item

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)
