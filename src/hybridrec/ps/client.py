"""The trainer's side of the parameter-server mode: pull rows, look them up, push gradients.

:class:`RemoteEmbeddingCollection` stands in for the embedding collection of a DLRM. Its
forward, per table: the batch's distinct ids (``torch.unique``), one pull per server of the
ids it owns, the pulled rows as a small ``[distinct ids, dim]`` autograd leaf, and the bags
pooled from it (``embedding_bag``, sum or mean), in the single-device collection's output
order. After backward, :meth:`pop_sparse_grads` gives the leaf's gradient: exactly one
summed gradient row per distinct id. :class:`PushOptimizer` is the trainer's sparse
optimizer: it pushes those rows to their servers, which apply the configured sparse
optimizer (``optim.sparse``) to them.

Order of a trainer's own updates: a pull first waits for this trainer's previous push, so
a trainer always reads its own updates; other trainers' updates arrive whenever their
pushes do (asynchronous across trainers; the servers' ``dist.ps_max_staleness`` bounds
how far ahead a trainer may run). With one trainer this is exactly one-process training
up to floating-point summation order (the server adds a row's gradient summed over its
occurrences; one process adds the occurrences one by one).

Training threads (``train.workers``, :mod:`hybridrec.train.loop.hogwild`) pull and push on their
own, as the paper's trainers do: lookups, the last push and the versions seen at the pull
are per thread, so a pull waits for its own thread's previous push only (a thread reads its
own updates; its sibling threads' land when they land). A pull's step is the trainer's
pushed steps plus one, so steps of sibling threads in flight share a number: with ``N``
threads a trainer may run up to ``N - 1`` steps further ahead than the bound says.
:meth:`flush_pushes` from the trainer's main thread (checkpoints, the end) waits for every
thread's push.

Counted bytes (ledger categories ``ps_pull`` and ``ps_push``): the tensors handed to RPC
(ids as int64, rows as float32) and the rows received; RPC's own framing is not counted.
Evaluation pulls are outside the training step and not counted.

A stream's dynamic tables (:mod:`hybridrec.train.loop.stream`) give rows to new keys on the
trainers; the rows start again on their servers (:meth:`RemoteEmbeddingCollection.reset_rows`,
the servers' ``reset``): queued by the mapping, sent before the trainer's next pull (after its
own pushes landed) and before a checkpoint. Not counted in the ledger.

Simplification: FM tables (DeepFM's first-order column and square sums) are not served;
``model.arch=deepfm`` with ``dist.num_ps`` is refused by the configuration.
"""

from __future__ import annotations

import re
import threading
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed import rpc

from hybridrec.comm.ledger import CommLedger
from hybridrec.errors import HybridrecError, PeerGone
from hybridrec.model.embedding import KeyedTensor, TableConfig, output_features
from hybridrec.parallel.plan import ShardingPlan
from hybridrec.ps import server as srv
from hybridrec.ps.world import server_name
from hybridrec.sparse.keyed_jagged import KeyedJagged


class ServerError(HybridrecError):
    """A parameter server could not be reached or failed a request."""


class ServerGone(ServerError, PeerGone):
    """A parameter server's connection closed: it exited or was killed (the launcher's line
    names it and how)."""


def wait_reply(fut, what: str, to: str):
    """The value of an RPC future, or a :class:`ServerError` naming the server and the request."""
    try:
        value = fut.wait()
    except RuntimeError as e:
        raise server_error(e, what, to) from e
    if isinstance(value, Exception):  # a failed asynchronous handler's (server.rpc_pull) error comes as its value
        raise server_error(RuntimeError(repr(value)), what, to) from value
    return value


_GONE = re.compile(r"^(eof|end of file)\b|connection (reset|refused|closed|aborted)|broken pipe|"
                   r"pipe closed|econnreset|econnrefused|epipe|process_vm_readv: no such process", re.IGNORECASE)
"""How TensorPipe says that the other end of a connection went away (its transports' words,
e.g. ``eof (this error originated at tensorpipe/transport/shm/connection_impl.cc:259)``
for a server killed while a request was under way or before a new one; its same-machine
channel that reads the server's memory says ``process_vm_readv: No such process``)."""
_TIMEOUT = re.compile(r"ran for more than set timeout|timed? ?out", re.IGNORECASE)
_ORIGIN = re.compile(r"\s*\(this error originated at [^)]*\)")


def server_error(e: BaseException, what: str, to: str) -> ServerError:
    """``e`` (an RPC to the server ``to`` failed) in one line for the user: a server whose
    connection closed went away (it exited or was killed; the launcher's line says how),
    one that did not answer within ``dist.timeout_s`` says so, anything else keeps its
    first line (an error raised on the server: its type and message), without the place in
    TensorPipe's source it came from. The request
    (``what``) is left out where the server went away, so that every trainer that lost it
    says the same line, shown once per machine."""
    lines = str(e).strip().splitlines()
    if len(lines) > 1 and lines[0].startswith("On WorkerInfo("):  # raised on the server: its repr next
        lines = lines[1:]
    first = _ORIGIN.sub("", lines[0]) if lines else type(e).__name__
    if _GONE.search(first):
        return ServerGone(f"parameter server {to} went away: the connection to it closed (the server "
                           "exited or was killed)")
    if _TIMEOUT.search(first):
        return ServerError(f"parameter server {to}: {what}: no answer within dist.timeout_s (the server "
                           "hung, or is far slower)")
    return ServerError(f"parameter server {to}: {what} failed: {first}")


@dataclass
class _Lookup:
    table: str
    ids: torch.Tensor  # distinct global ids, ascending
    rows: torch.Tensor  # [len(ids), dim] pulled rows, an autograd leaf


@dataclass
class _ThreadState:
    """A training thread's part of a trainer's traffic (see the module docstring)."""

    pending: list[_Lookup] = field(default_factory=list)  # lookups not popped yet
    pushes: list = field(default_factory=list)  # (server, future) of its last push
    versions: dict[int, int] = field(default_factory=dict)  # per server: version at its step's pull


class RemoteEmbeddingCollection(nn.Module):
    """Pooled embeddings from tables held by parameter servers (same output as
    :class:`~hybridrec.model.embedding.EmbeddingBagCollection`)."""

    # -- the EmbeddingCollection interface (hybridrec.model.embedding) -------------
    spans_ranks = True
    holds_tables = False  # no table is held here (checkpoints: the servers save them)

    def step_grads(self) -> dict[str, list]:
        return {"ps": self.pop_sparse_grads()}  # (pushed by the "ps" optimizer)

    def updated_collections(self) -> dict:
        return {}

    def local_weights(self) -> dict:
        return {}

    def shard_of(self, local_name: str) -> None:
        return None

    def plan_dict(self) -> None:
        return None  # (the servers' plan is the run's plan.json)

    def __init__(self, tables: list[TableConfig], plan: ShardingPlan, *, trainer: int,
                 num_trainers: int = 1, ledger: CommLedger | None = None, timeout_s: float = 300.0) -> None:
        super().__init__()
        if any(t.fm_cols is not None for t in tables):
            raise ValueError("FM tables are not served by parameter servers (use model.arch=dlrm)")
        self.tables = {t.name: t for t in tables}
        self.plan, self.trainer, self.ledger, self.timeout_s = plan, trainer, ledger, timeout_s
        self.grad_scale = 1.0 / num_trainers  # see push()
        out = output_features(tables)
        self.feature_names = [f for f, _ in out]
        self.feature_dims = [d for _, d in out]
        self._table_of = {f: t for t in tables for f in t.features}
        # Shards of each table by first row: (row starts [k], owning servers [k]).
        self._owners: dict[str, tuple[torch.Tensor, list[int]]] = {}
        for name, tp in plan.tables.items():
            shards = sorted(tp.shards, key=lambda s: s.rows[0])
            self._owners[name] = (torch.tensor([s.rows[0] for s in shards]), [s.rank for s in shards])
        self.pushed_steps = 0  # training steps pushed (the next pull is for the step after)
        # per push: mean of its staleness over the servers it updated (those pulled in its step)
        self.staleness: list[float] = []
        # Per training thread (train.workers; one thread: one entry): its lookups not popped
        # yet, the (server, future) pairs of its last push, and per server the version at its
        # step's pull.
        self._threads: dict[int, _ThreadState] = {}
        self._lock = threading.Lock()  # pushed_steps, from several threads
        self._resets: list[tuple[int, dict]] = []  # rows to start again, not sent yet (reset_rows)
        self._resets_lock = threading.Lock()  # (queued by a stream feed's thread)
        self.rows_reset = 0  # rows this trainer sent to be reset

    @property
    def _mine(self) -> _ThreadState:
        return self._threads.setdefault(threading.get_ident(), _ThreadState())

    # -- pulls ------------------------------------------------------------------
    def _route(self, table: str, ids: torch.Tensor) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
        """``{server: (positions in ids, ids)}`` for ascending ``ids``."""
        starts, owners = self._owners[table]
        shard = torch.bucketize(ids, starts, right=True) - 1
        out = {}
        for k, server in enumerate(owners):
            pos = (shard == k).nonzero().squeeze(1)
            if pos.numel():
                out[server] = (pos, ids.index_select(0, pos))
        return out

    def _pull(self, ids_by_table: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        self.flush_pushes()
        self.send_resets()
        routes = {t: self._route(t, ids) for t, ids in ids_by_table.items()}
        asks: dict[int, dict[str, torch.Tensor]] = {}
        for t, by_server in routes.items():
            for server, (_, ids) in by_server.items():
                asks.setdefault(server, {})[t] = ids
        step = self.pushed_steps + 1 if self.training and torch.is_grad_enabled() else None
        futs = {j: rpc.rpc_async(server_name(j), srv.rpc_pull, args=(self.trainer, step, a),
                                 timeout=self.timeout_s) for j, a in asks.items()}
        got = {j: wait_reply(f, "pull", server_name(j)) for j, f in futs.items()}
        mine = self._mine
        out = {}
        for t, ids in ids_by_table.items():
            rows = torch.empty(ids.numel(), self.tables[t].embedding_dim)
            for server, (pos, _) in routes[t].items():
                rows[pos] = got[server][1][t]
            out[t] = rows
        if step is not None:  # the servers read in this step: its push's staleness counts from them
            mine.versions = {j: v for j, (v, _) in got.items()}
            if self.ledger is not None:
                sent = sum(x.numel() * 8 for a in asks.values() for x in a.values())
                received = sum(r.numel() * 4 for r in out.values())
                self.ledger.record("ps_pull", sent=sent, received=received, direction="fwd")
        return out

    # -- lookup -----------------------------------------------------------------
    def forward(self, kjt: KeyedJagged) -> KeyedTensor:
        parts = kjt.split_by_key()
        missing = [f for f in self.feature_names if f not in parts]
        if missing:
            raise KeyError(f"input has no feature(s) {missing}")
        by_table: dict[str, list[str]] = {}
        for f in self.feature_names:
            by_table.setdefault(self._table_of[f].name, []).append(f)
        unique, inverse = {}, {}
        for t, feats in by_table.items():
            values = torch.cat([parts[f][0] for f in feats])
            unique[t], inverse[t] = torch.unique(values, sorted=True, return_inverse=True)
        device = kjt.values.device
        # The servers are CPU processes and RPC carries host tensors: on a GPU trainer the
        # distinct ids come to the host (a host sync, the pull's round trip waits anyway) and
        # the pulled rows go to the device. (No-ops on a CPU trainer.)
        unique = {t: u.cpu() for t, u in unique.items()}
        rows = {t: r.to(device) for t, r in self._pull(unique).items()}
        all_offsets, b = kjt.offsets(), kjt.batch_size
        key_at = {f: k for k, f in enumerate(kjt.keys)}
        train = self.training and torch.is_grad_enabled()
        blocks = {}
        for t, feats in by_table.items():
            leaf = rows[t].requires_grad_(train)
            if train:
                self._mine.pending.append(_Lookup(t, unique[t], leaf))
            at = 0
            for f in feats:
                n = parts[f][0].numel()
                k = key_at[f]  # this feature's bags in the batch's offsets, counted from 0
                offsets = all_offsets[k * b : (k + 1) * b + 1] - all_offsets[k * b]
                blocks[f] = F.embedding_bag(inverse[t][at : at + n], leaf, offsets,
                                            mode=self.tables[t].pooling, include_last_offset=True)
                at += n
        values = torch.cat([blocks[f] for f in self.feature_names], dim=1)
        return KeyedTensor(self.feature_names, self.feature_dims, values)

    def pop_sparse_grads(self) -> list[tuple[str, torch.Tensor, torch.Tensor]]:
        """``[(table, distinct ids, summed gradient rows)]`` of the calling thread's lookups
        since its last call."""
        mine = self._mine
        out = [(lk.table, lk.ids, lk.rows.grad) for lk in mine.pending if lk.rows.grad is not None]
        mine.pending = []
        return out

    # -- pushes -----------------------------------------------------------------
    def push(self, grads: list[tuple[str, torch.Tensor, torch.Tensor]], lr: float) -> None:
        """Send every server its rows of ``grads`` (every server, every step: the servers
        count each trainer's steps for the staleness bound). Asynchronous: the next pull,
        or :meth:`flush_pushes`, waits for it.

        The rows are scaled by ``1 / trainers``, as DDP averages the dense gradients: in
        lockstep the servers then apply, per step, the gradient of the mean loss over every
        trainer's batch (plain SGD: exactly synchronous training's update, split in one
        push per trainer), and the sparse learning rate means the same as with DES."""
        with self._lock:
            self.pushed_steps += 1
            step = self.pushed_steps
        mine = self._mine
        asks: dict[int, dict] = {j: {} for j in range(self.plan.world_size)}
        for t, ids, rows in grads:
            for server, (pos, sub) in self._route(t, ids).items():
                asks[server][t] = (sub, rows.index_select(0, pos.to(rows.device)).mul_(self.grad_scale).cpu())
        mine.pushes = [(j, rpc.rpc_async(server_name(j), srv.rpc_push,
                                         args=(self.trainer, step, lr, a, mine.versions.get(j)),
                                         timeout=self.timeout_s)) for j, a in asks.items()]
        if self.ledger is not None:
            sent = sum(ids.numel() * 8 + r.numel() * 4 for a in asks.values() for ids, r in a.values())
            self.ledger.record("ps_push", sent=sent, received=0, direction="bwd")

    def flush_pushes(self, *, every_thread: bool = False) -> None:
        """Wait for the calling thread's last push, or with ``every_thread`` for every
        training thread's (and note their staleness)."""
        for state in list(self._threads.values()) if every_thread else [self._mine]:
            pushes, state.pushes = state.pushes, []
            # (None: a push without rows, to a server not pulled in its step: no update)
            stale = [x for x in (wait_reply(f, "push", server_name(j)) for j, f in pushes) if x is not None]
            if stale:
                self.staleness.append(sum(stale) / len(stale))
        if every_thread:  # (no thread trains now) threads that ended leave nothing behind
            self._threads = {k: v for k, v in self._threads.items() if v.pending}

    # -- rows given to new keys (a stream's dynamic tables) ---------------------
    def reset_rows(self, generation: int, tables: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Queue ``tables``' rows (``{table: (global rows, values [n, dim])}``) to start again on
        the servers that hold them (their values, the optimizer's initial per-row state);
        ``generation``: the mapping's (the same on every trainer). Sent before this trainer's
        next pull, after its own pushes landed, or by :meth:`send_resets` (a checkpoint)."""
        with self._resets_lock:
            self._resets.append((generation, tables))

    def send_resets(self) -> None:
        """The queued resets to their servers, in the order they were queued, and wait."""
        with self._resets_lock:
            queued, self._resets = self._resets, []
        if not queued:
            return
        asks: dict[int, list] = {}
        step = self.pushed_steps  # (after this trainer's pushes so far: the lockstep servers wait for the others')
        for generation, tables in queued:
            per: dict[int, dict] = {}
            for t, (rows, values) in tables.items():
                for server, (pos, sub) in self._route(t, rows).items():
                    per.setdefault(server, {})[t] = (sub, values.index_select(0, pos))
            for server, part in per.items():
                asks.setdefault(server, []).append((generation, part))
        futs = [(j, rpc.rpc_async(server_name(j), srv.rpc_reset, args=(self.trainer, step, a),
                                 timeout=self.timeout_s))
                for j, a in asks.items()]
        for j, f in futs:
            wait_reply(f, "reset", server_name(j))
        self.rows_reset += sum(int(r.numel()) for _, tables in queued for r, _ in tables.values())

    def summary(self) -> dict:
        s = self.staleness
        return {"servers": self.plan.world_size, "steps_pushed": self.pushed_steps,
                "staleness_mean": sum(s) / len(s) if s else None, "staleness_max": max(s) if s else None}


class PushOptimizer:
    """The trainer's sparse optimizer in PS mode: pushes the row gradients; the servers
    hold the tables and the optimizer state (``name`` is the servers' optimizer)."""

    def __init__(self, remote: RemoteEmbeddingCollection, *, name: str, lr: float) -> None:
        self.remote, self.name, self.lr = remote, name, lr
        self.step_count = 0

    def step(self, grads: list) -> None:
        self.step_count += 1
        self.remote.push(grads, self.lr)

    def flush(self) -> None:
        """Wait for the pushes in flight, every training thread's, then send the rows queued
        to be reset (before a checkpoint, at the end)."""
        self.remote.flush_pushes(every_thread=True)
        self.remote.send_resets()

    def state_dict(self) -> dict:
        return {"name": self.name, "lr": self.lr, "step": self.step_count, "tables": {}}

    def load_state_dict(self, state: dict) -> None:
        if state.get("name") != self.name:
            raise ValueError(f"optimizer state is for {state.get('name')!r}, not {self.name!r}")
        self.lr, self.step_count = float(state["lr"]), int(state["step"])
        self.remote.pushed_steps = self.step_count
