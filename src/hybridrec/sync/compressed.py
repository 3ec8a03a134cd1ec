"""A synchronizer's mean through a compressor (``sync.compress``): the cross-group hop of
hierarchical training, or any sync group's.

Each rank sends the *change* of its replica since the last mean, not the replica: the
changes are small and sparse (a round's training moves few embedding rows), so a
threshold keeps most of what matters. With the anchor ``a`` (the previous mean, identical
on every rank) and this rank's replica ``x_i``::

    d_i = x_i - a                     # the change since the last round
    m   = mean_i C(d_i + r_i)         # compressed with error feedback r_i (what C left out)
    a  <- a + m                       # the new mean, identical on every rank again

so ``a`` tracks ``mean_i x_i`` up to what the residuals still hold, and nothing is lost for
good. The anchor starts as the replica training starts from (the same on every rank), so
every round is compressed; the last average of a run is exact
(:meth:`CompressedMean.final`: the nonzero changes only, where sparse). ``C`` is one of
the dense-gradient compressors (:mod:`hybridrec.comm.compress`: ``fp16``/``bf16`` casts, or
``dct``: entries at or above a magnitude threshold, the ``ratio``-th largest, recomputed
every ``refresh_every`` rounds), exchanged by the same all-reduce / sparse-message paths
as the dense gradients (:class:`hybridrec.comm.ddp_hooks.CompressedAllReduce`), counted
in the ledger's ``sync`` category with the uncompressed ring all-reduce as ``original``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from hybridrec.comm.compress import DCTCompressor
from hybridrec.comm.ddp_hooks import CompressedAllReduce
from hybridrec.sync.algorithms import CATEGORY, GroupMean, split_parts

KEY = "replica"  # the compressor's state key: one flat tensor per rank


class CompressedMean:
    """``mean(x)``: the mean of the replicas ``x`` ``[n]`` over ``group``, compressed as the
    module docstring says. State: the anchor and the compressor's residual/threshold (per
    rank: checkpointed with the runner)."""

    def __init__(self, group: dist.ProcessGroup, reducer: CompressedAllReduce, ledger=None,
                 parts: tuple[int, ...] = ()) -> None:
        """``parts``: as :class:`~hybridrec.sync.algorithms.GroupMean`'s (each piece its own
        exchange and its own compressor state)."""
        self.group, self.reducer, self.parts = group, reducer, tuple(parts)
        self.exact = GroupMean(group, ledger, parts)
        self.anchor: torch.Tensor | None = None  # [n] the previous mean, identical on every rank

    def size(self) -> int:
        return self.group.size()

    def start(self, replica: torch.Tensor) -> None:
        """The anchor is the replica training starts from (equal on every rank: the same
        initialization, or the same checkpoint), unless a checkpoint restored one: the first
        round is then compressed too, with no exact round of the whole replica first."""
        if self.anchor is None:
            self.anchor = replica.detach().clone()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.anchor is None or self.anchor.numel() != x.numel():
            self.anchor = self.exact(x)
            return self.anchor.clone()
        change = x - self.anchor
        for i, piece in enumerate(split_parts(change, self.parts)):  # averaged in place
            self.reducer.reduce(self.group, piece, [f"{KEY}.{i}"], [piece]).wait()
        self.anchor += change
        return self.anchor.clone()

    def final(self, x: torch.Tensor) -> torch.Tensor:
        """The exact mean, for the last average of a run. Per part: where the changes since
        the anchor are sparse (at most half the entries nonzero on every rank: e.g. the
        embedding rows the last rounds' training touched), only their nonzero entries travel
        (index and value, uncompressed: a ratio-1 sparse message); else the part itself, by a
        plain all-reduce. (Per part, so that the dense part, equal on a group's members, takes
        the same path on every cross group.)"""
        if self.anchor is None or self.anchor.numel() != x.numel():
            return self.exact(x)
        change = x - self.anchor
        pieces = split_parts(change, self.parts)
        full = torch.tensor([(p != 0).float().mean().item() for p in pieces])
        dist.all_reduce(full, op=dist.ReduceOp.MAX, group=self.group)  # every rank: the same paths
        everything = CompressedAllReduce(DCTCompressor(1.0, 1, error_feedback=False), self.reducer.ledger,
                                         category=self.reducer.category, direction=self.reducer.direction)
        out = []
        for i, (piece, start) in enumerate(zip(pieces, split_parts(self.anchor, self.parts))):
            if full[i] > 0.5:
                out.append(self.exact(start + piece))
            else:  # the changes, averaged in place
                everything.reduce(self.group, piece, [f"{KEY}.{i}"], [piece]).wait()
                out.append(start + piece)
        return torch.cat(out)

    def state_dict(self) -> dict:
        return {"anchor": self.anchor, "compressor": self.reducer.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.anchor = state.get("anchor")
        self.reducer.load_state_dict(state["compressor"])


__all__ = ["CATEGORY", "CompressedMean"]
