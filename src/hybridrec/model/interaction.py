"""Feature interactions between the bottom-MLP output and the pooled embeddings."""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn

from hybridrec.model.kernels import Choice, choose, compute_dtype, race


class _PairwiseDot(torch.autograd.Function):
    """Strictly-lower-triangular Gram entries of each sample's ``[F, D]`` matrix ``z``: the
    dense vector ``[B, D]`` stacked over the pooled embeddings ``[B, F-1, D]`` (the stacking
    happens here, so that the stacked matrix may carry zero rows below the ``F`` real ones).

    Forward is one batched matmul; backward is one batched matmul too (autograd
    of ``bmm(z, z.T)`` would run two), because with ``S`` the symmetric matrix
    holding the output gradient on both triangles, ``dz = S @ z``.

    The ways to pick the entries out and put their gradient back (``impl``,
    :data:`INTERACTION_IMPLS`) are timed against each other at start-up (which is faster
    depends on the processor and the dtype, see :func:`tune_interactions`):

    - ``index``: advanced indexing ``gram[:, rows, cols]``; backward writes the lower
      triangle and adds the transpose.
    - ``gather``: ``gather`` on the flattened Gram matrix; backward scatters the gradient
      into both triangles at once (no transpose added).
    - ``gather_pad``: ``gather`` with ``z`` padded by zero rows to a multiple of 8 in both
      products (``pairs.rows_total``), so that their operands are 16-byte aligned.
    - ``gather_pad4``: ``z`` padded to a multiple of 4 rows; the backward product runs at
      the real size over the padded matrix's rows (``pairs.pad_backward`` false).
    """

    @staticmethod
    def forward(ctx, dense, sparse, pairs: "_Pairs", impl: str):
        b, n, m = sparse.shape[0], sparse.shape[1] + 1, pairs.rows_total
        parts = [dense.unsqueeze(1), sparse]
        if m > n:  # zero rows: they add exact zeros to no entry that is read
            parts.append(sparse.new_zeros(b, m - n, sparse.shape[2]))
        z = torch.cat(parts, dim=1)
        ctx.save_for_backward(z)
        ctx.pairs, ctx.impl, ctx.n = pairs, impl, n
        gram = torch.bmm(z, z.transpose(1, 2))
        if impl == "index":
            return gram[:, pairs.rows, pairs.cols]
        return torch.gather(gram.view(b, m * m), 1, pairs.lower.expand(b, -1))

    @staticmethod
    def backward(ctx, grad_out):
        (z,) = ctx.saved_tensors
        p, b, n = ctx.pairs, z.shape[0], ctx.n
        if ctx.impl == "index":
            sym = grad_out.new_zeros(b, n, n)
            sym[:, p.rows, p.cols] = grad_out
            sym = sym + sym.transpose(1, 2)
        else:
            k = p.rows_total if p.pad_backward else n
            sym = grad_out.new_zeros(b, k * k)
            sym.scatter_(1, p.both.expand(b, -1), torch.cat([grad_out, grad_out], dim=1))
            sym = sym.view(b, k, k)
            z = z[:, :k]
        dz = torch.bmm(sym, z)
        return dz[:, 0], dz[:, 1:n], None, None


class _Pairs(NamedTuple):
    """The strictly lower triangle of an ``n x n`` matrix: ``rows``, ``cols``; the flat
    positions ``lower`` of its entries in the forward's ``rows_total x rows_total`` Gram matrix
    and, in the backward's (``rows_total`` rows if ``pad_backward``, else ``n``), ``both``: the
    lower ones, then the mirrored upper ones (disjoint: nothing on the diagonal)."""

    rows: torch.Tensor
    cols: torch.Tensor
    lower: torch.Tensor
    both: torch.Tensor
    rows_total: int
    pad_backward: bool


INTERACTION_IMPLS = ("index", "gather", "gather_pad", "gather_pad4")
"""The ways :class:`_PairwiseDot` picks the entries. The padded ones give the same values (the
padding adds exact zeros nowhere it is read): ``gather_pad`` pads to a multiple of 8 rows, so
that the batched products' operands are 16-byte aligned (on a GPU, cuBLAS's fast kernels need
it); ``gather_pad4`` pads the forward's operands to a multiple of 4 rows (on a CPU, MKL's fp32
batched products of 27 x 64 matrices ran 1.4x faster with a row stride of 28)."""


def interaction_impls(device: str) -> list[str]:
    """The candidates timed on ``device``'s type (``gather_pad`` on a GPU, ``gather_pad4`` on
    a CPU: where each was seen to pay)."""
    if torch.device(device).type == "cuda":
        return ["index", "gather", "gather_pad"]
    return ["index", "gather", "gather_pad4"]


class DotInteraction(nn.Module):
    """DLRM's pairwise dot interaction.

    Inputs: ``dense`` ``[B, D]`` (bottom-MLP output) and ``sparse`` ``[B, F, D]``
    (pooled embeddings). Output ``[B, D + (F+1)F/2]``: the dense vector followed
    by the dot products of every distinct pair among the F+1 vectors. Under bf16
    autocast both are cast before they are stacked and the Gram matrix is bf16.
    """

    def __init__(self, num_features: int, dim: int | None = None) -> None:
        super().__init__()
        self.num_features, self.dim = num_features, dim  # (dim: for timing; None: unknown)
        n = num_features + 1
        rows, cols = torch.tril_indices(n, n, offset=-1)
        self.register_buffer("rows", rows, persistent=False)
        self.register_buffer("cols", cols, persistent=False)
        self.register_buffer("lower", rows * n + cols, persistent=False)
        self.register_buffer("both", torch.cat([rows * n + cols, cols * n + rows]), persistent=False)
        self.rows_pad, self.rows_pad4 = -(-n // 8) * 8, -(-n // 4) * 4  # gather_pad's, gather_pad4's
        for name, m in (("pad", self.rows_pad), ("pad4", self.rows_pad4)):
            self.register_buffer(f"lower_{name}", rows * m + cols, persistent=False)
        m = self.rows_pad
        self.register_buffer("both_pad", torch.cat([rows * m + cols, cols * m + rows]), persistent=False)
        self.impl = "index"
        """How the entries are picked (``INTERACTION_IMPLS``); set by :func:`tune_interactions`."""

    @staticmethod
    def output_dim(num_features: int, dim: int) -> int:
        return dim + (num_features + 1) * num_features // 2

    def forward(self, dense: torch.Tensor, sparse: torch.Tensor) -> torch.Tensor:
        low = compute_dtype(dense.device)  # bf16 precision: cast first, stack in bf16
        if low is not None:
            dense, sparse = dense.to(low), sparse.to(low)
        if self.impl == "gather_pad":
            pairs = _Pairs(self.rows, self.cols, self.lower_pad, self.both_pad, self.rows_pad, True)
        elif self.impl == "gather_pad4":
            pairs = _Pairs(self.rows, self.cols, self.lower_pad4, self.both, self.rows_pad4, False)
        else:
            pairs = _Pairs(self.rows, self.cols, self.lower, self.both, self.num_features + 1, False)
        with torch.autocast(dense.device.type, enabled=False):
            return torch.cat([dense, _PairwiseDot.apply(dense, sparse, pairs, self.impl)], dim=1)


def time_dot_interaction(batch: int, num_features: int, dim: int, impls: list[str], *,
                         device: str = "cpu", dtype: str = "float32", reps: int = 5,
                         budget_s: float = 0.2) -> dict[str, float]:
    """Seconds of one forward and backward of :class:`DotInteraction` with each of
    ``impls`` (:func:`~hybridrec.model.kernels.race`)."""
    gen = torch.Generator(device=device).manual_seed(0)
    low = getattr(torch, dtype)
    dense = torch.randn(batch, dim, device=device, generator=gen).requires_grad_()
    sparse = torch.randn(batch, num_features, dim, device=device, generator=gen).requires_grad_()
    mod = DotInteraction(num_features).to(device)

    def run(impl: str) -> None:
        mod.impl = impl
        with torch.autocast(torch.device(device).type, dtype=low if low != torch.float32 else torch.bfloat16,
                            enabled=low != torch.float32):
            out = mod(dense, sparse)
        out.sum().backward()

    return race(impls, run, device=device, reps=reps, budget_s=budget_s)


def tune_interactions(model: nn.Module, batch: int, *, mode: str = "auto", device: str = "cpu",
                      dtype: str = "float32", agree=None) -> list[Choice]:
    """Choose every :class:`DotInteraction` of ``model``'s implementation by measurement
    at ``batch`` rows (``mode`` and ``agree`` as for :func:`~hybridrec.model.mlp.tune_mlps`;
    the ``torch``/``onednn`` overrides concern the linears and leave this measured)."""
    mods = [(name, m) for name, m in model.named_modules()
            if isinstance(m, DotInteraction) and m.dim is not None]
    if not mods:
        return []
    keys = {name: f"dot_interaction {device} {dtype} {batch}x{m.num_features + 1}x{m.dim}" for name, m in mods}
    shape = {keys[name]: (m.num_features, m.dim) for name, m in mods}
    got = choose([(k, interaction_impls(device), None) for k in dict.fromkeys(keys.values())],
                 lambda key, cands, budget: time_dot_interaction(batch, *shape[key], cands, device=device,
                                                                 dtype=dtype, budget_s=budget),
                 mode=mode, budget_s=0.3)
    picks = {name: got[keys[name]].impl for name, _ in mods}
    if agree is not None:
        picks = agree(picks)
    for name, m in mods:
        m.impl = picks[name]
    return [got[k] for k in dict.fromkeys(keys.values())]


class CatInteraction(nn.Module):
    """Concatenation (no interaction): output ``[B, D + F*D]``."""

    @staticmethod
    def output_dim(num_features: int, dim: int) -> int:
        return dim * (num_features + 1)

    def forward(self, dense: torch.Tensor, sparse: torch.Tensor) -> torch.Tensor:
        return torch.cat([dense, sparse.flatten(1)], dim=1)


def make_interaction(kind: str, num_features: int, dim: int) -> tuple[nn.Module, int]:
    """``(module, output width)`` of interaction ``kind`` (``dot`` or ``cat``) over the
    bottom-MLP output and ``num_features`` pooled vectors of width ``dim``."""
    if kind == "dot":
        return DotInteraction(num_features, dim), DotInteraction.output_dim(num_features, dim)
    if kind == "cat":
        return CatInteraction(), CatInteraction.output_dim(num_features, dim)
    raise ValueError(f"unknown interaction {kind!r} (dot or cat)")
