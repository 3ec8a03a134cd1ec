"""``train.publish_every``: a training run's model published while it trains.

A part of the training loop (:class:`Publisher`, given to :func:`hybridrec.train.run.train`
as an extra part by ``hybridrec train`` and the Python API): every ``N`` steps, or every
``N`` seconds of wall time (``30s``), it saves a checkpoint (every rank: a collective) unless
the step has one, and rank 0 exports it (:func:`hybridrec.serve.export.export_run`: the
format ``score.py``, ``hybridrec predict`` and ``hybridrec.load`` read, with a dynamic table's
key of each row as its vocabulary) into a new version ``RUN/published/vK/`` and moves
``RUN/published/LATEST`` to it (:func:`hybridrec.serve.published.publish`: both atomic), keeping
the newest ``train.publish_keep``. The last step is published once the run ends.

Each version's ``published.json`` records the step, the rows trained and, on a stream, the
files trained whole and the position in the file being read. A stream file's *freshness* is
the seconds from its landing (its ctime: the rename that landed it) to the publication of the
first version that trained on all of it; summary.json gives each file's and the median.
The export runs on rank 0 while the other ranks wait at their next collective: publishing
costs the run the export's seconds (recorded in the summary).
"""

from __future__ import annotations

import time
from typing import ClassVar

import torch
import torch.distributed as dist

from hybridrec.serve.published import checkpoint_export, publish
from hybridrec.train.checkpointing.checkpoint import step_dir
from hybridrec.train.loop.parts import Part


def parse_every(text: str) -> tuple[int, float]:
    """``train.publish_every`` as ``(steps, seconds)``, one of them 0."""
    text = text.strip()
    return (0, float(text[:-1])) if text.endswith("s") else (int(text), 0.0)


class Publisher(Part):
    """See the module's docstring."""

    absent: ClassVar[dict] = {"published": None}

    def __init__(self, every: str, *, keep: int) -> None:
        self.steps, self.seconds = parse_every(every)
        self.keep = keep
        self.versions: list[dict] = []
        self.export_s = 0.0
        self._last_time = time.monotonic()
        self._last_step: int | None = None

    def start(self, loop) -> None:
        self._last_time, self._last_step = time.monotonic(), loop.step

    def after_step(self, loop, done) -> None:
        if self._due(loop, done.step):
            self._publish(loop, saved=False)

    def close(self, loop) -> None:  # (after the final checkpoint)
        if loop.step > 0 and loop.step != self._last_step and loop.checkpoints.saved_step == loop.step:
            self._publish(loop, saved=True)

    def _due(self, loop, step: int) -> bool:
        if self.steps:
            return step % self.steps == 0
        due = time.monotonic() - self._last_time >= self.seconds
        if loop.topo.job_size > 1:  # (rank 0's clock decides for every rank)
            flag = torch.tensor([1 if due else 0], dtype=torch.int64, device=loop.topo.comm_device)
            dist.broadcast(flag, group=loop.topo.run_group, group_src=0)
            due = bool(flag.item())
        return due

    def _publish(self, loop, *, saved: bool) -> None:
        if not saved and loop.checkpoints.saved_step != loop.step:
            loop.save_checkpoint()
        self._last_time, self._last_step = time.monotonic(), loop.step
        if not loop.topo.lead:
            return
        loop.checkpoints.checkpointer.wait()  # (train.async_checkpoint: the files written)
        run_dir = loop.checkpoints.checkpointer.run_dir
        feed = getattr(loop.source, "stream", None)  # (a stream's: the files as the trained batches left them)
        info = {"trained_step": loop.step}
        if feed is not None:
            info["files"] = [{"name": f["name"], "rows": f["rows"], "done": f["done"]} for f in feed.files]
        start = time.perf_counter()
        path = step_dir(run_dir, loop.step)
        name = publish(run_dir, checkpoint_export(run_dir, str(path) if path.is_dir() else "latest", eval_rows=0),
                       info=info, keep=self.keep)
        now = time.time()
        self.export_s += time.perf_counter() - start
        self.versions.append({"version": name, "step": loop.step, "at": now})
        if feed is not None:  # the files this version is the first to train whole
            for f in feed.files:
                if f["done"] and f["name"] not in feed.freshness and f.get("landed") is not None:
                    feed.freshness[f["name"]] = {"freshness_s": round(now - float(f["landed"]), 3),
                                                 "published_in": name}

    def summary(self) -> dict:
        out = {"versions": len(self.versions), "last": self.versions[-1]["version"] if self.versions else None,
               "export_seconds": round(self.export_s, 2)}
        return {"published": out}


def publisher_parts(cfg) -> list[Part]:
    """The extra loop parts ``cfg`` asks for: a :class:`Publisher` with ``train.publish_every``."""
    t = cfg.train
    return [Publisher(t.publish_every, keep=t.publish_keep)] if t.publish_every else []
