"""The key map of a collisionless dynamic embedding table: which row holds which key.

A dynamic table gives every admitted key its own row (no two live keys share one) and takes
rows back from keys that stopped coming. :class:`KeyMap` decides, step by step, the row of each
key of a batch; the table (and its optimizer) only has to reset the rows it reports as
``fresh``. Row :data:`MISSING_ROW` (0) is shared by missing ids (key < 0) and by keys not
admitted (yet).

**Slots.** Rows ``1 .. rows-1`` are split into ``slots`` contiguous near-equal ranges; a key
lives only in the range of its slot, :func:`key_slots` (the splitmix64 finaliser of the key,
modulo ``slots``: the same on every process). Every decision about a slot (which key is
admitted, which row it gets, which rows are evicted) is made from that slot's own keys and
rows, so ranks that own different slots (:meth:`KeyMap.owned`) together make exactly the
decisions one process owning all of them would (:meth:`KeyMap.merge_states`).

**The lookup index** is an open-addressing hash table of row numbers (``-1`` empty, ``-2`` a
tombstone) with linear probing from the top bits of the key's mix; its capacity is the power of
two >= 4x ``rows`` (a load of at most 1/4: 4 bytes a cell, 16 a row). A lookup probes all its
keys at once: the home cells first (where nearly every key ends), then windows of 8 cells for
the few left, one vectorized round each. Insertion takes the first free cell the same way; keys
after the same cell all write it and read it back, and those that lost try again. Deletion
leaves a tombstone (later insertions reuse them); the index is rebuilt from the per-row keys
when tombstones pass 1/8 of the capacity. So a call costs O(its keys), not O(rows), except for
the amortised batch eviction and the rare rebuild.

**Rows are given lowest-first.** A slot's free rows are the rows above its watermark (never
used) and a sorted pool of freed rows below it; the new keys of a slot, in the order of their
mix (a fixed order of the keys, not of the call), take its lowest free rows; where there are
fewer rows than new keys, the first keys in that order get them. So the rows assigned depend
only on which rows are free, which the per-row key array says: the index, the pool and the
watermarks are rebuilt from it on load and are not saved.

**Admission** (``admit_after`` > 1): a key gets its own row once the occurrences counted for it
(the ``counts`` of the steps it came in, while it had no row) reach ``admit_after``. They are
counted in a count-min sketch per slot, shape ``[slots, depth, width]`` of int32 (depth 4 by
default; ``width`` 0 picks the power of two >= the slot's rows, so the sketch costs 16 bytes a
row), with the conservative update (only the counters at the key's minimum are raised) and
aging: a slot's counters are halved every ``sketch_age`` occurrences added to it (0: ``width``
occurrences; far more than a key needs to reach ``admit_after`` at any realistic rate, few
enough that a stream of distinct keys keeps the counters near 1). A count-min sketch can only
over-count, so a key may be admitted a little early when its counters are shared; aging can make
a key that comes very rarely wait longer. ``admit_after=1`` keeps no sketch.

**Eviction.** When a slot has fewer free rows than new keys, it frees a batch: the rows it is
short of or 1/32 of the slot, whichever is more (amortised: most calls evict nothing), chosen
among the rows not used in the last ``protect_steps`` steps (never fewer than the current one)
by ``np.argpartition`` over the slot's rows of the order below packed into one int64 per row
(exact, ties included; where the packed order would pass 2**62, a partition column by
column; slots of at most 1,024 rows that are short at once share one sort):

- ``lru``: the least recently used first, ties by row index;
- ``lfu``: the fewest uses first, ties by least recent use, then by row index. For ``lfu`` a
  row's use count is the sum of its key's counts, halved at every multiple of
  ``lfu_half_life`` steps (integer shifts, exact on every process); the other policies keep
  the plain sum;
- ``ttl``: only rows unused for ``ttl_steps`` steps (or ``protect_steps``, if more) can go,
  the oldest first. An expired key that comes back before its row was taken loses it then
  (the row is freed, counted as an eviction, and the key admitted again as a new key, into a
  fresh row). With nothing expired and no free row, new keys are not admitted. Expired rows
  are freed lazily, so ``stats()`` ``live`` counts expired rows not freed yet.

Where a slot cannot free enough rows, the new keys left over map to row 0 and are tried again
at their next occurrence.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from hybridrec.errors import ConfigError, HybridrecError

MISSING_ROW = 0
"""Row 0 of every dynamic table is shared: missing keys and keys not admitted (yet)."""

POLICIES = ("lru", "lfu", "ttl")
_WINDOW = 8  # cells probed per vectorized round
_LOAD = 4  # index capacity: the power of two >= this many times the rows
_EMPTY, _TOMB = -1, -2
_M1, _M2 = 0xBF58476D1CE4E5B9, 0x94D049BB133111EB
_SKETCH_SEED = 0x9E3779B97F4A7C15
_INT32_MAX = 2**31 - 1


class KeyMapConfigError(ConfigError, ValueError):
    """A KeyMap argument that cannot be used (the same on every rank)."""


class KeyMapError(HybridrecError, ValueError):
    """A lookup or a state that does not fit this key map."""


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser of uint64 ``x`` (a new array)."""
    z = x ^ (x >> 30)
    z *= _M1
    z ^= z >> 27
    z *= _M2
    z ^= z >> 31
    return z


def _slot_of(mixed: np.ndarray, slots: int) -> np.ndarray:
    s = mixed & (slots - 1) if slots & (slots - 1) == 0 else mixed % slots
    return s.view(np.int64)


def key_slots(keys: np.ndarray, slots: int) -> np.ndarray:
    """int64 slot in [0, slots) of each int64 key: a fixed 64-bit mix (splitmix64 finaliser) of
    the key, modulo slots. Pure function, same on every process."""
    if isinstance(slots, bool) or not isinstance(slots, (int, np.integer)) or slots < 1:
        raise KeyMapConfigError(f"key_slots: slots must be an integer >= 1, got {slots!r}")
    keys = np.ascontiguousarray(keys, dtype=np.int64)
    return _slot_of(_mix(keys.view(np.uint64)), int(slots))


def _k_smallest(cols: list[np.ndarray], k: int) -> np.ndarray:
    """Indices (ascending) of the ``k`` smallest entries in the lexicographic order of
    ``cols`` (the first the primary key), ties by index: exact, O(n) per column used."""
    n = len(cols[0])
    if k >= n:
        return np.arange(n)
    v = cols[0]
    t = np.partition(v, k - 1)[k - 1]
    below = np.flatnonzero(v < t)
    eq = np.flatnonzero(v == t)
    need = k - len(below)
    if need < len(eq) and len(cols) > 1:
        eq = eq[_k_smallest([c[eq] for c in cols[1:]], need)]
    else:
        eq = eq[:need]
    return np.sort(np.concatenate([below, eq]))


def _pack(cols: list[np.ndarray]) -> np.ndarray | None:
    """One int64 per entry, ordered as the columns are lexicographically (each made to start at
    0), or None where the product of their ranges passes 2**62."""
    out, total = None, 1
    for c in cols:
        if not len(c):
            return c.astype(np.int64)
        lo = int(c.min())
        span = int(c.max()) - lo + 1
        total *= span
        if total >= 1 << 62:
            return None
        v = c - lo
        out = v if out is None else out * span + v
    return out


@dataclass
class MapResult:
    """What one :meth:`KeyMap.lookup` decided."""

    rows: np.ndarray
    """int64 [n]: the row of each key given (MISSING_ROW when missing (key < 0) or not admitted)."""
    fresh: np.ndarray
    """int64 [m] sorted: rows newly assigned to a key in this call (their embedding and
    optimizer state must be reset by the caller)."""
    evicted: int
    """keys evicted in this call"""
    admitted: int
    """keys admitted in this call"""
    fresh_keys: np.ndarray
    """int64 [m]: the key each of ``fresh`` was given (in ``fresh``'s order)."""


_STATE_KEYS = ("config", "owned", "step", "row_key", "row_last", "row_uses", "sketch",
               "sketch_adds", "slot_admitted", "slot_evicted")


class KeyMap:
    """The rows of one dynamic table's keys: see the module's docstring for the design.

    Args:
        rows: the table's rows including the shared row 0.
        slots: ranges the rows 1..rows-1 are split into (a key lives in its slot's range).
        admit_after: occurrences before a key gets its own row (1: at once).
        evict: ``"lru"``, ``"lfu"`` or ``"ttl"``.
        ttl_steps: for ``"ttl"``: steps unused after which a row is freed (>= 1).
        sketch_width: counters per depth and slot of the admission sketch (0: automatic).
        protect_steps: rows used in the last this many steps are never evicted.
        sketch_depth: the sketch's depth (2-4).
        sketch_age: occurrences added to a slot between halvings of its counters (0: width).
        lfu_half_life: steps between halvings of the rows' use counts (>= 1).
    """

    def __init__(self, rows: int, *, slots: int = 16, admit_after: int = 1, evict: str = "lru",
                 ttl_steps: int = 0, sketch_width: int = 0, protect_steps: int = 2,
                 sketch_depth: int = 4, sketch_age: int = 0, lfu_half_life: int = 1000) -> None:
        def bad(msg: str) -> KeyMapConfigError:
            return KeyMapConfigError(f"KeyMap: {msg}")

        for name, v in (("rows", rows), ("slots", slots), ("admit_after", admit_after),
                        ("ttl_steps", ttl_steps), ("sketch_width", sketch_width),
                        ("protect_steps", protect_steps), ("sketch_depth", sketch_depth),
                        ("sketch_age", sketch_age), ("lfu_half_life", lfu_half_life)):
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
                raise bad(f"{name} must be an integer, not {v!r}")
        if slots < 1:
            raise bad(f"slots must be >= 1, got {slots}")
        if rows - 1 < slots:
            raise bad(f"rows={rows} leaves {rows - 1} rows besides the shared row 0, fewer than "
                      f"slots={slots} (each slot needs one)")
        if rows > _INT32_MAX:
            raise bad(f"rows={rows} is more than {_INT32_MAX}")
        if evict not in POLICIES:
            raise bad(f"evict={evict!r} is not one of {', '.join(POLICIES)}")
        if admit_after < 1:
            raise bad(f"admit_after must be >= 1, got {admit_after}")
        if evict == "ttl" and ttl_steps < 1:
            raise bad(f"evict='ttl' needs ttl_steps >= 1, got {ttl_steps}")
        if ttl_steps < 0 or protect_steps < 0 or sketch_age < 0:
            raise bad("ttl_steps, protect_steps and sketch_age must be >= 0")
        if not 2 <= sketch_depth <= 4:
            raise bad(f"sketch_depth must be 2, 3 or 4, got {sketch_depth}")
        if sketch_width < 0 or (sketch_width & (sketch_width - 1)):
            raise bad(f"sketch_width must be 0 (automatic) or a power of two, got {sketch_width}")
        if lfu_half_life < 1:
            raise bad(f"lfu_half_life must be >= 1, got {lfu_half_life}")

        self.rows, self.slots = int(rows), int(slots)
        self.admit_after, self.evict = int(admit_after), evict
        self.ttl_steps, self.protect_steps = int(ttl_steps), int(protect_steps)
        self.lfu_half_life = int(lfu_half_life)
        self._ttl = max(self.ttl_steps, self.protect_steps, 1)  # (protection comes first)
        n = self.rows - 1
        s = np.arange(self.slots + 1, dtype=np.int64)
        bounds = 1 + (s * n) // self.slots
        self._bounds = bounds
        self._lo, self._hi = bounds[:-1].copy(), bounds[1:].copy()
        self._slot_bits = self.slots.bit_length() - 1 if self.slots & (self.slots - 1) == 0 else None
        self._batch = -(-(self._hi - self._lo) // 32)  # ceil(slot size / 32)
        if self.admit_after > 1:
            biggest = int((self._hi - self._lo).max())
            width = sketch_width or 1 << (max(16, biggest) - 1).bit_length()
            self.sketch_depth, self.sketch_width = int(sketch_depth), int(width)
            self.sketch_age = int(sketch_age) or self.sketch_width
        else:
            self.sketch_depth, self.sketch_width, self.sketch_age = 0, 0, 0
        self._config = np.array([self.rows, self.slots, self.admit_after, POLICIES.index(evict),
                                 self.ttl_steps, self.sketch_width, self.protect_steps,
                                 self.sketch_depth, self.sketch_age, self.lfu_half_life],
                                dtype=np.int64)
        cap = 1 << max(4, (_LOAD * self.rows - 1).bit_length())
        self._cap, self._mask, self._shift = cap, cap - 1, 64 - (cap.bit_length() - 1)
        self._win = np.arange(_WINDOW, dtype=np.int64)
        # per-row state (saved)
        self._key = np.full(self.rows, -1, dtype=np.int64)
        self._last = np.full(self.rows, -1, dtype=np.int64)
        self._uses = np.zeros(self.rows, dtype=np.int64)
        self._sketch = np.zeros((self.slots, self.sketch_depth, self.sketch_width), dtype=np.int32)
        self._sk_flat = self._sketch.reshape(-1)
        self._sk_adds = np.zeros(self.slots, dtype=np.int64)
        self._adm = np.zeros(self.slots, dtype=np.int64)
        self._evd = np.zeros(self.slots, dtype=np.int64)
        self._owned = np.ones(self.slots, dtype=bool)
        self._all_owned = True
        self._step = np.iinfo(np.int64).min
        # derived state (rebuilt on load)
        self._cells = np.full(cap, _EMPTY, dtype=np.int32)
        self._row_cell = np.zeros(self.rows, dtype=np.int32 if cap <= 1 << 31 else np.int64)
        self._tombs = 0
        self._rebuilds = 0
        self._pool = np.zeros(0, dtype=np.int64)  # freed rows below the watermarks, sorted
        self._wm = self._lo.copy()  # per slot: rows >= wm (and < hi) were never given

    # -- the index -----------------------------------------------------------------------

    def _find(self, keys: np.ndarray, mixed: np.ndarray) -> np.ndarray:
        """The row of each key (keys >= 0) or -1."""
        pos = (mixed >> self._shift).view(np.int64)
        # first round: each key's home cell alone (at a load under 1/4 most keys end there)
        c = self._cells[pos]
        out = self._key.take(c, mode="clip")  # -1, -2 -> row 0, whose key is -1
        hit = out == keys
        out = np.where(hit, c, -1)
        more = ~hit
        more &= c != _EMPTY
        if not more.any():
            return out
        pend = np.flatnonzero(more)
        pos = pos[pend] + 1
        kk = keys[pend]
        while True:  # then windows of 8 cells
            win = pos[:, None] + self._win
            win &= self._mask
            c = self._cells[win]
            held = self._key.take(c, mode="clip")
            match = held == kk[:, None]
            stop = match | (c == _EMPTY)
            first = stop.argmax(axis=1)
            ar = np.arange(len(kk))
            hit = match[ar, first]
            out[pend[hit]] = c[ar, first][hit]
            more = ~stop[ar, first]  # the window held neither the key nor an empty cell
            if not more.any():
                return out
            idx = np.flatnonzero(more)
            pend, pos, kk = pend[idx], pos[idx] + _WINDOW, kk[idx]

    def _insert(self, rows: np.ndarray, mixed: np.ndarray) -> None:
        """Put ``rows`` (whose keys are not in the index) into it: each takes the first free
        cell (empty or tombstone) from its home cell on. Keys that want the same cell all
        write it and read it back: the one that reads itself has it, the others look again
        in the next round (which one wins does not matter: the index is not observable)."""
        pos = (mixed >> self._shift).view(np.int64)  # where each key's search stands
        cell, advance = pos, 1  # the first round tries the home cells alone
        before = self._cells[cell]
        while True:
            ok = before < 0
            if ok.all():
                idx, cand, cc, bc = None, rows, cell, before
            else:
                idx = np.flatnonzero(ok)
                cand, cc, bc = rows[idx], cell[idx], before[idx]
            self._cells[cc] = cand
            won = self._cells[cc] == cand
            self._tombs -= int(np.count_nonzero(bc[won] == _TOMB))
            self._row_cell[cand[won]] = cc[won]
            if idx is None:
                if won.all():
                    return
                rest = ~won
            else:
                rest = np.ones(len(rows), dtype=bool)
                rest[idx[won]] = False
            # a key that lost a contest searches from where it stood again; one that found
            # no free cell, from past what it searched
            rows, pos = rows[rest], pos[rest] + np.where(ok[rest], 0, advance)
            win = pos[:, None] + self._win
            win &= self._mask
            c = self._cells[win]
            first = (c < 0).argmax(axis=1)
            ar = np.arange(len(rows))
            before, cell, advance = c[ar, first], win[ar, first], _WINDOW

    def _rebuild_index(self) -> None:
        self._cells.fill(_EMPTY)
        self._tombs = 0
        live = np.flatnonzero(self._key >= 0)
        if len(live):
            self._insert(live, _mix(self._key[live].view(np.uint64)))
        self._rebuilds += 1

    def _free(self, rows: np.ndarray) -> None:
        """Take sorted ``rows`` back from their keys: index, per-row arrays, pool."""
        self._cells[self._row_cell[rows]] = _TOMB
        self._tombs += len(rows)
        self._key[rows] = -1
        self._last[rows] = -1
        self._uses[rows] = 0
        self._pool = np.insert(self._pool, np.searchsorted(self._pool, rows), rows)

    def _rebuild_free(self) -> None:
        """Watermarks and pool from the per-row keys (lowest-first makes them equivalent)."""
        used = self._key >= 0
        idx = np.flatnonzero(used)
        slot_of = np.searchsorted(self._lo, idx, side="right") - 1
        wm = self._lo.copy()
        if len(idx):
            np.maximum.at(wm, slot_of, idx + 1)
        self._wm = wm
        below = np.zeros(self.rows + 1, dtype=np.int64)
        np.add.at(below, self._lo, 1)
        np.add.at(below, wm, -1)
        below = np.cumsum(below[:-1]) > 0  # rows in [lo_s, wm_s)
        self._pool = np.flatnonzero(below & ~used).astype(np.int64)

    # -- the step ------------------------------------------------------------------------

    def lookup(self, keys: np.ndarray, counts: np.ndarray, step: int) -> MapResult:
        """The rows of one step's unique ``keys`` (int64; any slots this process owns), each
        seen ``counts`` times in the step; marks found rows used at ``step``, admits and
        evicts (module docstring). ``step`` never goes back."""
        keys = np.asarray(keys)
        counts = np.asarray(counts)
        if keys.ndim != 1 or counts.shape != keys.shape:
            raise KeyMapError(f"KeyMap.lookup: keys and counts must be 1-D of one length, got "
                              f"shapes {keys.shape} and {counts.shape}")
        if keys.dtype != np.int64:
            raise KeyMapError(f"KeyMap.lookup: keys must be int64, got {keys.dtype}")
        step = int(step)
        if step < self._step:
            raise KeyMapError(f"KeyMap.lookup: step {step} is before the last step seen, {self._step}")
        self._step = step
        n = len(keys)
        if n == 0:
            return MapResult(np.zeros(0, np.int64), np.zeros(0, np.int64), 0, 0, np.zeros(0, np.int64))
        counts = counts.astype(np.int64, copy=False)
        vidx = None if keys.min() >= 0 else np.flatnonzero(keys >= 0)
        k = keys if vidx is None else keys[vidx]
        c = counts if vidx is None else counts[vidx]
        mixed = _mix(k.view(np.uint64))
        slot = _slot_of(mixed, self.slots)
        if not self._all_owned and not self._owned[slot].all():
            bad = np.unique(slot[~self._owned[slot]])
            raise KeyMapError(f"KeyMap.lookup: keys of slots {bad[:8].tolist()} that this "
                              f"process does not own (owned: {np.flatnonzero(self._owned)[:8].tolist()}...)")
        r = self._find(k, mixed)
        found = r > 0
        evicted = 0
        if self.evict == "ttl" and found.any():
            expired = found & (self._last.take(r, mode="clip") <= step - self._ttl)
            if expired.any():
                gone = np.sort(r[expired])
                self._free(gone)
                np.add.at(self._evd, slot[expired], 1)
                evicted += len(gone)
                found &= ~expired
                r[expired] = -1
        every = bool(found.all())
        fr, fc = (r, c) if every else (r[found], c[found])
        if self.evict == "lfu":
            h = self.lfu_half_life
            d = np.minimum(step // h - self._last[fr] // h, 63)
            self._uses[fr] = (self._uses[fr] >> d) + fc
        else:
            self._uses[fr] += fc  # (rows of distinct keys: no row twice)
        self._last[fr] = step
        fresh = np.zeros(0, dtype=np.int64)
        admitted = 0
        if not every:
            new = np.flatnonzero(~found)
            got, fresh, admitted, ev = self._admit(k[new], c[new], mixed[new], slot[new], step)
            r[new] = got
            evicted += ev
        np.maximum(r, MISSING_ROW, out=r)  # (-1: not admitted)
        if vidx is None:
            rows = r
        else:
            rows = np.zeros(n, dtype=np.int64)
            rows[vidx] = r
        return MapResult(rows, fresh, evicted, admitted, self._key[fresh])

    def _sketch_count(self, k: np.ndarray, c: np.ndarray, mixed: np.ndarray,
                      slot: np.ndarray) -> np.ndarray:
        """Count the keys' occurrences in their slots' sketches (conservative update, then
        aging); the estimates after counting."""
        g = _mix(mixed ^ _SKETCH_SEED)
        h1 = (g & 0xFFFFFFFF).view(np.int64)
        h2 = (g >> 32).view(np.int64) | 1
        depth, width = self.sketch_depth, self.sketch_width
        d = np.arange(depth, dtype=np.int64)
        idx = (h1[:, None] + h2[:, None] * d) & (width - 1)
        idx += (slot[:, None] * depth + d) * width
        sk = self._sk_flat
        est = sk[idx].min(axis=1).astype(np.int64)
        target = np.minimum(est + c, _INT32_MAX).astype(np.int32)
        np.maximum.at(sk, idx.reshape(-1), np.repeat(target, depth))
        after = sk[idx].min(axis=1)
        adds = np.bincount(slot, weights=c, minlength=self.slots).astype(np.int64)
        self._sk_adds += adds
        age = self._sk_adds >= self.sketch_age
        if age.any():
            for s in np.flatnonzero(age):
                times = int(self._sk_adds[s] // self.sketch_age)
                self._sketch[s] >>= min(times, 31)
                self._sk_adds[s] -= times * self.sketch_age
        return after

    def _admit(self, k, c, mixed, slot, step) -> tuple[np.ndarray, np.ndarray, int, int]:
        """Rows for keys without one (-1 where not admitted), the fresh rows, how many were
        admitted and evicted."""
        got = np.full(len(k), -1, dtype=np.int64)
        if self.admit_after > 1:
            ok = self._sketch_count(k, c, mixed, slot) >= self.admit_after
            cand = np.flatnonzero(ok)
            if not len(cand):
                return got, np.zeros(0, np.int64), 0, 0
        else:
            cand = np.arange(len(k))
        # by slot, then by the key's mix (a bijection): an order of the keys, not of the call
        cm = mixed[cand]
        if self._slot_bits is not None:  # slot = the low bits: rotate them to the top
            b = self._slot_bits
            order = np.argsort((cm >> b) | (cm << (64 - b)) if b else cm)
        else:
            order = np.argsort(cm)
            order = order[np.argsort(slot[cand[order]], kind="stable")]
        cand = cand[order]
        cm = cm[order]
        if len(cm) > 1 and (cm[1:] == cm[:-1]).any():
            raise KeyMapError("KeyMap.lookup: keys must be unique (a new key is given twice)")
        cs = slot[cand]
        need = np.bincount(cs, minlength=self.slots)
        at = np.searchsorted(self._pool, self._bounds)
        pa, pool_n = at[:-1], at[1:] - at[:-1]
        free_n = pool_n + (self._hi - self._wm)
        evicted = 0
        short = np.flatnonzero(need > free_n)
        if len(short):
            evicted = self._evict(short, np.maximum(need[short] - free_n[short], self._batch[short]), step)
            at = np.searchsorted(self._pool, self._bounds)
            pa, pool_n = at[:-1], at[1:] - at[:-1]
            free_n = pool_n + (self._hi - self._wm)
        give = np.minimum(need, free_n)
        start = np.cumsum(need) - need
        j = np.arange(len(cand)) - start[cs]
        take = j < give[cs]
        cand, cs, j = cand[take], cs[take], j[take]
        from_pool = j < pool_n[cs]
        rows = self._wm[cs] + j - pool_n[cs]
        if from_pool.any():
            pidx = pa[cs[from_pool]] + j[from_pool]
            rows[from_pool] = self._pool[pidx]
            self._pool = np.delete(self._pool, pidx)
        self._wm += np.maximum(give - pool_n, 0)
        got[cand] = rows
        self._key[rows] = k[cand]
        self._last[rows] = step
        self._uses[rows] = c[cand]
        if self._tombs > self._cap // 8:
            self._rebuild_index()  # (includes the new rows)
        else:
            self._insert(rows, mixed[cand])
        self._adm += np.bincount(cs, minlength=self.slots)
        return got, rows, len(rows), evicted  # (rows ascend: by slot, pool then watermark)

    def _order(self, rows: np.ndarray, last: np.ndarray, step: int) -> list[np.ndarray]:
        """The eviction order of ``rows`` (their last steps ``last``) as columns, primary first
        (the row index, last of all, is implied)."""
        if self.evict == "lfu":
            h = self.lfu_half_life
            return [self._uses[rows] >> np.minimum(step // h - last // h, 63), last]
        return [last]

    def _evict(self, short: np.ndarray, want: np.ndarray, step: int) -> int:
        """Free up to ``want[i]`` rows of each slot ``short[i]`` (the module docstring: the
        policies); how many were freed."""
        limit = step - max(self.protect_steps, 1)
        if self.evict == "ttl":
            limit = step - self._ttl
        lo, hi = self._lo[short], self._hi[short]
        sizes = hi - lo
        gone = None
        if int(sizes.max()) <= 1024:  # small slots: one sort across all of them
            first = np.cumsum(sizes) - sizes
            rows = np.arange(int(sizes.sum()), dtype=np.int64) + np.repeat(lo - first, sizes)
            last = self._last[rows]
            elig = np.flatnonzero((self._key[rows] >= 0) & (last <= limit))
            rows, last = rows[elig], last[elig]
            which = np.repeat(np.arange(len(short)), sizes)[elig]
            comp = _pack([which, *self._order(rows, last, step), rows])
            if not len(rows):
                gone = rows
            elif comp is not None:
                rmin, rspan = int(rows[0]), int(rows[-1]) - int(rows[0]) + 1  # (rows ascend)
                ordered = np.sort(comp) % rspan + rmin
                w = np.searchsorted(lo, ordered, side="right") - 1
                cnt = np.bincount(which, minlength=len(short))
                j = np.arange(len(ordered)) - (np.cumsum(cnt) - cnt)[w]
                gone = np.sort(ordered[j < want[w]])
        if gone is None:
            parts = []
            for s, n in zip(short.tolist(), want.tolist()):
                a, b = int(self._lo[s]), int(self._hi[s])
                last = self._last[a:b]
                elig = np.flatnonzero((self._key[a:b] >= 0) & (last <= limit))
                if not len(elig):
                    continue
                cols = self._order(elig + a, last[elig], step)
                comp = _pack([*cols, elig])
                if comp is None:
                    pick = _k_smallest(cols, n)
                elif n < len(comp):
                    pick = np.argpartition(comp, n - 1)[:n]
                else:
                    pick = np.arange(len(comp))
                parts.append(elig[pick] + a)
            gone = np.sort(np.concatenate(parts)) if parts else np.zeros(0, np.int64)
        if len(gone):
            self._free(gone)
            self._evd += np.bincount(np.searchsorted(self._lo, gone, side="right") - 1,
                                     minlength=self.slots)
        return len(gone)

    # -- ownership, stats, state ---------------------------------------------------------

    def slot_rows(self, slot: int) -> tuple[int, int]:
        """The rows ``[lo, hi)`` of ``slot``."""
        return int(self._lo[slot]), int(self._hi[slot])

    def owned(self, slots: np.ndarray) -> None:
        """Hold only ``slots`` from now on: the rows, sketch and totals of the others are
        emptied, and lookups of their keys are refused."""
        slots = np.asarray(slots, dtype=np.int64).reshape(-1)
        if len(slots) and (slots.min() < 0 or slots.max() >= self.slots):
            raise KeyMapError(f"KeyMap.owned: slots must be in [0, {self.slots}), got {slots.tolist()[:8]}")
        mask = np.zeros(self.slots, dtype=bool)
        mask[slots] = True
        self._owned = mask
        self._all_owned = bool(mask.all())
        drop = np.repeat(~mask, self._hi - self._lo)
        drop = np.concatenate([[False], drop])
        self._key[drop] = -1
        self._last[drop] = -1
        self._uses[drop] = 0
        if self.sketch_width:
            self._sketch[~mask] = 0
        self._sk_adds[~mask] = 0
        self._adm[~mask] = 0
        self._evd[~mask] = 0
        self._rebuild_index()
        self._rebuild_free()

    def stats(self) -> dict:
        """``live`` rows held, totals ``admitted`` and ``evicted``, ``rows``; and the index's
        ``rebuilds`` since this object was made."""
        return {"live": int(np.count_nonzero(self._key >= 0)), "admitted": int(self._adm.sum()),
                "evicted": int(self._evd.sum()), "rows": self.rows, "rebuilds": self._rebuilds}

    def nbytes(self) -> int:
        """Bytes of this map's arrays (per-row state, sketch, index, pool)."""
        arrays = (self._key, self._last, self._uses, self._sketch, self._cells, self._row_cell,
                  self._pool, self._sk_adds, self._adm, self._evd, self._lo, self._hi, self._wm)
        return sum(a.nbytes for a in arrays)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Tensors only: ``row_key`` / ``row_last`` / ``row_uses`` (int64 [rows]: the key of
        each row or -1, its last step or -1, its decayed use count), ``sketch`` (int32 [slots,
        depth, width]), ``sketch_adds``, ``slot_admitted``, ``slot_evicted`` (int64 [slots]),
        ``owned`` (bool [slots]), ``step`` and ``config`` (what the map was made with). The
        index is not saved: :meth:`load_state_dict` rebuilds it from ``row_key``."""
        def t(a: np.ndarray) -> torch.Tensor:
            return torch.from_numpy(np.array(a, copy=True))

        return {"config": t(self._config), "owned": t(self._owned),
                "step": torch.tensor(self._step, dtype=torch.int64),
                "row_key": t(self._key), "row_last": t(self._last), "row_uses": t(self._uses),
                "sketch": t(self._sketch), "sketch_adds": t(self._sk_adds),
                "slot_admitted": t(self._adm), "slot_evicted": t(self._evd)}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Take ``state`` (of :meth:`state_dict` or :meth:`merge_states`): afterwards lookups
        give exactly what they would have given in the map that saved it. Refused where it was
        made with other arguments or does not hold together."""
        a = _check_state(state, self._config)
        if not np.array_equal(a["config"], self._config):
            names = ("rows", "slots", "admit_after", "evict", "ttl_steps", "sketch_width",
                     "protect_steps", "sketch_depth", "sketch_age", "lfu_half_life")
            diff = [f"{nm} {int(x)} (here {int(y)})" for nm, x, y in zip(names, a["config"], self._config)
                    if x != y]
            raise KeyMapError(f"KeyMap state: made with other arguments: {', '.join(diff)}")
        key = a["row_key"]
        live = np.flatnonzero(key >= 0)
        if key[0] != -1:
            raise KeyMapError("KeyMap state: row 0 holds a key (it is the shared row)")
        slot_of = np.searchsorted(self._lo, live, side="right") - 1
        if not np.array_equal(key_slots(key[live], self.slots), slot_of):
            raise KeyMapError("KeyMap state: a key is in a row outside its slot's range")
        if len(np.unique(key[live])) != len(live):
            raise KeyMapError("KeyMap state: a key is held by two rows")
        self._key[:] = key
        self._last[:] = a["row_last"]
        self._uses[:] = a["row_uses"]
        self._sketch[...] = a["sketch"]
        self._sk_adds[:] = a["sketch_adds"]
        self._adm[:] = a["slot_admitted"]
        self._evd[:] = a["slot_evicted"]
        self._owned[:] = a["owned"]
        self._all_owned = bool(self._owned.all())
        self._step = int(a["step"])
        self._rebuild_index()
        self._rebuild_free()

    @staticmethod
    def merge_states(states: list[dict]) -> dict:
        """One state from the states of processes owning disjoint slots: each slot's rows,
        sketch and totals from the state that owns it; ``step`` the latest."""
        if not states:
            raise KeyMapError("KeyMap.merge_states: no states given")
        arrays = [_check_state(s, None) for s in states]
        config = arrays[0]["config"]
        for i, a in enumerate(arrays[1:], 1):
            if not np.array_equal(a["config"], config):
                raise KeyMapError(f"KeyMap.merge_states: state {i} was made with other arguments than state 0")
        rows, slots = int(config[0]), int(config[1])
        bounds = 1 + (np.arange(slots + 1, dtype=np.int64) * (rows - 1)) // slots
        owner = np.full(slots, -1, dtype=np.int64)
        for i, a in enumerate(arrays):
            both = a["owned"] & (owner >= 0)
            if both.any():
                raise KeyMapError(f"KeyMap.merge_states: slot {int(np.flatnonzero(both)[0])} is owned "
                                  f"by state {int(owner[both][0])} and state {i}")
            owner[a["owned"]] = i
        row_owner = np.concatenate([[-1], np.repeat(owner, np.diff(bounds))])
        out = {"config": config.copy(), "owned": owner >= 0,
               "step": np.array(max(int(a["step"]) for a in arrays), dtype=np.int64)}
        for name, fill in (("row_key", -1), ("row_last", -1), ("row_uses", 0)):
            m = np.full(rows, fill, dtype=np.int64)
            for i, a in enumerate(arrays):
                sel = row_owner == i
                m[sel] = a[name][sel]
            out[name] = m
        for name in ("sketch", "sketch_adds", "slot_admitted", "slot_evicted"):
            m = np.zeros_like(arrays[0][name])
            for i, a in enumerate(arrays):
                sel = owner == i
                m[sel] = a[name][sel]
            out[name] = m
        return {name: torch.from_numpy(np.asarray(v)) for name, v in out.items()}


def _check_state(state: dict, config: np.ndarray | None) -> dict[str, np.ndarray]:
    """The numpy arrays of a saved state, its names, dtypes and shapes checked."""
    if not isinstance(state, dict):
        raise KeyMapError(f"KeyMap state: a dict of tensors expected, got {type(state).__name__}")
    missing = [k for k in _STATE_KEYS if k not in state]
    if missing:
        raise KeyMapError(f"KeyMap state: missing {', '.join(missing)}")
    out = {}
    for name in _STATE_KEYS:
        v = state[name]
        if not isinstance(v, torch.Tensor):
            raise KeyMapError(f"KeyMap state: {name} is a {type(v).__name__}, not a tensor")
        out[name] = v.detach().cpu().numpy()
    cfg = out["config"]
    if cfg.dtype != np.int64 or cfg.shape != (10,):
        raise KeyMapError("KeyMap state: config is not int64 [10]")
    rows, slots, depth, width = int(cfg[0]), int(cfg[1]), int(cfg[7]), int(cfg[5])
    shapes = {"owned": ((slots,), np.bool_), "step": ((), np.int64),
              "row_key": ((rows,), np.int64), "row_last": ((rows,), np.int64),
              "row_uses": ((rows,), np.int64), "sketch": ((slots, depth, width), np.int32),
              "sketch_adds": ((slots,), np.int64), "slot_admitted": ((slots,), np.int64),
              "slot_evicted": ((slots,), np.int64)}
    for name, (shape, dtype) in shapes.items():
        if out[name].shape != shape or out[name].dtype != dtype:
            raise KeyMapError(f"KeyMap state: {name} is {out[name].dtype} {list(out[name].shape)}, "
                              f"expected {np.dtype(dtype)} {list(shape)}")
    return out
