"""Sparse embedding optimizers: update only the rows a batch touched.

``step(grads)`` takes the row gradients explicitly: a list of ``(group, ids, grad_rows,
unique)`` as an embedding collection's ``pop_sparse_grads()`` returns them after backward
(per occurrence, or already summed per id), so the caller names where they come from and
any reduction across ranks happens before, in the step, never inside the optimizer. No
dense ``[rows, dim]`` gradient is ever built. Semantics match dense optimizers applied to the
table gradient restricted to the touched rows:

- ``sgd``: ``w[r] -= lr * g[r]``.
- ``rowwise_adagrad`` (FBGEMM's): one accumulator per row,
  ``a[r] += mean_j g[r, j]^2``; ``w[r] -= lr * g[r] / (sqrt(a[r]) + eps)``.
- ``lazy_adam``: Adam moments updated only for touched rows, bias correction
  with the global step.

Here ``g[r]`` is the summed gradient of row ``r`` over its occurrences.

bf16 tables (``model.embedding_dtype=bf16``): the touched rows are read, the float32 delta
added in float32, and the sums stored with stochastic rounding
(:func:`~hybridrec.model.embedding.stochastic_round`; repeated ids are summed first).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from hybridrec.model.embedding import stochastic_round
from hybridrec.model.id_groups import aggregate_rows
from hybridrec.model.kernels import Choice, choose_rows_add, rows_add_


class SparseOptimizer:
    """Base: holds the collection, the learning rate and per-group state."""

    name = "base"

    def __init__(self, collection, *, lr: float) -> None:
        if lr <= 0:
            raise ValueError(f"sparse lr must be positive, got {lr}")
        self.collection = collection
        self.lr = lr
        self.step_count = 0
        # Each fused group's row update (kernels.ROW_ADDS), chosen by :meth:`tune_kernels`.
        self.row_adds = ["scatter_add"] * collection.num_groups

    def tune_kernels(self, rows_per_feature: int, *, mode: str = "auto") -> list[Choice]:
        """Time the row updates on each fused table with ``rows_per_feature`` rows added per
        feature and step (an estimate: the ids of a one-hot batch) and keep the faster."""
        c = self.collection
        fp32 = [g for g in range(c.num_groups) if c.group_weight(g).dtype == torch.float32]
        got = choose_rows_add([(c.group_weight(g), rows_per_feature * len(c.group_features(g)))
                               for g in fp32], mode=mode)  # (bf16 tables: stochastic rounding)
        for g, ch in zip(fp32, got):
            self.row_adds[g] = ch.impl
        return got

    def _add_rows(self, group: int, weight: torch.Tensor, ids: torch.Tensor, delta: torch.Tensor,
                  unique: bool, alpha: float = 1.0) -> None:
        """``weight[ids] += alpha * delta`` (float32 ``delta``, which may be scaled in place;
        ``unique``: no id repeats)."""
        if weight.dtype == torch.float32:
            rows_add_(weight, ids, delta, self.row_adds[group], alpha)
            return
        if alpha != 1.0:
            delta = delta.mul_(alpha)
        if not unique:  # one read-modify-write per row
            ids, delta = aggregate_rows(ids, delta, bound=weight.shape[0])
        new = weight.index_select(0, ids).float().add_(delta)
        weight.index_copy_(0, ids, stochastic_round(new, weight.dtype))

    def step(self, grads: list[tuple[int, torch.Tensor, torch.Tensor, bool]]) -> None:
        """Apply ``grads`` (``(group, ids [n], rows [n, dim], unique)`` per fused group of
        the collection) to the touched rows. ``rows`` may be overwritten."""
        self.step_count += 1
        with torch.no_grad():
            for group, ids, rows, unique in grads:
                self._update(group, self.collection.group_weight(group), ids, rows, unique)

    def _update(self, group: int, weight: torch.Tensor, ids: torch.Tensor, rows: torch.Tensor,
                unique: bool):
        raise NotImplementedError

    # Per-row state is saved per table so checkpoints survive regrouping/resharding.
    def row_state(self, group: int) -> dict[str, torch.Tensor]:
        """The per-row state of fused group ``group`` (first dim: its rows), by name."""
        return {}

    def state_dict(self) -> dict:
        per_table = {}
        for name in self.collection.tables:
            g, start, n = self.collection.table_slice(name)
            per_table[name] = {k: v[start : start + n] for k, v in self.row_state(g).items()}
        return {"name": self.name, "lr": self.lr, "step": self.step_count, "tables": per_table}

    def load_state_dict(self, state: dict) -> None:
        if state.get("name") != self.name:
            raise ValueError(f"optimizer state is for {state.get('name')!r}, not {self.name!r}")
        self.lr, self.step_count = float(state["lr"]), int(state["step"])
        for name, tensors in state["tables"].items():
            g, start, n = self.collection.table_slice(name)
            dst = self.row_state(g)
            for k, v in tensors.items():
                dst[k][start : start + n].copy_(v)


class SparseSGD(SparseOptimizer):
    name = "sgd"

    def _update(self, group, weight, ids, rows, unique):
        self._add_rows(group, weight, ids, rows, unique, alpha=-self.lr)  # (rows is ours to overwrite)


class RowWiseAdagrad(SparseOptimizer):
    name = "rowwise_adagrad"

    def __init__(self, collection, *, lr: float, eps: float = 1e-8, initial_accumulator: float = 0.0):
        super().__init__(collection, lr=lr)
        self.eps = eps
        self._acc = [
            torch.full((collection.group_weight(g).shape[0],), initial_accumulator,
                       device=collection.group_weight(g).device)
            for g in range(collection.num_groups)
        ]

    def row_state(self, group):
        return {"sum": self._acc[group]}

    def _update(self, group, weight, ids, rows, unique):
        unique, grad = (ids, rows) if unique else aggregate_rows(ids, rows, bound=weight.shape[0])
        acc = self._acc[group]
        new_acc = acc.index_select(0, unique) + grad.pow(2).mean(1)
        acc.index_copy_(0, unique, new_acc)
        delta = grad.div_(new_acc.sqrt_().add_(self.eps).unsqueeze(1)).mul_(-self.lr)
        self._add_rows(group, weight, unique, delta, True)


class LazyAdam(SparseOptimizer):
    name = "lazy_adam"

    def __init__(self, collection, *, lr: float, betas=(0.9, 0.999), eps: float = 1e-8):
        super().__init__(collection, lr=lr)
        self.beta1, self.beta2 = betas
        self.eps = eps
        # (float32 whatever the tables' storage)
        self._m = [torch.zeros_like(collection.group_weight(g), dtype=torch.float32)
                   for g in range(collection.num_groups)]
        self._v = [torch.zeros_like(collection.group_weight(g), dtype=torch.float32)
                   for g in range(collection.num_groups)]

    def row_state(self, group):
        return {"exp_avg": self._m[group], "exp_avg_sq": self._v[group]}

    def _update(self, group, weight, ids, rows, unique):
        unique, grad = (ids, rows) if unique else aggregate_rows(ids, rows, bound=weight.shape[0])
        m = self._m[group].index_select(0, unique).mul_(self.beta1).add_(grad, alpha=1 - self.beta1)
        v = self._v[group].index_select(0, unique).mul_(self.beta2).addcmul_(grad, grad, value=1 - self.beta2)
        self._m[group].index_copy_(0, unique, m)
        self._v[group].index_copy_(0, unique, v)
        t = self.step_count
        step_size = self.lr / (1 - self.beta1**t)
        denom = v.div_(1 - self.beta2**t).sqrt_().add_(self.eps)
        self._add_rows(group, weight, unique, m.div_(denom).mul_(-step_size), True)


SPARSE_OPTIMIZERS = {c.name: c for c in (SparseSGD, RowWiseAdagrad, LazyAdam)}


def build_sparse_optimizer(name: str, collection, *, lr: float, **kwargs) -> SparseOptimizer:
    try:
        cls = SPARSE_OPTIMIZERS[name]
    except KeyError:
        raise ValueError(f"unknown sparse optimizer {name!r}; choose from {sorted(SPARSE_OPTIMIZERS)}") from None
    return cls(collection, lr=lr, **kwargs)


class CombinedSparseOptimizer:
    """Several sparse optimizers (e.g. a rank's shards and its replicated tables) as one."""

    def __init__(self, optimizers: dict[str, SparseOptimizer]) -> None:
        self.optimizers = optimizers

    def __iter__(self):  # the parts, e.g. for a checkpoint that saves each one's tables
        return iter(self.optimizers.values())

    def __len__(self) -> int:
        return len(self.optimizers)

    @property
    def lr(self) -> float:
        return next(iter(self.optimizers.values())).lr

    @lr.setter
    def lr(self, value: float) -> None:
        for o in self.optimizers.values():
            o.lr = value

    def step(self, grads: Mapping[str, list]) -> None:
        """``grads[name]`` goes to the optimizer ``name``; every optimizer steps (its step
        count is global), with no rows when ``grads`` has none for it."""
        for k, o in self.optimizers.items():
            o.step(grads.get(k, []))

    def tune_kernels(self, rows_per_feature: int, *, mode: str = "auto") -> list[Choice]:
        """Every part's row updates by measurement (parts without tables: none)."""
        return [ch for o in self.optimizers.values() if hasattr(o, "tune_kernels")
                for ch in o.tune_kernels(rows_per_feature, mode=mode)]

    def flush(self) -> None:
        """Wait for updates still in flight (a parameter-server run's pushes)."""
        for o in self.optimizers.values():
            if hasattr(o, "flush"):
                o.flush()

    def state_dict(self) -> dict:
        return {k: o.state_dict() for k, o in self.optimizers.items()}

    def load_state_dict(self, state: dict) -> None:
        for k, o in self.optimizers.items():
            o.load_state_dict(state[k])


def local_collections(sparse) -> dict:
    """The embedding collections a rank updates, by the names its row gradients carry
    (:func:`hybridrec.train.loop.step.sparse_grads`): a sharded collection's ``shards`` and
    ``replicated`` (those it has), or a single-device collection's ``tables``."""
    return sparse.updated_collections()


def combined_sparse_optimizer(name: str, sparse, *, lr: float, **kwargs) -> CombinedSparseOptimizer:
    """One ``name`` optimizer per local collection of ``sparse``, behind one interface."""
    return CombinedSparseOptimizer({k: build_sparse_optimizer(name, c, lr=lr, **kwargs)
                                    for k, c in local_collections(sparse).items()})
