"""The Python API: ``hybridrec.train`` and ``hybridrec.load``; the README's example runs as
written, and ``Model.predict`` on rows in memory gives what ``hybridrec predict`` writes."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import hybridrec
from hybridrec.data.criteo import CATEGORICAL, DENSE
from hybridrec.errors import ConfigError, DataError

pa = pytest.importorskip("pyarrow")
import pyarrow.parquet as pq


def readme_example() -> str:
    """The ```python block of the README's "Using a trained model" section."""
    text = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    section = text.split("## Using a trained model\n", 1)[1].split("\n## ", 1)[0]
    (block,) = re.findall(r"^```python\n(.*?)^```\n", section, re.MULTILINE | re.DOTALL)
    return block


@pytest.fixture(scope="module")
def readme_run(shared_dataset, tmp_path_factory):
    """The README's example run where the README's usage lines put the data
    (``data/raw``: 7 synthetic days, ``data/pre``: preprocessed, the last day held out;
    links to a shared dataset, read-only)."""
    root = tmp_path_factory.mktemp("api")
    pre = shared_dataset(days=7, rows=250)
    (root / "data").mkdir()
    (root / "data/raw").symlink_to(pre.parent / "raw", target_is_directory=True)
    (root / "data/pre").symlink_to(pre, target_is_directory=True)
    block = readme_example()
    assert len(block.strip().splitlines()) <= 12
    namespace: dict = {}
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(root)
        exec(compile(block, "README.md", "exec"), namespace)  # noqa: S102 (the README's own code)
    return root, namespace


def raw_columns(path: Path) -> dict:
    """A Criteo TSV file as a dict of columns, as a user would load it: counts as ints, ids
    as their hex strings, missing values as None."""
    rows = [line.split("\t") for line in path.read_text().splitlines()]
    cols: dict = {"label": [int(r[0]) for r in rows]}
    for j, name in enumerate(DENSE, start=1):
        cols[name] = [int(r[j]) if r[j] else None for r in rows]
    for j, name in enumerate(CATEGORICAL, start=1 + len(DENSE)):
        cols[name] = [r[j] or None for r in rows]
    return cols


@pytest.mark.slow
def test_the_readme_example_trains_loads_and_predicts(readme_run, capsys):
    root, ns = readme_run
    run, model = ns["run"], ns["model"]
    summary = json.loads((root / "runs/api/summary.json").read_text())
    assert run.run_dir == (root / "runs/api").resolve()
    assert run.metrics == summary["eval"] and model.metrics == summary["eval"]
    assert 0 <= run.metrics["auc"] <= 1 and run.metrics["count"] == 250
    assert model.config.data.batch_size == 256 and model.config.model.embedding_dim == 16  # override, recipe
    assert isinstance(model.torch_module, torch.nn.Module) and not model.torch_module.training
    assert model.checkpoint.parent == (root / "runs/api/checkpoints").resolve()
    one = model.predict({**{f"I{i}": [3] for i in range(1, 14)}, **{f"C{i}": ["68fd1e64"] for i in range(1, 27)}})
    assert one.shape == (1,) and one.dtype == np.float32 and 0 < one[0] < 1


def test_predict_in_memory_equals_the_file_predictions(readme_run):
    root, ns = readme_run
    model = ns["model"]
    written = pq.read_table(root / "scores.parquet").column("probability").to_numpy()
    assert len(written) == 250
    cols = raw_columns(root / "data/raw/day_6.tsv")
    np.testing.assert_array_equal(model.predict(cols), written)
    np.testing.assert_array_equal(model.predict(pa.table(cols)), written)
    unlabelled = {k: np.array(v, dtype=object) for k, v in cols.items() if k != "label"}
    np.testing.assert_array_equal(model.predict(unlabelled), written)
    as_ints = dict(cols, C5=[None if v is None else int(v, 16) for v in cols["C5"]])  # ids as integers
    np.testing.assert_array_equal(model.predict(as_ints), written)
    # A row the model never saw still has a probability; a malformed one is an error.
    unseen, days = "fffffffe", sorted((root / "data/raw").glob("day_*.tsv"))
    assert len(days) == 7 and not any(unseen in day.read_text().lower() for day in days)
    new = model.predict({**{f"I{i}": [7] for i in range(1, 14)}, **{f"C{i}": [unseen] for i in range(1, 27)}})
    assert new.shape == (1,) and 0 < new[0] < 1
    with pytest.raises(DataError, match=r"input:3: field C2 \(column 16\): not a hexadecimal id"):
        model.predict(dict(cols, C2=["68fd1e64", "68fd1e64", "not-hex"] + cols["C2"][3:]))
    with pytest.raises(DataError, match="no column C26"):
        model.predict({k: v for k, v in cols.items() if k != "C26"})


def test_train_refuses_what_it_cannot_run(tmp_path):
    with pytest.raises(ConfigError, match="write SECTION__KEY=value"):
        hybridrec.train({"data": {"path": str(tmp_path)}}, batch_size=256)
    with pytest.raises(ConfigError, match="unknown config section"):
        hybridrec.train({"dataa": {"path": str(tmp_path)}})
    with pytest.raises(ConfigError, match="runs one process"):
        hybridrec.train({"data": {"path": str(tmp_path)}}, dist__nproc=2)


def test_import_hybridrec_stays_cheap():
    code = ("import sys, hybridrec; assert 'torch' not in sys.modules; "
            "assert callable(hybridrec.train) and 'torch' not in sys.modules; "
            "import hybridrec.train.setup.config; assert callable(hybridrec.train); "
            "assert callable(hybridrec.load)")
    subprocess.run([sys.executable, "-c", code], check=True)
