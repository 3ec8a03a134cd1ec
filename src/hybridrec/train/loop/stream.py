"""A stream run's loop pieces: dynamic tables' key maps, the stream's steps, test-then-train
metrics.

**Dynamic tables** (``model.tables=dynamic``): the stream's batches carry raw 64-bit keys;
:class:`DynamicTables` turns them into rows before the batch reaches the model (as
:class:`MappedLoader`, between the stream and the pipeline, so a prefetched batch is mapped
too), with one :class:`~hybridrec.sparse.keymap.KeyMap` per table. Each table's rows are split
into ``SLOTS`` fixed slots and a key lives in the slot its hash names; rank ``r`` owns the
slots ``s`` with ``s % world == r`` and holds their maps. A step's distinct keys travel to
their owners (an all-to-all of keys and counts), each owner maps the union of every rank's
keys of its slots (admitting, evicting), and the rows travel back (a second all-to-all). A
slot is decided from its own keys only, so one process and N ranks map a global batch alike,
and a checkpoint of the maps (rows-sized arrays) loads into any world size: the slots are
only dealt out again. A row given to a new key (``fresh``) starts again: its embedding takes
the key's own initial values (a hash of the key, so the same on every rank and world size)
and its optimizer state its initial value, on every rank that holds the row (a shard, a
replica), or on its parameter server (``reset``: the backend's; sent before the trainer's next
pull). Rows a batch uses are never evicted while it may still be ahead of the step or in it
(:data:`PROTECT_STEPS`), so a batch mapped ahead never takes a row a step still updates.

**Test-then-train** (:class:`Progressive`): the training step's forward is the batch's score
before it is trained on; the last ``train.progressive_window`` samples' AUC and log loss are
logged as ``progressive`` records of metrics.jsonl and reported in summary.json.
"""

from __future__ import annotations

import contextlib
import copy
import math
import queue
import threading
import zlib
from collections import deque
from typing import ClassVar

import numpy as np
import torch
import torch.distributed as dist

from hybridrec.errors import HybridrecError
from hybridrec.metrics.classification import auc, log_loss
from hybridrec.sparse.keyed_jagged import Batch, KeyedJagged
from hybridrec.sparse.keymap import KeyMap, key_slots
from hybridrec.threads import single_threaded
from hybridrec.train.loop.parts import End, Part, StepSource

SLOTS = 16
"""Slots per dynamic table: the unit of ownership among ranks (a world size up to 16 owns
some of every table's keys; more ranks leave some without)."""

MAP_CHUNK = 4
"""Batches the stream feed's thread maps as one (at most: those parsed already, so it never
waits for a file to fill a chunk): a lookup's fixed cost (~60 small array operations per table,
and with several ranks 5 collectives) paid once for them all."""

PROTECT_STEPS = 4 + MAP_CHUNK
"""Rows used by the last this many mapped batches are never evicted: the batch training, the
one the pipeline took ahead, those the feed's queue holds (:class:`StreamFeed`, 2), and the
chunk being mapped (its uses are marked at its last batch's step)."""

SNAPSHOT_LOCK_WAIT_S = 5.0
"""How long a partial recovery's snapshot waits for the maps' lock (the feed's thread holds it
for a chunk's local lookups or resets, never across a collective; within the agent's 30-s
grace, after the step's own wait)."""

_MASK = (1 << 64) - 1

_NO_ROWS = np.zeros((0, 3), dtype=np.int64)
"""No fresh rows: an empty ``[n, 3]`` (table index, row, key) array (never written to)."""


class SnapshotBusy(HybridrecError):
    """The dynamic tables' maps could not be taken for a recovery snapshot in time."""


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser over uint64 (wrapping arithmetic)."""
    x = x.astype(np.uint64)
    with np.errstate(over="ignore"):
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return x ^ (x >> np.uint64(31))


def key_initial_values(keys: np.ndarray, table: str | np.ndarray, dim: int, rows: int | np.ndarray,
                       seed: int) -> torch.Tensor:
    """A fresh row's initial values for each of ``keys``: U(-sqrt(1/rows), sqrt(1/rows)) (the
    tables' own initialisation) drawn from a hash of (seed, table, key, column), so every rank
    and world size gives a key the same row values. ``table`` and ``rows``: one table's, or
    one per key (a name's :func:`table_salt` and rows) to draw several tables' keys at once."""
    a = np.sqrt(1.0 / np.asarray(rows, dtype=np.float64))
    salt = table_salt(table, seed) if isinstance(table, str) else np.asarray(table, dtype=np.uint64)
    with np.errstate(over="ignore"):
        k = _mix(keys.astype(np.int64).view(np.uint64) ^ salt)
        cells = _mix(k[:, None] + np.arange(1, dim + 1, dtype=np.uint64)[None, :] * np.uint64(0x9E3779B97F4A7C15))
    unit = (cells >> np.uint64(11)).astype(np.float64) * (1.0 / (1 << 53))
    scale = a[:, None] if a.ndim else a
    return torch.from_numpy(((2.0 * unit - 1.0) * scale).astype(np.float32))


def table_salt(table: str, seed: int) -> np.uint64:
    return np.uint64((seed * 1_000_003 + zlib.crc32(table.encode())) & _MASK)


class DynamicTables:
    """The run's key maps (component ``keymaps``): raw keys of a batch -> rows, fresh rows
    reset where they are held (see the module's docstring).

    Args:
        rows: each feature's table rows (the shared row 0 included).
        model_sparse: the model's embedding collection (local, sharded); sparse_opt: its
            sparse optimizers (their per-row state is reset with a fresh row).
        topo: the run's topology (``group``: the ranks that share the tables).
        reset: where the tables are held elsewhere (parameter servers: the backend's
            ``row_reset``), what takes the fresh rows instead of the local collections:
            ``reset(generation, {table: (rows, values [n, dim])})``, ``generation`` the
            mapping's step (the same on every rank).
    """

    def __init__(self, rows: dict[str, int], *, admit_after: int, evict: str, ttl_steps: int, seed: int,
                 model_sparse, sparse_opt, topo, dims: dict[str, int], reset=None) -> None:
        self.features = list(rows)
        self.rows, self.dims, self.seed = dict(rows), dict(dims), seed
        self.maps = {f: KeyMap(rows[f], slots=min(SLOTS, rows[f] - 1), admit_after=admit_after, evict=evict,
                               ttl_steps=ttl_steps, protect_steps=PROTECT_STEPS) for f in self.features}
        self.sparse, self.sparse_opt, self.topo = model_sparse, sparse_opt, topo
        self.reset = reset
        self.world = topo.group_size if topo is not None else 1
        self.rank = topo.rank if topo is not None else 0
        self.group = topo.group if topo is not None and self.world > 1 else None
        self.exchange_group = None  # (a stream feed's thread maps: its group; :class:`StreamFeed`)
        self._own()
        self.step = 0  # batches mapped
        self.fresh_rows = 0
        self.lock = threading.RLock()  # (a feed's thread maps while the loop saves or reads counts)
        self._held_for_snapshot = False
        self._pending = _NO_ROWS  # (see :meth:`state_dict`)
        self._reset_at_next = _NO_ROWS

    def _own(self) -> None:
        if self.world > 1:
            for m in self.maps.values():
                m.owned(np.arange(self.rank, m.slots, self.world))

    # -- the component -------------------------------------------------------------
    def state_dict(self) -> dict:
        """Every table's whole map (on every rank: the ranks' slots merged), the step, and
        ``pending``: the fresh rows of a chunk whose mapping was under way (its keys are in
        the maps, its rows maybe not reset yet: :meth:`map_batches` holds the lock only
        between its collectives), ``[n, 3]`` int64 (table index, row, key), reset again
        after a load, before the next chunk is mapped."""
        with self.lock:
            states = {f: m.state_dict() for f, m in self.maps.items()}
            step, pending = self.step, self._pending.copy()
        if self.group is not None:
            gathered = [None] * self.world
            dist.all_gather_object(gathered, (states, pending), group=self.group)
            states = {f: KeyMap.merge_states([g[0][f] for g in gathered]) for f in self.features}
            pending = np.concatenate([g[1] for g in gathered])
        return {"step": step, "tables": states, "pending": torch.from_numpy(pending)}

    def snapshot_state(self) -> dict:
        """A partial recovery's snapshot (written after a peer died: no collective): the step
        alone; this rank's slots are :class:`OwnSlots`'. Takes the lock for good (the process
        is ending: no batch is mapped after it), so the step and the slots saved next are of
        one moment (a chunk's exchange cut short by the lost peer leaves its fresh rows in
        ``pending``, reset after the load); raises :class:`SnapshotBusy` when the lock is not
        free within :data:`SNAPSHOT_LOCK_WAIT_S`."""
        self.hold_for_snapshot()
        return {"step": self.step}

    def hold_for_snapshot(self) -> None:
        if self._held_for_snapshot:
            return
        if not self.lock.acquire(timeout=SNAPSHOT_LOCK_WAIT_S):
            raise SnapshotBusy(f"the dynamic tables' maps: the stream's mapping held them past "
                               f"{SNAPSHOT_LOCK_WAIT_S:g} s; this rank's slots roll back to the checkpoint")
        self._held_for_snapshot = True  # (never released: the process ends after the snapshot)

    def load_state_dict(self, state: dict) -> None:
        with self.lock:
            self.step = int(state["step"])
            if "tables" not in state:  # (a recovery snapshot's: the step; OwnSlots loads the slots)
                return
            for f, m in self.maps.items():
                m.load_state_dict(state["tables"][f])
            self._own()
            self._reset_later(state.get("pending"))

    def _reset_later(self, pending) -> None:
        """Rows a loaded state's ``pending`` names: reset before the next chunk is mapped
        (after the tables' weights are loaded; idempotent: a key's initial values)."""
        if pending is not None and len(pending):
            self._reset_at_next = np.concatenate([self._reset_at_next, np.asarray(pending, dtype=np.int64)])

    def stats(self) -> dict:
        """Live, admitted and evicted keys: the totals, and ``tables`` each table's (with
        several ranks, summed over the ranks' slots: a collective)."""
        with self.lock:
            per = {f: m.stats() for f, m in self.maps.items()}
        counts = ("live", "admitted", "evicted")
        t = torch.tensor([[int(per[f][k]) for k in counts] for f in self.features], dtype=torch.int64)
        if self.group is not None:  # (each rank counts its own slots)
            dist.all_reduce(t, group=self.group)
        tables = {f: {**per[f], **dict(zip(counts, row, strict=True))} for f, row in zip(self.features, t.tolist(),
                                                                                      strict=True)}
        total = dict(zip(counts, t.sum(0).tolist(), strict=True))
        return {**total, "fresh_rows": self.fresh_rows, "tables": tables}

    # -- a batch ---------------------------------------------------------------------
    def map_batch(self, batch: Batch) -> Batch:
        """``batch`` with its raw keys replaced by rows (a collective with several ranks)."""
        return self.map_batches([batch])[0]

    def map_batches(self, batches: list[Batch]) -> list[Batch]:
        """``batches`` (the next ones, in order) with their raw keys replaced by rows, mapped
        as one: each table's distinct keys of them all looked up once, their uses marked at
        the last one's step (a collective with several ranks)."""
        nf = len(self.features)
        values = [b.sparse.values.numpy() for b in batches]
        per_key = [b.sparse.length_per_key() for b in batches]
        bounds = [np.concatenate([[0], np.cumsum(p)]).astype(np.int64) for p in per_key]
        uniques, inverses, counts = [], [], []
        for i in range(nf):
            seg = (values[0][bounds[0][i]:bounds[0][i + 1]] if len(batches) == 1 else
                   np.concatenate([v[b[i]:b[i + 1]] for v, b in zip(values, bounds, strict=True)]))
            u, inv, c = np.unique(seg, return_inverse=True, return_counts=True)
            uniques.append(u)
            inverses.append(inv)
            counts.append(c.astype(np.int64))
        step = self.step + len(batches) - 1
        if len(self._reset_at_next):  # (a loaded state's pending rows: before any lookup)
            with self.lock:
                self._reset(self._triples(self._reset_at_next), count=False)
                self._reset_at_next = _NO_ROWS
        # The lock is held between collectives, never across one: a rank's loop may hold it
        # through a checkpoint's collectives, waiting for a peer whose feed is in this exchange.
        if self._exchange_group() is None:
            with self.lock:
                rows, fresh = self._lookup_all(uniques, counts, step)
                self._pending = self._stack(fresh)
        else:
            rows, fresh = self._exchange(uniques, counts, step)
        outs = [np.empty_like(v) for v in values]
        for i in range(nf):
            mapped, at = rows[i][inverses[i]], 0
            for out, b in zip(outs, bounds, strict=True):
                n = int(b[i + 1] - b[i])
                out[b[i]:b[i + 1]] = mapped[at:at + n]
                at += n
        with self.lock:
            self._reset(fresh)
            self.step += len(batches)
            self._pending = _NO_ROWS
        return [Batch(batch.dense, KeyedJagged(batch.sparse.keys, torch.from_numpy(out), batch.sparse.lengths,
                                               length_per_key=list(p), one_id_per_bag=batch.sparse.one_id_per_bag()),
                      batch.labels)
                for batch, out, p in zip(batches, outs, per_key, strict=True)]

    def _exchange_group(self):
        """The group the keys travel on: the stream feed's own (its thread maps), else the step's."""
        return self.exchange_group if self.exchange_group is not None else self.group

    def _lookup(self, i: int, keys: np.ndarray, counts: np.ndarray, step: int):
        """Table ``i``'s rows of ``keys``, and its fresh ``(rows, their keys)`` (None: none)."""
        res = self.maps[self.features[i]].lookup(keys, counts, step)
        if not len(res.fresh):
            return res.rows, None
        return res.rows, (res.fresh, res.fresh_keys)

    def _lookup_all(self, uniques, counts, step: int):
        rows, fresh = [], []
        for i, (u, c) in enumerate(zip(uniques, counts, strict=True)):
            r, f = self._lookup(i, u, c, step)
            rows.append(r)
            if f is not None:
                fresh.append((i, *f))
        return rows, fresh

    def _exchange(self, uniques, counts, step: int):
        """Keys to their slots' owners, rows back; every owner's fresh rows to every rank."""
        w, nf = self.world, len(self.features)
        dest = [key_slots(u, self.maps[self.features[i]].slots) % w for i, u in enumerate(uniques)]
        order = [np.argsort(d, kind="stable") for d in dest]
        send_counts = np.zeros((w, nf), dtype=np.int64)
        for i, d in enumerate(dest):
            send_counts[:, i] = np.bincount(d, minlength=w)
        # the send buffer: destination-major, then feature; each (key, count)
        pieces = []
        starts = [np.concatenate([[0], np.cumsum(send_counts[:, i])]) for i in range(nf)]
        for r in range(w):
            for i in range(nf):
                idx = order[i][starts[i][r]:starts[i][r + 1]]
                pieces.append(np.stack([uniques[i][idx], counts[i][idx]], axis=1))
        send = torch.from_numpy(np.concatenate(pieces).reshape(-1, 2)) if pieces else torch.zeros(0, 2, dtype=torch.int64)
        recv_counts = torch.empty(w * nf, dtype=torch.int64)
        group = self._exchange_group()
        dist.all_to_all_single(recv_counts, torch.from_numpy(send_counts.reshape(-1).copy()), group=group)
        recv_counts = recv_counts.numpy().reshape(w, nf)
        out_split, in_split = send_counts.sum(1).tolist(), recv_counts.sum(1).tolist()
        recv = torch.empty(int(sum(in_split)), 2, dtype=torch.int64)
        dist.all_to_all_single(recv, send.contiguous(), in_split, out_split, group=group)
        got = recv.numpy()
        # owner: each feature's received keys, every source's, mapped as one union
        at = np.concatenate([[0], np.cumsum(recv_counts.reshape(-1))])
        reply = np.empty(len(got), dtype=np.int64)
        fresh = []
        with self.lock:  # (this rank's slots change: fresh keys pending until reset everywhere)
            for i in range(nf):
                idx = np.concatenate([np.arange(at[r * nf + i], at[r * nf + i + 1]) for r in range(w)])
                if not len(idx):
                    continue
                u, inv = np.unique(got[idx, 0], return_inverse=True)
                c = np.bincount(inv, weights=got[idx, 1], minlength=len(u)).astype(np.int64)
                rows, f = self._lookup(i, u, c, step)
                reply[idx] = rows[inv]
                if f is not None:
                    fresh.append((i, *f))
            self._pending = self._stack(fresh)
        back = torch.empty(int(sum(out_split)), dtype=torch.int64)
        dist.all_to_all_single(back, torch.from_numpy(reply), out_split, in_split, group=group)
        back = back.numpy()
        rows = [np.empty(len(u), dtype=np.int64) for u in uniques]
        pos = 0
        for r in range(w):
            for i in range(nf):
                idx = order[i][starts[i][r]:starts[i][r + 1]]
                rows[i][idx] = back[pos:pos + len(idx)]
                pos += len(idx)
        return rows, self._all_fresh(fresh, group)

    @staticmethod
    def _stack(fresh) -> np.ndarray:
        """Fresh ``(table index, rows, keys)`` pieces as one ``[n, 3]`` int64 array."""
        return (np.concatenate([np.stack([np.full(len(r), i), r, k], axis=1) for i, r, k in fresh])
                if fresh else _NO_ROWS).astype(np.int64, copy=False)

    @staticmethod
    def _triples(every: np.ndarray) -> list:
        """:meth:`_stack`'s inverse: ``(table index, rows, keys)`` per table."""
        return [(i, every[every[:, 0] == i, 1], every[every[:, 0] == i, 2]) for i in np.unique(every[:, 0])]

    def _all_fresh(self, fresh, group):
        """Every owner's fresh (feature, row, key) triples, on every rank."""
        mine = self._stack(fresh)
        size = torch.tensor([len(mine)], dtype=torch.int64)
        sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(self.world)]
        dist.all_gather(sizes, size, group=group)
        most = max(int(s.item()) for s in sizes)
        if most == 0:
            return []
        padded = torch.zeros(most, 3, dtype=torch.int64)
        padded[: len(mine)] = torch.from_numpy(mine)
        parts = [torch.empty(most, 3, dtype=torch.int64) for _ in range(self.world)]
        dist.all_gather(parts, padded, group=group)
        every = np.concatenate([p.numpy()[: int(s.item())] for p, s in zip(parts, sizes, strict=True)])
        return self._triples(every)

    def _reset(self, fresh, *, count: bool = True) -> None:
        """Fresh rows start again wherever they are held: the key's initial values, the
        optimizer's initial per-row state (``count``: into ``fresh_rows``)."""
        if not fresh:
            return
        by_table = {self.features[int(i)]: (rows, keys) for i, rows, keys in fresh}
        if count:
            self.fresh_rows += sum(len(r) for r, _ in by_table.values())
        if self.reset is not None:  # (held elsewhere: the whole rows, with their values)
            self.reset(self.step, {t: (torch.from_numpy(np.ascontiguousarray(rows, dtype=np.int64)),
                                       key_initial_values(keys, t, self.dims[t], self.rows[t], self.seed))
                                   for t, (rows, keys) in by_table.items()})
            return
        optimizers = getattr(self.sparse_opt, "optimizers", {})
        with torch.no_grad():
            for name, coll in self.sparse.updated_collections().items():
                opt = optimizers.get(name)
                # every table of a fused group at once: its rows there, the keys' values
                at: dict[int, list] = {}
                for local in coll.tables:
                    table = local.partition("@")[0]
                    if table not in by_table:
                        continue
                    rows, keys = by_table[table]
                    held = self.sparse.shard_of(local)
                    (r0, r1), (c0, c1) = ((0, self.rows[table]), (0, self.dims[table])) if held is None else \
                        (held[0].rows, held[0].cols)
                    sel = (rows >= r0) & (rows < r1)
                    if sel.any():
                        g, start, _ = coll.table_slice(local)
                        at.setdefault(g, []).append((rows[sel] - r0 + start, keys[sel], table, (c0, c1)))
                for g, pieces in at.items():
                    self._reset_group(coll, opt, g, pieces)

    def _reset_group(self, coll, opt, g: int, pieces: list) -> None:
        """One fused group's fresh rows: ``pieces`` of (rows in the group, keys, table, columns)."""
        index = torch.from_numpy(np.concatenate([p[0] for p in pieces]))
        cols = {p[3] for p in pieces}
        dims = {self.dims[p[2]] for p in pieces}
        if len(cols) == 1 and len(dims) == 1:  # (the usual: one width, whole rows)
            keys = np.concatenate([p[1] for p in pieces])
            salt = np.concatenate([np.full(len(p[1]), table_salt(p[2], self.seed), dtype=np.uint64) for p in pieces])
            rows = np.concatenate([np.full(len(p[1]), self.rows[p[2]], dtype=np.int64) for p in pieces])
            (c0, c1), = cols
            values = key_initial_values(keys, salt, dims.pop(), rows, self.seed)[:, c0:c1]
        else:
            values = torch.cat([key_initial_values(k, t, self.dims[t], self.rows[t], self.seed)[:, c0:c1]
                                for _, k, t, (c0, c1) in pieces])
        weight = coll.group_weight(g)
        weight[index] = values.to(weight.dtype)
        if opt is not None:
            initial = float(getattr(opt, "initial_accumulator", 0.0))
            for key, state in opt.row_state(g).items():
                state[index] = initial if key == "sum" else 0


class OwnSlots:
    """This rank's slots of the dynamic tables' maps, for partial recovery's snapshots
    (component ``keymaps_own``, per rank; ``keymaps`` holds every rank's slots, merged by a
    collective that a snapshot written after a peer died cannot make). In a checkpoint it
    holds nothing (``keymaps`` has the slots). In a snapshot: this rank's maps, without a
    collective (under :meth:`DynamicTables.hold_for_snapshot`); loaded from a survivor's own
    snapshot over the checkpoint's maps, so a survivor's slots are those of its snapshot and
    a failed rank's (it loads no snapshot) the checkpoint's."""

    def __init__(self, tables: DynamicTables) -> None:
        self.tables = tables

    def state_dict(self) -> dict:
        return {}

    def snapshot_state(self) -> dict:
        t = self.tables
        t.hold_for_snapshot()
        return {"rank": t.rank, "world": t.world, "tables": {f: m.state_dict() for f, m in t.maps.items()},
                "pending": torch.from_numpy(t._pending.copy())}

    def load_state_dict(self, state: dict) -> None:
        t = self.tables
        if "tables" not in state:  # (a checkpoint's: nothing)
            return
        if (int(state["rank"]), int(state["world"])) != (t.rank, t.world):
            raise ValueError(f"keymaps_own: rank {state['rank']} of {state['world']}'s slots, this is rank "
                             f"{t.rank} of {t.world}")
        with t.lock:
            for f, m in t.maps.items():
                m.load_state_dict(state["tables"][f])
            t._own()
            t._reset_later(state.get("pending"))


_END = object()


class StreamFeed:
    """The stream's batches, read, parsed and mapped ahead on a thread while the step trains:
    the loop's loader (:class:`~hybridrec.train.loop.pipeline.TrainPipeline` takes it).

    A thread runs the stream (:class:`~hybridrec.data.stream.StreamLoader`: its collectives on
    a group of their own) and the dynamic tables' mapping, ``ahead`` batches in front; each
    batch comes with the stream's position after it, and :meth:`state_dict` is the position
    after the last batch *taken*, so a checkpoint never skips a row the thread read ahead.
    The thread maps up to :data:`MAP_CHUNK` batches as one, those the stream has parsed
    already; with several ranks their key exchange travels on the stream's group (every
    rank's thread maps the same chunks in the same order: they parse the same blocks), and
    the thread holds the maps' lock only between the exchange's collectives, never across one
    (the loop's thread holds it through a checkpoint's collectives: were the feed to wait in
    an exchange with the lock held, a peer whose loop holds its own lock in the checkpoint
    would wait for this rank's loop, which waits for the lock: a deadlock, seen under load).
    ``freshness``: each file's seconds from landing to its first publication
    (:mod:`hybridrec.serve.publisher`), kept with the position."""

    def __init__(self, stream, tables: DynamicTables | None, *, ahead: int = 2) -> None:
        self.stream, self.tables, self.ahead = stream, tables, ahead
        if tables is not None:
            tables.exchange_group = getattr(stream, "group", None)
        self._state: dict | None = None
        self.freshness: dict[str, dict] = {}

    def __len__(self) -> int:
        return 0

    def state_dict(self) -> dict:
        state = self._state if self._state is not None else self.stream.state_dict()
        return {**state, "freshness": dict(self.freshness)}

    def load_state_dict(self, state: dict) -> None:
        self.stream.load_state_dict(state)
        self.freshness = dict(state.get("freshness") or {})
        self._state = None

    @property
    def files(self) -> list[dict]:
        """The files as the last batch taken left them (rows trained, done)."""
        return (self._state if self._state is not None else self.stream.state_dict())["files"]

    @property
    def files_done(self) -> int:
        return sum(1 for f in self.files if f["done"])

    def summary(self) -> dict:
        out = self.stream.summary(self.files)
        for f in out["files"]:
            f.update(self.freshness.get(f["name"], {}))
        fresh = sorted(v["freshness_s"] for v in self.freshness.values())
        out["freshness_median_s"] = fresh[len(fresh) // 2] if fresh else None
        return out

    def __iter__(self):
        items: queue.Queue = queue.Queue(maxsize=self.ahead)
        stop = threading.Event()
        worker = threading.Thread(target=self._produce, args=(items, stop), name="hybridrec-stream", daemon=True)
        worker.start()
        try:
            while True:
                item = items.get()
                if item is _END:
                    return
                if isinstance(item, BaseException):
                    raise item
                batch, state = item
                self._state = state
                yield batch
        finally:
            stop.set()

    def _produce(self, items: queue.Queue, stop: threading.Event) -> None:
        single_threaded()  # (the step has the cores; hybridrec.threads)
        try:
            batches = iter(self.stream)
            for batch in batches:
                chunk = [(batch, copy.deepcopy(self.stream.state_dict()))]
                if self.tables is not None:
                    while len(chunk) < MAP_CHUNK and self.stream.ready():  # (parsed: no waiting)
                        chunk.append((next(batches), copy.deepcopy(self.stream.state_dict())))
                    mapped = self.tables.map_batches([b for b, _ in chunk])  # (it takes the lock)
                    chunk = [(b, state) for b, (_, state) in zip(mapped, chunk, strict=True)]
                for item in chunk:
                    while not stop.is_set():
                        try:
                            items.put(item, timeout=0.2)
                            break
                        except queue.Full:
                            continue
                    if stop.is_set():
                        return
            items.put(_END)
        except BaseException as e:  # noqa: BLE001 (handed to the loop: it raises it where it takes the next batch)
            items.put(e)


class StreamSteps(StepSource):
    """A stream's steps: one pass over the stream (it ends them), one step per batch; the
    stream's files and rows, and the dynamic tables' counts, in the summary."""

    absent: ClassVar[dict] = {"stream": None, "dynamic_tables": None}

    def __init__(self, pipeline, stream, tables: DynamicTables | None, *, log_every: int = 0, logger=None) -> None:
        super().__init__(pipeline)
        self.stream, self.tables, self.log_every, self.logger = stream, tables, log_every, logger

    def steps(self, loop):
        for batch, pending in self.pipeline.batches(loop.total_steps - loop.step):
            loss = loop.train_step(batch, pending)
            yield loss, batch.batch_size * loop.topo.job_size

    def after_step(self, loop, done) -> None:
        """Every ``train.log_every`` steps: the stream's rows and files and the dynamic tables'
        live, admitted and evicted keys (``keys_live``, ... of all tables, ``keys_live/C1``, ...
        of each), a ``stream`` record of metrics.jsonl."""
        if not self.log_every or done.step % self.log_every:
            return
        files = self.stream.files
        record = {"rows": sum(int(f["rows"]) for f in files), "files_done": self.stream.files_done,
                  "files_waiting": self.stream.stream.waiting}
        if self.tables is not None:  # (a collective with several ranks: every rank logs alike)
            stats = self.tables.stats()
            record.update({f"keys_{k}": stats[k] for k in ("live", "admitted", "evicted")})
            record.update({f"keys_{k}/{f}": c[k] for f, c in stats["tables"].items()
                           for k in ("live", "admitted", "evicted")})
        if self.logger is not None:
            self.logger.log(done.step, record, split="stream")

    def start(self, loop) -> None:
        self._progressive = next((p for p in loop.parts if isinstance(p, Progressive)), None)

    def status(self) -> str:
        """The progress line's stream fields: the last test-then-train AUC, files trained,
        files waiting (the lag)."""
        last = getattr(getattr(self, "_progressive", None), "last", None) or {}
        auc = last.get("progressive_auc")
        shown = f"AUC {auc:.4f}  " if isinstance(auc, float) and math.isfinite(auc) else ""
        return (f"{shown}files {self.stream.files_done:,} done, "
                f"{self.stream.stream.waiting:,} waiting")

    def saving(self, loop):
        """A checkpoint holds the maps and the tables of one moment: the feed's thread waits."""
        return self.tables.lock if self.tables is not None else contextlib.nullcontext()

    def finish(self, loop, end: End) -> None:
        super().finish(loop, end)
        self._stats = self.tables.stats() if self.tables is not None else None  # (a collective: every rank)

    def summary(self) -> dict:
        return {"stream": self.stream.summary(), "dynamic_tables": getattr(self, "_stats", None)}


class Progressive(Part):
    """Test-then-train metrics over a sliding window (see the module's docstring)."""

    absent: ClassVar[dict] = {"progressive": None}

    def __init__(self, window: int, *, log_every: int, logger, topo) -> None:
        self.window, self.log_every, self.logger, self.topo = window, log_every, logger, topo
        per_rank = max(1, window // max(1, topo.job_size if topo is not None else 1))
        self.probs: deque = deque()
        self.labels: deque = deque()
        self.kept, self.per_rank = 0, per_rank
        self.samples = 0
        self.last: dict | None = None

    def start(self, loop) -> None:
        loop.scores = self.add

    def add(self, logits: torch.Tensor, labels: torch.Tensor) -> None:
        p = torch.sigmoid(logits.detach().float()).cpu().numpy().reshape(-1)
        y = labels.detach().cpu().numpy().reshape(-1)
        self.probs.append(p)
        self.labels.append(y)
        self.kept += len(p)
        self.samples += len(p)
        while self.kept - len(self.probs[0]) >= self.per_rank:
            self.kept -= len(self.probs.popleft())
            self.labels.popleft()

    def compute(self) -> dict:
        p = np.concatenate(self.probs) if self.probs else np.zeros(0, np.float32)
        y = np.concatenate(self.labels) if self.labels else np.zeros(0, np.float32)
        if self.topo is not None and self.topo.job_size > 1:
            parts = [None] * self.topo.job_size
            dist.all_gather_object(parts, (p, y), group=self.topo.run_group)
            p = np.concatenate([a for a, _ in parts])
            y = np.concatenate([b for _, b in parts])
        both = len(y) and 0 < y.sum() < len(y)
        return {"progressive_auc": float(auc(y, p)) if both else float("nan"),
                "progressive_logloss": float(log_loss(y, p)) if len(y) else float("nan"),
                "progressive_samples": len(y)}

    def after_step(self, loop, done) -> None:
        if self.log_every and done.step % self.log_every == 0:
            self._log(done.step)

    def finish(self, loop, end: End) -> None:
        if end.trained:
            self._log(loop.step)

    def _log(self, step: int) -> None:
        self.last = self.compute()
        if self.logger is not None:
            self.logger.log(step, self.last, split="progressive")

    def summary(self) -> dict:
        if self.last is None:
            return {"progressive": None}
        return {"progressive": {"auc": self.last["progressive_auc"], "logloss": self.last["progressive_logloss"],
                                "window": self.window, "samples": self.samples}}
