"""The hierarchical step-time model: every term on hand-computed cases, the all-to-all
bytes against cost_model's per-rank predictions, one group = flat, monotonic in the rates."""

import itertools
import math

import pytest

from hybridrec.bench.hier_cost import (
    HostCpu,
    Links,
    Owner,
    SyncSpec,
    Workload,
    background_cost,
    balanced_owners,
    dlrm_dense_params,
    foreground_cost,
    from_owners,
    host_cost,
    plan_owners,
    predict_step,
    ring_loads,
    step_phases,
    sync_round_loads,
    to_owners,
)
from hybridrec.comm.codecs import make_codec
from hybridrec.model.embedding import TableConfig
from hybridrec.parallel import plan as P
from hybridrec.parallel.cost_model import predict_all_ranks


def two_tables():
    return (TableConfig(name="a", num_embeddings=10, embedding_dim=4),
            TableConfig(name="b", num_embeddings=10, embedding_dim=4))


def toy(**kw):
    """The module docstring's worked example: 400 dense bytes, batch 10, 1 s compute."""
    return Workload(**{"tables": two_tables(), "dense_params": 100, "batch_per_rank": 10,
                       "compute_s": 1.0, **kw})


SLOW = Links(intra=1000, cross=100)


def table_wise_plan(tables, n):
    return P.ShardingPlan(world_size=n, local_world_size=n, tables={
        t.name: P.table_wise(t.name, t.num_embeddings, t.embedding_dim, i % n)
        for i, t in enumerate(tables)})


# -- terms ------------------------------------------------------------------------------
def test_to_owners_by_hand():
    # 4 ranks in groups of 2, x = [1, 2, 3, 4] bytes to each owner from every other rank.
    lo = to_owners([1, 2, 3, 4], 0.0, 1, 2)
    assert lo.up == (9, 8, 7, 6)          # X - x_r, X = 10
    assert lo.down == (3, 6, 9, 12)       # (N-1) x_o
    assert lo.xup == (14, 6)              # M (X - X_g), X_g = 3, 7
    assert lo.xdown == (6, 14)            # (N-M) X_g
    assert sum(lo.xup) == sum(lo.xdown) and sum(lo.up) == sum(lo.down)


def test_to_owners_batch_and_per_pair_bytes():
    lo = to_owners([2, 0], 16, 10, 1)     # x = [10*2 + 16, 16]
    assert lo.up == (16, 36) and lo.down == (36, 16)
    assert lo.xup == (16, 36) and lo.xdown == (36, 16)


def test_from_owners_is_the_reverse():
    lo = from_owners([1, 2, 3, 4], 1, 2)  # owner o sends o+1 bytes to each other rank
    assert lo.up == (3, 6, 9, 12) and lo.down == (9, 8, 7, 6)
    assert lo.xup == (6, 14) and lo.xdown == (14, 6)


def test_ring_loads_by_hand():
    lo = ring_loads(100, 4, 2)            # 2 (n-1)/n * 100 = 150 on every rank and cross link
    assert lo.up == (150,) * 4 and lo.xup == (150, 150) and lo.xdown == (150, 150)
    inside = ring_loads(100, 2, 2)        # one group: the ring never leaves it
    assert inside.up == (100, 100) and inside.xup == (0.0,)


def test_phase_time_is_the_busiest_link():
    lo = to_owners([1, 2, 3, 4], 0.0, 1, 2)
    # own links 12 B at 1000 B/s = 0.012 s; cross 14 B at 100 B/s = 0.14 s; at half rate 0.28 s
    assert lo.time_s(SLOW, 1.0) == pytest.approx(0.14)
    assert lo.time_s(SLOW, 0.5) == pytest.approx(0.28)
    assert lo.time_s(Links(intra=10, cross=1e6), 1.0) == pytest.approx(1.2)


def test_balanced_owners_by_hand():
    tables = (TableConfig(name="a", num_embeddings=10, embedding_dim=4, features=["f", "g"]),
              TableConfig(name="b", num_embeddings=5, embedding_dim=2))
    (o, *_rest) = balanced_owners(tables, 2, {"f": 3.0})
    assert o.ids == ((1 + 3) + (1 + 1) + (1 + 1)) * 4 / 2     # f: 3 ids, g and b: 1; int32
    assert o.fwd == o.bwd == (16 + 16 + 8) / 2                 # two features of a, one of b
    assert o.weights == (10 * 4 + 5 * 2) * 4 / 2


def test_plan_owners_by_hand():
    tables = (TableConfig(name="a", num_embeddings=10, embedding_dim=4),
              TableConfig(name="b", num_embeddings=6, embedding_dim=2))
    plan = P.ShardingPlan(world_size=2, local_world_size=2, tables={
        "a": P.table_wise("a", 10, 4, 0), "b": P.row_wise("b", 6, 2, [0, 1])})
    o0, o1 = plan_owners(tables, plan, 2.0)
    # rank 0: a whole (1 + 2 ids) * 4, b's rows 0-2 (1 + 2 * 3/6) * 4 (int32); pieces 4 + 2 floats
    assert o0 == Owner(12 + 8, 24, 24, (40 + 6) * 4)
    assert o1 == Owner(8, 8, 8, 6 * 4)
    codec = make_codec("fp16", eta=1.0, values="fp32")
    c0, _ = plan_owners(tables, plan, 2.0, {"a": codec, "b": codec})
    assert c0.fwd == c0.bwd == 12


def test_plan_owners_match_cost_model_per_rank():
    """Every rank's bytes over the phases equal cost_model's sent and received, dense
    all-reduce included (one group of 3 ranks, uneven table-wise plan, 2 ids per bag)."""
    tables = [TableConfig(name=f"t{i}", num_embeddings=50 + i, embedding_dim=4 * (i + 1))
              for i in range(4)]
    plan = table_wise_plan(tables, 3)
    dense = 3 * 1000
    pred = predict_all_ranks(plan, tables, batch_sizes=[8] * 3, ids_per_bag=2.0,
                             dense_param_bytes=[dense])
    phases = step_phases(plan_owners(tables, plan, 2.0), 8, dense, 3)
    for r in range(3):
        sent = sum(lo.up[r] for lo, _ in phases.values())
        received = sum(lo.down[r] for lo, _ in phases.values())
        assert sent == pytest.approx(sum(s for s, _ in pred[r].values()))
        assert received == pytest.approx(sum(v for _, v in pred[r].values()))


def test_sync_round_loads_by_hand():
    owners = [Owner(0, 0, 0, 40.0)] * 2   # member j: 40 dense + 40 shard bytes = 20 entries
    lo, kind = sync_round_loads(owners, 40.0, 3, SyncSpec())
    ring = 2 * 2 / 3 * 80
    assert kind == "allreduce" and lo.up == pytest.approx((ring, ring))
    assert lo.xup == pytest.approx((2 * ring,))
    half, _ = sync_round_loads(owners, 40.0, 3, SyncSpec(compress="bf16"))
    assert half.up == pytest.approx((ring / 2, ring / 2))
    dct, kind = sync_round_loads(owners, 40.0, 3, SyncSpec(compress="dct", ratio=0.1))
    # k = ceil(0.1 * 20) = 2 entries, bounded at ceil(1.25 * 2) = 3: a fixed buffer of 3
    # float32 values (12 bytes, padded to 16) and 3 uint8 positions (padded to 8), 24 bytes,
    # sent to each of the 2 other groups
    assert kind == "a2a" and dct.up == (48, 48) and dct.xup == (96,)
    none, _ = sync_round_loads(owners, 40.0, 1, SyncSpec())
    assert none.xup == (0,)


def test_foreground_cost_by_hand():
    assert foreground_cost([0.5, 2.0], 1.0, 4) == (1.5, 2.0, 4.0)


def test_background_cost_free_when_the_link_has_room():
    # link 0 shared with the step (round gets half: 0.2 s), link 1 the round's alone (1 s)
    step, rnd, gap = background_cost([0.2, 0.0], [0.1, 1.0], 0.5, 1, 0.5)
    assert (step, rnd) == (0.5, 1.0)
    assert gap == pytest.approx(1.0 / (0.5 * 0.5))


def test_background_cost_stretches_a_full_link():
    # the step needs 0.4 s of a link, a round 0.4 s of it: T = 0.8 s shared.
    step, rnd, gap = background_cost([0.4], [0.4], 0.45, 1, 1.0)
    assert (step, rnd, gap) == pytest.approx((0.8, 0.8, 1.0))  # every 1: 0.4 + 0.4
    step, _, gap = background_cost([0.4], [0.4], 0.45, 4, 1.0)
    assert (step, gap) == pytest.approx((0.5, 4.0))             # a quarter round per step
    step, _, gap = background_cost([0.4], [0.4], 0.45, 1, 0.5)
    # duty 0.5: a round every 1.6 s at most; B = 0.4 / (1 - 0.5 * 0.4 / 0.8) = 0.5333
    assert step == pytest.approx(0.4 / 0.75) and gap == pytest.approx(0.8 / (0.5 * step))


def test_dlrm_dense_params_by_hand():
    # bottom 13-4: 56; dot: top_in = 4 + 3*2/2 = 7 (2 features), top 7-2-1: 16 + 3
    assert dlrm_dense_params(13, 2, 4, [4], [2, 1]) == 56 + 16 + 3
    # cat: top_in = 4 * 3 = 12, top 12-1: 13
    assert dlrm_dense_params(13, 2, 4, [4], [1], interaction="cat") == 56 + 13


# -- whole steps -------------------------------------------------------------------------
def test_worked_example_flat_and_hierarchical():
    flat = predict_step(toy(), SLOW, 2, 1, hierarchical=False)
    assert (flat.input_s, flat.output_fwd_s, flat.output_bwd_s, flat.dense_s) == pytest.approx(
        (0.96, 1.6, 1.6, 4.0))  # input: 10 x (4 + 4) int32 lengths and ids + 16 count bytes
    assert flat.step_s == pytest.approx(9.16) and flat.samples_per_s == pytest.approx(20 / 9.16)
    assert flat.cross_bytes_per_step == 2 * (96 + 160 + 160 + 400)
    hier = predict_step(toy(), SLOW, 2, 1, hierarchical=True, sync=SyncSpec())
    assert (hier.step_s, hier.a2a_s, hier.dense_s) == (1.0, 0.0, 0.0)
    assert hier.replica_bytes == 720 and hier.round_s == pytest.approx(7.2)
    assert hier.gap_steps == pytest.approx(14.4)
    assert hier.cross_bytes_per_step == pytest.approx(2 * 720 / 14.4)
    fg = predict_step(toy(), SLOW, 2, 1, hierarchical=True,
                      sync=SyncSpec(mode="foreground", every=2))
    assert fg.step_s == pytest.approx(1 + 7.2 / 2) and fg.sync_s == pytest.approx(3.6)


@pytest.mark.parametrize("plan", [None, table_wise_plan])
@pytest.mark.parametrize("sync", [SyncSpec(), SyncSpec(mode="foreground", compress="dct")])
def test_one_group_hierarchical_equals_flat(plan, sync):
    w = toy(plan=(lambda n: plan(two_tables(), n)) if plan else None)
    links = Links(intra=1000, cross=100, a2a_efficiency=0.5)
    flat = predict_step(w, links, 1, 4, hierarchical=False).to_dict()
    hier = predict_step(w, links, 1, 4, hierarchical=True, sync=sync).to_dict()
    assert flat.pop("mode") == "flat" and hier.pop("mode") == "hierarchical"
    assert flat == hier


def steps_over(rates, which, shape, hierarchical, sync, w=None):
    w = w or toy(batch_per_rank=64, dense_params=2000)
    out = []
    for r in rates:
        links = Links(intra=r, cross=100) if which == "intra" else Links(intra=1000, cross=r)
        out.append(predict_step(w, links, *shape, hierarchical=hierarchical, sync=sync))
    return out


def nonincreasing(xs):
    return all(a >= b - 1e-12 for a, b in itertools.pairwise(xs))


INTRA = [10, 50, 100, 500, 1e3, 1e4, 1e6]
CROSS = [1, 5, 10, 50, 100, 1e3, 1e5]
SHAPES = [(2, 1), (2, 2), (4, 2), (3, 3)]
BACKGROUND = [SyncSpec(), SyncSpec(duty=1.0), SyncSpec(every=4), SyncSpec(compress="dct")]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("hierarchical,sync", [(False, None), (True, SyncSpec(mode="foreground")),
                                               (True, SyncSpec(mode="foreground", every=3)),
                                               *((True, s) for s in BACKGROUND)])
def test_more_intra_bandwidth_never_predicts_slower(shape, hierarchical, sync):
    steps = steps_over(INTRA, "intra", shape, hierarchical, sync)
    assert nonincreasing([p.step_s for p in steps])


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("hierarchical,sync", [(False, None), (True, SyncSpec(mode="foreground")),
                                               (True, SyncSpec(mode="foreground", every=3))])
def test_more_cross_bandwidth_never_predicts_slower(shape, hierarchical, sync):
    steps = steps_over(CROSS, "cross", shape, hierarchical, sync)
    assert nonincreasing([p.step_s for p in steps])


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("sync", BACKGROUND)
def test_more_cross_bandwidth_in_the_background(shape, sync):
    """Background rounds run as often as the throttle lets them: more cross bandwidth never
    predicts a longer gap, nor a slower step while ``sync.every`` sets the pace. Where
    ``sync.duty`` sets it, faster rounds are more rounds, whose bytes also load the members'
    own links: the step may slow, never beyond the fast-cross limit
    ``t_free - tau + tau / (1 - duty / 2)`` (a round on every shared link half the time)."""
    steps = steps_over(CROSS, "cross", shape, True, sync)
    assert nonincreasing([p.gap_steps for p in steps])
    paced = [p.step_s for p in steps if p.gap_steps == sync.every]
    assert nonincreasing(paced)
    for p in steps:
        t_free = p.step_s - p.sync_s
        bound = t_free + (t_free - p.compute_s) * (1 / (1 - sync.duty / 2) - 1)
        assert p.step_s <= bound + 1e-9


def test_background_step_is_not_monotone_in_cross_when_duty_paced():
    """The one exception above, by hand: 2 x 2, rounds paced by duty. At cross 100 B/s a
    round trickles through the members' links; at 1e5 it runs at their fair share."""
    slow, fast = steps_over([100, 1e5], "cross", (2, 2), True, SyncSpec())
    assert fast.gap_steps < slow.gap_steps and fast.step_s > slow.step_s


def test_flat_cross_link_is_shared_by_the_group():
    """Twice the ranks per group on the same cross link: flat all-to-all over the cross link
    takes about twice as long; hierarchical does not use it within a step."""
    w = toy(batch_per_rank=100)
    links = Links(intra=1e9, cross=100)
    one = predict_step(w, links, 2, 1, hierarchical=False)
    two = predict_step(w, links, 2, 2, hierarchical=False)
    assert two.output_fwd_s == pytest.approx(2 * one.output_fwd_s)
    hier = predict_step(w, links, 2, 2, hierarchical=True, sync=SyncSpec())
    assert hier.step_s < one.step_s and math.isclose(hier.sync_s, 0.0)


def test_validation():
    with pytest.raises(ValueError):
        SyncSpec(algorithm="sgd")
    with pytest.raises(ValueError):
        Links(intra=1, cross=0)
    with pytest.raises(ValueError):
        predict_step(toy(), SLOW, 2, 1, hierarchical=True)


# -- calibration: the group link's all-to-all efficiency, the shadow thread's CPU ------------
def test_cross_a2a_efficiency_by_ranks_sharing_the_link():
    links = Links(intra=1, cross=1, a2a_efficiency=0.4, cross_a2a_efficiency=((1, 0.5), (2, 0.75)))
    assert links.cross_a2a(1) == 0.5 and links.cross_a2a(2) == 0.75
    assert links.cross_a2a(8) == 0.75  # the largest count <= 8
    assert Links(intra=1, cross=1, a2a_efficiency=0.4,
                 cross_a2a_efficiency=((2, 0.75),)).cross_a2a(1) == 0.4  # none <= 1: the default


def test_flat_all_to_alls_use_the_cross_efficiency_on_group_links():
    # The worked example, flat 2 x 1, every all-to-all byte across the 100 B/s group link:
    # at 0.5 there: (96 + 160 + 160) / 50 = 8.32 s of all-to-all, + 4 s ring + 1 s compute.
    links = Links(intra=1000, cross=100, cross_a2a_efficiency=((1, 0.5),))
    f = predict_step(toy(), links, 2, 1, hierarchical=False)
    assert f.input_s == pytest.approx(1.92) and f.output_fwd_s == pytest.approx(3.2)
    assert f.dense_s == pytest.approx(4.0)  # the ring all-reduce keeps its own efficiency
    assert f.step_s == pytest.approx(13.32)
    # 2 x 2 ranks share the link: the entry for 2, not the one for 1.
    two = Links(intra=1000, cross=100, cross_a2a_efficiency=((1, 0.5), (2, 0.25)))
    base = predict_step(toy(), SLOW, 2, 2, hierarchical=False)
    slow = predict_step(toy(), two, 2, 2, hierarchical=False)
    assert slow.a2a_s > base.a2a_s and slow.input_s == pytest.approx(4 * base.input_s)


def test_host_cost_by_hand():
    cpu = HostCpu(round_s_per_byte=0.0, dct_round_s_per_byte=0.0, write_back_s_per_byte=1e-3,
                  cores_per_rank=0.5, agree_s=0.01)
    # rho = 1 s / 10 s = 0.1 core, f = 0.1 / 0.5 = 0.2: compute 1 s -> 1 / 0.8 (+0.25 s);
    # write-back 1e-3 * 100 B / 0.5 cores / 4 steps = 0.05 s; agreement 0.01 s.
    assert host_cost(cpu, 1.0, 1.0, 10.0, True, 4.0, 100.0, True) == pytest.approx(0.31)
    assert host_cost(cpu, 1.0, 1.0, 10.0, False, 4.0, 100.0, False) == pytest.approx(0.25)
    # A thread wanting more than half the cores gets half (a fair share): compute x 2.
    assert host_cost(cpu, 1.0, 10.0, 10.0, False, 4.0, 100.0, False) == pytest.approx(1.0)


def test_host_cpu_round_and_scaling():
    cpu = HostCpu(round_s_per_byte=2.0, dct_round_s_per_byte=5.0, write_back_s_per_byte=1.0,
                  cores_per_rank=2.0, agree_s=0.5)
    assert cpu.round_cpu_s(3.0, "none") == 6.0 and cpu.round_cpu_s(3.0, "fp16") == 6.0
    assert cpu.round_cpu_s(3.0, "dct") == 15.0
    half = cpu.scaled(0.5)
    assert (half.round_s_per_byte, half.dct_round_s_per_byte, half.write_back_s_per_byte,
            half.cores_per_rank, half.agree_s) == (1.0, 2.5, 0.5, 2.0, 0.5)


def test_predict_step_prices_the_shadow_thread_by_hand():
    # The worked example's hierarchical 2 x 1: 1 s steps, 720-byte rounds of 7.2 s at duty 0.5.
    cpu = HostCpu(round_s_per_byte=1e-3, dct_round_s_per_byte=1.0, write_back_s_per_byte=1e-3,
                  cores_per_rank=1.0, agree_s=0.3)
    sync = SyncSpec(every=1, duty=0.5)
    free = predict_step(toy(), SLOW, 2, 1, hierarchical=True, sync=sync)
    assert free.step_s == pytest.approx(1.0) and free.host_s == 0.0
    # A run of 2 steps ends inside its first round: the thread's 0.72 CPU s spread over the
    # 7.2 s round, f = 0.1: compute 1 / 0.9; no write-back; groups of one rank: no agreement.
    short = predict_step(toy(), SLOW, 2, 1, hierarchical=True, sync=sync, cpu=cpu, run_steps=2)
    assert short.host_s == pytest.approx(1 / 0.9 - 1)
    assert short.step_s == pytest.approx(1 / 0.9)
    assert short.samples_per_s == pytest.approx(20 * 0.9)
    # Steady state: rounds every 14.4 s, f = 0.05 (+0.05 / 0.95 s), and the write-back's
    # 0.72 s over gap = 14.4 / t steps: host = 0.05/0.95 + 0.05 t, t = 1 + host.
    long = predict_step(toy(), SLOW, 2, 1, hierarchical=True, sync=sync, cpu=cpu)
    host = (0.05 / 0.95 + 0.05) / 0.95
    assert long.host_s == pytest.approx(host) and long.step_s == pytest.approx(1 + host)
    assert long.gap_steps == pytest.approx(14.4 / (1 + host))
    # Groups of 2 ranks: the members' agreement adds its 0.3 s to every step.
    two = predict_step(toy(), SLOW, 2, 2, hierarchical=True, sync=sync, cpu=cpu, run_steps=2)
    two_free = predict_step(toy(), SLOW, 2, 2, hierarchical=True, sync=sync)
    assert two.host_s >= 0.3 and two.step_s > two_free.step_s + 0.3
    # Flat training has no shadow thread: the CPU terms change nothing.
    assert (predict_step(toy(), SLOW, 2, 1, hierarchical=False, cpu=cpu).step_s
            == predict_step(toy(), SLOW, 2, 1, hierarchical=False).step_s)


def test_host_cpu_and_cross_efficiency_validation():
    with pytest.raises(ValueError, match="cores_per_rank"):
        HostCpu(round_s_per_byte=0, dct_round_s_per_byte=0, write_back_s_per_byte=0,
                cores_per_rank=0)
    with pytest.raises(ValueError, match="efficiencies"):
        Links(intra=1, cross=1, cross_a2a_efficiency=((2, 1.5),))
    with pytest.raises(ValueError, match="rank counts"):
        Links(intra=1, cross=1, cross_a2a_efficiency=((0, 0.5),))
