"""Atomic checkpoints of a single-process run.

Layout: ``RUN/checkpoints/step-00001234/{state.pt, meta.json}``. A checkpoint
is written into ``step-....tmp-<pid>`` and renamed when complete, so a crash
mid-write never leaves a directory that looks like a checkpoint. Loading uses
``torch.load(weights_only=True)``: a checkpoint can hold tensors and plain
containers, never code.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import torch

_NAME = re.compile(r"^step-(\d{8})$")


def checkpoint_dir(run_dir: str | Path) -> Path:
    return Path(run_dir) / "checkpoints"


def _complete(p: Path) -> bool:
    # A single-process checkpoint (state.pt) or a sharded one (DCP's .metadata); both
    # directories are renamed into place only when complete, meta.json written last.
    return (p / "meta.json").is_file() and ((p / "state.pt").is_file() or (p / ".metadata").is_file())


def list_checkpoints(run_dir: str | Path) -> list[tuple[int, Path]]:
    """Complete checkpoints, oldest first."""
    d = checkpoint_dir(run_dir)
    if not d.is_dir():
        return []
    found = []
    for p in d.iterdir():
        m = _NAME.match(p.name)
        if m and _complete(p):
            found.append((int(m.group(1)), p))
    return sorted(found)


def prune(run_dir: str | Path, *, keep: int) -> None:
    """Delete all but the newest ``keep`` checkpoints."""
    for _, old in list_checkpoints(run_dir)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)


def save_checkpoint(run_dir: str | Path, step: int, state: dict, *, keep: int = 2) -> Path:
    d = checkpoint_dir(run_dir)
    d.mkdir(parents=True, exist_ok=True)
    final = d / f"step-{step:08d}"
    tmp = d / f"{final.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        torch.save(state, tmp / "state.pt")
        with open(tmp / "meta.json", "w") as f:
            json.dump({"step": step, "format": 1}, f)
            f.flush()
            os.fsync(f.fileno())
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    prune(run_dir, keep=keep)
    return final


def load_checkpoint(path: str | Path) -> dict:
    """Load ``state.pt`` of a checkpoint directory (tensors and containers only)."""
    return torch.load(Path(path) / "state.pt", map_location="cpu", weights_only=True)


def latest_checkpoint(run_dir: str | Path) -> Path | None:
    found = list_checkpoints(run_dir)
    return found[-1][1] if found else None
