"""One training step, in order, and one evaluation: what the training loop
(:class:`~hybridrec.train.loop.trainer.Trainer`), its Hogwild threads (:mod:`hybridrec.train.loop.hogwild`)
and the multi-rank tests run.

``training_step``: input (the pipeline's ``(batch, pending)``), forward, backward, the dense
synchronization, the row gradients (``sparse_grads``), the dense and sparse optimizer steps.
Each phase is a profiler range (:mod:`hybridrec.phases`).
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
import torch.nn.functional as F

from hybridrec.metrics.classification import BinaryMetrics
from hybridrec.parallel.dense_sync import DenseSync
from hybridrec.parallel.topology import Topology
from hybridrec.phases import phase
from hybridrec.sparse.keyed_jagged import Batch
from hybridrec.train.loop.pipeline import to_device
from hybridrec.train.loop.sparse_optim import CombinedSparseOptimizer


@torch.no_grad()
def evaluate_model(model: torch.nn.Module, loader, topo: Topology | None = None) -> dict:
    """AUC, log loss, NE, calibration, accuracy over every batch of ``loader``; with
    several ranks, over the union of every rank's rows (predictions are gathered)."""
    was_training = model.training
    model.eval()
    metrics = BinaryMetrics()
    device = topo.device if topo is not None else torch.device("cpu")
    for batch in loader:
        batch = to_device(batch, device)
        metrics.update(model(batch), batch.labels)
    model.train(was_training)
    if topo is not None and topo.job_size > 1:  # (hierarchical: every group's rows)
        parts = [None] * topo.job_size
        dist.all_gather_object(parts, metrics.state(), group=topo.run_group)
        metrics = BinaryMetrics.from_parts(parts)
    return metrics.compute()


def sparse_grads(sparse) -> dict[str, list]:
    """The row gradients of the step for the sparse optimizers, by collection name
    (``CombinedSparseOptimizer``'s keys). With several ranks the replicated tables' rows
    are all-reduced here: an explicit collective every rank runs every step."""
    return sparse.step_grads()


def training_step(model: torch.nn.Module, batch: Batch, *, dense_opt: torch.optim.Optimizer,
                  sparse_opt: CombinedSparseOptimizer, dense_sync: DenseSync,
                  pending=None, updating=None, scores=None) -> torch.Tensor:
    """One training step, in order; returns the detached loss. ``pending``: the batch's
    input_dist already under way (the pipeline's handle), or None. ``updating``: a context
    around the optimizer updates (partial recovery's: the state is whole outside it).
    ``scores``: called with the batch's logits and labels before anything is updated
    (test-then-train metrics)."""
    if not model.training:  # (after an evaluation; evaluate_model restores every module's mode)
        model.train()
    # (Each phase is a torch.profiler range: benchmarks/profile_step.py reads them.)
    with phase("forward"):
        # input_dist (or its pending handle), lookup, output_dist, the dense arches.
        logits = model(batch) if pending is None else model(batch, sparse_input=pending)
        loss = F.binary_cross_entropy_with_logits(logits, batch.labels)
    if scores is not None:
        scores(logits.detach(), batch.labels)
    dense_opt.zero_grad(set_to_none=True)
    with phase("backward"):
        loss.backward()  # dense grads, the lookups' row grads, the output_dist backward
    with phase("grad_sync"):
        dense_sync.synchronize()  # dense synchronization (DDP's ran inside backward)
        grads = sparse_grads(model.sparse)
    with updating if updating is not None else contextlib.nullcontext() as track:
        if track is not None:  # (partial recovery's incremental saves: the rows looked up)
            track(grads)
        with phase("dense_update"):
            dense_opt.step()
        with phase("sparse_update"):
            sparse_opt.step(grads)
    return loss.detach()
