"""A gradient scale inside the autograd graph (not a parameter hook, so copies of a module
keep it): ``scale_grad(x, s)`` is ``x`` forward and multiplies the gradient by ``s`` backward.
Sharded embeddings and partitioned dense layers use it to turn a gradient summed over every
rank's rows into the average that data-parallel replicas would get."""

from __future__ import annotations

import torch


class _ScaleGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, scale: float):
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.scale, None


def scale_grad(x: torch.Tensor, scale: float) -> torch.Tensor:
    return _ScaleGrad.apply(x, scale)
