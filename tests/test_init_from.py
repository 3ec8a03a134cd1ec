"""``train.init_from`` / ``train.init_optimizer``: a new run starts from another run's
weights and optimizer state, across world sizes, and never instead of its own checkpoint."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from distributed import run_ranks

SMALL = ["model.embedding_dim=8", "model.bottom_mlp=16,8", "model.top_mlp=16,1", "data.batch_size=64",
         "data.eval_batch_size=1000", "train.progress=false", "train.log_every=0", "optim.warmup_steps=0",
         "train.threads=1", "train.kernels=torch"]


def _cli(*args: str) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, "-m", "hybridrec", *args], capture_output=True, text=True,
                          timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def _train(data, run, *extra) -> tuple[subprocess.CompletedProcess, dict]:
    proc = _cli("train", "--recipe", "demo", f"data.path={data}", f"train.run_dir={run}", *SMALL, *extra)
    return proc, json.loads((run / "summary.json").read_text())


def _main(*args: str) -> None:
    from hybridrec.cli.main import main

    assert main(list(args)) == 0


def _source_worker(topo, data, run):
    """A 2-rank source run (what `hybridrec train dist.nproc=2` trains, with config.json)."""
    from hybridrec.train.build import build_trainer

    cfg = _config(data, run, "train.max_steps=12", "dist.nproc=2", "dist.sharding=row_wise")
    build_trainer(cfg, topo=topo).fit()
    if topo.rank == 0:
        (run / "config.json").write_text(json.dumps(cfg.to_dict()))


@pytest.fixture(scope="module")
def world(shared_dataset, tmp_path_factory):
    """Days 0-1 (``data``); day 2 made ``--like data`` (``like``) and ``--like data --grow``
    (``grown``); a 1-process and a 2-rank run trained on ``data``."""
    root = tmp_path_factory.mktemp("init_from")
    data = shared_dataset(days=3, rows=1500)  # (days 0, 1 train, 2 held out)
    day2 = str(data.parent / "raw" / "day_2.tsv")
    _main("data", "preprocess", day2, "--like", str(data), "--out", str(root / "like"))
    _main("data", "preprocess", day2, "--like", str(data), "--grow", "--out", str(root / "grown"))
    one, two = root / "one", root / "two"
    _main("train", "--recipe", "demo", f"data.path={data}", f"train.run_dir={one}", *SMALL, "train.max_steps=12",
          "train.checkpoint_every=6")
    run_ranks(_source_worker, 2, data, two, timeout_s=120)
    return {"data": data, "like": root / "like", "grown": root / "grown", "one": one, "two": two}


def _config(data, run, *extra):
    from hybridrec.train.setup.configure import build_config
    from hybridrec.train.setup.recipes import demo

    return build_config(demo(), overrides=[f"data.path={data}", f"train.run_dir={run}", *SMALL, *extra])


def _checkpoint_state(path, cfg) -> dict:
    """A checkpoint's tables, dense weights and optimizer state, loaded into one process."""
    from hybridrec.parallel.checkpoint import load_state
    from hybridrec.parallel.topology import Topology
    from hybridrec.train.backends import build_sparse_optimizers
    from hybridrec.train.build import build_model
    from hybridrec.train.loop.optim import build_dense_optimizer, dense_parameters
    from hybridrec.train.setup.tables import load_dataset

    model = build_model(cfg, load_dataset(cfg))
    dense = build_dense_optimizer(dense_parameters(model), cfg.optim)
    sparse = build_sparse_optimizers(cfg, model.sparse)
    load_state(path, model=model, dense_opt=dense, sparse_opts=list(sparse.optimizers.values()),
               topo=Topology.single())
    return _state(model, dense, sparse)


def _state(model, dense, sparse) -> dict:
    out = {f"model.{k}": v.detach().clone() for k, v in model.state_dict().items()}
    for i, s in dense.state_dict()["state"].items():
        out.update({f"dense_opt.{i}.{k}": torch.as_tensor(v).clone() for k, v in s.items()})
    for name, opt in sparse.state_dict().items():
        for t, states in opt["tables"].items():
            out.update({f"sparse_opt.{name}.{t}.{k}": v.clone() for k, v in states.items()})
    return out


def _newest(run):
    from hybridrec.train.checkpointing.checkpoint import latest_checkpoint

    return latest_checkpoint(run)


@pytest.mark.distributed  # (the world fixture trains a 2-rank run)
def test_one_process_starts_from_a_two_rank_run_with_its_optimizer_state(world, tmp_path):
    from hybridrec.train.build import build_trainer

    source = _checkpoint_state(_newest(world["two"]), _config(world["data"], tmp_path / "src"))
    cfg = _config(world["like"], tmp_path / "new", f"train.init_from={world['two']}",
                  "train.init_optimizer=true", "optim.dense_lr=0.01")
    trainer = build_trainer(cfg)
    got = _state(trainer.model, trainer.optim.dense, trainer.optim.sparse)
    assert got.keys() == source.keys() and any(k.startswith("sparse_opt.") for k in got)
    for k in source:
        assert torch.equal(got[k], source[k]), k
    # The state, not the hyper-parameters: the learning rate is this run's.
    assert all(g["lr"] == 0.01 for g in trainer.optim.dense.param_groups)
    record = json.loads((tmp_path / "new" / "init_from.json").read_text())
    assert record["source_step"] == 12 and record["optimizer"] and record["which"] == "latest"


@pytest.mark.distributed  # (the world fixture trains a 2-rank run)
def test_weights_only_leaves_the_optimizer_state_fresh(world, tmp_path):
    from hybridrec.train.build import build_trainer

    path = world["one"] / "checkpoints" / _newest(world["one"]).name  # RUN/checkpoints/step-N
    source = _checkpoint_state(path, _config(world["data"], tmp_path / "src"))
    trainer = build_trainer(_config(world["like"], tmp_path / "new", f"train.init_from={path}"))
    got = _state(trainer.model, trainer.optim.dense, trainer.optim.sparse)
    for k in (k for k in source if k.startswith("model.")):
        assert torch.equal(got[k], source[k]), k
    opt = [k for k in got if not k.startswith("model.")]
    assert any(source[k].count_nonzero() for k in opt)  # the source's state is not the initial one ...
    assert all(got[k].count_nonzero() == 0 for k in opt)  # ... and this run's is


@pytest.mark.distributed
def test_a_newest_checkpoint_that_fails_its_checks_is_skipped_for_the_older_one(world, tmp_path):
    import shutil

    from hybridrec.train.build import build_trainer
    from hybridrec.train.checkpointing.checkpoint import list_checkpoints

    run = tmp_path / "source"
    shutil.copytree(world["one"], run)
    (older, older_path), (_, newest) = list_checkpoints(run)
    data_file = next(newest.glob("*.distcp"))
    data_file.write_bytes(data_file.read_bytes()[:100])  # truncated
    source = _checkpoint_state(older_path, _config(world["data"], tmp_path / "src"))
    with pytest.warns(Warning, match=r"train.init_from: skipped the checkpoint .*step-00000012 .*truncated"):
        trainer = build_trainer(_config(world["like"], tmp_path / "new", f"train.init_from={run}"))
    got = _state(trainer.model, trainer.optim.dense, trainer.optim.sparse)
    assert all(torch.equal(got[k], source[k]) for k in source if k.startswith("model."))
    assert json.loads((tmp_path / "new" / "init_from.json").read_text())["source_step"] == older == 6


def _two_rank_worker(topo, data, run, source, out):
    from hybridrec.parallel.checkpoint import save_sharded
    from hybridrec.train.build import build_trainer

    cfg = _config(data, run, f"train.init_from={source}", "train.init_optimizer=true",
                  "dist.sharding=row_wise")
    trainer = build_trainer(cfg, topo=topo)
    o = trainer.optim
    save_sharded(out, model=trainer.model, dense_opt=o.dense, sparse_opts=list(o.sparse.optimizers.values()),
                 extra={"step": 0}, topo=topo)


@pytest.mark.distributed
@pytest.mark.parametrize("dataset", ["like", "grown"])
def test_two_ranks_start_from_a_one_process_run(world, tmp_path, dataset):
    """Row-wise shards on 2 ranks take a 1-process run's tables and row-wise Adagrad state;
    a grown dataset's tables keep the source's rows first and their new rows drawn."""
    out = tmp_path / "saved"
    run_ranks(_two_rank_worker, 2, str(world[dataset]), str(tmp_path / "new"), str(world["one"]), str(out),
              timeout_s=120)
    source = _checkpoint_state(_newest(world["one"]), _config(world["data"], tmp_path / "a"))
    got = _checkpoint_state(out, _config(world[dataset], tmp_path / "b"))
    grew = 0
    for k in source:
        a, b = source[k], got[k]
        if a.dim() == 0 or k.startswith("dense_opt."):
            assert torch.equal(a, b), k
            continue
        assert a.shape[1:] == b.shape[1:], k
        assert torch.equal(b[:a.shape[0]], a), k
        if b.shape[0] > a.shape[0]:
            grew += b.shape[0] - a.shape[0]
            if k.startswith("sparse_opt."):  # new rows: the optimizer's initial state
                assert b[a.shape[0]:].count_nonzero() == 0, k
            else:
                assert b[a.shape[0]:].count_nonzero() > 0, k  # drawn, not zero
    assert (grew > 0) == (dataset == "grown")


@pytest.mark.distributed  # (the world fixture trains a 2-rank run)
def test_cli_continues_on_a_new_day_and_resume_wins_over_init_from(world, tmp_path, capsys):
    run = tmp_path / "day2"
    # 2 ranks through the launcher, from the 1-process run.
    proc, summary = _train(world["like"], run, f"train.init_from={world['one']}", "train.init_optimizer=true",
                           "train.max_steps=5", "dist.nproc=2", "dist.sharding=row_wise", "data.batch_size=32")
    assert "starting from the weights and optimizer state of" in proc.stderr
    assert summary["step"] == 5 and summary["resumed_from"] is None  # its own steps, from 0
    assert summary["world_size"] == 2
    first = (run / "init_from.json").read_text()
    # Named again with more steps (1 process, the same global batch): it resumes its own
    # checkpoint; the source is not read again.
    _main("train", "--recipe", "demo", f"data.path={world['like']}", f"train.run_dir={run}", *SMALL,
          f"train.init_from={world['one']}", "train.init_optimizer=true", "train.max_steps=8")
    summary = json.loads((run / "summary.json").read_text())
    assert summary["resumed_from"] == 5 and summary["step"] == 8
    assert "starting from the weights" not in capsys.readouterr().err
    assert (run / "init_from.json").read_text() == first


@pytest.mark.distributed  # (the world fixture trains a 2-rank run)
def test_refusals_name_the_difference(world, tmp_path):
    from hybridrec.errors import ConfigError
    from hybridrec.train.build import build_trainer

    cfg = _config(world["like"], tmp_path / "a", f"train.init_from={world['one']}", "model.embedding_dim=4",
                  "model.bottom_mlp=16,4")
    with pytest.raises(ConfigError, match=r"holds another model than this run's: parameter "
                                          r"bottom\.layers\.1\.bias: 8 there, 4 here \(and \d+ more"):
        build_trainer(cfg)
    cfg = _config(world["like"], tmp_path / "b", f"train.init_from={world['one']}", "train.init_optimizer=true",
                  "optim.sparse=lazy_adam")
    with pytest.raises(ConfigError, match="trained with optim.sparse=rowwise_adagrad, this run has "
                                          "optim.sparse=lazy_adam"):
        build_trainer(cfg)
    with pytest.raises(ConfigError, match="neither a run directory"):
        build_trainer(_config(world["like"], tmp_path / "c", f"train.init_from={tmp_path / 'nothing'}"))
    with pytest.raises(ConfigError, match="train.init_optimizer=true needs train.init_from=RUN"):
        _config(world["like"], tmp_path / "d", "train.init_optimizer=true")
    # A table of another size, not grown by --grow: refused with its name and both shapes.
    day2 = world["data"].parent / "raw" / "day_2.tsv"
    _main("data", "preprocess", str(day2), "--out", str(tmp_path / "other"))
    with pytest.raises(ConfigError, match=r"table C\d+: \d+x8 there, \d+x8 here"):
        build_trainer(_config(tmp_path / "other", tmp_path / "e", f"train.init_from={world['one']}"))


# -- the README's "New days": five commands, in order ------------------------------------
def _readme_commands() -> tuple[list[str], list[str]]:
    """The README's "New days" section: the commands before the marker (making the days) and
    the five after it, each a shell line (continuations joined)."""
    import re
    from pathlib import Path

    text = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    section = text[text.index("\n## New days\n"):]
    section = section[:section.index("\n## ", 1)]
    before, marker, after = section.partition("<!-- new-days:")
    assert marker, "README: the five commands' marker is gone"

    def commands(part: str) -> list[str]:
        blocks = re.findall(r"```bash\n(.*?)```", part, flags=re.DOTALL)
        return [c.strip() for b in blocks for c in b.replace("\\\n", " ").splitlines() if c.strip()]

    return commands(before), commands(after)[:5]


def _argv(command: str, cwd) -> list[str]:
    """``command``'s words as bash expands them (braces, globs; its comment dropped)."""
    proc = subprocess.run(["bash", "-c", f"printf '%s\\0' {command}"], cwd=cwd, capture_output=True, text=True,
                          timeout=30, check=True)
    return proc.stdout.split("\0")[:-1]


@pytest.mark.slow
def test_readme_new_days_commands_run_in_order(tmp_path, monkeypatch):
    """Each command as the shell expands it, run by the `hybridrec` entry point's main() in
    this process (torch imported once, not six times)."""
    from hybridrec.cli.main import build_parser, main

    setup, five = _readme_commands()
    assert len(setup) == 1 and len(five) == 5
    assert [c.split()[:3] for c in five] == [["hybridrec", "data", "preprocess"], ["hybridrec", "train", "--recipe"],
                                             ["hybridrec", "data", "preprocess"], ["hybridrec", "train", "--recipe"],
                                             ["hybridrec", "predict", "runs/day-23"]]
    monkeypatch.chdir(tmp_path)
    commands = build_parser()._subparsers._group_actions[0].choices
    for command in [*setup, *five]:
        argv = _argv(command, tmp_path)
        assert argv[0] == "hybridrec", command
        if argv[1] == "predict" and "predict" not in commands:
            pytest.skip("`hybridrec predict` is not registered in this build: the fifth command is not run")
        assert main(argv[1:]) == 0, command
    continued = json.loads((tmp_path / "runs/day-23/summary.json").read_text())
    assert continued["step"] > 0 and continued["resumed_from"] is None
    record = json.loads((tmp_path / "runs/day-23/init_from.json").read_text())
    assert record["optimizer"] and "day-22" in record["checkpoint"]
    import pyarrow.parquet as pq

    scores = pq.read_table(tmp_path / "day-24.parquet")
    assert scores.num_rows == 2000 and "probability" in scores.column_names
