"""Predicted time of one training step on G groups x M ranks, flat or hierarchical.

Pure arithmetic, no processes. The all-to-all bytes come from the same layout as
:mod:`hybridrec.parallel.cost_model` (:func:`plan_owners`), or from an ideal balanced
sharding for clusters too large to plan (:func:`balanced_owners`).

**Topology.** ``W = G * M`` ranks; ranks ``[g*M, (g+1)*M)`` form group g (a machine). Every
rank has its own link to its group's switch, ``Links.intra`` bytes/s each way; every group
has one link to the other groups, ``Links.cross`` bytes/s each way, shared by every flow
that leaves or enters the group (a machine's NIC; the namespace cluster's ``g<g>`` link).
A byte from rank r of group g to rank s of group h != g goes up r's link, up g's cross
link, down h's cross link and down s's link.

**Training.** Flat: one sharding group of all W ranks (tables sharded over W, the pooled
embeddings all-to-all over W, DDP's ring all-reduce over W). Hierarchical: G identical
sharding groups of M; a step all-to-alls and all-reduces inside its group only; a sync round
averages the replica (dense parameters + member j's shards) over the G members j: one
all-reduce per member index, the M of them at once, all through every group's cross link.
MA, EASGD and BMUF each run one all-reduce of the replica per round
(:mod:`hybridrec.sync.algorithms`), so they cost the same here. A round averages the float32
weights only (no optimizer state); ``sync.compress=dct`` is assumed to send each member's
sparse message to each peer, as the dense DCT exchange does (:class:`SyncSpec`).

**Step.** ``t_free = compute + input + output_fwd + output_bwd + dense`` (:func:`step_phases`):
the phases run one after another and overlap nothing (DDP's overlap of the all-reduce with
backward and ``dist.pipeline`` are not modelled). A phase lasts as long as its busiest link
direction needs, ``max_L load_L / (eff * rate_L)`` (:meth:`Loads.seconds`): links work in
parallel, each at ``eff`` x its rate (gloo's all-to-all reaches about half of it,
docs/benchmarks.md), on a group link at ``Links.cross_a2a(M)`` (several ranks' flows fill
it better); no latency (a step's messages are megabytes). Sync: foreground adds its
round to every ``every``-th step (:func:`foreground_cost`); background costs the step only
where a link cannot carry the step's bytes and the round's share of them
(:func:`background_cost`), and, given a :class:`HostCpu`, what its host work takes
(:func:`host_cost`: the shadow thread's CPU out of the cores the step computes on, the
write-back, the members' per-step agreement). Not modelled: the CPU of foreground rounds,
the CPU the step's own communication needs (a phase is as long as its links say, even on
oversubscribed cores), the compute imbalance of uneven plans (``compute_s`` is one number
for every rank), stragglers, and the run's final average (one-off, not per step).

Worked example (the tests' hand case): 2 tables of 10 x 4 one-hot, batch 10 per rank, 400
dense bytes, 1 s compute, intra 1000 B/s, cross 100 B/s, flat on 2 groups of 1 rank,
balanced: each rank owns one table; per step a rank sends the other ``10 * (4 + 4) + 16 =
96`` input bytes (int32 lengths and ids, int64 counts), 160 output bytes and 160 gradient
bytes, all across the cross link: 0.96 + 1.6 + 1.6 s, plus a 400-byte ring all-reduce (4 s):
9.16 s, 20 / 9.16 samples/s. Hierarchical 2 x 1: no all-to-all or all-reduce (1 s steps); a round sends
``400 + 320 = 720`` bytes each way over the cross link (7.2 s), in the background every
``7.2 / (0.5 * 1) = 14.4`` steps at duty 0.5, free for the step.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass

import torch

from hybridrec.comm.codecs import Codec
from hybridrec.comm.compress import DCTCompressor
from hybridrec.comm.sparse_message import FixedLayout, encoded_size
from hybridrec.model.embedding import TableConfig
from hybridrec.parallel.cost_model import COUNT_BYTES, VALUE_BYTES
from hybridrec.parallel.layout import build_layout, id_dtype
from hybridrec.parallel.plan import ShardingPlan
from hybridrec.sync.algorithms import ALGORITHMS, ModelAveraging

MODES = ("background", "foreground")
SYNC_COMPRESS = ("none", "fp16", "bf16", "dct")


# -- inputs ------------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class Links:
    """Link rates in bytes/s per direction, and how much of them a collective reaches."""

    intra: float
    """Each rank's own link to its group's switch (inside a machine)."""
    cross: float
    """Each group's link to the other groups, shared by all its ranks' flows."""
    a2a_efficiency: float = 1.0
    """Share of the rate an all-to-all reaches: gloo's ``all_to_all_single`` ~0.5 on 2 ranks,
    ~0.6 on 4; ``dist.exchange=pairwise`` ~0.9 (docs/benchmarks.md, gloo link rates)."""
    allreduce_efficiency: float = 1.0
    """The same for a ring all-reduce (gloo: 0.93-0.98)."""
    cross_a2a_efficiency: tuple[tuple[int, float], ...] = ()
    """An all-to-all's share of a *group's* link, by the number of ranks whose flows share it:
    ``((ranks, efficiency), ...)``; M ranks per group take the entry of the largest count
    <= M (:meth:`cross_a2a`); empty, or none <= M: ``a2a_efficiency``. Several ranks' flows
    fill a capped link better than one rank's turn-taking connection does (namespace cluster,
    2026-11-29: 0.48 with 1 rank, 0.72-0.87 with 2, median 0.78; docs/benchmarks.md)."""

    def __post_init__(self) -> None:
        if self.intra <= 0 or self.cross <= 0:
            raise ValueError(f"link rates must be > 0, got {self.intra}, {self.cross}")
        for e in (self.a2a_efficiency, self.allreduce_efficiency,
                  *(e for _, e in self.cross_a2a_efficiency)):
            if not 0 < e <= 1:
                raise ValueError(f"link efficiencies must be in (0, 1], got {e}")
        if any(m < 1 for m, _ in self.cross_a2a_efficiency):
            raise ValueError(f"cross_a2a_efficiency: rank counts must be >= 1, got "
                             f"{self.cross_a2a_efficiency}")

    def cross_a2a(self, ranks: int) -> float:
        """The all-to-all efficiency on a group link shared by ``ranks`` ranks' flows."""
        fits = [(m, e) for m, e in self.cross_a2a_efficiency if m <= ranks]
        return max(fits)[1] if fits else self.a2a_efficiency


@dataclass(frozen=True, kw_only=True)
class SyncSpec:
    """The cross-group synchronizer (``sync.*``)."""

    algorithm: str = ModelAveraging.name
    mode: str = "background"
    every: int = 1
    """Foreground: steps between rounds; background: at least this many."""
    duty: float = 0.5
    """Background: after a round of T seconds the shadow thread rests T (1/duty - 1)."""
    compress: str = "none"
    """``none`` / ``fp16`` / ``bf16``: ring all-reduce of 4 / 2 / 2 bytes per entry; ``dct``:
    every member sends its sparse message (``ratio`` of the entries, float32 values and
    their positions, :func:`~hybridrec.comm.sparse_message.encoded_size`) to the G-1 others."""
    ratio: float = 0.01

    def __post_init__(self) -> None:
        if (self.algorithm not in ALGORITHMS or self.mode not in MODES
                or self.compress not in SYNC_COMPRESS):
            raise ValueError(f"sync: algorithm in {ALGORITHMS}, mode in {MODES}, compress in "
                             f"{SYNC_COMPRESS}; got {self.algorithm}, {self.mode}, {self.compress}")
        if self.every < 1 or not 0 < self.duty <= 1 or not 0 < self.ratio <= 1:
            raise ValueError(f"sync: every >= 1, duty and ratio in (0, 1]; got {self.every}, "
                             f"{self.duty}, {self.ratio}")


@dataclass(frozen=True, kw_only=True)
class HostCpu:
    """What background sync takes from the ranks' CPUs (measured by
    ``benchmarks/shadow_cpu.py``; the module docstring says how it is priced)."""

    round_s_per_byte: float
    """CPU seconds of the shadow thread per replica byte and round (the snapshot copy and the
    round: its all-reduce's reduction and socket work, every thread of the process), exact
    rounds (``none``, ``fp16``, ``bf16``)."""
    dct_round_s_per_byte: float
    """The same with ``sync.compress=dct`` (threshold, sparse message, error feedback)."""
    write_back_s_per_byte: float
    """CPU seconds of the write-back per replica byte: on the training thread, once a round."""
    cores_per_rank: float
    """Cores each rank's training has (a machine's cores over its ranks), all kept busy by its
    compute: the shadow thread's CPU comes out of them."""
    agree_s: float = 0.0
    """Seconds of the per-step agreement of a group's members (an 8-byte all-reduce on the
    group's links; groups of one rank have none)."""

    def __post_init__(self) -> None:
        if min(self.round_s_per_byte, self.dct_round_s_per_byte, self.write_back_s_per_byte,
               self.agree_s) < 0 or self.cores_per_rank <= 0:
            raise ValueError(f"HostCpu: costs must be >= 0 and cores_per_rank > 0, got {self}")

    def round_cpu_s(self, replica_bytes: float, compress: str) -> float:
        """The shadow thread's CPU seconds for one round of ``replica_bytes``."""
        per = self.dct_round_s_per_byte if compress == "dct" else self.round_s_per_byte
        return per * replica_bytes

    def scaled(self, factor: float) -> HostCpu:
        """The CPU costs times ``factor`` (another processor: its step time over the measuring
        one's); ``cores_per_rank`` and ``agree_s`` unchanged."""
        return HostCpu(round_s_per_byte=self.round_s_per_byte * factor,
                       dct_round_s_per_byte=self.dct_round_s_per_byte * factor,
                       write_back_s_per_byte=self.write_back_s_per_byte * factor,
                       cores_per_rank=self.cores_per_rank, agree_s=self.agree_s)


@dataclass(frozen=True, kw_only=True)
class Workload:
    """The model, its sharding and one rank's batch and compute."""

    tables: tuple[TableConfig, ...]
    dense_params: int
    """Parameters of the dense arches (float32; :func:`dlrm_dense_params`)."""
    batch_per_rank: int
    compute_s: float
    """One step's computation on one rank at ``batch_per_rank``, measured from a 1-rank run
    (a sharded rank looks up the group's batch in its share of the tables: about the same
    work as its own batch in all of them)."""
    ids_per_bag: float | Mapping[str, float] = 1.0
    """Mean ids per bag, per feature (missing: 1) or for all."""
    plan: Callable[[int], ShardingPlan] | None = None
    """The sharding of n ranks (e.g. ``train.tables.uniform_plan``); None:
    :func:`balanced_owners`."""
    codecs: Mapping[str, Codec] | None = None
    """Codecs of the pooled-embedding hop (``plan`` only), as the collection takes them."""


def dlrm_dense_params(num_dense: int, num_features: int, dim: int, bottom_mlp: Sequence[int],
                      top_mlp: Sequence[int], interaction: str = "dot") -> int:
    """Weights and biases of DLRM's MLPs: ``sum a*b + b`` over consecutive widths of
    ``[num_dense, *bottom]`` and ``[top_in, *top]``, ``top_in = dim + F(F+1)/2`` (dot) or
    ``dim (F+1)`` (cat), as ``train.memory.dense_model_bytes`` counts them."""
    if interaction not in ("dot", "cat"):
        raise ValueError(f"interaction {interaction!r}: dot or cat")
    top_in = (dim + (num_features + 1) * num_features // 2 if interaction == "dot"
              else dim * (num_features + 1))
    widths = ([num_dense, *bottom_mlp], [top_in, *top_mlp])
    return sum(a * b + b for w in widths for a, b in itertools.pairwise(w))


# -- what each rank of a sharding group owns ---------------------------------------------
@dataclass(frozen=True)
class Owner:
    """One rank of a sharding group, per sample of every source rank."""

    ids: float
    """input_dist bytes a source sends it per sample (bag lengths and ids, int32 unless a
    table has more than 2^31 rows)."""
    fwd: float
    """output_dist bytes it sends a source per sample (its pieces, as encoded)."""
    bwd: float
    """Gradient bytes a source sends it per sample."""
    weights: float
    """Float32 bytes of its shards (a sync round averages them with the dense part)."""


def _ids(tables: Sequence[TableConfig], ids_per_bag: float | Mapping[str, float]) -> dict:
    if isinstance(ids_per_bag, Mapping):
        return {f: float(ids_per_bag.get(f, 1.0)) for t in tables for f in t.features}
    return {f: float(ids_per_bag) for t in tables for f in t.features}


def balanced_owners(tables: Sequence[TableConfig], n: int,
                    ids_per_bag: float | Mapping[str, float] = 1.0) -> list[Owner]:
    """An ideal table-wise sharding over ``n`` ranks: each owns ``1/n`` of every table
    (fractional tables allowed), float32:
    ``ids = sum_f (1 + ids_f) * 4 / n`` (8 with a table over 2^31 rows), ``fwd = bwd = sum_f 4 k_f / n``,
    ``weights = sum_t 4 rows_t k_t / n``. With n > number of tables this is the balance no
    real plan reaches (a column split sends a feature's ids to every column owner)."""
    ids = _ids(tables, ids_per_bag)
    item = id_dtype(max((t.num_embeddings for t in tables), default=0)).itemsize
    id_total = sum((1 + ids[f]) * item for t in tables for f in t.features)
    pooled = sum(VALUE_BYTES * t.embedding_dim for t in tables for _ in t.features)
    weights = sum(VALUE_BYTES * t.num_embeddings * t.embedding_dim for t in tables)
    return [Owner(id_total / n, pooled / n, pooled / n, weights / n)] * n


def plan_owners(tables: Sequence[TableConfig], plan: ShardingPlan,
                ids_per_bag: float | Mapping[str, float] = 1.0,
                codecs: Mapping[str, Codec] | None = None) -> list[Owner]:
    """The owners of ``plan``, from its layout (:func:`~hybridrec.parallel.layout.build_layout`,
    the bytes :func:`~hybridrec.parallel.cost_model.flows` predicts): per slot
    ``(1 + ids_f * share) * 4`` input bytes (8 with a table over 2^31 rows) (row shards: their ``share`` of the rows), per
    piece its ``fwd_bytes`` / ``bwd_bytes``. Data-parallel tables are not modelled."""
    layout = build_layout(list(tables), plan, codecs)
    if layout.replicated_tables:
        raise ValueError(f"data-parallel tables are not modelled: {layout.replicated_tables}")
    ids = _ids(tables, ids_per_bag)
    item = layout.id_dtype.itemsize
    weights = [0.0] * plan.world_size
    for tp in plan.tables.values():
        for s in tp.shards:
            weights[s.rank] += s.num_rows * s.num_cols * VALUE_BYTES
    out = []
    for o in range(plan.world_size):
        shares = [(s, s.shard.num_rows / s.table_rows if s.row_split else 1.0)
                  for s in layout.slots[o]]
        id_total = sum((1 + ids[s.feature] * share) * item for s, share in shares)
        pieces = layout.blocks[o].pieces
        out.append(Owner(id_total, sum(p.fwd_bytes for p in pieces),
                         sum(p.bwd_bytes for p in pieces), weights[o]))
    return out


def sharding_owners(w: Workload, n: int) -> list[Owner]:
    """The owners of a sharding group of ``n`` ranks under ``w``'s plan (or balanced)."""
    if w.plan is None:
        return balanced_owners(w.tables, n, w.ids_per_bag)
    plan = w.plan(n)
    if plan.world_size != n:
        raise ValueError(f"plan for {n} ranks has {plan.world_size}")
    return plan_owners(w.tables, plan, w.ids_per_bag, w.codecs)


# -- bytes on every link direction -------------------------------------------------------
@dataclass(frozen=True)
class Loads:
    """Bytes one phase puts on every link direction: ``up[r]`` / ``down[r]`` on rank r's own
    link, ``xup[g]`` / ``xdown[g]`` on group g's cross link."""

    up: tuple[float, ...]
    down: tuple[float, ...]
    xup: tuple[float, ...]
    xdown: tuple[float, ...]

    def reversed(self) -> Loads:
        """The same flows the other way (every source and destination swapped)."""
        return Loads(self.down, self.up, self.xdown, self.xup)

    def seconds(self, links: Links, eff: float, cross_eff: float | None = None) -> list[float]:
        """Seconds every link direction needs for its bytes: ``load / (eff * rate)`` (the
        group links at ``cross_eff`` when given), in the order up, down, xup, xdown."""
        own, cross = eff * links.intra, (eff if cross_eff is None else cross_eff) * links.cross
        return ([b / own for b in (*self.up, *self.down)]
                + [b / cross for b in (*self.xup, *self.xdown)])

    def time_s(self, links: Links, eff: float, cross_eff: float | None = None) -> float:
        """The phase's duration: its busiest link direction's seconds."""
        return max(self.seconds(links, eff, cross_eff), default=0.0)


def to_owners(per_owner: Sequence[float], per_pair: float, batch: int, group_size: int) -> Loads:
    """Every rank sends every other rank o ``x_o = batch * per_owner[o] + per_pair`` bytes
    (input_dist, gradients), over N = len(per_owner) ranks in groups of M = ``group_size``:
    ``up[r] = X - x_r``, ``down[o] = (N-1) x_o``, ``xup[g] = M (X - X_g)``,
    ``xdown[g] = (N-M) X_g`` with ``X = sum x``, ``X_g`` its sum over group g."""
    n, m = len(per_owner), group_size
    if n % m and n > m:
        raise ValueError(f"{n} ranks do not split into groups of {m}")
    x = [batch * c + per_pair for c in per_owner]
    total = sum(x)
    groups = [sum(x[g:g + m]) for g in range(0, n, m)] if n > m else [total]
    m = min(m, n)
    return Loads(tuple(total - v for v in x), tuple((n - 1) * v for v in x),
                 tuple(m * (total - xg) for xg in groups), tuple((n - m) * xg for xg in groups))


def from_owners(per_owner: Sequence[float], batch: int, group_size: int) -> Loads:
    """Every owner o sends every other rank ``batch * per_owner[o]`` bytes (output_dist
    forward): :func:`to_owners` reversed."""
    return to_owners(per_owner, 0.0, batch, group_size).reversed()


def ring_loads(nbytes: float, n: int, group_size: int) -> Loads:
    """Ring all-reduce of ``nbytes`` over ranks 0..n-1 in order: every rank sends its
    successor and receives ``2 (n-1)/n * nbytes``; the ring leaves and enters each group
    once (rank ``gM+M-1`` -> ``(g+1)M``), so every cross link carries the same, when the
    ring spans several groups."""
    per = 2 * (n - 1) / n * nbytes
    groups = max(1, n // group_size)
    cross = per if groups > 1 else 0.0
    return Loads((per,) * n, (per,) * n, (cross,) * groups, (cross,) * groups)


def step_phases(owners: Sequence[Owner], batch: int, dense_bytes: float,
                group_size: int) -> dict[str, tuple[Loads, str]]:
    """The loads of one step of a sharding group (``owners``, one per rank) split into
    groups of ``group_size``: ``{phase: (loads, "a2a" | "allreduce")}`` for ``input``
    (counts and ids), ``output_fwd``, ``output_bwd`` and ``dense`` (DDP's ring)."""
    n = len(owners)
    if n == 1:  # one rank holds every table: no distribution, no DDP
        none = Loads((0.0,), (0.0,), (0.0,), (0.0,))
        return {k: (none, "a2a") for k in ("input", "output_fwd", "output_bwd")} | {
            "dense": (none, "allreduce")}
    return {"input": (to_owners([o.ids for o in owners], COUNT_BYTES, batch, group_size), "a2a"),
            "output_fwd": (from_owners([o.fwd for o in owners], batch, group_size), "a2a"),
            "output_bwd": (to_owners([o.bwd for o in owners], 0.0, batch, group_size), "a2a"),
            "dense": (ring_loads(dense_bytes, n, group_size), "allreduce")}


def sync_round_loads(owners: Sequence[Owner], dense_bytes: float, groups: int,
                     spec: SyncSpec) -> tuple[Loads, str]:
    """One round's loads on one group's links (every group alike) and its kind. Member j
    averages ``n_j = (dense_bytes + weights_j) / 4`` entries with its G-1 peers:
    ring (``none``/``fp16``/``bf16``, v = 4/2/2 bytes): ``b_j = 2 (G-1)/G * n_j * v``;
    ``dct``: ``b_j = (G-1) *`` the fixed-size buffer of a message bounded at
    ``ceil(1.25 ceil(ratio n_j))`` entries (``compress.dense_cap``'s default;
    :class:`~hybridrec.comm.sparse_message.FixedLayout`, padding included). Member j's link carries
    ``b_j`` each way, the group's cross link ``sum_j b_j`` (every member's peers are in
    other groups)."""
    per = []
    for o in owners:
        n = round((dense_bytes + o.weights) / VALUE_BYTES)
        if groups == 1:
            per.append(0.0)
        elif spec.compress == "dct":  # the bounded message in its fixed-size buffer (ratio 1: as sent)
            cap = DCTCompressor(spec.ratio, 1).capacity(n)
            per.append((groups - 1) * (encoded_size(n, n, torch.float32) if cap is None
                                       else FixedLayout(cap, n, torch.float32).nbytes))
        else:
            v = VALUE_BYTES if spec.compress == "none" else 2
            per.append(2 * (groups - 1) / groups * n * v)
    kind = "a2a" if spec.compress == "dct" else "allreduce"
    return Loads(tuple(per), tuple(per), (sum(per),), (sum(per),)), kind


# -- sync cost ---------------------------------------------------------------------------
def foreground_cost(sigma: Sequence[float], t_free: float,
                    every: int) -> tuple[float, float, float]:
    """``(step_s, round_s, gap_steps)`` of rounds inside the loop every ``every`` steps: the
    round has the links to itself, ``T = max_L sigma_L`` (its link-seconds), and every
    ``every``-th step waits for it: ``t = t_free + T / every``."""
    round_s = max(sigma, default=0.0)
    return t_free + round_s / every, round_s, float(every)


def background_cost(tau: Sequence[float], sigma: Sequence[float], t_free: float, every: int,
                    duty: float) -> tuple[float, float, float]:
    """``(step_s, round_s, gap_steps)`` of rounds in a shadow thread.

    ``tau_L``: the step's seconds on link direction L, ``sigma_L``: a round's. Contention,
    simply: where the step uses a link too, the round gets half of it (a fair share between
    its flows and the step's), so the round lasts ``T = max_L sigma_L / s_L`` with
    ``s_L = 1/2`` if ``tau_L > 0`` else 1. Rounds start at most every ``every`` steps and rest
    ``T (1/duty - 1)`` after each: interval ``I = max(every * t, T / duty)``. Spread over I,
    a round takes ``sigma_L * t / I`` of every step on L, and the step lasts until each link
    carried both (the link's idle time during compute absorbs the round first)::

        t = max(t_free, max_L min(tau_L + sigma_L / every, tau_L / (1 - duty sigma_L / T)))

    (``t >= tau_L + min(sigma_L / every, t duty sigma_L / T)`` holds from the smaller of the
    two on). A link the step does not use never costs it time. ``gap = I / t``.

    Where ``duty`` sets the pace, a faster cross link means faster, hence more, rounds, whose
    bytes also load the members' own links: the step may then slow as the cross rate grows
    (the gap shrinks), up to ``tau_L / (1 - duty / 2)`` on each shared link; lower the duty
    to trade the gap back. Where ``every`` sets the pace, more bandwidth never slows it."""
    if not any(sigma):
        return t_free, 0.0, 0.0
    round_s = max(s / (0.5 if tl > 0 else 1.0) for tl, s in zip(tau, sigma))
    need = [min(tl + s / every, tl / (1 - duty * s / round_s)) if tl > 0 else 0.0
            for tl, s in zip(tau, sigma)]
    step_s = max(t_free, *need)
    return step_s, round_s, max(every, round_s / (duty * step_s))


def host_cost(cpu: HostCpu, compute_s: float, round_cpu_s: float, interval_s: float,
              write_back: bool, gap_steps: float, replica_bytes: float,
              agree: bool) -> float:
    """Seconds background sync's host work adds to a step (every rank alike).

    The shadow thread uses ``round_cpu_s`` CPU seconds per round, spread over the
    ``interval_s`` between round starts: ``rho = round_cpu_s / interval_s`` cores. While the
    step computes, its ranks keep their ``cores_per_rank`` busy, so the thread's share comes
    out of them: compute runs at ``1 - f`` of its speed, ``f = min(rho / cores_per_rank,
    1/2)`` (at most half: a fair share between the two threads; a round that needs more is
    CPU-bound, which is not priced), i.e. ``compute_s f / (1 - f)`` more; in the step's
    communication the cores are free and the thread's CPU costs nothing. The write-back, on
    the training thread once a round (``write_back``: a round ends within the run),
    ``write_back_s_per_byte * replica_bytes / cores_per_rank`` spread over ``gap_steps``.
    ``agree``: groups of several ranks add ``agree_s`` every step."""
    f = min(round_cpu_s / interval_s / cpu.cores_per_rank, 0.5) if interval_s > 0 else 0.0
    back = (cpu.write_back_s_per_byte * replica_bytes / cpu.cores_per_rank / gap_steps
            if write_back and gap_steps > 0 else 0.0)
    return compute_s * f / (1 - f) + back + (cpu.agree_s if agree else 0.0)


# -- the step ----------------------------------------------------------------------------
@dataclass(frozen=True)
class StepPrediction:
    """One step of every rank, in seconds, and what follows from it."""

    mode: str
    """``flat`` or ``hierarchical``."""
    groups: int
    group_size: int
    compute_s: float
    input_s: float
    output_fwd_s: float
    output_bwd_s: float
    dense_s: float
    sync_s: float
    """What the cross-group sync adds to the step (foreground: its share of a round;
    background: the contention); 0 without sync."""
    step_s: float
    samples_per_s: float
    """The whole cluster's: ``G * M * batch / step_s``."""
    round_s: float
    """One sync round's duration (0: no sync)."""
    gap_steps: float
    """Steps between the starts of two rounds (0: no sync)."""
    cross_bytes_per_step: float
    """Bytes that leave a group per step, summed over groups, each counted once (what
    ``Cluster.cross_bytes`` counts, without Ethernet and TCP headers)."""
    replica_bytes: float
    """Float32 bytes member 0 averages per round (dense + its shards); 0 without sync."""
    host_s: float = 0.0
    """What background sync's host work adds to the step (:func:`host_cost`: the shadow
    thread's CPU taken from compute, the write-back, the members' agreement); 0 without a
    :class:`HostCpu`. ``sync_s`` is the links' contention only."""

    @property
    def a2a_s(self) -> float:
        return self.input_s + self.output_fwd_s + self.output_bwd_s

    def to_dict(self) -> dict:
        return {**asdict(self), "a2a_s": self.a2a_s}


def predict_step(w: Workload, links: Links, groups: int, group_size: int, *,
                 hierarchical: bool, sync: SyncSpec | None = None, cpu: HostCpu | None = None,
                 run_steps: int | None = None) -> StepPrediction:
    """One step of ``groups`` x ``group_size`` ranks (see the module docstring). Flat: one
    sharding group of all ranks, no sync (``sync`` ignored); hierarchical: groups of
    ``group_size`` averaged by ``sync`` (required when ``groups > 1``; with one group it is
    flat, and predicts the same).

    ``cpu``: background sync's host work is priced (:func:`host_cost`); None: it is free.
    ``run_steps``: the run's length; where it ends before its first round does, the shadow
    thread works through the whole run (its CPU spread over the round, not the interval)
    and no write-back happens; None: the steady state of a long run."""
    if groups < 1 or group_size < 1:
        raise ValueError(f"groups and group_size must be >= 1, got {groups}, {group_size}")
    n = group_size if hierarchical else groups * group_size
    owners = sharding_owners(w, n)
    dense_bytes = w.dense_params * VALUE_BYTES
    phases = step_phases(owners, w.batch_per_rank, dense_bytes, group_size)
    effs = {"a2a": links.a2a_efficiency, "allreduce": links.allreduce_efficiency}
    xeffs = {"a2a": links.cross_a2a(group_size), "allreduce": links.allreduce_efficiency}
    times = {k: loads.time_s(links, effs[kind], xeffs[kind]) for k, (loads, kind) in phases.items()}
    t_free = w.compute_s + sum(times.values())
    step_s, round_s, gap, replica, cross, host = t_free, 0.0, 0.0, 0.0, 0.0, 0.0
    if not hierarchical or groups == 1:
        cross = sum(sum(loads.xup) for loads, _ in phases.values())
    else:
        if sync is None:
            raise ValueError("hierarchical training on several groups needs a SyncSpec")
        rloads, kind = sync_round_loads(owners, dense_bytes, groups, sync)
        sigma = rloads.seconds(links, effs[kind], xeffs[kind])
        replica = dense_bytes + owners[0].weights
        if sync.mode == "foreground":
            step_s, round_s, gap = foreground_cost(sigma, t_free, sync.every)
        else:
            per_phase = [lo.seconds(links, effs[k], xeffs[k]) for lo, k in phases.values()]
            tau = [sum(col) for col in zip(*per_phase)]
            step_s, round_s, gap = background_cost(tau, sigma, t_free, sync.every, sync.duty)
            if cpu is not None:
                step_s, round_s, gap, host = _with_host(cpu, w.compute_s, tau, sigma, t_free,
                                                        sync, replica, group_size > 1, run_steps)
        cross = groups * sum(rloads.xup) / gap if gap else 0.0
    return StepPrediction(
        "hierarchical" if hierarchical else "flat", groups, group_size, w.compute_s,
        times["input"], times["output_fwd"], times["output_bwd"], times["dense"],
        step_s - t_free - host, step_s, groups * group_size * w.batch_per_rank / step_s,
        round_s, gap, cross, replica, host)


def _with_host(cpu: HostCpu, compute_s: float, tau, sigma, t_free: float, sync: SyncSpec,
               replica: float, agree: bool, run_steps: int | None) -> tuple[float, ...]:
    """:func:`background_cost` of a step lengthened by :func:`host_cost`, whose interval
    between rounds depends on the step: the fixed point, by iteration (``host`` only grows
    with a shorter interval, the interval only with a longer step: it converges)."""
    cpu_s, host = cpu.round_cpu_s(replica, sync.compress), 0.0
    for _ in range(200):
        step_s, round_s, gap = background_cost(tau, sigma, t_free + host, sync.every, sync.duty)
        short = run_steps is not None and run_steps * step_s < round_s  # no round ends in the run
        interval = round_s if short else gap * step_s
        new = host_cost(cpu, compute_s, cpu_s, interval, not short, gap, replica, agree)
        if abs(new - host) <= 1e-12 * max(1.0, new):
            return step_s + new - host, round_s, gap, new
        host = new
    raise RuntimeError(f"host_cost did not converge (last {host} s)")
