"""A small synthetic dataset through the CLI, as a user makes one: synth, then preprocess.

The one place tests make a dataset (tests/conftest.py's ``shared_dataset`` calls it, once per
shape); the tests of ``data synth`` itself (test_data_cli.py, test_outputs_atomic.py) run the
command on their own."""

from pathlib import Path


def synth_dataset(root: Path, *, days: int, rows: int, synth: tuple[str, ...] = (),
                  preprocess: tuple[str, ...] = ()) -> Path:
    """``days`` synthetic days of ``rows`` rows under ``root/raw`` (``synth``: more
    `data synth` options), preprocessed into ``root/data`` with ``preprocess`` options (the
    last day is the held-out split); returns ``root/data``."""
    from hybridrec.cli.main import main

    assert main(["data", "synth", "--out", str(root / "raw"), "--days", str(days),
                 "--rows-per-day", str(rows), *synth]) == 0
    assert main(["data", "preprocess", *sorted(str(p) for p in (root / "raw").glob("day_*")),
                 "--out", str(root / "data"), *preprocess]) == 0
    return root / "data"


def synth_stream(root: Path, *, hours: int, rows: int, options: tuple[str, ...] = ()) -> Path:
    """``hours`` hour files of a drifting stream of ``rows`` rows each under ``root/stream``
    (``data synth --stream``; ``options``: more of its flags); returns the directory."""
    from hybridrec.cli.main import main

    assert main(["data", "synth", "--stream", "--out", str(root / "stream"), "--hours", str(hours),
                 "--rows-per-hour", str(rows), *options]) == 0
    return root / "stream"
