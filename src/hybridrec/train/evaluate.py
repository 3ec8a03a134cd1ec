"""A trained run read back: its config (config.json), its single-process model with the
weights of one of its checkpoints (whatever world size saved it), and an evaluation of
that checkpoint on the held-out split (``hybridrec eval``)."""

from __future__ import annotations

import dataclasses
import json
import warnings
from pathlib import Path

import numpy as np

from hybridrec.data.schema import DatasetMeta
from hybridrec.errors import ConfigError
from hybridrec.files import write_json_atomic
from hybridrec.parallel.checkpoint_io import CheckpointError
from hybridrec.parallel.topology import Topology
from hybridrec.train.backends import stored_backend
from hybridrec.train.build import build_loaders, build_model
from hybridrec.train.checkpointing import checkpoint as ckpt
from hybridrec.train.loop.early_stop import resolve_checkpoint
from hybridrec.train.loop.step import evaluate_model
from hybridrec.train.setup.config import Config, apply_dict
from hybridrec.train.setup.configure import replace, validate
from hybridrec.train.setup.tables import load_dataset


def load_run_config(run_dir: str | Path) -> Config:
    path = Path(run_dir) / "config.json"
    if not path.is_file():
        raise ConfigError(f"{run_dir} is not a run directory (no config.json)")
    try:
        data = json.loads(path.read_text())
    except ValueError as e:
        raise ConfigError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: not a config (a JSON object of sections)")
    cfg = Config()
    apply_dict(cfg, data, source=str(path))
    validate(cfg)
    return cfg


def load_run_model(run_dir: str | Path, *, checkpoint: str | None = None,
                   data_path: str | None = None):
    """A run's single-process model with the weights of one of its checkpoints, whatever
    world size saved it: ``checkpoint`` is ``"best"`` (the best evaluation's, kept by
    ``train.early_stop``), ``"latest"`` (the newest), a checkpoint directory, or None: the
    best one when the run recorded one, else the newest. With ``"latest"`` or None, one
    that fails its checks (truncated, unreadable, another model) is skipped with a warning
    and the next older one that loads is used (nothing is renamed); when none loads, one
    error says why each failed. Returns ``(cfg, meta, model, path, extra)`` (``extra``: the checkpoint's global state: step, loader position)."""
    cfg = load_run_config(run_dir)
    if data_path:
        cfg = replace(cfg, {"data.path": data_path})
    meta = load_dataset(cfg)
    path, _ = resolve_checkpoint(run_dir, checkpoint)
    if path is None:
        raise ConfigError(f"{run_dir} has no checkpoint to evaluate")
    model = build_model(cfg, meta)
    candidates = [path]
    if checkpoint in (None, "latest"):  # a named one (best, DIR) is that one or an error
        candidates += [p for _, p in reversed(ckpt.list_checkpoints(run_dir)) if p != path]
    path, extra, skipped = ckpt.load_newest(candidates, lambda p: _load_weights(p, model), Topology.single())
    for bad, why in skipped:  # (left in place: evaluating changes no checkpoint)
        warnings.warn(f"evaluating: skipped the checkpoint {bad} ({why}); using {path.name}", stacklevel=2)
    return cfg, with_key_maps(meta, extra, path), model, path, extra


def with_key_maps(meta: DatasetMeta, extra: dict, path: Path) -> DatasetMeta:
    """A dynamic-table run's dataset as the vocabulary its checkpoint ``path`` maps raw keys
    with: each table's key by row (row 0 shared: missing and not admitted keys), so
    ``key -> row`` is the vocabulary encoding's ``vocab[i] -> i + 1``. Other runs' as it is."""
    if meta.preprocessing.get("categorical") != "dynamic":
        return meta
    maps = (extra.get("keymaps") or {}).get("tables")
    if not maps:
        raise CheckpointError(f"{path}: a dynamic-table run's checkpoint without its key maps")
    vocab = {f: np.asarray(maps[f]["row_key"])[1:].astype(np.int64) for f in meta.feature_names}
    pre = {**meta.preprocessing, "categorical": "vocabulary", "table_size": None, "dynamic": True}
    return dataclasses.replace(meta, preprocessing=pre, vocab=vocab)


def _load_weights(path: Path, model) -> dict:
    """The weights of the checkpoint ``path`` into ``model`` (one process), read by the
    backend that wrote it (a parameter-server run's tables are in the servers' part); its
    ``extra``."""
    return stored_backend(path).load_weights(path, model)


def evaluate_run(run_dir: str | Path, *, checkpoint: str | None = None,
                 data_path: str | None = None, show=None, out: str | Path | None = None) -> dict:
    """Evaluate one of a run's checkpoints (``checkpoint`` as :func:`load_run_model`: by
    default the best one when ``train.early_stop`` recorded one, else the newest) on the
    held-out split; the result goes to ``show`` (when given) before it is written to
    ``out`` (default RUN/eval.json), so metrics a read-only or full run directory cannot
    take are still seen."""
    resolved, which = resolve_checkpoint(run_dir, checkpoint)
    cfg, meta, model, path, extra = load_run_model(run_dir, checkpoint=checkpoint, data_path=data_path)
    if path != resolved:  # that one failed its checks; an older one was evaluated
        which = "fallback"
    _, eval_loader = build_loaders(cfg, meta)
    result = {"checkpoint": str(path), "which": which, "step": extra.get("step"), "data": str(meta.path),
              **evaluate_model(model, eval_loader)}
    if show is not None:
        show(result)
    write_json_atomic(Path(out) if out is not None else Path(run_dir) / "eval.json", result)
    return result
