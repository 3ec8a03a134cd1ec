"""summary.json: what a run reports once :meth:`~hybridrec.train.loop.trainer.Trainer.fit`
has returned. The run's own entries (its step, memory, communication, dataset, config,
versions, kernels, times) are written here; every loop part's entries come from the part
itself (:meth:`~hybridrec.train.loop.parts.Part.summary`, merged generically), so a new
part's number reaches summary.json without a change here."""

from __future__ import annotations

import datetime
import platform
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

import hybridrec
from hybridrec.metrics.logger import cuda_peak_memory_bytes, peak_memory_bytes
from hybridrec.sync.algorithms import CATEGORY as SYNC_CATEGORY
from hybridrec.train.loop.parts import merge_entries
from hybridrec.train.setup.config import Config


def run_summary(trainer, result, meta, cfg: Config, *, shown: str, started_at: str, clock: float) -> dict:
    """What summary.json holds after :meth:`Trainer.fit` (collective: memory per rank): the
    run's own entries, then every loop part's (``result.parts``, :func:`summary_entries`:
    evaluation, train loss and throughput, the run's totals, the synchronizer, the
    parameter servers, early stopping, the checkpoint interval, recovery, ...), a part's
    dict under a key the run has (``kernels``) merged into it."""
    topo = trainer.topo
    run = {
        "run_dir": shown,
        "step": result.step,
        "resumed_from": result.resumed_from,
        "peak_memory_bytes": peak_memory_bytes(),
        "peak_memory_bytes_per_rank": _gather_ints(peak_memory_bytes(), topo),
        "world_size": topo.job_size,
        # Where the model trained ("cpu", or "cuda:0 NVIDIA H100 80GB HBM3"), and its peak there.
        "device": device_name(topo.device),
        "cuda_peak_memory_bytes": cuda_peak_memory_bytes(topo.device),
        "comm": (comm := trainer.ledger.summary()),  # this rank's (rank 0's in summary.json)
        # Hierarchical training: groups, and rank 0's bytes per step inside its group and across.
        "hierarchy": {"groups": topo.num_groups, "group_size": topo.group_size} if topo.hierarchical else None,
        "bytes_by_level": bytes_by_level(comm, topo),
        "dataset": {"path": str(meta.path), "train_rows": meta.split_rows("train"),
                    "eval_rows": meta.split_rows("eval")},
        "config": cfg.to_dict(),
        "versions": {**versions(), **code_version()},
        # Each MLP layer's linear implementation, measured or cached, with its timings.
        "kernels": dict(trainer.kernels or {}),
        "command": list(sys.argv),
        "started_at": started_at,
        "ended_at": now_iso(),
        "wall_seconds": time.monotonic() - clock,
    }
    return merge_entries(run, result.parts)


def versions() -> dict:
    """The library versions and the machine the run trained with (summary.json ``versions``)."""
    return {"hybridrec": hybridrec.__version__, "torch": torch.__version__, "numpy": np.__version__,
            "python": platform.python_version(), "platform": platform.platform(),
            "threads": torch.get_num_threads()}


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return f"{device} {torch.cuda.get_device_name(device)}"
    return str(device)


def now_iso() -> str:
    """The local time now, ISO 8601 with its UTC offset (``2026-11-23T11:06:00+01:00``)."""
    return datetime.datetime.now().astimezone().isoformat(timespec="seconds")


def code_version() -> dict:
    """The git commit of the checkout hybridrec runs from (None when it is not one whose
    files git tracks, or git is absent), and whether tracked files differ from it."""
    package = Path(hybridrec.__file__).resolve().parent

    def git(*args: str) -> str | None:
        try:
            out = subprocess.run(["git", "-C", str(package), *args], capture_output=True, text=True,
                                 timeout=10, stdin=subprocess.DEVNULL, check=False)
        except (OSError, subprocess.SubprocessError):
            return None
        return out.stdout.strip() if out.returncode == 0 else None

    if git("ls-files", "--error-unmatch", "__init__.py") is None:  # not a checkout of hybridrec
        return {"git_commit": None}
    status = git("status", "--porcelain", "--untracked-files=no")
    return {"git_commit": git("rev-parse", "HEAD"), "git_dirty": None if status is None else bool(status)}


def _gather_ints(value: int, topo) -> list[int]:
    if topo.job_size == 1:
        return [value]
    out = torch.zeros(topo.job_size, dtype=torch.int64, device=topo.comm_device)
    out[topo.job_rank] = value
    dist.all_reduce(out, group=topo.run_group)
    return out.tolist()


CROSS_CATEGORIES = (SYNC_CATEGORY,)  # hierarchical training: what crosses between groups


def _level(category: str) -> str:
    if category in CROSS_CATEGORIES:
        return "cross"
    return "servers" if category.startswith("ps_") else "intra"


def bytes_by_level(comm: dict, topo) -> dict | None:
    """Hierarchical training: this rank's mean bytes sent and received per step inside its
    group (``intra``), between groups (``cross``: the synchronizer's rounds) and, with
    parameter servers, to and from the servers every group shares (``servers``: pulls and
    pushes), each with its categories; None when flat."""
    if not topo.hierarchical:
        return None
    out = {name: {"sent": 0.0, "received": 0.0, "categories": []} for name in ("intra", "cross", "servers")}
    for category, mean in comm["per_step"]["mean_by_category"].items():
        level = out[_level(category)]
        level["sent"] += mean.get("sent") or 0.0
        level["received"] += mean.get("received") or 0.0
        level["categories"].append(category)
    return out
