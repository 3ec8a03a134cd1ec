"""Training: configs, building a run, the loop, checkpoints (docs/design.md).

``hybridrec.train`` is this package and also the Python API's call
``hybridrec.train(config, **overrides)`` (:func:`hybridrec.serve.api.train`): the package
above (hybridrec/__init__.py) makes it callable, so that this package imports nothing
above train/.
"""
