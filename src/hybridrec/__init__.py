"""hybridrec: communication-efficient training of DLRM-class recommendation models.

``hybridrec.load(run_dir)`` and ``hybridrec.train(config, **overrides)`` are the Python
API (:mod:`hybridrec.serve.api`); they are imported on first use, so ``import hybridrec``
stays cheap (no torch).

``hybridrec.train`` is also the training package (:mod:`hybridrec.train`, which imports
nothing itself): this module imports it and makes it callable, so that both hold whichever
is used first. This module may import any layer (tests/test_layers.py); no layer imports
the API's names from it.
"""

import types as _types

from hybridrec import train

__version__ = "0.1.0"

_LAZY = {"load": "hybridrec.serve.api"}


class _CallablePackage(_types.ModuleType):
    """The train package, callable: ``hybridrec.train(...)`` is :func:`hybridrec.serve.api.train`."""

    def __call__(self, *args, **kwargs):
        from hybridrec.serve.api import train as train_run

        return train_run(*args, **kwargs)


train.__class__ = _CallablePackage


def __getattr__(name: str):
    import importlib

    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'hybridrec' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})
