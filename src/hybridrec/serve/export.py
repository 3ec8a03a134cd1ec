"""``hybridrec export``: a run's model as a self-contained serving artifact.

The artifact directory holds what serving needs and nothing of hybridrec::

    model.pt2              torch.export program: (dense, ids[, mh_ids, mh_lengths]) -> probabilities [B]
    preprocess/spec.json   raw row -> model inputs: column order, key rule, encodings, dense transform
    preprocess/vocab/*.npy raw keys per feature (vocabulary encoding: key vocab[i] -> id i + 1)
    score.py               INPUT OUTPUT.csv with torch and numpy only (a second, standalone
                           implementation of the preprocessing; the tests hold it to the library's)
    README.md              how to load and call it
    export.json            what was exported, and the held-out metrics of the eager and exported models

The program's inputs (B is dynamic; one-hot and multi-hot features in the dataset schema's order):

- ``dense``: float32 ``[B, n_dense]``, already transformed (spec.json's ``dense_transform``:
  ``log1p`` of the non-negative value, or per column ``log1p``, ``none``, or standardized
  (after ``log1p`` or not) with the train split's mean and std; :mod:`hybridrec.data.dense`);
- ``ids``: int64 ``[B, n_onehot]``, each feature's table id (0 = missing or unseen);
- with multi-hot features only, ``mh_ids``: int64 ``[nnz]``, the bags' ids sample-major (row
  0's bags in feature order, then row 1's ...), and ``mh_lengths``: int64 ``[B, n_multihot]``.

What the export does not keep: the MLP kernels chosen by timing at training start
(:mod:`hybridrec.model.kernels`: oneDNN, padded linears) and the tuned lookups; the program is
the plain eager path (``F.linear``, ``index_select``, ``embedding_bag``), whose values those
kernels match within rounding. Sharded runs need nothing special:
:func:`~hybridrec.train.run.load_run_model` assembles whole tables from any world size's
checkpoint. The lookup is rebuilt here from the tables rather than traced through
:class:`~hybridrec.model.embedding.EmbeddingBagCollection` (whose bag-shape checks read
values on the host, which export cannot trace), so the tables can also be stored in bf16 or
row-wise int8 and dequantized in the program (``--tables``). A run trained with bf16 tables
and multi-hot bags pools in bf16 in eager mode; exported with ``--tables fp32`` it pools in
float32 (a difference of bf16 rounding).

The directory is written whole or not at all (:mod:`hybridrec.data.outputs`): into
``DIR.tmp-<pid>``, fsynced, renamed to ``DIR`` when complete; a failure leaves an earlier
export at ``DIR`` as it was. ``DIR`` may not be the run directory, hold it, its dataset or the
checkpoint; ``--overwrite`` replaces only an earlier export: an ``export.json`` as this
module writes it and nothing but the files of an export (:func:`export_in_the_way`).
"""

from __future__ import annotations

import copy
import json
import re
import shutil
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from hybridrec.data.outputs import refuse_over_inputs, replace_dir, unknown_entry
from hybridrec.data.shards import clear_stale_tmp, tmp_path
from hybridrec.errors import ConfigError, DataError
from hybridrec.model.kernels import precision_scope

TABLES = ("fp32", "bf16", "int8")
"""Storage of the exported tables: as trained in float32, bfloat16 (half), or row-wise int8
(a quarter, plus 8 bytes of scale and bias per row)."""

SPEC_VERSION = 1
"""The version of ``preprocess/spec.json`` that ``score.py`` reads."""

CRITEO_DENSE = tuple(f"I{i}" for i in range(1, 14))
CRITEO_CATEGORICAL = tuple(f"C{i}" for i in range(1, 27))


# ---------------------------------------------------------------- the model


def quantize_rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Row-wise int8: ``(codes uint8 [R, D], scale_bias float32 [R, 2])`` with
    ``row ~ codes * scale + bias``, ``bias`` the row's minimum and ``scale`` its range / 255,
    so every value is within ``scale / 2`` of the original (a constant row is exact)."""
    w = weight.float()
    lo, hi = w.min(1).values, w.max(1).values
    scale = (hi - lo) / 255
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    codes = ((w - lo[:, None]) / scale[:, None]).round_().clamp_(0, 255).to(torch.uint8)
    return codes, torch.stack([scale, lo], 1)


def _dense_arch(module: nn.Module) -> nn.Module:
    """A copy of a dense arch on the plain path: every MLP layer on ``F.linear`` (the kernels
    chosen at run time are not exported) and buffers of their own storage (torch.export.save
    wants no two buffers sharing one)."""
    out = copy.deepcopy(module)
    for m in out.modules():
        if hasattr(m, "impls"):
            m.impls = ["torch"] * len(m.impls)
        for name, buf in list(m.named_buffers(recurse=False)):
            m._buffers[name] = buf.clone()
    return out


class ServingModel(nn.Module):
    """A trained DLRM or DeepFM over plain tensors (the module docstring's signature),
    returning click probabilities ``[B]``.

    Args:
        model: the run's single-process model (:func:`~hybridrec.train.run.load_run_model`).
        onehot, multihot: the dataset's one-hot and multi-hot feature names, in the order
            of the ``ids`` columns and of ``mh_lengths``' columns.
        tables: ``fp32``, ``bf16`` or ``int8`` (:data:`TABLES`).
    """

    def __init__(self, model: nn.Module, *, onehot: list[str], multihot: list[str],
                 tables: str = "fp32") -> None:
        super().__init__()
        if tables not in TABLES:
            raise ConfigError(f"--tables {tables!r}: one of {', '.join(TABLES)}")
        ebc = model.sparse
        names = list(ebc.feature_names)
        if sorted(names) != sorted([*onehot, *multihot]):
            raise ConfigError(f"the model's features {names} are not the dataset's {[*onehot, *multihot]}")
        weight, first_row = self._stack_tables(ebc, [*onehot, *multihot])
        self.tables, self.width = tables, weight.shape[1]
        self.n_onehot, self.n_multihot = len(onehot), len(multihot)
        self.register_buffer("oh_rows", torch.tensor([first_row[f] for f in onehot], dtype=torch.int64))
        self.register_buffer("mh_rows", torch.tensor([first_row[f] for f in multihot], dtype=torch.int64))
        given = [*onehot, *multihot]  # the model's feature order, from the inputs' order
        order = [given.index(f) for f in names]
        self.reorder = order != list(range(len(order)))
        self.register_buffer("order", torch.tensor(order, dtype=torch.int64))
        if tables == "int8":
            codes, scale_bias = quantize_rows(weight)
            self.register_buffer("weight", codes)
            self.register_buffer("scale_bias", scale_bias)
        else:
            self.register_buffer("weight", weight.to(torch.bfloat16 if tables == "bf16" else torch.float32))
        self.pooling = next(iter(ebc.tables.values())).pooling
        self.fm = getattr(model, "dim", None) if type(model).__name__ == "DeepFM" else None
        self.precision = getattr(model, "precision", "fp32")
        self.bottom, self.interaction, self.top = (_dense_arch(model.bottom), _dense_arch(model.interaction),
                                                   _dense_arch(model.top))

    @staticmethod
    def _stack_tables(ebc, features: list[str]) -> tuple[torch.Tensor, dict[str, int]]:
        """Every table in float32, one after another (in ``features``' order), and each
        feature's first row in the result."""
        by_feature = {f: name for name, t in ebc.tables.items() for f in t.features}
        dims = {t.embedding_dim for t in ebc.tables.values()}
        if len(dims) != 1 or len({t.pooling for t in ebc.tables.values()}) != 1:
            raise ConfigError("export needs tables of one width and one pooling (as DLRM and DeepFM build them)")
        blocks, first, rows = [], {}, 0
        for name in dict.fromkeys(by_feature[f] for f in features):
            w = ebc.table_weight(name).detach().float()
            for f in ebc.tables[name].features:
                first[f] = rows
            blocks.append(w)
            rows += w.shape[0]
        return torch.cat(blocks), first

    def _rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows ``ids`` of the stacked tables, float32 ``[n, width]``."""
        rows = self.weight.index_select(0, ids)
        if self.tables == "int8":
            sb = self.scale_bias.index_select(0, ids)
            return rows.float() * sb[:, :1] + sb[:, 1:]
        return rows.float()

    def _bags(self, mh_ids: torch.Tensor, mh_lengths: torch.Tensor):
        """Pooled multi-hot bags ``[B, n_multihot, width]`` and each bag's sum of squared
        FM embedding norms ``[B, n_multihot]`` (DeepFM's ``q``; None for DLRM)."""
        b = mh_lengths.shape[0]
        lengths = mh_lengths.reshape(-1)
        offsets = torch.cat([lengths.new_zeros(1), torch.cumsum(lengths, 0)])
        nnz = mh_ids.shape[0]
        token = torch.arange(nnz, device=mh_ids.device)
        # The bag of every id: how many bags end at or before it (a cumulative count, not
        # searchsorted, which torch's ONNX exporter cannot translate).
        ends = torch.zeros(nnz + 1, dtype=torch.int64, device=mh_ids.device)
        bag = torch.cumsum(ends.index_add(0, offsets[1:], torch.ones_like(offsets[1:])), 0)[:nnz]
        rows = self._rows(mh_ids + self.mh_rows[bag % self.n_multihot])
        pooled = F.embedding_bag(token, rows, offsets, mode=self.pooling, include_last_offset=True)
        squares = None
        if self.fm is not None:
            sq = rows[:, : self.fm].pow(2).sum(1, keepdim=True)
            squares = F.embedding_bag(token, sq, offsets, mode="sum", include_last_offset=True).view(b, -1)
        return pooled.view(b, self.n_multihot, self.width), squares

    def forward(self, dense: torch.Tensor, ids: torch.Tensor, mh_ids: torch.Tensor | None = None,
                mh_lengths: torch.Tensor | None = None) -> torch.Tensor:
        b = dense.shape[0]
        pooled, squares = [], []
        if self.n_onehot:
            rows = self._rows((ids + self.oh_rows).reshape(-1)).view(b, self.n_onehot, self.width)
            pooled.append(rows)
            if self.fm is not None:
                squares.append(rows[:, :, : self.fm].pow(2).sum(2))
        if self.n_multihot:
            bags, sq = self._bags(mh_ids, mh_lengths)
            pooled.append(bags)
            squares += [sq] if sq is not None else []
        fields = pooled[0] if len(pooled) == 1 else torch.cat(pooled, 1)
        if self.reorder:  # (the model's feature order, where the inputs' differs)
            fields = fields.index_select(1, self.order)
            squares = [torch.cat(squares, 1).index_select(1, self.order)] if squares else []
        with precision_scope(self.precision, dense.device):
            x = self.bottom(dense)
        if self.fm is None:
            with precision_scope(self.precision, dense.device):
                logits = self.top(self.interaction(x, fields)).squeeze(1).float()
            return torch.sigmoid(logits)
        k = self.fm
        vectors = fields[:, :, :k]
        q = (squares[0] if len(squares) == 1 else torch.cat(squares, 1)).sum(1)
        with precision_scope(self.precision, dense.device):
            deep = self.top(self.interaction(x, vectors)).squeeze(1).float()
        s = vectors.sum(1)
        return torch.sigmoid(deep + fields[:, :, k].sum(1) + 0.5 * (s.pow(2).sum(1) - q))


def example_inputs(meta, batch: int = 8) -> tuple[torch.Tensor, ...]:
    """Inputs of the program's signature for ``meta``'s schema (ids 0, bags of 0-3 ids)."""
    s = meta.schema
    dense = torch.rand(batch, len(s.dense))
    ids = torch.zeros(batch, len(s.onehot), dtype=torch.int64)
    if not s.multihot:
        return dense, ids
    lengths = torch.arange(batch * len(s.multihot), dtype=torch.int64).remainder(4).view(batch, -1)
    return dense, ids, torch.zeros(int(lengths.sum()), dtype=torch.int64), lengths


def dynamic_shapes(args: tuple) -> tuple:
    """Dynamic batch (and number of multi-hot ids) for :func:`torch.export.export`."""
    batch = torch.export.Dim("batch", min=1)
    shapes: list = [{0: batch}, {0: batch}]
    if len(args) == 4:
        shapes += [{0: torch.export.Dim("nnz", min=0)}, {0: batch}]
    return tuple(shapes)


def export_program(serving: ServingModel, args: tuple) -> torch.export.ExportedProgram:
    serving.eval()
    with torch.no_grad():
        return torch.export.export(serving, args, dynamic_shapes=dynamic_shapes(args))


def batch_inputs(batch, meta) -> tuple[torch.Tensor, ...]:
    """A loader's :class:`~hybridrec.sparse.keyed_jagged.Batch` as the program's inputs."""
    s = meta.schema
    parts = batch.sparse.split_by_key()
    b = batch.dense.shape[0]
    ids = (torch.stack([parts[f.name][0] for f in s.onehot], 1).to(torch.int64) if s.onehot
           else torch.zeros(b, 0, dtype=torch.int64))
    if not s.multihot:
        return batch.dense, ids
    km_values = torch.cat([parts[f.name][0] for f in s.multihot]).to(torch.int64)
    km_lengths = torch.stack([parts[f.name][1] for f in s.multihot]).to(torch.int64)  # [n_mh, B]
    km_starts = torch.cumsum(km_lengths.reshape(-1), 0) - km_lengths.reshape(-1)
    lengths = km_lengths.t().contiguous()  # [B, n_mh], sample-major bags
    starts = km_starts.view(km_lengths.shape).t().reshape(-1)
    flat = lengths.reshape(-1)
    sm_starts = torch.cumsum(flat, 0) - flat
    src = torch.repeat_interleave(starts - sm_starts, flat) + torch.arange(int(flat.sum()))
    return batch.dense, ids, km_values.index_select(0, src), lengths


# ---------------------------------------------------------------- the preprocessing spec


def input_format(meta) -> str:
    """``criteo``, ``csv`` or ``parquet``: the raw format the dataset was made from. Criteo's
    columns make it Criteo, else its first part's source file names Parquet or CSV (the rule
    of ``hybridrec predict``)."""
    s = meta.schema
    if (s.label == "label" and tuple(s.dense) == CRITEO_DENSE
            and tuple(s.feature_names) == CRITEO_CATEGORICAL):
        return "criteo"
    source = Path(meta.parts[0].source if meta.parts else "")
    return "parquet" if source.suffix in (".parquet", ".pq") else "csv"


def preprocessing_spec(meta) -> tuple[dict, dict[str, Path]]:
    """``(spec.json's content, {feature: its vocabulary file in the dataset})``. CSV cells are
    read with the default delimiters (``,`` between fields, ``|`` inside a multi-hot cell):
    meta.json does not record the schema file's, and ``hybridrec predict`` reads them so too."""
    pre = meta.preprocessing
    if not pre.get("categorical") or not pre.get("dense_transform"):
        raise DataError(f"{meta.path}/meta.json: no 'preprocessing' entry (a dataset of an older "
                        "hybridrec); preprocess the raw data again to export a model trained on it")
    fmt = input_format(meta)
    csv_options = {"csv_delimiter": ",", "list_delimiter": "|"}
    sizes = pre.get("table_size") or {}
    vocab = pre["categorical"] == "vocabulary"
    files, features = {}, {"onehot": [], "multihot": []}
    for f in meta.schema.features:
        entry = {"name": f.name, "num_embeddings": f.num_embeddings,
                 "encoding": pre["categorical"], "modulo": sizes.get(f.name), "vocab": None}
        if vocab and meta.vocab is not None:  # (a dynamic table's keys by row: written, not copied)
            files[f.name] = meta.vocab[f.name]
            entry["vocab"] = f"vocab/{f.name}.npy"
        elif vocab:
            files[f.name] = meta.path / "vocab" / f"{f.name}.keys.npy"
            if not files[f.name].is_file():
                raise DataError(f"{files[f.name]}: the vocabulary file of feature {f.name} is missing")
            entry["vocab"] = f"vocab/{f.name}.npy"
        features[f.kind].append(entry)
    spec = {
        "spec_version": SPEC_VERSION,
        "format": fmt,
        **({"csv": csv_options} if fmt == "csv" else {}),
        "label": meta.schema.label,
        "dense": list(meta.schema.dense),
        "dense_transform": pre["dense_transform"],
        **features,
        "rules": {
            "keys": ("criteo: the hexadecimal field as an integer (at most 8 digits); csv: the "
                     "cell's BLAKE2b-64 digest (UTF-8), little-endian, shifted right by 1"),
            "missing": "an empty categorical value -> id 0; an empty dense value -> 0 after the transform",
            "modulo": "id = key % modulo",
            "vocabulary": ("key (first reduced % modulo when modulo is set) found at vocab[i] -> id i + 1, "
                           "else 0 (vocab is sorted, or sorted with keys appended by preprocess --grow)"),
            "log1p": "dense = float32(log(1 + max(x, 0))), computed in float64",
            "standardize": "dense = float32((x - mean) / std), computed in float64",
            "log1p_standardize": "dense = float32((log(1 + max(x, 0)) - mean) / std), computed in float64",
            "dense_transform": ("one of log1p, none for every dense column, or {column: log1p | none | "
                                "{transform: standardize | log1p_standardize, mean, std}}"),
        },
    }
    return spec, files


def _transform_text(value) -> str:
    """spec.json's ``dense_transform`` in a few words (the README's example)."""
    if isinstance(value, str):
        return value
    kinds = [v if isinstance(v, str) else v.get("transform") for v in value.values()]
    return "spec.json's dense_transform (" + ", ".join(
        f"{kinds.count(k)} {k}" for k in dict.fromkeys(kinds)) + ")"


def write_spec(out: Path, spec: dict, vocab_files: dict[str, Path]) -> None:
    d = out / "preprocess"
    (d / "vocab").mkdir(parents=True, exist_ok=True)
    for name, src in vocab_files.items():
        if isinstance(src, np.ndarray):  # (a dynamic table's keys by row)
            np.save(d / "vocab" / f"{name}.npy", src.astype(np.int64))
        else:
            shutil.copyfile(src, d / "vocab" / f"{name}.npy")
    (d / "spec.json").write_text(json.dumps(spec, indent=2) + "\n")


def write_score_script(out: Path) -> None:
    """``score.py``: the template shipped with this module, copied as it is."""
    shutil.copyfile(Path(__file__).with_name("score_template.py"), out / "score.py")
    (out / "score.py").chmod(0o755)


# ---------------------------------------------------------------- held-out metrics


def held_out_metrics(model: nn.Module, program, meta, *, batch_size: int, max_rows: int = 0) -> dict:
    """AUC and log loss of the eager model and of ``program`` (the exported module) on the
    held-out split (its first ``max_rows`` rows when > 0), and their largest difference."""
    from hybridrec.data.loader import ShardedLoader
    from hybridrec.metrics.classification import auc, log_loss

    if not meta.splits.get("eval"):
        return {"rows": 0, "note": "the dataset has no held-out split"}
    loader = ShardedLoader(meta, split="eval", batch_size=batch_size, shuffle=False, drop_last=False, prefetch=0)
    labels, eager, exported, rows = [], [], [], 0
    model.eval()
    with torch.no_grad():
        for batch in loader:
            labels.append(batch.labels)
            eager.append(torch.sigmoid(model(batch).float()))
            exported.append(program(*batch_inputs(batch, meta)))
            rows += batch.labels.numel()
            if max_rows and rows >= max_rows:
                break
    y, p0, p1 = (torch.cat(x).double().numpy() for x in (labels, eager, exported))
    if max_rows:
        y, p0, p1 = y[:max_rows], p0[:max_rows], p1[:max_rows]
    return {"rows": int(y.size), "auc_eager": auc(y, p0), "auc_exported": auc(y, p1),
            "log_loss_eager": log_loss(y, p0), "log_loss_exported": log_loss(y, p1),
            "max_abs_diff": float(np.abs(p0 - p1).max()) if y.size else 0.0}


# ---------------------------------------------------------------- ONNX


def export_onnx(serving: ServingModel, args: tuple, path: Path) -> str | None:
    """The model as ONNX through torch's dynamo exporter (weights in ``model.onnx.data``);
    None when written, else why not: the innermost error, e.g. the exporter needs the
    ``onnx`` and ``onnxscript`` packages, which hybridrec does not depend on."""
    try:
        with torch.no_grad():
            torch.onnx.export(serving.eval(), args, str(path), dynamo=True, verbose=False,
                              dynamic_shapes=dynamic_shapes(args), input_names=_input_names(args),
                              output_names=["probability"])
    except Exception as e:  # noqa: BLE001 (whatever the exporter raises: the reason is the report)
        for p in (path, path.with_name(path.name + ".data")):
            p.unlink(missing_ok=True)
        while e.__cause__ is not None:
            e = e.__cause__
        text = re.sub(r"\x1b\[[0-9;]*m", "", str(e)).strip()
        return f"{type(e).__name__}: {text.splitlines()[0] if text else ''}"
    return None


def _input_names(args: tuple) -> list[str]:
    return ["dense", "ids", "mh_ids", "mh_lengths"][: len(args)]


# ---------------------------------------------------------------- the command


def export_run(run_dir: str | Path, out: str | Path, *, checkpoint: str | None = None,
               tables: str = "fp32", onnx: bool = False, eval_rows: int = 0, overwrite: bool = False) -> dict:
    """Write the serving artifact of a run's checkpoint to ``out`` (the module docstring);
    returns what ``export.json`` records."""
    from hybridrec.train.run import load_run_model

    if tables not in TABLES:
        raise ConfigError(f"--tables {tables!r}: one of {', '.join(TABLES)}")
    out = Path(out)
    _check_out(out, overwrite, [("the run directory", Path(run_dir))])
    started = time.perf_counter()
    cfg, meta, model, path, extra = load_run_model(run_dir, checkpoint=checkpoint)
    dataset = [("the run's dataset", meta.path)] if meta.path is not None else []
    refuse_over_inputs(out, [("the checkpoint", Path(path)), *dataset])
    model.eval()
    spec, vocab_files = preprocessing_spec(meta)
    serving = ServingModel(model, onehot=[f.name for f in meta.schema.onehot],
                           multihot=[f.name for f in meta.schema.multihot], tables=tables)
    args = example_inputs(meta)
    program = export_program(serving, args)
    tmp = tmp_path(out)
    clear_stale_tmp(out.parent, lambda name: name == out.name)
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        torch.export.save(program, str(tmp / "model.pt2"))
        _check_archive(tmp / "model.pt2")
        write_spec(tmp, spec, vocab_files)
        write_score_script(tmp)
        onnx_problem = export_onnx(serving, args, tmp / "model.onnx") if onnx else None
        metrics = held_out_metrics(model, program.module(), meta, batch_size=cfg.data.eval_batch_size,
                                   max_rows=eval_rows)
        record = {"run_dir": str(Path(run_dir).resolve()), "checkpoint": str(path), "step": extra.get("step"),
                  "arch": cfg.model.arch, "precision": cfg.train.precision, "tables": tables,
                  "inputs": _input_names(args), "format": spec["format"],
                  "model_bytes": (tmp / "model.pt2").stat().st_size, "held_out": metrics,
                  "onnx": None if not onnx else ("model.onnx" if onnx_problem is None else f"not written: {onnx_problem}"),
                  "torch": torch.__version__, "seconds": round(time.perf_counter() - started, 2)}
        (tmp / "export.json").write_text(json.dumps(record, indent=2) + "\n")
        (tmp / "README.md").write_text(artifact_readme(record, spec))
        replace_dir(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return record


def _check_out(out: Path, overwrite: bool, inputs: list[tuple[str, Path]]) -> None:
    """Before anything is written: ``out`` is none of ``inputs`` and holds none; an existing
    ``out`` is replaced only with ``overwrite`` and only when it is an earlier export."""
    refuse_over_inputs(out, inputs)
    if not out.exists() and not out.is_symlink():
        return
    if not overwrite:
        raise ConfigError(f"{out}: already exists (--overwrite replaces an earlier export)")
    problem = export_in_the_way(out)
    if problem is not None:
        raise ConfigError(f"{out}: refusing to overwrite, it is not an export directory ({problem})")


_EXPORT_FILES = re.compile(
    r"model\.pt2|model\.onnx|model\.onnx\.data|score\.py|README\.md|export\.json"
    r"|preprocess/|preprocess/spec\.json|preprocess/vocab/|preprocess/vocab/[^/]+\.npy"
    r"|__pycache__/|__pycache__/score\.[^/]+\.pyc")
"""What an export directory holds (``__pycache__``: Python's, where ``score`` was imported)."""
_RECORD_FIELDS = ("run_dir", "checkpoint", "arch", "tables", "inputs", "format", "model_bytes", "held_out")
"""Fields of every ``export.json`` this module writes."""


def export_in_the_way(directory: Path) -> str | None:
    """Why ``directory`` is not an earlier export that ``--overwrite`` may replace, or None
    when it is one (or empty): an ``export.json`` with the fields, tables and format this
    module writes, and besides only the files of an export. One line naming what is in the way."""
    if directory.is_symlink() or not directory.is_dir():
        return "not a directory"
    if not any(directory.iterdir()):
        return None
    try:
        record = json.loads((directory / "export.json").read_text())
    except FileNotFoundError:
        return "no export.json"
    except (OSError, ValueError) as e:
        return f"export.json unreadable: {type(e).__name__}"
    if not isinstance(record, dict) or any(k not in record for k in _RECORD_FIELDS):
        missing = [k for k in _RECORD_FIELDS if not isinstance(record, dict) or k not in record]
        return f"export.json is not an export's record (no {', '.join(missing)})"
    if record["tables"] not in TABLES or record["format"] not in ("criteo", "csv", "parquet"):
        return f"export.json is not an export's record (tables {record['tables']!r}, format {record['format']!r})"
    extra = unknown_entry(directory, lambda rel: _EXPORT_FILES.fullmatch(rel) is not None)
    return None if extra is None else f"{extra} is not a file of an export"


def _check_archive(path: Path) -> None:
    """What score.py's ``load_model`` would refuse is not published: an archive torch wrote
    with something torch.export.load unpickles or runs (a model holding objects other than
    tensors, or a torch that writes more than the check knows) fails the export here rather
    than its users' scoring later."""
    from hybridrec.errors import HybridrecError
    from hybridrec.serve.score_template import archive_problem

    problem = archive_problem(path)
    if problem is not None:
        raise HybridrecError(f"model.pt2: torch wrote what score.py refuses to load: {problem}")


def describe(record: dict) -> list[tuple[str, str]]:
    """Rows of the table the command prints."""
    m = record["held_out"]
    rows = [("checkpoint", f"{record['checkpoint']} (step {record['step']})"),
            ("tables", record["tables"]), ("model.pt2", f"{record['model_bytes'] / 2**20:,.1f} MiB"),
            ("inputs", ", ".join(record["inputs"]))]
    if m.get("rows"):
        change = m["auc_exported"] - m["auc_eager"]
        rows += [("held-out rows", f"{m['rows']:,}"),
                 ("AUC eager (as trained)", f"{m['auc_eager']:.6f}"),
                 (f"AUC exported ({record['tables']})", f"{m['auc_exported']:.6f} ({change:+.6f})"),
                 ("max |p exported - p eager|", f"{m['max_abs_diff']:.2e}")]
    else:
        rows.append(("held-out", m.get("note", "not evaluated")))
    if record["onnx"] is not None:
        rows.append(("ONNX", record["onnx"]))
    return rows


def artifact_readme(record: dict, spec: dict) -> str:
    """``README.md`` of an artifact: what it holds, how to load and call it."""
    n_dense, n_oh, n_mh = len(spec["dense"]), len(spec["onehot"]), len(spec["multihot"])
    mh = n_mh > 0
    call = "dense, ids, mh_ids, mh_lengths" if mh else "dense, ids"
    m = record["held_out"]
    metrics = (f"Held-out split ({m['rows']:,} rows): AUC {m['auc_exported']:.6f} exported, "
               f"{m['auc_eager']:.6f} as trained; largest probability difference {m['max_abs_diff']:.2e}."
               if m.get("rows") else "No held-out split was evaluated.")
    example_mh = (f"\nmh_lengths = torch.tensor([[2] * {n_mh}, [0] * {n_mh}])     # int64 [B, {n_mh}]: ids per bag\n"
                  "mh_ids = torch.zeros(int(mh_lengths.sum()), dtype=torch.int64)  # int64 [nnz], sample-major\n"
                  ) if mh else "\n"
    return f"""# Serving artifact

Exported by `hybridrec export` from `{record['run_dir']}`, checkpoint `{record['checkpoint']}`
(step {record['step']}), {record['arch']}, tables stored as {record['tables']}, torch {record['torch']}.
{metrics}

| file | what |
|---|---|
| `model.pt2` | the model, a `torch.export` program: inputs below, output click probabilities float32 `[B]` |
| `preprocess/spec.json` | raw row -> inputs: column order, key rule, per-feature encoding, dense transform |
| `preprocess/vocab/*.npy` | vocabulary encoding: raw keys, key `vocab[i]` has id `i + 1` (else 0) |
| `score.py` | `python score.py INPUT OUTPUT.csv`: raw {spec['format']} rows to one probability per row (torch and numpy only) |
| `export.json` | what was exported, held-out metrics |

## Load and call

```python
import torch
from score import load_model  # score.py, beside model.pt2

model = load_model("model.pt2")  # torch.export.load(...).module() once the archive is checked
dense = torch.zeros(2, {n_dense})                   # float32 [B, {n_dense}]: {', '.join(spec['dense'][:3])}... after {_transform_text(spec['dense_transform'])}
ids = torch.zeros(2, {n_oh}, dtype=torch.int64)     # int64 [B, {n_oh}]: one-hot features' table ids{example_mh}with torch.no_grad():
    probabilities = model({call})   # float32 [B]
```

`load_model` first refuses an archive that `torch.export.load` would unpickle parts of or
run code from (pickled weights or objects, guards or shape expressions other than torch's own);
`torch.export.load` alone does both, so call it directly only on a model.pt2 you made yourself.
The batch size is free (1 and up). Columns follow `spec.json`: `dense` in its `dense` order,
`ids` in its `onehot` order{', `mh_lengths` in its `multihot` order and `mh_ids` holding the bags sample-major (row 0 bags in feature order, then row 1 bags ...)' if mh else ''}.
Ids are the table ids preprocessing makes (`spec.json` `rules`); an id outside a table is an error.

## Score raw rows

```
python score.py INPUT OUTPUT.csv [--batch-rows N]
```

INPUT: {_input_help(spec)}. OUTPUT.csv: a `probability` header, then one line per input row.
`score.py` needs only torch and numpy; it applies `preprocess/` itself.
{_onnx_help(record)}"""


def _onnx_help(record: dict) -> str:
    if record["onnx"] != "model.onnx":
        return ""
    return ("\n## ONNX\n\n`model.onnx` (weights in `model.onnx.data`): the same inputs, by name, and output "
            "`probability`, e.g.\n`onnxruntime.InferenceSession(\"model.onnx\").run(None, {\"dense\": ..., "
            "\"ids\": ...})` with numpy arrays.\n")


def _input_help(spec: dict) -> str:
    if spec["format"] == "criteo":
        return ("Criteo TSV, plain or `.gz`: 40 tab-separated fields (label, I1..I13, C1..C26) or 39 "
                "(no label); the label is ignored")
    if spec["format"] == "csv":
        return (f"CSV with a header row (plain or `.gz`), fields separated by `{spec['csv']['csv_delimiter']}`, "
                f"multi-hot cells by `{spec['csv']['list_delimiter']}`; the label column may be absent")
    return "the model was trained on Parquet, which score.py does not read (it would need pyarrow)"
