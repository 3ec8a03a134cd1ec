"""The layer order of docs/design.md, checked on the source: a module imports only its own
layer and the layers below it, and model/ never imports torch.distributed.

Every import counts, including those inside functions (lazy imports are how the CLI stays
light, not a way around the order) and those under ``if TYPE_CHECKING``.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import hybridrec

LAYERS = ("cli", "bench", "serve", "train", "sync", "ps", "parallel", "comm", "model", "data", "sparse", "metrics")
"""Top to bottom. ``errors.py``, ``threads.py``, ``phases.py``, ``files.py`` and ``__init__.py`` at the package root are
below every layer (all may import them, they import no layer); ``__main__.py`` is above
every layer."""

PACKAGE = Path(hybridrec.__file__).parent
ROOT_SHARED = ("hybridrec", "hybridrec.errors", "hybridrec.threads", "hybridrec.phases", "hybridrec.files")
ENTRY = "hybridrec.__main__"
CALLED = {("hybridrec.train", "hybridrec.serve.api"), ("hybridrec", "hybridrec.train")}
"""Imports made when the Python API is first *used*, not when a module is imported: the root
package's lazy ``hybridrec.train`` / ``hybridrec.load`` attributes, and ``hybridrec.train(...)``,
the train package called, whose ``__call__`` hands over to ``hybridrec.serve.api.train``
(hybridrec/__init__.py, hybridrec/train/__init__.py)."""


def module_name(path: Path) -> tuple[str, bool]:
    """``(dotted name, is_package)`` of a file under the package directory."""
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    if parts[-1] == "__init__":
        return ".".join(parts[:-1]), True
    return ".".join(parts), False


def imported_modules(source: str, module: str, *, is_package: bool = False) -> list[tuple[int, str]]:
    """``(line, absolute module)`` for every import in ``source`` (the module ``module``),
    relative imports resolved; ``from X import a`` gives ``X`` and ``X.a`` (``a`` may be a
    submodule, which matters for ``from hybridrec import ...``);
    ``importlib.import_module("...")`` with a literal name counts too."""
    base = module.split(".") if is_package else module.split(".")[:-1]
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                if node.level - 1 >= len(base):
                    raise ValueError(f"{module}:{node.lineno}: relative import beyond the package")
                pkg = ".".join(base[:len(base) - (node.level - 1)])
                mod = f"{pkg}.{node.module}" if node.module else pkg
            else:
                mod = node.module
            out.append((node.lineno, mod))
            if "." not in mod:  # from hybridrec import train: the names are the modules
                out += [(node.lineno, f"{mod}.{a.name}") for a in node.names if a.name != "*"]
        elif (isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant)
              and isinstance(node.args[0].value, str)
              and getattr(node.func, "attr", getattr(node.func, "id", None))
              in ("import_module", "__import__")):
            out.append((node.lineno, node.args[0].value))
    return out


def rank(module: str) -> float:
    """Position in the order: 0 = cli ... 9 = metrics; the entry point above, the shared
    root modules below. Raises for a module outside the order."""
    if module == ENTRY:
        return -1
    if module in ROOT_SHARED:
        return len(LAYERS)
    parts = module.split(".")
    if len(parts) > 1 and parts[1] in LAYERS:
        return LAYERS.index(parts[1])
    raise ValueError(f"{module} is in no layer of docs/design.md's order")


def imported_rank(target: str) -> float | None:
    """The layer an import reaches, or None when it is not in a layer (another package,
    or a name of the root package such as ``hybridrec.errors`` or ``hybridrec.__version__``)."""
    parts = target.split(".")
    if parts[0] != "hybridrec":
        return None
    if len(parts) > 1 and parts[1] in LAYERS:
        return LAYERS.index(parts[1])
    return None


def layer_violations(source: str, module: str, *, is_package: bool = False) -> list[str]:
    """Every import of ``source`` that reaches a layer above ``module``'s own."""
    own = rank(module)
    bad = []
    for line, target in imported_modules(source, module, is_package=is_package):
        r = imported_rank(target)
        if r is not None and r < own and (module, target) not in CALLED:
            own_name = "the shared root modules" if own == len(LAYERS) else LAYERS[int(own)]
            bad.append(f"{module}:{line} imports {target} ({LAYERS[r]}/ is above {own_name})")
    return bad


def distributed_imports(source: str) -> list[str]:
    """Every use of ``torch.distributed`` in ``source``: ``import torch.distributed``,
    ``from torch.distributed... import``, ``from torch import distributed``, and the
    attribute ``torch.distributed`` (``import torch`` makes it reachable too)."""
    tree = ast.parse(source)
    torch_names = {"torch"} | {a.asname for n in ast.walk(tree) if isinstance(n, ast.Import)
                               for a in n.names if a.name == "torch" and a.asname}

    def is_dist(name: str | None) -> bool:
        return name is not None and (name == "torch.distributed"
                                     or name.startswith("torch.distributed."))

    bad = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            bad += [f"{node.lineno}: import {a.name}" for a in node.names if is_dist(a.name)]
        elif isinstance(node, ast.ImportFrom) and not node.level:
            if is_dist(node.module):
                bad.append(f"{node.lineno}: from {node.module} import ...")
            elif node.module == "torch":
                bad += [f"{node.lineno}: from torch import {a.name}" for a in node.names
                        if a.name == "distributed" or a.name.startswith("distributed.")]
        elif (isinstance(node, ast.Attribute) and node.attr == "distributed"
              and isinstance(node.value, ast.Name) and node.value.id in torch_names):
            bad.append(f"{node.lineno}: {node.value.id}.distributed")
    return bad


def _sources(under: Path = PACKAGE):
    for path in sorted(under.rglob("*.py")):
        name, is_package = module_name(path)
        yield path, name, is_package, path.read_text()


# ---------------------------------------------------------------- the checkers themselves


@pytest.mark.parametrize("module, source", [
    ("hybridrec.model.dlrm", "from hybridrec.train import config"),
    ("hybridrec.model.dlrm", "import hybridrec.parallel.topology"),
    ("hybridrec.comm.ledger", "from hybridrec import parallel"),
    ("hybridrec.model.dlrm", "from ..train import build"),
    ("hybridrec.data.loader", "def f():\n    from hybridrec.cli.main import main\n"),
    ("hybridrec.metrics.logger", ("from typing import TYPE_CHECKING\n"
                                  "if TYPE_CHECKING:\n    from hybridrec.sparse import Batch\n")),
    ("hybridrec.sparse.keyed_jagged", "import importlib\nimportlib.import_module('hybridrec.data')"),
    ("hybridrec.errors", "from hybridrec.metrics import auc"),
    ("hybridrec", "from hybridrec import cli"),
    ("hybridrec.train.setup.config", "from hybridrec.bench import compression"),
])
def test_checker_finds_a_planted_upward_import(module, source):
    assert len(layer_violations(source, module)) == 1


@pytest.mark.parametrize("module, source", [
    ("hybridrec.model.dlrm", "from hybridrec.sparse import KeyedJagged\nimport torch"),
    ("hybridrec.model.dlrm", "from . import mlp\nfrom .embedding import EmbeddingBagCollection"),
    ("hybridrec.data.schema", "from hybridrec import __version__\nfrom hybridrec.errors import DataError"),
    ("hybridrec.train.build", "import hybridrec\nfrom hybridrec.parallel import plan"),
    ("hybridrec.cli.plan", "def f():\n    from hybridrec.parallel.cost_model import OPTIMIZERS"),
    ("hybridrec.__main__", "from hybridrec.cli.main import main"),
    ("hybridrec.metrics.logger", "from hybridrec.metrics.classification import auc"),
])
def test_checker_passes_imports_that_go_down(module, source):
    assert layer_violations(source, module) == []


def test_relative_imports_resolve_from_the_package():
    assert (3, "hybridrec.model.mlp") in imported_modules(
        "\n\nfrom .mlp import MLP", "hybridrec.model.dlrm")
    # A package's __init__ is its own base; a module's base is its package.
    assert imported_modules("from ..comm import ledger", "hybridrec.parallel",
                            is_package=True) == [(1, "hybridrec.comm")]
    assert imported_modules("from ..comm import ledger", "hybridrec.parallel.plan") == [
        (1, "hybridrec.comm")]
    assert imported_modules("from . import plan", "hybridrec.parallel", is_package=True) == [
        (1, "hybridrec.parallel")]
    assert layer_violations("from .. import train", "hybridrec.model.dlrm") != []
    with pytest.raises(ValueError, match="beyond the package"):
        imported_modules("from ... import x", "hybridrec.model.dlrm")


@pytest.mark.parametrize("source", [
    "import torch.distributed as dist",
    "import torch.distributed",
    "from torch import distributed as dist",
    "from torch import nn, distributed",
    "from torch.distributed import all_reduce",
    "from torch.distributed.nn import functional",
    "import torch\n\ndef f():\n    return torch.distributed.is_initialized()",
    "import torch as T\nT.distributed.barrier()",
])
def test_distributed_checker_finds_a_planted_use(source):
    assert len(distributed_imports(source)) == 1, distributed_imports(source)


def test_distributed_checker_passes_plain_torch():
    assert distributed_imports("import torch\nfrom torch import nn\nimport torch.nn.functional as F\n"
                               "x = torch.zeros(1)\ndistributed = 1\n") == []


# ---------------------------------------------------------------- the code base


def test_every_subpackage_has_a_place_in_the_order():
    packages = {p.parent.name for p in PACKAGE.glob("*/__init__.py")}
    assert packages == set(LAYERS), ("add new packages to LAYERS and docs/design.md",
                                     packages ^ set(LAYERS))
    root = {p.stem for p in PACKAGE.glob("*.py")}
    assert root == {"__init__", "__main__", "errors", "threads", "phases", "files"}, root


def test_no_module_imports_a_layer_above_its_own():
    bad = [v for _, name, is_package, source in _sources()
           for v in layer_violations(source, name, is_package=is_package)]
    assert bad == [], "\n".join(bad)


def test_model_does_not_import_torch_distributed():
    found = [f"{path.relative_to(PACKAGE.parent)}:{v}" for path, _, _, source in
             _sources(PACKAGE / "model") for v in distributed_imports(source)]
    assert list(_sources(PACKAGE / "model")), "no model/ sources found"
    assert found == [], "\n".join(found)


# ---------------------------------------------------------------- inside train/

TRAIN_ORDER = ("", "loop", "setup", "checkpointing")
"""train/'s own order, top to bottom: the package's top modules (build, run, ps_run,
init_from, demo: they assemble a run), loop/ (the trainer, its parts, the step),
setup/ (config, rules, tables, memory), checkpointing/ (checkpoint directories, the
checkpointer, recovery); train/loop/__init__.py says the same."""


def train_rank(module: str) -> int | None:
    """Position of a ``hybridrec.train...`` module in :data:`TRAIN_ORDER` (None: outside train/,
    or the package itself)."""
    parts = module.split(".")
    if parts[:2] != ["hybridrec", "train"] or len(parts) < 3:
        return None
    return TRAIN_ORDER.index(parts[2]) if parts[2] in TRAIN_ORDER else 0


def train_violations(source: str, module: str, *, is_package: bool = False) -> list[str]:
    """Every import of ``source`` that reaches a part of train/ above ``module``'s own part
    (``from hybridrec.train import x`` counts as ``hybridrec.train.x``)."""
    own = train_rank(module)
    if own is None:
        return []
    targets = imported_modules(source, module, is_package=is_package)
    targets += [(n.lineno, f"hybridrec.train.{a.name}") for n in ast.walk(ast.parse(source))
                if isinstance(n, ast.ImportFrom) and n.module == "hybridrec.train" for a in n.names]
    bad = []
    for line, target in targets:
        r = train_rank(target)
        if r is not None and r < own:
            bad.append(f"{module}:{line} imports {target} (train/{TRAIN_ORDER[r] or '*.py'} is above "
                       f"train/{TRAIN_ORDER[own]})")
    return bad


@pytest.mark.parametrize("module, source", [
    ("hybridrec.train.setup.rules", "from hybridrec.train.loop.parts import Part"),
    ("hybridrec.train.checkpointing.recovery", "from hybridrec.train.setup import config"),
    ("hybridrec.train.loop.trainer", "def f():\n    from hybridrec.train import build"),
    ("hybridrec.train.checkpointing", "from ..loop import step"),
])
def test_train_checker_finds_a_planted_upward_import(module, source):
    assert len(train_violations(source, module, is_package=module.endswith("checkpointing"))) == 1


def test_train_checker_passes_imports_that_go_down():
    assert train_violations("from hybridrec.train.setup.config import Config\n"
                            "from hybridrec.train.checkpointing import checkpoint", "hybridrec.train.loop.optim") == []
    assert train_violations("from hybridrec.train.loop.trainer import Trainer", "hybridrec.train.build") == []


@pytest.mark.slow
def test_train_subpackages_import_only_downward():
    subpackages = {p.parent.name for p in (PACKAGE / "train").glob("*/__init__.py")}
    assert subpackages == set(TRAIN_ORDER) - {""}, ("add new train/ subpackages to TRAIN_ORDER", subpackages)
    bad = [v for _, name, is_package, source in _sources(PACKAGE / "train")
           for v in train_violations(source, name, is_package=is_package)]
    assert bad == [], "\n".join(bad)


def private_imports(source: str, module: str, *, is_package: bool = False) -> list[str]:
    """Every ``from hybridrec.X import _name`` in ``source`` that takes a private name of
    another module (function-level imports included): a name shared across modules is
    public in its home, with a docstring."""
    base = module.split(".") if is_package else module.split(".")[:-1]
    bad = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.ImportFrom):
            continue
        if node.level:
            pkg = ".".join(base[:len(base) - (node.level - 1)])
            target = f"{pkg}.{node.module}" if node.module else pkg
        else:
            target = node.module or ""
        if target.split(".")[0] != "hybridrec" or target == module:
            continue
        bad += [f"{module}:{node.lineno} imports {target}.{a.name}" for a in node.names
                if a.name.startswith("_") and not a.name.startswith("__")]
    return bad


@pytest.mark.parametrize("source", ["from hybridrec.data.tabular import _pyarrow\n",
                                    "def f():\n    from ..data.schema import read_meta, _parse_json\n"])
def test_private_checker_finds_a_planted_import(source):
    assert private_imports(source, "hybridrec.serve.inputs")


def test_private_checker_passes_public_and_own_names():
    assert private_imports("from hybridrec.data.tabular import import_pyarrow\n"
                           "from hybridrec.serve.inputs import _own\n", "hybridrec.serve.inputs") == []


def test_no_module_imports_a_private_name_of_another():
    bad = [v for _, name, is_package, source in _sources()
           for v in private_imports(source, name, is_package=is_package)]
    assert bad == [], "\n".join(bad)
