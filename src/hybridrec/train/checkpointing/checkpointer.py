"""One checkpointer for every stateful part of a run, on one process or many.

The Trainer's components, saved and restored as a list, by name:

==============  ==========  =====================================================
component       scope       what it holds
==============  ==========  =====================================================
``model``       sharded     tables (one global tensor per table), dense arches
``dense_opt``   replicated  torch.optim state, by parameter name
``sparse_opt``  sharded     per-row state of the sparse optimizers, per table
``loader``      global      position after the last trained batch
``run_totals``  global      samples and training seconds over every invocation
``sync``        global      a synchronizer's centre / global model / block momentum
``dense_sync``  per rank    a compressor's residuals, thresholds, step counts
``rng``         per rank    torch's CPU random generator
``early_stop``  global      ``train.early_stop``: the best step and AUC so far, the
                            evaluations since; its best checkpoint is kept from pruning
``ps``          servers     a parameter-server run's tables and their optimizer state:
                            the servers' own sharded checkpoint ``step-N/ps/``
==============  ==========  =====================================================

Everything goes through torch.distributed.checkpoint (:mod:`hybridrec.parallel.checkpoint`),
in one process too, so a checkpoint of any run loads into any world size or plan. Global
components are rank 0's state. Per-rank components carry over only to the world size that
saved them; into another world size they restart from their initial state, each with a
warning that names it. The manifest (``manifest.json``) lists the step, the world size,
the plan, every component with its scope and the model's fingerprint (its tensors' names
and global shapes).

Resuming (:meth:`Checkpointer.restore_newest`) takes the newest checkpoint that passes its
integrity checks and loads: files whole and of the checksums the manifest records
(:func:`hybridrec.train.checkpointing.checkpoint.problem`; a ``step-N`` directory without ``.metadata``
fails them), the model's fingerprint and shapes those of the model being built, every
tensor readable.
Newer ones that fail are renamed aside to ``step-N.bad`` with one warning each, once a
good one is loaded; when none loads, one error names why each failed and nothing is
renamed.

Codecs of the pooled-embedding hop hold no state across steps (a fixed top-k per row, or a
cast), so there is nothing of theirs to save.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch
from torch import nn

from hybridrec.errors import os_error_message
from hybridrec.parallel.checkpoint import PendingSave, load_state, save_sharded, save_sharded_async
from hybridrec.parallel.checkpoint_io import gather
from hybridrec.parallel.topology import Topology
from hybridrec.train.checkpointing import checkpoint as ckpt


class Stateful(Protocol):
    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...


@dataclass(frozen=True)
class Component:
    """A stateful part of a run, saved under ``name``; ``per_rank``: each rank's own
    (bound to the world size), else global (equal on every rank; rank 0's is saved);
    ``snapshot_only``: its state lives in recovery snapshots alone (a checkpoint's is empty),
    so a checkpoint without it, or of another world size, loses nothing and says nothing."""

    name: str
    obj: Stateful
    per_rank: bool = False
    snapshot_only: bool = False


class TorchRNG:
    """torch's CPU generator as a component (each rank draws from its own)."""

    def state_dict(self) -> dict:
        return {"cpu": torch.get_rng_state()}

    def load_state_dict(self, state: dict) -> None:
        torch.set_rng_state(state["cpu"])


class Attachment(Protocol):
    """What a run's checkpoints carry besides the trainers' own state, held elsewhere (a
    sparse backend's: the parameter servers' tables, ``step-N/ps/``,
    :class:`~hybridrec.train.ps_run.ServerCheckpoints`). Collective over the trainers:
    :meth:`quiesce` on every rank before a checkpoint, :meth:`save` into the checkpoint
    being written (before it is published), :meth:`load` before the trainers' state;
    with a recovery (:class:`~hybridrec.train.checkpointing.recovery.Recovery`),
    :meth:`no_failure` or :meth:`recover`."""

    in_background: bool
    """Whether the trainers' checkpoint may be written in the background beside it."""

    def manifest(self) -> dict: ...

    def processes(self, trainers: int) -> int: ...

    def quiesce(self, sparse_opt) -> None: ...

    def save(self, path: Path, step: int) -> None: ...

    def load(self, path: Path) -> None: ...

    def no_failure(self, run_dir: Path, fast_dir) -> None: ...

    def recover(self, resumed_at: int, checkpoint_step: int | None, *, use_snapshots: bool, run_dir: Path,
                lost_since: Callable, global_batch: int, trainers_shards: Callable[[], list]) -> dict: ...


class NoAttachment:
    """The trainers hold every table (one process, or several ranks' shards): nothing is
    attached to their checkpoints; a failure can hit only them, and the record's shards
    are theirs."""

    in_background = True

    def manifest(self) -> dict:
        """The checkpoint's components besides the trainers' (their scope): none."""
        return {}

    def processes(self, trainers: int) -> int:
        """The processes a failure can hit: the trainers."""
        return trainers

    def quiesce(self, sparse_opt) -> None:
        pass

    def save(self, path: Path, step: int) -> None:
        pass

    def load(self, path: Path) -> None:
        pass

    def no_failure(self, run_dir: Path, fast_dir) -> None:
        pass  # (no snapshot but the trainers')

    def recover(self, resumed_at: int, checkpoint_step: int | None, *, use_snapshots: bool, run_dir: Path,
                lost_since: Callable, global_batch: int, trainers_shards: Callable[[], list]) -> dict:
        """The recovery record's entries of the tables: the trainers' shards' losses."""
        return {"shards": trainers_shards()}


NO_ATTACHMENT = NoAttachment()


class Checkpointer:
    """Saves ``RUN/checkpoints/step-N/`` and restores the newest, for every component.

    ``model``, ``dense_opt`` and ``sparse_opt`` (a ``CombinedSparseOptimizer``) are saved
    by their tensor layout (sharded tables, named dense state); ``components`` by their
    ``state_dict``. Collective: every rank calls :meth:`save` and :meth:`restore`.
    """

    def __init__(self, run_dir: str | Path, topo: Topology, *, model: nn.Module,
                 dense_opt: torch.optim.Optimizer, sparse_opt, components: list[Component],
                 keep: int = 2, attachment: Attachment = NO_ATTACHMENT,
                 keep_also: Callable[[], Iterable[int]] | None = None, background: bool = False) -> None:
        """``attachment``: what the checkpoints carry besides the trainers' state (:class:`Attachment`:
        a parameter-server run's tables and their optimizer state, saved into ``step-N/ps/``).
        ``keep_also``: the steps whose checkpoints pruning keeps besides the newest ``keep``
        (early stopping's best one), asked at every save.
        ``background``: :meth:`save` blocks only while the state is copied and the files are
        written in the background (:func:`~hybridrec.parallel.checkpoint.save_sharded_async`;
        the copy costs memory: every tensor a rank saves); the owner calls :meth:`wait`
        before the process ends. Parameter-server and hierarchical runs save in the foreground."""
        names = [c.name for c in components]
        clash = {"model", "dense_opt", "sparse_opt", "step"} & set(names)
        if clash or len(set(names)) != len(names):
            raise ValueError(f"component names must be unique and not {sorted(clash)}: {names}")
        self.run_dir, self.topo, self.keep = Path(run_dir), topo, keep
        self.model, self.dense_opt, self.sparse_opt = model, dense_opt, sparse_opt
        self.components = components
        self.attachment = attachment
        self.keep_also = keep_also
        self.background = background
        self._pending: PendingSave | None = None  # the save being written in the background
        self._group = None  # its process group (made at the first background save)

    def _sparse_opts(self) -> list:
        return list(self.sparse_opt.optimizers.values())

    def save(self, step: int) -> Path:
        """Collective; in hierarchical training only group 0 saves (every group resumes from
        it) and the other groups wait for it (a world barrier: no rank trains past a step
        whose checkpoint could still be lost with it)."""
        path = ckpt.step_dir(self.run_dir, step)
        self.wait()
        self.attachment.quiesce(self.sparse_opt)  # (servers: every group's pushes land before group 0's save)
        if self.topo.group_index == 0:
            self._save(path, step)
        if self.topo.hierarchical:
            torch.distributed.barrier(group=self.topo.job_group)
        return path

    def _save(self, path: Path, step: int) -> None:
        self.sparse_opt.flush()  # pushes in flight land before the servers save
        extra = {"step": step, **{c.name: c.obj.state_dict() for c in self.components if not c.per_rank}}
        per_rank = {c.name: c.obj.state_dict() for c in self.components if c.per_rank}
        manifest = {"step": step, "components": {
            "model": "sharded", "dense_opt": "replicated", "sparse_opt": "sharded",
            **{c.name: "per_rank" if c.per_rank else "global" for c in self.components},
            **self.attachment.manifest()}}
        args = {"model": self.model, "dense_opt": self.dense_opt, "sparse_opts": self._sparse_opts(),
                "extra": extra, "per_rank": per_rank, "manifest": manifest, "topo": self.topo}
        if self.background and self.attachment.in_background and not self.topo.hierarchical:
            if self._group is None and self.topo.group is not None:  # (collective: every rank saves)
                self._group = self.topo.job_gloo_group()
            self._pending = save_sharded_async(path, group=self._group, **args)
            return
        save_sharded(path, attach=lambda tmp: self.attachment.save(tmp, step), **args)
        self._prune()

    def _prune(self) -> None:
        if self.topo.rank == 0:
            ckpt.prune(self.run_dir, keep=self.keep, keep_also=self.keep_also() if self.keep_also else ())

    def wait(self) -> Path | None:
        """Block until the checkpoint being written in the background is published (then
        prune); returns its path (None: none was being written) or raises its error, the
        same on every rank."""
        pending, self._pending = self._pending, None
        if pending is None:
            return None
        path = pending.wait()
        self._prune()
        return path

    def latest(self) -> Path | None:
        return ckpt.latest_checkpoint(self.run_dir)

    def restore_newest(self, *, dense_only: bool = False) -> tuple[int, Path] | None:
        """Collective: restore the newest checkpoint that passes its checks and loads
        (:func:`hybridrec.train.checkpointing.checkpoint.load_newest`, every rank the same one); returns
        ``(step, path)``, or None when the run has no checkpoint. Each newer one that failed
        is renamed aside (``step-N.bad``, by rank 0) with a warning naming it and why;
        when none loads, :class:`CheckpointError` and nothing is renamed. ``dense_only``:
        see :meth:`restore` (this rank's; others may differ)."""
        self.wait()
        found = ckpt.resume_candidates(self.run_dir)  # (incomplete ones too: set aside if they fail)
        if self.topo.group_size == 1 and not found:
            return None
        if not gather(self.topo, bool(found))[0]:  # rank 0's listing decides
            return None
        path, step, skipped = ckpt.load_newest(found, lambda p: self.restore(p, dense_only=dense_only), self.topo)
        for bad, why in skipped:
            if not self.topo.lead:
                continue
            try:
                where = f"renamed to {ckpt.set_aside(bad).name}"
            except OSError as e:
                where = f"left in place ({os_error_message(e)})"
            self._warn(f"skipped the checkpoint {bad} ({why}); {where}; resuming from {path.name}")
        return step, path

    def restore(self, path: str | Path, *, dense_only: bool = False) -> int:
        """Load ``path`` into every component; returns the step it was saved at.
        ``dense_only``: not the tables and their sparse optimizer state (a rank that takes
        them from its own recovery snapshot, partial recovery)."""
        self.wait()
        self.attachment.load(Path(path))
        loaded = load_state(path, model=self.model, dense_opt=self.dense_opt,
                            sparse_opts=None if dense_only else self._sparse_opts(), topo=self.topo,
                            parts="dense" if dense_only else "all")
        for c in self.components:
            if c.snapshot_only:
                continue
            if not c.per_rank and c.name not in loaded.extra:  # e.g. saved before it existed
                self._warn(f"{c.name}: not in the checkpoint {path}; it starts from its initial state")
            elif not c.per_rank:
                c.obj.load_state_dict(loaded.extra[c.name])
            elif loaded.per_rank is None:
                self._warn(f"{c.name}: saved by {loaded.manifest['world_size']} ranks, this run has "
                           f"{self.topo.group_size}; its per-rank state restarts from scratch")
            elif c.name not in loaded.per_rank:
                self._warn(f"{c.name}: not in the checkpoint {path}; it restarts from scratch")
            else:
                self._load_per_rank(c, loaded.per_rank[c.name])
        return int(loaded.extra["step"])

    def _load_per_rank(self, c: Component, state: dict) -> None:
        try:
            c.obj.load_state_dict(state)
        except ValueError as e:  # e.g. another compressor than the one saved
            self._warn(f"{c.name}: the saved state does not fit this run ({e}); it restarts from scratch")

    def _warn(self, message: str) -> None:
        if self.topo.lead:  # one line per run, not one per rank
            warnings.warn(f"resuming: {message}", stacklevel=3)
