"""Occurrences of each distinct id: the grouping every row optimizer that sums repeated ids
first (row-wise Adagrad, lazy Adam, bf16 tables), the multi-id bags' row gradients and the
parameter servers build on. A stable sort of the ids, so everything built on it is
deterministic on a CPU."""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F

RADIX_FROM = 1 << 15
"""On a CPU, torch sorts integer keys with a parallel radix sort from this many elements
(``at::internal::GRAIN_SIZE``) and with a comparison sort below: 0.59 ms for 13,312 int32
keys (the demo's 512 x 26 ids) against 0.12 ms for 32,768 (Zen 5, torch 2.13)."""

PAD_FROM = 1 << 13
"""The fewest keys :func:`stable_sort` pads (below, the comparison sort is cheap: 0.09 ms for
4,096)."""

_padding_pays: bool | None = None


def _pad_pays() -> bool:
    """Whether sorting :data:`PAD_FROM` keys padded to :data:`RADIX_FROM` is faster here than
    sorting them as they are: timed once per process (a few ms), never assumed."""
    global _padding_pays
    if _padding_pays is None:
        keys = torch.randint(0, 1 << 30, (PAD_FROM,), dtype=torch.int32, generator=torch.Generator().manual_seed(0))
        _padding_pays = _best_of(lambda: _padded_sort(keys)) < _best_of(lambda: torch.sort(keys, stable=True))
    return _padding_pays


def _best_of(fn, reps: int = 5) -> float:
    best = float("inf")
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def _padded_sort(key: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    n = key.numel()
    pad = key.new_full((RADIX_FROM - n,), torch.iinfo(key.dtype).max)  # (sorted after every key)
    values, perm = torch.sort(torch.cat([key, pad]), stable=True)
    return values[:n], perm[:n]


def stable_sort(key: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``torch.sort(key, stable=True)`` of 1-D integer keys; on a CPU, between :data:`PAD_FROM`
    and :data:`RADIX_FROM` keys, padded with the dtype's largest value up to RADIX_FROM when
    that was measured faster here (the same values and permutation: the pads sort last and the
    sort is stable)."""
    if key.device.type == "cpu" and PAD_FROM <= key.numel() < RADIX_FROM and _pad_pays():
        return _padded_sort(key)
    return torch.sort(key, stable=True)


def group_ids(ids: torch.Tensor, bound: int | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Occurrences of each distinct id: ``(unique ascending int64, offsets [u+1], perm)`` with
    ``perm[offsets[i]:offsets[i+1]]`` the positions of ``unique[i]`` in ``ids``, in order.

    Sorts 32-bit keys when the ids fit (more than twice as fast as 64-bit on CPU): every id
    is below ``bound`` where given (a table's rows), else the largest id is looked at (on a
    GPU, a wait for it). The sort is stable, so everything built on it is deterministic.
    The number of distinct ids sizes the outputs: on a GPU ``unique_consecutive`` makes the
    host wait for it, the one synchronization of a step with multi-id bags or with a row
    optimizer that sums repeated ids first (row-wise Adagrad, lazy Adam, bf16 tables).
    """
    small = bound < 2**31 if bound is not None else bool(ids.numel()) and int(ids.max()) < 2**31
    key = ids.to(torch.int32) if small else ids
    sorted_ids, perm = stable_sort(key)
    unique, counts = torch.unique_consecutive(sorted_ids, return_counts=True)
    offsets = torch.zeros(counts.numel() + 1, dtype=torch.int64, device=ids.device)
    torch.cumsum(counts, 0, out=offsets[1:])
    return unique.to(torch.int64), offsets, perm


def aggregate_rows(ids: torch.Tensor, rows: torch.Tensor, bound: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Sum the rows of repeated ids (all below ``bound`` where given, see :func:`group_ids`).

    ``ids`` ``[n]``, ``rows`` ``[n, d]`` -> ``(unique_ids [u], summed [u, d])``,
    unique ids ascending. Deterministic: a stable sort keeps occurrence order
    and ``embedding_bag`` adds each bag's rows in that order.
    """
    unique, offsets, perm = group_ids(ids, bound=bound)
    summed = F.embedding_bag(perm, rows, offsets, mode="sum", include_last_offset=True)
    return unique, summed
