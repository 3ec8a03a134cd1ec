"""Apply parallelism to a single-device DLRM, in one ordered function.

1. Embeddings: the collection is replaced by a :class:`ShardedEmbeddingBagCollection`
   following the plan (every rank holds only its shards).
2. Dense arches: wrapped in torch's DistributedDataParallel; gradients are averaged
   by an all-reduce communication hook, the point where a compressor plugs in.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch.nn.parallel import DistributedDataParallel

from hybridrec.comm.codecs import Codec
from hybridrec.comm.ddp_hooks import HookFactory
from hybridrec.comm.ledger import CommLedger, ring_allreduce_bytes
from hybridrec.model.dlrm import DLRM
from hybridrec.model.embedding import EmbeddingBagCollection
from hybridrec.parallel.plan import ShardingPlan
from hybridrec.parallel.sharded_embedding import ShardedEmbeddingBagCollection
from hybridrec.parallel.topology import Topology


def allreduce_hook(ledger: CommLedger | None):
    """Plain averaging all-reduce of a DDP bucket; counts ring all-reduce bytes."""

    def hook(process_group, bucket):
        buf = bucket.buffer()
        world = process_group.size()
        if ledger is not None:
            ring = ring_allreduce_bytes(buf.numel() * buf.element_size(), world)
            ledger.record("dense_allreduce", sent=ring, received=ring, direction="bwd")
        buf.div_(world)
        fut = torch.distributed.all_reduce(buf, group=process_group, async_op=True).get_future()
        return fut.then(lambda f: f.value()[0])

    return hook


def parallelize_dlrm(model: DLRM, plan: ShardingPlan, topo: Topology, *,
                     ledger: CommLedger | None = None, dense_hooks: HookFactory | None = None,
                     codecs: Mapping[str, Codec] | None = None) -> DLRM:
    """Shard ``model.sparse`` by ``plan`` (unless it already is; ``codecs``: table ->
    codec of its output_dist hop) and make the dense arches data-parallel.

    ``dense_hooks(arch, module)`` gives each arch's DDP comm hook (a compressor, see
    :mod:`hybridrec.comm.ddp_hooks`); None = :func:`allreduce_hook`."""
    ebc = model.sparse
    if isinstance(ebc, EmbeddingBagCollection):
        model.sparse = ShardedEmbeddingBagCollection(list(ebc.tables.values()), plan, topo,
                                                     seed=ebc.seed, ledger=ledger, codecs=codecs)
    elif not isinstance(ebc, ShardedEmbeddingBagCollection):
        raise TypeError(f"cannot shard a {type(ebc).__name__}")
    if topo.world_size > 1:
        for name in ("bottom", "top"):
            module = getattr(model, name)
            hook = allreduce_hook(ledger) if dense_hooks is None else dense_hooks(name, module)
            ddp = DistributedDataParallel(module, process_group=topo.group)
            ddp.register_comm_hook(topo.group, hook)
            setattr(model, name, ddp)
    return model
