"""compress.embedding_when=pays and compress.dense_when=pays: the run measures the codecs' time
against the wire time they save and sends the hop uncompressed when compressing does not pay,
on every rank alike."""

import pytest
from distributed import run_ranks

pytestmark = pytest.mark.distributed

SMALL = ["model.embedding_dim=8", "model.bottom_mlp=16,8", "model.top_mlp=16,1", "data.batch_size=64",
         "train.threads=1", "train.progress=false", "compress.embedding=dct", "compress.embedding_ratio=0.25",
         "compress.embedding_when=pays"]


@pytest.fixture(scope="module")
def dataset(shared_dataset):
    return shared_dataset(days=2, rows=1000)


def _build(topo, data, run_dir, codec_ms):
    import hybridrec.parallel.codec_pays as pays
    from hybridrec.train.build import build_trainer
    from hybridrec.train.setup.configure import build_config
    from hybridrec.train.setup.recipes import recipe

    if codec_ms is not None:  # a codec this slow (or this fast) on rank 1 only: the slowest rank decides
        real = pays.codec_ms
        pays.codec_ms = lambda *a, **k: codec_ms if topo.rank == 1 else real(*a, **k)
    cfg = build_config(recipe("demo"), overrides=[f"data.path={data}", f"train.run_dir={run_dir}", *SMALL])
    trainer = build_trainer(cfg, topo=topo)
    for _, batch in zip(range(2), trainer.pipeline.loader):
        trainer.train_step(batch)
    sent = trainer.ledger.totals(category="output_dist")
    return trainer.kernels["embedding_compression"], bool(trainer.model.sparse.codecs), sent.ratio


@pytest.mark.parametrize("codec_ms", [1e6, None])
def test_the_slowest_ranks_codec_decides_and_the_hop_follows(dataset, tmp_path, codec_ms):
    (r0, coded0, ratio0), (r1, coded1, ratio1) = run_ranks(_build, 2, str(dataset), str(tmp_path / "run"), codec_ms,
                                                           timeout_s=120)
    from hybridrec.parallel.codec_pays import saving_ms

    assert r0 == r1  # one decision, the same numbers on both ranks
    assert set(r0) == {"codec_ms", "float32_ms", "coded_ms", "float32_bwd_ms", "coded_bwd_ms", "hidden_fwd_ms",
                       "hidden_bwd_ms", "saved_ms", "pays", "compressed"}
    assert r0["pays"] == (r0["saved_ms"] > r0["codec_ms"]) == r0["compressed"] == coded0 == coded1
    assert r0["hidden_fwd_ms"] > 0 and r0["hidden_bwd_ms"] > 0  # the bottom MLP was timed
    saved = (saving_ms(r0["float32_ms"], r0["coded_ms"], r0["hidden_fwd_ms"])
             + saving_ms(r0["float32_bwd_ms"], r0["coded_bwd_ms"], r0["hidden_bwd_ms"]))
    assert r0["saved_ms"] == pytest.approx(saved, abs=2e-3)
    if codec_ms is not None:  # a second per step of coding never pays on a loopback link
        assert r0["codec_ms"] == codec_ms and not r0["pays"]
    if r0["compressed"]:
        assert ratio0 > 1 and ratio1 > 1
    else:  # the float32 hop: what is sent is what it stands for
        assert ratio0 == ratio1 == 1.0


def test_pays_is_refused_with_the_threshold_variant():
    from hybridrec.errors import ConfigError
    from hybridrec.train.setup.configure import build_config

    with pytest.raises(ConfigError, match="compress.embedding_when=pays measures the top-k"):
        build_config(overrides=["compress.embedding=dct", "compress.embedding_select=threshold",
                                "compress.embedding_when=pays"])


def test_only_the_wire_time_beyond_the_bottom_mlp_is_saved():
    from hybridrec.parallel.codec_pays import decision, saving_ms

    assert saving_ms(5.0, 1.0) == 4.0  # nothing to hide behind: the whole difference
    assert saving_ms(5.0, 1.0, hidden=3.0) == 2.0  # the coded hop hides entirely, the plain one by 3 ms
    assert saving_ms(5.0, 1.0, hidden=8.0) == 0.0  # both hide: compressing saves nothing
    # A bottom MLP slower than the plain exchange both ways: no codec, however fast, pays.
    hidden = decision(0.001, plain=(5.0, 6.0), coded=(1.0, 1.0), hidden=(8.0, 7.0))
    assert hidden == {"saved_ms": 0.0, "pays": False}
    # The same exchanges with a quicker bottom MLP: 3 + 4 ms saved, more than the codecs' 6.5.
    assert decision(6.5, plain=(5.0, 6.0), coded=(1.0, 1.0), hidden=(2.0, 2.0)) == {"saved_ms": 7.0, "pays": True}
    assert decision(7.0, plain=(5.0, 6.0), coded=(1.0, 1.0), hidden=(2.0, 2.0))["pays"] is False  # (not more)
    assert decision(1.0, plain=(3.0,), coded=(1.0,)) == {"saved_ms": 2.0, "pays": True}  # the dense hop: no overlap


def test_the_codecs_timed_are_those_of_the_rows_that_travel():
    """The codecs' work timed for a step is that of the rows that cross a link: on rank 0 of
    batches [5, 3], its block's rows of rank 1's 3 samples encoded and their gradients
    decoded, rank 1's block for its own 5 samples decoded and their gradients encoded; its
    own samples' rows from its own tables are not coded (they do not travel)."""
    from hybridrec.comm.codecs import TopKCodec
    from hybridrec.model.embedding import TableConfig
    from hybridrec.parallel import plan as P
    from hybridrec.parallel.codec_pays import codec_ms
    from hybridrec.parallel.layout import build_layout

    rows = []  # (call, rows) of every codec call

    class Counted(TopKCodec):
        def encode(self, x):
            rows.append(("encode", x.shape[0]))
            return super().encode(x)

        def decode(self, payload, cols):
            rows.append(("decode", payload.shape[0]))
            return super().decode(payload, cols)

        def encode_grad(self, grad, state):
            rows.append(("encode_grad", grad.shape[0]))
            return super().encode_grad(grad, state)

        def decode_grad(self, payload, cols, state, out=None):
            rows.append(("decode_grad", payload.shape[0]))
            return super().decode_grad(payload, cols, state, out=out)

    tables = [TableConfig(name=n, num_embeddings=20, embedding_dim=8, features=[f"f{i}"]) for i, n in enumerate("ab")]
    plan = P.ShardingPlan(world_size=2, local_world_size=2,
                          tables={"a": P.table_wise("a", 20, 8, 0), "b": P.table_wise("b", 20, 8, 1)})
    codec = Counted(0.25)
    layout = build_layout(tables, plan, {"a": codec, "b": codec})
    codec_ms(layout, [5, 3], 0, reps=1)
    step = [("encode", 3), ("decode", 5), ("encode_grad", 5), ("decode_grad", 3)]
    assert rows == [("encode", 5), *step, *step], rows  # (rank 1's payloads made once; a warm-up step)


DENSE = ["model.embedding_dim=8", "model.bottom_mlp=16,8", "model.top_mlp=16,1", "data.batch_size=64",
         "train.threads=1", "train.progress=false", "compress.dense=dct", "compress.dense_ratio=0.1",
         "compress.dense_when=pays"]

DENSE_FIELDS = {"codec_ms", "codec_refresh_ms", "codec_held_ms", "refresh_every", "float32_bytes", "coded_bytes",
                "float32_ms", "coded_ms", "saved_ms", "pays", "compressed"}


def _build_dense(topo, data, run_dir, sync, slow):
    import hybridrec.parallel.codec_pays as pays
    from hybridrec.comm.compress import NoCompression
    from hybridrec.parallel.dense_sync import CATEGORY
    from hybridrec.train.build import build_trainer
    from hybridrec.train.setup.configure import build_config
    from hybridrec.train.setup.recipes import recipe

    # On rank 1 only (the slowest rank decides): a compressor of a second a step, or an
    # all-reduce of a second.
    if slow == "codec":
        real = pays.dense_compressor_ms
        slowed = lambda *a, **k: (1e3, 1e3, 1e3, real(*a, **k)[3])  # (L as measured)
        pays.dense_compressor_ms = slowed if topo.rank == 1 else real
    elif slow == "plain":
        real_x = pays.dense_exchange_ms  # (run all the same: its collectives pair with rank 0's)
        pays.dense_exchange_ms = (lambda *a, **k: (1e3, real_x(*a, **k)[1])) if topo.rank == 1 else real_x
    cfg = build_config(recipe("demo"), overrides=[f"data.path={data}", f"train.run_dir={run_dir}",
                                                  f"dist.dense_sync={sync}", *DENSE])
    trainer = build_trainer(cfg, topo=topo)
    for _, batch in zip(range(3), trainer.pipeline.loader):
        trainer.train_step(batch)
    dense_sync = trainer.optim.dense_sync
    compressor = (dense_sync.hooks.compressor if sync == "ddp" and dense_sync.hooks is not None else
                  getattr(getattr(dense_sync, "reducer", None), "compressor", None))
    kind = None if compressor is None or isinstance(compressor, NoCompression) else compressor.kind
    sent = trainer.ledger.totals(category=CATEGORY)
    return trainer.kernels["dense_compression"], kind, sent.ratio


@pytest.mark.parametrize("sync,slow", [("ddp", "codec"), ("allreduce", "codec"), ("ddp", "plain")])
def test_the_dense_hop_is_measured_and_the_plain_all_reduce_built_when_it_does_not_pay(dataset, tmp_path, sync,
                                                                                      slow):
    (r0, kind0, ratio0), (r1, kind1, ratio1) = run_ranks(_build_dense, 2, str(dataset), str(tmp_path / "run"),
                                                         sync, slow, timeout_s=120)
    assert r0 == r1  # one decision, the same numbers on both ranks
    assert set(r0) == DENSE_FIELDS
    assert r0["float32_bytes"] > r0["coded_bytes"] > 0
    assert r0["saved_ms"] == pytest.approx(r0["float32_ms"] - r0["coded_ms"], abs=2e-3)
    assert r0["pays"] == (r0["saved_ms"] > r0["codec_ms"]) == r0["compressed"]
    assert r0["pays"] == (slow == "plain")
    if r0["pays"]:  # DCT's hook, and fewer bytes than the all-reduce's
        assert kind0 == kind1 == "dct" and ratio0 > 1 and ratio1 > 1
    else:  # the plain all-reduce: what is sent is what it stands for
        assert kind0 is kind1 is None and ratio0 == ratio1 == 1.0


def test_dense_when_pays_is_refused_where_it_does_not_measure():
    from hybridrec.errors import ConfigError
    from hybridrec.train.setup.configure import build_config

    for wrong in (["compress.dense=fp16"], ["compress.dense=dct", "compress.dense_cap=0"],
                  ["compress.dense=topk", "compress.dense_ratio=1"]):
        with pytest.raises(ConfigError, match="compress.dense_when=pays measures the bounded messages"):
            build_config(overrides=[*wrong, "compress.dense_when=pays"])
    with pytest.raises(ConfigError, match="compress.dense_when 'often': always or pays"):
        build_config(overrides=["compress.dense=dct", "compress.dense_when=often"])
