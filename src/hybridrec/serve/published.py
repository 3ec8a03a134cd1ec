"""Published model versions of a run: ``RUN/published/vN/`` and ``RUN/published/LATEST``.

A version is an export directory (:func:`hybridrec.serve.export.export_run`: ``model.pt2``,
``export.json``, ``preprocess/``, ``score.py``) plus ``published.json`` (when it was
published and what the publisher knew: trained rows, step, data time). ``LATEST`` holds
the name of the newest version, one line. Writers (a streaming trainer's publisher,
``hybridrec serve``'s tests) go through :func:`publish`; readers (``hybridrec serve``)
through :func:`latest` and :func:`versions`::

    RUN/published/
        v1/  v2/  v3/          each an export directory, complete once it has its name
        LATEST                 "v3\\n"

Both steps are atomic, so a reader never sees half of anything: a version is written
under a temporary name beginning with ``.`` (which :func:`versions` ignores) and renamed
to ``vN`` once complete; ``LATEST`` is written to a temporary file and renamed over the
old one. A reader that follows ``LATEST`` therefore always finds a complete directory,
unless :func:`prune` removed it in between (a reader keeps what it loaded; the next
``LATEST`` names a newer one). :func:`prune` never removes the version ``LATEST`` names.

One publisher per run is assumed; two at once would still not overwrite each other (the
rename of a directory onto an existing ``vN`` fails and the next number is taken), but
their ``LATEST`` writes would race.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from hybridrec.errors import ConfigError, DataError

PUBLISHED = "published"
"""The folder of a run's published versions."""
LATEST = "LATEST"
"""The file naming the newest version."""
INFO = "published.json"
"""A version's record of its publication (beside ``export.json``)."""
_VERSION = re.compile(r"^v([0-9]+)$")


def published_dir(run_dir: str | os.PathLike) -> Path:
    return Path(run_dir) / PUBLISHED


def versions(run_dir: str | os.PathLike) -> list[str]:
    """The complete versions of a run, oldest first (``["v1", "v2", ...]``)."""
    try:
        names = [p.name for p in published_dir(run_dir).iterdir() if p.is_dir()]
    except FileNotFoundError:
        return []
    return sorted((n for n in names if _VERSION.match(n)), key=_number)


def _number(name: str) -> int:
    return int(_VERSION.match(name).group(1))


def latest_name(run_dir: str | os.PathLike) -> str | None:
    """The version ``LATEST`` names, or None when nothing was published."""
    file = published_dir(run_dir) / LATEST
    try:
        text = file.read_text().strip()
    except FileNotFoundError:
        return None
    if not _VERSION.match(text):
        raise DataError(f"{file}: {text[:40]!r} is not a version name (v1, v2, ...)")
    return text


def latest(run_dir: str | os.PathLike) -> Path | None:
    """The directory of the version ``LATEST`` names, or None when nothing was published."""
    name = latest_name(run_dir)
    return None if name is None else published_dir(run_dir) / name


def info(version_dir: str | os.PathLike) -> dict[str, Any]:
    """A version's ``published.json`` (empty for an export directory never published)."""
    try:
        data = json.loads((Path(version_dir) / INFO).read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def publish(run_dir: str | os.PathLike, export_dir_maker: Callable[[Path], dict | None], *,
            info: dict[str, Any] | None = None, keep: int | None = None) -> str:
    """Publish a new version of ``run_dir``'s model and point ``LATEST`` at it; returns its
    name (``vN``, one more than the highest so far).

    ``export_dir_maker(path)`` writes an export directory at ``path`` (which does not exist
    yet), e.g. :func:`checkpoint_export`'s maker; what it returns (a dict, or None) is
    recorded in ``published.json`` with ``info`` (e.g. ``trained_rows``, ``data_until``)
    and the time. ``keep``: then remove all but the newest ``keep`` versions (:func:`prune`).
    """
    root = published_dir(run_dir)
    root.mkdir(parents=True, exist_ok=True)
    staging = root / f".staging-{os.getpid()}-{time.monotonic_ns()}"
    try:
        made = export_dir_maker(staging)
        if not (staging / "export.json").is_file():
            raise DataError(f"{staging}: the export directory maker wrote no export.json")
        now = time.time()
        record = {**(made or {}), **(info or {}), "published_at": now,
                  "published_at_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(now))}
        _write_atomic(staging / INFO, json.dumps(record, indent=2) + "\n")
        name = _rename_to_next(staging, root)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    _write_atomic(root / LATEST, name + "\n")
    if keep is not None:
        prune(run_dir, keep)
    return name


def _rename_to_next(staging: Path, root: Path) -> str:
    """Rename ``staging`` to the next free ``vN``; a name another writer took is skipped
    (renaming a directory onto a non-empty one fails)."""
    n = max((_number(v) for v in versions(root.parent)), default=0) + 1
    for _ in range(1000):
        try:
            staging.rename(root / f"v{n}")
            return f"v{n}"
        except OSError:
            if not (root / f"v{n}").exists():
                raise
            n += 1
    raise DataError(f"{root}: no free version name after v{n}")


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def prune(run_dir: str | os.PathLike, keep: int) -> list[str]:
    """Remove all but the newest ``keep`` versions (never the one ``LATEST`` names) and
    leftovers of interrupted publications; returns the names removed."""
    if keep < 1:
        raise ConfigError(f"keep {keep}: keep at least 1 published version")
    root = published_dir(run_dir)
    names = versions(run_dir)
    current = latest_name(run_dir)
    removed = [n for n in names[:-keep] if n != current]
    for name in removed:
        # (renamed out of the way first: a reader never sees a half-removed vN)
        gone = root / f".removed-{name}-{os.getpid()}"
        (root / name).rename(gone)
        shutil.rmtree(gone, ignore_errors=True)
    for p in root.glob(".staging-*"):
        if _stale(p):
            shutil.rmtree(p, ignore_errors=True)
    return removed


def _stale(path: Path, age_s: float = 3600.0) -> bool:
    """A staging directory older than an hour: a publication that was interrupted."""
    try:
        return time.time() - path.stat().st_mtime > age_s
    except OSError:
        return False


def checkpoint_export(run_dir: str | os.PathLike, checkpoint: str | None = "latest", *,
                      tables: str = "fp32", eval_rows: int = 2048) -> Callable[[Path], dict]:
    """A maker for :func:`publish`: ``hybridrec export`` of one of the run's checkpoints
    (default the newest), held-out metrics on ``eval_rows`` rows (0: all). It returns the
    checkpoint's step and the rows trained on (the run's sample count at that checkpoint)."""

    def make(out: Path) -> dict:
        from hybridrec.serve.export import export_run

        record = export_run(run_dir, out, checkpoint=checkpoint, tables=tables, eval_rows=eval_rows)
        return {"step": record.get("step"), "checkpoint": Path(record["checkpoint"]).name,
                "trained_rows": trained_rows(record)}

    return make


def trained_rows(export_record: dict) -> int | None:
    """The rows the exported checkpoint had trained on (its manifest's run totals), or None
    when the checkpoint is no longer there."""
    try:
        ckpt = Path(export_record["run_dir"]) / "checkpoints" / Path(export_record["checkpoint"]).name
        manifest = json.loads((ckpt / "manifest.json").read_text())
        samples = manifest["extra"]["run_totals"]["samples"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return int(samples) if isinstance(samples, (int, float)) else None
