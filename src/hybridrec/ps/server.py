"""A parameter server: holds embedding shards, answers pulls, applies pushes.

Each server process holds its shards of every table as a
:class:`~hybridrec.parallel.sharded_embedding.ShardedEmbeddingBagCollection` over the
servers' process group (the same storage, initial values and sharded checkpoints as DES
ranks; it never runs a forward), and one of the project's sparse optimizers over them.

- ``pull(trainer, step, ids)``: the rows of global ids per table, and the server's version
  (updates applied so far). With a staleness bound ``B`` a pull for step ``s`` waits until
  every trainer has pushed step ``s - 1 - B`` (unbounded (``B < 0``): never waits). Over
  RPC the wait holds no thread (``pull_later``: a future that the push which lets the pull
  through completes, ``rpc.functions.async_execution``): with blocking handlers, pulls held
  back by the bound filled the RPC agent's worker threads (16 by default) once 17 trainers
  or more waited, and the push that would release them found no thread to run on.
- ``push(trainer, step, lr, grads, pulled_version)``: row gradients per table. ``B != 0``:
  applied at once under a lock (asynchronous across trainers: pushes apply in arrival
  order); returns the staleness of the update, the other trainers' updates applied
  between its pull and its push. ``B = 0`` (synchronous): a step's pushes wait in a buffer
  until every trainer has pushed that step, then their sum is applied as one update (the
  update of one process with the global batch, for every optimizer, row-wise Adagrad and
  lazy Adam included); staleness 0. A push without rows (the trainer read nothing from
  this server in that step: ``pulled_version`` None) is no update: it counts the trainer's
  step for the bound, changes no version and has no staleness (None).
- ``reset(trainer, step, resets)``: rows that a stream's dynamic tables gave to new keys start again:
  the values the trainers send (the key's initial values) and the optimizer's initial per-row
  state, applied under the lock in order with pushes and pulls. Every trainer sends every
  reset (the trainers map the same keys) before its next pull, after its own pushes landed;
  the first to arrive applies it, the others only count it (so a trainer that already trained
  on the row does not see its update wiped), and it is forgotten once every trainer sent it.
  In lockstep a reset waits until every trainer pushed the step its sender had pushed.
- ``save(path)`` / ``load(path)``: a sharded checkpoint of the servers (DCP, collective
  over the servers, the checkpoint module's format).

RPC calls these through module functions (RPC runs functions by their import path), on the
one :class:`EmbeddingServer` of the process.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from torch.distributed import rpc

from hybridrec.model.embedding import TableConfig
from hybridrec.model.id_groups import aggregate_rows
from hybridrec.parallel.checkpoint import load_state, save_sharded
from hybridrec.parallel.plan import ShardingPlan
from hybridrec.parallel.sharded_embedding import ShardedEmbeddingBagCollection
from hybridrec.parallel.topology import Topology


class _Tables(nn.Module):
    """The servers' shards as a model with only ``sparse`` (checkpoint keys
    ``model.sparse.tables.<t>.weight``, like a trainer's model)."""

    def __init__(self, sparse: ShardedEmbeddingBagCollection) -> None:
        super().__init__()
        self.sparse = sparse


@dataclass
class _Held:
    """A pull the staleness bound holds back until every trainer has pushed ``need``."""

    need: int
    ids: dict
    fut: torch.futures.Future
    deadline: float  # monotonic seconds


class EmbeddingServer:
    def __init__(self, tables: list[TableConfig], plan: ShardingPlan, topo: Topology, *, optimizer,
                 num_trainers: int, max_staleness: int = -1, timeout_s: float = 300.0, seed: int = 0) -> None:
        """``optimizer(collection)``: the sparse optimizer over the shards (a
        ``CombinedSparseOptimizer``, e.g. ``train.sparse_optim.combined_sparse_optimizer``)."""
        self.topo, self.num_trainers = topo, num_trainers
        self.max_staleness, self.timeout_s = max_staleness, timeout_s
        self.model = _Tables(ShardedEmbeddingBagCollection(tables, plan, topo, seed=seed))
        self.opt = optimizer(self.model.sparse)
        self._shards: dict[str, tuple[int, int, int]] = {}  # table -> (group, fused start, first row)
        local = self.model.sparse.local
        for name, (shard, _) in self.model.sparse.local_shards().items():
            group, start, _ = local.table_slice(name)
            self._shards[name.partition("@")[0]] = (group, start, shard.rows[0])
        self._cond = threading.Condition()
        self.version = 0  # updates applied
        self.pushed = [0] * num_trainers  # steps each trainer has pushed
        self._waiting: dict[int, list[dict]] = {}  # synchronous: step -> the pushes so far
        self._waiting_pulls: list[_Held] = []  # pulls held back by the staleness bound
        self._expiry: threading.Thread | None = None  # fails held pulls at their deadline
        self.on_step: Callable[[int], None] | None = None  # called with min(pushed) when a push raised it
        self._resets: dict[int, int] = {}  # a reset's generation -> the trainers that sent it
        self._deferred: list[tuple[int, dict]] = []  # resets not applied yet: (step, rows by table)

    def _rows(self, table: str, ids: torch.Tensor) -> tuple[int, torch.Tensor]:
        try:
            group, start, first = self._shards[table]
        except KeyError:
            raise ValueError(f"server {self.topo.rank} holds no rows of table {table!r}") from None
        return group, ids - first + start

    def pull(self, trainer: int, step: int | None, ids: dict[str, torch.Tensor]) -> tuple[int, dict]:
        """The rows (waiting in the calling thread, if the bound says so)."""
        return self.pull_later(trainer, step, ids).wait()

    def pull_later(self, trainer: int, step: int | None, ids: dict[str, torch.Tensor]) -> torch.futures.Future:
        """:meth:`pull` as a future, completed at once if the staleness bound lets the pull
        through, else by the push that does (or failed with ``TimeoutError`` after
        ``timeout_s``); nothing waits meanwhile."""
        fut = torch.futures.Future()
        with self._cond:
            need = step - 1 - self.max_staleness if step is not None and self.max_staleness >= 0 else None
            if need is None or min(self.pushed) >= need:
                _complete(fut, self._answer(ids))
                return fut
            self._waiting_pulls.append(_Held(need, ids, fut, time.monotonic() + self.timeout_s))
            self._cond.notify_all()  # (the expiry thread: a new deadline)
            self._start_expiry()
        return fut

    def _answer(self, ids: dict[str, torch.Tensor]) -> tuple[int, dict] | Exception:
        """The pull's reply, or its error (set on the future: an asynchronous RPC function
        that raises leaves its caller without a reply)."""
        try:
            return self._read(ids)
        except Exception as e:  # noqa: BLE001 - the trainer's error (one line, client.server_error)
            return e

    def _read(self, ids: dict[str, torch.Tensor]) -> tuple[int, dict]:
        out = {}
        for table, gids in ids.items():
            group, rows = self._rows(table, gids)
            out[table] = self.model.sparse.local.group_weight(group).index_select(0, rows)
        return self.version, out

    def _release(self) -> list:
        """Under the lock: the held pulls the pushes now let through, with their rows
        (completed by the caller once it let go of the lock)."""
        ready = [h for h in self._waiting_pulls if min(self.pushed) >= h.need]
        self._waiting_pulls = [h for h in self._waiting_pulls if min(self.pushed) < h.need]
        return [(h.fut, self._answer(h.ids)) for h in ready]

    def _start_expiry(self) -> None:
        """Under the lock: one thread per server fails held pulls past their deadline."""
        if self._expiry is None:
            self._expiry = threading.Thread(target=self._expire, name="hybridrec-ps-expiry", daemon=True)
            self._expiry.start()

    def _expire(self) -> None:
        while True:
            with self._cond:
                now = time.monotonic()
                late = [h for h in self._waiting_pulls if h.deadline <= now]
                self._waiting_pulls = [h for h in self._waiting_pulls if h.deadline > now]
                errors = [(h.fut, self._late(h.need)) for h in late]
                if not errors:
                    nxt = min((h.deadline for h in self._waiting_pulls), default=None)
                    self._cond.wait(None if nxt is None else max(0.0, nxt - now))
            for fut, e in errors:
                fut.set_exception(e)

    def _late(self, step: int) -> TimeoutError:
        late = [i for i, s in enumerate(self.pushed) if s < step]
        return TimeoutError(f"staleness bound: trainer(s) {late} did not push step {step} within "
                            f"dist.timeout_s={self.timeout_s:g}")

    def push(self, trainer: int, step: int, lr: float, grads: dict, pulled_version: int | None) -> int | None:
        with self._cond:
            rows = any(ids.numel() for ids, _ in grads.values()) and pulled_version is not None
            if self.max_staleness == 0 and self.num_trainers > 1:
                waiting = self._waiting.setdefault(step, [])
                waiting.append(grads)
                if len(waiting) == self.num_trainers:  # the step's last push: one update
                    self._apply(lr, _summed(self._waiting.pop(step)))
                staleness = 0 if rows else None
            else:
                staleness = self.version - pulled_version if rows else None
                self._apply(lr, grads)
            before = min(self.pushed)
            self.pushed[trainer] = max(self.pushed[trainer], step)
            done = min(self.pushed)
            self._apply_resets()  # (before the pulls this push lets through)
            released = self._release()
            self._cond.notify_all()
        if self.on_step is not None and done > before:  # (e.g. a failure injected at that step)
            self.on_step(done)
        for fut, value in released:
            _complete(fut, value)
        return staleness

    def _apply(self, lr: float, grads: dict) -> None:
        """One update, unless no rows (no version either)."""
        if not any(ids.numel() for ids, _ in grads.values()):
            return
        rows = [(g, fused, r, True) for table, (ids, r) in grads.items() for g, fused in [self._rows(table, ids)]]
        self.opt.lr = lr
        self.opt.step({"shards": rows})
        self.version += 1

    def reset(self, trainer: int, step: int, resets: list) -> None:
        """``resets``: ``[(generation, {table: (global ids, values [n, dim]))}]`` in the order
        the trainer mapped them, sent after it pushed ``step``; each generation applied by the
        first trainer that sends it (see the module's docstring). In lockstep (``B = 0``) a
        step's pushes wait for one another: the resets then wait for every trainer's push of
        ``step`` too (applied by the push that completes it, before the pulls it lets through),
        so that no update of a row's previous key lands after its reset."""
        with self._cond:
            for generation, tables in resets:
                seen = self._resets.get(generation, 0) + 1
                if seen == 1:
                    self._deferred.append((step, tables))
                if seen >= self.num_trainers:
                    self._resets.pop(generation, None)
                else:
                    self._resets[generation] = seen
            self._apply_resets()

    def _apply_resets(self) -> None:
        """Under the lock: the queued resets whose step every trainer's update has reached."""
        buffered = self.max_staleness == 0 and self.num_trainers > 1
        while self._deferred and (not buffered or min(self.pushed) >= self._deferred[0][0]):
            self._reset_rows(self._deferred.pop(0)[1])

    def _reset_rows(self, tables: dict) -> None:
        opt = self.opt.optimizers.get("shards")  # (the shards' optimizer: _apply's)
        with torch.no_grad():
            for table, (ids, values) in tables.items():
                group, rows = self._rows(table, ids)
                weight = self.model.sparse.local.group_weight(group)
                weight[rows] = values.to(weight.dtype)
                if opt is not None:
                    initial = float(getattr(opt, "initial_accumulator", 0.0))
                    for key, state in opt.row_state(group).items():
                        state[rows] = initial if key == "sum" else 0

    @property
    def lock(self) -> threading.Condition:
        """Held while the shards change (a push's update, a load): held, the state is whole."""
        return self._cond

    def state(self) -> dict:
        """The whole state (take :attr:`lock` first): the shards' weights by local name,
        the sparse optimizer's state, the version and every trainer's pushed step."""
        return {"weights": {k: w.detach() for k, w in self.model.sparse.local_weights().items()},
                "sparse_opt": self.opt.state_dict(), "version": self.version, "pushed": list(self.pushed)}

    def load_own(self, state: dict) -> None:
        """:meth:`state`'s weights, optimizer state and version back (a recovery snapshot of
        this server's own; the pushed steps are set by :meth:`restart_at`)."""
        with self._cond:
            live = self.model.sparse.local_weights()
            with torch.no_grad():
                for k, v in state["weights"].items():
                    if v is not live[k]:
                        live[k].copy_(v)
            self.opt.load_state_dict(state["sparse_opt"])
            self.version = int(state["version"])

    def clock(self) -> list[tuple[float, int]]:
        """Each sparse optimizer's learning rate and step count (equal on every server: their
        sharded checkpoint checks it)."""
        return [(o.lr, o.step_count) for o in self.opt]

    def set_clock(self, clock: list[tuple[float, int]]) -> None:
        """Another server's :meth:`clock` (a recovery: a server rolled back to the checkpoint
        takes a survivor's, so that Adam's bias correction and the next checkpoint agree)."""
        with self._cond:
            for o, (lr, step) in zip(self.opt, clock, strict=True):
                o.lr, o.step_count = float(lr), int(step)

    def restart_at(self, step: int) -> None:
        """The trainers go on from ``step`` (a recovery): every trainer has pushed it, and
        the pushes of later steps held for a synchronous update are dropped (the trainers
        train those steps again)."""
        with self._cond:
            self.pushed = [step] * self.num_trainers
            self._waiting.clear()
            self._resets.clear()  # (the trainers map those steps' keys again from their checkpoint)
            self._deferred.clear()

    def save(self, path: str, extra: dict) -> None:
        with self._cond:
            save_sharded(Path(path), model=self.model, dense_opt=None, sparse_opts=list(self.opt),
                         extra={**extra, "version": self.version, "pushed": list(self.pushed)}, topo=self.topo)

    def load(self, path: str) -> dict:
        with self._cond:
            extra = load_state(Path(path), model=self.model, dense_opt=None, sparse_opts=list(self.opt),
                               topo=self.topo).extra
            self.version, self.pushed = int(extra["version"]), [int(s) for s in extra["pushed"]]
            self._resets.clear()  # (the trainers' key maps are the checkpoint's: they reset from there)
            self._deferred.clear()
            released = self._release()
            self._cond.notify_all()
        for fut, value in released:
            _complete(fut, value)
        return extra


def _complete(fut: torch.futures.Future, value) -> None:
    """Complete ``fut`` with ``value``, or fail it with ``value`` if an exception."""
    if isinstance(value, Exception):
        fut.set_exception(value)
    else:
        fut.set_result(value)


def _summed(pushes: list[dict]) -> dict:
    """Several pushes' ``{table: (ids, rows)}`` as one, each id's rows added up in push order."""
    out = {}
    for table in sorted({t for p in pushes for t in p}):
        parts = [p[table] for p in pushes if table in p]
        out[table] = parts[0] if len(parts) == 1 else aggregate_rows(
            torch.cat([i for i, _ in parts]), torch.cat([r for _, r in parts]))
    return out


_SERVER: EmbeddingServer | None = None


def serve(server: EmbeddingServer) -> None:
    """Make ``server`` the one the RPC functions below reach in this process."""
    global _SERVER
    _SERVER = server


def _server() -> EmbeddingServer:
    if _SERVER is None:
        raise RuntimeError("this process serves no embedding shards")
    return _SERVER


@rpc.functions.async_execution
def rpc_pull(trainer: int, step: int | None, ids: dict) -> torch.futures.Future:
    """Returns at once: the reply goes when the future is completed (no thread waits)."""
    return _server().pull_later(trainer, step, ids)


def rpc_push(trainer: int, step: int, lr: float, grads: dict, pulled_version: int | None) -> int | None:
    return _server().push(trainer, step, lr, grads, pulled_version)


def rpc_reset(trainer: int, step: int, resets: list) -> None:
    _server().reset(trainer, step, resets)


def rpc_save(path: str, extra: dict) -> None:
    _server().save(path, extra)


def rpc_load(path: str) -> dict:
    return _server().load(path)


def rpc_set_clock(clock: list) -> None:
    _server().set_clock(clock)
