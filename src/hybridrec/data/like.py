"""New days with an existing dataset's ids: ``hybridrec data preprocess NEW... --like DATASET``.

A model trained on DATASET keeps training on the new data only if every id means the same
row: same tables (names, kinds, order, rows), same ids for the same raw keys, same dense
columns and transform. So the new inputs are encoded with DATASET's encoders, read back from
its ``meta.json`` (``preprocessing``) and ``vocab/``:

- modulo tables (``--table-size``): ``id = key % size`` with DATASET's sizes; every key
  has a row already.
- vocabulary tables (``--min-count``, or neither option): DATASET's vocabulary; a key it
  does not hold maps to id 0, as a rare key did when DATASET was made (``ids_unseen`` in
  the new dataset's ``preprocessing`` gives, per feature, the share of the new training
  values that did).
- dense values: DATASET's ``dense_transform``, per column, a ``standardize`` column's mean
  and std included (:mod:`hybridrec.data.dense`): the new days are not measured again, so
  the model sees their values as it saw DATASET's. A schema file's choices must allow
  DATASET's (``auto`` allows any).

``--grow`` (vocabulary tables only) appends rows instead for the keys of the new training
parts seen at least DATASET's ``min_count`` times there that DATASET's vocabulary lacks:
key ``vocab[i]`` still has id ``i + 1``, the new keys come after the old ones (ids
``V + 1 ...``), so every old id keeps its row and a table of V + 1 rows becomes one of
V + 1 + added rows. A model started from a run on DATASET (``train.init_from``) then
takes the old rows from that run and draws the new ones (:mod:`hybridrec.train.init_from`).
Modulo tables cannot grow: every key has a row there already.

The new dataset's ``preprocessing`` records ``like`` (DATASET's path) and, with
``--grow``, ``grown_rows`` per table; its ``vocab/`` is the (grown) vocabulary, so the
next day can be made ``--like`` it in turn. Its ``stats`` are the new data's own (they
are for the sharding planner).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from hybridrec.data import dense as dense_transforms
from hybridrec.data.chunk import check_on_bad_line
from hybridrec.data.criteo import CATEGORICAL, DENSE, CriteoReader
from hybridrec.data.encode import VocabEncoder
from hybridrec.data.inputs import check_inputs
from hybridrec.data.preprocess import PreprocessJob, load_encoders
from hybridrec.data.schema import DatasetMeta
from hybridrec.errors import ConfigError, DataError


@dataclass
class Like:
    """The encoders of an existing dataset, for :class:`~hybridrec.data.preprocess.PreprocessJob`."""

    meta: DatasetMeta
    mode: str  # "modulo" or "vocabulary"
    sizes: dict[str, int] | None  # the table sizes keys were reduced by (None: none)
    min_count: int | None
    grow: bool = False
    base: dict[str, Any] = field(default_factory=dict)  # feature -> DATASET's encoder
    grown: dict[str, int] = field(default_factory=dict)  # feature -> rows added
    _counts: dict[str, list[int]] = field(default_factory=dict)  # feature -> [present, unseen]

    @staticmethod
    def load(dataset: str | os.PathLike, *, grow: bool = False) -> Like:
        meta = DatasetMeta.load(dataset)
        pp, where = meta.preprocessing, meta.path / "meta.json"
        mode = pp.get("categorical")
        if mode not in ("modulo", "vocabulary"):
            raise DataError(f"{where}: preprocessing.categorical is {mode!r}, not modulo or vocabulary")
        sizes = pp.get("table_size")
        if sizes is not None and (not isinstance(sizes, dict) or set(sizes) != set(meta.feature_names)):
            raise DataError(f"{where}: preprocessing.table_size does not give one size per feature")
        if grow and mode == "modulo":
            raise ConfigError(f"--grow: {meta.path} maps ids modulo its table sizes (--table-size), so "
                              "every key has a row already; only vocabulary tables (--min-count) grow")
        like = Like(meta, mode, sizes, pp.get("min_count") if mode == "vocabulary" else None, grow)
        like.base = load_encoders(meta)
        for f in meta.schema.features:
            if like.base[f.name].num_embeddings != f.num_embeddings:
                raise DataError(f"{where}: feature {f.name} has {f.num_embeddings:,} rows but its "
                                f"encoder gives {like.base[f.name].num_embeddings:,}")
        return like

    def encoders(self, job) -> dict[str, Any]:
        """The encoders of the new dataset (``job``: its preprocessing run; with ``grow``
        its training inputs are counted first)."""
        if not self.grow:
            return dict(self.base)
        counted = job.count_keys(self.base)
        out = {}
        for name, enc in self.base.items():
            keys, counts = counted[name]
            new = keys[(counts >= self.min_count) & (keys >= 0) & (enc(keys) == 0)]
            self.grown[name] = int(new.size)
            out[name] = VocabEncoder(np.concatenate([enc.vocab, new]), enc.modulo) if new.size else enc
        return out

    def tally(self, chunk, features: Sequence[tuple[str, str]], onehot: np.ndarray, multihot: dict) -> None:
        """Count a training chunk's present keys and those that became id 0 (the vocabulary
        lacks them): ``ids_unseen``. (Modulo tables have a row for every key.)"""
        if self.mode == "modulo":
            return
        j = 0
        for name, kind in features:
            if kind == "onehot":
                keys, ids = chunk.onehot[:, j], onehot[:, j]
                j += 1
            else:
                keys, ids = chunk.multihot[name][0], multihot[name][0]
            seen = self._counts.setdefault(name, [0, 0])
            present = keys >= 0
            seen[0] += int(np.count_nonzero(present))
            seen[1] += int(np.count_nonzero(present & (ids == 0)))

    def noted(self) -> dict[str, Any]:
        """More entries for the new dataset's ``preprocessing``: ``like``, ``ids_unseen``
        (per feature, the share of the training parts' present values that became id 0
        because the vocabulary lacks their key; None for modulo tables) and, with
        ``grow``, ``grown_rows``."""
        unseen = None if self.mode == "modulo" else {
            n: round(bad / total, 6) if total else 0.0 for n, (total, bad) in self._counts.items()}
        return {"like": os.path.abspath(self.meta.path), "ids_unseen": unseen,
                **({"grown_rows": dict(self.grown)} if self.grow else {})}


def check_same_columns(like: DatasetMeta, label: str, dense: Sequence[str],
                       features: Sequence[tuple[str, str]], what: str) -> None:
    """The new inputs' columns must be ``like``'s, in its order (the model's inputs)."""
    s, where = like.schema, like.path
    mine = [(f.name, f.kind) for f in s.features]
    if (label, list(dense), list(features)) != (s.label, list(s.dense), mine):
        raise ConfigError(f"{what}: its columns are not those of {where} (label {label!r}, "
                          f"{len(dense)} dense, {len(features)} categorical here; label {s.label!r}, "
                          f"{len(s.dense)} dense, {len(mine)} categorical there, in the same order and kinds)")


def like_dense(like: DatasetMeta, spec: Any, what: str) -> list[dense_transforms.Column]:
    """``like``'s dense transforms, numbers included, for the new inputs (a schema's
    ``spec``: its choices must allow them; ``auto`` allows any); None for Criteo inputs
    (``log1p``, and ``like`` must have been made so)."""
    theirs_meta = like.preprocessing.get("dense_transform")
    theirs = dense_transforms.from_meta(theirs_meta, like.schema.dense, f"{like.path}/meta.json")
    plan = dense_transforms.parse("log1p", like.schema.dense, what) if spec is None else spec.dense_plan
    if not dense_transforms.agrees(plan, theirs):
        mine = "log1p" if spec is None else spec.dense_transform
        raise ConfigError(f"{what}: dense_transform {mine!r}, but {like.path} was made with {theirs_meta!r}")
    return theirs


def preprocess_like(
    inputs: Sequence[str | os.PathLike],
    out: str | os.PathLike,
    *,
    like: str | os.PathLike,
    fmt: str = "criteo",
    schema_path: str | os.PathLike | None = None,
    grow: bool = False,
    on_bad_line: str = "error",
    eval_parts: Sequence[int | str] | str | None = None,
    overwrite: bool = False,
    progress: bool | None = None,
) -> DatasetMeta:
    """New raw files -> a dataset at ``out`` whose ids, tables and dense transform are those
    of the dataset ``like`` (see the module docstring). ``fmt``: ``criteo``, ``csv`` or
    ``parquet`` (the latter two read with ``schema_path``, whose columns must be ``like``'s;
    its table_size and min_count are not used). Returns the new dataset's meta; with
    ``grow``, ``preprocessing["grown_rows"]`` says how many rows each table gained."""
    from hybridrec.data.tabular import CsvReader, ParquetReader, TabularSpec

    ref = Like.load(like, grow=grow)
    s = ref.meta.schema
    check_on_bad_line(on_bad_line)
    label_map = None
    if fmt == "criteo":
        if schema_path:
            raise ConfigError("--schema is for --format csv/parquet (Criteo's layout is fixed)")
        if s.dense != list(DENSE) or s.feature_names != list(CATEGORICAL):
            raise ConfigError(f"--like {ref.meta.path}: it was not made from Criteo files; give "
                              "--format csv or parquet and the --schema it was made with")
        multi = tuple(f.name for f in s.multihot)
        reader: Any = CriteoReader(multihot=multi, on_bad_line=on_bad_line)
        features = [(f.name, f.kind) for f in s.features]
        check_same_columns(ref.meta, "label", DENSE, features, "Criteo inputs")
        like_dense(ref.meta, None, "Criteo inputs")
        transform = "log1p"
    elif fmt in ("csv", "parquet"):
        if not schema_path:
            raise ConfigError(f"--format {fmt} needs --schema FILE (the one {ref.meta.path} was made with)")
        spec = TabularSpec.load(schema_path)
        reader = (CsvReader if fmt == "csv" else ParquetReader)(spec=spec, on_bad_line=on_bad_line)
        features = [(n, "onehot") for n in spec.categorical] + [(n, "multihot") for n in spec.multihot]
        check_same_columns(ref.meta, spec.label, spec.dense, features, str(schema_path))
        spec.dense_columns = like_dense(ref.meta, spec, str(schema_path))
        transform = dense_transforms.to_meta(spec.dense_columns, spec.dense)
        label_map = spec.label_map
    else:
        raise ConfigError(f"format {fmt!r}: expected criteo, csv or parquet")
    job = PreprocessJob(inputs=check_inputs(list(inputs)), out=Path(out), reader=reader, label=s.label,
               label_map=label_map, dense=list(s.dense), features=features, table_size=None,
               min_count=None, dense_transform=transform, eval_parts=eval_parts,
               overwrite=overwrite, progress=progress, like=ref)
    meta = job.run()
    return meta
