"""Helper threads run their torch operators on one thread.

torch's CPU operators split their work over an OpenMP team of ``torch.get_num_threads()``
threads, and every Python thread that runs a parallel operator gets a team of its own.
GNU OpenMP lets an idle team member spin for a few milliseconds before it sleeps, so the
next parallel operator of the same thread starts at once; but while the process has more
OpenMP threads than CPUs, every team member spins only ~100 times and sleeps, and each
parallel operator then waits for a wake-up in the kernel (~15-20 us). A loader thread that
converts one batch with a parallel operator keeps a second team alive, and from then on
each of the hundreds of parallel operators of a training step pays that wake-up: 2-3 ms of
a 23 ms bf16 step of the benchmark DLRM on 2 cores (docs/benchmarks.md, "One OpenMP team").

:func:`single_threaded` makes the calling thread's operators run without a team (its
OpenMP thread count becomes 1; other threads keep theirs). The helper threads that run
beside the training step (the loader's prefetch thread, the async checkpoint writer, the
incremental-save writer, the background synchronizer) call it first: their work is memory
copies and small conversions, and the training step has the cores. The readers of a
restart's snapshot and deltas keep their teams: the step waits for them.
"""

from __future__ import annotations

import ctypes
import functools
import os

import torch


def _loaded_libgomp() -> str | None:
    """The path of the GNU OpenMP runtime this process has loaded (torch's own copy first:
    wheels may ship it under a hashed name such as ``libgomp-a34b3233.so.1``), or None."""
    try:
        with open("/proc/self/maps") as f:
            paths = {line.split(None, 5)[5].strip() for line in f if line.count(" ") >= 5 and "libgomp" in line}
    except OSError:
        return None
    paths = sorted(p for p in paths if os.path.basename(p).startswith("libgomp"))
    torch_dir = os.path.dirname(torch.__file__)
    return next((p for p in paths if p.startswith(torch_dir)), paths[0] if paths else None)


@functools.cache
def _runtime():
    """``(path, omp_set_num_threads)`` of the OpenMP runtime torch loaded, or None."""
    if "OpenMP" not in torch.__config__.parallel_info():
        return None
    path = _loaded_libgomp()
    if path is None:
        return None
    try:  # (RTLD_NOLOAD: the copy already loaded, never a second one)
        fn = ctypes.CDLL(path, mode=getattr(os, "RTLD_NOLOAD", 0) | ctypes.RTLD_GLOBAL).omp_set_num_threads
    except (OSError, AttributeError):
        return None
    fn.argtypes, fn.restype = [ctypes.c_int], None
    return path, fn


def single_threaded() -> bool:
    """Run the calling thread's torch CPU operators on one thread (no OpenMP team of its
    own); other threads are not affected. Returns whether it could (torch built with GNU
    OpenMP); otherwise nothing changes. Call it first in a helper thread."""
    runtime = _runtime()
    if runtime is None:
        return False
    torch.get_num_threads()  # torch's own per-thread setup first: it would set the count again later
    runtime[1](1)
    return torch.get_num_threads() == 1


def status() -> dict:
    """What :func:`single_threaded` does in this process (summary.json ``kernels.helper_threads``)."""
    runtime = _runtime()
    if runtime is None:
        return {"single_threaded": False, "reason": "torch without GNU OpenMP: helper threads keep torch's count"}
    return {"single_threaded": True, "runtime": os.path.basename(runtime[0])}
