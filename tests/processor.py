"""What a test assumes about the processor, as skip marks whose reasons say so.

Everything else runs on every x86-64 processor seen (AVX2 only, AVX-512, AMX) and on any
number of cores; a test that needs more says it here, never by failing."""

import pytest

from hybridrec.model import kernels

BF16_PROBLEM = kernels.precision_problem("bf16", "cpu")
"""Why ``train.precision=bf16`` is refused on this CPU (None where it trains)."""

needs_bf16 = pytest.mark.skipif(
    BF16_PROBLEM is not None,
    reason=f"needs a CPU with bf16 kernels ({', '.join(f.upper() for f in kernels.BF16_FLAGS)}): "
           f"{kernels.cpu_name()} has none, and train.precision=bf16 is refused there")

needs_onednn_bf16 = pytest.mark.skipif(
    not kernels.onednn_bf16_available(),
    reason=f"oneDNN has no bf16 kernels for {kernels.cpu_name()} (no AVX512-BF16, AMX or AVX-512): "
           "its bf16 linear is not offered there")
