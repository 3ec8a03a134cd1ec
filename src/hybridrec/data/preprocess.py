"""Raw click logs -> a preprocessed dataset directory (docs/data-format.md).

One part per input file, in order. Everything is written into ``OUT.tmp-<pid>``,
fsynced and renamed to ``OUT`` only when complete (``meta.json`` last), so an interrupted
run leaves nothing that looks like a dataset; on failure the tmp dir is removed (an
earlier dataset at ``OUT`` stays as it was), and what a killed run left (its process
gone) is removed by the next run, with a warning (:mod:`hybridrec.data.outputs`).

``OUT`` may not be an input, hold one, or be the ``--like`` dataset (refused before anything
is written); ``--overwrite`` replaces only a hybridrec dataset: a ``meta.json`` as this module
writes it and the files of one (:func:`dataset_in_the_way`), nothing else.

With a vocabulary (``min_count``) there are two passes over the training inputs:
count keys first, then write; a CSV/Parquet schema whose dense transform is left to the
values (``auto``, ``standardize``: :mod:`hybridrec.data.dense`) adds one over the training
inputs before writing. Statistics (for the sharding planner, and the dense columns') are over
the train split.
"""

from __future__ import annotations

import copy
import json
import os
import re
import shutil
import sys
import time
import warnings
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from hybridrec.data import dense as dense_transforms
from hybridrec.data.chunk import ParseReport, RowChunk, check_on_bad_line
from hybridrec.data.criteo import CATEGORICAL, DENSE, CriteoReader
from hybridrec.data.encode import KeyCounter, ModuloEncoder, VocabEncoder, resolve_table_sizes
from hybridrec.data.inputs import check_inputs
from hybridrec.data.outputs import refuse_over_inputs, replace_dir, unknown_entry
from hybridrec.data.schema import DatasetMeta, FeatureSpec, PartInfo, Schema
from hybridrec.data.shards import FeatureStats, PartWriter, clear_stale_tmp, tmp_path
from hybridrec.data.tabular import CsvReader, ParquetReader, TabularSpec
from hybridrec.errors import ConfigError, DataError, HybridrecWarning

Encoder = ModuloEncoder | VocabEncoder


def preprocess_criteo(
    inputs: Sequence[str | os.PathLike],
    out: str | os.PathLike,
    *,
    table_size: Any = None,
    min_count: int | None = None,
    on_bad_line: str = "error",
    multi_hot_fields: Iterable[str] | str = (),
    eval_parts: Sequence[int | str] | str | None = None,
    overwrite: bool = False,
    progress: bool | None = None,
) -> DatasetMeta:
    """Criteo TSV files (plain or .gz, one per day) -> dataset at ``out``.

    Args:
        table_size: ids = hex % size; an int, ``{name: size, "*": default}``, a list of 26,
            or a CLI string (see :func:`~hybridrec.data.encode.resolve_table_sizes`).
        min_count: vocabulary of keys seen >= K times in the train parts (others -> 0).
            With neither, an exact vocabulary (min_count=1).
        on_bad_line: "error" (raise DataError naming file:line and field) or "skip" (count).
        multi_hot_fields: C-fields holding comma-separated id lists ("all" for every one).
        eval_parts: parts held out (indices, part names or input file names); default the
            last input; ``[]`` for none.
        overwrite: replace an existing dataset at ``out``.
        progress: tqdm progress bar; default on when stderr is a terminal.
    """
    multi = _multihot_names(multi_hot_fields, CATEGORICAL)
    reader = CriteoReader(multihot=tuple(multi), on_bad_line=check_on_bad_line(on_bad_line))
    features = [(n, "multihot" if n in multi else "onehot") for n in CATEGORICAL]
    job = PreprocessJob(
        inputs=check_inputs(list(inputs)),
        out=Path(out),
        reader=reader,
        label="label",
        dense=list(DENSE),
        features=features,
        table_size=table_size,
        min_count=min_count,
        dense_transform="log1p",
        eval_parts=eval_parts,
        overwrite=overwrite,
        progress=progress,
    )
    return job.run()


def preprocess_tabular(
    inputs: Sequence[str | os.PathLike],
    out: str | os.PathLike,
    *,
    schema_path: str | os.PathLike,
    fmt: str | None = None,
    table_size: Any = None,
    min_count: int | None = None,
    on_bad_line: str = "error",
    eval_parts: Sequence[int | str] | str | None = None,
    overwrite: bool = False,
    progress: bool | None = None,
) -> DatasetMeta:
    """CSV or Parquet files with a declared schema (see :mod:`hybridrec.data.tabular`).

    ``fmt``: "csv" or "parquet" (default: from the first input's suffix). ``table_size``
    and ``min_count`` override the schema file's. Other arguments as :func:`preprocess_criteo`.
    """
    spec = TabularSpec.load(schema_path)
    paths = check_inputs(list(inputs))
    fmt = fmt or ("parquet" if paths[0].suffix in (".parquet", ".pq") else "csv")
    check_on_bad_line(on_bad_line)
    if fmt == "csv":
        reader: Any = CsvReader(spec=spec, on_bad_line=on_bad_line)
    elif fmt == "parquet":
        reader = ParquetReader(spec=spec, on_bad_line=on_bad_line)
    else:
        raise ConfigError(f"format {fmt!r}: expected criteo, csv or parquet")
    features = [(n, "onehot") for n in spec.categorical] + [(n, "multihot") for n in spec.multihot]
    job = PreprocessJob(
        inputs=paths,
        out=Path(out),
        reader=reader,
        label=spec.label,
        label_map=spec.label_map,
        dense=list(spec.dense),
        features=features,
        table_size=table_size if table_size is not None else spec.table_size,
        min_count=min_count if min_count is not None else spec.min_count,
        dense_transform=spec.dense_transform,
        eval_parts=eval_parts,
        overwrite=overwrite,
        progress=progress,
    )
    return job.run()


def _multihot_names(fields: Iterable[str] | str, names: Sequence[str]) -> list[str]:
    if isinstance(fields, str):
        fields = names if fields.strip() == "all" else [f for f in fields.split(",") if f.strip()]
    fields = [f.strip() for f in fields]
    unknown = sorted(set(fields) - set(names))
    if unknown:
        raise ConfigError(f"multi-hot fields {unknown} are not among the features {list(names)}")
    return [n for n in names if n in fields]


def _eval_part_indices(eval_parts, inputs: list[Path]) -> list[int]:
    """Which parts are eval: ints (negative from the end), ``part-XXXXX`` or input paths."""
    n = len(inputs)
    if eval_parts is None:
        return [n - 1] if n > 1 else []  # a single input is all training data
    if isinstance(eval_parts, str):
        eval_parts = [] if eval_parts.strip() in ("", "none") else eval_parts.split(",")
    out = []
    for item in eval_parts:
        s = str(item).strip()
        if s.lstrip("-").isdigit():
            i = int(s)
            if not -n <= i < n:
                raise ConfigError(f"eval part {i}: only {n} inputs")
            out.append(i % n)
        elif s.startswith("part-") and s[5:].isdigit() and int(s[5:]) < n:
            out.append(int(s[5:]))
        else:
            hits = [i for i, p in enumerate(inputs) if s in (str(p), p.name)]
            if not hits:
                raise ConfigError(f"eval part {s!r}: not an input index, part name or input file")
            out.extend(hits)
    return sorted(set(out))


@dataclass(kw_only=True)
class PreprocessJob:
    """One preprocessing run (the arguments of preprocess_criteo / preprocess_tabular)."""

    inputs: list[Path]
    out: Path
    reader: Any
    label: str
    dense: list[str]
    features: list[tuple[str, str]]
    table_size: Any
    min_count: int | None
    dense_transform: Any
    """meta.json's ``dense_transform`` (a CSV/Parquet reader's: from its spec, the choices
    left to the values made by :meth:`_dense_columns`)."""
    eval_parts: Any
    overwrite: bool
    progress: bool | None
    label_map: dict[str, Any] | None = None
    """How raw label values became 0/1 (the schema file's label_positive/negative or
    label_threshold); None: they were 0/1."""
    like: Any = None
    """``preprocess --like``: a :class:`~hybridrec.data.like.Like` that gives the encoders
    (an existing dataset's vocabulary and table sizes) and more ``preprocessing`` entries;
    None: the encoders are made from these inputs."""

    def run(self) -> DatasetMeta:
        start = time.perf_counter()
        self._check_out()
        eval_idx = _eval_part_indices(self.eval_parts, self.inputs)
        self.part_names = [f"part-{i:05d}" for i in range(len(self.inputs))]
        self.train_idx = [i for i in range(len(self.inputs)) if i not in eval_idx]
        self.eval_idx = eval_idx
        tmp = tmp_path(self.out)
        clear_stale_tmp(self.out.parent, lambda name: name == self.out.name)
        if tmp.exists():
            shutil.rmtree(tmp)
        self.out.parent.mkdir(parents=True, exist_ok=True)
        tmp.mkdir()
        try:
            meta = self._build(tmp, start)
            meta.save(tmp)  # meta.json last: its presence marks a complete dataset
            replace_dir(tmp, self.out)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        meta.path = self.out
        if self.eval_parts is None and len(self.inputs) == 1:
            warnings.warn(f"{self.inputs[0]}: the only input, so there is no held-out split and "
                          "training will report AUC n/a; give two or more inputs (the last one "
                          "is held out for evaluation)",
                          HybridrecWarning, stacklevel=3)
        return meta

    def _check_out(self) -> None:
        """Before anything is written: ``out`` is no input, holds none and is not the
        ``--like`` dataset; an existing ``out`` is replaced only with ``overwrite`` and only
        when it is a hybridrec dataset."""
        sources = [("the input", p) for p in self.inputs]
        if self.like is not None:
            sources.append(("the --like dataset", self.like.meta.path))
        refuse_over_inputs(self.out, sources)
        if not self.out.exists() and not self.out.is_symlink():
            return
        if not self.overwrite:
            raise DataError(f"{self.out}: already exists (use --overwrite to replace it)")
        problem = dataset_in_the_way(self.out)
        if problem is not None:
            raise DataError(f"{self.out}: refusing to overwrite, it is not a hybridrec dataset ({problem})")

    def _build(self, tmp: Path, start: float) -> DatasetMeta:
        self._dense_columns()
        encoders, mode = self._encoders()
        specs = [
            FeatureSpec(name=n, kind=k, num_embeddings=encoders[n].num_embeddings)
            for n, k in self.features
        ]
        schema = Schema(label=self.label, dense=self.dense, features=specs)
        stats = {f.name: FeatureStats(f.name, f.num_embeddings, tmp / "stats") for f in specs}
        report = ParseReport()
        parts = []
        with byte_progress(self.inputs, "write", self.progress) as bar:
            for i, path in enumerate(self.inputs):
                rows = self._write_part(
                    tmp / self.part_names[i],
                    schema,
                    path,
                    encoders,
                    stats if i in self.train_idx else None,
                    report,
                    bar,
                )
                parts.append(PartInfo(name=self.part_names[i], rows=rows, source=str(path)))
        if mode == "vocabulary":
            _save_vocab(tmp / "vocab", encoders)
        return DatasetMeta(
            schema=schema,
            parts=parts,
            splits={
                "train": [self.part_names[i] for i in self.train_idx],
                "eval": [self.part_names[i] for i in self.eval_idx],
            },
            stats={n: s.finish(tmp) for n, s in stats.items()},
            report={
                "lines_read": report.lines_read,
                "rows_written": sum(p.rows for p in parts),
                "bad_lines_skipped": report.bad_lines_skipped,
                "bad_line_examples": report.bad_line_examples,
                "seconds": round(time.perf_counter() - start, 3),
            },
            preprocessing={
                "categorical": mode,
                "dense_transform": self.dense_transform,
                "min_count": self.min_count if mode == "vocabulary" else None,
                "table_size": self._sizes,
                "stats_split": "train",
                "label_map": self.label_map,
                **(self.like.noted() if self.like is not None else {}),
            },
        )

    def _encoders(self) -> tuple[dict[str, Encoder], str]:
        if self.like is not None:
            self._sizes, self.min_count = self.like.sizes, self.like.min_count
            return self.like.encoders(self), self.like.mode
        names = [n for n, _ in self.features]
        self._sizes = resolve_table_sizes(self.table_size, names)
        min_count = self.min_count
        if min_count is None and self._sizes is None:
            min_count = 1  # neither given: the exact vocabulary of the training parts
            self.min_count = 1
        if min_count is None:
            return {n: ModuloEncoder(self._sizes[n]) for n in names}, "modulo"
        if int(min_count) < 1:
            raise ConfigError(f"min_count: {min_count} must be >= 1")
        return self._count_vocab(names, int(min_count)), "vocabulary"

    def _count_vocab(self, names: list[str], min_count: int) -> dict[str, Encoder]:
        """First pass: count (modulo-reduced) keys over the train inputs."""
        reducers = {
            n: VocabEncoder(np.zeros(0), self._sizes[n] if self._sizes else None) for n in names
        }
        counted = self.count_keys(reducers)
        return {
            n: VocabEncoder.from_counts(*counted[n], min_count, reducers[n].modulo) for n in names
        }

    def _dense_columns(self) -> None:
        """A CSV/Parquet reader's dense transforms, before the writing pass: the schema's,
        or (``auto``, ``standardize`` without numbers) chosen from the train inputs' values
        in a pass of their own."""
        spec = getattr(self.reader, "spec", None)
        if spec is None:
            return
        if spec.dense_columns is None:
            stats = dense_transforms.Stats(len(self.dense))
            train = [self.inputs[i] for i in self.train_idx]
            raw = copy.copy(self.reader)
            raw.spec = copy.copy(spec)
            raw.spec.raw_dense = True
            with byte_progress(train, "dense", self.progress) as bar:
                for path in train:
                    for chunk, _ in tracked_chunks(raw.read(path, ParseReport()), bar):
                        stats.add(chunk.dense)
            spec.dense_columns = stats.resolve(spec.dense_plan)
        self.dense_transform = dense_transforms.to_meta(spec.dense_columns, self.dense)

    def count_keys(self, reducers: dict[str, VocabEncoder]) -> dict[str, tuple[np.ndarray, np.ndarray]]:
        """``{feature: (sorted unique keys, counts)}`` over the train inputs, each key reduced
        by ``reducers[feature]`` (modulo its table size, when it has one)."""
        counters = {n: KeyCounter() for n in reducers}
        train = [self.inputs[i] for i in self.train_idx]
        with byte_progress(train, "count", self.progress) as bar:
            for path in train:
                for chunk, pos in tracked_chunks(self.reader.read(path, ParseReport()), bar):
                    for n, keys in _keys_by_feature(chunk, self.features):
                        counters[n].add(reducers[n].reduce(keys[keys >= 0]))
        return {n: c.result() for n, c in counters.items()}

    def _write_part(self, directory, schema, path, encoders, stats, report, bar) -> int:
        writer = PartWriter(directory, schema, source=str(path))
        try:
            for chunk, _ in tracked_chunks(self.reader.read(path, report), bar):
                onehot, mh = encode_chunk(chunk, schema, encoders)
                writer.append(chunk.labels, chunk.dense, onehot, mh)
                if stats is not None:
                    for j, f in enumerate(schema.onehot):
                        stats[f.name].add(onehot[:, j], len(chunk))
                    for name, (ids, _) in mh.items():
                        stats[name].add(ids, len(chunk))
                    if self.like is not None:  # (train parts: how many keys --like's ids lack)
                        self.like.tally(chunk, self.features, onehot, mh)
            rows = writer.close()
        finally:
            writer.abort()
        if rows == 0:
            raise DataError(f"{path}: no valid rows (every line was malformed and skipped)")
        return rows


def encode_chunk(
    chunk: RowChunk, schema: Schema, encoders: dict[str, Encoder]
) -> tuple[np.ndarray, dict[str, tuple[np.ndarray, np.ndarray]]]:
    """A chunk's raw keys as table ids: int32 one-hot ids ``[n, n_onehot]`` and
    ``{feature: (int32 ids, int64 bag sizes)}``. Preprocessing and prediction
    (:mod:`hybridrec.serve.predict`) both go through here, so new rows get the ids
    the training rows got."""
    onehot = np.empty((len(chunk), len(schema.onehot)), dtype=np.int32)
    for j, f in enumerate(schema.onehot):
        onehot[:, j] = encoders[f.name](chunk.onehot[:, j])
    mh = {
        f.name: (encoders[f.name](chunk.multihot[f.name][0]), chunk.multihot[f.name][1])
        for f in schema.multihot
    }
    return onehot, mh


def load_encoders(meta: DatasetMeta,
                  vocab_files: dict[str, Path] | None = None) -> dict[str, Encoder]:
    """The encoders a dataset was written with, from its ``meta.json`` and ``vocab/``
    (the inverse of :func:`_save_vocab`): raw keys of new rows map to the ids training saw;
    a key the vocabulary lacks maps to 0, as a rare key did. ``vocab_files``: each
    feature's vocabulary file elsewhere (an export's copies) instead of ``vocab/``."""
    pre = meta.preprocessing
    names = meta.feature_names
    sizes = pre.get("table_size")
    if pre.get("categorical") == "modulo":
        return {n: ModuloEncoder(sizes[n]) for n in names}
    if pre.get("categorical") != "vocabulary":
        raise DataError(f"{meta._where()}: preprocessing.categorical "
                        f"{pre.get('categorical')!r} is neither modulo nor vocabulary")
    out: dict[str, Encoder] = {}
    for n in names:
        if meta.vocab is not None:  # (a dynamic table's keys by row, from its checkpoint)
            out[n] = VocabEncoder(meta.vocab[n], sizes[n] if sizes else None)
            continue
        file = vocab_files[n] if vocab_files is not None else meta.part_dir("vocab") / f"{n}.keys.npy"
        try:
            vocab = np.load(file)
        except (OSError, ValueError) as e:
            raise DataError(f"{file}: cannot read the vocabulary of {n} ({e})") from None
        out[n] = VocabEncoder(vocab, sizes[n] if sizes else None)
    return out


def _keys_by_feature(chunk: RowChunk, features: list[tuple[str, str]]):
    j = 0
    for name, kind in features:
        if kind == "onehot":
            yield name, chunk.onehot[:, j]
            j += 1
        else:
            yield name, chunk.multihot[name][0]


def _save_vocab(directory: Path, encoders: dict[str, Encoder]) -> None:
    """Sorted raw keys per feature: key ``vocab[i]`` has id ``i + 1`` (to encode new data)."""
    directory.mkdir()
    for name, enc in encoders.items():
        np.save(directory / f"{name}.keys.npy", enc.vocab)


_DATASET_FILES = re.compile(
    r"meta\.json|vocab/|vocab/[^/]+\.keys\.npy|stats/|stats/[^/]+\.(id_counts|counts)\.npy"
    r"|part-\d{5}/|part-\d{5}/(labels|dense|onehot|id_ranges)\.(npy|json)"
    r"|part-\d{5}/mh-[^/]+\.(values|offsets)\.npy")
"""What a dataset directory holds (``stats/*.counts.npy``: datasets of earlier versions;
``id_ranges.json``: the loader's cache beside a part's shards)."""


def dataset_in_the_way(directory: Path) -> str | None:
    """Why ``directory`` is not a hybridrec dataset that ``--overwrite`` may replace, or None
    when it is one (an empty directory too): a ``meta.json`` as preprocessing writes it
    (``format_version``, ``created_by`` hybridrec, ``schema``, ``parts``; of any format
    version, so that an older dataset can be made again) and, besides, only a dataset's
    files. A single line, naming what is in the way."""
    if directory.is_symlink() or not directory.is_dir():
        return "not a directory"
    if not any(directory.iterdir()):
        return None
    meta = directory / "meta.json"
    try:
        d = json.loads(meta.read_text())
    except FileNotFoundError:
        return "no meta.json"
    except (OSError, ValueError) as e:
        return f"meta.json unreadable: {type(e).__name__}"
    if not (isinstance(d, dict) and isinstance(d.get("format_version"), int)
            and str(d.get("created_by", "")).startswith("hybridrec")
            and isinstance(d.get("schema"), dict) and isinstance(d.get("parts"), list)):
        return "meta.json is not one that preprocessing writes"
    extra = unknown_entry(directory, lambda rel: _DATASET_FILES.fullmatch(rel) is not None)
    return None if extra is None else f"{extra} is not a dataset's file"


class byte_progress:
    """A tqdm bar over the input bytes (only on a terminal unless asked)."""

    def __init__(self, paths: list[Path], desc: str, enabled: bool | None) -> None:
        from tqdm import tqdm

        if enabled is None:
            enabled = sys.stderr.isatty()
        total = sum(p.stat().st_size for p in paths)
        self.bar = tqdm(total=total, desc=desc, unit="B", unit_scale=True, disable=not enabled)

    def __enter__(self):
        return self.bar

    def __exit__(self, *exc) -> None:
        self.bar.close()


def tracked_chunks(chunks, bar):
    """Pass chunks through, advancing ``bar`` by the bytes each consumed."""
    last = 0
    for chunk, pos in chunks:
        bar.update(max(pos - last, 0))
        last = max(pos, last)
        yield chunk, pos
