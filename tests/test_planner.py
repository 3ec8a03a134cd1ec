"""The sharding planner and its byte model: plan invariants in one process; predicted
bytes per step equal the bytes the real mechanism counts, on 2 gloo ranks."""

import json

import pytest
import torch
import torch.nn.functional as F
from distributed import run_ranks

from hybridrec.cli.main import main
from hybridrec.comm.ledger import CommLedger
from hybridrec.model.dlrm import DLRM
from hybridrec.model.embedding import EmbeddingBagCollection, TableConfig
from hybridrec.parallel import plan as P
from hybridrec.parallel.cost_model import (
    describe_plan,
    memory_by_rank,
    predict_all_ranks,
    predict_step_bytes,
)
from hybridrec.parallel.dense_sync import DDPSync
from hybridrec.parallel.parallelize import parallelize_dlrm
from hybridrec.parallel.planner import TableConstraint, plan_sharding
from hybridrec.sparse.keyed_jagged import Batch, KeyedJagged
from hybridrec.train.loop.sparse_optim import combined_sparse_optimizer
from hybridrec.train.loop.step import sparse_grads

GiB = 2**30


def criteo_like(dim=16):
    rows = [10_000_000, 2_000_000, 500_000, 100_000, 20_000, 5_000, 1_000, 100, 10, 3]
    return [TableConfig(name=f"C{i}", num_embeddings=n, embedding_dim=dim)
            for i, n in enumerate(rows)]


def plan_of(tables, **kw):
    args = {"world_size": 4, "local_world_size": 2, "batch_size_per_rank": 1024,
            "bandwidth_bytes_per_s": 1.25e9, "optimizer": "rowwise_adagrad"}
    return plan_sharding(tables, **{**args, **kw})


# -- planner invariants, one process ---------------------------------------------
def test_plan_validates_round_trips_and_is_deterministic():
    tables = criteo_like()
    plan = plan_of(tables)
    plan.validate()
    assert set(plan.tables) == {t.name for t in tables}
    assert ShardingPlanJSON(plan) == ShardingPlanJSON(P.ShardingPlan.from_json(plan.to_json()))
    again = plan_of(list(reversed(tables)))  # input order does not matter
    assert ShardingPlanJSON(plan) == ShardingPlanJSON(again)


def ShardingPlanJSON(plan):  # reads like the type it canonicalises
    d = json.loads(plan.to_json())
    return {**d, "tables": dict(sorted(d["tables"].items()))}


def test_memory_cap_is_respected_and_huge_table_is_row_split():
    tables = criteo_like()
    cap = 250 * 2**20  # C0 alone needs 10M x (16 + 1) x 4 bytes = 680 MB; all: 860 MB
    plan = plan_of(tables, memory_per_rank_bytes=cap)
    assert max(memory_by_rank(plan, "rowwise_adagrad")) <= cap
    assert plan.tables["C0"].sharding_type in ("row_wise", "table_row_wise")


def test_small_tables_go_data_parallel_and_threshold_turns_it_off():
    tables = criteo_like()
    assert plan_of(tables).tables["C9"].sharding_type == "data_parallel"
    no_dp = plan_of(tables, dp_max_rows=0)
    assert all(tp.sharding_type != "data_parallel" for tp in no_dp.tables.values())


def test_constraints_are_obeyed():
    tables = criteo_like()
    pins = {"C1": TableConstraint(sharding_types=["table_wise"], ranks=[3]),
            "C2": TableConstraint(sharding_types=["column_wise"], ranks=[0, 2]),
            "C3": TableConstraint(sharding_types=["table_row_wise"]),
            "C9": TableConstraint(sharding_types=["row_wise"])}
    plan = plan_of(tables, constraints=pins)
    assert [(s.rank, s.cols) for s in plan.tables["C1"].shards] == [(3, (0, 16))]
    assert plan.tables["C2"].sharding_type == "column_wise"
    assert [s.rank for s in plan.tables["C2"].shards] == [0, 2]
    assert plan.tables["C3"].sharding_type == "table_row_wise"
    assert plan.tables["C9"].sharding_type == "row_wise"


def test_bad_input_gives_clear_errors():
    tables = criteo_like()
    with pytest.raises(ValueError, match="'C0'.*memory cap"):
        plan_of(tables, memory_per_rank_bytes=50 * 2**20)  # 680 MB / 4 ranks > 50 MiB
    with pytest.raises(ValueError, match="'C0'.*no sharding candidate.*too big"):
        plan_of(tables, memory_per_rank_bytes=GiB // 4,
                constraints={"C0": TableConstraint(sharding_types=["table_wise"])})
    with pytest.raises(ValueError, match="no such table"):
        plan_of(tables, constraints={"nope": TableConstraint(ranks=[0])})
    with pytest.raises(ValueError, match="not among"):
        plan_of(tables, constraints={"C1": TableConstraint(sharding_types=["diagonal"])})
    with pytest.raises(ValueError, match="outside world"):
        plan_of(tables, constraints={"C1": TableConstraint(ranks=[4])})


def test_worked_example_and_conservation():
    t = TableConfig(name="t", num_embeddings=10, embedding_dim=4)
    plan = P.ShardingPlan(world_size=2, local_world_size=2,
                          tables={"t": P.table_wise("t", 10, 4, 1)})
    p0 = predict_step_bytes(plan, [t], rank=0, batch_sizes=[3, 3])
    assert p0[("input_dist", "fwd")] == (24, 0)  # (3 lengths + 3 ids) x int32
    assert p0[("output_dist", "fwd")] == (0, 48)
    assert p0[("output_dist", "bwd")] == (48, 0)
    assert p0[("input_dist_counts", "fwd")] == (16, 16)
    # All-to-all bytes are conserved: what ranks send, ranks receive.
    tables = criteo_like()
    plan = plan_of(tables)
    pred = predict_all_ranks(plan, tables, batch_sizes=[5, 7, 9, 11], ids_per_bag=2.0)
    for key in pred[0]:
        assert sum(p[key][0] for p in pred) == sum(p[key][1] for p in pred), key
    report = describe_plan(plan, tables, batch_sizes=[1024] * 4, optimizer="rowwise_adagrad")
    assert [r["memory_bytes"] for r in report["ranks"]] == memory_by_rank(plan, "rowwise_adagrad")
    json.dumps(report)


# -- predicted == counted on 2 gloo ranks ---------------------------------------------
DIM = 4
BATCH = [4, 6]  # uneven local batches on purpose
BAG = {"f_t0": 1, "f_t1": 2, "f_t2": 1, "f_t3a": 1, "f_t3b": 3}


def small_tables():
    return [TableConfig(name="t0", num_embeddings=20, embedding_dim=DIM, features=["f_t0"]),
            TableConfig(name="t1", num_embeddings=40, embedding_dim=DIM, features=["f_t1"]),
            TableConfig(name="t2", num_embeddings=8, embedding_dim=DIM, features=["f_t2"],
                        pooling="mean"),  # a second data-parallel group when replicated
            TableConfig(name="t3", num_embeddings=16, embedding_dim=DIM,
                        features=["f_t3a", "f_t3b"])]


def small_plans(world):
    ts = {t.name: (t.name, t.num_embeddings, DIM) for t in small_tables()}
    every = list(range(world))
    uniform = {
        "table_wise": lambda a, i: P.table_wise(*a, i % world),
        "row_wise": lambda a, i: P.row_wise(*a, every),
        "column_wise": lambda a, i: P.column_wise(*a, every),
        "table_row_wise": lambda a, i: P.table_row_wise(*a, every),
        "data_parallel": lambda a, i: P.data_parallel(*a, world),
    }
    plans = {k: P.ShardingPlan(world_size=world, local_world_size=world,
                               tables={n: make(a, i) for i, (n, a) in enumerate(ts.items())})
             for k, make in uniform.items()}
    mixed = ["row_wise", "column_wise", "data_parallel", "table_wise"]
    plans["mixed"] = P.ShardingPlan(world_size=world, local_world_size=world, tables={
        n: uniform[k](a, 1) for (n, a), k in zip(ts.items(), mixed)})
    plans["planned"] = plan_sharding(small_tables(), world_size=world, local_world_size=world,
                                     batch_size_per_rank=5, bandwidth_bytes_per_s=1e9,
                                     stats={f: {"mean_ids_per_sample": n} for f, n in BAG.items()},
                                     constraints={"t1": TableConstraint(
                                         sharding_types=["row_wise"])})
    plans["mixed_dp"] = P.ShardingPlan(world_size=world, local_world_size=world, tables={
        n: P.data_parallel(*a, world) if n in ("t0", "t2") else P.table_wise(*a, 0)
        for n, a in ts.items()})
    return plans


def even_batch(rank, b):
    """Bags of fixed size BAG[f]; ids alternate between the two row halves of the table,
    so each row shard of 2 ranks receives exactly half of a rank's ids (b * bag is even)."""
    keys, vals, lens = [], [], []
    for t in small_tables():
        half = t.num_embeddings // 2
        for f in t.features:
            n = b * BAG[f]
            k = torch.arange(n)
            vals.append((k % 2) * half + (k // 2 + 3 * rank) % half)
            lens.append(torch.full((b,), BAG[f], dtype=torch.int64))
            keys.append(f)
    g = torch.Generator().manual_seed(rank)
    return Batch(torch.randn(b, 3, generator=g), KeyedJagged.from_lengths_per_key(keys, vals, lens),
                 torch.randint(0, 2, (b,), generator=g).float())


def counted(ledger):
    out = {}
    for e in ledger.summary()["entries"]:
        s, r = out.get((e["category"], e["direction"]), (0, 0))
        out[(e["category"], e["direction"])] = (s + e["sent"], r + e["received"])
    return out


def predicted_vs_counted_worker(topo):
    results = {}
    batch = even_batch(topo.rank, BATCH[topo.rank])
    for name, plan in small_plans(topo.group_size).items():
        torch.manual_seed(0)
        model = DLRM(num_dense=3, sparse=EmbeddingBagCollection(small_tables(), seed=7),
                     bottom_mlp=[8, DIM], top_mlp=[6, 1])
        dense = [sum(p.numel() * p.element_size() for p in m.parameters())
                 for m in (model.bottom, model.top)]
        ledger = CommLedger()
        sync = DDPSync(topo, ledger=ledger)
        model = parallelize_dlrm(model, plan, topo, ledger=ledger, dense_sync=sync)
        opts = combined_sparse_optimizer("sgd", model.sparse, lr=0.1)
        F.binary_cross_entropy_with_logits(model(batch), batch.labels).backward()
        sync.synchronize()  # the plain all-reduce predicts its step's bytes
        opts.step(sparse_grads(model.sparse))  # the data-parallel tables' all-reduce runs here
        ledger.step_end()
        pred = predict_step_bytes(plan, small_tables(), rank=topo.rank, batch_sizes=BATCH,
                                  ids_per_bag=BAG, dense_param_bytes=dense)
        summary = ledger.summary()["predicted_vs_counted"]
        match = {k: v["match"] for k, v in summary.items()}
        per_table = {}
        for e in ledger.summary()["entries"]:
            if e["category"] in ("input_dist", "output_dist"):
                per_table.setdefault(e["table"], set()).add((e["category"], e["direction"]))
        results[name] = (pred, counted(ledger), match, plan.to_dict(), per_table)
    return results


@pytest.mark.distributed
def test_predicted_bytes_equal_counted_bytes_on_two_ranks():
    results = run_ranks(predicted_vs_counted_worker, 2)
    for rank, per_plan in enumerate(results):
        assert set(per_plan) == {"table_wise", "row_wise", "column_wise", "table_row_wise",
                                 "data_parallel", "mixed", "planned", "mixed_dp"}
        for name, (pred, count, match, plan, per_table) in per_plan.items():
            # One host group: table_row_wise sums every partial inside it (trw_intra) and
            # nothing is left to send on; the static expectation has output_dist at (0, 0).
            one_host = name == "table_row_wise"
            if one_host:
                assert pred.pop(("output_dist", "fwd")) == pred.pop(("output_dist", "bwd")) == (0, 0)
            # The static expectation is exact for this batch (ids spread evenly over the rows).
            assert pred == count, (rank, name, pred, count)
            # The step's own prediction covers every category counted, and matches.
            assert set(match) == {c for c, _ in count}, (name, match, count)
            # Every sharded table has its own input and output entries, both directions.
            sharded = {n for n, tp in plan["tables"].items() if tp["sharding_type"] != "data_parallel"}
            assert set(per_table) == sharded, (name, per_table)
            for n in sharded:
                assert per_table[n] == ({("input_dist", "fwd")} if one_host else
                                        {("input_dist", "fwd"), ("output_dist", "fwd"), ("output_dist", "bwd")})
            assert all(match.values()), (rank, name, match)
            if name == "data_parallel":  # replicated tables only: nothing is distributed
                assert ("output_dist", "fwd") not in count and ("input_dist", "fwd") not in count
            elif one_host:
                assert ("output_dist", "fwd") not in count and count[("trw_intra", "fwd")] != (0, 0)
            else:
                assert count[("output_dist", "fwd")] != (0, 0)
    kinds = {tp["sharding_type"] for tp in results[0]["planned"][3]["tables"].values()}
    assert "row_wise" in kinds


# -- CLI --------------------------------------------------------------------------------
def test_cli_plan_tables_and_pins(tmp_path, capsys):
    out = tmp_path / "plan.json"
    rc = main(["plan", "--nproc", "2", "--nnodes", "2", "--tables", "2x100000x16,6x1000x16",
               "--memory-per-rank", "16MiB", "--bandwidth", "10Gbit", "--optimizer", "lazy_adam",
               "--pin", "t2=table_wise@3", "--pin", "t0=row_wise", "--out", str(out)])
    assert rc == 0
    text = capsys.readouterr().out
    assert "output fwd sent" in text and "t7" in text
    plan = P.ShardingPlan.from_json(out.read_text())
    assert plan.world_size == 4 and plan.local_world_size == 2
    assert [s.rank for s in plan.tables["t2"].shards] == [3]
    assert plan.tables["t0"].sharding_type == "row_wise"


def test_cli_plan_from_dataset_and_errors(tmp_path, capsys):
    from hybridrec.data.schema import DatasetMeta, FeatureSpec, PartInfo, Schema

    schema = Schema(dense=["I1"], features=[
        FeatureSpec(name="C1", num_embeddings=1000),
        FeatureSpec(name="C2", kind="multihot", num_embeddings=50)])
    (tmp_path / "part-00000").mkdir()  # the planner reads meta.json only
    DatasetMeta(schema=schema, parts=[PartInfo(name="part-00000", rows=10, source="x")],
                splits={"train": ["part-00000"], "eval": []},
                stats={"C2": {"mean_ids_per_sample": 5.0}}).save(tmp_path)
    assert main(["plan", "--nproc", "2", "--data", str(tmp_path), "--dim", "8"]) == 0
    assert "C2" in capsys.readouterr().out
    too_small = ["--tables", "1x100000x16", "--memory-per-rank", "1MiB"]
    assert main(["plan", "--nproc", "2", *too_small]) == 2
    assert "'t0'" in capsys.readouterr().err
    assert main(["plan", "--nproc", "2", "--tables", "3xx10"]) == 2
    assert "COUNTxROWSxDIM" in capsys.readouterr().err
    assert main(["plan", "--nproc", "2", "--tables", "3x10", "--bandwidth", "fast"]) == 2
    assert "--bandwidth: cannot read 'fast'" in capsys.readouterr().err
