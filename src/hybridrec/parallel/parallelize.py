"""Apply parallelism to a single-device DLRM, in one ordered function.

1. Embeddings: the collection is replaced by a :class:`ShardedEmbeddingBagCollection`
   following the plan (every rank holds only its shards).
2. Dense arches: handed to the dense-synchronization strategy
   (:mod:`hybridrec.parallel.dense_sync`): DDP wraps them here; the explicit all-reduce and
   "none" leave them as they are and act in the training step.
"""

from __future__ import annotations

from collections.abc import Mapping

from hybridrec.comm.codecs import Codec
from hybridrec.comm.ddp_hooks import HookFactory
from hybridrec.comm.ledger import CommLedger
from hybridrec.model.dlrm import DLRM
from hybridrec.parallel.dense_sync import DDPSync, DenseSync, NoSync, allreduce_hook
from hybridrec.parallel.plan import ShardingPlan
from hybridrec.parallel.sharded_embedding import ShardedEmbeddingBagCollection
from hybridrec.parallel.topology import Topology

__all__ = ["allreduce_hook", "parallelize_dlrm"]


def parallelize_dlrm(model: DLRM, plan: ShardingPlan, topo: Topology, *,
                     ledger: CommLedger | None = None, dense_hooks: HookFactory | None = None,
                     codecs: Mapping[str, Codec] | None = None,
                     dense_sync: DenseSync | None = None) -> DLRM:
    """Shard ``model.sparse`` by ``plan`` (unless it already is; ``codecs``: table ->
    codec of its output_dist hop), then let ``dense_sync`` take the dense arches.

    ``dense_sync`` None: :class:`DDPSync` with ``dense_hooks`` (``dense_hooks(arch,
    module)`` gives each arch's DDP comm hook; None = the plain all-reduce) on several
    ranks, nothing on one."""
    ebc = model.sparse
    if not ebc.spans_ranks:  # (a single-device collection: sharded here)
        model.sparse = ShardedEmbeddingBagCollection(list(ebc.tables.values()), plan, topo,
                                                     seed=ebc.seed, ledger=ledger, codecs=codecs)
    if dense_sync is None:
        dense_sync = DDPSync(topo, hooks=dense_hooks, ledger=ledger) if topo.group_size > 1 else NoSync()
    return dense_sync.wrap(model)
