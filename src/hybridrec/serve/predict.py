"""A trained run's probabilities for raw rows: ``hybridrec predict`` and ``Model.predict``.

Both go through :class:`Predictor`: the run's single-process model from one of its
checkpoints (:func:`hybridrec.train.run.load_run_model`, any world size or sharding plan),
its dataset's encoders read back from ``meta.json`` and ``vocab/``
(:func:`hybridrec.data.preprocess.load_encoders`), and for every chunk of raw rows
(:mod:`hybridrec.serve.inputs`) the ids preprocessing would have written
(:func:`~hybridrec.data.preprocess.encode_chunk`), the batches the loader would have built
(:func:`~hybridrec.data.loader.keyed_ids`) and ``sigmoid(logits)`` in float32, as
evaluation computes them. So the probabilities of the raw held-out file are those
``hybridrec eval`` scores.

Files stream chunk by chunk (a few thousand rows); memory holds one chunk, one output
buffer (:data:`FLUSH_ROWS` rows) and the model, whatever the input size. The output goes
to ``OUT.tmp-<pid>`` beside ``OUT`` and is fsynced and renamed to ``OUT`` once every input
is read, so an interrupted run (a malformed line, a full disk) leaves no file that looks
complete and an earlier ``OUT`` as it was; an ``OUT`` that is one of the inputs (by any
name) is refused before anything is written (:mod:`hybridrec.data.outputs`). The model
runs on the GPU when CUDA is available, else on the CPU.
"""

from __future__ import annotations

import contextlib
import csv
import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from hybridrec.data.chunk import ParseReport, RowChunk, check_on_bad_line
from hybridrec.data.inputs import check_inputs
from hybridrec.data.loader import keyed_ids
from hybridrec.data.outputs import commit_file, refuse_over_inputs
from hybridrec.data.preprocess import byte_progress, encode_chunk, load_encoders, tracked_chunks
from hybridrec.data.shards import tmp_path
from hybridrec.data.tabular import import_pyarrow
from hybridrec.errors import ConfigError, DataError, naming
from hybridrec.serve.inputs import read_file, table_chunks
from hybridrec.sparse.keyed_jagged import Batch
from hybridrec.train.loop.pipeline import to_device
from hybridrec.train.loop.thread_governor import thread_governor

PROBABILITY = "probability"
"""The output column of the probabilities."""
FLUSH_ROWS = 1 << 18
"""Predictions buffered before they are written (one Parquet row group)."""


def default_device() -> torch.device:
    """The current GPU when CUDA is available, else the CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


class Predictor:
    """A run's model, its dataset's encoders and the device, ready for raw rows."""

    def __init__(self, cfg, meta, model: torch.nn.Module, checkpoint: Path, *,
                 device: torch.device, batch_size: int) -> None:
        self.cfg, self.meta, self.checkpoint = cfg, meta, checkpoint
        self.device, self.batch_size = device, batch_size
        self.encoders = load_encoders(meta)
        self.model = model.to(device).eval()
        # On a CPU, the count of torch threads is chosen as training chooses it: by timing
        # chunks (one team of 2 threads runs 4x slower than 1 beside other busy processes).
        self.governor = thread_governor(0, world_size=1, workers=1, device=device)
        self.chunks = 0

    @staticmethod
    def load(run_dir: str | os.PathLike, *, checkpoint: str | None = None,
             device: str | torch.device | None = None, batch_size: int | None = None) -> Predictor:
        """``checkpoint``: ``best``, ``latest``, a checkpoint directory or None (the best
        when the run recorded one, else the newest), as ``hybridrec eval``'s."""
        from hybridrec.train.run import load_run_model

        cfg, meta, model, path, _ = load_run_model(run_dir, checkpoint=checkpoint)
        size = cfg.data.eval_batch_size if batch_size is None else int(batch_size)
        if size < 1:
            raise ConfigError(f"batch size must be >= 1, got {size}")
        return Predictor(cfg, meta, model, path.absolute(), batch_size=size,
                         device=torch.device(device) if device is not None else default_device())

    def predict_chunk(self, chunk: RowChunk) -> np.ndarray:
        """float32 ``[len(chunk)]`` probabilities, ``batch_size`` rows per forward."""
        start = time.perf_counter()
        out = self._predict(chunk)
        if self.governor is not None:
            self.governor.record(self.chunks, time.perf_counter() - start)
        self.chunks += 1
        return out

    @torch.no_grad()
    def _predict(self, chunk: RowChunk) -> np.ndarray:
        schema = self.meta.schema
        onehot, mh = encode_chunk(chunk, schema, self.encoders)
        starts = {n: np.concatenate([[0], np.cumsum(lengths)]) for n, (_, lengths) in mh.items()}
        out = np.empty(len(chunk), np.float32)
        for lo in range(0, len(chunk), self.batch_size):
            hi = min(len(chunk), lo + self.batch_size)
            bags = {n: (ids[starts[n][lo]:starts[n][hi]], lengths[lo:hi])
                    for n, (ids, lengths) in mh.items()}
            batch = Batch(dense=torch.from_numpy(np.ascontiguousarray(chunk.dense[lo:hi])),
                          sparse=keyed_ids(schema, onehot[lo:hi], bags),
                          labels=torch.zeros(hi - lo))
            logits = self.model(to_device(batch, self.device))
            # (.cpu() waits for the device: the numbers go to the output now)
            out[lo:hi] = torch.sigmoid(logits.float()).reshape(-1).cpu().numpy()
        return out

    def predict_table(self, data: Any) -> np.ndarray:
        """Probabilities of in-memory raw rows (DataFrame, Arrow table, dict of arrays), in
        order; a malformed row is an error naming its row and column."""
        parts = [self.predict_chunk(chunk) for chunk, *_ in table_chunks(data, self.meta, ParseReport())]
        return np.concatenate(parts) if parts else np.zeros(0, np.float32)


# ---------------------------------------------------------------- the output file


def output_format(out: Path) -> str:
    if out.suffix in (".parquet", ".pq"):
        return "parquet"
    if out.suffix == ".csv":
        return "csv"
    raise ConfigError(f"--out {out}: name a .parquet or .csv file (the format follows the extension)")


def check_out(out: Path, inputs: Sequence[str | os.PathLike]) -> str:
    """``out``'s format, once it is known to be no directory and none of ``inputs`` (the
    same path, or the same file by another name): the refusals before the model loads."""
    fmt = output_format(out)
    refuse_over_inputs(out, [("the input", Path(p)) for p in inputs])
    if out.is_dir():
        raise ConfigError(f"--out {out}: is a directory")
    return fmt


class PredictionWriter:
    """Kept columns and probabilities into ``out`` (Parquet or CSV), through a tmp file."""

    def __init__(self, out: Path, keep: Sequence[str]) -> None:
        self.out, self.keep, self.fmt = out, list(keep), output_format(out)
        if PROBABILITY in self.keep:
            raise ConfigError(f"--keep-columns {PROBABILITY}: that is the output column's name")
        if out.is_dir():
            raise ConfigError(f"--out {out}: is a directory")
        out.parent.mkdir(parents=True, exist_ok=True)
        self.tmp = tmp_path(out)
        self.rows = 0
        self._probs: list[np.ndarray] = []
        self._kept: dict[str, list] = {c: [] for c in self.keep}
        self._buffered = 0
        self._writer: Any = None
        self._file: Any = None

    def add(self, probs: np.ndarray, kept: dict[str, Any]) -> None:
        self._probs.append(probs)
        for c in self.keep:
            self._kept[c].append(kept[c])
        self._buffered += len(probs)
        self.rows += len(probs)
        if self._buffered >= FLUSH_ROWS:
            with naming(self.out):  # (a full disk names the output, not its tmp file)
                self._flush()

    def close(self) -> None:
        """Write what is buffered, close, and rename the tmp file to ``out`` (fsynced)."""
        with naming(self.out):
            self._flush(final=True)
            if self._writer is not None:
                self._writer.close()
            if self._file is not None:
                self._file.close()
            commit_file(self.tmp, self.out)

    def abort(self) -> None:
        for handle in (self._writer, self._file):
            # (already failing: the first error is the one to see)
            with contextlib.suppress(Exception):
                if handle is not None:
                    handle.close()
        self.tmp.unlink(missing_ok=True)

    def _flush(self, final: bool = False) -> None:
        if not self._buffered and not final:
            return
        probs = np.concatenate(self._probs) if self._probs else np.zeros(0, np.float32)
        if self.fmt == "parquet":
            self._write_parquet(probs)
        else:
            self._write_csv(probs)
        self._probs, self._kept = [], {c: [] for c in self.keep}
        self._buffered = 0

    def _write_parquet(self, probs: np.ndarray) -> None:
        pa, _, pq = import_pyarrow()
        cols = {c: _arrow_concat(pa, parts) for c, parts in self._kept.items()}
        table = pa.table({**cols, PROBABILITY: pa.array(probs, pa.float32())})
        if self._writer is None:
            self._writer = pq.ParquetWriter(self.tmp, table.schema)
        elif table.schema != self._writer.schema:
            table = table.cast(self._writer.schema)
        if table.num_rows or self.rows == 0:
            self._writer.write_table(table)

    def _write_csv(self, probs: np.ndarray) -> None:
        if self._file is None:
            self._file = open(self.tmp, "w", newline="")  # noqa: SIM115 (closed in close/abort)
            self._csv = csv.writer(self._file, lineterminator="\n")
            self._csv.writerow([*self.keep, PROBABILITY])
        texts = [f"{p:.9g}" for p in probs.tolist()]  # 9 digits: the float32 exactly
        if self.keep:
            cols = [_texts(parts) for parts in self._kept.values()]
            self._csv.writerows(zip(*cols, texts))
        else:
            self._file.write("".join(t + "\n" for t in texts))


def _arrow_concat(pa, parts: list):
    arrays = [p if isinstance(p, (pa.Array, pa.ChunkedArray)) else pa.array(p) for p in parts]
    arrays = [a.combine_chunks() if isinstance(a, pa.ChunkedArray) else a for a in arrays]
    if not arrays:
        return pa.array([], pa.string())
    return pa.concat_arrays([a.cast(arrays[0].type) for a in arrays])


def _texts(parts: list) -> list[str]:
    out: list[str] = []
    for p in parts:
        values = p.to_pylist() if hasattr(p, "to_pylist") else (p.tolist() if hasattr(p, "tolist") else p)
        out.extend("" if v is None else str(v) for v in values)
    return out


# ---------------------------------------------------------------- files


def predict_files(predictor: Predictor, inputs: Sequence[str | os.PathLike], out: str | os.PathLike,
                  *, keep: Sequence[str] = (), on_bad_line: str = "error",
                  progress: bool | None = None) -> dict:
    """Probabilities of every row of ``inputs`` (in order) into ``out``; returns a report:
    rows written, lines read, bad lines skipped (and the first few), seconds."""
    start = time.perf_counter()
    check_on_bad_line(on_bad_line)
    paths = check_inputs(list(inputs))
    out = Path(out)
    check_out(out, paths)
    writer = PredictionWriter(out, keep)
    report = ParseReport()
    try:
        with byte_progress(paths, "predict", progress) as bar:
            for path in paths:
                chunks = read_file(path, predictor.meta, on_bad_line=on_bad_line, report=report, keep=keep)
                for (chunk, kept, _), _pos in tracked_chunks(((c[:3], c[3]) for c in chunks), bar):
                    writer.add(predictor.predict_chunk(chunk), kept)
        if writer.rows == 0:
            raise DataError(f"{', '.join(map(str, paths))}: no valid rows to predict")
        writer.close()
    except BaseException:
        writer.abort()
        raise
    seconds = time.perf_counter() - start
    return {"out": str(out), "rows": writer.rows, "lines_read": report.lines_read,
            "bad_lines_skipped": report.bad_lines_skipped,
            "bad_line_examples": report.bad_line_examples, "seconds": round(seconds, 3),
            "rows_per_second": writer.rows / seconds if seconds > 0 else None,
            "checkpoint": str(predictor.checkpoint), "device": str(predictor.device)}
