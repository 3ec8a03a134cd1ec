"""The layer order of docs/design.md, checked on the source: a module imports only its own
layer and the layers below it, no two modules import each other (directly or round a cycle),
and model/ never imports torch.distributed. Besides, facts with one home stay there: the
launcher's rank variables (hybridrec/launch_env.py), rank 0's broadcast of a Python value
(hybridrec/broadcast.py) and the synchronizers' names (hybridrec/sync/algorithms.py).

Every import counts, including those inside functions (lazy imports are how the CLI stays
light, not a way around the order) and those under ``if TYPE_CHECKING``.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import hybridrec

LAYERS = ("cli", "bench", "serve", "train", "sync", "ps", "parallel", "comm", "model", "data", "sparse", "metrics")
"""Top to bottom. ``errors.py``, ``threads.py``, ``phases.py``, ``files.py``, ``launch_env.py``,
``broadcast.py`` and ``__init__.py`` at the package root are below every layer (all may
import them, they import no layer); ``__main__.py`` is above every layer."""

PACKAGE = Path(hybridrec.__file__).parent
ROOT_SHARED = ("hybridrec", "hybridrec.errors", "hybridrec.threads", "hybridrec.phases", "hybridrec.files",
               "hybridrec.launch_env", "hybridrec.broadcast")
ENTRY = "hybridrec.__main__"
CALLED = {("hybridrec", "hybridrec.serve.api"), ("hybridrec", "hybridrec.train")}
"""The root package's imports of the Python API (hybridrec/__init__.py, which may import any
layer): the train package, which it makes callable (it imports nothing itself), and, when
the API is first *used*, ``hybridrec.serve.api`` (``hybridrec.train(...)``, and the lazy
``hybridrec.load``)."""


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
    assert root == {"__init__", "__main__", "errors", "threads", "phases", "files", "launch_env",
                    "broadcast"}, root


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


# ---------------------------------------------------------------- no import cycles


def _module_level(tree: ast.AST):
    """The nodes of ``tree`` outside function bodies (what runs when the module is imported)."""
    todo = [tree]
    while todo:
        node = todo.pop()
        yield node
        todo += [c for c in ast.iter_child_nodes(node)
                 if not isinstance(c, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda)]


def import_graph(modules: dict[str, tuple[bool, str]]) -> dict[str, set[str]]:
    """``{module: the modules it imports}`` over ``modules`` (``{name: (is_package, source)}``),
    function-level imports included: ``from X import a`` is ``X.a`` where that is a module,
    else ``X``; an import reaches the nearest module of ``modules`` named by it, and the
    packages above that one (their ``__init__`` runs first) unless the importer is inside them
    already; ``from hybridrec import load`` reaches the module the root package imports it
    from. The root package's own imports inside functions (the Python API, imported on first
    use) are not edges: its module level is."""
    lazy = {f"hybridrec.{n}": m for n, m in getattr(hybridrec, "_LAZY", {}).items()}

    def nearest(target: str) -> str:
        target = lazy.get(target, target)
        while target and target not in modules:
            target = target.rpartition(".")[0]
        return target

    graph = {}
    for name, (is_package, source) in modules.items():
        base = name.split(".") if is_package else name.split(".")[:-1]
        tree = ast.parse(source)
        targets = []
        for node in (_module_level(tree) if name == "hybridrec" else ast.walk(tree)):
            if isinstance(node, ast.Import):
                targets += [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    pkg = ".".join(base[:len(base) - (node.level - 1)])
                    mod = f"{pkg}.{node.module}" if node.module else pkg
                else:
                    mod = node.module or ""
                targets += [f"{mod}.{a.name}" if f"{mod}.{a.name}" in modules or f"{mod}.{a.name}" in lazy
                            else mod for a in node.names]
            elif (isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant)
                  and isinstance(node.args[0].value, str)
                  and getattr(node.func, "attr", getattr(node.func, "id", None))
                  in ("import_module", "__import__")):
                targets.append(node.args[0].value)
        edges = set()
        for target in filter(None, map(nearest, targets)):
            parts = target.split(".")
            edges.add(target)
            edges |= {".".join(parts[:k]) for k in range(1, len(parts))
                      if not (name + ".").startswith(".".join(parts[:k]) + ".")}
        edges.discard(name)
        graph[name] = {e for e in edges if e in modules}
    return graph


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every set of modules that import each other round a cycle (the graph's strongly
    connected components of more than one module), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            v, children = work[-1]
            w = next(children, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                component = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    component.append(w)
                    if w == v:
                        break
                if len(component) > 1:
                    cycles.append(sorted(component))
    return cycles


def _planted(**sources: str) -> dict[str, tuple[bool, str]]:
    """Planted modules: ``a__b="..."`` is module ``a.b``; a name ending in ``__init`` a package."""
    out = {}
    for key, source in sources.items():
        name = key.replace("__", ".")
        out[name.removesuffix(".init")] = (name.endswith(".init"), source)
    return out


def test_cycle_checker_finds_a_planted_cycle_through_function_level_imports():
    graph = import_graph(_planted(
        hybridrec__cli__main="from hybridrec.cli.launch import PEER_LOST\n",
        hybridrec__cli__launch="def rank_main():\n    from hybridrec.cli.train import run\n",
        hybridrec__cli__train="def f():\n    from hybridrec.cli import main\n",
        hybridrec__cli__init=""))
    assert import_cycles(graph) == [["hybridrec.cli.launch", "hybridrec.cli.main", "hybridrec.cli.train"]]


def test_cycle_checker_counts_a_package_init_that_imports_upward():
    # train/__init__ handing its call to serve.api, which imports train.run: importing
    # hybridrec.train.run runs train/__init__ first.
    graph = import_graph(_planted(
        hybridrec__init="",
        hybridrec__train__init="def __call__(*a):\n    from hybridrec.serve.api import train\n",
        hybridrec__train__run="x = 1\n",
        hybridrec__serve__init="",
        hybridrec__serve__api="from hybridrec.train.run import x\n"))
    assert import_cycles(graph) == [["hybridrec.serve.api", "hybridrec.train"]]
    # A package that imports its own modules is no cycle (they are inside it).
    assert import_cycles(import_graph(_planted(
        hybridrec__init="", hybridrec__sync__init="from hybridrec.sync.algorithms import A\n",
        hybridrec__sync__algorithms="import torch\n"))) == []


def test_cycle_checker_takes_the_root_packages_lazy_api_as_used_not_imported():
    planted = _planted(
        hybridrec__init="from hybridrec import train\n\ndef __getattr__(n):\n"
                        "    from hybridrec.serve.api import load\n",
        hybridrec__train__init="", hybridrec__train__run="from hybridrec import __version__\n",
        hybridrec__serve__init="", hybridrec__serve__api="import hybridrec.train.run\n")
    assert import_cycles(import_graph(planted)) == []
    planted["hybridrec"] = (True, "from hybridrec.serve import api\n")  # at import: a cycle
    assert import_cycles(import_graph(planted)) == [["hybridrec", "hybridrec.serve.api",
                                                     "hybridrec.train.run"]]


def test_no_import_cycles():
    graph = import_graph({name: (is_package, source) for _, name, is_package, source in _sources()})
    assert len(graph) > 100 and "hybridrec.cli.main" in graph["hybridrec.__main__"]
    assert import_cycles(graph) == []


def test_the_train_package_imports_nothing_above_train():
    """``hybridrec.train(...)`` is the root package's business (hybridrec/__init__.py)."""
    source = (PACKAGE / "train" / "__init__.py").read_text()
    outside = [t for _, t in imported_modules(source, "hybridrec.train", is_package=True)
               if t.startswith("hybridrec.") and not t.startswith("hybridrec.train")
               and t not in ROOT_SHARED]
    assert outside == []
    assert callable(hybridrec.train) and hybridrec.train.__name__ == "hybridrec.train"


# ---------------------------------------------------------------- one home per fact

LAUNCH_VARIABLES = ("WORLD_SIZE", "RANK", "LOCAL_WORLD_SIZE", "LOCAL_RANK")


def launch_variable_reads(source: str) -> list[int]:
    """Lines of ``source`` that name a launcher's rank variable other than to set it
    (``os.environ["RANK"] = ...``, or a key of an environment made for a child)."""
    tree = ast.parse(source)
    written = {id(n.slice) for n in ast.walk(tree)
               if isinstance(n, ast.Subscript) and isinstance(n.ctx, ast.Store)}
    written |= {id(k) for n in ast.walk(tree) if isinstance(n, ast.Dict) for k in n.keys if k is not None}
    return [n.lineno for n in ast.walk(tree) if isinstance(n, ast.Constant)
            and n.value in LAUNCH_VARIABLES and id(n) not in written]


@pytest.mark.parametrize("source", ['import os\nw = int(os.environ.get("WORLD_SIZE", "1"))\n',
                                    'import os\nlaunched = "RANK" in os.environ\n',
                                    'import os\nr = os.getenv("LOCAL_RANK")\n',
                                    'import os\nn = os.environ["LOCAL_WORLD_SIZE"]\n'])
def test_launch_variable_checker_finds_a_planted_read(source):
    assert len(launch_variable_reads(source)) == 1


def test_launch_variable_checker_passes_the_helper_and_writes():
    assert launch_variable_reads('from hybridrec import launch_env\nw = launch_env.world_size()\n'
                                 'import os\nos.environ["RANK"] = "0"\nenv = {"WORLD_SIZE": "2"}\n') == []


def test_the_rank_variables_are_read_in_launch_env_alone():
    found = [f"{path.relative_to(PACKAGE.parent)}:{line}" for path, name, _, source in _sources()
             if name != "hybridrec.launch_env" for line in launch_variable_reads(source)]
    assert found == [], "read them through hybridrec.launch_env:\n" + "\n".join(found)
    assert launch_variable_reads((PACKAGE / "launch_env.py").read_text())  # (the checker sees its home)


def object_broadcasts(source: str) -> list[int]:
    """Lines of ``source`` that use torch's pickled object broadcast."""
    return [n.lineno for n in ast.walk(ast.parse(source))
            if getattr(n, "attr", getattr(n, "id", None)) in ("broadcast_object_list", "broadcast_object")]


def test_object_broadcast_checker_finds_a_planted_use():
    assert object_broadcasts("import torch.distributed as dist\nbox = [1]\n"
                             "dist.broadcast_object_list(box, group_src=0)\n") == [3]
    assert object_broadcasts("from hybridrec.broadcast import rank0_value\nrank0_value(1, None)\n") == []


def test_rank0s_values_travel_through_one_helper():
    """Rank 0's Python value reaches the other ranks through hybridrec.broadcast.rank0_value
    (JSON, nothing unpickled), never a hand-written broadcast_object_list."""
    found = [f"{path.relative_to(PACKAGE.parent)}:{line}" for path, _, _, source in _sources()
             for line in object_broadcasts(source)]
    assert found == [], "use hybridrec.broadcast.rank0_value:\n" + "\n".join(found)
    homes = [name for _, name, _, source in _sources() if "def rank0_value(" in source]
    assert homes == ["hybridrec.broadcast"]


def synchronizer_names(source: str, names) -> list[int]:
    """Lines of ``source`` that spell one of the synchronizers' ``names`` as a string."""
    return [n.lineno for n in ast.walk(ast.parse(source))
            if isinstance(n, ast.Constant) and isinstance(n.value, str) and n.value in names]


def test_the_synchronizer_names_are_listed_in_one_place():
    from hybridrec.sync.algorithms import ALGORITHMS

    assert ALGORITHMS == ("ma", "easgd", "bmuf")
    assert synchronizer_names('if s.algorithm in ("none", "ma", "easgd"):\n    pass\n', ALGORITHMS) == [1, 1]
    found = [f"{path.relative_to(PACKAGE.parent)}:{line}" for path, name, _, source in _sources()
             if name != "hybridrec.sync.algorithms" for line in synchronizer_names(source, ALGORITHMS)]
    assert found == [], "read hybridrec.sync.algorithms.ALGORITHMS:\n" + "\n".join(found)


def test_build_trainer_stays_short():
    """The run's assembly reads in one screen: ``build_trainer`` at most 50 lines (each part
    built by a ``build_*`` of its own)."""
    import ast
    from pathlib import Path

    from hybridrec.train import build

    tree = ast.parse(Path(build.__file__).read_text())
    (fn,) = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "build_trainer"]
    assert fn.end_lineno - fn.lineno + 1 <= 50


# ---------------------------------------------------------------- the sparse backends

PS_NAMES = r"num_ps|PS_DIR|PS_PART|remote|servers$"
"""Names that say "a parameter-server run": ``dist.num_ps``, the servers' checkpoint part,
the remote collection, a handle on the servers."""
PS_HOMES = ("hybridrec/train/backends.py", "hybridrec/train/ps_run.py", "hybridrec/train/setup/rules.py")
"""Where parameter servers may be branched on: the sparse backends (chosen once), the
servers' own module and the run rules."""


def ps_branches(source: str) -> list[int]:
    """The lines of ``source`` whose branch condition names a parameter-server run (a name
    or attribute matching :data:`PS_NAMES`): ``if``/``elif``/``while`` tests, conditional
    expressions, comprehension filters and ``and``/``or`` expressions; comments, strings and
    docstrings are not code and do not count."""
    import re

    pattern = re.compile(PS_NAMES)
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.If, ast.While, ast.IfExp)):
            conditions = [node.test]
        elif isinstance(node, ast.comprehension):
            conditions = node.ifs
        elif isinstance(node, ast.BoolOp):
            conditions = [node]
        else:
            continue
        for c in conditions:
            names = [n.id if isinstance(n, ast.Name) else n.attr for n in ast.walk(c)
                     if isinstance(n, (ast.Name, ast.Attribute))]
            if any(pattern.search(x) for x in names):
                found.add(c.lineno)
    return sorted(found)


@pytest.mark.parametrize("source, lines", [
    ("if cfg.dist.num_ps:\n    pass\n", [1]),
    ("x = 1\nif a:\n    pass\nelif (path / PS_DIR).is_dir():\n    pass\n", [4]),
    ("y = f(s) if servers is None else g(s)\n", [1]),
    ("ok = a > 1 or bool(cfg.dist.num_ps)\n", [1]),
    ("xs = [p for p in ps if p.remote]\n", [1]),
    ("while self.servers:\n    break\n", [1]),
])
def test_ps_branch_checker_finds_a_planted_branch(source, lines):
    assert ps_branches(source) == lines


def test_ps_branch_checker_skips_comments_strings_and_plain_uses():
    source = ('"""if num_ps: a docstring"""\n'
              "# if cfg.dist.num_ps: a comment\n"
              'msg = "or servers" if a else "remote"\n'
              "n = cfg.dist.num_ps + 1\n"
              "self.servers.save(path)\n"
              "if a:\n    servers.load(path)  # (the body is not the condition)\n")
    assert ps_branches(source) == []


def test_parameter_servers_are_branched_on_in_the_backend_alone():
    """Parameter servers are a sparse backend chosen once (:mod:`hybridrec.train.backends`):
    outside it, the servers' module and the rules, train/ branches on them at most 3 times
    (the role split of :func:`hybridrec.train.run.train`: servers serve, trainers train)."""
    train = PACKAGE / "train"
    homes = {PACKAGE.parent / h for h in PS_HOMES}
    assert all(h.is_file() for h in homes), homes
    found = [f"{path.relative_to(PACKAGE.parent)}:{line}" for path in sorted(train.rglob("*.py"))
             if path not in homes for line in ps_branches(path.read_text())]
    assert len(found) <= 3, "branch on the sparse backend instead:\n" + "\n".join(found)
