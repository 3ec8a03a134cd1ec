"""Keep freed memory for the next step instead of handing it back to the kernel.

A training step on the CPU allocates and frees the same large temporaries every step
(pooled embeddings, their bf16 casts, activations and their gradients: 1-15 MB each for
the benchmark DLRM at batch 2048). glibc's malloc serves blocks that large with a fresh
``mmap`` and returns them with ``munmap`` (above its mmap threshold, dynamic from 128 KiB),
or trims the top of its heap after a large free; either way the next step touches new
pages, and every page is a fault and a zeroing in the kernel: ~4,000-6,000 faults per step
there, 15-20% of the step (docs/benchmarks.md, "Page faults of the step's temporaries").

``train.allocator=retain`` (the default) raises the mmap threshold to glibc's maximum
(32 MiB on 64-bit) and the trim threshold to 256 MiB through ``mallopt``, so those
temporaries are reused from the heap; ``system`` leaves malloc as it is. Blocks above
32 MiB are still mapped and unmapped. The price is memory that the process keeps after it
is freed (up to the trim threshold above what it uses); the peak does not change. Only
glibc has these settings: elsewhere ``retain`` does nothing and says so.
"""

from __future__ import annotations

import ctypes
import platform

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's malloc.h
MMAP_THRESHOLD = 32 << 20  # glibc's upper bound on 64-bit (DEFAULT_MMAP_THRESHOLD_MAX)
TRIM_THRESHOLD = 256 << 20
ALLOCATORS = ("retain", "system")

_applied: dict | None = None


def configure_allocator(mode: str = "retain") -> dict:
    """Apply ``mode`` (:data:`ALLOCATORS`) to this process's malloc, once; returns what was
    done: ``{"mode", "applied", "mmap_threshold", "trim_threshold"}`` or with ``reason``
    when nothing was. Settings stay for the life of the process (a later call with
    ``system`` cannot undo ``retain``: it reports the settings in force)."""
    global _applied
    if mode not in ALLOCATORS:
        raise ValueError(f"allocator {mode!r}: one of {', '.join(ALLOCATORS)}")
    if _applied is not None and _applied["applied"]:
        return dict(_applied)
    if mode == "system":
        return {"mode": mode, "applied": False, "reason": "malloc's own settings"}
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return {"mode": mode, "applied": False, "reason": "not glibc: malloc's own settings"}
    libc = ctypes.CDLL(None)
    ok = libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1 and libc.mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1
    _applied = ({"mode": mode, "applied": True, "mmap_threshold": MMAP_THRESHOLD, "trim_threshold": TRIM_THRESHOLD}
                if ok else {"mode": mode, "applied": False, "reason": "mallopt refused the thresholds"})
    return dict(_applied)
