"""What a run is and whether it can run, before anything is built: the config (typed,
read-only after validation), named recipes, the rules of which options combine
(:mod:`~hybridrec.train.setup.rules`, the one place), the dataset's tables and their
sharding plan, and each rank's memory estimate."""
