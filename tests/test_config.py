"""Typed config: files, overrides, recipes, clear errors naming the key."""

import pytest

from hybridrec.errors import ConfigError
from hybridrec.parallel.cost_model import OPTIMIZERS
from hybridrec.train import recipes
from hybridrec.train.config import build_config, describe
from hybridrec.train.optim import LRSchedule


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
    from hybridrec.train.sparse_optim import SPARSE_OPTIMIZERS

    assert len(set(OPTIMIZERS)) == len(OPTIMIZERS)
    assert set(SPARSE_OPTIMIZERS) == set(OPTIMIZERS)
    doc = next(line for line in describe().splitlines() if line.strip().startswith("optim.sparse ="))
    for name in OPTIMIZERS:
        assert build_config(overrides=[f"optim.sparse={name}"]).optim.sparse == name
        assert f"``{name}``" in doc, (name, doc)
    with pytest.raises(ConfigError, match="optim.sparse 'adagrad': " + ", ".join(OPTIMIZERS[:-1])):
        build_config(overrides=["optim.sparse=adagrad"])
