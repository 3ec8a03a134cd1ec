"""Embedding rows across groups: synced by their changes, not their values.

In hierarchical training without parameter servers every group holds a full copy of the
tables (each member its shards), and a round's replica ends with the member's table rows.
Averaging those rows' *values* over G groups shrinks the update of a row that one group
touched by G: the other groups' copies did not move. With SGD that is right (a group's
gradient is a mean over a batch G times smaller than the flat run's, so the plain mean
equals flat synchronous training: the equivalence test); with row-wise Adagrad or Adam,
whose step size hardly depends on the gradient's scale, flat training moves such a row by
about one group's update, and the plain mean moved it by 1/G of that (a hot row, touched
by every group, moves by the mean of the groups' updates either way).

:class:`TableRows` wraps a synchronizer: the synchronizer (MA, EASGD, BMUF) runs over the
dense values of the replica (its leading ``dense`` values), and the table rows after them
are synced by their *changes* since the last round's agreed rows (the *anchor* ``a``,
identical on every rank of the sync group after every round)::

    d_i = x_i - a                                   # rank i's change of every row
    k   = sum_i [row of d_i != 0]                   # the groups that touched each row
    a  <- a + sum_i d_i / max(k, 1)                 # rows == "touched"

one all-reduce of the tables' size plus one value per row. Every round thus ends with the
same table rows on every group (before a background write-back adds what trained since the
snapshot), whatever the synchronizer: EASGD's elastic force and BMUF's block momentum act
on the dense part only (a simplification: the rows, sparse and optimizer-scaled, are not
given an elastic centre or a momentum of their own). ``rows == "all"``: the plain mean of
the values (``mean_i x_i``, what SGD needs), still outside the synchronizer.

A compressed mean (``sync.compress``) keeps the old path: the synchronizer over the whole
replica, through the compressor, rows averaged over all groups (not built: the touch
counts through a compressor's error feedback).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from hybridrec.comm.ledger import ring_allreduce_bytes
from hybridrec.sync.algorithms import CATEGORY, GroupMean, Synchronizer, as_mean

ROWS = ("touched", "all")


class TableRows:
    """``inner`` over the replica's first ``dense`` values; the table rows after them (the
    2-D weights of ``shapes``, ``(rows, columns)`` each, in order) by their changes (module
    docstring). Its state: the inner synchronizer's and the anchor ``[t]``."""

    def __init__(self, inner: Synchronizer, dense: int, shapes: list[tuple[int, int]], *,
                 rows: str = "touched") -> None:
        if rows not in ROWS:
            raise ValueError(f"table rows {rows!r}: touched or all")
        self.inner, self.dense, self.shapes, self.rows = inner, dense, list(shapes), rows
        self.name = inner.name
        self.anchor: torch.Tensor | None = None  # [t] the rows after the last round, equal on every rank

    def init(self, replica: torch.Tensor) -> None:
        self.inner.init(replica[: self.dense])
        if self.anchor is None:
            self.anchor = replica[self.dense :].detach().clone()

    def round(self, snapshot: torch.Tensor, mean) -> torch.Tensor:
        mean = as_mean(mean)
        dense = self.inner.round(snapshot[: self.dense], mean)
        return torch.cat([dense, self._tables(snapshot[self.dense :], mean)])

    def final(self, snapshot: torch.Tensor, mean) -> torch.Tensor:
        """The inner synchronizer's final dense model (or the replicas' mean), and the rows
        synced once more."""
        mean = as_mean(mean)
        final = getattr(self.inner, "final", None)
        head = snapshot[: self.dense]
        dense = mean(head) if final is None else final(head, mean)
        return torch.cat([dense, self._tables(snapshot[self.dense :], mean)])

    def _tables(self, x: torch.Tensor, mean) -> torch.Tensor:
        """The rows' new values ``[t]`` (collective over ``mean``'s group)."""
        group = getattr(mean, "group", None)
        if not isinstance(group, dist.ProcessGroup):
            raise TypeError("table rows are synced over a process group's exact mean (GroupMean)")
        ledger = getattr(mean, "ledger", None)
        if self.rows == "all":
            self.anchor = GroupMean(group, ledger)(x)  # (no parts: those are the dense part's)
            return self.anchor.clone()
        change = x - self.anchor
        touched = torch.cat([(c.view(r, n) != 0).any(dim=1).float() for c, (r, n) in self._split(change)])
        both = torch.cat([change, touched])  # summed: the changes, then the touches of every row
        if ledger is not None:
            ring = ring_allreduce_bytes(both.numel() * both.element_size(), group.size())
            ledger.record(CATEGORY, sent=ring, received=ring, direction="sync")
        dist.all_reduce(both, group=group)
        total, counts = both[: change.numel()], both[change.numel() :].clamp_(min=1)
        at, out = 0, []
        for piece, (r, n) in self._split(total):
            out.append((piece.view(r, n) / counts[at : at + r, None]).reshape(-1))
            at += r
        self.anchor = self.anchor + torch.cat(out) if out else self.anchor.clone()
        return self.anchor.clone()

    def _split(self, x: torch.Tensor) -> list[tuple[torch.Tensor, tuple[int, int]]]:
        sizes = [r * n for r, n in self.shapes]
        return list(zip(torch.split(x, sizes), self.shapes))

    def state_dict(self) -> dict:
        return {**self.inner.state_dict(), "table_anchor": self.anchor}

    def load_state_dict(self, state: dict) -> None:
        self.inner.load_state_dict(state)
        if state.get("table_anchor") is not None:
            self.anchor = state["table_anchor"]


def table_shapes(params: list[torch.nn.Parameter]) -> list[tuple[int, int]]:
    """The ``(rows, columns)`` of the trailing table weights of a replica's ``params``: the
    2-D parameters autograd does not train (their rows are written by the sparse optimizer),
    after every trained one. Empty: no tables (a flat run's dense replica)."""
    shapes: list[tuple[int, int]] = []
    for p in reversed(params):
        if p.requires_grad or p.dim() != 2:
            break
        shapes.append((p.shape[0], p.shape[1]))
    return shapes[::-1]


def with_table_rows(sync: Synchronizer, params: list[torch.nn.Parameter], mean, *,
                    rows: str = "touched") -> Synchronizer:
    """``sync`` wrapped in :class:`TableRows` when the replica ends with table rows and its
    rounds average exactly (a :class:`GroupMean`); else ``sync`` itself."""
    shapes = table_shapes(params)
    if not shapes or not isinstance(mean, GroupMean):
        return sync
    dense = sum(p.numel() for p in params) - sum(r * n for r, n in shapes)
    return TableRows(sync, dense, shapes, rows=rows)
