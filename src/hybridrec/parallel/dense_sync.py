"""Dense synchronization: how the dense arches' gradients (or replicas) become equal on
every rank. One strategy per run, chosen by ``dist.dense_sync``; the Trainer owns it.

The interface, as the training step uses it::

    model = sync.wrap(model)       # once, when parallelism is applied (DDP wraps arches here)
    ...
    loss.backward()
    sync.synchronize()             # the step's dense-synchronization point
    dense_opt.step()

and ``state_dict()`` / ``load_state_dict()`` for the checkpointer (what a compressor holds
per rank: residuals, thresholds, step counts).

- :class:`DDPSync` (``ddp``): torch's DistributedDataParallel with a comm hook (the plain
  averaging all-reduce, or a compressor of :mod:`hybridrec.comm.ddp_hooks`). The bucketed
  all-reduces run *inside* backward, overlapped with it, and DDP waits for the last bucket
  before ``backward()`` returns, so :meth:`DDPSync.synchronize` has nothing left to do.
- :class:`AllReduceSync` (``allreduce``): no DDP. After backward, each arch's gradients are
  flattened into one buffer and averaged through the same compressors
  (:class:`~hybridrec.comm.ddp_hooks.CompressedAllReduce`, plain = ``NoCompression``):
  visible in the step, not overlapped with backward.
- :class:`NoSync` (``none``, and every single-process run): nothing; every rank keeps its
  own replica (for a synchronizer that averages replicas instead of gradients).

Partitioned layers (:mod:`hybridrec.parallel.placement`): each rank's column block already
has the whole group's gradient (scaled to DDP's average), so every strategy leaves those
parameters out (:func:`synced_parameters`); an arch with nothing else is not synchronized.

Predicted bytes: an uncompressed all-reduce is predictable, so those strategies tell the
ledger each step what it should count (``dense_allreduce``, ``bwd``, ring bytes per arch;
DDP's buckets are exact per arch when ``2 (W-1) n / W`` is an integer for every bucket, e.g.
W = 2 or 4 with float32). Compressed payloads depend on the gradients and are not predicted.
"""

from __future__ import annotations

import warnings
from typing import Protocol

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from hybridrec.comm.ddp_hooks import CompressedAllReduce, HookFactory, PowerSGDHooks
from hybridrec.comm.ledger import CommLedger, ring_allreduce_bytes
from hybridrec.parallel.placement import partitioned_parameter_names
from hybridrec.parallel.topology import Topology

CATEGORY = "dense_allreduce"


class DenseSync(Protocol):
    name: str

    def wrap(self, model: nn.Module) -> nn.Module: ...

    def synchronize(self) -> None: ...

    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...


def dense_arches(model: nn.Module) -> dict[str, nn.Module]:
    """The model's dense children (everything but the embeddings) that hold trainable
    parameters, by attribute name, DDP unwrapped."""
    out = {}
    for name, m in model.named_children():
        m = m.module if isinstance(m, DistributedDataParallel) else m
        if name != "sparse" and any(p.requires_grad for p in m.parameters()):
            out[name] = m
    return out


def synced_parameters(module: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """The trainable parameters of an arch that the dense sync averages: all but the
    column blocks of partitioned layers."""
    skip = partitioned_parameter_names(module)
    return [(n, p) for n, p in module.named_parameters() if p.requires_grad and n not in skip]


def _arch_bytes(module: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for _, p in synced_parameters(module))


class NoSync:
    """No dense communication: one process, or replicas kept apart on purpose."""

    name = "none"

    def wrap(self, model: nn.Module) -> nn.Module:
        return model

    def synchronize(self) -> None:
        pass

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass


def allreduce_hook(ledger: CommLedger | None):
    """DDP comm hook: plain averaging all-reduce of a bucket; counts ring all-reduce bytes."""

    def hook(process_group, bucket):  # no annotations: DDP checks them as objects
        buf = bucket.buffer()
        world = process_group.size()
        if ledger is not None:
            ring = ring_allreduce_bytes(buf.numel() * buf.element_size(), world)
            ledger.record(CATEGORY, sent=ring, received=ring, direction="bwd")
        buf.div_(world)
        fut = torch.distributed.all_reduce(buf, group=process_group, async_op=True).get_future()
        return fut.then(lambda f: f.value()[0])

    return hook


class _Predicting:
    """Tells the ledger, once per step, the ring bytes of an uncompressed all-reduce of
    every arch (what a plain strategy must count)."""

    def __init__(self, topo: Topology, ledger: CommLedger | None, predict: bool) -> None:
        self.topo, self.ledger, self.predict = topo, ledger, predict and ledger is not None
        self.arches: dict[str, nn.Module] = {}

    def _record_prediction(self) -> None:
        if self.predict:
            for m in self.arches.values():
                ring = ring_allreduce_bytes(_arch_bytes(m), self.topo.group_size)
                self.ledger.predict(CATEGORY, sent=ring, received=ring, direction="bwd")


class DDPSync(_Predicting):
    """Each dense arch in DistributedDataParallel with the hook ``hooks(arch, module)``
    (None: :func:`allreduce_hook`). The averaging happens during backward."""

    name = "ddp"

    def __init__(self, topo: Topology, *, hooks: HookFactory | None = None,
                 ledger: CommLedger | None = None) -> None:
        super().__init__(topo, ledger, predict=hooks is None)
        self.hooks = hooks

    def wrap(self, model: nn.Module) -> nn.Module:
        self.arches = {n: m for n, m in dense_arches(model).items() if synced_parameters(m)}
        for name, module in self.arches.items():
            if skip := partitioned_parameter_names(module):  # before DDP reads the parameters
                DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(module, sorted(skip))
            hook = allreduce_hook(self.ledger) if self.hooks is None else self.hooks(name, module)
            ddp = DistributedDataParallel(module, process_group=self.topo.group)
            ddp.register_comm_hook(self.topo.group, hook)
            setattr(model, name, ddp)
        return model

    def send_plain(self) -> None:
        """Before :meth:`wrap`: the plain all-reduce instead of the compressor's hooks
        (``compress.dense_when=pays`` measured that compressing does not pay), predicted."""
        self.hooks = None
        self.predict = self.ledger is not None

    def synchronize(self) -> None:
        # Nothing to wait for: DDP's reducer finished every bucket before backward returned.
        self._record_prediction()

    def state_dict(self) -> dict:
        return _hook_state(self.hooks)

    def load_state_dict(self, state: dict) -> None:
        _load_hook_state(self.hooks, state)


class AllReduceSync(_Predicting):
    """After backward: per arch, one flat buffer of its gradients averaged by ``reducer``
    (a :class:`CompressedAllReduce`; ``NoCompression`` is the plain all-reduce)."""

    name = "allreduce"

    def __init__(self, topo: Topology, reducer: CompressedAllReduce, *,
                 ledger: CommLedger | None = None, predict: bool = False) -> None:
        super().__init__(topo, ledger, predict)
        self.reducer = reducer

    def wrap(self, model: nn.Module) -> nn.Module:
        self.arches = {n: m for n, m in dense_arches(model).items() if synced_parameters(m)}
        return model

    def send_plain(self) -> None:
        """Before :meth:`wrap`: the plain all-reduce instead of the compressor (as
        :meth:`DDPSync.send_plain`)."""
        from hybridrec.comm.compress import NoCompression

        self.reducer = CompressedAllReduce(NoCompression(), self.ledger, pairwise=self.reducer.pairwise)
        self.predict = self.ledger is not None

    def synchronize(self) -> None:
        for arch, module in self.arches.items():
            named = [(f"{arch}.{n}", p) for n, p in synced_parameters(module)]
            grads = [p.grad if p.grad is not None else torch.zeros_like(p) for _, p in named]
            buf = torch.cat([g.reshape(-1) for g in grads])
            views = list(torch.split(buf, [g.numel() for g in grads]))
            # Waits here, a named sync point: the optimizer step needs the averaged gradients.
            self.reducer.reduce(self.topo.group, buf, [k for k, _ in named], views).wait()
            for (_, p), v in zip(named, views):
                p.grad = v.view_as(p)  # buf is not reused: the gradients become its views
        self._record_prediction()

    def state_dict(self) -> dict:
        return _hook_state(self.reducer)

    def load_state_dict(self, state: dict) -> None:
        _load_hook_state(self.reducer, state)


def _hook_state(hooks) -> dict:
    """Per-rank state of a hook factory: a compressor's residuals, thresholds and counters.
    PowerSGD's memories are keyed by DDP bucket index, which a new DDP rebuilds: not saved."""
    if isinstance(hooks, CompressedAllReduce):
        return {"compressor": hooks.state_dict()}
    if isinstance(hooks, PowerSGDHooks):
        return {"powersgd": True}
    return {}


def _load_hook_state(hooks, state: dict) -> None:
    if "powersgd" in state:
        warnings.warn("PowerSGD's error feedback and P/Q memories are not in checkpoints (they are "
                      "keyed by DDP bucket index): they restart, with its warm-up, from this step",
                      stacklevel=2)
    if "compressor" in state:
        if not isinstance(hooks, CompressedAllReduce):
            raise ValueError("the checkpoint holds dense compressor state, this run has no compressor")
        hooks.load_state_dict(state["compressor"])
