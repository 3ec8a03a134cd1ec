"""DLRM-DCNv2 (``model.interaction=dcn``): the cross network's values and gradients, its rank
cap and rules, the ``mlperf-dcnv2`` recipe and its memory refusal, training with sharding,
compression and background sync, export and scoring."""

import csv
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from processor import needs_bf16

from hybridrec.cli.main import main
from hybridrec.errors import ConfigError
from hybridrec.model.dlrm import DLRM
from hybridrec.model.embedding import EmbeddingBagCollection, TableConfig
from hybridrec.model.interaction import (
    CrossInteraction,
    cross_impls,
    dcn_rank,
    interaction_parameters,
    make_interaction,
    tune_interactions,
)
from hybridrec.train.run import load_run_model
from hybridrec.train.setup import recipes
from hybridrec.train.setup.configure import build_config

SMALL = ["model.embedding_dim=8", "model.bottom_mlp=16,8", "model.top_mlp=16,1", "data.batch_size=64",
         "data.eval_batch_size=1000", "train.progress=false", "model.interaction=dcn"]


def _plain(m: CrossInteraction, dense, sparse):
    """The cross layers written out as the formula: x_{l+1} = x0 * (U (V x_l) + b) + x_l."""
    x0 = torch.cat([dense.unsqueeze(1), sparse], 1).flatten(1)
    x = x0
    for v, u, b in zip(m.down, m.up, m.bias):
        x = x0 * (x @ v.t() @ u.t() + b) + x
    return x


def test_cross_network_values_and_gradients_match_the_formula():
    torch.manual_seed(0)
    m = CrossInteraction(3, 4, layers=3, rank=2).double()
    for b in m.bias:  # (zero at the start: make them count)
        torch.nn.init.normal_(b)
    dense = torch.randn(5, 4, dtype=torch.double, requires_grad=True)
    sparse = torch.randn(5, 3, 4, dtype=torch.double, requires_grad=True)
    out = m(dense, sparse)
    want = _plain(m, dense, sparse)
    assert out.shape == (5, 16) and torch.allclose(out, want, atol=1e-12)
    g = torch.randn_like(out)
    inputs = [dense, sparse, *m.parameters()]
    got = torch.autograd.grad((out * g).sum(), inputs)
    ref = torch.autograd.grad((want * g).sum(), inputs)
    for a, b in zip(got, ref):
        assert torch.allclose(a, b, atol=1e-12)
    assert torch.autograd.gradcheck(lambda d, s: m(d, s), (dense, sparse))


def test_each_cross_implementation_matches_the_formula_and_one_is_chosen_by_measurement(tmp_path, monkeypatch):
    """fp32: ``torch`` (addmm) and, where oneDNN runs, ``onednn`` (the bias in the product's
    epilogue) give the formula's values and gradients; the choice is timed, then cached."""
    monkeypatch.setenv("HYBRIDREC_CACHE_DIR", str(tmp_path))
    torch.manual_seed(0)
    m = CrossInteraction(26, 16, layers=3, rank=16)
    for b in m.bias:
        torch.nn.init.normal_(b, std=0.1)
    dense = torch.randn(64, 16, requires_grad=True)
    sparse = torch.randn(64, 26, 16, requires_grad=True)
    inputs = [dense, sparse, *m.parameters()]
    want = _plain(m, dense, sparse)
    g = torch.randn_like(want)
    ref = torch.autograd.grad((want * g).sum(), inputs)
    assert cross_impls("cpu")[0] == "torch"
    for impl in cross_impls("cpu"):
        m.impl = impl
        out = m(dense, sparse)
        torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
        for a, r in zip(torch.autograd.grad((out * g).sum(), inputs), ref):
            torch.testing.assert_close(a, r, rtol=1e-4, atol=1e-4)
    holder = torch.nn.ModuleDict({"interaction": m})
    got = tune_interactions(holder, 64)
    assert len(got) == 1 and got[0].source == "measured" and set(got[0].seconds) == set(cross_impls("cpu"))
    assert got[0].key == "cross_net cpu float32 64x432 rank 16 x3" and m.impl == got[0].impl
    assert tune_interactions(holder, 64)[0].source == "cached"
    assert tune_interactions(holder, 64, mode="torch")[0].impl == "torch" and m.impl == "torch"


def test_rank_caps():
    assert dcn_rank(27 * 16, 512) == 16  # the demo: 26 features of 16 and the bottom MLP's output
    assert dcn_rank(27 * 128, 512) == 512  # the MLPerf model: kept
    assert dcn_rank(27 * 128, 2048) == 864  # a quarter of the width
    assert dcn_rank(27 * 64, 512) == 243  # 1,728**2 // 12,288
    assert dcn_rank(27 * 128, 8) == 8 and dcn_rank(40, 512) == 10 and dcn_rank(3, 512) == 1
    m, width = make_interaction("dcn", 26, 16, dcn_layers=2, dcn_rank=512)
    assert width == 432 and m.rank == 16 and len(m.down) == 2
    assert [tuple(p.shape) for p in m.parameters()] == [(16, 432)] * 2 + [(432, 16)] * 2 + [(432,)] * 2
    assert interaction_parameters("dcn", 26, 16, dcn_layers=2, dcn_rank=512) == sum(
        p.numel() for p in m.parameters())
    assert interaction_parameters("dot", 26, 16) == 0


@needs_bf16
def test_bf16_autocast_is_close_and_leaves_fp32_gradients():
    torch.manual_seed(1)
    m = CrossInteraction(26, 16, layers=3, rank=32)
    dense, sparse = torch.rand(64, 16), torch.rand(64, 26, 16) * 0.1
    want = m(dense, sparse)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = m(dense, sparse)
    assert got.dtype == torch.bfloat16
    assert (got.float() - want).abs().max().item() <= 0.05 * want.abs().max().item()
    got.float().sum().backward()
    assert all(p.grad is not None and p.grad.dtype == torch.float32 for p in m.parameters())


@pytest.mark.parametrize("override, message", [
    ("model.interaction=cross", "model.interaction 'cross': dot, cat or dcn"),
    ("model.dcn_layers=0", "model.dcn_layers must be at least 1 (cross layers), got 0"),
    ("model.dcn_rank=0", "model.dcn_rank must be at least 1 (the cross layers' rank), got 0"),
])
def test_bad_values_are_refused(override, message):
    with pytest.raises(ConfigError) as e:
        build_config(overrides=["model.interaction=dcn", override])
    assert message in str(e.value) and "\n" not in str(e.value)


def test_the_mlperf_dcnv2_recipe():
    cfg = build_config(recipes.recipe("mlperf-dcnv2"))
    m, o = cfg.model, cfg.optim
    assert (m.embedding_dim, m.bottom_mlp, m.top_mlp) == (128, [512, 256, 128], [1024, 1024, 512, 256, 1])
    assert (m.interaction, m.dcn_layers, m.dcn_rank) == ("dcn", 3, 512)
    assert (o.dense, o.sparse, o.dense_lr, o.sparse_lr, o.eps, o.warmup_steps) == (
        "adagrad", "rowwise_adagrad", 0.005, 0.005, 1e-10, 0)
    assert cfg.data.batch_size * 8 == 65536
    assert sum(recipes.MLPERF_TABLE_SIZES) == 204_184_588 and max(recipes.MLPERF_TABLE_SIZES) == 40_000_000
    assert recipes.mlperf_table_sizes(0.001).split(",")[:6] == ["40000", "39", "17", "7", "20", "2"]
    ebc = EmbeddingBagCollection([TableConfig(name=f"t{i}", num_embeddings=10, embedding_dim=128) for i in range(26)])
    model = DLRM(
        num_dense=13, sparse=ebc, bottom_mlp=m.bottom_mlp, top_mlp=m.top_mlp, interaction="dcn",
        dcn_layers=3, dcn_rank=512)
    assert model.interaction.rank == 512 and model.top.layers[0].in_features == 27 * 128


def test_mlperf_sized_tables_are_refused_with_numbers(shared_dataset, tmp_path, capsys):
    """The reference's tables (204M rows of 128 floats) on a 2-day dataset hashed into them:
    refused before anything is allocated, with the sizes (train.memory_limit_gb: any machine)."""
    data = shared_dataset(days=2, rows=400, preprocess=("--table-size", recipes.mlperf_table_sizes()))
    code = main(["train", "--recipe", "mlperf-dcnv2", f"data.path={data}", f"train.run_dir={tmp_path / 'run'}",
                 "data.batch_size=64", "train.memory_limit_gb=64", "train.progress=false"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1, err
    assert "not enough memory: this run needs 105." in err and "train.memory_limit_gb=64 is 64.0 GB" in err
    assert not (tmp_path / "run" / "checkpoints").exists()


def _summary(run: Path) -> dict:
    return json.loads((run / "summary.json").read_text())


@pytest.mark.slow
def test_dcn_trains_exports_and_scores_as_in_process(shared_dataset, trained_run, tmp_path):
    """A dcn run learns (held-out AUC above chance), its export's program equals the eager
    model, and score.py and `hybridrec predict` give the in-process probabilities."""
    data = shared_dataset(days=3, rows=2000)
    run = trained_run(data, 60, "model.interaction=dcn", "model.dcn_rank=16", export=True)
    art = run.parent / "art"
    assert _summary(run)["eval"]["auc"] > 0.6
    record = json.loads((art / "export.json").read_text())
    assert record["held_out"]["max_abs_diff"] <= 1e-6
    _, meta, model, _, _ = load_run_model(run)
    assert isinstance(model.interaction, CrossInteraction) and model.interaction.rank == 16
    lines = (data.parent / "raw" / "day_2.tsv").read_bytes().splitlines(keepends=True)[:500]
    inp = tmp_path / "rows.tsv"
    inp.write_bytes(b"".join(lines))
    r = subprocess.run([sys.executable, str(art / "score.py"), str(inp), str(tmp_path / "s.csv")],
                       capture_output=True, text=True, timeout=120, check=False)
    assert r.returncode == 0, r.stderr
    assert main(["predict", str(run), str(inp), "--out", str(tmp_path / "p.csv")]) == 0
    scored, predicted = (_probabilities(tmp_path / n) for n in ("s.csv", "p.csv"))
    # In process: the eval split's first 500 rows are these lines, in order.
    from hybridrec.data.loader import ShardedLoader

    batch = next(iter(ShardedLoader(meta, split="eval", batch_size=500, shuffle=False, prefetch=0)))
    model.eval()
    with torch.no_grad():
        eager = torch.sigmoid(model(batch)).double().numpy()
    assert scored.shape == (500,) and np.abs(scored - eager).max() <= 1e-6
    assert np.abs(predicted - eager).max() <= 1e-6


def _probabilities(path: Path) -> np.ndarray:
    with open(path) as f:
        return np.array([float(r["probability"]) for r in csv.DictReader(f)])


@needs_bf16
@pytest.mark.slow
def test_bf16_dcn_trains(tiny_data, tmp_path):
    run = tmp_path / "run"
    assert main(["train", f"data.path={tiny_data}", f"train.run_dir={run}", *SMALL, "train.max_steps=6",
                 "train.precision=bf16"]) == 0
    assert np.isfinite(_summary(run)["train_loss"])


@pytest.mark.slow
def test_a_resumed_run_that_changes_the_cross_network_is_refused_in_one_line(tiny_data, tmp_path, capsys):
    def args(run, *extra):
        return ["train", f"data.path={tiny_data}", f"train.run_dir={tmp_path / run}", *SMALL, *extra]

    assert main(args("dcn", "train.max_steps=2")) == 0
    assert main(args("dcn", "train.max_steps=3", "model.dcn_layers=2")) != 0
    assert "model.dcn_layers: 3 -> 2" in capsys.readouterr().err
    # a dot run ignores the cross network's keys
    assert main(args("dot", "train.max_steps=2", "model.interaction=dot")) == 0
    assert main(args("dot", "train.max_steps=3", "model.interaction=dot", "model.dcn_layers=2")) == 0


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("extra", [
    ("dist.sharding=table_wise",),
    ("dist.sharding=row_wise", "compress.dense=dct"),
    ("dist.sharding=column_wise",),
    ("dist.sharding=table_row_wise",),
    ("dist.sharding=data_parallel",),
    ("dist.sharding=row_wise", "compress.embedding=dct"),
], ids=lambda e: "+".join(x.split("=")[1] for x in e))
def test_two_ranks_train_dcn_with_every_sharding(shared_dataset, tmp_path, extra):
    """2 gloo ranks through the CLI: the cross network's weights are dense parameters
    (all-reduced, compressed with DCT), fed by every sharding type; the run trains and its
    checkpoint loads into one process. (That sharded training equals one process's is
    test_sharded_embedding's cross-network test.)"""
    data = shared_dataset(days=2, rows=1000)
    run = tmp_path / "run"
    assert main(["train", f"data.path={data}", f"train.run_dir={run}", *SMALL, "train.max_steps=8",
                 "dist.nproc=2", *extra]) == 0
    s = _summary(run)
    assert s["world_size"] == 2 and np.isfinite(s["train_loss"]) and 0.0 < s["eval"]["auc"] < 1.0
    _, _, model, _, _ = load_run_model(run)
    assert isinstance(model.interaction, CrossInteraction)


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("extra", [("sync.algorithm=bmuf",), ("dist.num_ps=1",)], ids=["bmuf", "ps"])
def test_background_sync_and_parameter_servers_train_dcn(shared_dataset, tmp_path, extra):
    """Background synchronization (BMUF between 2 replicas) and a parameter server."""
    data = shared_dataset(days=2, rows=1000)
    run = tmp_path / "run"
    assert main(["train", f"data.path={data}", f"train.run_dir={run}", *SMALL, "train.max_steps=8",
                 "dist.nproc=2", *extra]) == 0
    s = _summary(run)
    assert np.isfinite(s["train_loss"])
    if extra == ("sync.algorithm=bmuf",):  # the replicas were BMUF's, synchronized in the background
        assert (s["sync"]["algorithm"], s["sync"]["mode"]) == ("bmuf", "background")
    else:  # the tables were the server's: every step pushed to it
        assert s["ps"]["servers"] == 1 and s["ps"]["steps_pushed"] == s["step"] > 0
