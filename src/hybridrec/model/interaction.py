"""Feature interactions between the bottom-MLP output and the pooled embeddings."""

from __future__ import annotations

import torch
from torch import nn

from hybridrec.model.kernels import compute_dtype


class _PairwiseDot(torch.autograd.Function):
    """Strictly-lower-triangular Gram entries of each sample's ``[F, D]`` matrix.

    Forward is one batched matmul; backward is one batched matmul too (autograd
    of ``bmm(z, z.T)`` would run two), because with ``S`` the symmetric matrix
    holding the output gradient on both triangles, ``dz = S @ z``.
    """

    @staticmethod
    def forward(ctx, z, rows, cols):
        ctx.save_for_backward(z, rows, cols)
        return torch.bmm(z, z.transpose(1, 2))[:, rows, cols]

    @staticmethod
    def backward(ctx, grad_out):
        z, rows, cols = ctx.saved_tensors
        n = z.shape[1]
        sym = grad_out.new_zeros(z.shape[0], n, n)
        sym[:, rows, cols] = grad_out
        sym = sym + sym.transpose(1, 2)
        return torch.bmm(sym, z), None, None


class DotInteraction(nn.Module):
    """DLRM's pairwise dot interaction.

    Inputs: ``dense`` ``[B, D]`` (bottom-MLP output) and ``sparse`` ``[B, F, D]``
    (pooled embeddings). Output ``[B, D + (F+1)F/2]``: the dense vector followed
    by the dot products of every distinct pair among the F+1 vectors.
    """

    def __init__(self, num_features: int) -> None:
        super().__init__()
        n = num_features + 1
        rows, cols = torch.tril_indices(n, n, offset=-1)
        self.register_buffer("rows", rows, persistent=False)
        self.register_buffer("cols", cols, persistent=False)

    @staticmethod
    def output_dim(num_features: int, dim: int) -> int:
        return dim + (num_features + 1) * num_features // 2

    def forward(self, dense: torch.Tensor, sparse: torch.Tensor) -> torch.Tensor:
        z = torch.cat([dense.unsqueeze(1), sparse], dim=1)
        low = compute_dtype(z.device)  # bf16 precision: the Gram matrix in bf16 too
        if low is not None:
            z, dense = z.to(low), dense.to(low)
        with torch.autocast(z.device.type, enabled=False):
            return torch.cat([dense, _PairwiseDot.apply(z, self.rows, self.cols)], dim=1)


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
        return DotInteraction(num_features), DotInteraction.output_dim(num_features, dim)
    if kind == "cat":
        return CatInteraction(), CatInteraction.output_dim(num_features, dim)
    raise ValueError(f"unknown interaction {kind!r} (dot or cat)")
