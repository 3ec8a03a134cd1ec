"""The Python API: ``hybridrec.load(run_dir)`` and ``hybridrec.train(config, **overrides)``.

``load`` gives a :class:`Model`: ``predict`` takes raw rows in memory (a pandas DataFrame,
a pyarrow Table or a dict of column arrays, in the columns of the run's raw data) and
returns one float32 probability per row; it is :class:`~hybridrec.serve.predict.Predictor`,
what ``hybridrec predict`` runs on files. ``train`` trains one run in this process, as
``hybridrec train`` does with one process, and returns a :class:`Run`.

Overrides are keyword arguments ``SECTION__KEY=value`` (two underscores), the keys of
``hybridrec train SECTION.KEY=VALUE`` (``hybridrec train --list-keys``)::

    run = hybridrec.train("conf/small.toml", data__batch_size=256, train__max_steps=100)

Several processes (``dist.nproc > 1``, parameter servers) need the launcher of
``hybridrec train``; ``train`` refuses them in one line.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np

from hybridrec.errors import ConfigError


class Model:
    """A trained run's model, ready for raw rows (see :func:`load`)."""

    def __init__(self, run_dir: Path, predictor) -> None:
        self.run_dir = run_dir
        self._predictor = predictor

    @property
    def config(self):
        """The run's :class:`~hybridrec.train.setup.config.Config` (its config.json)."""
        return self._predictor.cfg

    @property
    def summary(self) -> dict | None:
        """The run's summary.json (None when the run has not finished)."""
        try:
            data = json.loads((self.run_dir / "summary.json").read_text())
        except (OSError, ValueError):
            return None
        return data if isinstance(data, dict) else None

    @property
    def metrics(self) -> dict:
        """The run's final held-out evaluation (summary.json's ``eval``: auc, log_loss, ne,
        calibration, accuracy, count); empty when the run has none."""
        return dict((self.summary or {}).get("eval") or {})

    @property
    def torch_module(self):
        """The eager ``torch.nn.Module`` (in eval mode, on :attr:`device`)."""
        return self._predictor.model

    @property
    def checkpoint(self) -> Path:
        """The checkpoint directory whose weights were loaded."""
        return self._predictor.checkpoint

    @property
    def device(self):
        return self._predictor.device

    def predict(self, data: Any) -> np.ndarray:
        """float32 probabilities, one per row of ``data`` (a pandas DataFrame, pyarrow Table
        or dict of column arrays with the raw columns; a label column is ignored)."""
        return self._predictor.predict_table(data)

    def predict_files(self, inputs, out, **options) -> dict:
        """``hybridrec predict RUN INPUT... --out OUT`` (options: ``keep``, ``on_bad_line``,
        ``progress``); returns its report."""
        from hybridrec.serve.predict import predict_files

        return predict_files(self._predictor, inputs, out, **options)

    def __repr__(self) -> str:
        return f"Model({str(self.run_dir)!r}, checkpoint={self.checkpoint.name!r}, device={self.device})"


def load(run_dir: str | os.PathLike, checkpoint: str | None = None, *, device=None,
         batch_size: int | None = None) -> Model:
    """A run's model: ``checkpoint`` ``"best"``, ``"latest"``, a checkpoint directory, or
    None (the best when the run recorded one, else the newest), whatever world size saved
    it; ``device`` default the GPU when there is one; ``batch_size`` rows per forward
    (default the run's ``data.eval_batch_size``). The run's dataset directory must still
    be there: its vocabulary maps raw values to ids."""
    from hybridrec.serve.predict import Predictor

    predictor = Predictor.load(run_dir, checkpoint=checkpoint, device=device, batch_size=batch_size)
    return Model(Path(run_dir).absolute(), predictor)


class Run:
    """A trained run: its directory, summary and metrics."""

    def __init__(self, run_dir: Path, summary: dict) -> None:
        self.run_dir = run_dir
        self.summary = summary

    @property
    def metrics(self) -> dict:
        """The final held-out evaluation (summary.json's ``eval``)."""
        return dict(self.summary.get("eval") or {})

    def load(self, checkpoint: str | None = None, **options) -> Model:
        """:func:`load` of this run."""
        return load(self.run_dir, checkpoint, **options)

    def __repr__(self) -> str:
        return f"Run({str(self.run_dir)!r}, auc={self.metrics.get('auc')})"


def build_config(config: str | os.PathLike | dict | None = None, *, recipe: str | None = None,
                 **overrides):
    """The Config of ``hybridrec train [--recipe R] [--config FILE] KEY=VALUE...``:
    defaults, the recipe, ``config`` (a TOML/JSON file, its relative paths relative to it,
    or a dict of sections as such a file holds, relative paths relative to the working
    directory), then ``SECTION__KEY=value`` overrides; validated."""
    from hybridrec.train.setup import recipes
    from hybridrec.train.setup.config import Config, apply_dict, load_file, set_value
    from hybridrec.train.setup.configure import validate

    cfg = Config()
    if recipe:
        apply_dict(cfg, recipes.recipe(recipe), source="recipe")
    if isinstance(config, dict):
        apply_dict(cfg, config, source="config")
    elif config is not None:
        apply_dict(cfg, load_file(config), source=str(config))
    for key, value in overrides.items():
        section, sep, name = key.partition("__")
        if not sep:
            raise ConfigError(f"override {key}={value!r}: write SECTION__KEY=value "
                              "(e.g. data__batch_size=256)")
        set_value(cfg, f"{section}.{name}", value)
    validate(cfg)
    return cfg


def train(config: str | os.PathLike | dict | None = None, /, *, recipe: str | None = None,
          **overrides) -> Run:
    """Train one run in this process and return it (see the module docstring). A run
    directory that holds this run resumes it, as ``hybridrec train`` does."""
    from hybridrec.train.run import train as train_run

    cfg = build_config(config, recipe=recipe, **overrides)
    if cfg.dist.nproc > 1 or cfg.dist.num_ps or cfg.dist.nnodes > 1:
        raise ConfigError("hybridrec.train runs one process; several ranks or parameter servers "
                          "(dist.nproc, dist.num_ps, dist.nnodes) need `hybridrec train`")
    from hybridrec.serve.publisher import publisher_parts

    summary = train_run(cfg, extra_parts=publisher_parts(cfg))  # (its config: absolute paths, the run directory chosen)
    return Run(Path(summary["config"]["train"]["run_dir"]), summary)
