#!/usr/bin/env python3
"""Failure schedule: full against partial recovery (CPR) over one run with emulated failures.

    .venv/bin/python benchmarks/failure_schedule.py --seeds 9 --step-ms 170   # the measurement
    .venv/bin/python benchmarks/failure_schedule.py --seeds 6 9 --step-ms 170 # two schedules
    .venv/bin/python benchmarks/failure_schedule.py --rows 50000 --steps 150 --mtbf-s 8  # a smoke test

The measurement: 2 ranks, 1,300 steps of 2048 per rank (~0.15-0.2 s each on 2 cores), MTBF
55 s; seed 9 at 170 ms per step places 4 failures (1:202,0:302,0:954,1:1087), seed 6 four
others (0:511,1:725,0:737,1:1089); about 4-5 minutes per mode and 3.5 for the reference.

CPR (Maeng et al., MLSys 2021) measures the *checkpoint-related overhead* of a training job:
the seconds spent saving checkpoints, plus the work lost at each failure and trained again,
plus the restart and the reload, as a share of the training time (8.2-8.5% with full
recovery, 0.53-0.68% with partial recovery in their production traces). This script emulates
a failure trace over one run of the same command and measures those parts.

Per seed:

1. A reference run without failures and without checkpoints (``train.save_checkpoints=false``):
   its wall time, its training seconds (summary.json ``run.train_seconds``: the steps only)
   and from them the step time.
2. The schedule: inter-failure times drawn from an exponential distribution of mean
   ``--mtbf-s`` (training seconds, seeded by the seed), summed and turned into failure steps
   with the reference's step time (failures past the last step dropped; two in one step
   move to the next), each on a rank drawn at random: ``train.inject_failure=R:S,R:S,...``.
3. The same command once per ``--modes`` entry (``train.recovery=full`` and ``partial``):
   ``hybridrec train ... dist.nproc=N dist.max_restarts=K train.inject_failure=<schedule>
   train.checkpoint_every=auto train.mtbf_hours=<MTBF/3600> train.recovery=<mode>`` (K: the
   number of failures), so the launcher's elastic agent restarts every rank after each
   injected SIGKILL and the run resumes (full: every rank from the newest checkpoint;
   partial: the failed rank's shards from it, the rest from the survivors' state).

Reported per run: wall time; overhead = wall time - the reference's wall time, as a share of
the reference's training seconds; and its parts: checkpoint saves (seconds, count), the
incremental saves of the shards (``--delta-every``: the seconds each held training up, to
stage its rows, and count; their writing runs in a background thread), lost work (steps
trained again, and those steps at the reference's step time), restart + reload (from the
kill to the resumed run's first step), the rest (``other``: what the parts do not explain,
e.g. noise of a shared machine, the auto interval's measured probe steps, the background
writing of incremental saves and the counting of lookups CPR-MFU needs), the
failures, and for partial recovery ``lost_fraction``: the embedding updates lost, as a share of
the run's (sum over failures of the steps a shard lost x its share of the embedding rows,
over the run's steps; a failure recovered fully lost none); plus the held-out AUC (summary.json
``eval.auc``). How the failures were recovered ("recovered as": each record's ``mode``): a
partial run whose ``checkpoint_every=auto`` choice falls back to full recovery (partial
recovery cannot keep ``train.lost_fraction``, ``--lost-fraction`` of the runs with failures)
recovers fully, and the report says so with the choice's reason and the line the run printed.

Where the numbers come from, best first:
- checkpoint saves: metrics.jsonl records ``{"split": "checkpoint", "save_seconds"}`` (one
  per save); without them an estimate from stderr: the saves the auto interval implies
  (the probe's, every interval, the last) x that invocation's measured save
  (``checkpoint interval: ... save X s``); incremental saves: metrics.jsonl records
  ``{"split": "checkpoint", "delta_seconds"}`` (rank 0's, one per save);
- failures and recoveries: summary.json ``recovery.events``, else metrics.jsonl records of
  ``"split": "recovery"``, else ``RUN/recovery.jsonl``, else stderr (``injecting a failure:
  ... after step F`` and the next ``resumed from step C``); the kill time from
  ``RUN/failure_injected.json`` (``injected[i].time``), else the time this script read the
  line ``injecting a failure``; the resumed time from the event's ``resumed_time``, else
  the time this script read ``resumed from step``.

Simplifications: failures fall on steps (training time), not on wall time, so the steps
trained again after a full recovery are never hit by a failure, and the time of the
restarts is not exposed to failures either; the MTBF is scaled to the run (seconds, not
the hours of a production job) while a restart costs what it costs here (process start,
rendezvous, reading the checkpoint), so the overhead shares are far above CPR's and only
their ratio between modes is comparable. Data and model: the synthetic one-hot set of
benchmarks/throughput.py (--rows training rows, as many held-out) and the bench recipe
(26 x 100,000 x 64, SGD) at --lr, --batch-size per rank, several passes when --steps asks.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import re
import shlex
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import throughput  # data preparation, machine()

from hybridrec.bench.report import read_jsonl

MODES = {  # the overrides of each mode (besides the schedule and checkpoint_every=auto)
    "full": ["train.recovery=full"],
    "partial": ["train.recovery=partial"],
    # with incremental saves of every rank's touched rows (train.shard_delta_every = --delta-every)
    "partial-deltas": ["train.recovery=partial", "train.shard_delta_rows=touched"],
    # with CPR-MFU: only the most looked-up share (--delta-hot) of them
    "partial-mfu": ["train.recovery=partial", "train.shard_delta_rows=hot"],
}

_INJECTED = re.compile(r"injecting a failure: rank (\d+) kills itself \(SIGKILL\) after step (\d+)")
_RESUMED = re.compile(r"^resumed from step (\d+)")
_INTERVAL = re.compile(r"^checkpoint interval: every ([\d,]+) steps .*save ([\d.eE+-]+) s")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE",
                   help="hybridrec overrides of every run, the reference's too (after --)")
    p.add_argument("--data", help="an existing preprocessed dataset (default: made under --out)")
    p.add_argument("--rows", type=int, default=500_000, help="training rows to synthesize (and as many held out)")
    p.add_argument("--multi-hot", type=int, default=0, help="ids per feature (0 = one-hot)")
    p.add_argument("--recipe", default="bench", help="hybridrec recipe of every run")
    p.add_argument("--lr", type=float, default=0.1,
                   help="dense and sparse learning rate (optim.dense_lr, optim.sparse_lr; 0: the recipe's)")
    p.add_argument("--batch-size", type=int, default=2048, help="per rank (data.batch_size)")
    p.add_argument("--nproc", type=int, default=2, help="local ranks (dist.nproc)")
    p.add_argument("--steps", type=int, default=1300, help="run length in steps (train.max_steps)")
    p.add_argument("--mtbf-s", type=float, default=55.0,
                   help="mean time between failures of the whole job, in training seconds (scaled "
                        "to the run; also train.mtbf_hours for the auto checkpoint interval)")
    p.add_argument("--max-failures", type=int, default=0, help="keep at most this many failures (0: all drawn)")
    p.add_argument("--step-ms", type=float, default=0.0,
                   help="place the failures at this step time instead of the reference's measured one "
                        "(the same schedule on every machine; 0: measured)")
    p.add_argument("--seeds", type=int, nargs="+", default=[0],
                   help="one schedule and training seed (train.seed) each")
    p.add_argument("--modes", default="full,partial", help=f"comma separated, from {', '.join(MODES)}")
    p.add_argument("--delta-every", type=int, default=25,
                   help="partial-deltas / partial-mfu: train.shard_delta_every (steps)")
    p.add_argument("--delta-hot", type=float, default=0.25, help="partial-mfu: train.shard_delta_hot")
    p.add_argument("--lost-fraction", type=float, default=0.0,
                   help="train.lost_fraction of the runs with failures, not of the reference (so "
                        "--reference-from serves runs of several targets; 0: hybridrec's default)")
    p.add_argument("--out", default=str(ROOT / "benchmarks/out/failure_schedule"),
                   help="work directory (data, run directories, logs, the JSON report)")
    p.add_argument("--timeout", type=float, default=3600, help="seconds per run")
    p.add_argument("--reference-from", metavar="REPORT",
                   help="take each seed's reference run from this earlier report (its JSON) instead of "
                        "running it again: the same settings, data and seeds are required")
    p.add_argument("--keep-checkpoints", action="store_true",
                   help="keep the runs' checkpoints (default: deleted once measured; ~0.7 GB each "
                        "with the bench model)")
    args = p.parse_args(argv)
    args.mode_list = [m.strip() for m in args.modes.split(",") if m.strip()]
    bad = [m for m in args.mode_list if m not in MODES]
    if bad or not args.mode_list:
        p.error(f"--modes {args.modes!r}: choose from {', '.join(MODES)}")
    for name, value, ok, want in (("--nproc", args.nproc, args.nproc >= 1, ">= 1"),
                                  ("--steps", args.steps, args.steps >= 2, ">= 2"),
                                  ("--mtbf-s", args.mtbf_s, args.mtbf_s > 0, "> 0"),
                                  ("--step-ms", args.step_ms, args.step_ms >= 0, ">= 0 (0: measured)"),
                                  ("--lost-fraction", args.lost_fraction, 0 <= args.lost_fraction < 1,
                                   "in [0, 1) (0: hybridrec's default)")):
        if not ok:
            p.error(f"{name} {value:g}: must be {want}")
    return args


# -- the schedule --------------------------------------------------------------------------
def failure_schedule(*, mtbf_s: float, step_s: float, steps: int, nproc: int, seed: int,
                     max_failures: int = 0) -> list[dict]:
    """Failures of one run: exponential inter-failure times of mean ``mtbf_s`` (seconds of
    training at ``step_s`` per step), as ``[{"rank", "step", "t"}]`` with steps strictly
    increasing in ``[1, steps)`` (a failure in the same step as the one before moves to the
    next step), each on a rank drawn uniformly; ``max_failures`` > 0 keeps the first ones."""
    if step_s <= 0:
        raise ValueError(f"step_s must be > 0, got {step_s}")
    rng = random.Random(seed)
    out: list[dict] = []
    t = 0.0
    while not max_failures or len(out) < max_failures:
        t += rng.expovariate(1.0 / mtbf_s)
        rank = rng.randrange(nproc)
        step = max(1, math.ceil(t / step_s))
        if out and step <= out[-1]["step"]:
            step = out[-1]["step"] + 1
        if step >= steps:  # (the last step's failure would only redo the end)
            break
        out.append({"rank": rank, "step": step, "t": t})
    return out


def inject_spec(schedule: list[dict]) -> str:
    return ",".join(f"{f['rank']}:{f['step']}" for f in schedule)


# -- runs ----------------------------------------------------------------------------------
def train_argv(args, data: Path, run_dir: Path, seed: int, extra: list[str]) -> list[str]:
    from hybridrec.data.schema import DatasetMeta

    per_epoch = max(1, DatasetMeta.load(data).split_rows("train") // (args.nproc * args.batch_size))
    lr = [f"optim.dense_lr={args.lr}", f"optim.sparse_lr={args.lr}"] if args.lr else []
    return ["train", "--recipe", args.recipe, f"data.path={data}", f"data.batch_size={args.batch_size}",
            *lr, f"train.max_steps={args.steps}", f"train.epochs={-(-args.steps // per_epoch)}",
            f"train.run_dir={run_dir}", f"train.seed={seed}", "train.progress=false",
            f"dist.nproc={args.nproc}", *args.overrides, *extra]


def run_command(argv: list[str], run_dir: Path, log: Path, timeout: float) -> dict:
    """``python -m hybridrec ARGV`` in a fresh ``run_dir`` (the runs must not use
    ``train.resume=false``: the restarted ranks run the same command and must resume):
    its wall time and its stderr lines, each with the Unix time this script read it."""
    shutil.rmtree(run_dir, ignore_errors=True)
    log.parent.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "hybridrec", *argv]
    lines: list[tuple[float, str]] = []
    start = time.monotonic()
    with open(log, "w") as f:
        f.write(f"$ {shlex.join(cmd)}\n")
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, cwd=ROOT)
        try:
            for line in proc.stderr:
                now = time.time()
                lines.append((now, line.rstrip("\n")))
                f.write(f"[{time.monotonic() - start:9.3f}] {line}")
                f.flush()
                if time.monotonic() - start > timeout:
                    proc.kill()
            status = proc.wait(timeout=max(1.0, timeout - (time.monotonic() - start)))
        except subprocess.TimeoutExpired:
            proc.kill()
            status = proc.wait()
    wall = time.monotonic() - start
    if status != 0:
        tail = "\n".join(line for _, line in lines[-30:])
        raise SystemExit(f"run failed (exit {status}; log {log}):\n$ {shlex.join(cmd)}\n{tail}")
    return {"wall_seconds": wall, "stderr": lines, "command": shlex.join(cmd[1:]), "log": str(log)}


def _read_json(path: Path):
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


# -- what a run spent ----------------------------------------------------------------------
def checkpoint_saves(run_dir: Path, stderr: list[tuple[float, str]], failures: list[dict],
                     total_steps: int) -> dict:
    """``{"seconds", "count", "source"}`` of the run's checkpoint saves: metrics.jsonl's
    ``checkpoint`` records, else estimated from stderr (see the module's docstring)."""
    recs = [r for r in read_jsonl(run_dir / "metrics.jsonl") if r.get("split") == "checkpoint"
            and isinstance(r.get("save_seconds"), (int, float))]
    if recs:
        # (A resumed run drops the records after the step it resumed at; a full recovery
        # resumes at the newest save and a partial one after it, so no save's record goes.)
        return {"seconds": sum(r["save_seconds"] for r in recs), "count": len(recs),
                "source": "metrics.jsonl checkpoint records"}
    # Estimate: per invocation [start, end), the probe's save PROBE_STEPS after its first
    # step, then every interval N, and the final save; at the invocation's measured save.
    from hybridrec.train.checkpointing.checkpoint_interval import PROBE_STEPS

    starts = [0] + [f["resumed_at_step"] for f in failures]
    ends = [f["failed_at_step"] for f in failures] + [total_steps]
    # Each invocation's interval line (none when it died before its probe): the lines up
    # to an "injecting a failure" are the invocation's that died there.
    intervals: list[tuple[int, float] | None] = [None]
    for _, line in stderr:
        if _INJECTED.search(line):
            intervals.append(None)
        elif m := _INTERVAL.search(line):
            intervals[-1] = (int(m.group(1).replace(",", "")), float(m.group(2)))
    seconds, count = 0.0, 0
    for i, (s0, end) in enumerate(zip(starts, ends)):
        last = i == len(ends) - 1
        probe = min(s0 + PROBE_STEPS, total_steps)
        if i >= len(intervals) or intervals[i] is None or probe > end or (probe == end and not last):
            continue  # died before its probe's save (its seconds: in "other")
        n, save_s = intervals[i]
        saved = {probe, *(s for s in range(n * (probe // n + 1), end + (1 if last else 0), n)
                          if total_steps - s >= n / 2)}  # (none less than half an interval before the end)
        if last:
            saved.add(total_steps)
        seconds += len(saved) * save_s
        count += len(saved)
    return {"seconds": seconds, "count": count, "source": "estimated from stderr (no checkpoint records)"}


def delta_saves(run_dir: Path) -> dict:
    """``{"seconds", "count"}`` of the incremental saves of rank 0's shards: the seconds each
    held training up (metrics.jsonl ``checkpoint`` records with ``delta_seconds``)."""
    recs = [r["delta_seconds"] for r in read_jsonl(run_dir / "metrics.jsonl") if r.get("split") == "checkpoint"
            and isinstance(r.get("delta_seconds"), (int, float))]
    return {"seconds": sum(recs), "count": len(recs)}


def recovery_events(run_dir: Path, summary: dict) -> tuple[list[dict], str]:
    """The run's recovery records, oldest first, and where they came from (empty: none
    recorded; stderr is then the source, see :func:`failures_of`)."""
    rec = summary.get("recovery")
    if isinstance(rec, dict) and isinstance(rec.get("events"), list) and rec["events"]:
        return rec["events"], "summary.json recovery.events"
    metrics = [r for r in read_jsonl(run_dir / "metrics.jsonl") if r.get("split") == "recovery"]
    if metrics:
        return metrics, "metrics.jsonl recovery records"
    events = read_jsonl(run_dir / "recovery.jsonl")
    if events:
        return events, "RUN/recovery.jsonl"
    return [], "stderr"


def failures_of(run_dir: Path, summary: dict, stderr: list[tuple[float, str]]) -> tuple[list[dict], str]:
    """One record per failure the run recovered from: ``failed_rank``, ``failed_at_step``,
    ``checkpoint_step``, ``resumed_at_step``, ``kill_time``, ``resumed_time``,
    ``restore_seconds`` (None: not recorded), ``shards`` (partial: per shard steps lost),
    ``mode`` (the record's ``partial`` or ``full``; None: not recorded)."""
    from hybridrec.train.checkpointing.faults import injections, read_marker

    kills = injections(read_marker(run_dir))
    # stderr: the failures and resumptions in the order they happened, timed as read. A
    # restart with no checkpoint to resume prints no "resumed from": step 0, timed at the
    # agent's restart line (which comes before building and loading: a lower bound).
    seen: list[dict] = []
    for t, line in stderr:
        if m := _INJECTED.search(line):
            seen.append({"failed_rank": int(m.group(1)), "failed_at_step": int(m.group(2)), "line_time": t})
        elif seen and "resumed_at_step" not in seen[-1]:
            if m := _RESUMED.search(line):
                seen[-1].update(resumed_at_step=int(m.group(1)), resumed_line_time=t)
            elif line.startswith("restarted the ranks after a failure"):
                seen[-1].setdefault("restart_line_time", t)
            elif line.startswith("checkpoint interval:") and "restart_line_time" in seen[-1]:
                seen[-1].update(resumed_at_step=0, resumed_line_time=seen[-1]["restart_line_time"])
    events, source = recovery_events(run_dir, summary)
    out, pointer = [], 0
    for i, s in enumerate(seen):
        if "resumed_at_step" not in s and "restart_line_time" not in s:
            continue  # (the run finished: cannot be, unless a line went missing)
        # The event of this failure: the next one whose failed step is this one's (a
        # survivor may record the step after, never before); a restart whose ranks wrote
        # nothing has none.
        e = {}
        for j in range(pointer, len(events)):
            if 0 <= (events[j].get("failed_at_step") or -9) - s["failed_at_step"] <= 1:
                e, pointer = events[j], j + 1
                break
        kill = kills[i] if i < len(kills) and kills[i].get("step") == s["failed_at_step"] else {}
        resumed_at = e.get("resumed_at_step", e.get("step", s.get("resumed_at_step", 0)))
        checkpoint = e["checkpoint_step"] if "checkpoint_step" in e else s.get("resumed_at_step", 0)
        out.append({
            "failed_rank": s["failed_rank"],
            "failed_at_step": s["failed_at_step"],
            "checkpoint_step": checkpoint or 0,
            "resumed_at_step": resumed_at,
            "kill_time": kill.get("time") or s["line_time"],
            "resumed_time": e.get("resumed_time") or s.get("resumed_line_time") or s["restart_line_time"],
            "restore_seconds": e.get("restore_seconds"),
            "shards": e.get("shards"),
            # (the record's "partial" or "full": a run whose interval fell back recovers fully)
            "mode": e.get("mode"),
            "source": "event" if e else "stderr",
        })
    return out, source if events else "stderr"


def lost_fraction(failures: list[dict], total_steps: int, *, recorded: bool = False) -> float | None:
    """Partial recovery: the embedding updates lost, as a share of the run's: the sum over
    failures of the steps each shard lost x its share of the embedding parameters (rows x
    columns), over the run's steps (None: no per-shard record).

    A shard's steps lost are its rows' mean (``mean_steps_lost``; ``steps_lost`` in records
    without it). As recorded they count from the checkpoint it rolled back to; when
    the same shard rolled back to that checkpoint at an earlier failure, the updates up to
    that recovery were lost then, so (unless ``recorded``) this one lost only the steps
    since: ``failed_at_step - max(checkpoint_step, the step it resumed at then)``.

    A failure recovered fully (its record's ``mode`` is ``full``: the run's interval fell
    back to full recovery) lost nothing: its shards' steps were trained again."""
    if not any(f.get("shards") for f in failures):
        return None
    total = 0.0
    restored_at: dict[tuple, int] = {}  # shard -> the step at which it last rolled back
    for f in failures:
        if f.get("mode") == "full":
            continue
        shards = f.get("shards") or []
        weights = [(sh.get("rows") or 1) * (sh.get("cols") or 1) for sh in shards]  # (None: one table)
        lost = []
        for sh in shards:
            # (the mean over the shard's rows where recorded: rows a hot-row delta left out lost more)
            n = sh.get("mean_steps_lost", sh.get("steps_lost")) or 0
            key = (sh.get("table"), sh.get("rank"), sh.get("row_start"), sh.get("col_start"))
            if n > 0:
                if not recorded:
                    since = max(f["checkpoint_step"], restored_at.get(key, f["checkpoint_step"]))
                    n = max(0, min(n, f["failed_at_step"] - since))
                restored_at[key] = f["resumed_at_step"]
            lost.append(n)
        whole = sum(weights)
        if whole:
            total += sum(w * n for w, n in zip(weights, lost)) / whole
    return total / total_steps


def measure_run(name: str, run: dict, run_dir: Path, ref: dict | None, total_steps: int) -> dict:
    """One run's numbers, and its overhead against the reference ``ref`` (None: this is it)."""
    summary = _read_json(run_dir / "summary.json") or {}
    totals = summary.get("run") or {}
    res = {"name": name, "wall_seconds": run["wall_seconds"], "steps": summary.get("step"),
           "train_seconds": totals.get("train_seconds"),
           "auc": (summary.get("eval") or {}).get("auc"), "command": run["command"], "log": run["log"],
           "run_dir": str(run_dir), "checkpoint_interval": summary.get("checkpoint_interval")}
    if ref is None:
        res["step_seconds"] = res["train_seconds"] / res["steps"]
        return res
    failures, source = failures_of(run_dir, summary, run["stderr"])
    saves = checkpoint_saves(run_dir, run["stderr"], failures, total_steps)
    deltas = delta_saves(run_dir)
    step_s = ref["step_seconds"]
    redone = sum(max(0, f["failed_at_step"] - f["resumed_at_step"]) for f in failures)
    restart = sum(max(0.0, f["resumed_time"] - f["kill_time"]) for f in failures)
    overhead = res["wall_seconds"] - ref["wall_seconds"]
    base = ref["train_seconds"]
    parts = saves["seconds"] + deltas["seconds"] + redone * step_s + restart
    res.update(
        failures=len(failures), failure_records=failures, failures_source=source,
        overhead_seconds=overhead, overhead_share=overhead / base,
        save_seconds=saves["seconds"], saves=saves["count"], saves_source=saves["source"],
        delta_seconds=deltas["seconds"], deltas=deltas["count"],
        lost_steps=redone, lost_seconds=redone * step_s, restart_seconds=restart,
        restore_seconds=(sum(f["restore_seconds"] for f in failures)
                         if failures and all(f["restore_seconds"] is not None for f in failures) else None),
        other_seconds=overhead - parts, cpr_overhead_share=parts / base,
        # (full: the shards' records count steps trained again, none lost)
        lost_fraction=lost_fraction(failures, total_steps) if name.startswith("partial") else 0.0,
        lost_fraction_recorded=(lost_fraction(failures, total_steps, recorded=True)
                                if name.startswith("partial") else 0.0),
        auc_vs_reference=(res["auc"] - ref["auc"] if res["auc"] is not None and ref["auc"] is not None
                          else None),
        **fallback_of(summary, run["stderr"], failures))
    return res


_FALLS_BACK = "falls back to full recovery"


def fallback_of(summary: dict, stderr: list[tuple[float, str]], failures: list[dict]) -> dict:
    """Whether a run of ``train.recovery=partial`` fell back to full recovery, by what it
    recorded and said: ``fallback`` (the interval's choice, summary.json
    ``checkpoint_interval.fallback``: ``"full"`` or None), ``fallback_reason``,
    ``fallback_said`` (the run's stderr line that says it, the first; None: not said),
    ``recovery_mode`` (summary.json ``recovery.mode`` at the end) and ``recovered_as``
    (each failure's record's mode, in order)."""
    choice = summary.get("checkpoint_interval") or {}
    said = next((line for _, line in stderr if _FALLS_BACK in line), None)
    return {"fallback": choice.get("fallback"), "fallback_reason": choice.get("fallback_reason"),
            "fallback_said": said, "recovery_mode": (summary.get("recovery") or {}).get("mode"),
            "recovered_as": [f.get("mode") for f in failures]}


def recovered_as(r: dict) -> str:
    """The report's column: how the run's failures were recovered ("partial x4", "full x8",
    "-": none recorded), and "fell back" where the interval's choice said full recovery."""
    modes = r.get("recovered_as") or []
    counts = {m: modes.count(m) for m in dict.fromkeys(modes)}
    text = ", ".join(f"{m or 'unrecorded'} x{n}" for m, n in counts.items()) or "-"
    return f"{text} (fell back)" if r.get("fallback") == "full" else text


# -- report --------------------------------------------------------------------------------
def _fmt(v, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def format_report(rep: dict) -> str:
    s = rep["settings"]
    lines = [(f"machine: {rep['machine']}   date: {rep['date']}   {s['nproc']} ranks, {s['steps']:,} steps of "
              f"{s['batch_size']} per rank, recipe {s['recipe']}, MTBF {s['mtbf_s']:g} s (training time), "
              f"seeds {s['seeds']}"), ""]
    for seed in rep["seeds"]:
        ref = seed["reference"]
        lines.append(f"seed {seed['seed']}: reference {ref['wall_seconds']:.1f} s wall, "
                     f"{ref['train_seconds']:.1f} s training ({ref['step_seconds'] * 1000:.1f} ms/step); "
                     f"failures (rank:step) {seed['inject_failure'] or 'none'}")
    lines += ["", ("| run | seed | failures | wall s | overhead s | overhead % | saves s (n) | deltas s (n) | "
                   "lost work steps (s) | restart+reload s | other s | CPR overhead % | recovered as | lost_fraction | "
                   "AUC | AUC vs reference |"),
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for seed in rep["seeds"]:
        ref = seed["reference"]
        lines.append(f"| reference | {seed['seed']} | 0 | {ref['wall_seconds']:.1f} | - | - | - | - | - | - | - "
                     f"| - | - | - | {_fmt(ref['auc'], '.5f')} | - |")
        for r in seed["runs"]:
            lines.append(
                f"| {r['name']} | {seed['seed']} | {r['failures']} | {r['wall_seconds']:.1f} | "
                f"{r['overhead_seconds']:.1f} | {100 * r['overhead_share']:.1f} | "
                f"{r['save_seconds']:.1f} ({r['saves']}) | {r.get('delta_seconds', 0.0):.1f} ({r.get('deltas', 0)}) | "
                f"{r['lost_steps']} ({r['lost_seconds']:.1f}) | "
                f"{r['restart_seconds']:.1f} | {r['other_seconds']:.1f} | {100 * r['cpr_overhead_share']:.1f} | "
                f"{recovered_as(r)} | {_fmt(r['lost_fraction'], '.4f')} | {_fmt(r['auc'], '.5f')} | "
                f"{_fmt(r['auc_vs_reference'], '+.5f')} |")
    if len(rep["seeds"]) > 1:
        lines += ["", ("| run | failures (mean) | overhead % (mean) | CPR overhead % (mean) | lost_fraction (mean) "
                       "| AUC (mean) | AUC vs reference (mean) |"), "|---|---|---|---|---|---|---|"]
        for name, v in rep["means"].items():
            lines.append(f"| {name} | {_fmt(v['failures'], '.1f')} | {_fmt(v['overhead_share'], '.1%')} | "
                         f"{_fmt(v['cpr_overhead_share'], '.1%')} | {_fmt(v['lost_fraction'], '.4f')} | "
                         f"{_fmt(v['auc'], '.5f')} | {_fmt(v['auc_vs_reference'], '+.5f')} |")
    for seed in rep["seeds"]:
        for r in seed["runs"]:
            if r.get("fallback") == "full":
                lines += ["", (f"{r['name']} (seed {seed['seed']}) fell back to full recovery: "
                               f"{r.get('fallback_reason') or '(no reason recorded)'}; the run said: "
                               f"{r.get('fallback_said') or '(nothing)'}")]
    sources = sorted({f"{r['name']}: saves from {r['saves_source']}, failures from {r['failures_source']}"
                      for seed in rep["seeds"] for r in seed["runs"]})
    lines += ["", ("overhead = wall - the reference's wall, % of the reference's training seconds; CPR "
                   "overhead = saves + deltas + lost work + restart+reload, % of the same; other = overhead - "
                   "those."),
              *sources]
    return "\n".join(lines)


def means(seeds: list[dict]) -> dict:
    """Per run name, the means over seeds."""
    by_name: dict[str, list[dict]] = {"reference": [s["reference"] for s in seeds]}
    for s in seeds:
        for r in s["runs"]:
            by_name.setdefault(r["name"], []).append(r)

    def mean(rs, key):
        vals = [r[key] for r in rs if r.get(key) is not None]
        return statistics.mean(vals) if vals else None

    return {name: {k: mean(rs, k) for k in ("wall_seconds", "overhead_share", "cpr_overhead_share", "auc",
                                             "lost_fraction", "auc_vs_reference", "failures")}
            for name, rs in by_name.items()}


SETTINGS = ("nproc", "steps", "mtbf_s", "max_failures", "step_ms", "seeds", "recipe", "lr", "batch_size", "rows",
            "multi_hot", "overrides")


def earlier_references(args, data: Path) -> dict[int, dict]:
    """``--reference-from``: each seed's reference run of an earlier report of the same
    settings and data (a SystemExit that says what differs otherwise)."""
    try:
        rep = json.loads(Path(args.reference_from).read_text())
    except (OSError, ValueError) as e:
        raise SystemExit(f"--reference-from {args.reference_from}: not readable as a report ({e})") from None
    old, now = rep.get("settings", {}), {k: getattr(args, k) for k in SETTINGS}
    differ = [f"{k} {old.get(k)!r} there, {now[k]!r} here" for k in SETTINGS if k != "seeds" and old.get(k) != now[k]]
    if Path(rep.get("data", "")) != Path(data):
        differ.append(f"data {rep.get('data')} there, {data} here")
    found = {s["seed"]: s["reference"] for s in rep.get("seeds", [])}
    missing = [s for s in args.seeds if s not in found]
    if differ or missing:
        raise SystemExit(f"--reference-from {args.reference_from}: " + "; ".join(
            differ + ([f"no reference of seed(s) {missing}"] if missing else [])))
    return found


def main(argv=None) -> int:
    args = parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    args.out = str(out)  # (what throughput.prepare_data reads: out, rows, multi_hot)
    data = Path(args.data) if args.data else throughput.prepare_data(args)
    seeds = []
    earlier = earlier_references(args, data) if args.reference_from else {}
    for seed in args.seeds:
        if seed in earlier:
            ref = earlier[seed]
            print(f"seed {seed}: the reference run of {args.reference_from}", file=sys.stderr, flush=True)
        else:
            run_dir = out / f"run-reference-s{seed}"
            print(f"seed {seed}: reference run ({args.steps:,} steps, no failures, no checkpoints) ...",
                  file=sys.stderr, flush=True)
            run = run_command(train_argv(args, data, run_dir, seed, ["train.save_checkpoints=false"]),
                              run_dir, out / f"logs/reference-s{seed}.log", args.timeout)
            ref = measure_run("reference", run, run_dir, None, args.steps)
        schedule = failure_schedule(mtbf_s=args.mtbf_s, step_s=args.step_ms / 1000 or ref["step_seconds"], steps=args.steps,
                                    nproc=args.nproc, seed=seed, max_failures=args.max_failures)
        spec = inject_spec(schedule)
        print(f"seed {seed}: reference {ref['wall_seconds']:.1f} s wall, {ref['step_seconds'] * 1000:.1f} ms/step; "
              f"failures {spec or 'none'}", file=sys.stderr, flush=True)
        runs = []
        for mode in args.mode_list:
            run_dir = out / f"run-{mode}-s{seed}"
            extra = [f"dist.max_restarts={len(schedule)}", "train.checkpoint_every=auto",
                     f"train.mtbf_hours={args.mtbf_s / 3600.0!r}", *MODES[mode]]
            if "deltas" in mode or "mfu" in mode:
                extra += [f"train.shard_delta_every={args.delta_every}", f"train.shard_delta_hot={args.delta_hot}"]
            if args.lost_fraction:
                extra.append(f"train.lost_fraction={args.lost_fraction!r}")
            if spec:
                extra.append(f"train.inject_failure={spec}")
            run = run_command(train_argv(args, data, run_dir, seed, extra), run_dir,
                              out / f"logs/{mode}-s{seed}.log", args.timeout)
            r = measure_run(mode, run, run_dir, ref, args.steps)
            runs.append(r)
            if not args.keep_checkpoints:
                shutil.rmtree(run_dir / "checkpoints", ignore_errors=True)
            print(f"seed {seed}: {mode}: {r['wall_seconds']:.1f} s wall, overhead {r['overhead_share']:.1%}, "
                  f"{r['failures']} failures, AUC {_fmt(r['auc'], '.4f')}", file=sys.stderr, flush=True)
        seeds.append({"seed": seed, "schedule": schedule, "inject_failure": spec, "reference": ref, "runs": runs})
    rep = {"date": time.strftime("%Y-%m-%d"), "machine": throughput.machine(), "data": str(data),
           "command": shlex.join([Path(sys.executable).name, *sys.argv]),
           "settings": {k: getattr(args, k) for k in SETTINGS} | {"modes": args.mode_list,
                                                                     "lost_fraction": args.lost_fraction},
           **({"reference_from": str(args.reference_from)} if args.reference_from else {}),
           "seeds": seeds, "means": means(seeds)}
    path = out / (f"failure_schedule-nproc{args.nproc}-steps{args.steps}-mtbf{args.mtbf_s:g}"
                  f"-seeds{'-'.join(map(str, args.seeds))}.json")
    path.write_text(json.dumps(rep, indent=2))
    print(format_report(rep))
    print(f"\nwritten: {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
