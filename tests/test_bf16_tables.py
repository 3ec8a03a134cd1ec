"""bf16 embedding tables (model.embedding_dtype=bf16): half the memory, lookups as the
float32 tables with the same values, updates in float32 stored with stochastic rounding."""

import pytest
import torch
from distributed import run_ranks

from hybridrec.model.embedding import EmbeddingBagCollection, TableConfig, stochastic_round
from hybridrec.parallel import plan as P
from hybridrec.parallel.cost_model import memory_by_rank
from hybridrec.parallel.sharded_embedding import ShardedEmbeddingBagCollection
from hybridrec.sparse.keyed_jagged import KeyedJagged
from hybridrec.train.loop.sparse_optim import build_sparse_optimizer
from hybridrec.train.setup.config import ConfigError
from hybridrec.train.setup.configure import build_config

BF16 = torch.bfloat16


def neighbours(x):
    """The two bf16 values around each float32 ``x`` (equal where x is one)."""
    down = (x.view(torch.int32) & -65536).view(torch.float32)  # toward zero
    up = ((x.view(torch.int32) & -65536) + 65536).view(torch.float32)  # away from zero
    return down, torch.where(down == x, down, up)


@pytest.mark.slow
def test_stochastic_round_picks_a_neighbour_and_is_unbiased():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1000, generator=g) * torch.logspace(-20, 20, 1000)
    down, up = neighbours(x)
    for _ in range(3):
        r = stochastic_round(x, generator=g).float()
        assert ((r == down) | (r == up)).all()
    # unbiased: 1 + 2^-10 lies 1/8 of the way from 1.0 to the next bf16 (1 + 2^-7)
    v = torch.full((50_000,), 1.0 + 2**-10)  # (fewer than NOISE_SIZE: one number each)
    r = torch.cat([stochastic_round(v, generator=g).float() for _ in range(8)])  # fresh every call
    p_up = (r > 1.0).double().mean().item()
    assert abs(p_up - 0.125) < 4 * (0.125 * 0.875 / 400_000) ** 0.5
    assert set(r.unique().tolist()) == {1.0, 1.0 + 2**-7}
    # the same for negative values (the magnitude is rounded)
    assert abs((stochastic_round(-v, generator=g).float() < -1.0).double().mean().item() - 0.125) < 0.006
    # a tensor larger than NOISE_SIZE: still a neighbour, still unbiased
    big = torch.full((300, 1000), 1.0 + 2**-10)
    r = torch.stack([stochastic_round(big, generator=g).float() for _ in range(20)])
    assert set(r.unique().tolist()) == {1.0, 1.0 + 2**-7}
    assert abs((r > 1.0).double().mean().item() - 0.125) < 0.006
    special = torch.tensor([float("nan"), float("inf"), -float("inf"), 0.0, 1.0, -2.0])
    out = stochastic_round(special).float()
    assert out[0].isnan() and out[1:].tolist() == [float("inf"), -float("inf"), 0.0, 1.0, -2.0]
    with pytest.raises(ValueError, match="float32 only"):
        stochastic_round(x.double())


def tables():
    return [TableConfig(name="a", num_embeddings=50, embedding_dim=8, features=["fa"]),
            TableConfig(name="b", num_embeddings=30, embedding_dim=8, features=["fb"])]


def batch(b=16, seed=1):
    g = torch.Generator().manual_seed(seed)
    lengths = [torch.randint(0, 4, (b,), generator=g) for _ in range(2)]
    values = [torch.randint(0, n, (int(ln.sum()),), generator=g) for n, ln in zip((50, 30), lengths)]
    return KeyedJagged.from_lengths_per_key(["fa", "fb"], values, lengths)


def test_bf16_tables_look_up_what_float32_tables_of_the_same_values_do():
    low = EmbeddingBagCollection(tables(), seed=3, weight_dtype=BF16)
    ref = EmbeddingBagCollection(tables(), seed=3)
    assert low.group_weight(0).dtype == BF16
    assert all(v.dtype == BF16 for v in low.state_dict().values())
    with torch.no_grad():  # the float32 table's values rounded to bf16: the same initial values
        assert torch.equal(low.group_weight(0).float(), ref.group_weight(0).to(BF16).float())
        ref.group_weight(0).copy_(low.group_weight(0).float())
    kjt = batch()
    out, want = low(kjt).values, ref(kjt).values
    assert out.dtype == torch.float32  # output_dtype
    torch.testing.assert_close(out, want, rtol=1e-2, atol=1e-3)  # bags summed in bf16
    as_bf16 = EmbeddingBagCollection(tables(), seed=3, weight_dtype=BF16, output_dtype=BF16)
    assert as_bf16(kjt).values.dtype == BF16
    with pytest.raises(ValueError, match="FM tables"):
        EmbeddingBagCollection([TableConfig(name="f", num_embeddings=5, embedding_dim=4, fm_cols=3)],
                               weight_dtype=BF16)


def test_updates_far_below_a_bf16_step_are_kept_in_expectation():
    """SGD steps of 1e-4 on weights of 1.0 (bf16 steps there: 2^-8 below, 2^-7 above):
    rounding to nearest would drop every one; stochastic rounding keeps their sum."""
    torch.manual_seed(0)
    t = [TableConfig(name="a", num_embeddings=2000, embedding_dim=8, features=["fa"])]
    ebc = EmbeddingBagCollection(t, weight_dtype=BF16)
    with torch.no_grad():
        ebc.group_weight(0).fill_(1.0)
    opt = build_sparse_optimizer("sgd", ebc, lr=1e-4)
    ids = torch.arange(2000).repeat(2)  # every row twice per step: repeated ids are summed first
    for _ in range(50):
        opt.step([(0, ids, torch.full((4000, 8), 0.5), False)])  # 2 x 0.5 x 1e-4 per row and step
    w = ebc.group_weight(0).float()
    assert w.dtype == torch.float32 and not torch.equal(w, torch.ones_like(w))
    assert abs(w.mean().item() - (1.0 - 50 * 1e-4)) < 2e-4
    for name in ("rowwise_adagrad", "lazy_adam"):  # float32 state whatever the storage
        o = build_sparse_optimizer(name, ebc, lr=1e-3)
        o.step([(0, torch.tensor([3, 5]), torch.ones(2, 8), True)])
        assert all(v.dtype == torch.float32 for v in o.row_state(0).values())


def test_memory_estimate_counts_two_bytes_per_value():
    plan = P.ShardingPlan(world_size=1, local_world_size=1,
                          tables={"a": P.table_wise("a", 1000, 8, 0)})
    assert memory_by_rank(plan, "rowwise_adagrad", 2) == [1000 * 8 * 2 + 1000 * 4]
    assert memory_by_rank(plan, "rowwise_adagrad") == [1000 * 8 * 4 + 1000 * 4]


@pytest.mark.parametrize("override, message", [
    (["model.arch=deepfm"], "not supported with model.arch=deepfm"),
    (["dist.num_ps=1"], "not supported with dist.num_ps"),
    (["sync.algorithm=ma"], "not supported with sync.algorithm=ma"),
])
def test_bf16_tables_refused_where_float32_is_needed(override, message):
    with pytest.raises(ConfigError, match=message):
        build_config(overrides=["model.embedding_dtype=bf16", *override])


def sharded_worker(topo, precision_wire):
    tp = {t.name: P.table_wise(t.name, t.num_embeddings, 8, i % topo.group_size) for i, t in enumerate(tables())}
    plan = P.ShardingPlan(world_size=topo.group_size, local_world_size=topo.group_size, tables=tp)
    ebc = ShardedEmbeddingBagCollection(tables(), plan, topo, seed=3, weight_dtype=BF16, wire_dtype=precision_wire)
    kjt = batch(seed=10 + topo.rank)
    out = ebc(kjt).values
    out.sum().backward()
    grads = ebc.reduce_sparse_grads(ebc.pop_sparse_grads())
    opt = build_sparse_optimizer("sgd", ebc.local, lr=0.1)
    before = ebc.local.group_weight(0).clone()
    opt.step(grads["shards"])
    after = ebc.local.group_weight(0)
    return out.dtype, after.dtype, [g.dtype for _, _, g, _ in grads["shards"]], bool((after != before).any())


@pytest.mark.distributed
def test_sharded_bf16_tables_pool_into_the_wire_dtype_and_update_in_float32():
    for wire, want in ((BF16, BF16), (None, torch.float32)):
        for out_dtype, weight_dtype, grad_dtypes, moved in run_ranks(sharded_worker, 2, wire):
            assert out_dtype == want and weight_dtype == BF16 and moved
            assert grad_dtypes and set(grad_dtypes) == {torch.float32}


def test_planner_fits_bf16_tables_where_float32_ones_do_not():
    from hybridrec.parallel.planner import plan_sharding

    big = [TableConfig(name=f"t{i}", num_embeddings=1_000_000, embedding_dim=64, features=[f"f{i}"])
           for i in range(4)]
    kw = {"world_size": 2, "local_world_size": 2, "batch_size_per_rank": 512, "memory_per_rank_bytes": 300_000_000,
          "bandwidth_bytes_per_s": 1.25e8, "optimizer": "rowwise_adagrad"}
    with pytest.raises(ValueError, match="fits on no rank"):  # 4 x 260 MB on 2 ranks of 300 MB
        plan_sharding(big, **kw)
    plan = plan_sharding(big, weight_bytes=2, **kw)  # 4 x 132 MB
    assert memory_by_rank(plan, "rowwise_adagrad", 2) == [2 * (1_000_000 * 64 * 2 + 1_000_000 * 4)] * 2
