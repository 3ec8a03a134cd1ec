"""The dynamic tables' key map (hybridrec.sparse.keymap): rows, admission, eviction, slots, state.

Besides hand-made cases, a plain-Python model of the documented rules (a dict, sorted lists)
runs the same random streams as :class:`KeyMap` and must agree on every row, every fresh row and
every per-row array: the vectorized index, pool and batch eviction change nothing observable.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hybridrec.errors import ConfigError, HybridrecError
from hybridrec.sparse.keymap import (
    MISSING_ROW,
    KeyMap,
    KeyMapConfigError,
    KeyMapError,
    MapResult,
    key_slots,
)

M64 = (1 << 64) - 1


def mix(key: int) -> int:
    """splitmix64's finaliser in Python integers."""
    z = key & M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & M64
    return z ^ (z >> 31)


def ids(*keys: int) -> tuple[np.ndarray, np.ndarray]:
    """(keys, counts of 1)."""
    k = np.array(keys, dtype=np.int64)
    return k, np.ones(len(k), dtype=np.int64)


def keys_of_slot(slot: int, slots: int, n: int, start: int = 0) -> list[int]:
    """The first ``n`` keys >= ``start`` whose slot is ``slot``."""
    out, k = [], start
    while len(out) < n:
        if mix(k) % slots == slot:
            out.append(k)
        k += 1
    return out


class Model:
    """The documented rules, one key at a time (exact admission counts: no sketch)."""

    def __init__(self, rows: int, slots: int, admit_after: int, evict: str, ttl: int,
                 protect: int, half_life: int) -> None:
        self.rows, self.slots, self.admit = rows, slots, admit_after
        self.evict, self.ttl, self.protect, self.h = evict, ttl, protect, half_life
        n = rows - 1
        self.lo = [1 + s * n // slots for s in range(slots)]
        self.hi = [1 + (s + 1) * n // slots for s in range(slots)]
        self.key = [-1] * rows
        self.last = [-1] * rows
        self.uses = [0] * rows
        self.row_of: dict[int, int] = {}
        self.seen: dict[int, int] = {}

    def free(self, r: int) -> None:
        del self.row_of[self.key[r]]
        self.key[r], self.last[r], self.uses[r] = -1, -1, 0

    def order(self, r: int, step: int) -> tuple:
        if self.evict == "lfu":
            d = min(step // self.h - self.last[r] // self.h, 63)
            return (self.uses[r] >> d, self.last[r], r)
        return (self.last[r], r)

    def lookup(self, keys, counts, step: int):
        rows = [0] * len(keys)
        fresh, evicted, admitted = [], 0, 0
        new: dict[int, list] = {}
        for i, (k, c) in enumerate(zip(keys.tolist(), counts.tolist())):
            if k < 0:
                continue
            r = self.row_of.get(k)
            if r is not None and self.evict == "ttl" and self.last[r] <= step - max(self.ttl, self.protect, 1):
                self.free(r)
                evicted += 1
                r = None
            if r is not None:
                if self.evict == "lfu":
                    d = min(step // self.h - self.last[r] // self.h, 63)
                    self.uses[r] = (self.uses[r] >> d) + c
                else:
                    self.uses[r] += c
                self.last[r] = step
                rows[i] = r
                continue
            self.seen[k] = self.seen.get(k, 0) + c
            if self.seen[k] >= self.admit:
                new.setdefault(mix(k) % self.slots, []).append((mix(k), k, c, i))
        for s, cand in sorted(new.items()):
            cand.sort()
            lo, hi = self.lo[s], self.hi[s]
            free = [r for r in range(lo, hi) if self.key[r] < 0]
            if len(cand) > len(free):
                limit = step - max(self.protect, 1)
                if self.evict == "ttl":
                    limit = min(limit, step - self.ttl)  # (the protection holds as well)
                elig = [r for r in range(lo, hi) if self.key[r] >= 0 and self.last[r] <= limit]
                want = max(len(cand) - len(free), -(-(hi - lo) // 32))
                for r in sorted(elig, key=lambda r: self.order(r, step))[:want]:
                    self.free(r)
                    evicted += 1
                free = [r for r in range(lo, hi) if self.key[r] < 0]
            for (_, k, c, i), r in zip(cand, free):
                self.key[r], self.last[r], self.uses[r] = k, step, c
                self.row_of[k] = r
                rows[i] = r
                fresh.append(r)
                admitted += 1
        return rows, sorted(fresh), evicted, admitted


def stream(rng, steps: int, population: int, per_step: int, negative: bool = True):
    """Random steps of unique keys (a skewed population, a few missing ids) with counts."""
    w = 1.0 / np.arange(1, population + 1) ** 1.1
    w /= w.sum()
    for _ in range(steps):
        draw = rng.choice(population, size=per_step, p=w)
        k, c = np.unique(draw, return_counts=True)
        k = k.astype(np.int64) * 7919 + 3  # spread the ids out
        if negative:
            k = np.concatenate([k, [-1, -5]])
            c = np.concatenate([c, [3, 1]])
        perm = rng.permutation(len(k))  # the order of a call is not the order of the keys
        yield k[perm], c[perm].astype(np.int64)


POLICY_KW = {"lru": {}, "lfu": {"lfu_half_life": 5}, "ttl": {"ttl_steps": 6}}


def make(evict: str, admit_after: int = 1, rows: int = 161, slots: int = 4, protect: int = 2,
         **kw) -> KeyMap:
    args = {**POLICY_KW[evict], **kw}
    if admit_after > 1:  # a sketch wide enough to count exactly, never halved
        args.setdefault("sketch_width", 1 << 14)
        args.setdefault("sketch_age", 1 << 40)
    return KeyMap(rows, slots=slots, admit_after=admit_after, evict=evict,
                  protect_steps=protect, **args)


def model_for(m: KeyMap) -> Model:
    return Model(m.rows, m.slots, m.admit_after, m.evict, m.ttl_steps, m.protect_steps,
                 m.lfu_half_life)


def state_equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


# -- the model agrees ---------------------------------------------------------------------


@pytest.mark.parametrize("evict", ["lru", "lfu", "ttl"])
@pytest.mark.parametrize("admit_after", [1, 3])
def test_the_documented_rules_row_for_row(evict, admit_after):
    """Every row, fresh row, count and per-row array as the plain model says, through a
    stream that evicts every few steps; no two live keys ever share a row."""
    rng = np.random.default_rng(7)
    m = make(evict, admit_after)
    ref = model_for(m)
    total_evicted = 0
    for step, (k, c) in enumerate(stream(rng, 120, population=600, per_step=90)):
        got = m.lookup(k, c, step)
        rows, fresh, evicted, admitted = ref.lookup(k, c, step)
        assert got.rows.tolist() == rows, step
        assert got.fresh.tolist() == fresh, step
        assert (got.evicted, got.admitted) == (evicted, admitted), step
        assert got.rows.dtype == np.int64 and got.fresh.dtype == np.int64
        live = got.rows[got.rows != MISSING_ROW]
        assert len(np.unique(live)) == len(live)
        total_evicted += evicted
    state = m.state_dict()
    assert state["row_key"].tolist() == ref.key
    assert state["row_last"].tolist() == ref.last
    assert state["row_uses"].tolist() == ref.uses
    assert total_evicted > 100  # the stream did evict
    held = state["row_key"].numpy()
    assert len(np.unique(held[held >= 0])) == np.count_nonzero(held >= 0)
    s = m.stats()
    assert s["live"] == np.count_nonzero(held >= 0) and s["rows"] == m.rows
    assert s["rebuilds"] > 0  # the index was rebuilt from its tombstones along the way


@pytest.mark.parametrize(("evict", "scale"), [("lru", 1), ("lfu", 1), ("lfu", 1 << 50)])
def test_the_rules_with_large_slots(evict, scale):
    """Slots of 1,500 rows: each short slot chooses by its own partition (the small-slot sort
    is for slots of at most 1,024 rows); counts of 2**50 overflow the packed order, and the
    partition of the columns one by one decides instead."""
    rng = np.random.default_rng(2)
    m = make(evict, rows=3001, slots=2)
    ref = model_for(m)
    evicted = 0
    for step, (k, c) in enumerate(stream(rng, 40, population=9000, per_step=700)):
        got = m.lookup(k, c * scale, step)
        rows, fresh, ev, _ = ref.lookup(k, c * scale, step)
        assert got.rows.tolist() == rows and got.fresh.tolist() == fresh, step
        evicted += ev
    assert evicted > 200
    assert m.state_dict()["row_uses"].tolist() == ref.uses


def test_k_smallest_is_the_lexicographic_order_with_ties_by_index():
    from hybridrec.sparse.keymap import _k_smallest
    rng = np.random.default_rng(0)
    for _ in range(200):
        n = int(rng.integers(1, 60))
        cols = [rng.integers(0, 4, n), rng.integers(0, 3, n)]
        k = int(rng.integers(1, n + 1))
        want = np.sort(np.lexsort((np.arange(n), cols[1], cols[0]))[:k])
        assert _k_smallest(cols, k).tolist() == want.tolist()


# -- admission ------------------------------------------------------------------------------


def test_missing_keys_map_to_the_shared_row():
    m = KeyMap(33, slots=2)
    r = m.lookup(*ids(-1, 5, -7), step=0)
    assert r.rows[0] == MISSING_ROW and r.rows[2] == MISSING_ROW and r.rows[1] != MISSING_ROW
    assert r.admitted == 1 and r.fresh.tolist() == [r.rows[1]]
    assert m.stats()["live"] == 1


def test_admission_after_n_occurrences():
    m = KeyMap(65, slots=2, admit_after=3)
    for step in (0, 1):
        r = m.lookup(*ids(10), step=step)
        assert r.rows.tolist() == [MISSING_ROW] and r.admitted == 0 and len(r.fresh) == 0
    r = m.lookup(*ids(10), step=2)
    assert r.rows[0] != MISSING_ROW and r.admitted == 1 and r.fresh.tolist() == r.rows.tolist()
    row10 = int(r.rows[0])
    # counts count: 3 occurrences in one step admit at once, 2 do not
    r = m.lookup(np.array([20, 30], np.int64), np.array([3, 2], np.int64), step=3)
    assert r.rows[0] != MISSING_ROW and r.rows[1] == MISSING_ROW
    # once admitted, a key keeps its row without counting again
    r2 = m.lookup(*ids(10), step=4)
    assert r2.rows.tolist() == [row10] == [m.lookup(*ids(10), step=5).rows[0]] and len(r2.fresh) == 0


def test_admit_after_one_keeps_no_sketch():
    assert KeyMap(33, slots=2).state_dict()["sketch"].numel() == 0
    assert KeyMap(33, slots=2, admit_after=2).state_dict()["sketch"].numel() > 0


def test_the_sketch_is_bounded_and_ages():
    """The sketch's size is fixed by the arguments, not by the keys seen; halving keeps a
    long stream of keys seen once from saturating it (no admissions of them)."""
    m = KeyMap(1025, slots=4, admit_after=2)
    shape = m.state_dict()["sketch"].shape
    before = m.nbytes()
    rng = np.random.default_rng(0)
    once = rng.choice(1 << 50, 200_000, replace=False).astype(np.int64)
    admitted = 0
    for step, chunk in enumerate(np.array_split(once, 100)):
        admitted += m.lookup(chunk, np.ones(len(chunk), np.int64), step).admitted
    state = m.state_dict()
    assert state["sketch"].shape == shape and m.nbytes() == before
    assert admitted < 0.01 * len(once), admitted  # keys seen once are (nearly) never admitted
    assert int(state["sketch"].max()) <= 4
    # and a key seen twice still is
    r = m.lookup(*ids(7), step=200)
    r = m.lookup(*ids(7), step=201)
    assert r.rows[0] != MISSING_ROW


# -- eviction ---------------------------------------------------------------------------


def fill_one_slot(m: KeyMap, n: int, start_step: int = 0) -> list[int]:
    """Keys 0.. of slot 0, one per step; their rows."""
    keys = keys_of_slot(0, m.slots, n)
    rows = []
    for i, k in enumerate(keys):
        rows.append(int(m.lookup(*ids(k), step=start_step + i).rows[0]))
    return rows


def test_lru_evicts_the_least_recent_first():
    m = KeyMap(65, slots=2, evict="lru")  # slot 0: rows 1..32, a batch of 1
    keys = keys_of_slot(0, 2, 40)
    rows = fill_one_slot(m, 32)
    assert rows == list(range(1, 33))  # lowest rows first
    m.lookup(*ids(keys[0]), step=40)  # key 0 used again: key 1 is now the least recent
    r = m.lookup(*ids(keys[32]), step=41)
    assert r.evicted == 1 and r.rows[0] == rows[1] and r.fresh.tolist() == [rows[1]]
    assert m.lookup(*ids(keys[1]), step=42).rows[0] != rows[1]  # it lost its row


def test_lru_ties_go_by_row_index():
    m = KeyMap(65, slots=2, evict="lru")
    keys = keys_of_slot(0, 2, 34)
    r = m.lookup(np.array(keys[:32], np.int64), np.ones(32, np.int64), step=0)
    assert sorted(r.rows.tolist()) == list(range(1, 33))
    r = m.lookup(*ids(keys[32]), step=5)
    assert r.rows[0] == 1 and r.evicted == 1  # all used at step 0: the lowest row goes
    r = m.lookup(*ids(keys[33]), step=6)
    assert r.rows[0] == 2


def test_lfu_evicts_the_fewest_uses_first():
    m = KeyMap(65, slots=2, evict="lfu", lfu_half_life=1000)
    keys = keys_of_slot(0, 2, 34)
    k = np.array(keys[:32], np.int64)
    counts = np.full(32, 5, np.int64)
    counts[7], counts[3] = 2, 2  # the two least used: rows of keys 3 and 7, key 7 used later
    r = m.lookup(k, counts, step=0)
    row_of = dict(zip(k.tolist(), r.rows.tolist()))
    m.lookup(np.array([keys[7]], np.int64), np.array([0], np.int64), step=3)  # later, no uses
    got = m.lookup(*ids(keys[32]), step=10)
    assert got.rows[0] == row_of[keys[3]]  # same uses: the least recent goes
    got = m.lookup(*ids(keys[33]), step=11)
    assert got.rows[0] == row_of[keys[7]]


def test_lfu_counts_decay():
    """Uses halve at every multiple of lfu_half_life: old popularity fades."""
    m = KeyMap(65, slots=2, evict="lfu", lfu_half_life=10)
    keys = keys_of_slot(0, 2, 33)
    k = np.array(keys[:32], np.int64)
    counts = np.full(32, 3, np.int64)
    counts[0] = 64  # popular long ago
    m.lookup(k, counts, step=0)
    m.lookup(np.array(keys[1:32], np.int64), np.full(31, 3, np.int64), step=60)  # the others lately
    uses = m.state_dict()["row_uses"]
    assert int(uses[1]) == 64 and int(uses[2]) == (3 >> 6) + 3
    r = m.lookup(*ids(keys[32]), step=62)
    assert r.rows[0] == 1  # 64 >> 6 = 1 use left, fewer than the others' 3


def test_ttl_frees_expired_rows_only():
    m = KeyMap(65, slots=2, evict="ttl", ttl_steps=10)
    keys = keys_of_slot(0, 2, 36)
    r = m.lookup(np.array(keys[:32], np.int64), np.ones(32, np.int64), step=0)
    row_of = dict(zip(keys[:32], r.rows.tolist()))
    m.lookup(np.array(keys[16:32], np.int64), np.ones(16, np.int64), step=5)
    r = m.lookup(*ids(keys[32]), step=9)  # full, nothing expired (used at 0, 5): not admitted
    assert r.rows[0] == MISSING_ROW and r.evicted == 0 and r.admitted == 0
    r = m.lookup(*ids(keys[32]), step=10)  # keys 0..15 expired: the oldest, lowest goes
    assert r.rows[0] == row_of[keys[0]] and r.evicted == 1 and r.admitted == 1
    # an expired key that comes back loses its row, and is admitted again into a fresh one
    r = m.lookup(*ids(keys[5]), step=11)
    assert r.evicted == 1 and r.admitted == 1 and r.rows[0] == row_of[keys[5]]
    assert r.fresh.tolist() == [row_of[keys[5]]]
    # keys used at step 5 expire at 15
    r = m.lookup(*ids(keys[20]), step=14)
    assert r.rows[0] == row_of[keys[20]] and len(r.fresh) == 0
    # a ttl shorter than the protection: the protection holds
    m = KeyMap(65, slots=2, evict="ttl", ttl_steps=1, protect_steps=3)
    row = m.lookup(*ids(keys[0]), step=0).rows[0]
    assert m.lookup(*ids(keys[0]), step=2).rows[0] == row  # used 2 steps ago: kept
    r = m.lookup(*ids(keys[0]), step=5)  # 3 steps: expired
    assert r.evicted == 1 and r.fresh.tolist() == [row]


def test_eviction_is_batched():
    """A full slot frees max(needed, 1/32 of the slot) rows at once; the next new key takes
    a freed row without evicting."""
    m = KeyMap(257, slots=2)  # slot 0: 128 rows, batches of 4
    keys = keys_of_slot(0, 2, 131)
    m.lookup(np.array(keys[:128], np.int64), np.ones(128, np.int64), step=0)
    r = m.lookup(*ids(keys[128]), step=3)
    assert r.evicted == 4 and r.rows[0] == 1
    r = m.lookup(np.array(keys[129:131], np.int64), np.ones(2, np.int64), step=4)
    assert r.evicted == 0 and r.fresh.tolist() == [2, 3]
    assert m.stats()["evicted"] == 4 and m.stats()["live"] == 127


def test_rows_in_use_are_protected():
    m = KeyMap(65, slots=2, protect_steps=2)
    keys = keys_of_slot(0, 2, 34)
    m.lookup(np.array(keys[:16], np.int64), np.ones(16, np.int64), step=0)
    m.lookup(np.array(keys[16:32], np.int64), np.ones(16, np.int64), step=1)
    r = m.lookup(*ids(keys[32]), step=1)  # every row used at 0 or 1: none may go
    assert r.rows[0] == MISSING_ROW and r.evicted == 0
    r = m.lookup(np.array(keys[:16] + [keys[32]], np.int64), np.ones(17, np.int64), step=2)
    # step 2: rows used at 1 and 2 are protected, and the keys of this call: no row free
    assert r.rows[-1] == MISSING_ROW and r.evicted == 0
    r = m.lookup(*ids(keys[32]), step=3)  # keys 16..31 were last used at 1: they may go now
    assert r.rows[0] != MISSING_ROW and r.evicted == 1
    # protect_steps=0 still never takes a row from a key of the same call
    m0 = KeyMap(65, slots=2, protect_steps=0)
    m0.lookup(np.array(keys[:32], np.int64), np.ones(32, np.int64), step=0)
    r = m0.lookup(np.array(keys[:33], np.int64), np.ones(33, np.int64), step=0)
    assert r.rows[-1] == MISSING_ROW and len(np.unique(r.rows[:32])) == 32


@pytest.mark.parametrize("evict", ["lru", "lfu", "ttl"])
def test_fresh_rows_are_exactly_the_rows_that_change_owner(evict):
    rng = np.random.default_rng(3)
    m = make(evict, rows=101)
    before = m.state_dict()["row_key"].numpy().copy()
    for step, (k, c) in enumerate(stream(rng, 60, population=400, per_step=60)):
        r = m.lookup(k, c, step)
        after = m.state_dict()["row_key"].numpy()
        changed = np.flatnonzero((after != before) & (after >= 0))
        if evict == "ttl":  # a key may come back to its own freed row: fresh, same key
            assert set(changed) <= set(r.fresh.tolist())
        else:
            assert r.fresh.tolist() == changed.tolist()
        assert np.array_equal(after[r.fresh], k[np.isin(r.rows, r.fresh)][np.argsort(
            r.rows[np.isin(r.rows, r.fresh)])])  # each fresh row holds the key it was given
        assert np.all(np.diff(r.fresh) > 0)
        before = after.copy()


# -- slots, processes, state ------------------------------------------------------------------


def test_key_slots_is_the_splitmix64_finaliser_modulo_slots():
    keys = np.array([0, 1, 2, 12345, 2**62 + 7, 2**63 - 1], dtype=np.int64)
    for slots in (1, 3, 16):
        got = key_slots(keys, slots)
        assert got.dtype == np.int64
        assert got.tolist() == [mix(int(k)) % slots for k in keys]


def split_run(evict: str, admit_after: int, steps: int = 60):
    """One owner of all 8 slots against two owners of 4 each fed the same steps."""
    full = make(evict, admit_after, rows=241, slots=8)
    halves = [make(evict, admit_after, rows=241, slots=8) for _ in range(2)]
    halves[0].owned(np.arange(0, 8, 2))
    halves[1].owned(np.arange(1, 8, 2))
    one_by_one = make(evict, admit_after, rows=241, slots=8)  # all slots, a call per half
    rng = np.random.default_rng(11)
    for step, (k, c) in enumerate(stream(rng, steps, population=900, per_step=120, negative=False)):
        want = full.lookup(k, c, step)
        odd = key_slots(k, 8) % 2 == 1
        got = np.zeros(len(k), np.int64)
        fresh, evicted = [], 0
        for h, sel in ((0, ~odd), (1, odd)):
            r = halves[h].lookup(k[sel], c[sel], step)
            r2 = one_by_one.lookup(k[sel], c[sel], step)
            assert np.array_equal(r.rows, r2.rows) and np.array_equal(r.fresh, r2.fresh)
            got[sel] = r.rows
            fresh += r.fresh.tolist()
            evicted += r.evicted
        assert np.array_equal(got, want.rows), step
        assert sorted(fresh) == want.fresh.tolist() and evicted == want.evicted
    return full, halves, one_by_one


@pytest.mark.parametrize("evict", ["lru", "lfu", "ttl"])
@pytest.mark.parametrize("admit_after", [1, 2])
def test_slots_are_decided_independently(evict, admit_after):
    """Calling lookup with all slots' keys, or once per subset of slots (two processes
    owning half each, or one process calling twice), gives the same rows; merging the two
    half-owners' states gives the single owner's state exactly."""
    full, halves, one_by_one = split_run(evict, admit_after)
    want = full.state_dict()
    assert full.stats()["evicted"] > 0
    assert state_equal(one_by_one.state_dict(), want)
    merged = KeyMap.merge_states([h.state_dict() for h in halves])
    assert state_equal(merged, want)
    # a half's own state holds nothing of the other half's slots
    s0 = halves[0].state_dict()
    assert int(s0["slot_admitted"][1::2].sum()) == 0 and s0["owned"].tolist() == [True, False] * 4


def test_a_process_refuses_keys_of_slots_it_does_not_own():
    m = KeyMap(161, slots=4)
    m.owned(np.array([0, 1]))
    k = np.array(keys_of_slot(3, 4, 1), np.int64)
    with pytest.raises(KeyMapError, match="slots \\[3\\].*does not own"):
        m.lookup(k, np.ones(1, np.int64), 0)


@pytest.mark.parametrize("evict", ["lru", "lfu", "ttl"])
@pytest.mark.parametrize("admit_after", [1, 3])
def test_state_dict_round_trip_is_exact(evict, admit_after):
    """A map loaded from a saved state gives exactly what the saving map gives from then on
    (the index, the pool and the watermarks rebuilt from the per-row keys)."""
    rng = np.random.default_rng(5)
    steps = list(stream(rng, 100, population=600, per_step=90))
    kw = {} if admit_after == 1 else {"sketch_width": 64, "sketch_age": 200}  # collisions, halvings
    m = KeyMap(161, slots=4, admit_after=admit_after, evict=evict, **POLICY_KW[evict], **kw)
    for step, (k, c) in enumerate(steps[:50]):
        m.lookup(k, c, step)
    state = m.state_dict()
    assert all(isinstance(v, torch.Tensor) for v in state.values())
    assert state["row_key"].shape == (161,) and state["row_last"].shape == (161,)
    loaded = KeyMap(161, slots=4, admit_after=admit_after, evict=evict, **POLICY_KW[evict], **kw)
    loaded.load_state_dict({name: t.clone() for name, t in state.items()})
    assert state_equal(loaded.state_dict(), state)
    for step, (k, c) in enumerate(steps[50:], 50):
        a, b = m.lookup(k, c, step), loaded.lookup(k, c, step)
        assert np.array_equal(a.rows, b.rows) and np.array_equal(a.fresh, b.fresh), step
        assert (a.evicted, a.admitted) == (b.evicted, b.admitted)
    assert state_equal(m.state_dict(), loaded.state_dict())
    assert m.stats() | {"rebuilds": 0} == loaded.stats() | {"rebuilds": 0}


def test_memory_is_fixed_by_the_arguments():
    """Nothing grows with the keys seen: the arrays' bytes stay what they were when made."""
    m = KeyMap(2001, slots=8, admit_after=2)
    before = m.nbytes()
    assert before < 2001 * 60 + 8 * 4 * 256 * 4 + 4096  # per-row state, index, sketch
    rng = np.random.default_rng(1)
    for step in range(50):
        k = np.unique(rng.integers(0, 1 << 40, 3000)).astype(np.int64)
        m.lookup(k, np.full(len(k), 2, np.int64), step)
    assert m.stats()["evicted"] > 0
    assert m.nbytes() <= before + 8 * 2001  # (the pool of freed rows holds at most all rows)


# -- refusals -------------------------------------------------------------------------------


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"rows": 4, "slots": 4}, "rows=4 leaves 3 rows besides the shared row 0, fewer than slots=4"),
    ({"rows": 100, "evict": "fifo"}, "evict='fifo' is not one of lru, lfu, ttl"),
    ({"rows": 100, "admit_after": 0}, "admit_after must be >= 1, got 0"),
    ({"rows": 100, "evict": "ttl"}, "evict='ttl' needs ttl_steps >= 1"),
    ({"rows": 100, "admit_after": 2, "sketch_width": 100}, "sketch_width must be 0"),
    ({"rows": 100, "slots": 2.5}, "slots must be an integer"),
])
def test_bad_arguments_are_refused_in_one_line(kwargs, message):
    rows = kwargs.pop("rows")
    with pytest.raises(ValueError, match=message) as e:
        KeyMap(rows, **kwargs)
    assert isinstance(e.value, ConfigError) and isinstance(e.value, KeyMapConfigError)
    assert "\n" not in str(e.value) and str(e.value).startswith("KeyMap: ")


def test_bad_lookups_and_states_are_refused():
    m = KeyMap(161, slots=4)
    with pytest.raises(KeyMapError, match="keys must be int64"):
        m.lookup(np.array([1, 2], np.int32), np.ones(2, np.int64), 0)
    with pytest.raises(KeyMapError, match="1-D of one length"):
        m.lookup(np.array([1, 2], np.int64), np.ones(3, np.int64), 0)
    m.lookup(*ids(1), step=5)
    with pytest.raises(KeyMapError, match="step 4 is before the last step seen, 5"):
        m.lookup(*ids(1), step=4)
    with pytest.raises(KeyMapError, match="unique"):
        m.lookup(*ids(9, 9), step=5)
    assert isinstance(KeyMapError("x"), HybridrecError)
    other = KeyMap(161, slots=8)
    with pytest.raises(KeyMapError, match="made with other arguments: slots 4 \\(here 8\\)"):
        other.load_state_dict(m.state_dict())
    state = m.state_dict()
    del state["row_key"]
    with pytest.raises(KeyMapError, match="missing row_key"):
        m.load_state_dict(state)
    state = m.state_dict()
    state["row_last"] = state["row_last"].to(torch.int32)
    with pytest.raises(KeyMapError, match="row_last is int32"):
        m.load_state_dict(state)
    state = m.state_dict()
    key = int(state["row_key"][state["row_key"] >= 0][0])
    lo, hi = m.slot_rows(int(key_slots(np.array([key]), 4)[0]))
    wrong = 1 if lo > 1 else hi  # a row of another slot
    state["row_key"][wrong] = key
    with pytest.raises(KeyMapError, match="outside its slot's range"):
        m.load_state_dict(state)
    a, b = KeyMap(161, slots=4), KeyMap(161, slots=4)
    a.owned(np.array([0, 1]))
    b.owned(np.array([1, 2]))
    with pytest.raises(KeyMapError, match="slot 1 is owned by state 0 and state 1"):
        KeyMap.merge_states([a.state_dict(), b.state_dict()])


def test_map_result_fields():
    r = KeyMap(33, slots=2).lookup(np.zeros(0, np.int64), np.zeros(0, np.int64), 0)
    assert isinstance(r, MapResult) and len(r.rows) == 0 and len(r.fresh) == 0
    assert (r.evicted, r.admitted) == (0, 0)
