"""``native``: DCT-MP's per-row top-k as a small C loop, built on first use with the
system's C compiler and called through ctypes.

Why: the selection is the costly part of a DCT-MP hop on a CPU (``codecs.py``), and the
torch and numpy candidates pay per row: ``torch.topk`` and numpy's ``partition`` run a
general selection on every 64-wide row (about 0.5 us a row on a Zen 3, 23-47 ms for the
benchmark's 53,248 rows a step). Keeping the ``k`` largest magnitudes of a short row is one
comparison per entry against the smallest kept, and an insertion when it is larger: a
single pass over the data.

It is one candidate among :data:`~hybridrec.comm.codecs.TOPK_IMPLS`, raced and checked
against ``torch.topk``'s magnitudes like the others (:func:`~hybridrec.comm.codecs.tune_topk`);
where no C compiler runs (``CC``, else ``cc``) or the build fails, calling it raises and the
race leaves it out with the reason. The library is built once per source, compiler and
machine into ``<cache>/hybridrec/native/`` (``HYBRIDREC_CACHE_DIR`` or ``XDG_CACHE_HOME``, as
the kernel choices), a directory only its owner may write, written to a temporary name and
renamed, so a reader never loads a half-written file. ``-march=native``: built and run on
the same machine.

Ties among equal magnitudes keep the earlier column; a NaN counts as the largest magnitude,
as in ``torch.topk``.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

SOURCE = r"""
#include <stdint.h>

/* out[r, :k] = the columns of the k largest |x[r, c]| of every row r of x [rows, cols]
   (in descending magnitude; ties keep the earlier column). 1 <= k <= cols.
   Magnitudes are compared as the bits of |x| (int32 with the sign bit cleared: they order
   as the magnitudes do, a NaN above infinity, as torch.topk orders it), which vectorizes.
   Per row, a first pass takes the largest magnitude of each of k column groups: the
   smallest of those k maxima, lo, has at least k entries at or above it, so the top k are
   among the entries >= lo (a handful); the second pass marks them in a bit mask, 64
   columns at a time, without a branch per entry, and inserts only those. */
#define MAG(v) ((v) & 0x7fffffff)
void row_topk_f32(const int32_t *x, int64_t rows, int64_t cols, int64_t k, int64_t *out) {
    int32_t best[k];
    int64_t pos[k];
    const int64_t width = cols / k; /* groups 0..k-2 of this width, the last takes the rest */
    for (int64_t r = 0; r < rows; r++) {
        const int32_t *row = x + r * cols;
        int32_t lo = 0x7fffffff;
        for (int64_t g = 0; g < k; g++) {
            const int64_t a0 = g * width, a1 = g == k - 1 ? cols : a0 + width;
            int32_t m = 0;
            for (int64_t c = a0; c < a1; c++) {
                int32_t a = MAG(row[c]);
                m = a > m ? a : m;
            }
            lo = m < lo ? m : lo;
        }
        int64_t n = 0;
        for (int64_t c0 = 0; c0 < cols; c0 += 64) {
            const int64_t w = cols - c0 < 64 ? cols - c0 : 64;
            uint64_t bits = 0;
            for (int64_t j = 0; j < w; j++) bits |= (uint64_t)(MAG(row[c0 + j]) >= lo) << j;
            while (bits) {
                const int64_t c = c0 + __builtin_ctzll(bits);
                bits &= bits - 1;
                const int32_t a = MAG(row[c]);
                int64_t i;
                if (n < k) {
                    i = n++;
                } else if (a > best[k - 1]) {
                    i = k - 1;
                } else {
                    continue;
                }
                while (i > 0 && best[i - 1] < a) {
                    best[i] = best[i - 1];
                    pos[i] = pos[i - 1];
                    i--;
                }
                best[i] = a;
                pos[i] = c;
            }
        }
        int64_t *o = out + r * k;
        for (int64_t i = 0; i < k; i++) o[i] = pos[i];
    }
}
"""

FLAGS = ["-O3", "-march=native", "-shared", "-fPIC", "-std=gnu99"]

_LOCK = threading.Lock()
_LIB: ctypes.CDLL | None = None
_ERROR: str | None = None


def _build() -> ctypes.CDLL:
    cc = os.environ.get("CC") or "cc"
    if shutil.which(cc) is None:
        raise RuntimeError(f"no C compiler ({cc!r} not found; set CC)")
    tag = hashlib.sha256("\0".join([SOURCE, cc, *FLAGS, platform.machine(), platform.node()]).encode()).hexdigest()[:16]
    from hybridrec.model.kernels import cache_path  # (the kernel choices' folder)

    folder = cache_path().parent / "native"
    folder.mkdir(parents=True, exist_ok=True, mode=0o700)
    if folder.stat().st_uid != os.getuid() or folder.stat().st_mode & 0o022:
        raise RuntimeError(f"{folder}: not a directory only this user may write; not loading code from it")
    lib = folder / f"row_topk-{tag}.so"
    if not lib.exists():
        with tempfile.TemporaryDirectory(dir=folder) as tmp:
            src, out = Path(tmp) / "row_topk.c", Path(tmp) / "row_topk.so"
            src.write_text(SOURCE)
            res = subprocess.run([cc, *FLAGS, str(src), "-o", str(out)], capture_output=True, text=True,
                                 timeout=120)
            if res.returncode != 0:
                raise RuntimeError(f"{cc} failed (exit {res.returncode}): {res.stderr.strip()[-500:]}")
            os.replace(out, lib)
    dll = ctypes.CDLL(str(lib))
    dll.row_topk_f32.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p]
    dll.row_topk_f32.restype = None
    return dll


def library() -> ctypes.CDLL:
    """The built library (built on the first call); raises RuntimeError, every call, with
    the first failure's reason when it cannot be built here."""
    global _LIB, _ERROR
    with _LOCK:
        if _LIB is None and _ERROR is None:
            try:
                _LIB = _build()
            except (OSError, RuntimeError, subprocess.SubprocessError) as e:
                _ERROR = f"{type(e).__name__}: {e}"
        if _LIB is None:
            raise RuntimeError(f"native row top-k unavailable: {_ERROR}")
        return _LIB


def row_topk(x, k: int):
    """int64 ``[..., k]``: the columns of the ``k`` largest ``|x|`` of every row of a float32
    CPU tensor ``x [..., C]``, ``1 <= k <= C``."""
    import torch

    if x.dtype != torch.float32 or x.device.type != "cpu":
        raise ValueError(f"native row top-k takes float32 CPU tensors, got {x.dtype} on {x.device}")
    cols = x.shape[-1]
    if not 1 <= k <= cols:
        raise ValueError(f"k={k} outside 1..{cols}")
    lib = library()
    x = x.contiguous()
    out = torch.empty(*x.shape[:-1], k, dtype=torch.int64)
    rows = x.numel() // cols if cols else 0
    if rows:
        lib.row_topk_f32(x.data_ptr(), rows, cols, k, out.data_ptr())
    return out
