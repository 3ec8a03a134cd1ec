"""compress.embedding_when=pays: the run measures the codecs' time against the wire time they
save and sends the hop uncompressed when compressing does not pay, on every rank alike."""

import pytest

from distributed import run_ranks
from synth_data import synth_dataset

pytestmark = pytest.mark.distributed

SMALL = ["model.embedding_dim=8", "model.bottom_mlp=16,8", "model.top_mlp=16,1", "data.batch_size=64",
         "train.threads=1", "train.progress=false", "compress.embedding=dct", "compress.embedding_ratio=0.25",
         "compress.embedding_when=pays"]


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    return synth_dataset(tmp_path_factory.mktemp("pays"), days=2, rows=1000)


def _build(topo, data, run_dir, codec_ms):
    import hybridrec.parallel.codec_pays as pays
    from hybridrec.train.build import build_trainer
    from hybridrec.train.setup.config import build_config
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
    assert r0 == r1  # one decision, the same numbers on both ranks
    assert set(r0) == {"codec_ms", "float32_ms", "coded_ms", "saved_ms", "pays", "compressed"}
    assert r0["pays"] == (r0["saved_ms"] > r0["codec_ms"]) == r0["compressed"] == coded0 == coded1
    assert r0["saved_ms"] == pytest.approx(2 * (r0["float32_ms"] - r0["coded_ms"]), abs=2e-3)
    if codec_ms is not None:  # a second per step of coding never pays on a loopback link
        assert r0["codec_ms"] == codec_ms and not r0["pays"]
    if r0["compressed"]:
        assert ratio0 > 1 and ratio1 > 1
    else:  # the float32 hop: what is sent is what it stands for
        assert ratio0 == ratio1 == 1.0


def test_pays_is_refused_with_the_threshold_variant():
    from hybridrec.errors import ConfigError
    from hybridrec.train.setup.config import build_config

    with pytest.raises(ConfigError, match="compress.embedding_when=pays measures the top-k"):
        build_config(overrides=["compress.embedding=dct", "compress.embedding_select=threshold",
                                "compress.embedding_when=pays"])
