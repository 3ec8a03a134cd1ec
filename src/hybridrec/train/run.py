"""Run-level entry points used by the CLI: train a config, evaluate a run directory."""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.distributed as dist

from hybridrec.errors import ConfigError
from hybridrec.metrics.logger import peak_memory_bytes, write_json_atomic
from hybridrec.parallel.checkpoint import load_sharded
from hybridrec.parallel.topology import Topology
from hybridrec.train import checkpoint as ckpt
from hybridrec.train.build import build_loaders, build_model, build_trainer, load_dataset, versions
from hybridrec.train.config import Config, apply_dict, validate
from hybridrec.train.trainer import evaluate_model


def train(cfg: Config, *, extra_summary: dict | None = None) -> dict:
    """Train, evaluate on the held-out split, write summary.json; returns the summary."""
    meta = load_dataset(cfg)
    trainer = build_trainer(cfg, meta=meta)
    run_dir, topo = trainer.run_dir, trainer.topo
    if topo.rank == 0:
        write_json_atomic(run_dir / "config.json", cfg.to_dict())
    try:
        result = trainer.fit()
    finally:
        if trainer.logger:
            trainer.logger.close()
    summary = {
        "run_dir": str(run_dir),
        "step": result.step,
        "resumed_from": result.resumed_from,
        "eval": result.eval_metrics,
        "eval_history": result.history,
        "train_loss": result.train_loss,
        "throughput": result.throughput,
        "peak_memory_bytes": peak_memory_bytes(),
        "peak_memory_bytes_per_rank": _gather_ints(peak_memory_bytes(), topo),
        "world_size": topo.world_size,
        "comm": trainer.ledger.summary(),  # this rank's (rank 0's in summary.json)
        "dataset": {"path": str(meta.path), "train_rows": meta.split_rows("train"),
                    "eval_rows": meta.split_rows("eval")},
        "config": cfg.to_dict(),
        "versions": versions(),
        **(extra_summary or {}),
    }
    if topo.rank == 0:
        write_json_atomic(run_dir / "summary.json", summary)
    return summary


def _gather_ints(value: int, topo) -> list[int]:
    if topo.world_size == 1:
        return [value]
    out = torch.zeros(topo.world_size, dtype=torch.int64)
    out[topo.rank] = value
    dist.all_reduce(out, group=topo.group)
    return out.tolist()


def load_run_config(run_dir: str | Path) -> Config:
    path = Path(run_dir) / "config.json"
    if not path.is_file():
        raise ConfigError(f"{run_dir} is not a run directory (no config.json)")
    cfg = Config()
    apply_dict(cfg, json.loads(path.read_text()), source=str(path))
    validate(cfg)
    return cfg


def load_run_model(run_dir: str | Path, *, checkpoint: str | None = None,
                   data_path: str | None = None):
    """A run's single-process model with the weights of its newest (or a given)
    checkpoint, whatever world size saved it. Returns ``(cfg, meta, model, path, extra)``
    (``extra``: the checkpoint's global state: step, loader position)."""
    cfg = load_run_config(run_dir)
    if data_path:
        cfg.data.path = data_path
    meta = load_dataset(cfg)
    path = Path(checkpoint) if checkpoint else ckpt.latest_checkpoint(run_dir)
    if path is None:
        raise ConfigError(f"{run_dir} has no checkpoint to evaluate")
    model = build_model(cfg, meta)
    extra = load_sharded(path, model=model, dense_opt=None, sparse_opts=None, topo=Topology.single())
    return cfg, meta, model, path, extra


def evaluate_run(run_dir: str | Path, *, checkpoint: str | None = None,
                 data_path: str | None = None) -> dict:
    """Evaluate a run's newest (or a given) checkpoint on the held-out split."""
    cfg, meta, model, path, _ = load_run_model(run_dir, checkpoint=checkpoint, data_path=data_path)
    _, eval_loader = build_loaders(cfg, meta)
    result = {"checkpoint": str(path), "data": str(meta.path), **evaluate_model(model, eval_loader)}
    write_json_atomic(Path(run_dir) / "eval.json", result)
    return result
