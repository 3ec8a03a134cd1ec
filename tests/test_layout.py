"""build_layout: a pure function of tables, plan and codecs; the one place of bytes per row."""

import dataclasses

import pytest
import torch

from hybridrec.comm.codecs import make_codec
from hybridrec.model.embedding import TableConfig
from hybridrec.parallel import plan as P
from hybridrec.parallel.cost_model import expected_ids, predict_all_ranks, step_bytes
from hybridrec.parallel.layout import IDENTITY, build_layout


def tables(fm=False):
    k = 4
    return [TableConfig(name="a", num_embeddings=10, embedding_dim=k + fm, features=["fa"],
                        fm_cols=k if fm else None),
            TableConfig(name="b", num_embeddings=6, embedding_dim=k + fm, features=["fb1", "fb2"],
                        fm_cols=k if fm else None),
            TableConfig(name="c", num_embeddings=3, embedding_dim=k + fm, features=["fc"],
                        fm_cols=k if fm else None)]


def plan(dim=4):
    return P.ShardingPlan(world_size=2, local_world_size=2, tables={
        "a": P.row_wise("a", 10, dim, [0, 1]), "b": P.column_wise("b", 6, dim, [1, 0]),
        "c": P.data_parallel("c", 3, dim, 2)})


def test_layout_is_frozen_data_of_tuples():
    lay = build_layout(tables(), plan())
    assert lay == build_layout(tables(), plan())  # pure: the same inputs, an equal layout
    with pytest.raises(dataclasses.FrozenInstanceError):
        lay.world_size = 3
    for f in dataclasses.fields(lay):
        value = getattr(lay, f.name)
        assert not isinstance(value, (list, dict, set)), f.name
    assert lay.feature_names == ("fa", "fb1", "fb2", "fc") and lay.feature_dims == (4, 4, 4, 4)
    assert [[s.name for s in owner] for owner in lay.slots] == [["fa@0", "fb1@1", "fb2@1"],
                                                                ["fa@1", "fb1@0", "fb2@0"]]
    assert lay.widths == (4 + 2 + 2, 4 + 2 + 2)
    assert lay.row_split == (True, False, False, False)
    # fb1: column shard 0 (cols 0-1) on rank 1, shard 1 (cols 2-3) on rank 0, in column order.
    assert lay.assembly[1] == ((1, 1, 0), (0, 1, 2))
    assert lay.replicated_tables == ("c",) and lay.dp_groups == ((3, 4),)
    assert lay.coded is None


def test_block_order_only_where_every_feature_is_one_whole_piece():
    # Table-wise and replicated tables: a rank's output can stay in its blocks' order.
    tw = P.ShardingPlan(world_size=2, local_world_size=2, tables={
        "a": P.table_wise("a", 10, 4, 1), "b": P.table_wise("b", 6, 4, 0), "c": P.data_parallel("c", 3, 4, 2)})
    lay = build_layout(tables(), tw)
    # Blocks: rank 0's (b: fb1, fb2), rank 1's (a: fa), the replicated (c: fc).
    assert lay.block_order == (1, 2, 0, 3)
    # Row shards are added and column shards joined: assembled.
    assert build_layout(tables(), plan()).block_order is None
    # FM pieces: assembled.
    assert build_layout(tables(fm=True), P.ShardingPlan(world_size=2, local_world_size=2, tables={
        "a": P.table_wise("a", 10, 5, 1), "b": P.table_wise("b", 6, 5, 0),
        "c": P.data_parallel("c", 3, 5, 2)})).block_order is None


def test_ids_travel_as_int32_unless_a_sharded_table_is_too_large():
    assert build_layout(tables(), plan()).id_dtype == torch.int32
    big = [TableConfig(name="a", num_embeddings=2**31 + 1, embedding_dim=4, features=["fa"])]
    big_plan = P.ShardingPlan(world_size=2, local_world_size=2,
                              tables={"a": P.table_wise("a", 2**31 + 1, 4, 1)})
    assert build_layout(big, big_plan).id_dtype == torch.int64
    edge = P.ShardingPlan(world_size=2, local_world_size=2, tables={"a": P.table_wise("a", 2**31, 4, 1)})
    assert build_layout([dataclasses.replace(big[0], num_embeddings=2**31)], edge).id_dtype == torch.int32


def test_bytes_per_row_come_from_the_codec():
    dct = make_codec("dct", eta=0.25)
    lay = build_layout(tables(), plan(), {"a": dct})
    piece = lay.blocks[0].pieces[0]
    assert (piece.table, piece.width, piece.codec) == ("a", 4, dct)
    assert (piece.fwd_bytes, piece.bwd_bytes, piece.orig_bytes) == (1 * (4 + 1), 4, 16)
    assert lay.blocks[0].pieces[1].codec is IDENTITY
    assert [o.fwd_bytes for o in lay.coded] == [5 + 8 + 8, 5 + 8 + 8]
    assert lay.blocks[0].bytes_by_table(3 * 21, "fwd") == {"a": (15, 48), "b": (48, 48)}
    with pytest.raises(ValueError, match="whole rows"):
        lay.blocks[0].bytes_by_table(20, "fwd")


def test_fm_piece_carries_s_only_for_coded_fm_owners():
    dim = 5
    plain = build_layout(tables(fm=True), plan(dim))
    assert [b.pieces[-1].width for b in plain.blocks] == [2, 2, 2]
    assert plain.feature_dims == (4, 4, 4, 4)
    # b's column shards: cols 0-2 on rank 1 (3 FM columns), 3-4 on rank 0 (1 FM column + w).
    assert [p.width for p in plain.blocks[0].pieces] == [4, 1, 1, 2]
    coded = build_layout(tables(fm=True), plan(dim), {"b": make_codec("fp16")})
    assert [b.s_at_owner for b in coded.blocks] == [True, True, False]
    assert [b.pieces[-1].width for b in coded.blocks] == [2 + 4, 2 + 4, 2]
    assert coded.blocks[0].bytes_by_table(coded.blocks[0].row_bytes("fwd"), "fwd")[None] == (24, 24)


def test_fm_sum_places_pieces_at_their_columns():
    lay = build_layout(tables(fm=True), plan(5))
    block = lay.blocks[0]  # fa@0 (cols 0-3), fb1@1 and fb2@1 (col 3 only)
    parts = [torch.ones(2, 4), torch.full((2, 1), 2.0), torch.full((2, 1), 3.0)]
    assert torch.equal(block.fm_sum(parts, 2), torch.tensor([[1.0, 1, 1, 6]] * 2))


def test_errors_name_what_is_wrong():
    with pytest.raises(ValueError, match="no entry"):
        build_layout(tables() + [TableConfig(name="z", num_embeddings=2, embedding_dim=4)], plan())
    with pytest.raises(ValueError, match="unknown tables"):
        build_layout(tables(), plan(), {"nope": make_codec("fp16")})


@pytest.mark.parametrize("codec", [None, "dct", "int8"])
def test_step_bytes_of_every_rank_add_up_to_the_static_prediction(codec):
    codecs = {} if codec is None else {"a": make_codec(codec, eta=0.5), "b": make_codec(codec, eta=0.5)}
    lay = build_layout(tables(), plan(), codecs)
    batch = [4, 6]
    ids = expected_ids(lay, batch, {"fa": 2.0, "fb1": 1.0, "fb2": 3.0})  # whole ids: exact
    static = predict_all_ranks(plan(), tables(), batch_sizes=batch,
                               ids_per_bag={"fa": 2.0, "fb1": 1.0, "fb2": 3.0}, codecs=codecs)
    for rank in range(2):
        got = {}
        for (category, _table, direction), (s, r) in step_bytes(lay, rank, batch, ids).items():
            a, b = got.get((category, direction), (0, 0))
            got[(category, direction)] = (a + s, b + r)
        assert {k: v for k, v in static[rank].items() if k[0] != "dp_table_allreduce"} == got
