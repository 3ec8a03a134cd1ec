"""hybridrec: communication-efficient training of DLRM-class recommendation models.

``hybridrec.load(run_dir)`` and ``hybridrec.train(config, **overrides)`` are the Python
API (:mod:`hybridrec.serve.api`); they are imported on first use, so ``import hybridrec``
stays cheap (no torch).
"""

__version__ = "0.1.0"

_LAZY = {"load": "hybridrec.serve.api"}


def __getattr__(name: str):
    import importlib

    if name == "train":  # the package, callable (hybridrec/train/__init__.py)
        return importlib.import_module("hybridrec.train")
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'hybridrec' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *_LAZY, "train"])
