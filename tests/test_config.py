"""Typed config: files, overrides, recipes, clear errors naming the key."""

import json
import os
import re
from pathlib import Path

import pytest
import tomllib

from hybridrec.cli.main import main
from hybridrec.errors import ConfigError
from hybridrec.parallel.cost_model import OPTIMIZERS
from hybridrec.train.loop.optim import LRSchedule
from hybridrec.train.setup import recipes
from hybridrec.train.setup.config import PATH_KEYS, SECTIONS, describe
from hybridrec.train.setup.configure import build_config


def test_defaults_recipe_file_override_precedence(tmp_path):
    f = tmp_path / "c.toml"
    f.write_text('[optim]\ndense_lr = 0.5\nsparse = "lazy_adam"\n[data]\nbatch_size = 64\n')
    cfg = build_config(recipes.recipe("criteo-kaggle"), [str(f)], ["optim.dense_lr=0.25"])
    assert cfg.model.bottom_mlp == [512, 256, 64, 16]  # recipe
    assert cfg.optim.sparse == "lazy_adam" and cfg.data.batch_size == 64  # file
    assert cfg.optim.dense_lr == 0.25  # override wins


def test_value_parsing():
    cfg = build_config(overrides=["model.bottom_mlp=[32,16]", "model.top_mlp=8,1", "train.progress=off",
                                  "data.shuffle_window=1_000"])
    assert cfg.model.bottom_mlp == [32, 16] and cfg.model.top_mlp == [8, 1]
    assert cfg.train.progress is False and cfg.data.shuffle_window == 1000


@pytest.mark.parametrize("override, message", [
    ("optim.dense_lrr=1", "unknown config key 'optim.dense_lrr' (did you mean 'dense_lr'?)"),
    ("optm.dense_lr=1", "unknown config section 'optm'"),
    ("data.batch_size=big", "config key 'data.batch_size': 'big' is not a valid int"),
    ("train.progress=maybe", "config key 'train.progress'"),
    ("model.bottom_mlp=a,b", "config key 'model.bottom_mlp'"),
    ("optim.sparse=adamw", "optim.sparse 'adamw'"),
    ("dense_lr=1", "expected SECTION.NAME"),
    ("optim.dense_lr", "expected KEY=VALUE"),
    ("model.embedding_dim=8", "model.bottom_mlp must end in model.embedding_dim (8)"),
])
def test_bad_config_names_the_key(override, message):
    with pytest.raises(ConfigError) as e:
        build_config(overrides=[override])
    assert message in str(e.value)


@pytest.mark.parametrize("overrides, message", [
    (["model.bottom_mlp=512,0,16"], ("model.bottom_mlp: every width must be a positive integer, got 0 "
                                     "(entry 2 of 512,0,16)")),
    (["model.bottom_mlp=-3"], "model.bottom_mlp: every width must be a positive integer, got -3 (entry 1 of -3)"),
    (["model.top_mlp=64,-1,1"], "model.top_mlp: every width must be a positive integer, got -1 (entry 2 of 64,-1,1)"),
    (["model.embedding_dim=0", "model.bottom_mlp=8,0"], "model.embedding_dim must be a positive integer, got 0"),
])
def test_a_layer_width_below_one_is_one_line_naming_the_key(overrides, message, capsys):
    """Widths of 0 or below are refused by the config, before any layer is built, in the
    command's one error line (they ended in a traceback from the model)."""
    assert main(["train", "--recipe", "demo", *overrides, "--print-config"]) != 0
    err = capsys.readouterr().err
    assert err.strip() == f"hybridrec: error: {message}", err


def test_bad_file(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        build_config(files=[str(tmp_path / "nope.toml")])
    f = tmp_path / "bad.toml"
    f.write_text("[train]\nepochz = 3\n")
    with pytest.raises(ConfigError, match=r"bad.toml: unknown config key 'train.epochz'"):
        build_config(files=[str(f)])
    f.write_text("[train]\nepochs = 'three'\n")
    with pytest.raises(ConfigError, match="train.epochs"):
        build_config(files=[str(f)])


def test_unknown_recipe():
    with pytest.raises(ConfigError, match="unknown recipe"):
        recipes.recipe("nope")


def test_every_recipe_validates():
    for name in recipes.RECIPES:
        build_config(recipes.recipe(name))


def test_describe_lists_keys_with_docs():
    text = describe()
    assert "optim.sparse_lr = 0.05  (float) Embedding learning rate" in text


def test_lr_schedule():
    s = LRSchedule(warmup_steps=4, decay="linear", decay_start=0, total_steps=12)
    assert [s.factor(i) for i in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert s.factor(8) == pytest.approx(0.5) and s.factor(12) == 0.0
    c = LRSchedule(warmup_steps=0, decay="cosine", decay_start=2, total_steps=6)
    assert c.factor(1) == 1.0 and c.factor(4) == pytest.approx(0.5) and c.factor(6) == pytest.approx(0.0)
    assert LRSchedule(0, "none", 0, 10).factor(9) == 1.0


def test_sparse_optimizer_names_are_one_list():
    """cost_model.OPTIMIZERS is the list: the registry builds exactly those, the config
    accepts exactly those (and documents each)."""
    from hybridrec.train.loop.sparse_optim import SPARSE_OPTIMIZERS

    assert len(set(OPTIMIZERS)) == len(OPTIMIZERS)
    assert set(SPARSE_OPTIMIZERS) == set(OPTIMIZERS)
    doc = next(line for line in describe().splitlines() if line.strip().startswith("optim.sparse ="))
    for name in OPTIMIZERS:
        assert build_config(overrides=[f"optim.sparse={name}"]).optim.sparse == name
        assert f"``{name}``" in doc, (name, doc)
    with pytest.raises(ConfigError, match="optim.sparse 'adagrad': " + ", ".join(OPTIMIZERS[:-1])):
        build_config(overrides=["optim.sparse=adagrad"])


def test_relative_paths_in_a_file_are_relative_to_the_file(tmp_path, monkeypatch):
    conf = tmp_path / "conf"
    conf.mkdir()
    (conf / "a.toml").write_text('[data]\npath = "../conf/../data/pre"\n[train]\nrun_dir = "runs/x"\n'
                                 f'[dist]\nplan = "{tmp_path / "plan.json"}"\n')
    (conf / "b.json").write_text(json.dumps({"dist": {"plan": "plans/p.json"}}))
    elsewhere = tmp_path / "elsewhere" / "deeper"
    elsewhere.mkdir(parents=True)
    monkeypatch.chdir(elsewhere)
    cfg = build_config(files=["../../conf/a.toml"])
    assert Path(cfg.data.path).resolve() == tmp_path / "data" / "pre"
    assert Path(cfg.train.run_dir).resolve() == conf / "runs" / "x"
    assert cfg.dist.plan == str(tmp_path / "plan.json")  # absolute: as written
    assert Path(build_config(files=[str(conf / "b.json")]).dist.plan) == conf / "plans" / "p.json"
    # The command line's paths stay relative to the working directory.
    cfg = build_config(files=["../../conf/a.toml"], overrides=["data.path=mine", "train.run_dir=runs/y"])
    assert (cfg.data.path, cfg.train.run_dir) == ("mine", "runs/y")
    assert set(PATH_KEYS) == {"data.path", "data.stream", "data.stream_schema", "dist.plan",
                              "train.run_dir"}


def _readme_config() -> tuple[str, str]:
    """The README's example config file (its one ```toml block) and the command after it."""
    text = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    (block,) = re.findall(r"^```toml\n(.*?)^```\n", text, re.MULTILINE | re.DOTALL)
    command = re.search(r"```toml\n.*?^```\n\s*`(hybridrec train --config [^`]*)`", text,
                        re.MULTILINE | re.DOTALL)[1]
    return block, command


def test_the_readme_config_file_loads_as_it_says(tmp_path, monkeypatch, capsys):
    """The README's example, through the command line it shows (``--print-config``): every
    key it sets takes its value, its paths are relative to the file, and the command line's
    KEY=VALUE wins."""
    block, command = _readme_config()
    name, *overrides = command.removeprefix("hybridrec train --config ").split()
    assert overrides, command  # (the KEY=VALUE checked below)
    (tmp_path / "conf").mkdir()
    (tmp_path / "conf" / name).write_text(block)
    monkeypatch.chdir(tmp_path)
    assert main(["train", "--config", f"conf/{name}", *overrides, "--print-config"]) == 0
    printed = json.loads(capsys.readouterr().out)
    written = tomllib.loads(block)
    assert 6 <= sum(len(v) for v in written.values()) <= 10 and set(written) <= set(SECTIONS)
    for section, values in written.items():
        for key, value in values.items():
            want = os.path.join("conf", value) if f"{section}.{key}" in PATH_KEYS else value
            assert printed[section][key] == want, (section, key)
    for item in overrides:
        (section, key), value = item.split("=")[0].split("."), item.split("=")[1]
        assert str(printed[section][key]) == value


def test_a_warm_up_longer_than_half_the_run_is_warned_of():
    from hybridrec.train.build import warmup_problem

    assert warmup_problem(50, 100) is None and warmup_problem(0, 10) is None and warmup_problem(50, 0) is None
    assert warmup_problem(100, 48) == (
        "optim.warmup_steps=100 is 208% of this run's 48 steps: the learning rates never reach their peak; "
        "on a small dataset set a shorter warm-up (optim.warmup_steps=N) or more train.epochs")
    assert "reach their peak only in its second half" in warmup_problem(50, 96)
