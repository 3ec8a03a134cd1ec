"""The training step's named phases (``hybridrec.phases``): profiler ranges while a profiler
runs (the profiling benchmarks split a step by them), nothing otherwise."""

import torch
from test_kernels import _batch, _tiny_dlrm
from torch.profiler import profile

from hybridrec.parallel.dense_sync import NoSync
from hybridrec.phases import phase
from hybridrec.train.loop.optim import dense_parameters
from hybridrec.train.loop.sparse_optim import combined_sparse_optimizer
from hybridrec.train.loop.step import training_step

PHASES = {"forward", "embeddings", "bottom_mlp", "interaction", "top_mlp", "backward", "grad_sync",
          "dense_update", "sparse_update"}


def _step(model, opts):
    dense_opt, sparse_opt = opts
    return training_step(model, _batch(), dense_opt=dense_opt, sparse_opt=sparse_opt, dense_sync=NoSync())


def test_a_profiled_step_shows_every_phase_and_an_unprofiled_one_opens_none():
    model = _tiny_dlrm()
    opts = torch.optim.SGD(dense_parameters(model), lr=0.1), combined_sparse_optimizer("sgd", model.sparse, lr=0.1)
    with profile() as prof:
        _step(model, opts)
    names = {e.name for e in prof.events()}
    assert PHASES <= names, PHASES - names
    # unprofiled: the ranges are one shared no-op context, and the step still trains
    assert phase("forward") is phase("backward")
    before = [p.detach().clone() for p in dense_parameters(model)]
    loss = _step(model, opts)
    assert torch.isfinite(loss)
    assert any(not torch.equal(a, p) for a, p in zip(before, dense_parameters(model)))
