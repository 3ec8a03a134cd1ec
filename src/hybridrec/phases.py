"""The named phases of a training step, as torch.profiler ranges.

``benchmarks/profile_step.py`` and ``benchmarks/gpu.py`` split a step's time by these ranges.
A ``record_function`` costs about 4 us even when nothing profiles, and a step opens eleven
(a tenth of a millisecond on the demo's 3 ms step), so :func:`phase` opens one only while a
profiler runs.
"""

from __future__ import annotations

from contextlib import nullcontext

import torch
from torch.profiler import record_function

_NO_RANGE = nullcontext()

MP_PHASES = ("mp_select", "mp_encode", "mp_wait", "mp_decode", "mp_grad_encode", "mp_grad_wait", "mp_grad_decode")
"""The ranges of a compressed model-parallel hop (DCT-MP, the other codecs), inside the step's
forward and backward: the sender's selection (inside its encoding), encoding, the wait for the
exchange, the receiver's decoding; the same for the gradients."""


def phase(name: str):
    """``with phase("forward"): ...``: a profiler range named ``name`` while one runs (always,
    should a torch no longer say whether one runs)."""
    return record_function(name) if getattr(torch.autograd.profiler, "_is_profiler_enabled", True) else _NO_RANGE
