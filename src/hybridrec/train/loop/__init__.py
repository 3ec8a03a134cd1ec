"""The training loop: :class:`~hybridrec.train.loop.trainer.Trainer` runs a step source
(one thread, Hogwild's threads, a parameter-server trainer) and a list of parts
(:mod:`~hybridrec.train.loop.parts`: progress, evaluation and early stopping, checkpoint
policy, sync, failure injection, thread timing), the step itself and the optimizers.

Inside train/, the order of imports is: the package's top modules (build, run, ps_run,
init_from, demo) > loop/ > setup/ > checkpointing/ (tests/test_layers.py checks it).
"""
