"""Synchronization of dense replicas: MA, EASGD, BMUF (:mod:`.algorithms`) run in the
foreground or by a background shadow thread (:mod:`.runners`)."""

from hybridrec.sync.algorithms import (
    BlockMomentum,
    ElasticAveraging,
    ModelAveraging,
    Synchronizer,
    make_synchronizer,
)
from hybridrec.sync.runners import BackgroundRunner, ForegroundRunner, RankReplica, SyncRunner

__all__ = ["BackgroundRunner", "BlockMomentum", "ElasticAveraging", "ForegroundRunner", "ModelAveraging",
           "RankReplica", "SyncRunner", "Synchronizer", "make_synchronizer"]
