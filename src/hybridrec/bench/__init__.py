"""Benchmark harnesses: a cluster of network namespaces on one machine (``netns``) and the
compression sweep (``compression``)."""

from hybridrec.bench.netns import (
    Cluster,
    ClusterUnavailableError,
    RankNode,
    RankResult,
    netns_cluster,
    parse_rate,
    probe_support,
    remove_stale,
    require_support,
)

__all__ = [
    "Cluster",
    "ClusterUnavailableError",
    "RankNode",
    "RankResult",
    "netns_cluster",
    "parse_rate",
    "probe_support",
    "remove_stale",
    "require_support",
]
