"""Rank 0's Python value on every rank: the one home of that broadcast.

A decision one rank makes for all (a new run directory, a kept checkpoint interval, the
kernels timed, the stream's next file) travels as JSON bytes in two tensor broadcasts (a
length, then the bytes): nothing received is unpickled, so a value is what JSON can say
(dicts with string keys, lists, strings, numbers, booleans, None).
"""

from __future__ import annotations

import json

import torch
import torch.distributed as dist


def rank0_value(obj, group, *, device: torch.device | str = "cpu"):
    """Rank 0's ``obj`` (JSON-able) on every rank of ``group`` (None: one process, ``obj``
    itself): collective, every rank of ``group`` calls it; rank 0 gets ``obj`` back, the
    others its JSON copy. ``device``: where the tensors go, the rank's GPU for an NCCL
    group (:attr:`~hybridrec.parallel.topology.Topology.comm_device`)."""
    if group is None:
        return obj
    if dist.get_rank(group) == 0:
        data = json.dumps(obj).encode()
        size = torch.tensor([len(data)], dtype=torch.int64, device=device)
    else:
        data, size = b"", torch.zeros(1, dtype=torch.int64, device=device)
    dist.broadcast(size, group=group, group_src=0)
    buf = (torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device) if data
           else torch.empty(int(size.item()), dtype=torch.uint8, device=device))
    dist.broadcast(buf, group=group, group_src=0)
    return json.loads(bytes(buf.cpu().numpy()).decode()) if not data else obj
