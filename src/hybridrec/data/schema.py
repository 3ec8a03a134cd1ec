"""What a preprocessed dataset holds: the schema and ``meta.json`` (docs/data-format.md).

:class:`Schema` names the label, the dense columns and the categorical features
(one-hot: exactly one id per sample; multi-hot: a bag of ids). :class:`DatasetMeta`
is the parsed ``meta.json`` of a dataset directory; its presence marks a complete
dataset, so :meth:`DatasetMeta.load` refuses a directory without it.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hybridrec import __version__
from hybridrec.errors import DataError

FORMAT_VERSION = 1
"""The on-disk format this code reads and writes."""

KINDS = ("onehot", "multihot")

# Feature names become file names (mh-<feature>.values.npy, stats/<feature>.counts.npy).
_SAFE_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.\-]*$")


@dataclass(kw_only=True)
class FeatureSpec:
    """One categorical feature and its embedding table."""

    name: str
    """Feature (and table) name; letters, digits, ``_ . -`` only (it names files)."""
    kind: str = "onehot"
    """``"onehot"``: one id per sample; ``"multihot"``: a bag of ids per sample."""
    num_embeddings: int
    """Table rows; every id is in ``[0, num_embeddings)``."""

    def __post_init__(self) -> None:
        if not _SAFE_NAME.match(self.name):
            raise DataError(
                f"feature name {self.name!r}: use letters, digits, '_', '.', '-' only "
                "(it is used in file names)"
            )
        if self.kind not in KINDS:
            raise DataError(f"feature {self.name}: kind {self.kind!r} is not one of {KINDS}")
        if not 1 <= int(self.num_embeddings) < 2**31:
            raise DataError(
                f"feature {self.name}: num_embeddings {self.num_embeddings} "
                "must be in [1, 2**31) (ids are stored as int32)"
            )
        self.num_embeddings = int(self.num_embeddings)

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "kind": self.kind, "num_embeddings": self.num_embeddings}


@dataclass(kw_only=True)
class Schema:
    """Columns of a dataset, in the order the arrays store them."""

    label: str = "label"
    """Name of the 0/1 click label."""
    dense: list[str] = field(default_factory=list)
    """Dense (numeric) column names; ``dense.npy`` columns follow this order."""
    features: list[FeatureSpec] = field(default_factory=list)
    """Categorical features; ``onehot.npy`` columns follow this order restricted to one-hot."""

    def __post_init__(self) -> None:
        names = [self.label, *self.dense, *self.feature_names]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise DataError(f"schema: duplicate column names {dup}")

    @property
    def feature_names(self) -> list[str]:
        return [f.name for f in self.features]

    @property
    def onehot(self) -> list[FeatureSpec]:
        return [f for f in self.features if f.kind == "onehot"]

    @property
    def multihot(self) -> list[FeatureSpec]:
        return [f for f in self.features if f.kind == "multihot"]

    @property
    def num_embeddings(self) -> dict[str, int]:
        return {f.name: f.num_embeddings for f in self.features}

    def feature(self, name: str) -> FeatureSpec:
        for f in self.features:
            if f.name == name:
                return f
        raise KeyError(name)

    def to_dict(self) -> dict[str, Any]:
        return {
            "label": self.label,
            "dense": list(self.dense),
            "features": [f.to_dict() for f in self.features],
        }

    @staticmethod
    def from_dict(d: dict[str, Any], where: str = "schema") -> Schema:
        try:
            feats = [FeatureSpec(**f) for f in d["features"]]
            return Schema(label=d["label"], dense=list(d["dense"]), features=feats)
        except (KeyError, TypeError) as e:
            raise DataError(f"{where}: malformed schema ({type(e).__name__}: {e})") from None

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    @staticmethod
    def from_json(text: str, where: str = "schema") -> Schema:
        return Schema.from_dict(parse_json(text, where), where)


@dataclass(kw_only=True)
class PartInfo:
    """One part directory (one input file)."""

    name: str
    """Directory name, ``part-00000`` ..."""
    rows: int
    """Number of samples in the part."""
    source: str
    """The input file it was made from (informational)."""


@dataclass(kw_only=True)
class DatasetMeta:
    """The parsed ``meta.json`` of a preprocessed dataset directory."""

    path: Path | None = None
    """The dataset directory (None until saved or loaded)."""
    schema: Schema
    """Columns and tables."""
    parts: list[PartInfo]
    """Parts in input order."""
    splits: dict[str, list[str]]
    """``{"train": [part names], "eval": [part names]}``."""
    stats: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Per-feature table statistics over the train split (for the sharding planner)."""
    report: dict[str, Any] = field(default_factory=dict)
    """Preprocessing report: lines read, rows written, bad lines skipped, seconds."""
    preprocessing: dict[str, Any] = field(default_factory=dict)
    """How ids and dense values were made (categorical mode, dense transform, min_count)."""
    format_version: int = FORMAT_VERSION
    """On-disk format version."""
    created_by: str = f"hybridrec {__version__}"
    """Writer and version."""
    vocab: dict[str, Any] | None = field(default=None, compare=False, repr=False)
    """In memory only (never in meta.json): each feature's vocabulary array where it comes
    from elsewhere than ``vocab/``: a dynamic table's key of each row (its checkpoint's key
    map, :func:`hybridrec.train.evaluate.load_run_model`), which the vocabulary encoding reads
    as ``key -> row``."""

    @property
    def feature_names(self) -> list[str]:
        return self.schema.feature_names

    @property
    def num_embeddings(self) -> dict[str, int]:
        return self.schema.num_embeddings

    def part(self, name: str) -> PartInfo:
        for p in self.parts:
            if p.name == name:
                return p
        raise DataError(f"{self._where()}: no part named {name!r}")

    def part_dir(self, name: str) -> Path:
        if self.path is None:
            raise DataError("dataset meta has no path (not loaded from or saved to disk)")
        return self.path / name

    def split_parts(self, split: str) -> list[PartInfo]:
        if split not in self.splits:
            raise DataError(f"{self._where()}: no split {split!r} (have {sorted(self.splits)})")
        return [self.part(n) for n in self.splits[split]]

    def split_rows(self, split: str) -> int:
        return sum(p.rows for p in self.split_parts(split))

    def to_dict(self) -> dict[str, Any]:
        return {
            "format_version": self.format_version,
            "created_by": self.created_by,
            "schema": self.schema.to_dict(),
            "parts": [{"name": p.name, "rows": p.rows, "source": p.source} for p in self.parts],
            "splits": {k: list(v) for k, v in self.splits.items()},
            "stats": self.stats,
            "report": self.report,
            "preprocessing": self.preprocessing,
        }

    def save(self, directory: str | os.PathLike) -> Path:
        """Write ``meta.json`` into ``directory`` atomically (tmp file + rename)."""
        directory = Path(directory)
        tmp = directory / f"meta.json.tmp-{os.getpid()}"
        tmp.write_text(json.dumps(self.to_dict(), indent=2) + "\n")
        os.replace(tmp, directory / "meta.json")
        self.path = directory
        return directory / "meta.json"

    @staticmethod
    def load(path: str | os.PathLike) -> DatasetMeta:
        """Read ``path/meta.json`` (``path`` may also name the meta.json file itself)."""
        path = Path(path)
        if path.name == "meta.json" and path.is_file():
            path = path.parent
        if not path.is_dir():
            raise DataError(f"{path}: dataset directory does not exist")
        file = path / "meta.json"
        if not file.is_file():
            raise DataError(
                f"{path}: no meta.json, so not a complete preprocessed dataset "
                "(interrupted run, or not made by `hybridrec data preprocess`)"
            )
        d = parse_json(file.read_text(), str(file))
        return _meta_from_dict(d, path, str(file))

    def _where(self) -> str:
        return str(self.path / "meta.json") if self.path else "meta.json"


def parse_json(text: str, where: str) -> dict[str, Any]:
    """``text`` as a JSON object, or a one-line DataError naming ``where`` (shared by every
    reader of hybridrec's JSON files: meta.json, the tabular spec)."""
    try:
        d = json.loads(text)
    except json.JSONDecodeError as e:
        raise DataError(f"{where}:{e.lineno}: invalid JSON: {e.msg}") from None
    if not isinstance(d, dict):
        raise DataError(f"{where}: expected a JSON object at the top level")
    return d


def _meta_from_dict(d: dict[str, Any], path: Path, where: str) -> DatasetMeta:
    version = d.get("format_version")
    if version != FORMAT_VERSION:
        raise DataError(
            f"{where}: format_version {version!r} is not supported "
            f"(this hybridrec reads format_version {FORMAT_VERSION}); re-run preprocessing"
        )
    try:
        parts = [
            PartInfo(name=p["name"], rows=int(p["rows"]), source=p.get("source", ""))
            for p in d["parts"]
        ]
        meta = DatasetMeta(
            path=path,
            schema=Schema.from_dict(d["schema"], where),
            parts=parts,
            splits={k: list(v) for k, v in d["splits"].items()},
            stats=d.get("stats", {}),
            report=d.get("report", {}),
            preprocessing=d.get("preprocessing", {}),
            format_version=version,
            created_by=d.get("created_by", "unknown"),
        )
    except (KeyError, TypeError, AttributeError, ValueError) as e:
        raise DataError(f"{where}: malformed meta.json ({type(e).__name__}: {e})") from None
    for names in meta.splits.values():
        for n in names:
            meta.part(n)  # raises on a split naming an unknown part
    for p in meta.parts:
        if not (path / p.name).is_dir():
            raise DataError(f"{where}: part directory {p.name} is missing")
    return meta
