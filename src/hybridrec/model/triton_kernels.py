"""Triton kernels for CUDA devices, each one a candidate that start-up timing may pick
(:mod:`hybridrec.model.kernels`); nothing here is used where it was not measured faster.

``gather_rows(weight, ids)``: ``weight[ids]`` for a contiguous ``[rows, dim]`` table, the lookup
of one id per bag. On an H200 torch's ``embedding_bag`` and ``index_select`` move these rows at
700-840 GB/s, a fifth of the memory's bandwidth (docs/benchmarks.md, "The GPU path"); this
kernel copies whole rows with 16-byte accesses (``dim`` is a compile-time constant, so the
compiler knows every row starts aligned).

``add_rows_(weight, ids, delta, alpha)``: ``weight[ids[i]] += alpha * delta[i]`` with atomic
adds, the scale fused in (torch's ``scatter_add_`` needs the delta scaled by a pass of its own).

CPU builds of torch come without Triton: then :func:`available` is False and nothing here runs.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # (CPU wheels of torch ship without Triton)
    triton = None


def available(device: torch.device | str) -> bool:
    """Whether the kernels here can run on ``device`` (a CUDA device, and Triton installed)."""
    return triton is not None and torch.device(device).type == "cuda"


if triton is not None:

    @triton.jit
    def _gather_rows_kernel(ids_ptr, weight_ptr, out_ptr, n, DIM: tl.constexpr,
                            BLOCK_ROWS: tl.constexpr, BLOCK_DIM: tl.constexpr):
        pid = tl.program_id(0)
        rows = pid * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
        row_ok = rows < n
        ids = tl.load(ids_ptr + rows, mask=row_ok, other=0).to(tl.int64)
        cols = tl.arange(0, BLOCK_DIM)
        ok = row_ok[:, None] & (cols < DIM)[None, :]
        vals = tl.load(weight_ptr + ids[:, None] * DIM + cols[None, :], mask=ok)
        tl.store(out_ptr + rows.to(tl.int64)[:, None] * DIM + cols[None, :], vals, mask=ok)


def gather_rows(weight: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """``weight[ids]``, ``[n, dim]`` in ``weight``'s dtype (a copy: bit for bit the rows).
    ``weight``: ``[rows, dim]`` with rows ``dim`` apart; ``ids``: int64 ``[n]`` on its device."""
    if triton is None:
        raise RuntimeError("gather_rows needs Triton (a CUDA build of torch)")
    n, dim = ids.numel(), weight.shape[1]
    if weight.stride() != (dim, 1):
        raise ValueError(f"gather_rows: the table must be contiguous, strides {weight.stride()}")
    out = torch.empty(n, dim, dtype=weight.dtype, device=weight.device)
    if n == 0:
        return out
    block_dim = triton.next_power_of_2(dim)
    block_rows = max(1, 4096 // block_dim)  # (16 KB of fp32 per program)
    grid = (triton.cdiv(n, block_rows),)
    _gather_rows_kernel[grid](ids, weight, out, n, DIM=dim, BLOCK_ROWS=block_rows, BLOCK_DIM=block_dim)
    return out


if triton is not None:

    @triton.jit
    def _add_rows_kernel(ids_ptr, delta_ptr, weight_ptr, n, alpha, DIM: tl.constexpr,
                         BLOCK_ROWS: tl.constexpr, BLOCK_DIM: tl.constexpr):
        pid = tl.program_id(0)
        rows = pid * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
        row_ok = rows < n
        ids = tl.load(ids_ptr + rows, mask=row_ok, other=0).to(tl.int64)
        cols = tl.arange(0, BLOCK_DIM)
        ok = row_ok[:, None] & (cols < DIM)[None, :]
        d = tl.load(delta_ptr + rows.to(tl.int64)[:, None] * DIM + cols[None, :], mask=ok, other=0.0)
        tl.atomic_add(weight_ptr + ids[:, None] * DIM + cols[None, :], d * alpha, mask=ok, sem="relaxed")


def add_rows_(weight: torch.Tensor, ids: torch.Tensor, delta: torch.Tensor, alpha: float = 1.0) -> None:
    """``weight[ids[i]] += alpha * delta[i]`` for every i (repeated ids: atomic adds, in no set
    order). float32 ``weight`` ``[rows, dim]`` contiguous; ``delta`` ``[n, dim]``; int64 ``ids``."""
    if triton is None:
        raise RuntimeError("add_rows_ needs Triton (a CUDA build of torch)")
    n, dim = ids.numel(), weight.shape[1]
    if weight.stride() != (dim, 1) or weight.dtype != torch.float32:
        raise ValueError(f"add_rows_: a contiguous float32 table, got {weight.dtype} strides {weight.stride()}")
    if n == 0:
        return
    delta = delta.contiguous()
    block_dim = triton.next_power_of_2(dim)
    block_rows = max(1, 4096 // block_dim)
    grid = (triton.cdiv(n, block_rows),)
    _add_rows_kernel[grid](ids, delta, weight, n, float(alpha), DIM=dim, BLOCK_ROWS=block_rows, BLOCK_DIM=block_dim)
