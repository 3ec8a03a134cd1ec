"""Shared test fixtures: datasets and small trained runs made once per session, handed out read-only.

Synthesizing and preprocessing a dataset through the CLI costs seconds, and ~35 files used to
make their own, often the same shape. Here each shape (days, rows per day) is made once per
session under a session tmp dir (``shared_dataset``), and each small run (a dataset, a step count,
overrides) is trained once (``trained_run``). Both are shared: a test only reads them. A test
that changes a dataset or a run copies it first (``dataset_copy``, ``run_copy``); at the end of
the session every shared dataset and run is checked against what it was when made, so a test
that writes into one fails there instead of silently changing the next test's input.

Tiers (markers registered in pyproject.toml): ``distributed`` starts several processes/ranks,
``slow`` takes over ~5 s on a loaded 2-core machine; the rest is the fast tier
(``-m "not slow and not distributed"``), which CI runs first.
"""

from __future__ import annotations

import hashlib
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
from synth_data import synth_dataset, synth_stream

from hybridrec.cli.main import DEBUG_ENV, main


@pytest.fixture(autouse=True)
def _no_debug_no_ranks(monkeypatch):
    """No test sees a --debug or a rank environment left by another or by the shell CI runs in.
    ``setenv`` first so monkeypatch remembers the value before (absent, most often) and
    restores it after the test: HYBRIDREC_DEBUG that ``main(["--debug", ...])`` sets goes too."""
    for name in (DEBUG_ENV, "RANK", "WORLD_SIZE", "TORCHELASTIC_ERROR_FILE"):
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)


def _digest(root: Path) -> dict[str, str]:
    """Every file under ``root`` by relative path, with a hash of its bytes."""
    return {str(p.relative_to(root)): hashlib.sha1(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


class _Shared:
    """Directories made once per session, each with its digest at making, checked at the end."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.made: dict[tuple, Path | BaseException] = {}
        self.digests: dict[Path, dict[str, str]] = {}

    def get(self, key: tuple, make: Callable[[Path], Path]) -> Path:
        """What ``make`` made for ``key``, made on the first request; a failure is kept and
        raised again to every later request (as pytest does for a failed fixture)."""
        if key not in self.made:
            where = self.root / f"{len(self.made):03d}"
            where.mkdir()
            try:
                self.made[key] = make(where)
            except BaseException as e:
                self.made[key] = e
                raise
            self.digests[where] = _digest(where)
        made = self.made[key]
        if isinstance(made, BaseException):
            raise made
        return made

    def changed(self) -> list[str]:
        return [f"{where}: changed by a test (copy it first: dataset_copy / run_copy)"
                for where, digest in self.digests.items() if _digest(where) != digest]


@pytest.fixture(scope="session")
def _shared(tmp_path_factory):
    shared = _Shared(tmp_path_factory.mktemp("shared"))
    yield shared
    changed = shared.changed()
    assert not changed, "; ".join(changed)


@pytest.fixture(scope="session")
def shared_dataset(_shared) -> Callable[..., Path]:
    """``shared_dataset(days=, rows=, synth=(), preprocess=())``: the preprocessed directory of
    ``days`` synthetic days of ``rows`` rows each (the last day held out; ``synth`` and
    ``preprocess``: more options of those commands), made once per shape through the CLI
    (tests/synth_data.py); its raw days are in ``<it>.parent / "raw"``. Read-only."""

    def get(*, days: int = 2, rows: int = 400, synth: tuple[str, ...] = (),
            preprocess: tuple[str, ...] = ()) -> Path:
        return _shared.get(("data", days, rows, tuple(synth), tuple(preprocess)),
                           lambda where: synth_dataset(where, days=days, rows=rows, synth=tuple(synth),
                                                       preprocess=tuple(preprocess)))

    return get


@pytest.fixture(scope="session")
def shared_stream(_shared) -> Callable[..., Path]:
    """``shared_stream(hours=, rows=, options=())``: a directory of ``hours`` landed hour files
    of a drifting stream (``data synth --stream``), made once per shape. Read-only: a test
    that lands files itself copies them into its own directory."""

    def get(*, hours: int = 3, rows: int = 1000, options: tuple[str, ...] = ()) -> Path:
        return _shared.get(("stream", hours, rows, tuple(options)),
                           lambda where: synth_stream(where, hours=hours, rows=rows, options=tuple(options)))

    return get


@pytest.fixture(scope="session")
def tiny_data(shared_dataset) -> Path:
    """The smallest dataset most tests need: 2 days (1 train, 1 held out) of 400 rows."""
    return shared_dataset(days=2, rows=400)


@pytest.fixture
def dataset_copy(shared_dataset, tmp_path) -> Callable[..., Path]:
    """``dataset_copy(days=, rows=)``: a private copy (raw days and preprocessed) of a shared
    dataset, for a test that changes it; returns the preprocessed directory."""

    def get(*, days: int = 2, rows: int = 400) -> Path:
        data = shared_dataset(days=days, rows=rows)
        root = tmp_path / f"data_{days}x{rows}"
        shutil.copytree(data.parent, root)
        return root / data.name

    return get


@pytest.fixture(scope="session")
def trained_run(_shared) -> Callable[..., Path]:
    """``trained_run(data, steps, *overrides, export=False)``: a run of the demo recipe trained
    ``steps`` steps on ``data`` (batch 64, no progress bar) with ``overrides``, made once per
    arguments; with ``export``, its export is in ``<run>.parent / "art"``. Read-only."""

    def get(data: Path, steps: int, *overrides: str, export: bool = False) -> Path:
        def make(where: Path) -> Path:
            run = where / "run"
            assert main(["train", "--recipe", "demo", f"data.path={data}", f"train.run_dir={run}",
                         "data.batch_size=64", "train.progress=false", f"train.max_steps={steps}",
                         *overrides]) == 0
            if export:
                assert main(["export", str(run), "--out", str(where / "art")]) == 0
            return run

        return _shared.get(("run", str(data), steps, overrides, export), make)

    return get


@pytest.fixture
def run_copy(tmp_path) -> Callable[[Path], Path]:
    """``run_copy(run)``: a private copy of a shared run (and its export, if any), for a test
    that changes it; returns the copied run directory."""

    def get(run: Path) -> Path:
        root = tmp_path / f"copy_{run.parent.name}"
        shutil.copytree(run.parent, root)
        return root / run.name

    return get
