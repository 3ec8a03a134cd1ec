"""Runners: when a synchronizer's rounds happen, and how their targets are written back.

- :class:`ForegroundRunner`: a round every ``every`` training steps, inside the loop (the
  A/B counterpart of the background runner: synchronization on the critical path).
- :class:`BackgroundRunner`: ShadowSync's shadow thread: rounds while training runs, on a
  process group of its own (so its all-reduces never interleave with the step's
  all-to-alls). Before every round the ranks all-reduce a stop flag, so every rank runs the
  same number of rounds and all leave together when one asks to stop.

Throttle (background only). Back to back, the rounds' all-reduces fill a link that the
step's all-to-alls need, and every step slows down to the pace of the rounds
(docs/benchmarks.md). Before each round the shadow thread waits (in the thread, woken at once
by :meth:`BackgroundRunner.stop`) until all of these hold:

- ``every``: at least that many training steps since the previous round started;
- ``interval_s``: at least that many seconds since the previous round started;
- ``duty``: the thread spends at most that share of the time in rounds: after a round that
  took ``T`` seconds (stop flag + all-reduce + the synchronizer's arithmetic) it rests
  ``T (1/duty - 1)``. Unlike the other two this adapts to the link and to the model: a round
  that takes long (a slow link, a large dense part, a link shared with the all-to-alls) is
  followed by a long rest, a quick one by a short rest.

``every=1, interval_s=0, duty=1`` runs the rounds back to back. Each rank waits on its own
clock and steps; the stop-flag all-reduce after the wait lines the ranks up again, so they
still run the same rounds.

Write-back while training goes on (background only; in the foreground nothing trains during
a round and the target is copied): the training thread applies a round's target at its next
step boundary (autograd forbids in-place writes between a step's forward and backward).
``delta`` (the default) adds ``target - snapshot``, keeping the steps the replica trained
since the snapshot; ``overwrite`` sets the parameters to ``target``, dropping them.
ShadowSync's paper has the shadow thread *copy* the synchronized model into the trainer's
replica (overwrite); the delta form is the elastic-averaging reading that loses no local
progress, chosen as the default (measured against overwrite in docs/benchmarks.md). The
snapshot is read without a lock while the optimizer writes (Hogwild style, as in the paper):
it may mix two steps' values of a parameter.

Checkpoints (:meth:`SyncRunner.parked`, :class:`RankReplica`). Between rounds the ranks'
replicas differ, and so do their dense optimizers' state, a compressed mean's residuals and,
in the background, the target of a round not yet written back. A checkpoint therefore holds,
besides the synchronizer's state (identical on every rank: global), each rank's own: its
replica, its dense optimizer state, the runner's counters (rounds, sync gaps, the step the
last round started at, which the throttle's ``every`` counts from) and a pending target with
its snapshot. All of it is one capture, taken under the synchronizer's lock: a round in
flight finishes first, and its state and its target are both in the checkpoint or neither
is; the ranks agree on the rounds their captures hold (:meth:`BackgroundRunner._capture_now`).
A resumed runner starts where the saved one was: the restored target is written back at
the first step boundary, the next round waits for ``every`` steps from the restored one.
The throttle's clock (``interval_s``, ``duty``) restarts: time is not part of a run's state.

Background rounds are not reproducible (they start wherever the training thread is); with
``lockstep`` (a test hook, not a setting) the training thread waits at every step boundary
until the shadow thread has decided on that step (a round done, or its turn not yet come),
so rounds start at fixed steps and land one step later, and two runs are bitwise equal.

A shadow thread that dies (its round raised) is noticed at the training thread's next step
boundary: :meth:`BackgroundRunner.after_step` raises :class:`ShadowSyncDied` (one line: the
step, the rounds done, the thread's error), so the run ends within one step instead of
training on with replicas that no longer meet.

The runner counts what it moves in the ledger (category ``sync``, direction ``sync``: one
ring all-reduce of the replica per round, plus the 4-byte stop flag in the background) and
keeps the *sync gap*: training steps between two rounds of this rank.
"""

from __future__ import annotations

import contextlib
import threading
import time

import torch
import torch.distributed as dist

from hybridrec.comm.exchange import collective_device
from hybridrec.comm.ledger import CommLedger, ring_allreduce_bytes
from hybridrec.errors import HybridrecError
from hybridrec.sync.algorithms import CATEGORY, GroupMean, Mean, Synchronizer
from hybridrec.sync.rows import with_table_rows
from hybridrec.threads import single_threaded


class ShadowSyncDied(HybridrecError):
    """The shadow thread of background synchronization raised: the run ends at the next
    training step (:meth:`BackgroundRunner.raise_if_dead`) with its error in one line."""


class SyncRunner:
    """Base: rounds over ``params`` (the dense replica) with ``sync`` on ``group``."""

    mode = ""

    def __init__(self, sync: Synchronizer, params: list[torch.nn.Parameter], group: dist.ProcessGroup, *,
                 ledger: CommLedger | None = None, write_back: str = "delta", mean: Mean | None = None,
                 rows: str = "touched") -> None:
        """``mean``: how a round averages over ``group`` (default: exact, :class:`GroupMean`;
        ``sync.compress``: a :class:`~hybridrec.sync.compressed.CompressedMean`). The last
        average (:meth:`finish`) is always exact. A replica that ends with table rows
        (hierarchical training) has them synced by their changes, averaged over the groups
        that touched each row (``rows="touched"``) or over all (``"all"``: SGD's exact
        mean): :mod:`hybridrec.sync.rows`."""
        if write_back not in ("delta", "overwrite"):
            raise ValueError(f"write_back {write_back!r}: delta or overwrite")
        self.params, self.group = list(params), group
        self.ledger, self.write_back = ledger, write_back
        self.exact = GroupMean(group, ledger)
        self.mean = mean or self.exact
        self.sync = with_table_rows(sync, self.params, self.mean, rows=rows)
        self.step = 0  # the trainer's step, as of its last after_step()
        self.rounds = 0
        self._last_round_step: int | None = None
        self.gaps: list[int] = []  # training steps between two rounds of this rank
        self._capture: dict | None = None  # a checkpoint's one capture (inside parked())

    @contextlib.contextmanager
    def parked(self):
        """A context the training thread holds while it is out of the step loop for a
        collective wait (a checkpoint): :meth:`state_dict` and :meth:`replica_state` called
        within are one capture (module docstring), so the global and the per-rank parts of
        a checkpoint agree even if a round ends between the two calls."""
        self._capture = {}
        try:
            yield
        finally:
            self._capture = None

    def flat(self) -> torch.Tensor:
        """This rank's replica, ``[n]`` float32 (a copy), on the host: the rounds run over
        gloo groups of their own on host copies, so on a GPU a round never shares a
        communicator (or a CUDA stream's collectives) with the step. ``.cpu()``: the
        round's one device-to-host copy (a host sync of the thread that takes it; a no-op
        on CPU ranks)."""
        with torch.no_grad():
            return torch.cat([p.detach().reshape(-1) for p in self.params]).cpu()

    def start(self) -> None:
        replica = self.flat()
        self.sync.init(replica)
        if hasattr(self.mean, "start"):  # a compressed mean's anchor
            self.mean.start(replica)

    def after_step(self, step: int) -> None:
        self.step = step

    def finish(self) -> None:
        """Stop rounds and make every rank's dense model the same final one (the one
        evaluated and saved): the synchronizer's own (EASGD: the centre), else the
        replicas' mean."""
        self._average()

    def one_round(self) -> None:
        """A round in the calling thread; nothing trains meanwhile, so the target is
        copied exactly (write-back modes differ only in the background)."""
        snapshot = self.flat()
        with torch.no_grad():
            self._write(self.sync.round(snapshot, self.mean), None)
        self._note_round()

    def _note_round(self) -> None:
        self.rounds += 1
        if self._last_round_step is not None:
            self.gaps.append(self.step - self._last_round_step)
        self._last_round_step = self.step

    def _average(self) -> None:
        snapshot = self.flat()
        exact = _FinalMean(self.mean) if hasattr(self.mean, "final") else self.exact
        final = getattr(self.sync, "final", None)
        with torch.no_grad():
            self._write(exact(snapshot) if final is None else final(snapshot, exact), None)

    def _write(self, target: torch.Tensor, snapshot: torch.Tensor | None) -> None:
        at = 0
        for p in self.params:
            n = p.numel()
            t = target[at : at + n].view_as(p)
            if snapshot is None:
                p.copy_(t)
            else:  # keep what trained since the snapshot (host values: to the device, a no-op on CPU)
                p.add_((t - snapshot[at : at + n].view_as(p)).to(p.device))
            at += n

    # -- checkpoints ------------------------------------------------------------
    def state_dict(self) -> dict:
        """The synchronizer's state (identical on every rank of the sync group), and a
        compressed mean's (its anchor, this rank's compressor residuals: a resume on another
        world size takes rank 0's, else :meth:`replica_state` brings each rank its own)."""
        c = self._captured()
        return {"synchronizer": c["synchronizer"], **({"mean": c["mean"]} if "mean" in c else {})}

    def load_state_dict(self, state: dict) -> None:
        with self._state_locked():
            self.sync.load_state_dict(state["synchronizer"])
            if hasattr(self.mean, "load_state_dict") and "mean" in state:
                self.mean.load_state_dict(state["mean"])

    def replica_state(self) -> dict:
        """This rank's own state: its replica ``[n]``, the step and round counters (and a
        compressed mean's state, with this rank's residuals)."""
        c = self._captured()
        return {**self._own_state(), **c["thread"], **({"mean": c["mean"]} if "mean" in c else {})}

    def load_replica_state(self, state: dict) -> None:
        """Write the saved replica into the parameters and take the counters back;
        ``ValueError`` (the checkpointer's warning) for a replica of another size."""
        replica, n = state["replica"], sum(p.numel() for p in self.params)
        if replica.numel() != n:
            raise ValueError(f"the saved replica has {replica.numel()} values, this model's dense part {n}")
        with torch.no_grad():
            self._write(replica, None)
        self.step, self.rounds = int(state["step"]), int(state["rounds"])
        self._last_round_step = state["last_round_step"]
        self.gaps = [int(g) for g in state["gaps"].tolist()]
        if hasattr(self.mean, "load_state_dict") and "mean" in state:
            self.mean.load_state_dict(state["mean"])

    def _captured(self) -> dict:
        """Inside :meth:`parked`: its capture (taken at the first call); else a new one."""
        if self._capture is None:
            return self._capture_now()
        if not self._capture:
            self._capture.update(self._capture_now())
        return self._capture

    def _capture_now(self) -> dict:
        """What the rounds change, at one moment: the synchronizer's state (its tensors are
        replaced by a round, never written in place), a compressed mean's (written in place:
        copied) and the shadow thread's. (The replica and the counters change only in the
        training thread, which is parked while a checkpoint takes them.)"""
        with self._state_locked():
            out = {"synchronizer": self.sync.state_dict(), "thread": self._thread_state()}
            if hasattr(self.mean, "state_dict"):
                out["mean"] = cloned(self.mean.state_dict())
            return out

    def _thread_state(self) -> dict:
        return {}

    def _own_state(self) -> dict:
        return {"replica": self.flat(), "step": self.step, "rounds": self.rounds,
                "last_round_step": self._last_round_step, "gaps": torch.tensor(self.gaps, dtype=torch.int64)}

    def _state_locked(self):
        """The synchronizer's lock (a background round holds it); none in the foreground."""
        return contextlib.nullcontext()

    def summary(self) -> dict:
        g = self.gaps
        return {"algorithm": self.sync.name, "mode": self.mode, "write_back": self.write_back,
                "rounds": self.rounds, "gap_mean": sum(g) / len(g) if g else None,
                "gap_max": max(g) if g else None}


class ForegroundRunner(SyncRunner):
    """A round after every ``every``-th training step, in the training thread."""

    mode = "foreground"

    def __init__(self, *args, every: int = 1, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        if every < 1:
            raise ValueError(f"every must be >= 1, got {every}")
        self.every = every

    def after_step(self, step: int) -> None:
        self.step = step
        if step % self.every == 0:
            self.one_round()


class _FinalMean:
    """A compressed mean's exact last average (its ``final``) as a :class:`Mean`."""

    def __init__(self, mean: Mean) -> None:
        self.mean = mean

    def size(self) -> int:
        return self.mean.size()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.mean.final(x)


def cloned(state):
    """``state`` (dicts, lists, tuples of tensors and plain values) with its tensors copied."""
    if isinstance(state, torch.Tensor):
        return state.detach().clone()
    if isinstance(state, dict):
        return {k: cloned(v) for k, v in state.items()}
    if isinstance(state, (list, tuple)):
        return type(state)(cloned(v) for v in state)
    return state


class RankReplica:
    """The per-rank checkpoint component of a runner (``sync_replica``): this rank's dense
    replica, its dense optimizer's state and the runner's own state
    (:meth:`SyncRunner.replica_state`). The replicated ``model`` and ``dense_opt`` entries of
    a checkpoint are rank 0's; between rounds the ranks' differ, and this brings each rank
    its own back (loaded after them)."""

    def __init__(self, runner: SyncRunner, dense_opt: torch.optim.Optimizer) -> None:
        self.runner, self.dense_opt = runner, dense_opt

    def state_dict(self) -> dict:
        return {**self.runner.replica_state(), "dense_opt": self.dense_opt.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.dense_opt.load_state_dict(state["dense_opt"])  # (checks the groups' sizes first)
        self.runner.load_replica_state(state)


class BackgroundRunner(SyncRunner):
    """ShadowSync's shadow thread: rounds while training runs, throttled by ``every``,
    ``interval_s`` and ``duty`` (module docstring; the defaults run them back to back).

    The thread reads the live replica (the snapshot) and runs the round's all-reduce beside
    training; it never writes the parameters itself: autograd saves them for backward, so an
    in-place write between a step's forward and backward would corrupt (and here stop) that
    step. It hands the target to the training thread, which writes it back at its next step
    boundary (:meth:`after_step`: a vector add, the only sync work on the critical path),
    then the thread waits for its next turn. The training thread never waits for a round:
    the synchronizer's state has a lock of its own, held by the round and by
    :meth:`state_dict` (a checkpoint waits for a round in flight), never by the write-back."""

    mode = "background"

    def __init__(self, *args, every: int = 1, interval_s: float = 0.0, duty: float = 1.0,
                 lockstep: bool = False, train_group: dist.ProcessGroup | None = None, **kwargs) -> None:
        """``lockstep``: a test hook (module docstring): rounds at fixed steps, reproducible.
        ``train_group``: the training threads' group (the checkpoint's), over which a
        checkpoint's ranks agree on the rounds it holds (:meth:`_capture_now`); None: they
        do not (hierarchical: group 0 saves alone)."""
        super().__init__(*args, **kwargs)
        if every < 1:
            raise ValueError(f"every must be >= 1, got {every}")
        if interval_s < 0:
            raise ValueError(f"interval_s must be >= 0, got {interval_s}")
        if not 0 < duty <= 1:
            raise ValueError(f"duty must be in (0, 1], got {duty}")
        self.every, self.interval_s, self.duty, self.lockstep = every, interval_s, duty, lockstep
        self.train_group = train_group
        self.flag_group = self.group  # where the ranks agree to go on (a subclass: wider)
        self._stop = threading.Event()
        self._cond = threading.Condition()  # guards step, _pending and the waits on them
        self._state_lock = threading.RLock()  # the synchronizer's state: a round or a capture
        self._pending: tuple[torch.Tensor, torch.Tensor] | None = None  # snapshot, target
        # The training step the latest round started at (set with its target, under the
        # state lock: checkpointed with it); the throttle's ``every`` counts from it.
        self._round_step: int | None = None
        self._turn_at: int | None = None  # the thread waits for this step (lockstep's cue)
        self._done = 0  # rounds this invocation's thread finished (their state and target out)
        self._running = False  # the thread's loop has not ended
        self._thread: threading.Thread | None = None
        self.error: BaseException | None = None  # the thread's, raised at the next step
        self._died_at: int | None = None  # the training step when the thread died
        # Each round's start (monotonic seconds), the training step then, and its seconds.
        self.round_starts: list[tuple[float, int, float]] = []
        self.busy_s = 0.0  # seconds this rank's thread spent in rounds
        self._span: list[float] = []  # monotonic start and end of the thread

    def start(self) -> None:
        super().start()
        self._span = [time.monotonic()]
        self._running = True
        self._thread = threading.Thread(target=self._loop, name="hybridrec-shadow-sync", daemon=True)
        self._thread.start()
        self._wait_in_lockstep()

    def _loop(self) -> None:
        single_threaded()  # (beside the training step: hybridrec.threads)
        try:
            # start, step at start, seconds taken; resumed: only the step counts (no clock)
            last = None if self._round_step is None else (float("-inf"), self._round_step, 0.0)
            self._wait_written_back()  # (a restored target first)
            while True:
                self._wait_for_turn(last)
                t0 = time.monotonic()
                with self._cond:
                    step0 = self.step
                if not self._agree_to_go_on():
                    break
                snapshot = self._snapshot()
                if snapshot is None:  # stopped while waiting for it
                    break
                with self._state_lock:  # the state and its target: one checkpoint's, or neither
                    target = self.sync.round(snapshot, self.mean)
                    with self._cond:
                        self._pending, self._round_step = (snapshot, target), step0
                        self._done += 1
                        self._cond.notify_all()
                took = time.monotonic() - t0
                self.busy_s += took
                self.round_starts.append((t0, step0, took))
                last = (t0, step0, took)
                self._wait_written_back()  # by the training thread, then the next turn
        except BaseException as e:  # noqa: BLE001 - raised in the training thread at its next step
            with self._cond:  # (the step it died at, and the error, seen together)
                self._died_at, self.error = self.step, e
        finally:
            with self._cond:
                self._running = False
                self._cond.notify_all()

    def _wait_written_back(self) -> None:
        with self._cond:
            while self._pending is not None and not self._stop.is_set():
                self._cond.wait()

    def _snapshot(self) -> torch.Tensor | None:
        """The replica the round starts from, read in this thread without a lock while the
        optimizer writes (Hogwild: it may mix two steps' values)."""
        return self.flat()

    def _wait_for_turn(self, last: tuple[float, int, float] | None) -> None:
        """Wait until the throttle lets the next round start, or stop() was called."""
        if last is None:
            return
        t0, step0, took = last
        ready_at = t0 + max(self.interval_s, took / self.duty)  # rest took (1/duty - 1) after it
        with self._cond:
            try:
                while not self._stop.is_set():
                    wait_s = ready_at - time.monotonic()
                    turn_at = step0 + self.every if self.step < step0 + self.every else None
                    if wait_s <= 0 and turn_at is None:
                        return
                    if turn_at != self._turn_at:  # (lockstep: the training thread may go on)
                        self._turn_at = turn_at
                        self._cond.notify_all()
                    self._cond.wait(timeout=wait_s if wait_s > 0 else None)  # after_step notifies
            finally:
                self._turn_at = None

    def _agree_to_go_on(self) -> bool:
        """Collective on the sync group: False on every rank once any rank asked to stop."""
        flag = torch.tensor([1.0 if self._stop.is_set() else 0.0])
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.flag_group)
        if self.ledger is not None:
            ring = ring_allreduce_bytes(4, self.flag_group.size())
            self.ledger.record(CATEGORY, sent=ring, received=ring, direction="sync")
        return flag.item() == 0.0  # host read: the loop's decision

    def after_step(self, step: int) -> None:
        with self._cond:
            self.step = step
            self._apply_pending()
            self._cond.notify_all()  # a thread waiting for its turn counts steps
        self._wait_in_lockstep()
        self.raise_if_dead()

    def raise_if_dead(self) -> None:
        """:class:`ShadowSyncDied` once the thread has died (its error in one line): with no
        more rounds the replicas would drift apart unsynchronized, so the run ends at the
        step after the thread's death, not when training ends."""
        if self.error is None:
            return
        e = self.error
        why = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise ShadowSyncDied(f"the shadow sync thread died at step {self._died_at} after {self._done} "
                             f"round(s): {type(e).__name__}{': ' + why if why else ''}") from e

    def _wait_in_lockstep(self) -> None:
        """``lockstep``: wait until the thread has decided on this step: its round's target
        is ready, or it waits for a later step (or it ended)."""
        if not self.lockstep:
            return
        with self._cond:
            while self._running and self._pending is None and not (
                    self._turn_at is not None and self.step < self._turn_at):
                self._cond.wait()

    def _apply_pending(self) -> None:
        with self._cond:
            if self._pending is None:
                return
            snapshot, target = self._pending
            with torch.no_grad():
                self._write(target, snapshot if self.write_back == "delta" else None)
            self._pending = None
            self._note_round()
            self._cond.notify_all()

    def _state_locked(self):
        return self._state_lock

    def _capture_now(self) -> dict:
        """The base's capture; in a checkpoint (:meth:`parked`) every rank's holds the same
        rounds. A rank's capture may miss a round another rank's holds (its thread was still
        in that round's stop-flag all-reduce when the capture took the lock), so the ranks
        all-reduce (MAX) the rounds their captures hold, and one that is behind waits for its
        thread to finish that round (it can: some rank finished it, so every rank's thread
        joined it) and captures again. No rank's thread starts another round meanwhile: each
        waits for its target to be written back. Rounds count from this invocation's start
        (equal on every rank then)."""
        capture, done = self._capture_once()
        if self._capture is None or self.train_group is None:
            return capture
        most = torch.tensor([done], dtype=torch.int64, device=collective_device(self.train_group))
        dist.all_reduce(most, op=dist.ReduceOp.MAX, group=self.train_group)
        most_done = int(most.item())  # host read: the checkpoint's decision
        if most_done == done:
            return capture
        with self._cond:
            while self._done < most_done and self._running:
                self._cond.wait()
        return self._capture_once()[0]

    def _capture_once(self) -> tuple[dict, int]:
        with self._state_lock:
            with self._cond:
                done = self._done
            return super()._capture_now(), done

    def _thread_state(self) -> dict:
        """The step the latest round started at and its target if not yet written back
        (taken under the state lock: no round is in flight; a round makes new tensors)."""
        with self._cond:
            pending = None if self._pending is None else dict(zip(("snapshot", "target"), self._pending))
            return {"round_step": self._round_step, "pending": pending}

    def load_replica_state(self, state: dict) -> None:
        super().load_replica_state(state)
        pending = state["pending"]
        with self._cond:
            self._round_step = state["round_step"]
            self._pending = None if pending is None else (pending["snapshot"], pending["target"])

    def stop(self) -> None:
        """Ask for the last round, wait for the thread (every rank's thread leaves after
        the same round), and write back a target still pending."""
        with self._cond:
            self._stop.set()
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
            self._span.append(time.monotonic())
        self._apply_pending()
        self.raise_if_dead()

    def finish(self) -> None:
        self.stop()
        super().finish()

    def summary(self) -> dict:
        """The base summary, the throttle, and the share of the thread's time in rounds."""
        span = self._span[1] - self._span[0] if len(self._span) == 2 else None
        n = len(self.round_starts)
        return {**super().summary(), "every": self.every, "interval_s": self.interval_s, "duty": self.duty,
                "round_seconds_mean": self.busy_s / n if n else None,
                "busy_fraction": self.busy_s / span if span else None}
