"""Feature interactions between the bottom-MLP output and the pooled embeddings."""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch
from torch import nn

from hybridrec.model.kernels import (
    Choice,
    Timing,
    choose,
    compute_dtype,
    onednn_fits,
    onednn_linear,
    race_checked,
    small_ints,
)


class _PairwiseDot(torch.autograd.Function):
    """Strictly-lower-triangular Gram entries of each sample's ``[F, D]`` matrix.

    Forward is one batched matmul; backward is one batched matmul too (autograd
    of ``bmm(z, z.T)`` would run two), because with ``S`` the symmetric matrix
    holding the output gradient on both triangles, ``dz = S @ z``.

    Two ways to pick the entries out and put their gradient back (``impl``; and on a GPU
    ``gather`` over a padded matrix, :data:`INTERACTION_IMPLS`), timed
    against each other at start-up (which is faster depends on the processor and the
    dtype, see :func:`tune_interactions`):

    - ``index``: advanced indexing ``gram[:, rows, cols]``; backward writes the lower
      triangle and adds the transpose.
    - ``gather``: ``gather`` on the flattened Gram matrix; backward scatters the gradient
      into both triangles at once (no transpose added).
    """

    @staticmethod
    def forward(ctx, z, pairs: _Pairs, impl: str):
        b, n = z.shape[0], z.shape[1]
        ctx.save_for_backward(z)
        ctx.pairs, ctx.impl = pairs, impl
        gram = torch.bmm(z, z.transpose(1, 2))
        if impl == "gather":
            return torch.gather(gram.view(b, n * n), 1, pairs.lower.expand(b, -1))
        return gram[:, pairs.rows, pairs.cols]

    @staticmethod
    def backward(ctx, grad_out):
        (z,) = ctx.saved_tensors
        p, b, n = ctx.pairs, z.shape[0], z.shape[1]
        if ctx.impl == "gather":
            sym = grad_out.new_zeros(b, n * n)
            sym.scatter_(1, p.both.expand(b, -1), torch.cat([grad_out, grad_out], dim=1))
            sym = sym.view(b, n, n)
        else:
            sym = grad_out.new_zeros(b, n, n)
            sym[:, p.rows, p.cols] = grad_out
            sym = sym + sym.transpose(1, 2)
        return torch.bmm(sym, z), None, None


class _Pairs(NamedTuple):
    """The strictly lower triangle of an ``n x n`` matrix: ``rows``, ``cols``, their flat
    positions ``lower`` and, after them, the mirrored upper ones (``both``; disjoint from
    ``lower``: nothing on the diagonal)."""

    rows: torch.Tensor
    cols: torch.Tensor
    lower: torch.Tensor
    both: torch.Tensor


INTERACTION_IMPLS = ("index", "gather", "gather_pad")
"""``gather_pad``: ``gather`` over the ``[F+1, D]`` matrix padded with zero rows to a multiple of
8, so that the batched products' operands are 16-byte aligned (on a GPU, cuBLAS's fast kernels
need it); the same values (the padding adds exact zeros nowhere it is read). A candidate on GPUs
only (:func:`interaction_impls`)."""


def interaction_impls(device: str) -> list[str]:
    """The candidates timed on ``device``'s type (the padding only pays where alignment picks
    the kernel: on a GPU)."""
    return list(INTERACTION_IMPLS) if torch.device(device).type == "cuda" else ["index", "gather"]


class DotInteraction(nn.Module):
    """DLRM's pairwise dot interaction.

    Inputs: ``dense`` ``[B, D]`` (bottom-MLP output) and ``sparse`` ``[B, F, D]``
    (pooled embeddings). Output ``[B, D + (F+1)F/2]``: the dense vector followed
    by the dot products of every distinct pair among the F+1 vectors. Under bf16
    autocast both are cast before they are stacked and the Gram matrix is bf16.
    """

    def __init__(self, num_features: int, dim: int | None = None) -> None:
        super().__init__()
        self.num_features, self.dim = num_features, dim  # (dim: for timing; None: unknown)
        n = num_features + 1
        rows, cols = torch.tril_indices(n, n, offset=-1)
        self.register_buffer("rows", rows, persistent=False)
        self.register_buffer("cols", cols, persistent=False)
        self.register_buffer("lower", rows * n + cols, persistent=False)
        self.register_buffer("both", torch.cat([rows * n + cols, cols * n + rows]), persistent=False)
        m = self.padded = -(-n // 8) * 8  # gather_pad's rows: a multiple of 8
        self.register_buffer("lower_pad", rows * m + cols, persistent=False)
        self.register_buffer("both_pad", torch.cat([rows * m + cols, cols * m + rows]), persistent=False)
        self.impl = "index"
        """How the entries are picked (``INTERACTION_IMPLS``); set by :func:`tune_interactions`."""
        self._orders: dict = {}  # (order, m, device) -> its _Pairs (DotInteraction._pairs)

    @staticmethod
    def output_dim(num_features: int, dim: int) -> int:
        return dim + (num_features + 1) * num_features // 2

    def forward(self, dense: torch.Tensor, sparse: torch.Tensor | Sequence[torch.Tensor],
                order: Sequence[int] | None = None) -> torch.Tensor:
        """``sparse``: ``[B, F, D]``; or ``[B, F_i, D]`` parts whose features, side by side,
        are those of ``order`` (``order[k]``: the index of the ``k``-th in the features'
        order; :meth:`~hybridrec.model.embedding.KeyedTensor.as_parts`): they are stacked
        as they come, in one copy, and the pairs are picked where that order put them. The
        output is the same either way (the same dot products, in the same places)."""
        low = compute_dtype(dense.device)  # bf16 precision: cast first, stack in bf16
        parts = [sparse] if isinstance(sparse, torch.Tensor) else list(sparse)
        if low is not None:
            dense, parts = dense.to(low), [p.to(low) for p in parts]
        impl, m = self.impl, self.num_features + 1
        if impl == "gather_pad":  # zero rows up to a multiple of 8: aligned batched products
            m = self.padded
            parts.append(parts[0].new_zeros(parts[0].shape[0], m - self.num_features - 1, parts[0].shape[2]))
            impl = "gather"
        pairs = self._pairs(None if order is None else tuple(order), m)
        z = torch.cat([dense.unsqueeze(1), *parts], dim=1)
        with torch.autocast(z.device.type, enabled=False):
            return torch.cat([dense, _PairwiseDot.apply(z, pairs, impl)], dim=1)

    def _pairs(self, order: tuple[int, ...] | None, m: int) -> _Pairs:
        """The pairs' rows and columns (and their flat positions in an ``[m, m]`` matrix)
        where the features stand in ``order`` (None: their own), the dense vector first:
        the pair ``(i, j)`` of the features' order at ``(at[i], at[j])``, on either side of
        the diagonal (the Gram matrix is symmetric). Made once per order."""
        if order is None:
            if m == self.num_features + 1:
                return _Pairs(self.rows, self.cols, self.lower, self.both)
            return _Pairs(self.rows, self.cols, self.lower_pad, self.both_pad)
        key = (order, m, self.rows.device)
        got = self._orders.get(key)
        if got is None:
            if sorted(order) != list(range(self.num_features)):
                raise ValueError(f"an order of the {self.num_features} features, got {list(order)}")
            dev = self.rows.device
            at = torch.zeros(self.num_features + 1, dtype=torch.long, device=dev)
            at[torch.tensor(order, device=dev) + 1] = torch.arange(1, self.num_features + 1, device=dev)
            rows, cols = at[self.rows], at[self.cols]
            got = self._orders[key] = _Pairs(rows, cols, rows * m + cols,
                                             torch.cat([rows * m + cols, cols * m + rows]))
        return got


def time_dot_interaction(batch: int, num_features: int, dim: int, impls: list[str], *,
                         device: str = "cpu", dtype: str = "float32", reps: int = 5,
                         budget_s: float = 0.2) -> Timing:
    """Seconds of one forward and backward of :class:`DotInteraction` with each of
    ``impls`` (:func:`~hybridrec.model.kernels.race_checked`: the output and both gradients
    are compared, on :func:`~hybridrec.model.kernels.small_ints`)."""
    gen = torch.Generator(device=device).manual_seed(0)
    low = getattr(torch, dtype)
    dense = small_ints(batch, dim, generator=gen, device=device).requires_grad_()
    sparse = small_ints(batch, num_features, dim, generator=gen, device=device).requires_grad_()
    mod = DotInteraction(num_features).to(device)

    def run(impl: str) -> tuple:
        mod.impl, dense.grad, sparse.grad = impl, None, None
        with torch.autocast(torch.device(device).type, dtype=low if low != torch.float32 else torch.bfloat16,
                            enabled=low != torch.float32):
            out = mod(dense, sparse)
        out.sum().backward()
        return out, dense.grad, sparse.grad

    return race_checked(impls, run, device=device, what=f"interaction {batch}x{num_features + 1}x{dim}",
                        reps=reps, budget_s=budget_s)


def time_cross_net(batch: int, width: int, rank: int, layers: int, impls: list[str], *, device: str = "cpu",
                   dtype: str = "float32", reps: int = 5, budget_s: float = 0.2) -> Timing:
    """Seconds of one forward and backward of a :class:`CrossInteraction`'s layers with each
    of ``impls`` (:func:`~hybridrec.model.kernels.race_checked`: the output and every gradient
    compared; operands :func:`~hybridrec.model.kernels.small_ints` scaled by 1/8, so that three
    layers' products stay well inside float32's exact integers)."""
    gen = torch.Generator(device=device).manual_seed(0)
    low = getattr(torch, dtype)

    def ints(*shape: int) -> torch.Tensor:
        return (small_ints(*shape, generator=gen, device=device) / 8).to(low).requires_grad_()

    x0 = ints(batch, width)
    weights = [w for _ in range(layers) for w in (ints(rank, width), ints(width, rank), ints(width))]
    grad = small_ints(batch, width, generator=gen, device=device).to(low)

    def run(impl: str) -> tuple:
        for t in (x0, *weights):
            t.grad = None
        out = _CrossNet.apply(impl, x0, *weights)
        out.backward(grad)
        return out, x0.grad, *(w.grad for w in weights)

    return race_checked(impls, run, device=device, what=f"cross network {batch}x{width} rank {rank}",
                        reps=reps, budget_s=budget_s)


def tune_interactions(model: nn.Module, batch: int, *, mode: str = "auto", device: str = "cpu",
                      dtype: str = "float32", agree=None) -> list[Choice]:
    """Choose every :class:`DotInteraction`'s and :class:`CrossInteraction`'s implementation
    in ``model`` by measurement at ``batch`` rows (``mode`` and ``agree`` as for
    :func:`~hybridrec.model.mlp.tune_mlps`; the ``torch``/``onednn`` overrides concern the
    linears and leave the dot interaction measured; a cross network takes them as its
    linears do)."""
    mods = [(name, m) for name, m in model.named_modules()
            if (isinstance(m, DotInteraction) and m.dim is not None) or isinstance(m, CrossInteraction)]
    if not mods:
        return []
    keys, timers, items = {}, {}, {}
    for name, m in mods:
        if isinstance(m, CrossInteraction):
            key = f"cross_net {device} {dtype} {batch}x{m.width} rank {m.rank} x{len(m.down)}"
            cands = cross_impls(device, dtype)
            forced = (mode if mode in cands else "torch") if mode in CROSS_IMPLS else None
            timers[key] = (lambda c, b, m=m: time_cross_net(batch, m.width, m.rank, len(m.down), c, device=device,
                                                             dtype=dtype, budget_s=b))
        else:
            key = f"dot_interaction {device} {dtype} {batch}x{m.num_features + 1}x{m.dim}"
            cands, forced = interaction_impls(device), None
            timers[key] = (lambda c, b, m=m: time_dot_interaction(batch, m.num_features, m.dim, c, device=device,
                                                                   dtype=dtype, budget_s=b))
        keys[name] = key
        items[key] = (key, cands, forced)
    got = choose(list(items.values()), lambda key, cands, budget: timers[key](cands, budget), mode=mode,
                 budget_s=0.3 * len(items))
    picks = {name: got[keys[name]].impl for name, _ in mods}
    if agree is not None:
        picks = agree(picks)
    for name, m in mods:
        m.impl = picks[name]
    return [got[k] for k in dict.fromkeys(keys.values())]


class CatInteraction(nn.Module):
    """Concatenation (no interaction): output ``[B, D + F*D]``."""

    @staticmethod
    def output_dim(num_features: int, dim: int) -> int:
        return dim * (num_features + 1)

    def forward(self, dense: torch.Tensor, sparse: torch.Tensor) -> torch.Tensor:
        return torch.cat([dense, sparse.flatten(1)], dim=1)


DCN_RANK_SHARE = 4
"""The low rank of a cross layer is at most its input width // ``DCN_RANK_SHARE``."""

DCN_NARROW = 12_288
"""And at most ``max(16, width**2 // DCN_NARROW)`` (:func:`dcn_rank`)."""


def dcn_rank(width: int, rank: int) -> int:
    """The rank a cross layer over ``width`` inputs uses for ``model.dcn_rank=rank``: at most
    a quarter of the width and at most ``max(16, width**2 // 12288)`` (at least 1).

    The quarter: TorchRec's ``LowRankCrossNet`` notes that a rank below half the width is
    needed to save computation over a full-rank layer and that about a quarter keeps its
    accuracy. The second cap lets a narrow input's layers cost a smaller share of a full-rank
    layer (``2 rank / width`` of it, at most ``width / 6144``): a small model's step is mostly
    its other costs: rank 108 over the demo's 27 x 16 = 432 inputs made its step ~3x the dot
    DLRM's, rank 16 1.03-1.08x in bf16 and 1.32-1.43x in fp32 on a loaded 2-core machine
    (docs/benchmarks.md, "DLRM-DCNv2"; the bar is 1.3x). The constant was chosen so: the demo's 432 inputs get rank 16 and the MLPerf
    DLRM-DCNv2's 27 x 128 = 3,456 inputs keep the reference's 512 (caps 864 and 972)."""
    return max(1, min(rank, width // DCN_RANK_SHARE, max(16, width * width // DCN_NARROW)))


CROSS_IMPLS = ("torch", "onednn")
"""How a cross layer's up-projection adds its bias: ``torch`` (``addmm``: the bias copied into
the output, then the product added) or ``onednn`` (oneDNN's linear, the bias added in the
product's epilogue: one pass over ``[B, n]`` fewer; CPU, fp32 or bf16 where oneDNN computes it).
Chosen by measurement (:func:`tune_interactions`)."""


def cross_impls(device: str, dtype: str = "float32") -> list[str]:
    """The cross network's candidates that can run on ``device`` in ``dtype``."""
    return [i for i in CROSS_IMPLS if i == "torch" or onednn_fits(torch.device(device).type, getattr(torch, dtype))]


class _CrossNet(torch.autograd.Function):
    """The cross layers ``x_{l+1} = x0 * (U_l (V_l x_l) + b_l) + x_l`` as one autograd node.

    Autograd of the plain expression runs about ten element-wise passes over ``[B, n]`` per
    layer; here a layer is, forward, a product, a product with its bias added (``impl``:
    :data:`CROSS_IMPLS`) and one fused multiply-add (``addcmul``); backward ``g * x0`` into
    one buffer reused by every layer, one ``addcmul_`` into ``x0``'s gradient, a column sum and
    four products, the last adding into the layer's input gradient in place (out of place only
    for the incoming gradient, which is autograd's). Fresh ``[B, n]`` outputs cost more than
    their arithmetic on a CPU (memory not in cache), hence the buffer and the in-place
    products. Saved: each layer's input, ``V_l x_l`` and ``U_l V_l x_l + b_l``. ``weights``:
    ``V_0, U_0, b_0, V_1, ...`` in ``x0``'s dtype."""

    @staticmethod
    def forward(ctx, impl, x0, *weights):
        x, saved = x0, []
        fused = impl == "onednn"
        for v, u, b in zip(weights[0::3], weights[1::3], weights[2::3]):
            h = torch.mm(x, v.t())
            y = onednn_linear(h, u, b) if fused else torch.addmm(b, h, u.t())
            saved += [x, h, y]
            x = torch.addcmul(x, x0, y)
        ctx.save_for_backward(x0, *weights, *saved)
        ctx.layers = len(weights) // 3
        return x

    @staticmethod
    def backward(ctx, g):
        x0, *rest = ctx.saved_tensors
        n = ctx.layers
        weights, saved = rest[: 3 * n], rest[3 * n:]
        grads: list = [None] * (3 * n)
        gy, gx0 = torch.empty_like(x0), None
        for i in reversed(range(n)):
            last = i == n - 1  # (the first one back: g is autograd's, x0's gradient not begun)
            v, u = weights[3 * i], weights[3 * i + 1]
            x, h, y = saved[3 * i: 3 * i + 3]
            torch.mul(g, x0, out=gy)
            gx0 = torch.mul(g, y) if last else gx0.addcmul_(g, y)
            gh = torch.mm(gy, u)
            grads[3 * i: 3 * i + 3] = [torch.mm(gh.t(), x), torch.mm(gy.t(), h), gy.sum(0)]
            g = torch.addmm(g, gh, v) if last else g.addmm_(gh, v)
        return (None, gx0.add_(g), *grads)


class CrossInteraction(nn.Module):
    """DCNv2's low-rank cross network in place of the dot products (DLRM-DCNv2, TorchRec's
    ``DLRM_DCN``).

    The input ``x0`` ``[B, (F+1) D]`` is the bottom-MLP output followed by the F pooled
    embeddings, flattened; each of ``layers`` cross layers computes
    ``x_{l+1} = x0 * (U_l (V_l x_l) + b_l) + x_l`` with ``V_l`` ``[r, (F+1) D]`` and ``U_l``
    ``[(F+1) D, r]`` (the full-rank ``W_l = U_l V_l`` of DCNv2 at rank ``r``, :func:`dcn_rank`)
    and the output is ``x_L`` (the top MLP's input, the same width). Initial values as
    TorchRec's: ``U_l`` and ``V_l`` Xavier-normal, ``b_l`` zero. Under bf16 autocast the
    input and the weights are cast to bf16 and the layers run in bf16 (like the dot
    interaction's stacked vectors); the weights and their gradients stay fp32. One autograd
    node for all layers (:class:`_CrossNet`).
    """

    def __init__(self, num_features: int, dim: int, *, layers: int = 3, rank: int = 512) -> None:
        super().__init__()
        if layers < 1 or rank < 1:
            raise ValueError(f"a cross network needs layers >= 1 and rank >= 1, got {layers} and {rank}")
        self.width = (num_features + 1) * dim
        self.rank = dcn_rank(self.width, rank)
        self.down = nn.ParameterList(nn.Parameter(torch.empty(self.rank, self.width)) for _ in range(layers))
        self.up = nn.ParameterList(nn.Parameter(torch.empty(self.width, self.rank)) for _ in range(layers))
        self.bias = nn.ParameterList(nn.Parameter(torch.empty(self.width)) for _ in range(layers))
        self.impl = "torch"
        """How the up-projection adds its bias (:data:`CROSS_IMPLS`); set by
        :func:`tune_interactions` from measurements."""
        self.reset_parameters()

    def reset_parameters(self) -> None:
        for v, u, b in zip(self.down, self.up, self.bias):
            nn.init.xavier_normal_(v)
            nn.init.xavier_normal_(u)
            nn.init.zeros_(b)

    @staticmethod
    def output_dim(num_features: int, dim: int) -> int:
        return (num_features + 1) * dim

    @staticmethod
    def num_parameters(num_features: int, dim: int, *, layers: int, rank: int) -> int:
        """Weights of a cross network (``U_l``, ``V_l``, ``b_l`` of every layer)."""
        width = (num_features + 1) * dim
        return layers * (2 * width * dcn_rank(width, rank) + width)

    def forward(self, dense: torch.Tensor, sparse: torch.Tensor) -> torch.Tensor:
        """``dense`` ``[B, D]``, ``sparse`` ``[B, F, D]`` -> ``[B, (F+1) D]``."""
        dtype = compute_dtype(dense.device) or dense.dtype
        x0 = torch.cat([dense.to(dtype).unsqueeze(1), sparse.to(dtype)], dim=1).flatten(1)
        weights = [w.to(dtype) for layer in zip(self.down, self.up, self.bias) for w in layer]
        impl = self.impl if self.impl in cross_impls(dense.device.type, str(dtype).removeprefix("torch.")) \
            else "torch"
        with torch.autocast(dense.device.type, enabled=False):
            return _CrossNet.apply(impl, x0, *weights)


INTERACTIONS = ("dot", "cat", "dcn")
"""``model.interaction``'s values."""


def make_interaction(kind: str, num_features: int, dim: int, *, dcn_layers: int = 3,
                     dcn_rank: int = 512) -> tuple[nn.Module, int]:
    """``(module, output width)`` of interaction ``kind`` (``dot``, ``cat`` or ``dcn``: a
    :class:`CrossInteraction` of ``dcn_layers`` layers at rank ``dcn_rank``, capped by
    :func:`dcn_rank`) over the bottom-MLP output and ``num_features`` pooled vectors of
    width ``dim``."""
    if kind == "dot":
        return DotInteraction(num_features, dim), DotInteraction.output_dim(num_features, dim)
    if kind == "cat":
        return CatInteraction(), CatInteraction.output_dim(num_features, dim)
    if kind == "dcn":
        return (CrossInteraction(num_features, dim, layers=dcn_layers, rank=dcn_rank),
                CrossInteraction.output_dim(num_features, dim))
    raise ValueError(f"unknown interaction {kind!r} (dot, cat or dcn)")


def interaction_width(kind: str, num_features: int, dim: int) -> int:
    """The output width of interaction ``kind`` (the top MLP's input), without building it."""
    widths = {"dot": DotInteraction.output_dim, "cat": CatInteraction.output_dim,
              "dcn": CrossInteraction.output_dim}
    if kind not in widths:
        raise ValueError(f"unknown interaction {kind!r} (dot, cat or dcn)")
    return widths[kind](num_features, dim)


def interaction_parameters(kind: str, num_features: int, dim: int, *, dcn_layers: int = 3,
                           dcn_rank: int = 512) -> int:
    """Weights of interaction ``kind`` (only ``dcn`` has any)."""
    if kind != "dcn":
        return 0
    return CrossInteraction.num_parameters(num_features, dim, layers=dcn_layers, rank=dcn_rank)
