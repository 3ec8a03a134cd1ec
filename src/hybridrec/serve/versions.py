"""One served model version: an export directory loaded for raw rows (``hybridrec serve``).

An export directory (:mod:`hybridrec.serve.export`) holds the program (``model.pt2``) and
the preprocessing as plain files (``preprocess/spec.json``, ``preprocess/vocab/``). Raw
rows reach the program by the library's own rules, not a second copy of them:
the spec is read back as the :class:`~hybridrec.data.schema.DatasetMeta` it was written
from (schema, raw format, categorical encoding, dense transform), the vocabularies by
:func:`~hybridrec.data.preprocess.load_encoders` (given the export's copies), and a request's
columns go through :func:`hybridrec.serve.json_rows.json_chunk` (the values straight to the
chunk the dataset's reader makes of the same rows, with its parsing rules, hashing and
reasons), :func:`~hybridrec.data.preprocess.encode_chunk`,
:func:`~hybridrec.data.loader.keyed_ids` and :func:`~hybridrec.serve.export.batch_inputs`,
as ``hybridrec predict`` and ``hybridrec export`` do. So a row's probability here is
``hybridrec predict``'s (the exported program is the eager model on plain kernels: equal
within float32 rounding).

A version reads its requests (:class:`Rows` names the version) and makes their ids with its
own vocabularies when it scores them, a batch of requests at a time, so rows it read are
scored by it alone; two versions may have different
vocabularies but must take the same raw columns (:meth:`ModelVersion.same_columns`).
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from hybridrec.data.chunk import RowChunk
from hybridrec.data.criteo import CATEGORICAL, FIELDS
from hybridrec.data.loader import keyed_ids
from hybridrec.data.preprocess import encode_chunk, load_encoders
from hybridrec.data.schema import DatasetMeta, FeatureSpec, PartInfo, Schema
from hybridrec.errors import DataError
from hybridrec.serve import published
from hybridrec.serve.export import SPEC_VERSION, batch_inputs, example_inputs
from hybridrec.serve.json_rows import json_chunk
from hybridrec.sparse.keyed_jagged import Batch


@dataclass
class Rows:
    """A request's rows, read and checked by (and only for) ``version``: their raw keys and
    transformed dense values (:meth:`ModelVersion.read`), ids not yet made."""

    version: ModelVersion
    chunk: RowChunk
    rows: int


class ModelVersion:
    """An export directory, loaded: its program, its preprocessing and what is known of it."""

    def __init__(self, name: str, path: Path, meta: DatasetMeta, encoders: dict, program,
                 record: dict, info: dict) -> None:
        self.name, self.path, self.meta, self.encoders = name, path, meta, encoders
        self.program, self.record, self.info = program, record, info
        self.format = meta.preprocessing["format"]
        self.columns = raw_columns(meta, self.format)
        self.loaded_at = time.time()

    # ---------------------------------------------------------------- rows -> inputs

    def read(self, columns: dict[str, list], rows: int) -> Rows:
        """``{column: values}`` (``rows`` values each, the raw columns of :attr:`columns`;
        None for a missing value) read as the dataset's reader reads them. A malformed value
        raises a :class:`DataError` naming its row (0-based) and field."""
        return Rows(self, json_chunk(columns, rows, self.meta), rows)

    def inputs(self, chunks: list[RowChunk]) -> tuple[torch.Tensor, ...]:
        """The program's inputs of several requests' rows, one after another: their ids made
        once for all (:func:`~hybridrec.data.preprocess.encode_chunk`, with this version's
        encoders)."""
        chunk = concat_chunks(chunks)
        schema = self.meta.schema
        onehot, mh = encode_chunk(chunk, schema, self.encoders)
        batch = Batch(dense=torch.from_numpy(np.ascontiguousarray(chunk.dense)),
                      sparse=keyed_ids(schema, onehot, mh), labels=torch.zeros(len(chunk)))
        return batch_inputs(batch, self.meta)

    def score_rows(self, parts: list[Rows]) -> np.ndarray:
        """float32 probabilities of requests this version read, in order (one forward)."""
        return self.score(self.inputs([p.chunk for p in parts]))

    @torch.no_grad()
    def score(self, args: tuple[torch.Tensor, ...]) -> np.ndarray:
        """float32 probabilities of the program's inputs (one forward)."""
        return self.program(*args).float().reshape(-1).numpy()

    # ---------------------------------------------------------------- what it is

    def same_columns(self, other: ModelVersion) -> str | None:
        """Why ``other`` cannot replace this version for the same clients (None: it can)."""
        if other.format != self.format:
            return f"its raw format is {other.format}, the served one's {self.format}"
        if other.columns != self.columns:
            gone = [c for c in self.columns if c not in other.columns]
            new = [c for c in other.columns if c not in self.columns]
            return (f"its columns differ from the served ones (missing {gone[:5] or 'none'}, "
                    f"new {new[:5] or 'none'})")
        if _multihot(other) != _multihot(self):
            return (f"its multi-hot columns are {_multihot(other) or 'none'}, the served one's "
                    f"{_multihot(self) or 'none'}")
        return None

    def describe(self) -> dict[str, Any]:
        """What ``GET /v1/model`` says: the version, its training and its age where known."""
        published_at = self.info.get("published_at")
        trained = self.info.get("trained_rows")
        if trained is None:
            trained = published.trained_rows(self.record)
        return {
            "version": self.name, "path": str(self.path), "format": self.format,
            "step": self.info.get("step", self.record.get("step")),
            "checkpoint": self.record.get("checkpoint"), "trained_rows": trained,
            "published_at": published_at, "data_until": self.info.get("data_until"),
            "freshness_seconds": round(time.time() - published_at, 3)
            if isinstance(published_at, (int, float)) else None,
            "loaded_at": self.loaded_at, "columns": self.columns,
        }


def _multihot(version: ModelVersion) -> list[str]:
    return [f.name for f in version.meta.schema.multihot]


def concat_chunks(chunks: list[RowChunk]) -> RowChunk:
    """Chunks of one schema as one: rows one after another (and multi-hot keys too)."""
    if len(chunks) == 1:
        return chunks[0]
    return RowChunk(labels=np.concatenate([c.labels for c in chunks]),
                    dense=np.concatenate([c.dense for c in chunks]),
                    onehot=np.concatenate([c.onehot for c in chunks]),
                    multihot={name: (np.concatenate([c.multihot[name][0] for c in chunks]),
                                     np.concatenate([c.multihot[name][1] for c in chunks]))
                              for name in chunks[0].multihot})


def raw_columns(meta: DatasetMeta, fmt: str) -> list[str]:
    """The raw columns a request gives (the label excluded)."""
    if fmt == "criteo":
        return list(FIELDS[1:])
    s = meta.schema
    return [*s.dense, *(f.name for f in s.onehot), *(f.name for f in s.multihot)]


# ---------------------------------------------------------------- loading


def load_version(path: str | Path, name: str | None = None) -> ModelVersion:
    """Load the export directory ``path`` as version ``name`` (default its directory's
    name) and check it scores: a missing or corrupt file, a spec of another version or
    a program that does not run raises one :class:`DataError` naming the file."""
    path = Path(path)
    record = _json(path / "export.json")
    spec = _json(path / "preprocess" / "spec.json")
    if spec.get("spec_version") != SPEC_VERSION:
        raise DataError(f"{path / 'preprocess' / 'spec.json'}: spec_version {spec.get('spec_version')!r}, "
                        f"this hybridrec serves {SPEC_VERSION}")
    meta = meta_from_spec(spec, path / "preprocess")
    encoders = load_encoders(meta, {e["name"]: path / "preprocess" / str(e.get("vocab"))
                                   for e in [*spec["onehot"], *spec["multihot"]]})
    _check_archive(path / "model.pt2")
    try:
        with _quiet("torch.export"):  # (it logs a traceback before raising; the error is the line)
            program = torch.export.load(str(path / "model.pt2")).module()
    except FileNotFoundError:
        raise DataError(f"{path / 'model.pt2'}: missing") from None
    except Exception as e:  # noqa: BLE001 (whatever a corrupt archive raises: one line)
        raise DataError(f"{path / 'model.pt2'}: cannot load the program "
                        f"({type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''})") from None
    version = ModelVersion(name or path.name, path, meta, encoders, program, record, published.info(path))
    _smoke(version, path)
    return version


@contextlib.contextmanager
def _quiet(logger: str):
    log = logging.getLogger(logger)
    level = log.level
    log.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        log.setLevel(level)


def _check_archive(pt2: Path) -> None:
    """Before torch reads ``pt2``: refused if ``torch.export.load`` would unpickle any of
    it or run code from it (score.py's check, :func:`~hybridrec.serve.score_template.archive_problem`)."""
    from hybridrec.serve.score_template import archive_problem

    if pt2.is_file() and (problem := archive_problem(pt2)) is not None:  # (missing: said below)
        raise DataError(f"{pt2}: refused: {problem}")


def _json(file: Path) -> dict:
    try:
        data = json.loads(file.read_text())
    except FileNotFoundError:
        raise DataError(f"{file}: missing (not an export directory of `hybridrec export`)") from None
    except ValueError as e:
        raise DataError(f"{file}: not valid JSON ({e})") from None
    if not isinstance(data, dict):
        raise DataError(f"{file}: expected a JSON object")
    return data


def meta_from_spec(spec: dict, where: Path) -> DatasetMeta:
    """The :class:`DatasetMeta` an export's ``spec.json`` was written from, as far as
    reading raw rows needs it: schema (Criteo's features in Criteo's column order, which
    :func:`~hybridrec.serve.inputs.dataset_format` recognises), raw format (a CSV or
    Parquet source name) and ``preprocessing``."""
    try:
        fmt = spec["format"]
        kinds = {e["name"]: ("onehot", e) for e in spec["onehot"]}
        kinds.update({e["name"]: ("multihot", e) for e in spec["multihot"]})
        order = list(CATEGORICAL) if fmt == "criteo" else list(kinds)
        features = [FeatureSpec(name=n, kind=kinds[n][0], num_embeddings=kinds[n][1]["num_embeddings"])
                    for n in order]
        schema = Schema(label=spec["label"], dense=list(spec["dense"]), features=features)
        encodings = {e["encoding"] for _, e in kinds.values()}
        modulo = {n: e["modulo"] for n, (_, e) in kinds.items() if e.get("modulo")}
        dense_transform = spec["dense_transform"]
    except (KeyError, TypeError) as e:
        raise DataError(f"{where / 'spec.json'}: malformed ({type(e).__name__}: {e})") from None
    if (len(encodings) != 1 or not encodings <= {"modulo", "vocabulary"}
            or fmt not in ("criteo", "csv", "parquet")):
        raise DataError(f"{where / 'spec.json'}: format {fmt!r} and encodings {sorted(encodings)} "
                        "are not those of a hybridrec dataset")
    source = {"parquet": "export.parquet", "csv": "export.csv"}.get(fmt, "export.tsv")
    return DatasetMeta(path=where, schema=schema, parts=[PartInfo(name="part-00000", rows=0, source=source)],
                       splits={}, preprocessing={"categorical": encodings.pop(), "format": fmt,
                                                 "table_size": modulo or None,
                                                 "dense_transform": dense_transform})


def _smoke(version: ModelVersion, path: Path) -> None:
    """One forward on made-up inputs: a program that fails, or returns anything but a
    probability per row, is refused now rather than on a request."""
    args = example_inputs(version.meta)
    try:
        p = version.score(args)
    except Exception as e:  # noqa: BLE001 (a broken program: one line naming it)
        raise DataError(f"{path / 'model.pt2'}: the program fails on example inputs "
                        f"({type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''})") from None
    if p.shape != (args[0].shape[0],) or not np.all((p >= 0) & (p <= 1)):
        raise DataError(f"{path / 'model.pt2'}: the program returns {tuple(p.shape)} values, not one "
                        "probability in [0, 1] per row")

