"""Configs made, changed and checked: where the config (:mod:`~hybridrec.train.setup.config`:
its types, files and ``key=value`` overrides) meets its rules
(:mod:`~hybridrec.train.setup.rules`). Every config a run uses passes :func:`validate`, and
is read-only from then on; config.py itself knows no rule.
"""

from __future__ import annotations

import copy

from hybridrec.train.setup.config import Config, apply_dict, load_file, parse_overrides, set_value
from hybridrec.train.setup.rules import check_config


def validate(cfg: Config) -> None:
    """The rules of the config alone (:func:`~hybridrec.train.setup.rules.check_config`): the
    first one broken is a ConfigError with its one line. A valid config is read-only from
    then on."""
    check_config(cfg)
    cfg.seal()


def build_config(base: dict | None = None, files: list[str] = (), overrides: list[str] = ()) -> Config:
    """Defaults, then ``base`` (a recipe), then each file, then ``key=value`` overrides;
    validated."""
    cfg = Config()
    if base:
        apply_dict(cfg, base, source="recipe")
    for f in files:
        apply_dict(cfg, load_file(f), source=str(f))
    for k, v in parse_overrides(list(overrides)):
        set_value(cfg, k, v)
    validate(cfg)
    return cfg


def replace(cfg: Config, changes: dict) -> Config:
    """A validated, read-only copy of ``cfg`` with ``changes`` (``{"SECTION.KEY": value}``)
    applied."""
    new = copy.deepcopy(cfg).seal(False)
    for key, value in changes.items():
        set_value(new, key, value)
    validate(new)
    return new
