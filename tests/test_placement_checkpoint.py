"""Checkpoints of partitioned dense modules: each rank writes its rows of one global tensor
per parameter (and of the dense optimizer's state for them). A partitioned run resumed from
its checkpoint trains what the uninterrupted run trains, bit for bit; the checkpoint loads
into a replicated single-process model (same outputs) and back, resharded, onto 3 ranks."""

import pytest
import torch
from distributed import run_ranks
from test_placement import build, dense_params, table_plan
from test_sharded_embedding import GLOBAL_B, global_batches, local_batch

from hybridrec.parallel.checkpoint import load_state, read_manifest, save_sharded
from hybridrec.parallel.dense_sync import DDPSync, NoSync, dense_arches
from hybridrec.parallel.parallelize import parallelize_dlrm
from hybridrec.parallel.placement import model_linears, place_dense, plan_dense
from hybridrec.parallel.topology import Topology
from hybridrec.train.loop.sparse_optim import combined_sparse_optimizer
from hybridrec.train.loop.step import training_step

pytestmark = pytest.mark.distributed

ARCH, BOTTOM, NAMES = "dlrm", [8, 4], ["bottom_mlp", "top_mlp"]  # bottom 3->8->4: 8 columns split
SPLIT = {"bottom.layers.0.weight", "bottom.layers.0.bias", "top.layers.0.weight", "top.layers.0.bias"}


def make(topo, *, shift=0.0):
    """The rank's model (partitioned and sharded; one process: replicated), Adam for
    the dense part (state shaped like each parameter), row-wise Adagrad for the tables.
    ``shift`` moves every initial weight: a model that only a load can make equal."""
    model = build(ARCH, BOTTOM)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(shift)
    sync = NoSync()
    if topo.group_size > 1:  # (one process: the plain single-device model)
        model = place_dense(model, plan_dense(model_linears(model), NAMES, topo.group_size), topo)
        sync = DDPSync(topo)
        model = parallelize_dlrm(model, table_plan(ARCH, topo.group_size), topo, dense_sync=sync)
    dense_opt = torch.optim.Adam(list(dense_params(model).values()), lr=0.01)
    sparse_opt = combined_sparse_optimizer("rowwise_adagrad", model.sparse, lr=0.1)
    return model, dense_opt, sparse_opt, sync


def batches(topo):
    per = GLOBAL_B // topo.group_size
    return [local_batch(b, topo.rank * per, (topo.rank + 1) * per) for b in global_batches(True)]


def save(path, parts, topo):
    model, dense_opt, sparse_opt, _ = parts
    save_sharded(path, model=model, dense_opt=dense_opt, sparse_opts=list(sparse_opt.optimizers.values()),
                 extra={"step": 1}, topo=topo)


def load(path, parts, topo):
    model, dense_opt, sparse_opt, _ = parts
    load_state(path, model=model, dense_opt=dense_opt, sparse_opts=list(sparse_opt.optimizers.values()), topo=topo)


def train(parts, batch):
    model, dense_opt, sparse_opt, sync = parts
    training_step(model, batch, dense_opt=dense_opt, sparse_opt=sparse_opt, dense_sync=sync)


def state_of(parts):
    """Dense parameters and Adam's moments by name, and the tables' shards, cloned."""
    model, dense_opt, _, _ = parts
    params = dense_params(model)
    moments = {f"{k}.{s}": v.clone() for k, p in params.items() for s, v in dense_opt.state[p].items()}
    shards = model.sparse.local_shards() if hasattr(model.sparse, "local_shards") else {}
    tables = {k: w.detach().clone() for k, (_, w) in shards.items()}
    return {k: p.detach().clone() for k, p in params.items()} | moments | tables


def logits_of(parts, batch):
    with torch.no_grad():
        return parts[0](batch)


def resume_worker(topo, path):
    """Train every batch; and, from the checkpoint after the first, the rest again in a
    model that started elsewhere."""
    mine = batches(topo)
    parts = make(topo)
    train(parts, mine[0])
    save(path, parts, topo)
    for b in mine[1:]:
        train(parts, b)
    resumed = make(topo, shift=0.5)
    load(path, resumed, topo)
    for b in mine[1:]:
        train(resumed, b)
    return state_of(parts), state_of(resumed)


def test_resumed_partitioned_run_trains_bit_for_bit(tmp_path):
    for rank, (whole, resumed) in enumerate(run_ranks(resume_worker, 2, str(tmp_path / "ckpt"))):
        assert SPLIT <= whole.keys() and whole.keys() == resumed.keys()
        assert whole["top.layers.0.weight"].shape[0] < 7, "the top MLP's layer was not partitioned"
        for k, v in whole.items():
            assert torch.equal(v, resumed[k]), f"rank {rank}: {k} differs after the resume"


def saving_worker(topo, path):
    """One step, then the logits of the next batch and this rank's blocks, saved at ``path``."""
    parts = make(topo)
    train(parts, batches(topo)[0])
    save(path, parts, topo)
    return logits_of(parts, batches(topo)[1]), state_of(parts), spans(parts[0])


def spans(model):
    """Name -> this rank's rows of the whole layer, for the partitioned parameters."""
    out = {}
    for arch in ("bottom", "top"):
        layer = dense_arches(model)[arch].layers[0]
        c0, c1 = layer.spans()[layer.route.rank]
        out |= {f"{arch}.layers.0.{w}{s}": (c0, c1) for w in ("weight", "bias")
                for s in ("", ".exp_avg", ".exp_avg_sq")}
    return out


def loading_worker(topo, paths):
    """Each checkpoint of ``paths`` loaded into a fresh partitioned model: its logits and blocks."""
    out = []
    for path in paths:
        parts = make(topo, shift=0.5)
        load(path, parts, topo)
        out.append((logits_of(parts, batches(topo)[1]), state_of(parts), spans(parts[0])))
    return out


def assert_blocks(got: dict, whole: dict, rows: dict, where: str):
    """Each partitioned tensor is its rows of ``whole``'s, the others ``whole``'s (bits:
    a load moves them, it computes nothing); tables are compared by the sharded tests."""
    assert SPLIT <= got.keys() & whole.keys()
    for k in (k for k in got if k in whole):
        want = whole[k][slice(*rows[k])] if k in rows else whole[k]
        assert torch.equal(got[k], want), f"{where}: {k}"


def test_partitioned_checkpoint_loads_replicated_and_back_resharded(tmp_path):
    two, one = tmp_path / "two-ranks", tmp_path / "one-process"
    saved = run_ranks(saving_worker, 2, str(two))
    manifest = read_manifest(two)
    shapes = {k: s["shape"] for k, s in manifest["dense_opt"]["state"]["top.layers.0.weight"].items()}
    assert shapes["exp_avg"] == [7, 10] and shapes["step"] == []  # the whole layer, whatever the ranks

    single = Topology.single()
    replicated = make(single, shift=0.5)  # one process: nothing partitioned
    load(two, replicated, single)
    whole = state_of(replicated)
    assert tuple(whole["top.layers.0.weight"].shape) == (7, 10)
    for rank, (_, blocks, rows) in enumerate(saved):
        assert_blocks(blocks, whole, rows, f"rank {rank}'s blocks in the replicated model")
    want = logits_of(replicated, local_batch(global_batches(True)[1], 0, GLOBAL_B))
    # The split layer computes each column block on its own: equal up to float rounding.
    torch.testing.assert_close(torch.cat([r[0] for r in saved]), want, rtol=1e-6, atol=1e-7)

    save(one, replicated, single)
    for path, results in zip((one, two), zip(*run_ranks(loading_worker, 3, [str(one), str(two)]))):
        for rank, (_, blocks, rows) in enumerate(results):
            assert_blocks(blocks, whole, rows, f"{path.name} on rank {rank} of 3")
        torch.testing.assert_close(torch.cat([r[0] for r in results]), want, rtol=1e-6, atol=1e-7)


@pytest.mark.slow
def test_auto_placed_cli_run_resumes_to_the_same_checkpoint(shared_dataset, tmp_path):
    """``hybridrec train`` on 2 ranks with ``dist.partition_dense=auto`` (a wide top MLP at a
    small batch: the planner partitions it, plan.json says why), stopped at a checkpoint and
    resumed: its last checkpoint holds the uninterrupted run's tensors, bit for bit."""
    import json
    import shutil
    import warnings

    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    from hybridrec.cli.main import main

    data = shared_dataset(days=2, rows=600)

    def train(run, steps):
        # the CLI's entry in this process: the ranks start through the same launcher
        code = main(["train", "--recipe", "demo", f"data.path={data}", f"train.run_dir={run}", "dist.nproc=2",
                     "model.embedding_dim=8", "model.bottom_mlp=16,8", "model.top_mlp=256,1", "data.batch_size=8",
                     "data.eval_batch_size=1000", "train.progress=false", "train.checkpoint_every=6",
                     "dist.partition_dense=auto", f"train.max_steps={steps}"])
        assert code == 0
        return json.loads((run / "summary.json").read_text())

    full, cut = tmp_path / "full", tmp_path / "cut"
    train(full, 12)  # checkpoints at 6 and 12
    top = json.loads((full / "plan.json").read_text())["dense"]["top"]
    assert top["placement"] == "partitioned" and top["cost"]["pays"]
    assert top["cost"]["activation_bytes"] < top["cost"]["allreduce_bytes_saved"]
    shutil.copytree(full, cut)  # the run as it was at step 6 (its last checkpoint)
    shutil.rmtree(cut / "checkpoints" / "step-00000012")
    assert train(cut, 12)["resumed_from"] == 6
    saved = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for run in (full, cut):
            dcp_to_torch_save(run / "checkpoints" / "step-00000012", tmp_path / f"{run.name}.pt")
            saved[run.name] = torch.load(tmp_path / f"{run.name}.pt")
    a, b = saved["full"], saved["cut"]
    assert a["model.top.layers.0.weight"].shape[0] == 256  # the whole layer, one tensor
    for k, v in a.items():
        if isinstance(v, torch.Tensor) and not k.startswith("rank"):  # (per-rank: RNG, timings)
            assert torch.equal(v, b[k]), k


def test_init_from_into_column_blocks_is_refused_before_anything_is_built():
    from hybridrec.errors import ConfigError
    from hybridrec.train.setup.configure import build_config
    from hybridrec.train.setup.rules import RunFacts, check_run

    base = ["train.run_dir=r", "dist.partition_dense=top_mlp"]
    check_run(build_config(overrides=base), RunFacts(world=2, local_world=2, device="cpu"))
    with pytest.raises(ConfigError, match="train.init_from cannot load into column blocks"):
        check_run(build_config(overrides=[*base, "train.init_from=other"]), RunFacts(world=2, local_world=2, device="cpu"))
