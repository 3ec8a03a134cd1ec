"""Hogwild: several training threads in one trainer process share one model without locks.

With ``train.workers=N > 1``, :meth:`HogwildSteps.steps` runs ``N`` threads. Each thread
takes the next batch from the trainer's pipeline (a lock around taking the batch, and only
around that) and runs the ordinary :func:`~hybridrec.train.loop.step.training_step` on a
*thread replica* of the model:

- the dense parameters of a replica are aliases of the model's (``nn.Parameter(p.data)``:
  the same storage, their own ``.grad`` and their own autograd version counter, so a
  thread's optimizer writing the shared weights in place does not invalidate another
  thread's saved tensors); the embedding collection is the model's own object, whose
  parked lookups are per thread (``pop_sparse_grads`` returns the calling thread's);
- each thread has its own dense optimizer over its aliases whose per-parameter state
  (momentum, Adagrad sums, Adam moments) *is* the trainer's dense optimizer's state (the
  same dicts), so checkpoints save one coherent optimizer; the sparse optimizers are shared.

Updates are applied without a lock: two threads may read and write the same weights, the
same rows and the same optimizer state at the same time, and one may compute its gradient
on weights another is half-way through updating. Lost or mixed updates are accepted by
design (Hogwild, Recht et al. 2011): with sparse rows they rarely collide, and the dense
part tolerates the noise. So a run with ``workers > 1`` is not reproducible bit for bit.

What stays exact: every batch of an epoch is trained exactly once (batches are claimed
under the lock, up to the planned step); the trainer's step counter counts finished steps
and is advanced by the calling (main) thread only, which also does all logging. The
learning-rate schedule gives each step the factor of its own index (its dense optimizer's
``lr``); the sparse learning rate is one shared value each thread sets to its step's before
its update, so a sparse update may use a neighbour's (at most ``N - 1`` steps apart).
Evaluation and checkpoints run only at a *pause*: the threads claim no step past the next
``train.eval_every`` / ``train.checkpoint_every`` multiple, finish what they have, and exit;
the main thread then evaluates or saves (the loader position is then exactly the steps
trained) and starts the threads again.
"""

from __future__ import annotations

import copy
import queue
import threading
from collections.abc import Iterator

import torch
from torch import nn

from hybridrec.parallel.dense_sync import NoSync
from hybridrec.train.loop.parts import StepSource
from hybridrec.train.loop.step import training_step

_EXIT = object()  # a thread's last message


def thread_replica(model: nn.Module) -> tuple[nn.Module, dict[nn.Parameter, nn.Parameter]]:
    """``(replica, {model parameter: its alias})``: a copy of ``model`` whose parameters
    share the model's storage (not its ``.grad`` or version counter) and whose embedding
    collection (``model.sparse``) and buffers are the model's own objects."""
    memo: dict[int, object] = {id(model.sparse): model.sparse}
    aliases = {}
    for p in model.parameters():
        if id(p) not in memo:
            aliases[p] = nn.Parameter(p.data, requires_grad=p.requires_grad)
            memo[id(p)] = aliases[p]
    for b in model.buffers():
        memo[id(b)] = b
    return copy.deepcopy(model, memo), aliases


def thread_optimizer(opt: torch.optim.Optimizer, aliases: dict) -> torch.optim.Optimizer:
    """An optimizer of ``opt``'s kind and settings over the aliases of its parameters,
    holding ``opt``'s per-parameter state dicts themselves (one state, many writers)."""
    groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": [aliases[p] for p in g["params"]]}
              for g in opt.param_groups]
    mine = type(opt)(groups, **opt.defaults)
    for g in opt.param_groups:
        for p in g["params"]:
            mine.state[aliases[p]] = opt.state[p]  # (created empty when lazily initialised)
    return mine


class HogwildSteps(StepSource):
    """The remaining steps of a :class:`~hybridrec.train.loop.trainer.Trainer` in ``workers``
    threads (module docstring): a step source whose pauses are the loop's
    (:meth:`Trainer.pause_at`, the parts' next evaluation or checkpoint). The threads'
    replicas are built when training starts, after the resume (the optimizers' state must
    be the restored one)."""

    def __init__(self, pipeline, workers: int) -> None:
        super().__init__(pipeline)
        self.workers = workers
        self.replicas: list = []
        self._lock = threading.Lock()  # around taking a batch
        self._batches: Iterator | None = None  # the pipeline's current pass
        self._claimed = 0  # steps handed to a thread so far
        self._until = 0  # no step past this one before the next pause
        self._total = 0
        self._stop = threading.Event()
        self._done: queue.SimpleQueue = queue.SimpleQueue()

    def start(self, loop) -> None:
        self.replicas = []
        for _ in range(self.workers):
            replica, aliases = thread_replica(loop.model)
            self.replicas.append((replica, thread_optimizer(loop.optim.dense, aliases)))
        self._claimed = self._until = loop.step
        self._total = loop.total_steps

    # -- the main thread ----------------------------------------------------------
    def steps(self, loop) -> Iterator[tuple[torch.Tensor, int]]:
        """Trains every remaining step; yields ``(loss, global samples)`` of each as it
        finishes, with the loop's step closed. When the yielded step is a pause, every
        thread has stopped (the loop may evaluate or save), and the threads start again
        when the loop asks for the next step."""
        first = loop.step
        counts = [(o, o.step_count) for o in loop.optim.sparse]
        while loop.step < loop.total_steps:
            self._until = loop.pause_at(loop.step)
            threads = [threading.Thread(target=self._work, args=(i, loop), name=f"hybridrec-hogwild-{i}",
                                        daemon=True) for i in range(self.workers)]
            for th in threads:
                th.start()
            try:
                running, finished = len(threads), None
                while running:
                    item = self._done.get()
                    if item is _EXIT:
                        running -= 1
                        continue
                    if isinstance(item, BaseException):
                        raise item
                    if finished is not None:  # the previous step was not the pause's
                        yield finished
                    loop.close_step()
                    finished = item
            finally:
                if running:  # an error, or the loop stopped early: the others stop too
                    self._stop.set()
                for th in threads:
                    th.join()
            if finished is None:  # (an empty loader is refused when the trainer is built)
                raise RuntimeError("train.workers: the threads found no batch to train")
            # Every thread has exited. The sparse optimizers' step counts (incremented by the
            # threads without a lock) and the learning rates become what one thread leaves
            # after this step, then the pause's step goes out.
            for o, n in counts:
                o.step_count = n + loop.step - first
            loop.optim.scheduler.apply(loop.step - 1)
            yield finished

    # -- the training threads -----------------------------------------------------
    def _claim(self):
        """The next batch and its step index, or None at the pause (or when stopped)."""
        with self._lock:
            if self._stop.is_set() or self._claimed >= self._until:
                return None
            item = next(self._batches, None) if self._batches is not None else None
            if item is None:  # a new pass over the data
                self._batches = iter(self.pipeline.batches(self._total - self._claimed))
                item = next(self._batches, None)
                if item is None:
                    return None
            self._claimed += 1
            return item, self._claimed - 1

    def _work(self, i: int, loop) -> None:
        replica, opt = self.replicas[i]
        sched, sync = loop.optim.scheduler, NoSync()
        sparse_opt = loop.optim.sparse
        world = loop.topo.group_size
        try:
            while (claim := self._claim()) is not None:
                (batch, pending), step = claim
                f = sched.schedule.factor(step)
                for g in opt.param_groups:
                    g["lr"] = sched.dense_lr * f
                sparse_opt.lr = sched.sparse_lr * f
                loss = training_step(replica, batch, dense_opt=opt, sparse_opt=sparse_opt,
                                     dense_sync=sync, pending=pending)
                self._done.put((loss, batch.batch_size * world))
        except BaseException as e:  # noqa: BLE001 - handed to the main thread, which raises it
            self._stop.set()
            self._done.put(e)
        finally:
            self._done.put(_EXIT)
