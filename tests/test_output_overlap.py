"""The output exchange, plain or coded (DCT-MP), travels while the DLRM's bottom MLP runs,
forward and backward (docs/design.md, "One training step"). That it trains what one process trains is checked
step by step in test_sharded_embedding and test_bf16_wire, which train through it."""

import pytest
import test_deepfm as fm
import torch
from distributed import run_ranks
from test_sharded_embedding import DIM, GLOBAL_B, global_batches, make_plan, tables, train

from hybridrec.comm.codecs import make_codec
from hybridrec.model.deepfm import DeepFM
from hybridrec.model.dlrm import DLRM
from hybridrec.parallel.dense_sync import DDPSync
from hybridrec.parallel.sharded_embedding import ShardedEmbeddingBagCollection
from hybridrec.train.loop.sparse_optim import combined_sparse_optimizer

pytestmark = pytest.mark.distributed


def worker(topo, kind, arch="dlrm", codec=None):
    events = []
    start = topo.all_to_all_start

    class Logged:  # the handle, its wait() logged
        def __init__(self, handle, n):
            self.handle, self.n = handle, n

        def wait(self):
            self.handle.wait()
            events.append(("wait", self.n))

    def logged_start(out, inp, out_splits, in_splits):
        n = sum(1 for e in events if e[0] == "start")
        events.append(("start", n))
        return Logged(start(out, inp, out_splits, in_splits), n)

    topo.all_to_all_start = logged_start

    def bottom_ran(module, args, out):
        events.append(("bottom forward", None))
        out.register_hook(lambda g: events.append(("bottom backward", None)))

    per = GLOBAL_B // topo.group_size
    if arch == "deepfm":  # one forward and backward of DeepFM's first batch (its FM pieces travel too)
        ebc = ShardedEmbeddingBagCollection(fm.tables(), fm.make_plan(kind, topo.group_size), topo, seed=7)
        model = DeepFM(num_dense=3, sparse=ebc, bottom_mlp=[8, fm.K], top_mlp=[6, 1])
        model.bottom.register_forward_hook(bottom_ran)
        batch = fm.local_batch(fm.global_batches()[0], topo.rank * per, (topo.rank + 1) * per)
        model(batch).sum().backward()
        return events
    codecs = {t.name: make_codec(codec, eta=0.25, values="fp16") for t in tables()} if codec else None
    ebc = ShardedEmbeddingBagCollection(tables(), make_plan(kind, topo.group_size), topo, seed=7, codecs=codecs)
    sync = DDPSync(topo)
    model = sync.wrap(DLRM(num_dense=3, sparse=ebc, bottom_mlp=[8, DIM], top_mlp=[6, 1]))
    model.bottom.register_forward_hook(bottom_ran)
    dense_opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    sparse = combined_sparse_optimizer("sgd", model.sparse, lr=0.1)
    train(model, (dense_opt, sparse), global_batches(False)[:1], topo.rank * per, (topo.rank + 1) * per,
                   sync=sync)
    return events


def spans(events, kind):
    """For the bottom MLP's ``kind`` event: the exchanges started before it and waited for after it."""
    at = events.index((kind, None))
    started = {n for e, n in events[:at] if e == "start"}
    return {n for e, n in events[at:] if e == "wait" and n in started}


@pytest.mark.parametrize("arch, kind, codec", [("dlrm", "table_wise", None), ("dlrm", "row_wise", None),
                                               ("deepfm", "table_wise", None), ("dlrm", "table_wise", "dct"),
                                               ("dlrm", "row_wise", "fp16")])
def test_the_output_exchange_travels_while_the_bottom_mlp_runs(arch, kind, codec):
    for events in run_ranks(worker, 2, kind, arch, codec):
        assert len(spans(events, "bottom forward")) == 1, events  # the pooled rows
        assert len(spans(events, "bottom backward")) == 1, events  # their gradients
        assert spans(events, "bottom forward") != spans(events, "bottom backward")

