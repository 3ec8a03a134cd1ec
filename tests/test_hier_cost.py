"""The hierarchical step-time model: every term on hand-computed cases, the all-to-all
bytes against cost_model's per-rank predictions, one group = flat, monotonic in the rates."""

import itertools
import math

import pytest

from hybridrec.comm.codecs import make_codec
from hybridrec.model.embedding import TableConfig
from hybridrec.parallel import plan as P
from hybridrec.parallel.cost_model import predict_all_ranks
from hybridrec.bench.hier_cost import (
    Links,
    Owner,
    SyncSpec,
    Workload,
    background_cost,
    balanced_owners,
    dlrm_dense_params,
    foreground_cost,
    from_owners,
    plan_owners,
    predict_step,
    ring_loads,
    step_phases,
    sync_round_loads,
    to_owners,
)


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
