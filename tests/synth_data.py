"""A small synthetic dataset through the CLI, as a user makes one: synth, then preprocess."""

from pathlib import Path


def synth_dataset(root: Path, *, days: int, rows: int) -> Path:
    """``days`` synthetic days of ``rows`` rows under ``root/raw``, preprocessed into
    ``root/data`` (the last day is the held-out split); returns ``root/data``."""
    from hybridrec.cli.main import main

    assert main(["data", "synth", "--out", str(root / "raw"), "--days", str(days),
                 "--rows-per-day", str(rows)]) == 0
    assert main(["data", "preprocess", *sorted(str(p) for p in (root / "raw").glob("day_*")),
                 "--out", str(root / "data")]) == 0
    return root / "data"
