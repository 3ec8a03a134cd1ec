"""metrics.jsonl records, NaN → null, atomic JSON writes, optional TensorBoard."""

import json
import math
import mmap
import os
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from hybridrec.errors import HybridrecError
from hybridrec.files import write_json_atomic
from hybridrec.metrics import MetricLogger, peak_memory_bytes
from hybridrec.metrics import logger as logger_mod


def read_lines(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_jsonl_records_and_nan_to_null(tmp_path):
    run = tmp_path / "run"
    with MetricLogger(run) as log:
        log.log(1, {"loss": 0.5, "auc": float("nan"), "n": np.int64(3)})
        log.log(2, {"loss": torch.tensor(0.25), "inf": math.inf, "none": None}, split="eval")
    lines = read_lines(run / "metrics.jsonl")
    assert [(r["step"], r["split"]) for r in lines] == [(1, "train"), (2, "eval")]
    assert lines[0]["loss"] == 0.5 and lines[0]["auc"] is None and lines[0]["n"] == 3
    assert lines[1]["loss"] == 0.25 and lines[1]["inf"] is None and lines[1]["none"] is None
    assert all(isinstance(r["time"], float) for r in lines)
    # Appending: a resumed run continues the same file.
    with MetricLogger(run) as log:
        log.log(3, {"loss": 0.1})
    assert [r["step"] for r in read_lines(run / "metrics.jsonl")] == [1, 2, 3]


def test_log_rejects_non_numbers_and_reserved_names(tmp_path):
    log = MetricLogger(tmp_path, flush_every=10)
    with pytest.raises(TypeError, match="'name'"):
        log.log(0, {"name": "x"})
    with pytest.raises(ValueError, match="reserved"):
        log.log(0, {"step": 1})
    log.log(0, {"ok": 1})
    log.close()
    log.close()  # idempotent
    assert len(read_lines(tmp_path / "metrics.jsonl")) == 1
    with pytest.raises(RuntimeError):
        log.log(1, {"ok": 1})


def test_write_json_atomic_replaces_and_leaves_no_tmp(tmp_path):
    path = tmp_path / "sub" / "summary.json"
    write_json_atomic(path, {"auc": float("nan"), "x": (1, 2), "t": torch.tensor([1.5])})
    write_json_atomic(path, {"auc": 0.7, "nested": {"v": np.float32(0.5)}})
    assert json.loads(path.read_text()) == {"auc": 0.7, "nested": {"v": 0.5}}
    assert sorted(p.name for p in path.parent.iterdir()) == ["summary.json"]


def test_write_json_atomic_failure_keeps_old_file(tmp_path):
    path = tmp_path / "summary.json"
    write_json_atomic(path, {"a": 1})
    with pytest.raises(TypeError):
        write_json_atomic(path, {"a": object()})
    assert json.loads(path.read_text()) == {"a": 1}
    assert [p.name for p in tmp_path.iterdir()] == ["summary.json"]


def test_tensorboard_missing_gives_clear_error(tmp_path, monkeypatch):
    # A None entry in sys.modules makes the import fail as if the package were absent.
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)
    with pytest.raises(HybridrecError, match="pip install tensorboard"):
        MetricLogger(tmp_path, tensorboard=True)


def test_tensorboard_scalars_named_by_split(tmp_path, monkeypatch):
    calls = []

    class FakeWriter:
        def add_scalar(self, tag, value, step):
            calls.append((tag, value, step))

        def flush(self):
            pass

        def close(self):
            calls.append("closed")

    monkeypatch.setattr(logger_mod, "_summary_writer", lambda log_dir: FakeWriter())
    with MetricLogger(tmp_path, tensorboard=True) as log:
        log.log(5, {"auc": 0.8, "ne": float("nan")}, split="eval")
    assert calls == [("eval/auc", 0.8, 5), "closed"]


def _rss_bytes() -> int:
    """This process's resident set size now (Linux: /proc/self/statm, in pages)."""
    return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.skipif(not Path("/proc/self/statm").exists(), reason="needs Linux /proc")
def test_peak_memory_covers_a_measured_allocation():
    # The peak is a high-water mark, so compare with the resident size now plus a known
    # allocation (touched, so resident) rather than with an earlier peak.
    # An anonymous mapping of its own, every page written: fresh resident pages (a tensor
    # could reuse freed memory the allocator kept resident, and RSS would not move).
    size = 128 << 20
    before = _rss_bytes()
    block = mmap.mmap(-1, size)
    for at in range(0, size, mmap.PAGESIZE):
        block[at] = 1
    held = _rss_bytes()
    assert held - before >= 0.9 * size  # the allocation really is resident
    peak = peak_memory_bytes()
    # Bytes, not KiB, and covering the mapping (the kernel's high-water mark can lag the
    # resident size by a few pages, hence no exact ``peak >= held``).
    assert peak >= before + 0.9 * size
    # ... and not above what the machine has.
    assert peak <= os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    block.close()


def test_keep_until_drops_the_records_of_later_steps(tmp_path):
    with MetricLogger(tmp_path) as log:
        for step in (1, 2, 3):
            log.log(step, {"loss": 0.1})
        log.log(3, {"auc": 0.7}, split="eval")
    with (tmp_path / "metrics.jsonl").open("a") as f:
        f.write('{"step": 4, "spl')  # a line cut short by a crash
    with MetricLogger(tmp_path, keep_until=2) as log:  # resumed from step 2: 3 is trained again
        log.log(3, {"loss": 0.2})
        assert log.drop(lambda r: r["step"] == 1) == 1
        log.log(4, {"loss": 0.3})
    assert [(r["step"], r["split"], r["loss"]) for r in read_lines(tmp_path / "metrics.jsonl")] == [
        (2, "train", 0.1), (3, "train", 0.2), (4, "train", 0.3)]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["metrics.jsonl"]


def test_keep_until_leaves_a_file_with_nothing_to_drop_untouched(tmp_path):
    with MetricLogger(tmp_path) as log:
        log.log(1, {"loss": 0.1})
    before = (tmp_path / "metrics.jsonl").stat()
    MetricLogger(tmp_path, keep_until=1).close()
    after = (tmp_path / "metrics.jsonl").stat()
    assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns)


def test_files_written_atomically_get_the_mode_open_gives(tmp_path):
    old = os.umask(0o027)
    try:
        write_json_atomic(tmp_path / "summary.json", {"a": 1})
        with MetricLogger(tmp_path) as log:
            log.log(1, {"loss": 0.1})
            log.log(2, {"loss": 0.1})
            log.drop(lambda r: r["step"] == 2)  # rewritten through a temporary file
    finally:
        os.umask(old)
    modes = {p.name: p.stat().st_mode & 0o777 for p in tmp_path.iterdir()}
    assert modes == {"summary.json": 0o640, "metrics.jsonl": 0o640}
