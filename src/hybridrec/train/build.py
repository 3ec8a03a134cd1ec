"""``build_*``: turn a :class:`Config` into objects. Multi-step construction lives here,
so the classes themselves only store what they are given."""

from __future__ import annotations

import platform
from pathlib import Path

import numpy as np
import torch

import hybridrec
from hybridrec.comm.ledger import CommLedger
from hybridrec.data.loader import ShardedLoader
from hybridrec.data.schema import DatasetMeta
from hybridrec.errors import ConfigError
from hybridrec.metrics.logger import MetricLogger
from hybridrec.model.dlrm import DLRM
from hybridrec.model.embedding import EmbeddingBagCollection, TableConfig
from hybridrec.train.config import Config
from hybridrec.train.optim import (
    LRSchedule,
    LRScheduler,
    build_dense_optimizer,
    dense_parameters,
)
from hybridrec.train.sparse_optim import build_sparse_optimizer
from hybridrec.train.trainer import Trainer


def load_dataset(cfg: Config) -> DatasetMeta:
    if not cfg.data.path:
        raise ConfigError("data.path is not set: point it at a preprocessed dataset directory")
    return DatasetMeta.load(cfg.data.path)


def build_tables(meta: DatasetMeta, cfg: Config) -> list[TableConfig]:
    """One table per categorical feature, sized from the dataset's schema."""
    return [
        TableConfig(name=f.name, num_embeddings=f.num_embeddings,
                    embedding_dim=cfg.model.embedding_dim, pooling=cfg.model.pooling)
        for f in meta.schema.features
    ]


def build_model(cfg: Config, meta: DatasetMeta) -> DLRM:
    torch.manual_seed(cfg.train.seed)
    ebc = EmbeddingBagCollection(build_tables(meta, cfg), seed=cfg.train.seed)
    try:
        return DLRM(num_dense=len(meta.schema.dense), sparse=ebc, bottom_mlp=cfg.model.bottom_mlp,
                    top_mlp=cfg.model.top_mlp, interaction=cfg.model.interaction)
    except ValueError as e:
        raise ConfigError(str(e)) from None


def build_loaders(cfg: Config, meta: DatasetMeta, *, rank: int = 0, world_size: int = 1):
    d = cfg.data
    train = ShardedLoader(meta, split="train", batch_size=d.batch_size, rank=rank,
                          world_size=world_size, shuffle=d.shuffle, shuffle_window=d.shuffle_window,
                          seed=cfg.train.seed, drop_last=True, prefetch=d.prefetch)
    if len(train) == 0:
        raise ConfigError(
            f"data.batch_size={d.batch_size} x {world_size} rank(s) is larger than the "
            f"{meta.split_rows('train')} training rows of {meta.path}"
        )
    evals = ShardedLoader(meta, split="eval", batch_size=d.eval_batch_size, rank=rank,
                          world_size=world_size, shuffle=False, drop_last=False, prefetch=d.prefetch)
    return train, evals


def build_trainer(cfg: Config, *, meta: DatasetMeta | None = None) -> Trainer:
    if cfg.train.threads:
        torch.set_num_threads(cfg.train.threads)
    meta = meta or load_dataset(cfg)
    model = build_model(cfg, meta)
    dense_opt = build_dense_optimizer(dense_parameters(model), cfg.optim)
    sparse_kwargs = {} if cfg.optim.sparse == "sgd" else {"eps": cfg.optim.eps}
    sparse_opt = build_sparse_optimizer(cfg.optim.sparse, model.sparse, lr=cfg.optim.sparse_lr,
                                        **sparse_kwargs)
    train_loader, eval_loader = build_loaders(cfg, meta)
    total_steps = planned_steps(cfg, len(train_loader))
    schedule = LRSchedule(cfg.optim.warmup_steps, cfg.optim.decay, cfg.optim.decay_start, total_steps)
    scheduler = LRScheduler(schedule, dense_opt, sparse_opt,
                            dense_lr=cfg.optim.dense_lr, sparse_lr=cfg.optim.sparse_lr)
    run_dir = Path(cfg.train.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    logger = MetricLogger(run_dir, tensorboard=cfg.train.tensorboard)
    return Trainer(cfg=cfg, model=model, dense_opt=dense_opt, sparse_opt=sparse_opt,
                   scheduler=scheduler, train_loader=train_loader, eval_loader=eval_loader,
                   logger=logger, ledger=CommLedger(), run_dir=run_dir, total_steps=total_steps)


def planned_steps(cfg: Config, per_epoch: int) -> int:
    total = cfg.train.epochs * per_epoch
    return min(total, cfg.train.max_steps) if cfg.train.max_steps else total


def versions() -> dict:
    return {"hybridrec": hybridrec.__version__, "torch": torch.__version__, "numpy": np.__version__,
            "python": platform.python_version(), "platform": platform.platform(),
            "threads": torch.get_num_threads()}
