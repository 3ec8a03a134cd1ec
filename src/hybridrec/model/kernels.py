"""Dense kernels for the MLPs, with a plain-PyTorch fallback.

Why this exists: on CPU, ``torch.nn.functional.linear`` runs on MKL's sgemm,
which on non-Intel x86 processors picks AVX2 code paths. PyTorch also ships
oneDNN, whose fp32 matmul uses AVX-512 where the processor has it; on the AMD
EPYC machines we benchmark on it runs the DLRM layer shapes about 2x faster at
the same fp32 precision (see docs/benchmarks.md). We call it through
``torch.ops.mkldnn._linear_pointwise`` (the op PyTorch's own compiler emits for
CPU linears), and compute the backward with the same op on transposed
operands. Anything else (GPU, other dtypes, a build without the op) takes
``F.linear``. Both paths compute the same fp32 math; only summation order differs.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

_ENV_SWITCH = "HYBRIDREC_ONEDNN_LINEAR"


def _find_linear_pointwise():
    try:
        return torch.ops.mkldnn._linear_pointwise
    except (AttributeError, RuntimeError):
        return None


_LINEAR_POINTWISE = _find_linear_pointwise()


def onednn_linear_enabled() -> bool:
    """Whether CPU fp32 linears use oneDNN (env ``HYBRIDREC_ONEDNN_LINEAR=0`` turns it off)."""
    return (
        _LINEAR_POINTWISE is not None
        and torch.backends.mkldnn.is_available()
        and os.environ.get(_ENV_SWITCH, "1") != "0"
    )


def _use_onednn(x: torch.Tensor, weight: torch.Tensor) -> bool:
    return (
        x.device.type == "cpu"
        and x.dtype == torch.float32
        and weight.dtype == torch.float32
        and x.dim() == 2
        and onednn_linear_enabled()
    )


class _OneDNNLinear(torch.autograd.Function):
    """y = act(x @ w.T + b) with act in {identity, relu}; fp32 on CPU via oneDNN."""

    @staticmethod
    def forward(ctx, x, weight, bias, relu: bool):
        x = x.contiguous()
        y = _LINEAR_POINTWISE(x, weight, bias, "relu" if relu else "none", [], "")
        ctx.relu = relu
        ctx.save_for_backward(x, weight, y if relu else None)
        return y

    @staticmethod
    def backward(ctx, grad_y):
        x, weight, y = ctx.saved_tensors
        if ctx.relu:
            grad_y = torch.ops.aten.threshold_backward(grad_y, y, 0)
        grad_y = grad_y.contiguous()
        grad_x = grad_w = grad_b = None
        if ctx.needs_input_grad[0]:
            # dX = dY @ W, i.e. a linear with weight W.T
            grad_x = _LINEAR_POINTWISE(grad_y, weight.t(), None, "none", [], "")
        if ctx.needs_input_grad[1]:
            # dW = dY.T @ X, i.e. a linear of dY.T with weight X.T
            grad_w = _LINEAR_POINTWISE(grad_y.t(), x.t(), None, "none", [], "")
        if ctx.needs_input_grad[2]:
            grad_b = grad_y.sum(0)
        return grad_x, grad_w, grad_b, None


def linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, *, relu: bool = False
) -> torch.Tensor:
    """``act(x @ weight.T + bias)``; x ``[B, in]``, weight ``[out, in]``, returns ``[B, out]``."""
    if _use_onednn(x, weight) and (bias is None or bias.dtype == torch.float32):
        return _OneDNNLinear.apply(x, weight, bias, relu)
    y = F.linear(x, weight, bias)
    return F.relu(y) if relu else y
