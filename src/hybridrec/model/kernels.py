"""Dense kernels for the MLPs, chosen per layer by measurement on the machine that trains.

Why this exists: on CPU, ``torch.nn.functional.linear`` runs on MKL's sgemm (fp32) or
oneDNN (bf16), and PyTorch also ships oneDNN's own linear,
``torch.ops.mkldnn._linear_pointwise`` (the op its compiler emits for CPU linears). Which
is faster depends on the processor and the shape: on an AMD EPYC, oneDNN's fp32 runs the
DLRM layer shapes about 2x faster than MKL (which picks AVX2 code on non-Intel
processors); on an Intel Xeon with AMX, MKL is faster; in bf16 oneDNN is fast on wide
layers and two orders of magnitude slower than ``F.linear`` on a 13-wide input. So
nothing is chosen by vendor: :func:`tune_mlps` times every candidate on each layer's
actual shape (forward and backward, the batch the run trains with) and each layer keeps
the fastest. Choices are cached per machine, torch version, thread count, dtype and shape
(``~/.cache/hybridrec/kernels.json``, ``HYBRIDREC_CACHE_DIR`` moves it), so a run pays
for the measurement once. ``train.kernels`` overrides it (``torch`` or ``onednn``
everywhere; ``measure`` measures again and refreshes the cache).

Precision: inside ``torch.autocast`` (``train.precision=bf16``) :func:`linear` computes in
the autocast dtype with either candidate; the weights stay fp32 (the cast is part of the
graph, so their gradients arrive in fp32).

Candidates: ``torch`` (``F.linear``; any device and dtype) and ``onednn`` (CPU, fp32, or
bf16 where the processor has bf16 instructions, 2-D input; the backward runs the same op on
transposed operands). Both compute the same math; only the summation order differs.

Every race (:func:`race_checked`) first calls each candidate once and compares what it computes
with the first candidate's (the baseline, torch's own op): one that raises or disagrees is
excluded, with its reason in the choice (``summary.json`` ``kernels``, ``excluded``) and a
warning, and the next one is used.
"""

from __future__ import annotations

import json
import os
import platform
import threading
import time
import warnings
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

from hybridrec.model import triton_kernels

IMPLS = ("torch", "onednn")
"""The linear candidates, in order of preference when timings tie."""

PADDED = "torch_pad8"
"""A third linear candidate, on GPUs for layers whose fan-in is not a multiple of 8 (the DLRM's
13 dense inputs, its 415-wide interaction): ``F.linear`` with the input and the weight padded
with zero columns to a multiple of 8, so that cuBLAS's 16-byte-aligned kernels apply. The same
sums (the padding adds exact zeros); chosen only by measurement."""

CHOICES = ("auto", "measure", *IMPLS)
"""``train.kernels``: measure once and cache (auto), measure again (measure), or one linear
candidate everywhere (the embedding update is still chosen as in auto)."""


def _find_linear_pointwise():
    try:
        return torch.ops.mkldnn._linear_pointwise
    except (AttributeError, RuntimeError):
        return None


_LINEAR_POINTWISE = _find_linear_pointwise()


def onednn_available() -> bool:
    return _LINEAR_POINTWISE is not None and torch.backends.mkldnn.is_available()


def onednn_bf16_available() -> bool:
    """Whether oneDNN computes bf16 on this processor: torch's own check of the instructions
    its bf16 primitives need (AVX512BW/AVX512-BF16/AMX on x86; a Zen 3 has none of them, and
    there oneDNN cannot create a bf16 inner product). Should it miss a limit set by
    ``ONEDNN_MAX_CPU_ISA``, the race's first call finds it (:func:`race_checked`)."""
    if not onednn_available():
        return False
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


def compute_dtype(device: torch.device | str) -> torch.dtype | None:
    """The autocast dtype in force on ``device``'s type, or None outside autocast."""
    kind = torch.device(device).type
    return torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else None


def onednn_fits(device_type: str, dtype: torch.dtype, ndim: int = 2) -> bool:
    return (device_type == "cpu" and ndim == 2 and onednn_available()
            and (dtype == torch.float32 or (dtype == torch.bfloat16 and onednn_bf16_available())))


def onednn_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight.T + bias`` through oneDNN (the bias added in the product's epilogue); no
    autograd: for an autograd function's own forward (where :func:`onednn_fits`)."""
    return _LINEAR_POINTWISE(x, weight, bias, "none", [], "")


class _OneDNNLinear(torch.autograd.Function):
    """y = act(x @ w.T + b) with act in {identity, relu}, through oneDNN on CPU; every
    operand already in one dtype (fp32 or bf16)."""

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
        grad_y = grad_y.contiguous().to(x.dtype)
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


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, *,
           relu: bool = False, impl: str = "torch") -> torch.Tensor:
    """``act(x @ weight.T + bias)``; x ``[B, in]``, weight ``[out, in]``, returns ``[B, out]``.

    ``impl``: ``torch``, ``onednn`` (taken where it fits: CPU, fp32/bf16, 2-D; else
    ``torch``) or :data:`PADDED`. Inside autocast the operands are cast to its dtype first."""
    dtype = compute_dtype(x.device) or x.dtype
    if impl == PADDED and (pad := -x.shape[-1] % 8):
        x, weight = F.pad(x, (0, pad)), F.pad(weight, (0, pad))
    elif impl == "onednn" and onednn_fits(x.device.type, dtype, x.dim()):
        x, weight = x.to(dtype), weight.to(dtype)
        bias = None if bias is None else bias.to(dtype)
        with torch.autocast(x.device.type, enabled=False):
            return _OneDNNLinear.apply(x, weight, bias, relu)
    y = F.linear(x, weight, bias)
    return F.relu(y) if relu else y


# -- choosing by measurement ----------------------------------------------------


@dataclass(frozen=True)
class LinearShape:
    """One layer as it runs: ``batch x fan_in -> fan_out``, its activation, whether its
    input needs a gradient (the first layer of the bottom MLP's does not), the device
    and the compute dtype."""

    batch: int
    fan_in: int
    fan_out: int
    relu: bool
    input_grad: bool
    device: str = "cpu"
    dtype: str = "float32"

    def key(self) -> str:
        return (f"{self.device} {self.dtype} {self.batch}x{self.fan_in}->{self.fan_out}"
                f"{' relu' if self.relu else ''}{' dx' if self.input_grad else ''}")


def candidates(shape: LinearShape) -> list[str]:
    kind = torch.device(shape.device).type
    fits = onednn_fits(kind, getattr(torch, shape.dtype))
    pad = [PADDED] if kind == "cuda" and shape.fan_in % 8 else []
    return [i for i in IMPLS if i == "torch" or fits] + pad


CPU_FIELDS = ("model name", "cpu family", "model", "stepping")


def cpu_info(fields: tuple[str, ...] = CPU_FIELDS) -> dict[str, str]:
    """The first processor's ``fields`` from ``/proc/cpuinfo`` (empty where there is none)."""
    info: dict[str, str] = {}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            k, _, v = line.partition(":")
            k = k.strip()
            if k in fields and k not in info:
                info[k] = v.strip()
    except OSError:
        pass
    return info


ISA_LIMITS = ("ONEDNN_MAX_CPU_ISA", "ATEN_CPU_CAPABILITY")
"""Environment variables that limit the instructions torch's kernels use (on an AVX-512
processor, ``avx2`` makes torch behave as on one without): a choice made under one limit
does not hold under another."""


def machine_id() -> str:
    """The processor (model name, family, model, stepping), the instructions torch's kernels
    use (ATen's capability, and the :data:`ISA_LIMITS` set), torch version and threads, and
    the GPU when this process uses CUDA: what a cached choice holds for."""
    info = cpu_info()
    cpu = " ".join(info.get(k, "?") for k in CPU_FIELDS) if info else (platform.processor() or platform.machine())
    isa = " ".join([torch.backends.cpu.get_cpu_capability(),
                    *(f"{k}={os.environ[k]}" for k in ISA_LIMITS if os.environ.get(k))])
    # (is_initialized: a CPU run on a machine with a GPU makes no CUDA context just to name it)
    gpu = f" | {torch.cuda.get_device_name()}" if torch.cuda.is_initialized() else ""
    return f"{cpu} | {isa} | torch {torch.__version__} | {torch.get_num_threads()} threads{gpu}"


def cache_path() -> Path:
    base = os.environ.get("HYBRIDREC_CACHE_DIR")
    if base:
        return Path(base) / "kernels.json"
    xdg = os.environ.get("XDG_CACHE_HOME")
    return Path(xdg or Path.home() / ".cache") / "hybridrec" / "kernels.json"


_CACHE_LOCK = threading.Lock()


def _read_cache(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}  # missing, unreadable or damaged: measure again


def _write_cache(path: Path, new: dict) -> None:
    """Merge ``new`` into the cache file, atomically; a cache that cannot be written is
    only a cost (the next run measures again)."""
    with _CACHE_LOCK:
        try:
            data = {**_read_cache(path), **new}
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
            tmp.write_text(json.dumps(data, indent=1, sort_keys=True))
            os.replace(tmp, path)
        except OSError:
            pass


def race(impls: list[str], run, *, device: torch.device | str = "cpu", reps: int = 5, budget_s: float = 0.2,
         warmups: int = 1) -> dict[str, float]:
    """``{impl: seconds}``: the fastest of up to ``reps`` timed rounds of ``run(impl)`` on
    ``device`` (a GPU is synchronized around each call) after ``warmups`` untimed rounds
    (first calls create oneDNN primitives, fault pages in, grow allocator pools); fewer
    rounds when they would exceed ``budget_s``, at least one. Rounds alternate the
    candidates, so that a load that comes and goes weighs on all of them alike."""
    dev = torch.device(device)

    def once(impl: str) -> float:
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        start = time.perf_counter()
        run(impl)
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        return time.perf_counter() - start

    spent = sum(once(i) for _ in range(warmups) for i in impls)
    best = {i: float("inf") for i in impls}
    for _ in range(reps):
        for i in impls:
            t = once(i)
            best[i], spent = min(best[i], t), spent + t
        if spent > budget_s:
            break
    return best


@dataclass
class Timing:
    """What a race found: the seconds of each candidate that ran and agreed with the
    reference, and why each of the others was excluded."""

    seconds: dict[str, float]
    excluded: dict[str, str] = field(default_factory=dict)


def _tensors(out) -> list[torch.Tensor]:
    items = out if isinstance(out, (tuple, list)) else [out]
    return [t for t in items if isinstance(t, torch.Tensor)]


TOLERANCE = {torch.float32: 1e-4, torch.float64: 1e-9}
"""The largest relative difference (``|a - b| / |b|``, Euclidean norms of whole tensors)
between a candidate's outputs and the reference's that is only another summation order;
other dtypes (bf16, fp16): :data:`LOW_TOLERANCE`."""
LOW_TOLERANCE = 3e-2


def disagreement(got, want) -> str | None:
    """Why the tensors of ``got`` are not ``want``'s up to summation order (the number and
    shapes differ, a value is not finite, or the relative difference exceeds
    :data:`TOLERANCE`), or None when they agree."""
    got, want = _tensors(got), _tensors(want)
    if len(got) != len(want):
        return f"gave {len(got)} outputs, the reference {len(want)}"
    for i, (a, b) in enumerate(zip(got, want)):
        if a.shape != b.shape:
            return f"output {i} has shape {tuple(a.shape)}, the reference's {tuple(b.shape)}"
        if not a.is_floating_point():
            if not torch.equal(a, b):
                return f"output {i} differs from the reference's"
            continue
        a, b = a.detach().double(), b.detach().double()
        if not bool(torch.isfinite(a).all()) and bool(torch.isfinite(b).all()):
            return f"output {i} has values that are not finite"
        tol = max(TOLERANCE.get(x.dtype, LOW_TOLERANCE) for x in (got[i], want[i]))
        rel = float((a - b).norm() / b.norm().clamp(min=1e-30))
        if not rel <= tol:
            return f"output {i} differs from the reference's by {rel:.2g} (relative; at most {tol:g})"
    return None


def small_ints(*shape: int, generator: torch.Generator, device: torch.device | str) -> torch.Tensor:
    """float32 ``shape`` of integers in [-2, 2]: the operands a race checks its candidates on.
    Their products and the sums of thousands of them are exact in float32 (and the operands in
    bf16), so every summation order gives the same values and a ReLU's gate the same zeros: a
    candidate that agrees on random normal operands only up to a gate that rounding flipped
    (a whole row of a gradient apart) agrees here exactly, and any real difference shows."""
    return torch.randint(-2, 3, shape, generator=generator, device=device).float()


def race_checked(impls: list[str], run, *, device: torch.device | str, what: str, budget_s: float,
                 probe=None, reps: int = 5) -> Timing:
    """:func:`race` over the ``impls`` that compute what the first of them does.

    Each candidate is called once first, ``probe(impl)`` (default ``run(impl)``; when ``run``
    is the probe, that call is also its warm-up), and what it returns (a tensor or a tuple of
    them) compared with the first candidate's, the reference (:func:`disagreement`). One that
    raises (a kernel this processor or device cannot run) or returns other values is excluded,
    with a warning and its reason in :attr:`Timing.excluded`, and never chosen."""
    ok, excluded, ref = [], {}, None
    for impl in impls:
        try:
            out = (probe or run)(impl)
        except Exception as e:  # noqa: BLE001 (a candidate that cannot run here is dropped, said)
            excluded[impl] = f"raised {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}".rstrip(": ")
        else:
            why = None if ref is None else disagreement(out, ref)
            if why is None:
                ref = out if ref is None else ref
                ok.append(impl)
            else:
                excluded[impl] = f"wrong values: {why}"
        if impl in excluded:
            warnings.warn(f"{what} {impl!r} on {device}: {excluded[impl]}; not used", RuntimeWarning, stacklevel=2)
    seconds = race(ok, run, device=device, reps=reps, budget_s=budget_s, warmups=int(probe is not None)) if ok else {}
    return Timing(seconds, excluded)


def time_linears(shape: LinearShape, impls: list[str], *, reps: int = 5,
                 budget_s: float = 0.2) -> Timing:
    """Seconds of one forward and backward of each of ``impls`` on ``shape``
    (:func:`race_checked`: the output and the three gradients are compared, on
    :func:`small_ints`)."""
    dev, dtype = torch.device(shape.device), getattr(torch, shape.dtype)
    gen = torch.Generator(device=dev).manual_seed(0)
    x = small_ints(shape.batch, shape.fan_in, generator=gen, device=dev).requires_grad_(shape.input_grad)
    w = small_ints(shape.fan_out, shape.fan_in, generator=gen, device=dev).requires_grad_()
    b = small_ints(shape.fan_out, generator=gen, device=dev).requires_grad_()
    grad = small_ints(shape.batch, shape.fan_out, generator=gen, device=dev).to(dtype)
    low = dtype if dtype != torch.float32 else None

    def run(impl: str) -> tuple:
        x.grad = w.grad = b.grad = None
        with torch.autocast(dev.type, dtype=low or torch.bfloat16, enabled=low is not None):
            y = linear(x, w, b, relu=shape.relu, impl=impl)
        y.backward(grad)
        return y, x.grad, w.grad, b.grad

    return race_checked(impls, run, device=dev, what=f"linear {shape.key()}", reps=reps, budget_s=budget_s)


@dataclass
class Choice:
    key: str  # what was timed: op, device, dtype, shape
    impl: str
    source: str  # measured | cached | override | only
    seconds: dict[str, float]
    excluded: dict[str, str] = field(default_factory=dict)  # candidate -> why it is not used here

    def to_dict(self) -> dict:
        out = {"shape": self.key, "impl": self.impl, "source": self.source,
               "ms": {k: round(v * 1e3, 4) for k, v in self.seconds.items()}}
        return {**out, "excluded": dict(self.excluded)} if self.excluded else out


def _fastest(key: str, cands: list[str], got: Timing) -> str:
    """The fastest candidate that ran (ties: the earlier one); every candidate excluded is
    an error that names them and why (the first is torch's own op: nothing is left to run)."""
    if not got.seconds:
        why = "; ".join(f"{i}: {r}" for i, r in got.excluded.items())
        raise RuntimeError(f"{key}: no candidate runs on this machine ({why})")
    return min(got.seconds, key=lambda i: (got.seconds[i], cands.index(i)))


def choose(items: list[tuple[str, list[str], str | None]], timer, *, mode: str = "auto",
           budget_s: float = 0.5) -> dict[str, Choice]:
    """The implementation of each ``(key, candidates, forced)``, ``candidates`` led by the
    baseline (the reference every other is checked against): ``forced`` where given (an
    override that fits; when it is not the baseline, it is checked like a raced candidate and
    the baseline is used if it fails), else the only candidate, else the cached choice (unless
    ``mode`` is ``measure``; one made among the same candidates: a new candidate is timed),
    else the fastest by ``timer(key, candidates, budget_s) -> Timing``, cached with the
    candidates excluded and why. ``budget_s`` is shared by the keys to measure."""
    if mode not in CHOICES:
        raise ValueError(f"kernels {mode!r}: one of {', '.join(CHOICES)}")
    out: dict[str, Choice] = {}
    path, mid = cache_path(), machine_id()
    cached = {} if mode == "measure" else _read_cache(path)  # (an override reads it for the rest)
    todo = []
    for key, cands, forced in dict.fromkeys((k, tuple(c), f) for k, c, f in items):
        cands = list(cands)
        if forced is not None and forced != cands[0]:
            got = timer(key, [cands[0], forced], 0.0)  # (one timed round: a check, not a race)
            out[key] = Choice(key, forced if forced in got.seconds else _fastest(key, cands, got), "override", {},
                              got.excluded)
        elif forced is not None:
            out[key] = Choice(key, forced, "override", {})
        elif len(cands) == 1:
            out[key] = Choice(key, cands[0], "only", {})
        elif (hit := cached.get(f"{mid} | {key}")) and hit.get("candidates") == cands:
            out[key] = Choice(key, hit["impl"], "cached", {k: v / 1e3 for k, v in hit.get("ms", {}).items()},
                              dict(hit.get("excluded", {})))
        else:
            todo.append((key, cands))
    new = {}
    for key, cands in todo:
        got = timer(key, cands, budget_s / len(todo))
        best = _fastest(key, cands, got)
        out[key] = Choice(key, best, "measured", got.seconds, got.excluded)
        new[f"{mid} | {key}"] = {"impl": best, "candidates": cands, "excluded": got.excluded,
                                 "ms": {k: v * 1e3 for k, v in got.seconds.items()}}
    if new:
        _write_cache(path, new)
    return out


def choose_linears(shapes: Iterable[LinearShape], *, mode: str = "auto",
                   budget_s: float = 0.6) -> dict[LinearShape, Choice]:
    """Each distinct shape's linear: ``mode`` ``torch``/``onednn`` where it fits, else by
    :func:`choose` (cached, or timed by :func:`time_linears`)."""
    shapes = list(dict.fromkeys(shapes))
    by_key = {s.key(): s for s in shapes}
    items = []
    for s in shapes:
        cands = candidates(s)
        forced = (mode if mode in cands else "torch") if mode in IMPLS else None
        items.append((s.key(), cands, forced))
    got = choose(items, lambda key, cands, budget: time_linears(by_key[key], cands, budget_s=budget),
                 mode=mode, budget_s=budget_s)
    return {s: got[s.key()] for s in shapes}


# -- the embedding update: rows added into a table ---------------------------------

ROW_ADDS = ("scatter_add", "index_add", "triton")
"""``weight[ids] += alpha * delta`` with repeated ids: ``scatter_add_`` along dim 0 (splits the
work over columns) or ``index_add_`` (both after scaling ``delta`` in place), or on a GPU the
Triton kernel :func:`~hybridrec.model.triton_kernels.add_rows_` (the scale fused in). On a CPU
both torch ops are deterministic; which is fastest depends on the processor, the table and the
rows per step."""


def row_add_impls(device: torch.device | str) -> list[str]:
    """The row updates that run on ``device``."""
    return [i for i in ROW_ADDS if i != "triton" or triton_kernels.available(device)]


def rows_add_(weight: torch.Tensor, ids: torch.Tensor, delta: torch.Tensor, impl: str = "scatter_add",
              alpha: float = 1.0) -> None:
    """``weight[ids[i]] += alpha * delta[i]`` for every i, repeated ids summed (``delta`` may be
    scaled in place)."""
    if impl == "triton":
        triton_kernels.add_rows_(weight, ids, delta, alpha)
        return
    if alpha != 1.0:
        delta = delta.mul_(alpha)
    if impl == "index_add":
        weight.index_add_(0, ids, delta)
    else:
        weight.scatter_add_(0, ids.unsqueeze(1).expand(-1, weight.shape[1]), delta)


def rows_add_key(weight: torch.Tensor, nnz: int) -> str:
    rows, dim = weight.shape
    return f"rows_add {weight.device.type} {str(weight.dtype).removeprefix('torch.')} {rows}x{dim} +{nnz}"


PROBE_ROWS = 4096
"""The rows of the copy of a table's first rows that a row update's candidates are checked on."""


def time_rows_add(weight: torch.Tensor, nnz: int, impls: list[str], *, budget_s: float = 0.1) -> Timing:
    """Seconds of adding ``nnz`` rows at random ids into ``weight`` with each of ``impls``
    (:func:`race_checked`). The timed calls add zeros: the table keeps its values (a -0.0 may
    become +0.0); the check adds random rows, repeated ids among them, into a copy of the
    table's first :data:`PROBE_ROWS` rows."""
    gen = torch.Generator(device=weight.device).manual_seed(0)
    ids = torch.randint(0, weight.shape[0], (nnz,), generator=gen, device=weight.device)
    delta = torch.zeros(nnz, weight.shape[1], dtype=weight.dtype, device=weight.device)
    rows = min(weight.shape[0], PROBE_ROWS)
    probe_ids = torch.randint(0, rows, (min(nnz, 2 * rows),), generator=gen, device=weight.device)
    probe_delta = torch.randn(len(probe_ids), weight.shape[1], generator=gen, device=weight.device).to(weight.dtype)

    def run(impl: str) -> None:
        with torch.no_grad():
            rows_add_(weight, ids, delta, impl, alpha=-0.5)

    def probe(impl: str) -> torch.Tensor:
        table = weight[:rows].detach().clone()
        rows_add_(table, probe_ids, probe_delta.clone(), impl, alpha=-0.5)
        return table

    return race_checked(impls, run, probe=probe, device=weight.device, what="row update", budget_s=budget_s)


def choose_rows_add(weights: list[tuple[torch.Tensor, int]], *, mode: str = "auto",
                    budget_s: float = 0.2) -> list[Choice]:
    """The row update of each ``(table weight, rows added per step)``, by :func:`choose`."""
    keys = {rows_add_key(w, n): (w, n) for w, n in weights if w.numel() and n}
    got = choose([(k, row_add_impls(w.device), None) for k, (w, _) in keys.items()],
                 lambda key, cands, budget: time_rows_add(*keys[key], cands, budget_s=budget),
                 mode=mode, budget_s=budget_s)
    return [got[rows_add_key(w, n)] if w.numel() and n else Choice("", "scatter_add", "only", {})
            for w, n in weights]


def mlp_shapes(mlp, batch: int, *, device: str, dtype: str, input_grad: bool) -> list[LinearShape]:
    """The layer shapes of ``mlp`` (a :class:`~hybridrec.model.mlp.MLP`) at ``batch``."""
    last = len(mlp.layers) - 1
    return [LinearShape(batch, layer.in_features, layer.out_features,
                        relu=(i < last or mlp.final_relu), input_grad=(input_grad or i > 0),
                        device=device, dtype=dtype)
            for i, layer in enumerate(mlp.layers)]


# -- precision ------------------------------------------------------------------

PRECISIONS = {"fp32": None, "bf16": torch.bfloat16}
"""``train.precision``: the compute dtype of the dense arches (None: fp32 throughout)."""


def check_precision(precision: str) -> str:
    """``precision`` when it is one of :data:`PRECISIONS`, else a ValueError."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision {precision!r}: one of {', '.join(PRECISIONS)}")
    return precision


def precision_scope(precision: str, device: torch.device | str):
    """Autocast to ``precision``'s dtype on ``device`` (a no-op scope for fp32): MLPs and
    interactions compute in it, parameters and their gradients stay fp32."""
    dtype = PRECISIONS[check_precision(precision)]
    kind = torch.device(device).type
    return torch.autocast(kind, dtype=dtype or torch.bfloat16, enabled=dtype is not None)


BF16_FLAGS = ("avx512_bf16", "amx_bf16", "avx512bw")
"""The x86 instructions (``/proc/cpuinfo`` flags) torch's oneDNN computes bf16 with: native
bf16 dot products (AVX512-BF16, AMX), or AVX-512 that converts and computes in fp32."""


def cpu_flags() -> set[str]:
    """The first processor's ``flags`` from ``/proc/cpuinfo`` (empty where there is none)."""
    return set(cpu_info(("flags",)).get("flags", "").split())


def cpu_name() -> str:
    """The processor as a benchmark table names it: model name, family and model."""
    info = cpu_info()
    if not info:
        return platform.processor() or platform.machine()
    return f"{info.get('model name', '?')} (family {info.get('cpu family', '?')}, model {info.get('model', '?')})"


def precision_problem(precision: str, device: torch.device | str) -> str | None:
    """Why ``precision`` is refused on ``device``, or None. ``bf16`` on a CPU that torch's
    oneDNN has no bf16 kernels for (no AVX-512, no bf16 instructions: a Zen 3) is refused: torch
    emulates bf16 there, at the same AUC but 7x slower than fp32 on the demo recipe
    (docs/benchmarks.md, "A processor without bf16"), so it gives nothing that bf16 is for."""
    if PRECISIONS[check_precision(precision)] is None or torch.device(device).type != "cpu" \
            or onednn_bf16_available():
        return None
    flags = cpu_flags()
    missing = [f.upper() for f in BF16_FLAGS if f not in flags] or ["the bf16 kernels of torch's oneDNN"]
    return (f"train.precision={precision}: this processor, {cpu_name()}, has no {', no '.join(missing)}; "
            "torch would emulate bf16 here, 7x slower than fp32 at the same AUC (docs/benchmarks.md). "
            "Use train.precision=fp32 (the default; model.embedding_dtype=bf16 still halves the tables, "
            "compress.embedding=bf16 the pooled rows on the wire)")
