"""Training pipeline: the next batch's input_dist travels while the current batch trains.

With sharded embeddings every step starts with an all-to-all of ids (input_dist)
that the step then waits for. :class:`TrainPipeline` takes batch ``i + 1`` from
the loader and starts its input_dist before batch ``i`` is handed to the training
step, so the ids of the next step are on the wire during the current forward,
backward and optimizer step. The ids are the same, so the results are identical
with the pipeline on or off (``dist.pipeline``); only the waiting moves.

Every rank runs the same loop, so every rank starts the same prefetches in the
same order: collectives stay matched.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from hybridrec.sparse.keyed_jagged import Batch


class TrainPipeline:
    """Iterates a training loader one batch ahead.

    Args:
        loader: the training loader (``iter`` yields :class:`Batch`, ``state_dict``
            is the position after the last yielded batch).
        sparse: the model's embedding collection; prefetching needs its
            ``start_input_dist(kjt)`` (a sharded collection); anything else disables it.
        enabled: the switch (``dist.pipeline``).
        device: where the model is; a batch for a GPU is pinned and its copy queued
            without blocking the host as it is taken (a step ahead of its training).

    ``batches(limit)`` yields at most ``limit`` ``(batch, pending)`` pairs of one pass over
    the loader: ``pending`` is the handle of the batch's input_dist under way (None when
    not prefetched), which the caller passes to the model's forward. ``state_dict()`` is
    the loader position after the last batch *yielded* (the one taken ahead is not
    trained yet, so a checkpoint must not skip it); the pipeline is the checkpointer's
    ``loader`` component.
    """

    def __init__(self, loader, sparse, *, enabled: bool, device: torch.device | str = "cpu") -> None:
        self.loader = loader
        self.device = torch.device(device)
        self.sparse = sparse
        self.enabled = enabled and hasattr(sparse, "start_input_dist")
        self._state: dict | None = None  # loader position after the batch being trained
        self._ahead = None  # the input_dist handle of the batch taken ahead (None: none)

    def state_dict(self) -> dict:
        return self._state if self._state is not None else self.loader.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.loader.load_state_dict(state)
        self._state = None

    def batches(self, limit: int) -> Iterator[tuple[Batch, object | None]]:
        if limit <= 0:
            return
        it = iter(self.loader)
        nxt = self._take(it)
        nxt_state = self.loader.state_dict()
        yielded = 0
        while nxt is not None:
            cur, self._state = nxt, nxt_state
            yielded += 1
            # Take the next batch and start its ids on their way before this one trains;
            # never read past the last batch the caller will train.
            nxt = self._take(it) if yielded < limit else None
            nxt_state = self.loader.state_dict()
            self._ahead = nxt[1] if nxt is not None else None
            yield cur
        self._ahead = None

    def discard_ahead(self) -> None:
        """The caller stopped before the last batch (early stopping): the input_dist of the
        batch taken ahead finishes unused (every rank started it, so every rank completes
        it before the next collective, e.g. the evaluation's)."""
        if self._ahead is not None:
            self._ahead.discard()
            self._ahead = None

    def _take(self, it) -> tuple[Batch, object | None] | None:
        batch = next(it, None)
        if batch is None:
            return None
        batch = to_device(batch, self.device)
        return batch, self.sparse.start_input_dist(batch.sparse) if self.enabled else None


def to_device(batch: Batch, device: torch.device) -> Batch:
    """``batch`` on ``device``: as it is for the CPU; for a GPU through pinned memory (the
    loader's prefetch thread pinned it already, else it is pinned here), the copy queued
    without waiting (the step's kernels on the same stream come after it)."""
    if device.type == "cpu":
        return batch
    return batch.pin_memory().to(device, non_blocking=True)
