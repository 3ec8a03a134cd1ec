"""Multi-layer perceptrons for the bottom (dense features) and top (over) arches."""

from __future__ import annotations

import math
from itertools import pairwise

import torch
from torch import nn

from hybridrec.model.kernels import Choice, choose_linears, linear, mlp_shapes


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
        self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in pairwise(sizes))
        self.final_relu = final_relu
        self.impls = ["torch"] * len(self.layers)
        """Each layer's linear implementation (:mod:`hybridrec.model.kernels`); set by
        :func:`tune_mlps` from measurements."""
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
            x = linear(x, layer.weight, layer.bias, relu=(i < last or self.final_relu), impl=self.impls[i])
        return x


def tune_mlps(model: nn.Module, batch: int, *, mode: str = "auto", device: str = "cpu",
              dtype: str = "float32", agree=None) -> list[Choice]:
    """Choose every layer's linear implementation of every :class:`MLP` in ``model`` by
    measurement at ``batch`` rows (see :func:`~hybridrec.model.kernels.choose_linears`).
    A module named ``bottom`` takes raw features (its first layer needs no input
    gradient). ``agree``: a function that makes every rank hold the same choices (rank
    0's), so that ranks never train with different kernels. Returns the choices made."""
    mlps = [(name, m) for name, m in model.named_modules() if isinstance(m, MLP)]
    shapes = {name: mlp_shapes(m, batch, device=device, dtype=dtype,
                               input_grad=name.rsplit(".", 1)[-1] != "bottom") for name, m in mlps}
    chosen = choose_linears([s for ss in shapes.values() for s in ss], mode=mode)
    picks = {name: [chosen[s].impl for s in ss] for name, ss in shapes.items()}
    if agree is not None:
        picks = agree(picks)
    for name, m in mlps:
        m.impls = list(picks[name])
    return [chosen[s] for s in dict.fromkeys(s for ss in shapes.values() for s in ss)]
