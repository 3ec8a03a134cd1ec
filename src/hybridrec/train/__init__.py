"""Training: configs, building a run, the loop, checkpoints (docs/design.md).

``hybridrec.train`` is this package once any of its modules is imported, and it is also
the Python API's call ``hybridrec.train(config, **overrides)``
(:func:`hybridrec.serve.api.train`): so the package itself is callable.
"""

import sys
import types


class _CallablePackage(types.ModuleType):
    def __call__(self, *args, **kwargs):
        from hybridrec.serve.api import train

        return train(*args, **kwargs)


sys.modules[__name__].__class__ = _CallablePackage
