"""Gradient compressors: what of a gradient is sent, and the state that decides it.

One small interface, independent of the collective that carries the result::

    payload = compressor.compress(key, grad)     # grad: [n]; updates the state of `key`
    dense   = compressor.decompress(payload)     # [n], what the receiver adds up

``key`` names one tensor (a parameter) and owns its state (residual, threshold, step);
the payload is a :class:`~hybridrec.comm.sparse_message.SparseGrad` for sparsifiers and
a dense tensor (possibly of a narrower dtype) otherwise, so a DDP comm hook
(:mod:`hybridrec.comm.ddp_hooks`) or a parameter-server push can ship either.

- :class:`NoCompression`: the gradient itself (the plain all-reduce baseline).
- :class:`CastCompressor`: fp16 or bf16 casting.
- :class:`TopKCompressor`: exact top-k by magnitude, every step, with error feedback.
- :class:`DCTCompressor`: DCT-DP, a magnitude threshold refreshed every L steps, its
  message bounded by a cap.

A sparsifier's message carries a ``capacity`` (:meth:`_Sparsifier.capacity`): at most that
many entries, a number every rank derives from the tensor's size alone (top-k: K; DCT:
its cap). The hooks then sum it with one exchange of fixed-size buffers and no exchange
of message sizes first (:class:`~hybridrec.comm.sparse_message.FixedLayout`).

PowerSGD needs two collectives with a computation between them, so it is not a
payload compressor; it is a hook around PyTorch's own (``ddp_hooks.PowerSGDHooks``).
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from hybridrec.comm.sparse_message import SparseGrad

Payload = torch.Tensor | SparseGrad


@dataclass
class TensorState:
    """The per-tensor state of a compressor."""

    step: int = 0
    """Times this tensor was compressed: the warm-up and DCT's refresh cadence count it."""
    residual: torch.Tensor | None = None
    """``[n]``: what was not sent yet (error feedback), added to the next gradient; None
    while nothing is held back."""
    tau: torch.Tensor | None = None
    """DCT's threshold (0-d), held fixed between refreshes; None = refresh at the next step."""
    refreshes: int = 0
    """DCT: how many times the threshold was recomputed (the expensive top-k)."""


class GradientCompressor(ABC):
    """Base: per-tensor state keyed by name, warm-up, state_dict.

    Subclasses implement :meth:`_compress` on ``x`` = gradient + residual.
    """

    kind: str = ""

    def __init__(self, *, warmup_steps: int = 0) -> None:
        if warmup_steps < 0:
            raise ValueError(f"warmup_steps must be >= 0, got {warmup_steps}")
        # The first steps of training move far and are sensitive to biased gradients.
        self.warmup_steps = warmup_steps
        self.states: dict[str, TensorState] = {}

    def compress(self, key: str, grad: torch.Tensor) -> Payload:
        """What to send of ``grad`` (``[n]``; other shapes are read flat), a
        :class:`SparseGrad` of ``n`` entries or a dense ``[n]`` tensor. Does not modify
        ``grad``; updates the state of ``key`` (one call per tensor per step)."""
        flat = grad.reshape(-1)
        st = self.states.setdefault(key, TensorState())
        if st.residual is not None and st.residual.numel() != flat.numel():
            raise ValueError(f"{key}: gradient of {flat.numel()} entries, residual of {st.residual.numel()}")
        x = flat if st.residual is None else flat + st.residual
        if st.step < self.warmup_steps:
            st.residual, out = None, x.clone() if x is flat else x  # everything goes
        else:
            out = self._compress(st, x, x is flat)
        st.step += 1
        return out

    @abstractmethod
    def _compress(self, st: TensorState, x: torch.Tensor, shared: bool) -> Payload:
        """Payload of ``x`` (``[n]``); sets ``st.residual``. ``shared``: ``x`` is the
        caller's gradient and must not be modified or kept."""

    @staticmethod
    def decompress(payload: Payload, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The dense ``[n]`` tensor of a payload, in ``dtype``."""
        if isinstance(payload, SparseGrad):
            return payload.to_dense(dtype)
        return payload.to(dtype)

    def residual(self, key: str) -> torch.Tensor | None:
        """``[n]`` what ``key`` holds back, or None."""
        st = self.states.get(key)
        return None if st is None else st.residual

    def hyperparameters(self) -> dict[str, Any]:
        return {"kind": self.kind, "warmup_steps": self.warmup_steps}

    def state_dict(self) -> dict[str, Any]:
        """``{"hyperparameters": {...}, "tensors": {key: {"step", "residual", "tau", "refreshes"}}}``."""
        return {
            "hyperparameters": self.hyperparameters(),
            "tensors": {k: {"step": s.step, "residual": s.residual, "tau": s.tau, "refreshes": s.refreshes}
                        for k, s in self.states.items()},
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restores :meth:`state_dict`; raises ValueError if it is another compressor's."""
        if state["hyperparameters"] != self.hyperparameters():
            raise ValueError(f"compressor state of {state['hyperparameters']} loaded into "
                             f"{self.hyperparameters()}")
        self.states = {k: TensorState(**v) for k, v in state["tensors"].items()}


class NoCompression(GradientCompressor):
    """Sends the gradient as it is (the baseline)."""

    kind = "none"

    def _compress(self, st, x, shared):
        return x.clone() if shared else x


class CastCompressor(GradientCompressor):
    """Sends the gradient cast to fp16 or bf16 (no residual: the rounding error is
    relative, about 2^-11 for fp16 and 2^-8 for bf16)."""

    DTYPES: ClassVar[dict[str, torch.dtype]] = {"fp16": torch.float16, "bf16": torch.bfloat16}

    def __init__(self, dtype: str, *, warmup_steps: int = 0) -> None:
        super().__init__(warmup_steps=warmup_steps)
        if dtype not in self.DTYPES:
            raise ValueError(f"CastCompressor dtype {dtype!r}: fp16 or bf16")
        self.kind = dtype
        self.dtype = self.DTYPES[dtype]

    def _compress(self, st, x, shared):
        return x.to(self.dtype)


def keep_count(ratio: float, numel: int) -> int:
    """``K = ceil(ratio * numel)``, at least 1 (rounded first, so that 0.01 * 100 is 1)."""
    return min(numel, max(1, math.ceil(round(ratio * numel, 6))))


class _Sparsifier(GradientCompressor):
    """Sends some entries of ``x`` = gradient + residual, keeps the rest as the residual."""

    def __init__(self, ratio: float, *, error_feedback: bool = True, warmup_steps: int = 0,
                 min_numel: int = 0) -> None:
        super().__init__(warmup_steps=warmup_steps)
        if not 0 < ratio <= 1:
            raise ValueError(f"ratio (eta) must be in (0, 1], got {ratio}")
        if min_numel < 0:
            raise ValueError(f"min_numel must be >= 0, got {min_numel}")
        # Tensors of fewer entries go whole, every step (no residual): their bytes are few,
        # and an eta share of a bias or a 256-entry output layer is one or two entries a step.
        self.min_numel = min_numel
        # Fraction of entries kept (eta): K = ceil(eta * n) per tensor.
        self.ratio = ratio
        # Without it the unsent entries are lost; with it they are delayed (biased
        # compressors such as top-k need it to converge like uncompressed SGD).
        self.error_feedback = error_feedback

    def hyperparameters(self):
        out = {**super().hyperparameters(), "ratio": self.ratio, "error_feedback": self.error_feedback}
        if self.min_numel:  # (absent at 0: states saved before it existed load unchanged)
            out["min_numel"] = self.min_numel
        return out

    def capacity(self, numel: int) -> int | None:
        """At most how many entries a message of a ``numel`` tensor holds, the same on every
        rank; None: no bound below ``numel`` (the message travels at its own size, which the
        peers must be told first)."""
        return None

    def _compress(self, st, x, shared):
        if x.numel() < self.min_numel:
            st.residual = None
            return x.clone() if shared else x
        idx = self._select(st, x)
        msg = SparseGrad(idx, x[idx], x.numel(), self.capacity(x.numel()))
        if self.error_feedback:
            residual = x.clone() if shared else x
            residual[idx] = 0
            st.residual = residual
        return msg

    @abstractmethod
    def _select(self, st: TensorState, x: torch.Tensor) -> torch.Tensor:
        """Ascending int64 indices of the entries of ``x`` to send (never an exact zero)."""


def refresh_due(step: int, every: int, ramp: bool = False) -> bool:
    """Whether a threshold is recomputed at compressed step ``step`` (0-based) with refresh
    period ``every`` (L). Without ``ramp``: steps 0, L, 2L, ... With ``ramp``: gaps of 1, 2,
    4, ... while they are below L, then L: for L = 10, steps 0, 1, 3, 7, 15, 25, 35, ...
    (the doubling phase ends at step ``2^m - 1``, ``m`` the doublings below L)."""
    if not ramp:
        return step % every == 0
    m = max(0, (every - 1).bit_length())  # gaps 1, 2, ..., 2^(m-1) are all < every
    ramp_end = (1 << m) - 1
    if step < ramp_end:
        return ((step + 1) & step) == 0  # step + 1 a power of two
    return (step - ramp_end) % every == 0


def auto_refresh_every(total_steps: int) -> int:
    """L chosen from the run's length: 1% of its steps, at least 10 and at most 2000 (the
    paper's "every few thousand" for runs of hundreds of thousands of steps)."""
    return min(2000, max(10, round(total_steps / 100)))


def _top(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(indices, tau)``: the nonzero entries among the ``k`` largest ``|x|``, ascending,
    and the ``k``-th largest magnitude."""
    mags, idx = torch.topk(x.abs(), k, sorted=False)
    return idx[mags > 0].sort().values, mags.min()


class TopKCompressor(_Sparsifier):
    """Exact top-k: every step, the ``K = ceil(ratio * n)`` entries of largest magnitude
    (fewer when fewer are nonzero; ties broken by ``torch.topk``)."""

    kind = "topk"

    def capacity(self, numel):
        # ratio 1 keeps everything: only the nonzero entries travel, at their own count
        return None if self.ratio == 1 else keep_count(self.ratio, numel)

    def _select(self, st, x):
        return _top(x, keep_count(self.ratio, x.numel()))[0]


class DCTCompressor(_Sparsifier):
    """DCT-DP: send the entries with ``|x| >= tau``, where ``tau`` is the K-th largest
    magnitude of ``x`` (``K = ceil(ratio * n)``) recomputed only every ``refresh_every``
    compressed steps of a tensor and held fixed in between, so the top-k runs rarely and
    the number sent varies between refreshes, up to a cap.

    - At a refresh step exactly the top-K entries are sent (ties broken by ``torch.topk``),
      so the count there is K whatever the ties; in between, every entry at or above tau.
    - ``cap``: a message holds at most ``ceil(cap * K)`` entries (:meth:`capacity`; at least
      K, at most n). When more pass the threshold, the largest ``ceil(cap * K)`` of them are
      sent and the others stay in the residual (error feedback sends them later; without
      it they are dropped, as every unsent entry is); a tensor of so few entries that K is
      all of them is bounded by its size. This is a simplification of the
      paper's pure threshold: a bounded message, so that it travels in a buffer of fixed
      size and no message sizes are exchanged before it (a round trip in the middle of the
      backward). The cost: the padding when fewer pass, counted as sent. ``cap=None``:
      the pure threshold, a message of its own size. The cap counts nothing while the
      threshold lets through at most K entries (e.g. at refreshes, or as gradients shrink).
    - ``ratio = 1`` keeps everything: tau is 0 and every nonzero entry is sent (no cap).
    - A refreshed tau of 0 with K < n (fewer than K nonzero entries, e.g. an all-zero
      gradient) would send every nonzero entry until the next refresh, so the threshold
      is recomputed at the next step instead.
    - Exact zeros are never sent.
    - ``ramp``: the first refreshes come sooner, after 1, 2, 4, ... compressed steps (the
      gap doubling until it reaches L), then every L (:func:`refresh_due`). Early in
      training gradients shrink fast, and a threshold held from step 0 for L steps lets
      fewer and fewer entries through; the ramp costs ``log2(L)`` extra top-k passes.
    """

    kind = "dct"
    DEFAULT_CAP = 1.25
    """The cap's slack over K. Between refreshes the count mostly falls below K (the
    threshold was set on larger gradients); 1.25 leaves room for a quarter more before
    entries wait, and keeps the padding (what a fixed-size message costs in bytes) at a
    quarter of K's entries at most."""

    def __init__(self, ratio: float, refresh_every: int, *, error_feedback: bool = True,
                 warmup_steps: int = 0, ramp: bool = False, cap: float | None = DEFAULT_CAP,
                 min_numel: int = 0) -> None:
        super().__init__(ratio, error_feedback=error_feedback, warmup_steps=warmup_steps,
                         min_numel=min_numel)
        if refresh_every < 1:
            raise ValueError(f"refresh_every (L) must be >= 1, got {refresh_every}")
        if cap is not None and not cap >= 1:
            raise ValueError(f"DCT cap must be >= 1 (a multiple of K) or None, got {cap}")
        # L: the top-k behind tau costs a sort-like pass; holding tau L steps amortises it.
        self.refresh_every = refresh_every
        self.ramp = ramp
        self.cap = cap
        # Not checkpointed: how often the cap held entries back, and how many (diagnostics).
        self.capped_steps = 0
        self.capped_entries = 0

    def hyperparameters(self):
        return {**super().hyperparameters(), "refresh_every": self.refresh_every, "ramp": self.ramp,
                "cap": self.cap}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """As the base class; a state saved before the cap existed (no ``cap`` among its
        hyperparameters) loads into any cap: its residuals and thresholds mean the same."""
        saved = state["hyperparameters"]
        if "cap" not in saved:
            state = {**state, "hyperparameters": {**saved, "cap": self.cap}}
        super().load_state_dict(state)

    def capacity(self, numel):
        if self.cap is None or self.ratio == 1:
            return None
        return min(numel, math.ceil(round(self.cap * keep_count(self.ratio, numel), 6)))

    def due(self, st: TensorState) -> bool:
        """True when ``tau`` is recomputed at this step (:func:`refresh_due` of the compressed
        steps counted after the warm-up) and whenever no valid threshold is held."""
        return st.tau is None or refresh_due(st.step - self.warmup_steps, self.refresh_every, self.ramp)

    def _select(self, st, x):
        k = keep_count(self.ratio, x.numel())
        if k == x.numel():
            st.tau = torch.zeros((), dtype=x.dtype, device=x.device)
            return x.nonzero().squeeze(1)
        if self.due(st):
            idx, tau = _top(x, k)
            st.refreshes += 1
            # Host read, only at a refresh: a zero threshold is not held (see the class doc).
            st.tau = tau if float(tau) > 0 else None
            return idx
        idx = (x.abs() >= st.tau).nonzero().squeeze(1)
        cap = self.capacity(x.numel())
        if cap is not None and idx.numel() > cap:  # (the count is known: nonzero synchronized)
            self.capped_steps += 1
            self.capped_entries += idx.numel() - cap
            idx = idx[x[idx].abs().topk(cap, sorted=False).indices].sort().values
        return idx

    def threshold(self, key: str) -> float | None:
        """The threshold held for ``key`` (None before the first refresh or after a zero one)."""
        st = self.states.get(key)
        return None if st is None or st.tau is None else float(st.tau)
