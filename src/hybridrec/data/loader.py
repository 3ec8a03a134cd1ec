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
"""

from __future__ import annotations

import os
import queue
import threading
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

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

    def _window(self, w: int) -> np.ndarray:
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
        pin_memory: yield batches in page-locked memory (made by the prefetch thread,
            when there is one), for a copy to a GPU that does not block the host.

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
    ) -> None:
        self.meta = dataset if isinstance(dataset, DatasetMeta) else DatasetMeta.load(dataset)
        if batch_size < 1 or world_size < 1 or not 0 <= rank < world_size:
            raise ConfigError(
                f"loader: need batch_size >= 1 and 0 <= rank < world_size "
                f"(got batch_size={batch_size}, rank={rank}, world_size={world_size})"
            )
        if shuffle_window < 1 or seed < 0 or prefetch < 0:
            raise ConfigError("loader: shuffle_window >= 1, seed >= 0 and prefetch >= 0 please")
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
        g = self.global_batch_size
        return self.num_rows // g if self.drop_last else -(-self.num_rows // g)

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
        source = self._produce(epoch, start)
        prefetcher = _Prefetcher(source, self.prefetch) if self.prefetch else None
        try:
            for step, batch in prefetcher or source:
                self._step = step + 1  # the consumer has this batch: resume after it
                yield batch
            self.epoch, self._step = epoch + 1, 0
        finally:
            if prefetcher is not None:
                prefetcher.close()  # also when the consumer drops the iterator mid-epoch

    def _produce(self, epoch: int, start: int) -> Iterator[tuple[int, Batch]]:
        order = self._order(epoch)
        for step in range(start, len(self)):
            batch = self.batch(self.rows(step, order=order))
            yield step, batch.pin_memory() if self.pin_memory else batch

    def batch(self, rows: np.ndarray) -> Batch:
        """The Batch of the given global rows, in that order."""
        n = rows.size
        # Gather in increasing row order (page-cache and readahead friendly), then scatter
        # each value to its batch position: same result as indexing in batch order.
        pos = np.argsort(rows, kind="stable")
        srt = rows[pos]
        cuts = np.searchsorted(srt, self._bounds)
        dense = np.empty((n, len(self.schema.dense)), np.float32)
        labels = np.empty(n, np.float32)
        onehot = np.empty((n, len(self.schema.onehot)), np.int32)
        segs = []
        for p, part in enumerate(self._parts):
            a, b = cuts[p], cuts[p + 1]
            if a == b:
                continue
            local, at = srt[a:b] - self._bounds[p], pos[a:b]
            dense[at] = part.dense[local]
            labels[at] = part.labels[local]
            onehot[at] = part.onehot[local]
            segs.append((part, local, at))
        mh = {f.name: _gather_bags(f.name, segs, n) for f in self.schema.multihot}
        return Batch(
            dense=torch.from_numpy(dense),
            sparse=self._keyed(onehot, mh),
            labels=torch.from_numpy(labels),
        )

    def _keyed(self, onehot: np.ndarray, mh: dict) -> KeyedJagged:
        return keyed_ids(self.schema, onehot, mh)


def keyed_ids(schema: Schema, onehot: np.ndarray, mh: dict) -> KeyedJagged:
    """A batch's ids as the model takes them: one-hot ids ``[n, n_onehot]`` and
    ``{feature: (ids, bag sizes [n])}`` (the loader's batches and prediction's)."""
    names = schema.feature_names
    if not mh:
        return KeyedJagged.from_dense(names, torch.from_numpy(onehot))
    cols = np.ascontiguousarray(onehot.T)
    ones = torch.ones(onehot.shape[0], dtype=torch.int32)
    values, lengths, j = [], [], 0
    for f in schema.features:
        if f.kind == "onehot":
            values.append(torch.from_numpy(cols[j]))
            lengths.append(ones)
            j += 1
        else:
            values.append(torch.from_numpy(mh[f.name][0]))
            lengths.append(torch.from_numpy(mh[f.name][1]))
    return KeyedJagged.from_lengths_per_key(names, values, lengths)


def _gather_bags(name: str, segs: list, n: int) -> tuple[np.ndarray, np.ndarray]:
    """Bags of a multi-hot feature for the batch: (int64 values, int32 lengths [n])."""
    lengths = np.zeros(n, np.int64)
    spans = []
    for part, local, at in segs:
        offsets = part.mh[name][1]
        starts, ends = offsets[local], offsets[local + 1]
        lengths[at] = ends - starts
        spans.append((part.mh[name][0], starts, ends - starts, at))
    out_off = np.concatenate([[0], np.cumsum(lengths)])
    values = np.empty(int(out_off[-1]), np.int64)
    for src, starts, lens, at in spans:
        total = int(lens.sum())
        if total == 0:
            continue
        step = np.arange(total) - np.repeat(np.cumsum(lens) - lens, lens)
        src_idx = np.repeat(starts, lens) + step  # ascending: rows sorted, offsets monotone
        values[np.repeat(out_off[at], lens) + step] = src[src_idx]
    return values, lengths.astype(np.int32)


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
