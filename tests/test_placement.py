"""Dense placement (the plan's dense part): partitioned MLP layers on 2 and 3 gloo ranks
train what one process trains on the concatenated batch; the dense part round-trips
through JSON; bad placements are refused before any collective."""

import pytest
import torch
import torch.nn.functional as F
from distributed import run_ranks
from test_sharded_embedding import GLOBAL_B, TABLES, global_batches, local_batch

from hybridrec.comm.compress import NoCompression
from hybridrec.comm.ddp_hooks import CompressedAllReduce
from hybridrec.comm.ledger import CommLedger
from hybridrec.model.deepfm import DeepFM
from hybridrec.model.dlrm import DLRM
from hybridrec.model.embedding import EmbeddingBagCollection, TableConfig
from hybridrec.parallel import plan as P
from hybridrec.parallel.dense_sync import AllReduceSync, DDPSync, NoSync, dense_arches
from hybridrec.parallel.parallelize import parallelize_dlrm
from hybridrec.parallel.placement import (
    CATEGORY,
    activation_bytes,
    check_dense,
    mlp_linears,
    model_linears,
    place_dense,
    plan_dense,
    resolve_dense,
)
from hybridrec.parallel.topology import Topology
from hybridrec.train.loop.sparse_optim import combined_sparse_optimizer
from hybridrec.train.loop.step import training_step

K = 4
# (arch, bottom_mlp, modules to partition, dense sync): every dense module type, both
# strategies, and a module whose only layer is partitioned (nothing left for DDP).
CASES = [
    ("dlrm", [8, K], ["bottom_mlp", "top_mlp"], "ddp"),
    ("dlrm", [K], ["bottom"], "allreduce"),
    ("deepfm", [8, K], ["top_mlp"], "ddp"),
]
UNEVEN = {2: [5, 7], 3: [2, 6, 4]}  # rows per rank, GLOBAL_B in all


def build(arch, bottom):
    torch.manual_seed(0)
    fm = arch == "deepfm"
    tables = [TableConfig(name=n, num_embeddings=r, embedding_dim=K + fm, features=[f"f_{n}"],
                          fm_cols=K if fm else None) for n, r in TABLES]
    cls = DeepFM if fm else DLRM
    return cls(num_dense=3, sparse=EmbeddingBagCollection(tables, seed=7), bottom_mlp=bottom, top_mlp=[7, 1])


def table_plan(arch, world):
    dim = K + (arch == "deepfm")
    return P.ShardingPlan(world_size=world, local_world_size=world,
                          tables={n: P.table_wise(n, r, dim, i % world) for i, (n, r) in enumerate(TABLES)})


def dense_params(model):
    return {f"{a}.{n}": p for a, m in dense_arches(model).items() for n, p in m.named_parameters()}


def grads_of(model):
    return {k: p.grad.detach().clone() for k, p in dense_params(model).items()}


def shard_cols(dense, rank):
    """Parameter name -> this rank's column block, for the partitioned ones."""
    return {f"{n}.{d.layer}.{w}": next(s.cols for s in d.shards if s.rank == rank)
            for n, d in dense.items() for w in ("weight", "bias")}


def placed(topo, arch, bottom, names, kind, ledger=None):
    """The rank's model: tables sharded, ``names`` partitioned, the rest synced by ``kind``."""
    model = build(arch, bottom)
    dense = plan_dense(model_linears(model), names, topo.group_size)
    model = place_dense(model, dense, topo, ledger=ledger)
    sync = (DDPSync(topo, ledger=ledger) if kind == "ddp" else
            AllReduceSync(topo, CompressedAllReduce(NoCompression(), ledger), ledger=ledger))
    return parallelize_dlrm(model, table_plan(arch, topo.group_size), topo, dense_sync=sync), dense, sync


def train_worker(topo, arch, bottom, names, kind):
    ledger = CommLedger()
    model, dense, sync = placed(topo, arch, bottom, names, kind, ledger)
    dense_opt = torch.optim.SGD(list(dense_params(model).values()), lr=0.1)
    sparse_opt = combined_sparse_optimizer("sgd", model.sparse, lr=0.1)
    per = GLOBAL_B // topo.group_size
    batches = [local_batch(b, topo.rank * per, (topo.rank + 1) * per) for b in global_batches(True)]
    with torch.no_grad(), ledger.suspended():
        logits = model(batches[0])
    grads = None
    for batch in batches:
        training_step(model, batch, dense_opt=dense_opt, sparse_opt=sparse_opt, dense_sync=sync)
        grads = grads or grads_of(model)  # the first step's (SGD keeps .grad after its step)
        ledger.step_end()
    moved = {d: ledger.totals(scope="last_step", category=CATEGORY, direction=d) for d in ("fwd", "bwd")}
    final = {k: p.detach().clone() for k, p in dense_params(model).items()}
    tables = {k: (s, w.detach().clone()) for k, (s, w) in model.sparse.local_shards().items()}
    return {"logits": logits, "grads": grads, "final": final, "tables": tables, "dense": dense,
            "moved": {d: (c.sent, c.received) for d, c in moved.items()}}


def reference(arch, bottom):
    """One process, the global batch: first logits, first gradients, weights after STEPS."""
    model = build(arch, bottom)
    dense_opt = torch.optim.SGD(list(dense_params(model).values()), lr=0.1)
    sparse_opt = combined_sparse_optimizer("sgd", model.sparse, lr=0.1)
    batches = [local_batch(b, 0, GLOBAL_B) for b in global_batches(True)]
    with torch.no_grad():
        logits = model(batches[0])
    grads = None
    for batch in batches:
        training_step(model, batch, dense_opt=dense_opt, sparse_opt=sparse_opt, dense_sync=NoSync())
        grads = grads or grads_of(model)
    final = {k: p.detach().clone() for k, p in dense_params(model).items()}
    return logits, grads, final, model


def assert_matches(got: dict, ref: dict, cols: dict):
    """Every parameter (name as in the single-device model) equals the reference, the
    partitioned ones the reference's rows ``cols[name]``."""
    assert got.keys() == ref.keys()
    for k, v in got.items():
        want = ref[k][slice(*cols[k])] if k in cols else ref[k]
        torch.testing.assert_close(v, want, rtol=1e-5, atol=1e-6, msg=k)


@pytest.mark.distributed
@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("arch, bottom, names, kind", CASES)
def test_partitioned_training_equals_one_process(world, arch, bottom, names, kind):
    results = run_ranks(train_worker, world, arch, bottom, names, kind)
    ref_logits, ref_grads, ref_final, ref = reference(arch, bottom)
    per = GLOBAL_B // world
    torch.testing.assert_close(torch.cat([r["logits"] for r in results]), ref_logits, rtol=1e-5, atol=1e-6)
    for rank, r in enumerate(results):
        cols = shard_cols(r["dense"], rank)
        assert cols, "nothing was partitioned"
        assert_matches(r["grads"], ref_grads, cols)
        assert_matches(r["final"], ref_final, cols)
        for key, (shard, w) in r["tables"].items():  # the input gradients reached the embeddings
            full = ref.sparse.table_weight(key.split("@")[0])
            want = full[shard.rows[0]:shard.rows[1], shard.cols[0]:shard.cols[1]]
            torch.testing.assert_close(w, want, rtol=1e-5, atol=1e-6)
        predicted = {"fwd": [0, 0], "bwd": [0, 0]}
        for d in r["dense"].values():
            for direction, (sent, received) in activation_bytes(d, per, rank).items():
                predicted[direction][0] += sent
                predicted[direction][1] += received
        assert {k: list(v) for k, v in r["moved"].items()} == predicted


def uneven_worker(topo, arch, bottom, names):
    model, dense, _ = placed(topo, arch, bottom, names, "ddp")
    sizes = UNEVEN[topo.group_size]
    lo = sum(sizes[: topo.rank])
    batch = local_batch(global_batches(True)[0], lo, lo + sizes[topo.rank])
    logits = model(batch)
    F.binary_cross_entropy_with_logits(logits, batch.labels, reduction="sum").backward()
    return logits.detach(), grads_of(model), dense


@pytest.mark.distributed
@pytest.mark.parametrize("world", [2, 3])
def test_uneven_batches(world):
    """Ranks with different batch sizes: the logits are those of one process, and with a
    summed loss every gradient (DDP-averaged or a scaled slice) is the global one / G."""
    arch, bottom, names, _ = CASES[0]
    results = run_ranks(uneven_worker, world, arch, bottom, names)
    model = build(arch, bottom)
    batch = local_batch(global_batches(True)[0], 0, GLOBAL_B)
    logits = model(batch)
    F.binary_cross_entropy_with_logits(logits, batch.labels, reduction="sum").backward()
    torch.testing.assert_close(torch.cat([r[0] for r in results]), logits.detach(), rtol=1e-5, atol=1e-6)
    ref = {k: g / world for k, g in grads_of(model).items()}
    for rank, (_, grads, dense) in enumerate(results):
        assert_matches(grads, ref, shard_cols(dense, rank))


# -- pure: the plan's dense part -----------------------------------------------------------
def test_dense_part_round_trips_and_old_plans_load():
    model = build("dlrm", [8, K])
    dense = plan_dense(model_linears(model), ["top_mlp", "bottom"], 3)
    assert dense["top"].layer == "layers.0" and dense["bottom"].layer == "layers.0"
    assert [s.cols for s in dense["bottom"].shards] == [(0, 3), (3, 6), (6, 8)]
    plan = table_plan("dlrm", 3)
    old = plan.to_json()
    assert '"dense"' not in old  # plans without a dense part are written as before
    plan.dense = dense
    back = P.ShardingPlan.from_json(plan.to_json())
    assert back.dense == dense and back.tables == plan.tables
    assert P.ShardingPlan.from_json(old).dense == {}
    explicit = P.ShardingPlan.from_dict({**plan.to_dict(), "dense": {"top": {"module": "top"}}})
    assert explicit.dense["top"].placement == "replicated"


def test_widest_layer_and_bytes():
    """The widest layer is split; bytes per step follow the formula, worked by hand."""
    layers = mlp_linears([13, 16, 32, 32, 1])
    d = plan_dense({"top": layers}, ["top"], 4)["top"]
    assert d.layer == "layers.1" and [s.num_cols for s in d.shards] == [8] * 4
    # batch 10, rank 0: inputs 3 x 10 x 16 x 4 B either way; 3 x 10 x 8 x 4 B of my columns
    # out, 10 x 24 x 4 B of theirs in; 3 x 8 B of batch sizes forward.
    assert activation_bytes(d, 10, 0) == {"fwd": (1920 + 960 + 24, 1920 + 960 + 24),
                                          "bwd": (1920 + 960, 1920 + 960)}


@pytest.mark.parametrize("names, group, match", [
    (["interaction"], 2, "module 'interaction' has no nn.Linear layer"),
    (["sparse"], 2, "the embeddings are placed by the plan's tables"),
    (["middle_mlp"], 2, "the model has no module 'middle_mlp' .dense modules: interaction, bottom, top"),
    (["top_mlp"], 8, "widest layer top.layers.0 has 7 output columns, fewer than the 8 ranks"),
])
def test_refused_partitions(names, group, match):
    with pytest.raises(ValueError, match=match):
        plan_dense(model_linears(build("dlrm", [8, K])), names, group)


def test_refused_plan_files():
    """A plan file's dense part that does not fit: refused with what and where, before
    any collective (the topologies here have no process group)."""
    model = build("dlrm", [8, K])
    modules = model_linears(model)
    good = plan_dense(modules, ["top"], 2)["top"]
    off_world = P.partitioned("top", "layers.0", 10, 7, [0, 5])
    with pytest.raises(ValueError, match=r"rank\(s\) \[5\], which do not exist \(ranks 0..1\)"):
        P.ShardingPlan(world_size=2, local_world_size=2, dense={"top": off_world}).validate()
    with pytest.raises(ValueError, match=r"dense module 'top': columns placed on rank\(s\) \[5\]"):
        place_dense(model, {"top": off_world}, Topology(0, 2, 0, 2, torch.device("cpu"), "gloo", None, None))
    with pytest.raises(ValueError, match="columns on 2 rank.s., the group has 3"):
        check_dense({"top": good}, modules, 3)
    other = P.partitioned("top", "layers.0", 10, 9, [0, 1])
    with pytest.raises(ValueError, match="splits a 10->9 layer, the model's top.layers.0 is 10->7"):
        check_dense({"top": other}, modules, 2)
    with pytest.raises(ValueError, match="no nn.Linear top.layers.5"):
        check_dense({"top": P.partitioned("top", "layers.5", 10, 7, [0, 1])}, modules, 2)
    with pytest.raises(ValueError, match="do not cover the 7 outputs once"):
        gap = [P.ColumnShard(0, (0, 3)), P.ColumnShard(1, (4, 7))]
        check_dense({"top": P.DensePlan(module="top", placement="partitioned", layer="layers.0",
                                        in_features=10, out_features=7, shards=gap)}, modules, 2)
    with pytest.raises(ValueError, match="and the plan file's dense part .bottom. differ"):
        resolve_dense(["top_mlp"], plan_dense(modules, ["bottom"], 2), model, 2)
    assert resolve_dense([], {"top": good}, model, 2) == {"top": good}


# -- hybridrec plan ------------------------------------------------------------------------
def test_cli_plan_prints_and_writes_the_dense_part(tmp_path, capsys):
    from hybridrec.cli.main import main

    out = tmp_path / "plan.json"
    assert main(["plan", "--nproc", "3", "--tables", "3x100x8", "--batch-size", "10",
                 "--partition-dense", "top_mlp", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    dense = P.ShardingPlan.from_json(out.read_text()).dense
    top = dense["top"]  # default top MLP [14, 512, 256, 1]: 14 = 8 + the 6 dot products of 4 vectors
    assert (top.layer, top.in_features, top.out_features) == ("layers.0", 14, 512)
    assert [s.num_cols for s in top.shards] == [171, 171, 170]
    assert "bottom       replicated" in text and "171,171,170" in text
    assert main(["plan", "--nproc", "2", "--tables", "3x100x8", "--partition-dense", "interaction"]) == 2
    assert "--partition-dense 'interaction': module 'interaction' has no nn.Linear" in capsys.readouterr().err


# -- dist.partition_dense=auto: the planner decides ------------------------------------------
def test_auto_partitions_only_where_it_pays():
    """A wide layer at a small batch pays (its gradient outweighs the activations), a
    narrow one at a large batch does not; the numbers are the formula's, worked by hand."""
    from hybridrec.parallel.planner import choose_dense

    dense = choose_dense({"top": mlp_linears([16, 2048, 1]), "bottom": mlp_linears([16, 64, 4]),
                          "interaction": []}, 2, 8)
    top = dense["top"]
    assert top.placement == "partitioned" and [s.num_cols for s in top.shards] == [1024, 1024]
    # batch 8, rank 0 of 2: inputs 8 x 16 x 4 B each way and direction; my 1024 columns of the
    # other's 8 rows out, its 1024 of mine in (forward; backward the reverse); 8 B of sizes forward.
    act = 2 * (512 + 32768 + 8) + 2 * (512 + 32768)
    saved = 2 * (2 * 1 * (17 * 2048 * 4) // 2)  # ring all-reduce of weight + bias, sent + received
    assert top.cost == {"layer": "layers.0", "batch": 8, "activation_bytes": act,
                        "allreduce_bytes_saved": saved, "pays": True}
    assert dense.keys() == {"top", "bottom"}  # a module without parameters has nothing to decide
    narrow = choose_dense({"bottom": mlp_linears([16, 64, 4])}, 2, 128)["bottom"]
    assert narrow.placement == "replicated" and not narrow.shards
    assert not narrow.cost["pays"] and narrow.cost["activation_bytes"] > narrow.cost["allreduce_bytes_saved"]
    assert choose_dense({"top": mlp_linears([16, 2048, 1])}, 2, 2048)["top"].placement == "replicated"
    few = choose_dense({"top": mlp_linears([16, 2, 1])}, 3, 1)["top"]
    assert few.placement == "replicated" and few.cost == {"pays": False, "why": "2 columns, fewer than the 3 ranks"}


def test_auto_on_a_model_and_its_plan_file():
    """``dist.partition_dense=auto`` on a model: its MLPs decided (the plan's dense part
    round-trips with the numbers); ``auto`` goes alone; a plan file must agree."""
    model = build("dlrm", [64, K])  # bottom 3->64->4, top 10->7->1
    dense = resolve_dense(["auto"], {}, model, 2, batch=3)  # bottom: 1,624 B < 2,048; top: 664 > 616
    assert dense["bottom"].placement == "partitioned" and dense["bottom"].layer == "layers.0"
    assert dense["bottom"].cost["pays"] and dense["top"].placement == "replicated"
    assert (dense["bottom"].cost["activation_bytes"], dense["top"].cost["activation_bytes"]) == (1624, 664)
    plan = table_plan("dlrm", 2)
    plan.dense = dense
    assert P.ShardingPlan.from_json(plan.to_json()).dense == dense
    assert resolve_dense(["auto"], dense, model, 2, batch=3) == dense
    with pytest.raises(ValueError, match="dist.partition_dense=auto and the plan file's dense part"):
        resolve_dense(["auto"], dense, model, 2, batch=4096)
    with pytest.raises(ValueError, match="'auto' lets the planner decide every module; give it alone"):
        resolve_dense(["auto", "top_mlp"], {}, model, 2, batch=3)


def test_cli_plan_auto_says_its_choice(tmp_path, capsys):
    from hybridrec.cli.main import main

    out = tmp_path / "plan.json"
    assert main(["plan", "--nproc", "2", "--tables", "3x100x8", "--batch-size", "8",
                 "--partition-dense", "auto", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    dense = P.ShardingPlan.from_json(out.read_text()).dense
    assert dense["top"].placement == "partitioned" and dense["top"].cost["pays"]
    assert "auto: partitioned: pays; its layers.0 per rank per step at batch 8" in text
    assert main(["plan", "--nproc", "2", "--tables", "3x100x8", "--batch-size", "4096",
                 "--partition-dense", "auto"]) == 0
    assert "top          replicated" in (text := capsys.readouterr().out) and "auto: replicated: does not pay" in text
