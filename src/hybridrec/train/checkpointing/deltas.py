"""Incremental saves of a rank's embedding shards (``train.shard_delta_every``), for partial recovery.

A full checkpoint saves every row of every table. Between two of them, each rank saves on
its own cadence (every ``train.shard_delta_every`` steps, no collective) only the rows of its
shards that the optimizer touched since its previous save: their weights and their sparse
optimizer state (a *delta*). When the rank fails, partial recovery rolls its shards back to
the newest checkpoint and then applies its deltas in order, so its shards lose the updates
since its newest delta instead of those since the checkpoint.

``train.shard_delta_rows=hot`` (CPR-MFU): each delta saves only the most frequently
accessed ``train.shard_delta_hot`` of the touched rows (by the number of lookups since
their last save); the others stay pending until they are hot enough or the next full
checkpoint saves them. Smaller, faster deltas; the hot rows, which carry most of the
updates, are saved most often. A row left out holds the values of its own newest save, older
than the delta's: with hot rows each rank keeps the step of every row's newest save
(``saved_at``, int32 per row, like the counts), and each delta's manifest counts its pending rows by that step
and shard (``pending_held``), so a recovery counts what such rows really lost.

Layout: ``RUN/recovery/deltas/rank-R/step-N/`` with ``rows.pt`` (the rows' ids, weights and
optimizer state: a dict of tensors by ``torch.save``, read back with ``torch.load(...,
weights_only=True, mmap=True)``) and ``manifest.json`` (the step, the checkpoint it follows,
the plan, the rows saved and pending), both synced, renamed into place when complete. A
delta is one rank's small, unsharded file: torch.distributed.checkpoint's planning and
metadata cost 4x its reading (81 deltas of ~25k rows x 64: 0.24-0.35 s against 0.07-0.09 s,
or 0.02 s to map them, their bytes read later as they are used), which a rank that rolls back
pays per delta. Deltas of an earlier version (torch.distributed.checkpoint directories) are
still read. The staging (the touched rows copied out) happens between two steps; the
writing runs in a background thread while training goes on, one delta at a time. A full
checkpoint makes the rank's older deltas obsolete: they are deleted and every row counts as
saved.

The counts of lookups are part of a survivor's snapshot, so rows touched since a survivor's
last delta stay pending after a partial recovery. A rank that rolls back reads its deltas in
a thread while the checkpoint is restored (:meth:`ShardDeltas.prefetch`), newest first,
keeping of each only the rows no newer delta has, then writes them over the checkpoint's.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import shutil
import threading
import time
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp

from hybridrec.parallel.checkpoint_io import (
    FORMAT,
    MANIFEST,
    SafeFileSystemReader,
    is_complete,
    quiet,
    write_json,
)
from hybridrec.parallel.sharded_embedding import SHARDS
from hybridrec.threads import single_threaded

DELTA_KIND = "shard-delta"
ROWS = "rows.pt"
OBSOLETE = ".obsolete-"
"""Prefix of the directory a checkpoint's obsolete deltas are moved into to be deleted."""
TMP = ".tmp-step-"
"""Prefix of a delta being written (renamed to ``step-N`` once complete)."""
READ_TIMINGS = 3
"""Reads of :meth:`ShardDeltas.time_next_read`'s delta; the fastest counts."""
_NAME = re.compile(r"^step-(\d{8})$")


def _largest(values: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of ``k`` largest ``values`` (counts: integers >= 0) in ascending order; of the
    values equal to the k-th largest, the first ones. By a histogram of the counts: the
    k-th largest is where the counts from the top reach ``k`` (one pass to count, one to
    pick: 1.1 ms on 160k Zipf counts on a Zen 5, against 3.7 ms for numpy's introselect,
    slowed by the many equal counts, and more for ``topk``)."""
    n = values.numel()
    if k >= n:
        return torch.arange(n, device=values.device)
    if k <= 0:
        return torch.empty(0, dtype=torch.int64, device=values.device)
    top = int(values.max())
    if top > 4 * n:  # (a histogram longer than the counts: a stable sort instead)
        return values.sort(descending=True, stable=True).indices[:k].sort().values
    at_least = torch.bincount(values, minlength=top + 1).flip(0).cumsum(0)  # [j]: counts >= top - j
    kth = top - int(torch.searchsorted(at_least, k))  # the k-th largest count
    above = (values > kth).nonzero().squeeze(1)
    ties = (values == kth).nonzero().squeeze(1)[:k - above.numel()]
    return torch.cat([above, ties]).sort().values


def plan_json(ebc) -> dict | None:
    """A sharded collection's plan as JSON holds it (so a plan read back from a manifest
    compares equal); None for any other collection."""
    plan = ebc.plan_dict()
    return json.loads(json.dumps(plan)) if plan is not None else None


def deltas_dir(recovery_dir: Path, rank: int) -> Path:
    return recovery_dir / "deltas" / f"rank-{rank:05d}"


class ShardDeltas:
    """One rank's incremental saves of its shards (``collection``: its local shards'
    :class:`~hybridrec.model.embedding.EmbeddingBagCollection`; ``optimizer``: their sparse
    optimizer)."""

    def __init__(self, collection, optimizer, *, directory: Path, plan, every: int, rows: str = "touched",
                 hot: float = 0.25) -> None:
        if rows not in ("touched", "hot") or not 0 < hot <= 1:
            raise ValueError(f"rows must be touched or hot and hot in (0, 1], got {rows!r}, {hot}")
        self.collection, self.optimizer = collection, optimizer
        self.dir, self.plan, self.every, self.rows, self.hot = Path(directory), plan, every, rows, hot
        self.counts = [torch.zeros(collection.group_weight(g).shape[0], dtype=torch.int32,
                                   device=collection.group_weight(g).device) for g in range(collection.num_groups)]
        # hot rows: the step of each row's newest save (a checkpoint's or a delta's), what it holds if
        # the rank fails (every touched row saved: a delta's step for all, not kept)
        self.saved_at = [torch.zeros_like(c) for c in self.counts] if rows == "hot" else []
        self.base_step = 0  # the newest full checkpoint's step (what the deltas follow)
        self.last_step: int | None = None  # the newest delta's step
        self._writer: threading.Thread | None = None
        self._cleaner: threading.Thread | None = None  # deleting the deltas a checkpoint made obsolete
        self._error: BaseException | None = None
        self.saved = {"deltas": 0, "rows": 0, "bytes": 0, "stage_seconds": 0.0, "write_seconds": 0.0,
                      "lookups": 0, "lookups_saved": 0}
        self._prefetch: dict | None = None  # deltas read ahead of apply(): see prefetch()
        self._time_read = False  # time_next_read(): the next delta written is read back, timed
        self.read_probe: dict | None = None  # its {"seconds", "rows"}, once measured

    # -- while training -------------------------------------------------------------------
    def track(self, grads: dict) -> None:
        """Count this step's lookups of the shards' rows (the optimizer's row gradients)."""
        for group, ids, _, _ in grads.get(SHARDS, []):
            c = self.counts[group]
            c.index_add_(0, ids, torch.ones(ids.shape[0], dtype=c.dtype, device=c.device))

    def share_per_delta(self, step: int) -> float:
        """The share of the shards' rows one delta saves: measured over the deltas written so
        far, else estimated from the rows pending now (scaled to ``every`` steps)."""
        total = sum(c.numel() for c in self.counts)
        if not total:
            return 1.0
        if self.saved["deltas"]:
            return min(1.0, self.saved["rows"] / self.saved["deltas"] / total)
        covered = step - max(self.base_step, self.last_step or 0)
        pending = sum(int(c.count_nonzero()) for c in self.counts)
        if self.rows == "hot":
            pending = math.ceil(self.hot * pending)
        return min(1.0, pending / total * self.every / covered) if covered > 0 else 1.0

    def update_share(self) -> float:
        """The share of the updates (lookups counted) a delta saves: 1 for every touched row;
        with hot rows, measured over the deltas written so far (the lookups of the rows saved
        over those of every row pending then), else estimated from the counts now. What the
        interval prices a hot-row delta's coverage at (:func:`~hybridrec.train.checkpointing.checkpoint_interval.
        partial_recovery_interval`'s ``delta_update_share``)."""
        if self.rows != "hot":
            return 1.0
        if self.saved["lookups"]:
            return max(1e-6, self.saved["lookups_saved"] / self.saved["lookups"])
        total = hot = 0
        for c in self.counts:
            touched = c[c > 0]
            if touched.numel():
                k = max(1, math.ceil(self.hot * touched.numel()))
                total += int(touched.sum())
                hot += int(touched.topk(k).values.sum())
        return max(1e-6, hot / total) if total else self.hot

    def _table_starts(self, g: int) -> tuple[list[str], torch.Tensor]:
        """The local tables (shards) fused in group ``g``, by first row, and their first rows."""
        found = sorted((self.collection.table_slice(n)[1], n) for n in self.collection.tables
                       if self.collection.table_slice(n)[0] == g)
        return [n for _, n in found], torch.tensor([r for r, _ in found], dtype=torch.int64)

    def _held(self, g: int, ids: torch.Tensor, out: dict[str, dict[str, int]]) -> None:
        """Count rows ``ids`` of group ``g`` (left out of a delta) into ``out[table][step]``
        by the step of their newest save."""
        if not ids.numel():
            return
        names, starts = self._table_starts(g)
        table = torch.bucketize(ids.cpu(), starts, right=True) - 1
        key = table * (1 << 32) + self.saved_at[g].index_select(0, ids).cpu().to(torch.int64)
        uniq, n = key.unique(return_counts=True)
        for k, c in zip(uniq.tolist(), n.tolist(), strict=True):
            held = out.setdefault(names[k >> 32], {})
            step = str(k & 0xFFFFFFFF)
            held[step] = held.get(step, 0) + c

    def checkpointed(self, step: int) -> None:
        """A full checkpoint of ``step`` is on disk: every row is saved; older deltas go. They
        are renamed into ``.obsolete-*`` at once (no longer deltas: :meth:`list` skips them)
        and deleted by a thread while training goes on (hundreds of them took 0.3-0.7 s to
        delete, within the save); :meth:`wait` joins it, and :meth:`resumed` deletes any left
        by a process that ended first."""
        self.wait()
        for c in self.counts:
            c.zero_()
        for a in self.saved_at:
            a.fill_(step)
        self.base_step, self.last_step = step, None
        old = [p for s, p in self.list() if s <= step]
        if not old:
            return
        trash = self.dir / f"{OBSOLETE}{step:08d}-{os.getpid()}"
        try:
            trash.mkdir()
            for p in old:
                os.replace(p, trash / p.name)
        except OSError:  # (cannot move them: deleted here and now)
            for p in [*old, trash]:
                shutil.rmtree(p, ignore_errors=True)
            return
        self._cleaner = threading.Thread(target=shutil.rmtree, args=(trash,), kwargs={"ignore_errors": True},
                                         daemon=True, name="hybridrec-delta-cleanup")
        self._cleaner.start()

    def time_next_read(self) -> None:
        """Read back the next delta that saves rows once it is written, in its writing thread,
        as :meth:`prefetch` reads one (the file mapped, its tensors copied out; the best of
        :data:`READ_TIMINGS`), into ``read_probe``:
        ``{"seconds", "rows"}`` (what ``train.checkpoint_every=auto`` prices a replay at)."""
        self._time_read, self.read_probe = True, None

    def replay_seconds(self) -> float | None:
        """The measured read-back (:meth:`time_next_read`) scaled to the mean delta's rows:
        what replaying one delta costs; None until that read is measured."""
        measured = self.read_probe
        if measured is None or measured["rows"] <= 0 or not self.saved["deltas"]:
            return None
        mean_rows = self.saved["rows"] / self.saved["deltas"]
        return max(measured["seconds"] * mean_rows / measured["rows"], 1e-6)

    def save(self, step: int) -> None:
        """Stage the pending rows of ``step`` (copies, now) and write them in the background."""
        self.wait()
        start = time.perf_counter()
        tensors: dict[str, torch.Tensor] = {}
        saved = pending = 0
        held: dict[str, dict[str, int]] = {}  # the rows left pending: {shard: {step of their newest save: rows}}
        for g, c in enumerate(self.counts):
            touched = c.nonzero().squeeze(1)
            n = touched.numel()
            if self.rows == "hot" and n:
                k = max(1, math.ceil(self.hot * n))
                looked = c.index_select(0, touched)
                pick = _largest(looked, k)  # (ascending, as touched)
                left = torch.ones(n, dtype=torch.bool, device=touched.device)
                left[pick] = False
                self._held(g, touched[left], held)
                self.saved["lookups"] += int(looked.sum())
                self.saved["lookups_saved"] += int(looked.index_select(0, pick).sum())
                touched = touched[pick]
            pending += n - touched.numel()
            saved += touched.numel()
            if not touched.numel():
                continue
            tensors[f"g{g}.ids"] = touched.cpu()
            tensors[f"g{g}.weight"] = self.collection.group_weight(g).index_select(0, touched).cpu()
            for k, v in self.optimizer.row_state(g).items():
                tensors[f"g{g}.state.{k}"] = v.index_select(0, touched).cpu()
            c.index_fill_(0, touched, 0)
            if self.saved_at:
                self.saved_at[g].index_fill_(0, touched, step)
        meta = {"format": FORMAT, "kind": DELTA_KIND, "step": step, "base_step": self.base_step, "plan": self.plan,
                "rows": saved, "pending_rows": pending, "pending_held": held, "mode": self.rows,
                "groups": sorted(int(k[1:].split(".")[0]) for k in tensors if k.endswith(".ids"))}
        self.saved["stage_seconds"] += time.perf_counter() - start
        self.saved["deltas"] += 1
        self.saved["rows"] += saved
        self.saved["bytes"] += sum(t.numel() * t.element_size() for t in tensors.values())
        self.last_step = step
        timed = self._time_read and saved > 0
        self._time_read = self._time_read and not timed
        self._writer = threading.Thread(target=self._write, args=(step, tensors, meta, timed), daemon=True,
                                        name="hybridrec-delta")
        self._writer.start()

    def _write(self, step: int, tensors: dict, meta: dict, timed: bool = False) -> None:
        single_threaded()  # (beside the training step: hybridrec.threads)
        start = time.perf_counter()
        try:
            final = self.dir / f"step-{step:08d}"
            tmp = self.dir / f"{TMP}{step:08d}-{os.getpid()}"
            tmp.mkdir(parents=True, exist_ok=True)
            # (nothing touched: an empty delta still says the rows are saved up to this step)
            with open(tmp / ROWS, "wb") as f:
                torch.save(tensors, f)
                f.flush()
                os.fsync(f.fileno())
            write_json(tmp / MANIFEST, meta)
            shutil.rmtree(final, ignore_errors=True)
            os.replace(tmp, final)
        except BaseException as e:  # noqa: BLE001 - raised at the next wait(), in the training thread
            self._error = e
        self.saved["write_seconds"] += time.perf_counter() - start
        if timed and self._error is None:
            with contextlib.suppress(Exception):  # (a read that fails: no measurement, the next delta's)
                seconds = []
                for _ in range(READ_TIMINGS):
                    begin = time.perf_counter()
                    for v in self._read(final).values():  # (mapped: copied out, as a replay does)
                        v.clone()
                    seconds.append(time.perf_counter() - begin)
                self.read_probe = {"seconds": min(seconds), "rows": int(meta["rows"])}
            if self.read_probe is None:
                self._time_read = True

    def wait(self) -> None:
        """The delta being written is on disk (its error, if any, raised here), and the
        obsolete ones are deleted."""
        if self._cleaner is not None:
            self._cleaner.join()
            self._cleaner = None
        if self._writer is not None:
            self._writer.join()
            self._writer = None
        if self._error is not None:
            e, self._error = self._error, None
            raise OSError(f"{self.dir}: writing an incremental save of the shards failed: {e}") from e

    # -- snapshot and recovery ---------------------------------------------------------------
    def state_dict(self) -> dict:
        """What a survivor's snapshot keeps: the lookups since each row's last save, and the
        step of that save."""
        return {"counts": [c.clone() for c in self.counts], "saved_at": [a.clone() for a in self.saved_at],
                "base_step": self.base_step, "last_step": self.last_step}

    def load_state_dict(self, state: dict) -> None:
        for c, saved in zip(self.counts, state["counts"], strict=True):
            c.copy_(saved)
        self.base_step, self.last_step = int(state["base_step"]), state["last_step"]
        kept = state.get("saved_at") or []
        for a, saved in zip(self.saved_at, kept if len(kept) == len(self.saved_at) else [None] * len(self.saved_at),
                            strict=True):
            if saved is None:  # (an earlier version's snapshot: none kept)
                a.fill_(self.base_step)
            else:
                a.copy_(saved)

    def resumed(self, *, checkpoint_step: int, step: int) -> None:
        """Training resumes at ``step`` from the checkpoint of ``checkpoint_step``: deltas
        after ``step`` or of another checkpoint belong to a trajectory this run left. No row
        holds values older than the checkpoint. A delta a killed process was still writing
        (its ``.tmp-step-*`` directory: never renamed into place, so never listed or applied)
        is deleted."""
        self.base_step = checkpoint_step
        for a in self.saved_at:
            a.clamp_(min=checkpoint_step)
        if self.dir.is_dir():  # (left by a process that ended while deleting or writing them)
            for p in [*self.dir.glob(f"{OBSOLETE}*"), *self.dir.glob(f"{TMP}*")]:
                shutil.rmtree(p, ignore_errors=True)
        for s, p in self.list():
            if s > step or s <= checkpoint_step:
                shutil.rmtree(p, ignore_errors=True)
                continue
            try:
                base = json.loads((p / MANIFEST).read_text()).get("base_step")
            except (OSError, ValueError):
                base = None
            if base != checkpoint_step:
                shutil.rmtree(p, ignore_errors=True)

    def list(self) -> list[tuple[int, Path]]:
        """This rank's complete deltas, oldest first."""
        if not self.dir.is_dir():
            return []
        found = [(int(m.group(1)), p) for p in self.dir.iterdir()
                 if (m := _NAME.match(p.name)) and ((p / ROWS).is_file() and (p / MANIFEST).is_file() or is_complete(p))]
        return sorted(found)

    def _usable(self, checkpoint_step: int, until: int | None) -> list[tuple[int, Path, dict]]:
        """This rank's deltas that follow the checkpoint of ``checkpoint_step`` (up to step
        ``until``; None: any), of this plan, oldest first, with their manifests."""
        out = []
        for step, path in self.list():
            if step <= checkpoint_step or (until is not None and step > until):
                continue
            meta = json.loads((path / MANIFEST).read_text())
            if (meta.get("kind"), meta.get("base_step"), meta.get("plan")) == (DELTA_KIND, checkpoint_step, self.plan):
                out.append((step, path, meta))
        return out

    @staticmethod
    def _read(path: Path) -> dict[str, torch.Tensor]:
        if (path / ROWS).is_file():
            return torch.load(path / ROWS, map_location="cpu", weights_only=True, mmap=True)
        targets: dict[str, torch.Tensor] = {}  # an earlier version's: a DCP directory
        md = SafeFileSystemReader(path).read_metadata().state_dict_metadata
        for k, m in md.items():
            if k != "empty":
                targets[k] = torch.empty(tuple(m.size), dtype=m.properties.dtype)
        if targets:
            with quiet():
                dcp.load(targets, storage_reader=SafeFileSystemReader(path), no_dist=True)
        return targets

    def prefetch(self, checkpoint_step: int) -> None:
        """A rank about to roll back to the checkpoint of ``checkpoint_step``: read its deltas
        that follow it in a thread, while the checkpoint is restored, newest first, keeping of
        each only the rows no newer delta has (what :meth:`apply` would leave of it). At
        most the rows touched since the checkpoint are held."""
        box: dict = {"checkpoint_step": checkpoint_step, "error": None, "deltas": [], "rows": {}}

        def read() -> None:
            try:
                seen: dict[int, torch.Tensor] = {}
                for step, path, meta in reversed(self._usable(checkpoint_step, None)):
                    t = self._read(path)
                    for g in meta["groups"]:
                        ids = t[f"g{g}.ids"]
                        mask = seen.setdefault(g, torch.zeros(self.counts[g].shape[0], dtype=torch.bool))
                        keep = ~mask[ids]
                        mask[ids] = True
                        rows = {"step": step, "ids": ids[keep], "weight": t[f"g{g}.weight"][keep],
                                **{f"state.{k}": t[f"g{g}.state.{k}"][keep] for k in self.optimizer.row_state(g)}}
                        box["rows"].setdefault(g, []).append(rows)
                    box["deltas"].append((step, int(meta["pending_rows"]), meta.get("pending_held") or {}))
            except BaseException as e:  # noqa: BLE001 - apply() reads them again itself
                box["error"] = e

        box["thread"] = threading.Thread(target=read, name="hybridrec-delta-read", daemon=True)
        box["thread"].start()
        self._prefetch = box

    def _write_rows(self, g: int, rows: dict[str, torch.Tensor], prefix: str) -> None:
        """Write saved rows of group ``g`` over the live ones: ``rows[prefix + "ids"]``,
        ``... + "weight"`` and ``... + "state.<name>"`` for the optimizer's row state."""
        w = self.collection.group_weight(g)
        ids = rows[prefix + "ids"].to(w.device)
        with torch.no_grad():
            w.index_copy_(0, ids, rows[prefix + "weight"].to(w.device))
            for k, v in self.optimizer.row_state(g).items():
                v.index_copy_(0, ids.to(v.device), rows[f"{prefix}state.{k}"].to(v.device))

    def apply(self, checkpoint_step: int, until: int) -> tuple[int | None, int, dict[str, dict[str, int]]]:
        """After the checkpoint of ``checkpoint_step`` was loaded: apply this rank's deltas
        that follow it, up to step ``until``, oldest first (those :meth:`prefetch` read, when
        they are these). Returns ``(the newest applied delta's step or None, rows of it that
        were still pending, those rows by shard and the step of their newest save: {shard:
        {step: rows}})``: the rows a delta left out hold older values than its step. A
        delta of another plan or checkpoint is not applied."""
        box, self._prefetch = self._prefetch, None
        for a in self.saved_at:
            a.fill_(checkpoint_step)
        if box is not None:
            box["thread"].join()
            steps = [d[0] for d in box["deltas"]]
            if (box["error"] is None and box["checkpoint_step"] == checkpoint_step
                    and sorted(steps) == [s for s, _, _ in self._usable(checkpoint_step, until)]):
                for g, parts in box["rows"].items():
                    for rows in parts:
                        self._write_rows(g, rows, "")
                        if self.saved_at:
                            self.saved_at[g].index_fill_(0, rows["ids"].to(self.saved_at[g].device), rows["step"])
                newest, pending, held = box["deltas"][0] if box["deltas"] else (None, 0, {})
                self.base_step, self.last_step = checkpoint_step, newest
                return newest, pending, held
        newest, pending, held = None, 0, {}
        for step, path, meta in self._usable(checkpoint_step, until):
            targets = self._read(path)
            for g in meta["groups"]:
                self._write_rows(g, targets, f"g{g}.")
                if self.saved_at:
                    self.saved_at[g].index_fill_(0, targets[f"g{g}.ids"].to(self.saved_at[g].device), step)
            newest, pending, held = step, int(meta["pending_rows"]), meta.get("pending_held") or {}
        self.base_step, self.last_step = checkpoint_step, newest
        return newest, pending, held
