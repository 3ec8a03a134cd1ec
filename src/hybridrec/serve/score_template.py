#!/usr/bin/env python3
"""Score raw rows with the model beside this file: ``python score.py INPUT OUTPUT.csv``.

Written by ``hybridrec export``; needs only torch and numpy. It applies
``preprocess/spec.json`` to the rows itself (a second implementation of hybridrec's
preprocessing, kept small; hybridrec's tests hold it to the library's): Criteo TSV
(40 fields with the label, or 39 without; plain or gzip) or CSV with a header row (plain
or gzip; the label column may be absent). Models trained on Parquet are refused: reading
Parquet needs pyarrow. OUTPUT.csv gets a ``probability`` header and one line per row,
in input order, written to ``OUTPUT.csv.tmp-<pid>`` and renamed only when complete: a
malformed row stops the run with ``INPUT:LINE: field F: why`` and leaves an earlier
OUTPUT.csv as it was. An OUTPUT that is the INPUT (by any name) is refused. torch reads
model.pt2 only once :func:`load_model` found nothing in it that ``torch.export.load`` would
unpickle or run as code (pickled weights or objects, guards or shape expressions of Python).
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import csv
import gzip
import hashlib
import io
import itertools
import json
import os
import re
import sys
import zipfile
from pathlib import Path

import numpy as np
import torch

HERE = Path(__file__).resolve().parent
SPEC_VERSION = 1
MISSING = -1  # raw key of an empty categorical value (-> id 0)
HEX = np.full(256, 255, dtype=np.uint8)  # byte -> nibble; 255: not a hex digit
for _i, _c in enumerate(b"0123456789abcdef"):
    HEX[_c] = _i
for _i, _c in enumerate(b"ABCDEF"):
    HEX[_c] = 10 + _i


class ScoreError(Exception):
    """Bad input; the message names file, line and field."""


# ------------------------------------------------------------ keys -> ids, dense transform


class Encoder:
    """One feature's raw keys -> table ids (spec.json ``rules``). A vocabulary is sorted, or
    sorted then grown (new keys appended after the old ones): looked up through its sorting
    permutation then."""

    def __init__(self, entry: dict, root: Path) -> None:
        self.name, self.modulo = entry["name"], entry["modulo"]
        self.vocab = np.load(root / "preprocess" / entry["vocab"]) if entry["vocab"] else None
        if self.vocab is None and not self.modulo:
            raise ScoreError(f"spec.json: feature {self.name} has neither a vocabulary nor a modulo")
        if self.vocab is not None:
            ordered = bool(np.all(self.vocab[1:] > self.vocab[:-1]))
            self.order = None if ordered else np.argsort(self.vocab, kind="stable")
            self.sorted = self.vocab if ordered else self.vocab[self.order]

    def __call__(self, keys: np.ndarray) -> np.ndarray:
        if self.vocab is None:
            return np.where(keys < 0, 0, np.remainder(keys, self.modulo))
        k = keys if self.modulo is None else np.where(keys < 0, keys, np.remainder(keys, self.modulo))
        if len(self.vocab) == 0:
            return np.zeros(k.shape, dtype=np.int64)
        pos = np.minimum(np.searchsorted(self.sorted, k), len(self.vocab) - 1)
        hit = self.sorted[pos] == k
        if self.order is not None:
            pos = self.order[pos]
        return np.where(hit & (k >= 0), pos + 1, 0).astype(np.int64)


def transform(values: np.ndarray, how, names: list[str] | None = None) -> np.ndarray:
    """float64 values ``[n, len(names)]`` (NaN: missing) -> the model's float32 dense inputs.
    ``how``: spec.json's ``dense_transform``, one word for every column or each column's
    (``log1p``, ``none`` or ``{"transform": "standardize" | "log1p_standardize", "mean": M,
    "std": S}``: the log first, then the numbers); every
    missing value is 0 after the transform."""
    x = np.array(values, dtype=np.float64)
    missing = np.isnan(x)
    for j, name in enumerate(names if names is not None else map(str, range(x.shape[1]))):
        entry = how if isinstance(how, str) else how.get(name) if isinstance(how, dict) else None
        kind = entry if isinstance(entry, str) else entry.get("transform") if isinstance(entry, dict) else None
        if kind in ("log1p", "log1p_standardize"):
            x[:, j] = np.log1p(np.maximum(x[:, j], 0.0))
        if kind in ("standardize", "log1p_standardize"):
            x[:, j] = (x[:, j] - float(entry["mean"])) / float(entry["std"])
        elif kind not in ("log1p", "none"):
            raise ScoreError(f"spec.json: dense column {name}: unknown dense_transform {entry!r}")
    x[missing] = 0.0
    return x.astype(np.float32)


def sample_major(bags: list[tuple[np.ndarray, np.ndarray]]) -> tuple[np.ndarray, np.ndarray]:
    """Per-feature ``(ids row-major, lengths [n])`` -> ``(ids sample-major, lengths [n, F])``:
    row 0's bags in feature order, then row 1's (the model's ``mh_ids``, ``mh_lengths``)."""
    lengths = np.stack([n for _, n in bags], 1)
    by_feature = np.concatenate([ids for ids, _ in bags])
    km = lengths.T.reshape(-1)
    starts = (np.cumsum(km) - km).reshape(lengths.shape[1], -1).T.reshape(-1)
    flat = lengths.reshape(-1)
    src = np.repeat(starts - (np.cumsum(flat) - flat), flat) + np.arange(flat.sum())
    return by_feature[src], lengths


# ------------------------------------------------------------ Criteo TSV


def as_bytes(cells, width: int) -> np.ndarray:
    """Cells (bytes) -> uint8 ``[n, width]``, zero-padded (a longer cell is cut: its last
    byte is then non-zero, which the parsers below take as too long)."""
    return np.array(cells, dtype=f"S{width}").view(np.uint8).reshape(len(cells), width)


def hex_keys(u: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Hex ids of at most 8 digits (``as_bytes(cells, 9)``) -> (int64 keys, MISSING where
    empty; bad cells)."""
    present = u != 0
    nib = HEX[u]
    bad = (present & (nib == 255)).any(1) | present[:, 8] | (present[:, 1:] & ~present[:, :-1]).any(1)
    keys = np.zeros(len(u), dtype=np.int64)
    for k in range(8):  # Horner over the digit columns
        keys = np.where(present[:, k], keys * 16 + nib[:, k], keys)
    return np.where(present[:, 0], keys, MISSING), bad


def decimals(u: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Optionally signed integers of at most 18 characters (``as_bytes(cells, 19)``) ->
    (float64 values, 0 where empty; bad cells)."""
    present = u != 0
    digit = u - np.uint8(ord("0"))  # (wraps below '0': one comparison tests both ends)
    neg = (u[:, 0] == ord("-")) & present[:, 1]
    good = (digit < 10) | ~present
    good[:, 0] |= neg
    bad = ~good.all(1) | present[:, 18] | (present[:, 1:] & ~present[:, :-1]).any(1)
    values = np.zeros(len(u), dtype=np.int64)
    for k in range(18):  # Horner over the digit columns
        use = present[:, k] & (digit[:, k] < 10)
        values = np.where(use, values * 10 + digit[:, k].astype(np.int64), values)
    return np.where(neg, -values, values).astype(np.float64), bad


def hex_lists(cells: list[bytes]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Comma-separated hex ids -> (keys row-major, ids per row, bad rows)."""
    parts = [c.split(b",") if c else [] for c in cells]
    lengths = np.fromiter(map(len, parts), dtype=np.int64, count=len(parts))
    keys, bad = hex_keys(as_bytes(list(itertools.chain.from_iterable(parts)), 9))
    bad |= keys == MISSING  # "a,,b" or a trailing comma
    row = np.repeat(np.arange(len(cells)), lengths)
    return keys, lengths, np.bincount(row[bad], minlength=len(cells)) > 0


def check(bad: np.ndarray, c: int, why: str, where: tuple) -> None:
    """Raise for the first bad cell of column ``c`` of a block (``where``: the file, its
    lines before the block, the block's fields, fields per line, column names)."""
    if bad.any():
        path, line, flat, width, names = where
        i = int(np.argmax(bad))
        raise ScoreError(f"{path}:{line + i + 1}: field {names[c]} (column {c + 1}): {why}: "
                         f"{flat[i * width + c]!r}")


def criteo_blocks(stream, path: str, spec: dict, rows: int):
    """Blocks of ``(dense [n, D], {feature: keys [n]}, {feature: (keys, lengths)})``. The
    fields of a block are split at once and packed into one byte matrix (19 bytes a field:
    the widest valid dense value; a longer one-hot or dense field shows as too long);
    multi-hot cells are taken whole from the split."""
    dense_names = spec["dense"]
    cats = [f"C{i}" for i in range(1, 27)]
    multihot = {f["name"] for f in spec["multihot"]}
    width, line = None, 0
    for lines in iter(lambda: list(itertools.islice(stream, rows)), []):
        tabs = [ln.count(b"\t") for ln in lines]
        width = width or (tabs[0] + 1 if tabs[0] in (38, 39) else 40)
        if any(t != width - 1 for t in tabs):
            i = next(i for i, t in enumerate(tabs) if t != width - 1)
            raise ScoreError(f"{path}:{line + i + 1}: expected {width} tab-separated fields, got {tabs[i] + 1}")
        data = b"".join(lines).replace(b"\r\n", b"\n")
        flat = data[: -1 if data.endswith(b"\n") else None].replace(b"\n", b"\t").split(b"\t")
        n = len(lines)
        u = as_bytes(flat, 19).reshape(n, width, 19)
        skip = width - 39  # the label, when the file has one (ignored)
        names = [*["label"] * skip, *dense_names, *cats]
        where = (path, line, flat, width, names)
        dense = []
        for j in range(len(dense_names)):
            values, bad = decimals(u[:, skip + j])
            check(bad, skip + j, "not an integer", where)
            dense.append(values)
        onehot, bags = {}, {}
        for j, name in enumerate(cats):
            c = skip + len(dense_names) + j
            if name in multihot:
                keys, lengths, bad = hex_lists(flat[c::width])
                check(bad, c, "not a comma-separated list of hexadecimal ids", where)
                bags[name] = (keys, lengths)
            else:
                keys, bad = hex_keys(u[:, c, :9])
                check(bad, c, "not a hexadecimal id of at most 8 digits", where)
                onehot[name] = keys
        line += n
        yield np.stack(dense, 1), onehot, bags
    if line == 0:
        raise ScoreError(f"{path}: empty file (no lines)")


# ------------------------------------------------------------ CSV


def string_keys(cells) -> np.ndarray:
    """Cells -> 63-bit keys: BLAKE2b-64 of the UTF-8 text, little-endian, >> 1; empty -> MISSING."""
    u, inv = np.unique(np.array(cells, dtype=str), return_inverse=True)
    table = np.array([int.from_bytes(hashlib.blake2b(s.encode(), digest_size=8).digest(), "little") >> 1
                      for s in u.tolist()], dtype=np.int64)
    keys = table[inv.reshape(-1)] if len(u) else np.zeros(0, np.int64)
    return np.where(np.array(cells, dtype=str) == "", MISSING, keys)


def csv_numbers(cells, path: str, lines: list[int], name: str, col: int) -> np.ndarray:
    a = np.array(cells, dtype=str)
    out = np.full(a.size, np.nan)
    present = a != ""
    try:
        out[present] = a[present].astype(np.float64)
    except ValueError:
        out[present] = np.nan
        for i in np.flatnonzero(present):
            try:
                out[i] = float(a[i])
            except ValueError:
                raise ScoreError(f"{path}:{lines[i]}: field {name} (column {col}): not a number: {a[i]!r}") from None
    if np.isinf(out).any():
        i = int(np.argmax(np.isinf(out)))
        raise ScoreError(f"{path}:{lines[i]}: field {name} (column {col}): not a finite number: {a[i]!r}")
    return out  # (NaN: a missing value, 0 after the transform)


def csv_blocks(stream, path: str, spec: dict, rows: int):
    opts = spec["csv"]
    reader = csv.reader(io.TextIOWrapper(stream, encoding="utf-8", newline=""), delimiter=opts["csv_delimiter"])
    header = next(reader, None)
    if header is None:
        raise ScoreError(f"{path}: empty file (no header line)")
    index = {n: i for i, n in enumerate(header)}
    names = [*spec["dense"], *(f["name"] for f in spec["onehot"]), *(f["name"] for f in spec["multihot"])]
    absent = [n for n in names if n not in index]
    if absent:
        raise ScoreError(f"{path}: no column {absent[0]!r} (the model reads {', '.join(names)})")
    while True:
        block = []
        for row in reader:
            if row:
                block.append((reader.line_num, row))
                if len(block) == rows:
                    break
        if not block:
            return
        short = [(n, r) for n, r in block if len(r) != len(header)]
        if short:
            raise ScoreError(f"{path}:{short[0][0]}: expected {len(header)} fields, got {len(short[0][1])}")
        lines = [n for n, _ in block]
        cols = list(zip(*(r for _, r in block)))
        dense = np.stack([csv_numbers(cols[index[n]], path, lines, n, index[n] + 1) for n in spec["dense"]], 1) \
            if spec["dense"] else np.zeros((len(block), 0))
        onehot = {f["name"]: string_keys(cols[index[f["name"]]]) for f in spec["onehot"]}
        bags = {}
        for f in spec["multihot"]:
            cells = cols[index[f["name"]]]
            parts = [c.split(opts["list_delimiter"]) if c else [] for c in cells]
            if any("" in p for p in parts):
                i = next(i for i, p in enumerate(parts) if "" in p)
                raise ScoreError(f"{path}:{lines[i]}: field {f['name']} (column {index[f['name']] + 1}): "
                                 f"empty id in list {cells[i]!r}")
            lengths = np.fromiter(map(len, parts), dtype=np.int64, count=len(parts))
            bags[f["name"]] = (string_keys(list(itertools.chain.from_iterable(parts))), lengths)
        yield dense, onehot, bags


# ------------------------------------------------------------ the model, checked before torch reads it
# torch.export.load is not a safe reader: it unpickles (torch.load(weights_only=False),
# pickle.loads) weights and constants marked use_pickle, custom and opaque objects, the
# legacy data/weights/*.pt and data/constants/*.pt, sample inputs that weights_only=True
# refuses, and, when the archive fails to read, an older format's serialized_*.pt; it loads
# AOTInductor's compiled libraries; it evaluates each symbolic-shape expression with
# sympy.sympify (Python's eval); and the program's guards are Python source compiled into
# the module and run at every call. So load_model reads the archive first (zipfile, json
# and ast: nothing in it is run) and accepts only what torch.export.save writes for a plain
# program: raw tensor files and their JSON configs, sample inputs that load with
# weights_only=True, shape expressions of sympy's constructors and guards on input sizes.
# What runs is then torch's own operators on those tensors (the graph's targets resolve to
# torch's operators only). The check lives here because score.py is copied into the export
# and needs only torch and numpy; hybridrec imports it from here (hybridrec.serve.export),
# so there is one copy.

_ARCHIVE_FILES = {"archive_format", "archive_version", "byteorder", ".data/version", ".data/serialization_id"}
_ARCHIVE_ENTRY = re.compile(
    r"models/(?P<model>\w+)\.json|data/weights/(?:weight_\d+|(?P<weights>\w+)_weights_config\.json)"
    r"|data/constants/(?:tensor_\d+|(?P<constants>\w+)_constants_config\.json)"
    r"|data/sample_inputs/(?P<inputs>\w+)\.pt|extra/[^/]+")
_SYMBOL = re.compile(r"[a-z]+\d+")  # torch's shape symbols: s0, u3 ... (never a function's name)
_DIGITS = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?")  # a Float's string
_SYMPY_CALLS = frozenset({  # sympy's constructors and torch's sympy functions (srepr of a shape)
    "Symbol", "Integer", "Rational", "Float", "Add", "Mul", "Pow", "Mod", "Max", "Min", "Abs", "floor",
    "ceiling", "Eq", "Ne", "Lt", "Le", "Gt", "Ge", "StrictLessThan", "StrictGreaterThan", "LessThan",
    "GreaterThan", "Equality", "Unequality", "And", "Or", "Not", "FloorDiv", "ModularIndexing", "Where",
    "PythonMod", "CleanDiv", "CeilToInt", "FloorToInt", "CeilDiv", "LShift", "RShift", "PowByNatural",
    "FloatPow", "FloatTrueDiv", "IntTrueDiv", "ToFloat", "TruncToInt", "TruncToFloat", "RoundToInt",
    "RoundDecimal", "Identity"})
_ARITHMETIC = (ast.Add, ast.Sub, ast.Mult, ast.Div, ast.FloorDiv, ast.Mod, ast.Pow)
_COMPARISONS = (ast.Eq, ast.NotEq, ast.Lt, ast.LtE, ast.Gt, ast.GtE)
_SIZES = {"size", "stride", "storage_offset", "dim"}


def archive_problem(path: str | Path) -> str | None:
    """What in the torch.export archive ``path`` torch.export.load would unpickle, load as
    compiled code or evaluate as Python (see above); None: nothing."""
    try:
        with zipfile.ZipFile(path) as z:
            return _archive_problem(z)
    except Exception as e:  # noqa: BLE001 - whatever fails to read is refused, not loaded
        return f"unreadable ({type(e).__name__}: {e})"


def _archive_problem(z: zipfile.ZipFile) -> str | None:
    names = z.namelist()
    if len(set(names)) != len(names):
        return f"{next(n for n in names if names.count(n) > 1)}: in the archive twice"
    roots = {n.partition("/")[0] for n in names}
    if len(roots) != 1 or not all("/" in n for n in names):
        return "its entries are not all in one directory (torch would read it as an older format, of pickles)"
    for name in names:
        entry = name.partition("/")[2]
        m = _ARCHIVE_ENTRY.fullmatch(entry)
        if entry in _ARCHIVE_FILES:
            continue
        if m is None:
            return f"{name}: not part of a plain torch.export program (torch would load it as pickles or code)"
        if m["model"]:
            problem = _program_problem(json.loads(z.read(name)))
        elif m["weights"] or m["constants"]:
            problem = _payload_problem(json.loads(z.read(name)), "weight_" if m["weights"] else "tensor_")
        elif m["inputs"]:
            problem = _inputs_problem(z.read(name))
        else:
            continue
        if problem is not None:
            return f"{name}: {problem}"
    return None


def _payload_problem(config, prefix: str) -> str | None:
    """A weights or constants config: every entry a raw tensor file, none pickled."""
    entries = config.get("config") if isinstance(config, dict) else None
    if not isinstance(entries, dict):
        return "not a payload config"
    for fqn, p in entries.items():
        if not isinstance(p, dict) or p.get("use_pickle") is not False:
            return f"{fqn!r} is pickled (use_pickle), which torch.export.load would unpickle"
        if not isinstance(p.get("path_name"), str) or not re.fullmatch(rf"{prefix}\d+", p["path_name"]):
            return f"{fqn!r} is an object ({p.get('path_name')!r}), which torch.export.load would unpickle"
    return None


def _inputs_problem(data: bytes) -> str | None:
    """The sample inputs: torch reads them with weights_only=True, and if that fails, again
    without; so they must load with it."""
    if not data:
        return None
    try:
        torch.load(io.BytesIO(data), weights_only=True)
    except Exception as e:  # noqa: BLE001 - what weights_only refuses torch would unpickle
        return f"holds objects other than tensors, which torch.export.load would unpickle ({type(e).__name__})"
    return None


def _program_problem(program) -> str | None:
    """models/*.json: its shape expressions (sympify'd) and guards (compiled) only what
    torch.export writes: sympy constructors of shape symbols, comparisons of input sizes."""
    if not isinstance(program, dict):
        return "not a torch.export program"
    guards, ranges = program.get("guards_code") or [], program.get("range_constraints") or {}
    if not isinstance(guards, list) or not isinstance(ranges, dict):
        return "its guards or shape ranges are not a list and a dict"
    for guard in guards:
        if not isinstance(guard, str) or not _parses(guard, _guard_ok) or re.search(r"[#\\\n\"]", guard):
            return f"guard {_shown(guard)} is not a comparison of input sizes (it would run as Python)"
    for key in ranges:
        if not _parses(key, _sympy_ok):
            return f"shape symbol {_shown(key)} is not a symbol (it would be evaluated as Python)"
    for expr in _expressions(program):
        if not isinstance(expr, str) or not _parses(expr, _sympy_ok):
            return f"shape expression {_shown(expr)} is not one of sympy's (it would be evaluated as Python)"
    return None


def _shown(text) -> str:
    r = repr(text)
    return r if len(r) <= 100 else r[:97] + "..."


def _expressions(obj):
    """Every ``expr_str`` in the program's JSON (what the loader passes to sympify)."""
    stack = [obj]
    while stack:
        o = stack.pop()
        if isinstance(o, dict):
            if "expr_str" in o:
                yield o["expr_str"]
            stack.extend(o.values())
        elif isinstance(o, list):
            stack.extend(o)


def _parses(text: str, ok) -> bool:
    try:
        return ok(ast.parse(text, mode="eval").body)
    except (SyntaxError, ValueError, RecursionError):
        return False


def _sympy_ok(node) -> bool:
    """Numbers, shape symbols, arithmetic and calls of sympy's constructors; a string only as
    a Symbol's name or a Float's digits (a string elsewhere would be sympify'd: eval)."""
    if isinstance(node, ast.Constant):
        return type(node.value) in (int, float, bool)
    if isinstance(node, ast.Name):
        return _SYMBOL.fullmatch(node.id) is not None or node.id in ("oo", "zoo", "nan", "true", "false")
    if isinstance(node, ast.UnaryOp):
        return isinstance(node.op, (ast.USub, ast.UAdd, ast.Invert)) and _sympy_ok(node.operand)
    if isinstance(node, ast.BinOp):
        return (isinstance(node.op, (*_ARITHMETIC, ast.BitAnd, ast.BitOr))  # (& |: sympy's And, Or)
                and _sympy_ok(node.left) and _sympy_ok(node.right))
    if isinstance(node, ast.Compare):
        return _compares(node, _sympy_ok)
    if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in _SYMPY_CALLS):
        return False
    if not all(k.arg is not None and isinstance(k.value, ast.Constant) and type(k.value.value) in (bool, int)
               for k in node.keywords):
        return False
    args, name = node.args, node.func.id
    if name in ("Symbol", "Float") and args and _index(args[0], str):
        return len(args) == 1 and (_SYMBOL if name == "Symbol" else _DIGITS).fullmatch(args[0].value) is not None
    return name != "Symbol" and all(_sympy_ok(a) for a in args)


def _guard_ok(node) -> bool:
    """Comparisons and arithmetic of numbers and inputs' sizes: ``L['ids'].size()[0]``."""
    if isinstance(node, ast.Constant):
        return type(node.value) in (int, float, bool)
    if isinstance(node, ast.BoolOp):
        return all(map(_guard_ok, node.values))
    if isinstance(node, ast.UnaryOp):
        return isinstance(node.op, (ast.Not, ast.USub, ast.UAdd)) and _guard_ok(node.operand)
    if isinstance(node, ast.BinOp):
        return isinstance(node.op, _ARITHMETIC) and _guard_ok(node.left) and _guard_ok(node.right)
    if isinstance(node, ast.Compare):
        return _compares(node, _guard_ok)
    if isinstance(node, ast.Subscript):  # a size: L[...].size()[i]
        return _index(node.slice, int) and isinstance(node.value, ast.Call) and _guard_ok(node.value)
    return (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in _SIZES
            and _input(node.func.value) and not node.keywords and len(node.args) <= 1
            and all(_index(a, int) for a in node.args))


def _input(node) -> bool:
    """An input of the program: ``L['name']``, ``L['name'][0]`` ..."""
    if isinstance(node, ast.Name):
        return node.id == "L"
    return isinstance(node, ast.Subscript) and _index(node.slice, (int, str)) and _input(node.value)


def _compares(node: ast.Compare, ok) -> bool:
    return all(isinstance(o, _COMPARISONS) for o in node.ops) and all(map(ok, [node.left, *node.comparators]))


def _index(node, types) -> bool:
    """A constant of ``types`` (a type or a tuple of them); a string only an identifier."""
    kinds = types if isinstance(types, tuple) else (types,)
    return (isinstance(node, ast.Constant) and type(node.value) in kinds
            and (not isinstance(node.value, str) or node.value.isidentifier()))


def load_model(path: str | Path):
    """The exported program at ``path`` as a module, once :func:`archive_problem` found
    nothing in it that torch.export.load would unpickle or run; else :class:`ScoreError`."""
    problem = archive_problem(path)
    if problem is not None:
        raise ScoreError(f"{path}: refused: {problem}")
    return torch.export.load(str(path)).module()


# ------------------------------------------------------------ scoring


def open_binary(path: str):
    with open(path, "rb") as f:
        gz = f.read(2) == b"\x1f\x8b"  # gzip, whatever the name
    return gzip.open(path, "rb") if gz else open(path, "rb")


@contextlib.contextmanager
def staged(output_path: str, input_path: str):
    """``output_path`` open for writing under a temporary name beside it, renamed into place
    (after an fsync) once the block ends without error and removed if it raises, so an
    earlier output stays whole. An output that is the input is refused before anything opens."""
    try:
        same = os.path.samefile(output_path, input_path)  # (a hard link or symlink too)
    except OSError:
        same = os.path.realpath(output_path) == os.path.realpath(input_path)
    if same:
        raise ScoreError(f"{output_path}: is the input; write the probabilities to another file")
    if os.path.isdir(output_path):
        raise ScoreError(f"{output_path}: is a directory")
    tmp = f"{output_path}.tmp-{os.getpid()}"
    try:
        with open(tmp, "w") as out:
            yield out
            out.flush()
            os.fsync(out.fileno())
        os.replace(tmp, output_path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def model_inputs(block, spec: dict, encoders: dict) -> tuple[torch.Tensor, ...]:
    dense, onehot, bags = block
    n = len(dense)
    x = torch.from_numpy(transform(dense, spec["dense_transform"], spec["dense"]))
    ids = np.stack([encoders[f["name"]](onehot[f["name"]]) for f in spec["onehot"]], 1) \
        if spec["onehot"] else np.zeros((n, 0), np.int64)
    if not spec["multihot"]:
        return x, torch.from_numpy(ids.astype(np.int64))
    mh_ids, lengths = sample_major([(encoders[f["name"]](bags[f["name"]][0]), bags[f["name"]][1])
                                    for f in spec["multihot"]])
    return (x, torch.from_numpy(ids.astype(np.int64)), torch.from_numpy(mh_ids.astype(np.int64)),
            torch.from_numpy(lengths.astype(np.int64)))


def score(input_path: str, output_path: str, *, rows: int = 65536, root: Path | None = None) -> int:
    """Write one probability per row of ``input_path``; returns the number of rows. ``root``:
    the artifact directory (default: this file's)."""
    root = HERE if root is None else root
    spec = json.loads((root / "preprocess" / "spec.json").read_text())
    if spec.get("spec_version") != SPEC_VERSION:
        raise ScoreError(f"spec.json: spec_version {spec.get('spec_version')!r}; this score.py reads {SPEC_VERSION}")
    if spec["format"] not in ("criteo", "csv"):
        raise ScoreError(f"the model was trained on {spec['format']} files, which score.py does not read "
                         "(Parquet needs pyarrow); use `hybridrec predict`, or give the rows as CSV to a "
                         "model trained on CSV")
    encoders = {f["name"]: Encoder(f, root) for f in [*spec["onehot"], *spec["multihot"]]}
    blocks = criteo_blocks if spec["format"] == "criteo" else csv_blocks
    total, model = 0, None
    with open_binary(input_path) as stream, staged(output_path, input_path) as out:
        out.write("probability\n")
        for block in blocks(stream, input_path, spec, rows):
            if model is None:  # (loaded after the first block parses: a bad input fails at once)
                model = load_model(root / "model.pt2")
            with torch.no_grad():
                p = model(*model_inputs(block, spec, encoders))
            out.write("".join(f"{v:.9g}\n" for v in p.tolist()))
            total += len(block[0])
    return total


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("input", help="raw rows (Criteo TSV or CSV, plain or gzip)")
    p.add_argument("output", help="CSV of probabilities, one per input row")
    p.add_argument("--batch-rows", type=int, default=65536, help="rows per model call [65536]")
    args = p.parse_args(argv)
    try:
        n = score(args.input, args.output, rows=max(1, args.batch_rows))
    except (ScoreError, OSError, UnicodeDecodeError, EOFError, csv.Error) as e:
        print(f"score.py: error: {e}", file=sys.stderr)
        return 2
    print(f"{n} rows scored -> {args.output}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
