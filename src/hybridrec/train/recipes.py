"""Named configurations (Python functions returning config overrides).

Use with ``hybridrec train --recipe NAME``; files and ``key=value`` arguments
given after it override the recipe.
"""

from __future__ import annotations

from hybridrec.errors import ConfigError


def demo() -> dict:
    """The README's demo: a small DLRM on the synthetic Criteo-like dataset."""
    return {
        "model": {"embedding_dim": 16, "bottom_mlp": [64, 16], "top_mlp": [128, 64, 1]},
        "data": {"batch_size": 512, "eval_batch_size": 16384},
        "optim": {"dense": "adagrad", "dense_lr": 0.05, "sparse": "rowwise_adagrad",
                  "sparse_lr": 0.05, "warmup_steps": 50},
        "train": {"epochs": 1, "log_every": 100},
    }


def criteo_kaggle() -> dict:
    """DLRM reference Kaggle config: dim 16, bottom 13-512-256-64-16, top 512-256-1."""
    return {
        "model": {"embedding_dim": 16, "bottom_mlp": [512, 256, 64, 16], "top_mlp": [512, 256, 1]},
        "data": {"batch_size": 2048},
        "optim": {"dense": "sgd", "dense_lr": 0.1, "sparse": "sgd", "sparse_lr": 0.1},
    }


def criteo_terabyte() -> dict:
    """DLRM reference Terabyte config: dim 64, bottom 13-512-256-64, top 512-512-256-1."""
    return {
        "model": {"embedding_dim": 64, "bottom_mlp": [512, 256, 64], "top_mlp": [512, 512, 256, 1]},
        "data": {"batch_size": 2048},
        "optim": {"dense": "sgd", "dense_lr": 0.1, "sparse": "sgd", "sparse_lr": 0.1},
    }


def mlperf() -> dict:
    """MLPerf DLRM: dim 128, bottom 13-512-256-128, top 1024-1024-512-256-1."""
    return {
        "model": {"embedding_dim": 128, "bottom_mlp": [512, 256, 128],
                  "top_mlp": [1024, 1024, 512, 256, 1]},
        "data": {"batch_size": 2048},
        "optim": {"dense": "adagrad", "dense_lr": 0.01, "sparse": "rowwise_adagrad",
                  "sparse_lr": 0.01},
    }


def bench() -> dict:
    """The throughput benchmark model: dim 64, bottom 13-512-256-64, top 512-256-1, SGD."""
    return {
        "model": {"embedding_dim": 64, "bottom_mlp": [512, 256, 64], "top_mlp": [512, 256, 1]},
        "data": {"batch_size": 2048},
        "optim": {"dense": "sgd", "dense_lr": 0.01, "sparse": "sgd", "sparse_lr": 0.01},
    }


RECIPES = {
    "demo": demo,
    "criteo-kaggle": criteo_kaggle,
    "criteo-terabyte": criteo_terabyte,
    "mlperf": mlperf,
    "bench": bench,
}


def recipe(name: str) -> dict:
    try:
        return RECIPES[name]()
    except KeyError:
        raise ConfigError(f"unknown recipe {name!r}; choose from {', '.join(RECIPES)}") from None
