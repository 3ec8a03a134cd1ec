"""Run-directory outputs: metrics.jsonl (+ optional TensorBoard), peak memory. (Atomic JSON
and text files: :mod:`hybridrec.files`.)

``metrics.jsonl`` holds one JSON object per :meth:`MetricLogger.log` call::

    {"step": 100, "split": "train", "time": 1718000000.1, "loss": 0.45, "auc": null}

Values are numbers (or ``null``: NaN and ±inf are not JSON, and an undefined
metric such as a one-class AUC is written as ``null``), so scripts and
benchmarks read numbers, never log text.
"""

from __future__ import annotations

import contextlib
import json
import math
import numbers
import os
import resource
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from hybridrec.errors import HybridrecError, naming
from hybridrec.files import write_text_atomic

if TYPE_CHECKING:
    from typing_extensions import Self  # typing.Self needs Python 3.11

METRICS_FILE = "metrics.jsonl"
TENSORBOARD_DIR = "tensorboard"
_RESERVED = ("step", "split", "time")


def _number(key: str, value: Any) -> int | float | None:
    """One metric value → int, finite float or None (NaN/inf/None → None)."""
    if isinstance(value, (torch.Tensor, np.ndarray)):
        numel = value.numel() if isinstance(value, torch.Tensor) else value.size
        if numel != 1:
            raise TypeError(f"metric {key!r}: expected a scalar, got shape {tuple(value.shape)}")
        # .item() on a device tensor is a host sync; callers on the training path
        # should pass numbers they already read (e.g. from RunningLoss.compute()).
        value = value.item()
    if value is None:
        return None
    if isinstance(value, np.generic):
        value = value.item()
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real):
        value = float(value)
        return value if math.isfinite(value) else None
    raise TypeError(f"metric {key!r}: expected a number, got {type(value).__name__}")


def peak_memory_bytes() -> int:
    """Peak resident set size of this process, in bytes (``ru_maxrss``).

    Linux reports ``ru_maxrss`` in KiB, macOS in bytes.
    """
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak) if sys.platform == "darwin" else int(peak) * 1024


def cuda_peak_memory_bytes(device: torch.device | int | None = None) -> int | None:
    """``torch.cuda.max_memory_allocated`` for ``device``, or None when CUDA is not in use.

    "In use" means initialised in this process: asking an uninitialised CUDA
    would create a context (hundreds of MiB) just to report zero.
    """
    if not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return None
    if isinstance(device, (str, torch.device)) and torch.device(device).type != "cuda":
        return None  # (a CPU run in a process that used CUDA before)
    return int(torch.cuda.max_memory_allocated(device))


class MetricLogger:
    """Appends metrics to ``run_dir/metrics.jsonl`` and optionally to TensorBoard.

    The file is opened in append mode so a resumed run continues the same log;
    ``keep_until`` first drops the records of later steps (those a resumed run trains
    again), so no step appears twice.

    Args:
        run_dir: the run directory (created if missing).
        tensorboard: also write scalars under ``run_dir/tensorboard`` as
            ``{split}/{name}`` (needs the ``tensorboard`` package).
        flush_every: flush the files every this many :meth:`log` calls; 1 loses
            nothing on a crash, larger values save syscalls on chatty logs.
        keep_until: drop the existing records of steps after this one first
            (None: keep every record).
    """

    def __init__(
        self, run_dir: str | os.PathLike[str], *, tensorboard: bool = False, flush_every: int = 1,
        keep_until: int | None = None,
    ) -> None:
        if flush_every < 1:
            raise ValueError(f"MetricLogger: flush_every must be >= 1, got {flush_every}")
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.path = self.run_dir / METRICS_FILE
        self.flush_every = flush_every
        if keep_until is not None:
            drop_records(self.path, lambda r: r["step"] > keep_until)
        self._writer = _summary_writer(self.run_dir / TENSORBOARD_DIR) if tensorboard else None
        self._file = _open_append(self.path)
        self._lines: list[str] = []  # records not yet written (see flush_every)

    def drop(self, predicate: Callable[[dict], bool]) -> int:
        """Removes the records for which ``predicate(record)`` is true from the file
        (atomically, see :func:`drop_records`); logging continues after them."""
        if self._file is None:
            raise RuntimeError("MetricLogger.drop called after close()")
        self.flush()
        self._file.close()
        try:
            return drop_records(self.path, predicate)
        finally:
            self._file = _open_append(self.path)

    def log(self, step: int, metrics: dict[str, Any], *, split: str = "train") -> None:
        """Appends one record ``{"step", "split", "time", **metrics}``.

        Args:
            step: the global training step.
            metrics: name → number (int, float, numpy or one-element tensor);
                NaN/inf/None are written as ``null``.
            split: "train", "eval", "test", ...
        """
        if self._file is None:
            raise RuntimeError("MetricLogger.log called after close()")
        record: dict[str, Any] = {"step": int(step), "split": split, "time": time.time()}
        for key, value in metrics.items():
            if key in _RESERVED:
                raise ValueError(f"metric name {key!r} is reserved in metrics.jsonl")
            record[key] = _number(key, value)
        self._lines.append(json.dumps(record, allow_nan=False) + "\n")
        if self._writer is not None:
            for key, value in record.items():
                if key not in _RESERVED and value is not None:
                    self._writer.add_scalar(f"{split}/{key}", value, int(step))
        if len(self._lines) >= self.flush_every:
            self.flush()

    def flush(self) -> None:
        """Writes the records not yet written (and flushes TensorBoard's events). Whole
        records only: when the write fails (e.g. ``OSError`` ``RUN/metrics.jsonl: No space
        left on device``) the file is cut back to where it was, and those records are gone."""
        if self._file is not None and self._lines:
            data, self._lines = "".join(self._lines).encode("utf-8"), []
            with naming(self.path):
                _append_whole(self._file, data)
        if self._writer is not None:
            self._writer.flush()

    def close(self) -> None:
        """Flushes and closes (the file is closed even when the last write fails); safe to
        call twice."""
        if self._file is None:
            return
        try:
            self.flush()
        finally:
            self._file.close()
            self._file = None
            if self._writer is not None:
                self._writer.close()
                self._writer = None

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def _open_append(path: Path):
    """``path`` opened for appending bytes, unbuffered: :class:`MetricLogger` keeps its own
    buffer, so that a failed write can be taken back whole. (A run's metrics.jsonl that is
    a symbolic link is refused before the run starts: hybridrec.train.run_files.)"""
    return open(path, "ab", buffering=0)  # closed in MetricLogger.close()


def _append_whole(f, data: bytes) -> None:
    """Appends ``data`` to the unbuffered file ``f``, or, when a write fails part way
    (a full disk), cuts the file back to its size before and re-raises."""
    start = os.fstat(f.fileno()).st_size
    view = memoryview(data)
    try:
        while view:
            view = view[f.write(view):]
    except BaseException:
        with contextlib.suppress(OSError):
            os.ftruncate(f.fileno(), start)
        raise


def drop_records(path: str | Path, predicate: Callable[[dict], bool]) -> int:
    """Rewrites the JSONL file ``path`` without the records for which ``predicate`` is
    true, through a temporary file (readers see the old file or the new one); lines that
    are not a JSON record (a line cut short by a crash) go too. Returns how many lines
    went; the file is untouched when none does (or it does not exist)."""
    path = Path(path)
    try:
        lines = path.read_text(encoding="utf-8").splitlines(keepends=True)
    except FileNotFoundError:
        return 0
    kept = []
    for line in lines:
        try:
            record = json.loads(line)
            keep = isinstance(record, dict) and not predicate(record)
        except (ValueError, KeyError, TypeError):
            keep = False
        if keep:
            kept.append(line if line.endswith("\n") else line + "\n")
    if len(kept) != len(lines):
        write_text_atomic(path, "".join(kept))
    return len(lines) - len(kept)


def _summary_writer(log_dir: Path) -> Any:
    """A TensorBoard SummaryWriter, imported only when asked for (optional dependency)."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as err:
        raise HybridrecError(
            "TensorBoard logging needs the tensorboard package: "
            "pip install tensorboard (or pip install 'hybridrec[tensorboard]')"
        ) from err
    return SummaryWriter(log_dir=str(log_dir))
