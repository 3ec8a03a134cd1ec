"""DLRM: bottom MLP on dense features, embedding bags, pairwise dot interaction, top MLP.

Single-device module; parallelism (sharded embeddings, data-parallel dense) is
applied from outside by replacing ``model.sparse`` and wrapping the dense part.
"""

from __future__ import annotations

import torch
from torch import nn

from hybridrec.model.embedding import EmbeddingBagCollection, lookup_during
from hybridrec.model.interaction import DotInteraction, make_interaction
from hybridrec.model.kernels import check_precision, precision_scope
from hybridrec.model.mlp import MLP
from hybridrec.phases import phase
from hybridrec.sparse.keyed_jagged import Batch


class DLRM(nn.Module):
    """Deep Learning Recommendation Model.

    Args:
        num_dense: dense input features (13 for Criteo).
        sparse: the embedding-bag collection; every table must have the dim
            ``bottom_mlp[-1]``.
        bottom_mlp: hidden and output widths of the bottom MLP (input width is
            ``num_dense``), e.g. ``[512, 256, 64]``.
        top_mlp: widths of the top MLP, ending in 1 (the logit), e.g. ``[512, 256, 1]``.
        interaction: ``dot`` (DLRM), ``cat`` or ``dcn`` (DLRM-DCNv2:
            :class:`~hybridrec.model.interaction.CrossInteraction`).
        dcn_layers, dcn_rank: the cross network's layers and rank with ``dcn``.
        precision: ``fp32`` or ``bf16``: the compute dtype of the MLPs and the
            interaction (:func:`~hybridrec.model.kernels.precision_scope`); the
            parameters and the logits stay fp32, and so do the embedding tables unless
            the collection stores them in bf16 (``model.embedding_dtype``).

    ``forward(batch, *, sparse_input=None)`` returns logits ``[B]``.
    """

    def __init__(
        self,
        *,
        num_dense: int,
        sparse: EmbeddingBagCollection,
        bottom_mlp: list[int],
        top_mlp: list[int],
        interaction: str = "dot",
        precision: str = "fp32",
        dcn_layers: int = 3,
        dcn_rank: int = 512,
    ) -> None:
        super().__init__()
        dim = bottom_mlp[-1]
        bad = [n for n, d in zip(sparse.feature_names, sparse.feature_dims) if d != dim]
        if bad:
            raise ValueError(
                f"DLRM needs every embedding dim equal to the bottom MLP output ({dim}); "
                f"features {bad[:5]} differ"
            )
        if top_mlp[-1] != 1:
            raise ValueError(f"the top MLP must end in 1 (the logit), got {top_mlp}")
        self.interaction, top_in = make_interaction(interaction, len(sparse.feature_names), dim,
                                                    dcn_layers=dcn_layers, dcn_rank=dcn_rank)
        self.sparse = sparse
        self.bottom = MLP([num_dense, *bottom_mlp], final_relu=True)
        self.top = MLP([top_in, *top_mlp], final_relu=False)
        self.precision = check_precision(precision)

    def forward(self, batch: Batch, *, sparse_input=None) -> torch.Tensor:
        """Logits ``[B]``. ``sparse_input``: a handle the embedding collection takes
        beside the ids (a sharded collection's input_dist already under way); None for
        a single-device collection."""
        def bottom() -> torch.Tensor:  # (while a sharded lookup's rows travel)
            with precision_scope(self.precision, batch.dense.device), phase("bottom_mlp"):
                return self.bottom(batch.dense)

        pooled, x = lookup_during(self.sparse, batch.sparse, sparse_input, bottom)
        with precision_scope(self.precision, batch.dense.device):
            with phase("interaction"):
                if isinstance(self.interaction, DotInteraction):  # (the features in any order)
                    z = self.interaction(x, *pooled.as_parts())
                else:
                    z = self.interaction(x, pooled.as_3d())
            with phase("top_mlp"):
                logits = self.top(z).squeeze(1)
        return logits.float()
