"""What a recovery lost: the record each recovery appends to ``RUN/recovery.jsonl``
(summary.json ``recovery.events``) and the arithmetic of its counts.

Per shard, the steps of updates it lost (``failed_at_step - checkpoint_step`` for the shards
of a failed rank, 0 for the survivors') and the samples of those steps. With incremental
saves the rows of a failed rank's shard hold the step of their own newest save: those a
hot-row delta left out are older than the delta (``ShardDeltas.apply``'s
``pending_held``), so ``steps_lost`` is the most any row of the shard lost (the
``samples_lost`` of those steps), ``mean_steps_lost`` the mean over its rows, and
``held_rows`` (only where rows differ) ``{steps lost: rows}``. With
``train.recovery=full`` the survivors write only ``rank-R.json`` (the step they reached),
so the same record says how many steps every shard trains again. A rank rolled back twice
to one checkpoint counts only the steps since its previous recovery (:func:`steps_lost_by`).
:meth:`hybridrec.train.checkpointing.recovery.Recovery.restore` makes the record.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path

from hybridrec.train.checkpointing.snapshots import clear_snapshots

EVENTS = "recovery.jsonl"


def read_events(run_dir: str | Path) -> list[dict]:
    """Every recovery of the run, oldest first (``RUN/recovery.jsonl``)."""
    out = []
    with contextlib.suppress(OSError):
        for line in (Path(run_dir) / EVENTS).read_text().splitlines():
            with contextlib.suppress(ValueError):
                out.append(json.loads(line))
    return out


def steps_lost_by(run_dir: Path, checkpoint_step: int | None, failed_at: int) -> Callable[[int | str, int], int]:
    """``lost_since(who, step)``: the steps of updates that ``who`` (a rank, or ``psJ``: a
    parameter server), whose state holds ``step``, lost in a failure at ``failed_at``, after
    the checkpoint of ``checkpoint_step``. A rank rolled back before to this same checkpoint
    lost the steps up to that recovery then; this one loses those since."""
    before: dict[int | str, int] = {}
    for e in read_events(run_dir):
        if e.get("checkpoint_step") == checkpoint_step and e.get("survivors"):
            for r in [*e.get("failed_ranks", []), *(f"ps{j}" for j in e.get("failed_servers", []))]:
                before[r] = max(before.get(r, 0), int(e["resumed_at_step"]))

    def lost_since(r: int | str, step: int) -> int:
        return max(0, failed_at - max(step, before.get(r, step)))

    return lost_since


def older_rows(holds: list, failed: list[int], lost_since) -> dict[int, dict[str, dict[int, int]]]:
    """The rows a hot-row delta left out, ``{rank: {shard: {steps lost: rows}}}``, by the step
    of their newest save (``holds[rank][2]``: ``{shard: {step: rows}}``) for the failed ranks."""
    return {r: {shard: _by_lost(by_step, lambda s, r=r: lost_since(r, s))
                for shard, by_step in holds[r][2].items()} for r in failed if holds[r][2]}


def shard_losses(ebc, global_batch: int, lost: dict[int, int],
                 older: dict[int, dict[str, dict[int, int]]] | None = None) -> list[dict]:
    """Per shard what it lost: ``lost[rank]`` steps for its rows, except the rows of
    ``older[rank][shard]`` (``{steps lost: rows}``: those a hot-row delta left out, which
    hold an older save's values). ``ebc``: the run's sharded collection (several ranks without
    parameter servers); ``global_batch``: the samples of a step."""
    slots = {(x.table, x.index): x.shard for rank_slots in ebc.layout.slots for x in rank_slots}
    out = []
    for name in ebc.tables:
        for i in sorted(i for t, i in slots if t == name):
            s = slots[(name, i)]
            n = lost.get(s.rank, 0)
            rows = _held_rows(n, s.num_rows, (older or {}).get(s.rank, {}).get(f"{name}@{i}", {}))
            worst = max(rows)
            out.append({"table": name, "rank": s.rank, "rows": s.num_rows, "cols": s.num_cols,
                        "row_start": s.rows[0], "col_start": s.cols[0],
                        "steps_lost": worst, "samples_lost": worst * global_batch,
                        "mean_steps_lost": sum(k * r for k, r in rows.items()) / max(1, s.num_rows),
                        **({"held_rows": {str(k): r for k, r in sorted(rows.items())}} if len(rows) > 1 else {})})
    return out


def server_shard_loss(server: int, shard: dict, steps: int, global_batch: int) -> dict:
    """A parameter server's shard (``shard``: its table, rows and columns) as a record
    entry: ``steps`` of updates lost."""
    return {**shard, "server": server, "steps_lost": steps, "samples_lost": steps * global_batch,
            "mean_steps_lost": steps}


def record_event(run_dir: Path, event: dict, fast_dir: Path | None) -> None:
    """Append the recovery ``event`` to ``RUN/recovery.jsonl`` (synced), clear the snapshots it
    consumed (``fast_dir``: the launcher's local-memory directory) and say what it did."""
    fd = os.open(run_dir / EVENTS, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o666)
    with open(fd, "a") as f:  # (never through a link: the record stays in the run directory)
        f.write(json.dumps(event) + "\n")
        f.flush()
        os.fsync(f.fileno())
    clear_snapshots(run_dir, fast_dir)  # consumed (the incremental saves stay: they serve the next failure)
    failed = ([f"rank(s) {event['failed_ranks']}"] if event["failed_ranks"] else []) + (
        [f"parameter server(s) {[f'ps{j}' for j in event['failed_servers']]}"] if event.get("failed_servers") else [])
    what = (f"partial: the survivors {event['survivors']} kept their state at step {event['resumed_at_step']}, "
            f"the shards of {' and '.join(failed) or 'no rank'} {rolled_back(event)}"
            if event["survivors"] else
            f"{event['mode']}: every rank resumed from step {event['resumed_at_step']}; "
            f"steps {event['resumed_at_step'] + 1}..{event['failed_at_step']} are trained again")
    print(f"recovered from a failure at step {event['failed_at_step']} ({what})", file=sys.stderr, flush=True)


def rolled_back(event: dict) -> str:
    """Where the failed ranks' shards went back to, in words: the checkpoint, or their
    newest incremental saves (whose pending rows hold the checkpoint's values)."""
    base = event["checkpoint_step"] or 0
    deltas = event.get("deltas") or {}
    if not deltas:
        return f"rolled back to step {base} ({event['failed_at_step'] - base} steps of their updates lost)"
    parts = [f"rank {r} to step {d['step']}" + (f" ({d['pending_rows']:,} rows left out of it to their own "
                                                f"newest save, step {base} or later)"
                                                if d["pending_rows"] else "")
             for r, d in sorted(deltas.items(), key=lambda kv: int(kv[0]))]
    return f"rolled back to their incremental saves: {', '.join(parts)}"


def _by_lost(by_step: dict[str, int], lost_since) -> dict[int, int]:
    """``{step of the newest save: rows}`` as ``{steps lost: rows}`` (``lost_since(step)``)."""
    out: dict[int, int] = {}
    for step, rows in by_step.items():
        n = lost_since(int(step))
        out[n] = out.get(n, 0) + int(rows)
    return out


def _held_rows(steps: int, rows: int, older: dict[int, int]) -> dict[int, int]:
    """A shard's ``rows`` by the steps of updates each lost: ``older`` (``{steps lost:
    rows}``, rows that hold an older save's values), the others ``steps``."""
    out = dict(older)
    rest = rows - sum(older.values())
    if rest > 0 or not out:
        out[steps] = out.get(steps, 0) + max(0, rest)
    return out
