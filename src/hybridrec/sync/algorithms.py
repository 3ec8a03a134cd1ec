"""Synchronizers of dense replicas (ShadowSync's algorithms): MA, EASGD and BMUF.

Every rank trains its own dense replica (no gradient all-reduce); a synchronizer makes the
replicas meet, one *round* at a time. A round takes this rank's snapshot ``s`` (the
replica's parameters flattened, ``[n]`` float32), runs one all-reduce over the sync group
and returns the *target* ``t`` ``[n]`` the replica should become; the runner
(:mod:`hybridrec.sync.runners`) writes it back. Each algorithm is a small state object:

- :class:`ModelAveraging` (MA): ``t = mean_i s_i``. No state.
- :class:`ElasticAveraging` (EASGD, centre replicated on every rank): with the centre ``c``,
  ``c <- c + beta (mean_i s_i - c)``, then ``t = s - alpha (s - c)`` toward the *updated*
  centre: the EASGD of Zhang, Choromanska and LeCun 2015, whose centre moves at
  ``beta = N alpha`` (N ranks: the elastic force is symmetric). The paper's synchronous
  equations pull toward the centre *before* its update (``pull="stale"``); the centre then
  lags the replicas by about the progress of one round, and the pull drags every replica
  back: in steady state the replicas and the centre move ``beta / (alpha + beta) =
  N / (N + 1)`` of what the replicas trained, 2/3 across 2 groups (with the updated centre:
  ``beta / (beta + alpha (1 - beta))``, 0.95). That drag, and the table rows' elastic
  averaging (:mod:`hybridrec.sync.rows`), were why background EASGD across 2 groups trained
  0.020-0.030 AUC below flat training (docs/benchmarks.md). Both pulls contract the
  replicas' differences alike (by ``1 - alpha`` a round); the updated centre is the order
  of the paper's asynchronous algorithm, whose centre already holds the moves of the
  workers that communicated before. By default ``beta`` is fixed at 0.9, the value of the
  paper's experiments, and ``alpha = beta / N``, so ``beta < 1`` for any N (a fixed
  ``alpha`` of 0.25 gave ``N alpha >= 1`` from 4 ranks on: the centre became each round's
  mean, and EASGD "move alpha toward last round's mean"). An explicit ``alpha`` keeps
  ``beta = min(1, N alpha)``. The final model (:meth:`ElasticAveraging.final`) is the
  centre, as in the paper, moved once more toward the replicas' last mean. ``alpha = 0``:
  independent training.
- :class:`BlockMomentum` (BMUF, Chen & Huo 2016): with the global model ``g`` and the block
  momentum ``delta``: the replicas started the block from ``b``, the previous round's target
  (``b = g + mu delta`` with Nesterov, ``b = g`` without); ``d = mean_i s_i - b``,
  ``delta <- mu delta + zeta d``, ``g <- g + delta``; ``t = g + mu delta`` (Nesterov) or
  ``t = g``. ``mu = 0, zeta = 1``: MA. The block gradient ``d`` is measured from where the
  replicas started (the paper's ``W_g(t-1)``), not from ``g``: measured from ``g``, the
  look-ahead ``mu delta`` handed out last round comes back inside ``d`` and the recursion
  becomes ``delta <- mu (1 + zeta) delta + zeta p`` (``p``: the replicas' mean progress),
  momentum 1 at ``mu = 0.5, zeta = 1``: the block momentum never decays and the dense model
  runs away (the divergence measured at 100 Mbit/s before this was fixed, docs/benchmarks.md).
  In steady state BMUF multiplies the replicas' progress by ``zeta / (1 - mu)``. The block
  momentum defaults to ``1 - 1/N`` (N ranks), Chen and Huo's advice (with ``zeta = 1``):
  the more replicas a block averages, the less each block's mean progress is worth alone.

The centre and the global model start as the replica at :meth:`Synchronizer.init` (every
rank holds the same initial dense model: same seed, or the same checkpoint) and are kept
identical on every rank by construction (each rank applies the same all-reduced mean), so
they are checkpointed once, as global state.

A synchronizer may also say what the final model is (``final(snapshot, mean)``, collective
like a round): EASGD's centre. Without one the runner's last average is the replicas' mean.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.distributed as dist

from hybridrec.comm.ledger import ring_allreduce_bytes

CATEGORY = "sync"  # the ledger's category of every synchronizer round


class Synchronizer(Protocol):
    name: str

    def init(self, replica: torch.Tensor) -> None:
        """Start from ``replica`` ``[n]`` (the same on every rank) unless state was loaded."""

    def round(self, snapshot: torch.Tensor, mean: Mean | dist.ProcessGroup) -> torch.Tensor:
        """Collective over the sync group (``mean``'s, or a process group's exact mean):
        the target ``[n]`` of this rank's replica."""

    def state_dict(self) -> dict:
        """Its tensors are never written in place afterwards (a round makes new ones), so a
        checkpoint may write them while the next round runs."""

    def load_state_dict(self, state: dict) -> None: ...


def mean_over(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """``mean_i x_i`` over ``group`` (one all-reduce of ``x``'s size; ``x`` is not modified)."""
    out = x.clone()
    dist.all_reduce(out, group=group)
    return out.div_(group.size())


class Mean(Protocol):
    """How a round averages the replicas over the sync group: ``mean(x)`` is collective and
    returns ``mean_i x_i`` ``[n]`` (exactly, or through a compressor:
    :class:`hybridrec.sync.compressed.CompressedMean`); ``size()`` is the group's size."""

    def __call__(self, x: torch.Tensor) -> torch.Tensor: ...

    def size(self) -> int: ...


class GroupMean:
    """The exact mean: plain all-reduces over ``group``, counted in ``ledger`` (category
    ``sync``) as ring all-reduces. ``parts``: lengths of consecutive pieces of ``x`` averaged
    by all-reduces of their own (hierarchical training: the dense part, equal on every member
    of a group, apart from the member's shards, so that its sum runs in the same order on
    every cross group whatever the shards' sizes); empty: one all-reduce."""

    def __init__(self, group: dist.ProcessGroup, ledger=None, parts: tuple[int, ...] = ()) -> None:
        self.group, self.ledger, self.parts = group, ledger, tuple(parts)

    def size(self) -> int:
        return self.group.size()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([self._one(piece) for piece in split_parts(x, self.parts)])

    def _one(self, x: torch.Tensor) -> torch.Tensor:
        if self.ledger is not None:
            ring = ring_allreduce_bytes(x.numel() * x.element_size(), self.group.size())
            self.ledger.record(CATEGORY, sent=ring, received=ring, direction="sync")
        return mean_over(x, self.group)


def split_parts(x: torch.Tensor, parts: tuple[int, ...]) -> list[torch.Tensor]:
    """``x`` ``[n]`` as views of the given leading lengths and the rest (empty pieces dropped)."""
    if not parts:
        return [x]
    pieces = list(torch.split(x, [*parts, x.numel() - sum(parts)]))
    return [p for p in pieces if p.numel()]


def as_mean(group_or_mean) -> Mean:
    """A process group means its exact :class:`GroupMean` (uncounted)."""
    return GroupMean(group_or_mean) if isinstance(group_or_mean, dist.ProcessGroup) else group_or_mean


class ModelAveraging:
    name = "ma"
    state_copies = 0

    def init(self, replica: torch.Tensor) -> None:
        pass

    def round(self, snapshot, mean):
        return as_mean(mean)(snapshot)

    def state_dict(self) -> dict:
        return {"name": self.name}

    def load_state_dict(self, state: dict) -> None:
        _check_name(self, state)


EASGD_BETA = 0.9  # the centre's moving rate N alpha by default: the paper's experiments


class ElasticAveraging:
    name = "easgd"
    state_copies = 1  # the centre

    def __init__(self, alpha: float | None = None, *, beta: float = EASGD_BETA, pull: str = "updated") -> None:
        """``alpha`` None: ``beta / N`` (N: the sync group's size, known at the first round).
        ``pull``: the centre the replicas move toward, ``updated`` (this round's) or
        ``stale`` (the previous round's: the paper's synchronous equations; module docstring)."""
        if alpha is not None and not 0 <= alpha <= 1:
            raise ValueError(f"EASGD alpha must be in [0, 1], got {alpha}")
        if not 0 < beta < 1:
            raise ValueError(f"EASGD beta must be in (0, 1), got {beta}")
        if pull not in ("updated", "stale"):
            raise ValueError(f"EASGD pull {pull!r}: updated or stale")
        self.alpha, self.beta, self.pull = alpha, beta, pull
        self.centre: torch.Tensor | None = None  # [n], identical on every rank

    def rates(self, n: int) -> tuple[float, float]:
        """``(alpha, beta)`` over ``n`` ranks: the replicas' and the centre's moving rates."""
        if self.alpha is None:
            return self.beta / n, self.beta
        return self.alpha, min(1.0, n * self.alpha)  # (capped: the centre never overshoots the mean)

    def init(self, replica: torch.Tensor) -> None:
        if self.centre is None:
            self.centre = replica.detach().clone()

    def round(self, snapshot, mean):
        mean = as_mean(mean)
        alpha, beta = self.rates(mean.size())
        c = self.centre
        self.centre = c + beta * (mean(snapshot) - c)
        return snapshot - alpha * (snapshot - (self.centre if self.pull == "updated" else c))

    def final(self, snapshot, mean):
        """The final model: the centre after one more move toward the replicas' mean (the
        elastic average the paper evaluates; measured against the replicas' mean in
        docs/benchmarks.md)."""
        mean = as_mean(mean)
        _, beta = self.rates(mean.size())
        self.centre = self.centre + beta * (mean(snapshot) - self.centre)
        return self.centre.clone()

    def state_dict(self) -> dict:
        return {"name": self.name, "alpha": self.alpha, "centre": self.centre}

    def load_state_dict(self, state: dict) -> None:
        _check_name(self, state)
        self.centre = state["centre"]


class BlockMomentum:
    name = "bmuf"
    state_copies = 2  # the global model and the block momentum

    def __init__(self, block_momentum: float | None = None, block_lr: float = 1.0, *, nesterov: bool = True) -> None:
        """``block_momentum`` None: ``1 - 1/N`` (N: the sync group's size, at the first round)."""
        if (block_momentum is not None and not 0 <= block_momentum < 1) or block_lr <= 0:
            raise ValueError(f"BMUF needs 0 <= mu < 1 and zeta > 0, got {block_momentum}, {block_lr}")
        self.block_momentum, self.zeta, self.nesterov = block_momentum, block_lr, nesterov
        self.mu = 0.0 if block_momentum is None else block_momentum  # (None: set by the first round)
        self.global_model: torch.Tensor | None = None  # [n] g, identical on every rank
        self.delta: torch.Tensor | None = None  # [n] block momentum

    def init(self, replica: torch.Tensor) -> None:
        if self.global_model is None:
            self.global_model = replica.detach().clone()
            self.delta = torch.zeros_like(self.global_model)

    def round(self, snapshot, mean):
        mean = as_mean(mean)
        self.mu = self.momentum(mean.size())
        start = self.global_model + self.mu * self.delta if self.nesterov else self.global_model
        d = mean(snapshot) - start  # the block's progress from where it started
        self.delta = self.mu * self.delta + self.zeta * d
        self.global_model = self.global_model + self.delta
        return self.global_model + self.mu * self.delta if self.nesterov else self.global_model.clone()

    def momentum(self, n: int) -> float:
        """The block momentum over ``n`` ranks."""
        return 1.0 - 1.0 / n if self.block_momentum is None else self.block_momentum

    def state_dict(self) -> dict:
        return {"name": self.name, "global_model": self.global_model, "delta": self.delta}

    def load_state_dict(self, state: dict) -> None:
        _check_name(self, state)
        self.global_model, self.delta = state["global_model"], state["delta"]


SYNCHRONIZERS = {s.name: s for s in (ModelAveraging, ElasticAveraging, BlockMomentum)}
"""Every synchronizer class by its ``sync.algorithm`` name; each says its ``state_copies``, the
replica-sized tensors of state it keeps between rounds (the memory estimate,
:func:`hybridrec.train.setup.memory.sync_copies`, counts them)."""

ALGORITHMS = tuple(SYNCHRONIZERS)
"""The synchronizers' names (``sync.algorithm`` takes them, or ``none``): the one list, read by
the config's rules, the memory estimate and the step's cost model (:mod:`hybridrec.bench.hier_cost`)."""


def either(names) -> str:
    """``a, b or c``: how a message lists the names it takes."""
    names = list(names)
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} or {names[-1]}"


def _check_name(sync, state: dict) -> None:
    if state.get("name") != sync.name:
        raise ValueError(f"synchronizer state is for {state.get('name')!r}, not {sync.name!r}")


def make_synchronizer(algorithm: str, *, alpha: float | str | None = None,
                      block_momentum: float | str | None = None, block_lr: float = 1.0,
                      nesterov: bool = True) -> Synchronizer:
    """``alpha`` / ``block_momentum`` None or ``"auto"`` (the config's default): from the
    number of ranks, as the papers advise (module docstring)."""
    if algorithm == ModelAveraging.name:
        return ModelAveraging()
    if algorithm == ElasticAveraging.name:
        return ElasticAveraging(_given(alpha))
    if algorithm == BlockMomentum.name:
        return BlockMomentum(_given(block_momentum), block_lr, nesterov=nesterov)
    raise ValueError(f"unknown synchronizer {algorithm!r}: {either(ALGORITHMS)}")


def _given(value: float | str | None) -> float | None:
    """A rate the user set, or None for ``"auto"``."""
    return None if value is None or value == "auto" else float(value)
