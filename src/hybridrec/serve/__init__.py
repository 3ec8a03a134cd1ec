"""Using a trained run: predictions for raw rows (``hybridrec predict``, ``hybridrec.load``)."""
