"""Multi-layer perceptrons for the bottom (dense features) and top (over) arches."""

from __future__ import annotations

import math

import torch
from torch import nn

from hybridrec.model.kernels import linear


class MLP(nn.Module):
    """``Linear -> ReLU`` stack; ``sizes = [in, h1, ..., out]``.

    Args:
        sizes: layer widths including the input width.
        final_relu: apply ReLU after the last layer too (the DLRM bottom MLP does,
            the top MLP ends in a logit and does not).

    Input ``[B, sizes[0]]``, output ``[B, sizes[-1]]``.
    """

    def __init__(self, sizes: list[int], *, final_relu: bool) -> None:
        super().__init__()
        if len(sizes) < 2:
            raise ValueError(f"MLP needs at least an input and an output width, got {sizes}")
        self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in zip(sizes[:-1], sizes[1:]))
        self.final_relu = final_relu
        self.reset_parameters()

    def reset_parameters(self) -> None:
        # The DLRM reference initialisation: weights N(0, 2/(in+out)), bias N(0, 1/out).
        for layer in self.layers:
            fan_out, fan_in = layer.weight.shape
            nn.init.normal_(layer.weight, 0.0, math.sqrt(2.0 / (fan_in + fan_out)))
            nn.init.normal_(layer.bias, 0.0, math.sqrt(1.0 / fan_out))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        last = len(self.layers) - 1
        for i, layer in enumerate(self.layers):
            x = linear(x, layer.weight, layer.bias, relu=(i < last or self.final_relu))
        return x
