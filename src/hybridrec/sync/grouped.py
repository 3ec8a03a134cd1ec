"""Background rounds across the groups of hierarchical training.

With ``dist.group_size`` below the world, rank ``j`` of every group holds the same shards,
so the replica a round averages is per member: the dense arches (equal inside a group:
DDP) and the member's embedding shards; each member's rounds run on its cross group.

Inside a group the dense arches must stay *bitwise* equal (DDP averages gradients, it
never re-aligns weights), so the members must snapshot the same step and write their
targets back at the same step. :class:`GroupedBackgroundRunner` does both by agreement:
after every training step the members all-reduce two flags (MIN over the group: "my
thread waits for a snapshot", "my thread's target is ready"), 8 bytes on the group's fast
link; a snapshot is taken, or a target written back, only at a step where every member's
flag is set. The same rounds then start from the same dense values on every member, and
the cross groups' all-reduces of equal dense values give equal results (the same sizes and
group order on every cross group: the same summation order).

A checkpoint parks the training threads (:meth:`GroupedBackgroundRunner.parked`): group 0
saves, which waits for the synchronizer's state, i.e. for a round in flight, whose
all-reduce needs the other groups' snapshots, while their training threads wait for group
0 at a barrier. Parked at one step, a member's thread takes its snapshot itself.

Rounds are in lockstep over the whole world: the stop flag of
:class:`~hybridrec.sync.runners.BackgroundRunner` is all-reduced over every rank
(``flag_group``), so every member runs the same rounds and all stop after the same one.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

from hybridrec.comm.exchange import collective_device
from hybridrec.sync.runners import BackgroundRunner

AGREE_CATEGORY = "sync_members"  # the per-step agreement inside a group (ledger)


class GroupedBackgroundRunner(BackgroundRunner):
    """:class:`BackgroundRunner` whose snapshots and write-backs happen at steps the
    ``members`` of this rank's group agree on; ``flag_group``: every rank (the stop flag)."""

    def __init__(self, *args, members: dist.ProcessGroup, flag_group: dist.ProcessGroup, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.members = members
        self.flag_group = flag_group
        self._want = False  # the thread waits for a snapshot
        self._given: torch.Tensor | None = None  # the snapshot the training thread took for it
        self._final = False  # no more training steps: snapshots are taken at once
        self._parked = False  # the training thread is out of the step loop (parked())

    @contextlib.contextmanager
    def parked(self):
        """The training thread leaves the step loop for a while at a step boundary (a
        checkpoint: group 0 saves while the other groups wait for it). Every member parks
        at the same step, so meanwhile the thread may snapshot the replica itself: a round
        in flight, whose all-reduce a saving group's state_dict waits on, can complete.
        (Within it, as for every runner, the checkpoint's state is one capture.)"""
        with super().parked():
            with self._cond:
                self._parked = True
                self._cond.notify_all()
            try:
                yield
            finally:
                with self._cond:
                    self._parked = False

    def _snapshot(self) -> torch.Tensor | None:
        with self._cond:
            if self._final or self._parked:  # no step runs: every member holds the same replica
                return self.flat()
            self._want = True
            self._cond.notify_all()
            while self._given is None and not self._final and not self._parked:
                self._cond.wait()
            snapshot = self._given if self._given is not None else self.flat()
            self._given, self._want = None, False
            return snapshot

    def after_step(self, step: int) -> None:
        with self._cond:
            self.step = step
            flags = torch.tensor([int(self._want and self._given is None), int(self._pending is not None)],
                                 dtype=torch.int32, device=collective_device(self.members))
        # Collective on the group, every step: both flags only ever go from 0 to 1 in the
        # thread meanwhile, so a MIN of 1 means every member can do it now.
        dist.all_reduce(flags, op=dist.ReduceOp.MIN, group=self.members)
        if self.ledger is not None:
            self.ledger.record(AGREE_CATEGORY, sent=8, received=8, direction="sync")
        snap, ready = flags.tolist()  # host read: the step's decision
        with self._cond:
            if ready:
                self._apply_pending()
            if snap:
                self._given = self.flat()
            self._cond.notify_all()
        self.raise_if_dead()  # (after the members' agreement: every member took part in it)

    def stop(self) -> None:
        with self._cond:
            self._final = True
            self._cond.notify_all()
        super().stop()
