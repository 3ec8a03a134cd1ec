"""DeepFM: DLRM's deep part plus a first-order (LR) term and an FM second-order term.

Every categorical feature's table is an *FM table* of ``k + 1`` columns
(:attr:`TableConfig.fm_cols` ``= k``): columns ``0..k-1`` are the id's embedding
``v_i`` (shared by the deep part and the FM term, as in DeepFM) and column ``k``
its first-order weight ``w_i``. For one sample, with ``e_f`` the pooled embedding
of field ``f`` (sum pooling)::

    logit = deep(bottom(dense), e_1..e_F)            # DLRM: interaction + top MLP
          + z                                         # z = sum_f sum_{i in bag f} w_i
          + 1/2 (||s||^2 - q)                         # s = sum_f e_f
                                                      # q = sum_f sum_{i in bag f} ||v_i||^2

``q`` is a sum over ids, not over fields, so the FM term is the factorisation machine
over every active id (for one-hot fields the two coincide).

Sharded (DES, see :mod:`hybridrec.parallel.sharded_embedding`): ``z`` and ``q`` are
sums over ids, so every shard owner adds up its own part and sends 2 floats per
sample (``[z_p, q_p]``) instead of its ids' weights and rows; the receiver adds the
owners' parts. ``s`` adds up over owners as well: ``s = sum_d s_d`` with ``s_d`` the
sum of owner ``d``'s field pieces, each at its columns. The collection returns the
fields (``k`` columns each) and ``fm = [z, q, s]`` (``[B, 2 + k]``).

Codecs on the hop (``compress.embedding``): the FM term is always the exact FM of the
embeddings. A lossy codec changes the field vectors the receiver decodes, and an FM
built from decoded fields with ``q`` from the true rows is the FM of no set of vectors
(``||s_hat||^2 - q`` is not a sum of pairwise products), while one process (``hybridrec
eval``) computes the true FM. So the *deep part* sees the decoded fields (as in DLRM,
the compression being studied), and the FM term uses ``s`` and ``q`` of the true
vectors: an owner whose FM pieces are coded sends ``s_p`` uncoded, float32, in its FM
piece (``[z_p, q_p, s_p]``: ``k + 2`` floats per sample instead of 2). Owners without
coded FM pieces send ``[z_p, q_p]`` and the receiver computes their ``s_d`` from the
float32 fields it has, with the function the owners use for ``s_p``, so a lossless
codec (``dct`` at ``eta = 1``, float32 values) trains bit for bit like the uncoded hop.
The loss trained is ``BCE(deep(decoded fields) + z + FM(true v))``; its gradient is
exact for the first-order and FM terms and the codec's backward for the deep part.
"""

from __future__ import annotations

import torch
from torch import nn

from hybridrec.model.embedding import KeyedTensor, lookup_during
from hybridrec.model.interaction import make_interaction
from hybridrec.model.kernels import check_precision, precision_scope
from hybridrec.model.mlp import MLP
from hybridrec.sparse.keyed_jagged import Batch


def fm_terms(pooled: KeyedTensor, dim: int) -> tuple[torch.Tensor, ...]:
    """``(fields [B, F, k], z [B], q [B], s [B, k])`` from a collection's output: either a
    plain collection of FM tables (``k + 1`` columns per feature and square sums; ``s``
    is the fields' sum) or a sharded one that already reduced ``[z, q, s]`` (``pooled.fm``)."""
    b, nf = pooled.values.shape[0], len(pooled.keys)
    if pooled.fm is not None:
        return pooled.as_3d(), pooled.fm[:, 0], pooled.fm[:, 1], pooled.fm[:, 2:]
    if pooled.square_sums is None or any(d != dim + 1 for d in pooled.dims):
        raise ValueError(f"DeepFM needs FM tables of {dim} + 1 columns (fm_cols={dim})")
    v = pooled.values.view(b, nf, dim + 1)
    fields = v[:, :, :dim]
    return fields, v[:, :, dim].sum(1), pooled.square_sums.sum(1), fields.sum(1)


class DeepFM(nn.Module):
    """DeepFM over DLRM's deep part.

    Args:
        num_dense: dense input features.
        sparse: a collection of FM tables (``k + 1`` columns, ``fm_cols = k``), or a
            sharded collection of them.
        bottom_mlp: bottom MLP widths, ending in ``k``.
        top_mlp: top MLP widths, ending in 1.
        interaction: ``dot``, ``cat`` or ``dcn`` (with ``dcn_layers`` and ``dcn_rank``, as
            for :class:`~hybridrec.model.dlrm.DLRM`).
        precision: ``fp32`` or ``bf16``, as for :class:`~hybridrec.model.dlrm.DLRM`
            (the FM terms stay fp32).

    ``forward(batch, *, sparse_input=None)`` returns logits ``[B]``: deep + first-order
    + FM (``sparse_input``: as in :meth:`hybridrec.model.dlrm.DLRM.forward`).
    """

    def __init__(self, *, num_dense: int, sparse, bottom_mlp: list[int], top_mlp: list[int],
                 interaction: str = "dot", precision: str = "fp32", dcn_layers: int = 3,
                 dcn_rank: int = 512) -> None:
        super().__init__()
        self.dim = bottom_mlp[-1]
        if top_mlp[-1] != 1:
            raise ValueError(f"the top MLP must end in 1 (the logit), got {top_mlp}")
        self.interaction, top_in = make_interaction(interaction, len(sparse.feature_names), self.dim,
                                                    dcn_layers=dcn_layers, dcn_rank=dcn_rank)
        self.sparse = sparse
        self.bottom = MLP([num_dense, *bottom_mlp], final_relu=True)
        self.top = MLP([top_in, *top_mlp], final_relu=False)
        self.precision = check_precision(precision)

    def forward(self, batch: Batch, *, sparse_input=None) -> torch.Tensor:
        def bottom() -> torch.Tensor:  # (while a sharded lookup's rows travel)
            with precision_scope(self.precision, batch.dense.device):
                return self.bottom(batch.dense)

        pooled, x = lookup_during(self.sparse, batch.sparse, sparse_input, bottom)
        fields, z, q, s = fm_terms(pooled, self.dim)
        with precision_scope(self.precision, batch.dense.device):
            deep = self.top(self.interaction(x, fields)).squeeze(1).float()
        return deep + z + 0.5 * (s.pow(2).sum(1) - q)
