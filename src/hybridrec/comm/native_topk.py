"""``native``: DCT-MP's per-row top-k, and the codec around it, as small C loops, built on
first use with the system's C compiler and called through ctypes.

- :func:`row_topk`: the columns of the ``k`` largest magnitudes of every row;
- :func:`encode`: a row's forward bytes at once (select, cast the ``k`` values to float32,
  float16 or bfloat16 rounding to nearest even as torch does, pack them and their columns);
- :func:`decode` / :func:`scatter`: a row of zeros with the ``k`` values written at their
  columns (a column outside the row is refused: ValueError);
- :func:`gather`: the gradient's ``k`` values at the columns a forward payload names.

Why: the selection is the costly part of a DCT-MP hop on a CPU (``codecs.py``), and the
torch and numpy candidates pay per row: ``torch.topk`` and numpy's ``partition`` run a
general selection on every 64-wide row (about 0.5 us a row on a Zen 3, 23-47 ms for the
benchmark's 53,248 rows a step). Keeping the ``k`` largest magnitudes of a short row is one
comparison per entry against the smallest kept, and an insertion when it is larger: a
single pass over the data. Around the selection, torch's gather, casts, concatenation and
scatter into zeros cost as much again, each a pass over its own temporary; in C they are a
few stores per row.

It is one candidate among :data:`~hybridrec.comm.codecs.TOPK_IMPLS`, raced (the codec's
round trip) and checked against the torch path like the others
(:func:`~hybridrec.comm.codecs.tune_topk`);
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
#include <string.h>
#if defined(__AVX2__) || defined(__F16C__)
#include <immintrin.h>
#endif

#define MAG(v) ((v) & 0x7fffffff)

/* Bit i of the result: |row[c0 + i]| >= lo (magnitudes as the bits of |x|), i < w <= 64. */
static inline uint64_t at_least(const int32_t *row, int64_t w, int32_t lo) {
    uint64_t bits = 0;
    int64_t j = 0;
#ifdef __AVX2__
    const __m256i mag = _mm256_set1_epi32(0x7fffffff), below = _mm256_set1_epi32(lo - 1);
    for (; j + 8 <= w; j += 8) {
        __m256i v = _mm256_and_si256(_mm256_loadu_si256((const __m256i *)(row + j)), mag);
        uint32_t m = (uint32_t)_mm256_movemask_ps(_mm256_castsi256_ps(_mm256_cmpgt_epi32(v, below)));
        bits |= (uint64_t)m << j;
    }
#endif
    for (; j < w; j++) bits |= (uint64_t)(MAG(row[j]) >= lo) << j;
    return bits;
}

/* The columns of the k largest |row[c]|, c < cols, in descending magnitude into pos[0..k)
   (ties keep the earlier column). 1 <= k <= cols; best: k ints of scratch.
   Magnitudes are compared as the bits of |x| (int32 with the sign bit cleared: they order
   as the magnitudes do, a NaN above infinity, as torch.topk orders it), which vectorizes.
   A first pass takes the largest magnitude of each of k column groups: the smallest of
   those k maxima, lo, has at least k entries at or above it, so the top k are among the
   entries >= lo (a handful); the second pass marks them in a bit mask, 64 columns at a
   time, without a branch per entry, and inserts only those. */
static inline void select_row(const int32_t *row, int64_t cols, int64_t k, int32_t *best, int64_t *pos) {
    const int64_t width = cols / k; /* groups 0..k-2 of this width, the last takes the rest */
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
        uint64_t bits = at_least(row + c0, cols - c0 < 64 ? cols - c0 : 64, lo);
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
}

/* out[r, :k] = select_row of every row r of x [rows, cols]. */
void row_topk_f32(const int32_t *x, int64_t rows, int64_t cols, int64_t k, int64_t *out) {
    int32_t best[k];
    for (int64_t r = 0; r < rows; r++) select_row(x + r * cols, cols, k, best, out + r * k);
}

/* float32 bits -> float16 / bfloat16 bits, rounding to nearest even (as torch casts); a NaN
   becomes a quiet NaN. With F16C, the processor's conversion (the same rounding). */
#ifdef __F16C__
static inline uint16_t to_half(uint32_t x) {
    float f;
    memcpy(&f, &x, 4);
    return (uint16_t)_cvtss_sh(f, 0); /* 0: round to nearest even */
}
#else
static inline uint16_t to_half(uint32_t x) {
    const uint32_t sign = (x >> 16) & 0x8000, a = x & 0x7fffffff;
    if (a > 0x7f800000) return (uint16_t)(sign | 0x7e00);
    if (a >= 0x477ff000) return (uint16_t)(sign | 0x7c00);      /* 65520 and above: infinity */
    if (a >= 0x38800000) {                                      /* a normal half */
        const uint32_t m = a - 0x38000000;                      /* exponent rebiased, 127 -> 15 */
        return (uint16_t)(sign | ((m + 0xfff + ((m >> 13) & 1)) >> 13));
    }
    float f;                                                    /* a subnormal half: n * 2^-24 */
    memcpy(&f, &a, 4);
    f = f * 16777216.0f;                                        /* exact: a power of two */
    f = (f + 8388608.0f) - 8388608.0f;                          /* to an integer, ties to even */
    return (uint16_t)(sign | (uint32_t)f);
}
#endif

static inline uint16_t to_bf16(uint32_t x) {
    if ((x & 0x7fffffff) > 0x7f800000) return (uint16_t)(((x >> 16) & 0x8000) | 0x7fc0);
    return (uint16_t)((x + 0x7fff + ((x >> 16) & 1)) >> 16);
}

static inline uint32_t from_half(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000) << 16, e = (h >> 10) & 0x1f, m = h & 0x3ff;
    if (e == 0) {                                               /* zero or subnormal: m * 2^-24 */
        float f = (float)m * 5.9604644775390625e-08f;
        uint32_t b;
        memcpy(&b, &f, 4);
        return sign | b;
    }
    if (e == 31) return sign | 0x7f800000 | (m << 13);
    return sign | ((e + 112) << 23) | (m << 13);
}

/* Values: vkind 0 float32, 1 float16, 2 bfloat16 (4, 2, 2 bytes); positions: ib bytes
   (1: uint8, 2: int16, 4: int32), native byte order, as the codec's torch path lays them. */
static inline void put_value(uint8_t *p, uint32_t bits, int vkind) {
    if (vkind == 0) {
        memcpy(p, &bits, 4);
    } else {
        uint16_t h = vkind == 1 ? to_half(bits) : to_bf16(bits);
        memcpy(p, &h, 2);
    }
}

static inline uint32_t get_value(const uint8_t *p, int vkind) {
    uint32_t bits;
    if (vkind == 0) {
        memcpy(&bits, p, 4);
        return bits;
    }
    uint16_t h;
    memcpy(&h, p, 2);
    return vkind == 1 ? from_half(h) : (uint32_t)h << 16;
}

static inline int64_t get_pos(const uint8_t *p, int ib) {
    if (ib == 1) return *p;
    if (ib == 2) {
        int16_t v;
        memcpy(&v, p, 2);
        return v;
    }
    int32_t v;
    memcpy(&v, p, 4);
    return v;
}

static inline void put_pos(uint8_t *p, int64_t c, int ib) {
    if (ib == 1) {
        *p = (uint8_t)c;
    } else if (ib == 2) {
        int16_t v = (int16_t)c;
        memcpy(p, &v, 2);
    } else {
        int32_t v = (int32_t)c;
        memcpy(p, &v, 4);
    }
}

/* DCT-MP's forward encoding of every row r of x [rows, cols]: payload row r (k * (vb + ib)
   bytes) = the k values of largest magnitude, then their k columns (select_row's order). */
static inline void encode_impl(const int32_t *x, int64_t rows, int64_t cols, int64_t k, const int vkind, const int ib,
                               uint8_t *payload) {
    const int64_t vb = vkind == 0 ? 4 : 2, row_bytes = k * (vb + ib);
    int32_t best[k];
    int64_t pos[k];
    for (int64_t r = 0; r < rows; r++) {
        const int32_t *row = x + r * cols;
        uint8_t *p = payload + r * row_bytes;
        select_row(row, cols, k, best, pos);
        for (int64_t i = 0; i < k; i++) {
            put_value(p + i * vb, (uint32_t)row[pos[i]], vkind);
            put_pos(p + k * vb + i * ib, pos[i], ib);
        }
    }
}

/* out[r, :] = zeros with the k values of row r of vals (stride vstride bytes) at the k
   columns of row r of idx (stride istride bytes), as float32 bits. Returns the number of
   columns outside 0..cols-1 (left unwritten: a corrupt message). */
static inline int64_t scatter_impl(const uint8_t *vals, int64_t vstride, const uint8_t *idx, int64_t istride,
                                   int64_t rows, int64_t cols, int64_t k, const int vkind, const int ib, uint32_t *out) {
    const int64_t vb = vkind == 0 ? 4 : 2;
    int64_t bad = 0;
    for (int64_t r = 0; r < rows; r++) {
        uint32_t *o = out + r * cols;
        memset(o, 0, (size_t)cols * 4);
        for (int64_t i = 0; i < k; i++) {
            const int64_t c = get_pos(idx + r * istride + i * ib, ib);
            if (c < 0 || c >= cols) {
                bad++;
                continue;
            }
            o[c] = get_value(vals + r * vstride + i * vb, vkind);
        }
    }
    return bad;
}

/* out row r (k * vb bytes) = the k values of g [rows, cols] at the columns of row r of idx
   (stride istride bytes), cast as vkind. Returns the number of columns outside 0..cols-1
   (their values written as 0). */
static inline int64_t gather_impl(const uint32_t *g, const uint8_t *idx, int64_t istride, int64_t rows, int64_t cols,
                                  int64_t k, const int vkind, const int ib, uint8_t *out) {
    const int64_t vb = vkind == 0 ? 4 : 2;
    int64_t bad = 0;
    for (int64_t r = 0; r < rows; r++) {
        for (int64_t i = 0; i < k; i++) {
            const int64_t c = get_pos(idx + r * istride + i * ib, ib);
            uint32_t v = 0;
            if (c < 0 || c >= cols) {
                bad++;
            } else {
                v = g[r * cols + c];
            }
            put_value(out + (r * k + i) * vb, v, vkind);
        }
    }
    return bad;
}

/* The entry points: the common wire (float16 values, one-byte columns) gets its own copy of
   each loop, with the value and position types known to the compiler. */
void topk_encode(const int32_t *x, int64_t rows, int64_t cols, int64_t k, int vkind, int ib, uint8_t *payload) {
    if (vkind == 1 && ib == 1) encode_impl(x, rows, cols, k, 1, 1, payload);
    else encode_impl(x, rows, cols, k, vkind, ib, payload);
}

int64_t topk_scatter(const uint8_t *vals, int64_t vstride, const uint8_t *idx, int64_t istride,
                     int64_t rows, int64_t cols, int64_t k, int vkind, int ib, uint32_t *out) {
    if (vkind == 1 && ib == 1) return scatter_impl(vals, vstride, idx, istride, rows, cols, k, 1, 1, out);
    return scatter_impl(vals, vstride, idx, istride, rows, cols, k, vkind, ib, out);
}

int64_t topk_gather(const uint32_t *g, const uint8_t *idx, int64_t istride, int64_t rows, int64_t cols,
                    int64_t k, int vkind, int ib, uint8_t *out) {
    if (vkind == 1 && ib == 1) return gather_impl(g, idx, istride, rows, cols, k, 1, 1, out);
    return gather_impl(g, idx, istride, rows, cols, k, vkind, ib, out);
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
                                 timeout=120, check=False)
            if res.returncode != 0:
                raise RuntimeError(f"{cc} failed (exit {res.returncode}): {res.stderr.strip()[-500:]}")
            os.replace(out, lib)
    dll = ctypes.CDLL(str(lib))
    i64, ptr, c_int = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
    dll.row_topk_f32.argtypes = [ptr, i64, i64, i64, ptr]
    dll.row_topk_f32.restype = None
    dll.topk_encode.argtypes = [ptr, i64, i64, i64, c_int, c_int, ptr]
    dll.topk_encode.restype = None
    dll.topk_scatter.argtypes = [ptr, i64, ptr, i64, i64, i64, i64, c_int, c_int, ptr]
    dll.topk_scatter.restype = i64
    dll.topk_gather.argtypes = [ptr, ptr, i64, i64, i64, i64, c_int, c_int, ptr]
    dll.topk_gather.restype = i64
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


_VALUE_KINDS = {"float32": (0, 4), "float16": (1, 2), "bfloat16": (2, 2)}


def _kinds(dtype, index_bytes: int) -> tuple[int, int]:
    name = str(dtype).rsplit(".", 1)[-1]
    if name not in _VALUE_KINDS or index_bytes not in (1, 2, 4):
        raise ValueError(f"native DCT-MP codec: values {dtype} / {index_bytes}-byte positions not supported")
    return _VALUE_KINDS[name]


def _cpu_bytes(b, what: str):
    import torch

    if b.dtype != torch.uint8 or b.device.type != "cpu":
        raise ValueError(f"native DCT-MP codec: {what} must be uint8 on the CPU, got {b.dtype} on {b.device}")
    return b.contiguous()


def _check(bad: int, what: str) -> None:
    if bad:
        raise ValueError(f"a DCT-MP {what} names {bad} column(s) outside its rows' width: "
                         "the message is corrupt or was coded for another layout")


def encode(x, k: int, dtype, index_bytes: int):
    """DCT-MP's forward bytes of a float32 CPU tensor ``x [..., C]``: per row, the ``k``
    values of largest magnitude cast to ``dtype`` (float32, float16 or bfloat16, rounded to
    nearest even), then their columns in ``index_bytes``-byte integers; uint8
    ``[..., k * (value bytes + index_bytes)]``. The same bytes as the codec's torch path with
    this selection (``codecs.TopKCodec``), in one pass."""
    import torch

    if x.dtype != torch.float32 or x.device.type != "cpu":
        raise ValueError(f"native DCT-MP codec takes float32 CPU tensors, got {x.dtype} on {x.device}")
    cols = x.shape[-1]
    if not 1 <= k <= cols:
        raise ValueError(f"k={k} outside 1..{cols}")
    kind, vb = _kinds(dtype, index_bytes)
    lib = library()
    x = x.contiguous()
    out = torch.empty(*x.shape[:-1], k * (vb + index_bytes), dtype=torch.uint8)
    rows = x.numel() // cols
    if rows:
        lib.topk_encode(x.data_ptr(), rows, cols, k, kind, index_bytes, out.data_ptr())
    return out


def decode(payload, cols: int, k: int, dtype, index_bytes: int):
    """The inverse of :func:`encode`: uint8 ``[..., R]`` -> float32 ``[..., cols]``, zeros
    but the ``k`` values of every row at their columns. Raises ValueError when a column lies
    outside ``0 .. cols - 1``."""
    return scatter(payload, payload, cols, k, dtype, index_bytes)


def scatter(values, positions, cols: int, k: int, dtype, index_bytes: int, out=None):
    """float32 ``[..., cols]``: zeros but, per row, the ``k`` values of ``values`` (uint8
    ``[..., >= k * value bytes]``, values first) at the columns that the same row of
    ``positions`` (a forward payload, uint8 ``[..., R]``: columns after ``k`` values) names;
    written into ``out`` (returned) when given: in place where it is a contiguous float32
    CPU tensor of that shape, else through a copy. Raises ValueError when a column lies
    outside ``0 .. cols - 1``."""
    import torch

    kind, vb = _kinds(dtype, index_bytes)
    values, positions = _cpu_bytes(values, "values"), _cpu_bytes(positions, "positions")
    rows = values.numel() // values.shape[-1] if values.shape[-1] else 0
    if positions.shape[:-1] != values.shape[:-1] or positions.shape[-1] < k * (vb + index_bytes) \
            or values.shape[-1] < k * vb:
        raise ValueError(f"native DCT-MP codec: values {tuple(values.shape)} and positions "
                         f"{tuple(positions.shape)} do not hold k={k} entries per row")
    shape = (*values.shape[:-1], cols)
    dst = out if (out is not None and out.dtype == torch.float32 and out.device.type == "cpu"
                  and tuple(out.shape) == shape and out.is_contiguous()) else torch.empty(shape, dtype=torch.float32)
    if rows and cols:
        bad = library().topk_scatter(values.data_ptr(), values.shape[-1], positions.data_ptr() + k * vb,
                                     positions.shape[-1], rows, cols, k, kind, index_bytes, dst.data_ptr())
        _check(bad, "message")
    return dst if out is None or dst is out else out.copy_(dst)


def gather(g, positions, k: int, dtype, index_bytes: int):
    """uint8 ``[..., k * value bytes]``: per row of the float32 CPU tensor ``g [..., C]``, its
    ``k`` values at the columns that the same row of ``positions`` (a forward payload) names,
    cast to ``dtype``. Raises ValueError when a column lies outside ``0 .. C - 1``."""
    import torch

    if g.dtype != torch.float32 or g.device.type != "cpu":
        raise ValueError(f"native DCT-MP codec takes float32 CPU gradients, got {g.dtype} on {g.device}")
    kind, vb = _kinds(dtype, index_bytes)
    g, positions = g.contiguous(), _cpu_bytes(positions, "positions")
    cols = g.shape[-1]
    if positions.shape[:-1] != g.shape[:-1] or positions.shape[-1] < k * (vb + index_bytes):
        raise ValueError(f"native DCT-MP codec: gradients {tuple(g.shape)} and positions "
                         f"{tuple(positions.shape)} do not match for k={k}")
    out = torch.empty(*g.shape[:-1], k * vb, dtype=torch.uint8)
    rows = g.numel() // cols if cols else 0
    if rows:
        bad = library().topk_gather(g.data_ptr(), positions.data_ptr() + k * vb, positions.shape[-1], rows, cols,
                                    k, kind, index_bytes, out.data_ptr())
        _check(bad, "sender's positions")
    return out
