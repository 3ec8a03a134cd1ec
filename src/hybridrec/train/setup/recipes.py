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


# The DLRM reference trains both Criteo sets with plain SGD, lr 0.1, at mini-batch 128. The
# recipes keep its models at batch 2048 (16x fewer steps per epoch, far better throughput),
# where SGD 0.1 trains badly: one epoch of a synthetic log with Kaggle's cardinalities reached
# AUC 0.762 with the Kaggle model and 0.769 with the Terabyte one (Kaggle model: 0.814 at batch
# 128; 0.764 with the lr scaled to 1.6 and 200 warm-up steps), against 0.825 and 0.826 for Adam
# 0.001 + row-wise Adagrad 0.05 at the same batch 2048 (docs/benchmarks.md, "Defaults: the
# sweep"). So the optimizers differ from the reference; the models do not.
_CRITEO_OPTIM = {"dense": "adam", "dense_lr": 0.001, "sparse": "rowwise_adagrad", "sparse_lr": 0.05,
                 "warmup_steps": 50}


def criteo_kaggle() -> dict:
    """DLRM reference Kaggle model (dim 16, bottom 13-512-256-64-16, top 512-256-1) at batch
    2048, with Adam 0.001 and row-wise Adagrad 0.05 instead of the reference's SGD 0.1 (which
    it runs at batch 128; at 2048 SGD 0.1 trains far worse, see above)."""
    return {
        "model": {"embedding_dim": 16, "bottom_mlp": [512, 256, 64, 16], "top_mlp": [512, 256, 1]},
        "data": {"batch_size": 2048},
        "optim": dict(_CRITEO_OPTIM),
    }


def criteo_terabyte() -> dict:
    """DLRM reference Terabyte model (dim 64, bottom 13-512-256-64, top 512-512-256-1) at batch
    2048, with the optimizers of ``criteo-kaggle`` instead of the reference's SGD 0.1 at 128."""
    return {
        "model": {"embedding_dim": 64, "bottom_mlp": [512, 256, 64], "top_mlp": [512, 512, 256, 1]},
        "data": {"batch_size": 2048},
        "optim": dict(_CRITEO_OPTIM),
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


MLPERF_TABLE_CAP = 40_000_000
"""The MLPerf DLRM-DCNv2 reference's cap on a table's rows (Criteo 1TB's ids above it hashed
into it)."""

MLPERF_TABLE_SIZES = (
    40_000_000, 39_060, 17_295, 7_424, 20_265, 3, 7_122, 1_543, 63, 40_000_000, 3_067_956, 405_282,
    10, 2_209, 11_938, 155, 4, 976, 14, 40_000_000, 40_000_000, 40_000_000, 590_152, 12_973, 108, 36,
)  # fmt: skip
"""Rows of the reference's 26 tables (C1..C26; its ``--num_embeddings_per_feature``: Criteo
1TB's cardinalities capped at :data:`MLPERF_TABLE_CAP`), 204,184,588 in all."""

MLPERF_MULTI_HOT_SIZES = (3, 2, 1, 2, 6, 1, 1, 1, 1, 7, 3, 8, 1, 6, 9, 5, 1, 1, 1, 12, 100, 27, 10, 3, 1, 1)
"""Ids per bag of the reference's synthetic multi-hot Criteo 1TB (``--multi_hot_sizes``,
uniform); hybridrec does not generate this data set (``data synth --multi-hot N`` draws bags
of about N ids)."""


def mlperf_table_sizes(scale: float = 1.0) -> str:
    """The reference's table sizes times ``scale`` (at least 2 rows each) as
    ``hybridrec data preprocess --table-size`` takes them (one number per feature, C1..C26):
    ``scale=1`` gives the benchmark's tables, a smaller one the same shape for a run that fits."""
    return ",".join(str(max(2, round(n * scale))) for n in MLPERF_TABLE_SIZES)


def mlperf_dcnv2() -> dict:
    """The MLPerf Training DLRM-DCNv2 reference (mlcommons/training ``recommendation_v2/
    torchrec_dlrm``: its README's benchmark command and ``dlrm_main.py``):

    - tables: its rows per table are Criteo 1TB's ids capped at 40M (:data:`MLPERF_TABLE_SIZES`),
      which a dataset gets at preprocessing, not from a training config:
      ``hybridrec data preprocess --table-size $(python -c "from hybridrec.train.setup.recipes
      import mlperf_table_sizes; print(mlperf_table_sizes())")`` (or ``--table-size 40000000``:
      every table hashed into 40M rows). 204M rows of 128 floats are 105 GB with their
      optimizer state: the memory check refuses a run whose ranks cannot hold them, with the
      numbers.
    - embedding width 128, bottom MLP 13-512-256-128, top MLP 1024-1024-512-256-1
      (``--embedding_dim 128 --dense_arch_layer_sizes 512,256,128 --over_arch_layer_sizes
      1024,1024,512,256,1``), as in the ``mlperf`` recipe.
    - interaction DCNv2, 3 cross layers of rank 512 (``--interaction_type=dcn
      --dcn_num_layers=3 --dcn_low_rank_dim=512``; over 27 x 128 inputs the rank is below
      ``model.dcn_rank``'s cap and kept).
    - optimizer: Adagrad at learning rate 0.005 for the dense part and the embeddings
      (``--adagrad --learning_rate 0.005``), epsilon 1e-10 (``ADAGRAD_EPS``), no warm-up and no
      decay (``--lr_warmup_steps``, ``--lr_decay_start`` and ``--lr_decay_steps`` default 0),
      one epoch. Differs: the embeddings use row-wise Adagrad (one accumulator per row, as
      every hybridrec table), where the reference's TorchRec applies the exact, element-wise
      Adagrad (FBGEMM's ``EXACT_ADAGRAD``: a float per weight: another 105 GB at full size).
    - batch: the reference trains at a global batch of 65,536 (8 GPUs x 8,192). hybridrec's
      ``data.batch_size`` is per rank: the recipe sets 8,192, the reference's per-GPU batch, so
      that 8 ranks (``dist.nproc=8``) train at its global batch; on fewer ranks the global batch
      is smaller at the same learning rate (not rescaled). One CPU process at 8,192 holds
      ~1.5 GB of activations (the cross layers keep three ``[8192, 3456]`` tensors each); a
      smaller machine lowers ``data.batch_size``.
    - evaluation: the reference's target is AUC 0.8030 on Criteo 1TB's last day within one
      epoch; its ``multi_hot_sizes`` (:data:`MLPERF_MULTI_HOT_SIZES`) are not generated here.
    """
    return {
        "model": {"embedding_dim": 128, "bottom_mlp": [512, 256, 128],
                  "top_mlp": [1024, 1024, 512, 256, 1],
                  "interaction": "dcn", "dcn_layers": 3, "dcn_rank": 512},
        "data": {"batch_size": 8192},
        "optim": {"dense": "adagrad", "dense_lr": 0.005, "sparse": "rowwise_adagrad",
                  "sparse_lr": 0.005, "eps": 1e-10, "warmup_steps": 0, "decay": "none"},
        "train": {"epochs": 1},
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
    "mlperf-dcnv2": mlperf_dcnv2,
    "bench": bench,
}


def recipe(name: str) -> dict:
    try:
        return RECIPES[name]()
    except KeyError:
        raise ConfigError(f"unknown recipe {name!r}; choose from {', '.join(RECIPES)}") from None
