"""A picture of training runs: ``index.html`` (one self-contained page, the charts inline,
no script, nothing fetched) and one SVG per chart, for one run directory or several side by
side (one line or bar per run, labelled by the run directory's name).

Charts: train loss, held-out AUC and log loss, samples/s (all against the step), bytes sent
per step by communication category (rank 0's ledger, with the bytes before compression
beside a compressed category) and, where the ledger has them, predicted against counted
bytes. Above them a table per run: world size, steps, final metrics, throughput, peak
memory, bytes per step and the config that shapes the run; and, where a run failed and
recovered, a table of its failures: when, after which step, which rank, what failed, what the
recovery did and how long it took.

Read from each run directory: ``metrics.jsonl`` (curves), ``summary.json`` (final
metrics, throughput, memory, ledger), ``config.json``, and the records of failures:
``failure_injected.json`` (``train.inject_failure``'s kills) and ``recovery.jsonl`` (every
recovery: the failed and surviving ranks, the steps lost, when training resumed; else
summary.json's copy, ``recovery.events``). A failure no record names (a rank that crashed in
a run without recovery records: one process, parameter servers, groups, Hogwild threads) shows
only as the step the log went back to, in the notes. A run without ``summary.json``
is still training (or stopped before its end): its report shows what exists and says it is
partial. Every file is written atomically. :func:`write_report` is the call at the end of a
training run: it never raises for a report problem.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from xml.sax.saxutils import escape

from hybridrec.bench.compression_report import byte_ratio, fmt_bytes
from hybridrec.bench.svg import Bar, BarGroup, Series, bar_svg, color, line_svg
from hybridrec.errors import HybridrecError, os_error_message
from hybridrec.files import write_text_atomic
from hybridrec.metrics.logger import METRICS_FILE
from hybridrec.train.checkpointing.faults import MARKER as INJECTED_FILE
from hybridrec.train.checkpointing.faults import injections, read_marker

REPORT_DIR = "report"
SUMMARY_FILE, CONFIG_FILE, PLAN_FILE = "summary.json", "config.json", "plan.json"
RECOVERY_FILE = "recovery.jsonl"
"""Every recovery of a run (:data:`hybridrec.train.checkpointing.lost_work.EVENTS`, named again here: that
module imports torch's distributed checkpointing, seconds of start-up for a report)."""

_log = logging.getLogger(__name__)


@dataclass
class Failure:
    """One failure of a run and what its recovery did: a row of the report's failures table."""
    time: float | None
    """Unix seconds: the kill of an injected failure, else when the survivors stopped."""
    step: int | None
    """The last step trained before the failure."""
    ranks: list[int]
    """The ranks that failed."""
    what: str
    """What failed, in words."""
    recovery: str = ""
    """What the recovery did, in words ("": no recovery recorded)."""
    took_s: float | None = None
    """Seconds from the failure until training went on."""
    restore_s: float | None = None
    """Of those, the seconds of loading the state back (the slowest rank's)."""

    def line(self) -> str:
        """The failure in one line (``hybridrec report`` prints one per failure)."""
        when = f"{_clock(self.time)}: " if self.time is not None else ""
        return (f"{when}{self.what}; " + (f"recovered in {_took(self)}: {self.recovery}"
                                          if self.recovery else "no recovery recorded"))


@dataclass
class Run:
    """One run directory as the report reads it."""
    path: Path
    label: str
    train: list[dict] = field(default_factory=list)
    """metrics.jsonl's train records in step order (a resumed run's redone steps replaced)."""
    evals: list[dict] = field(default_factory=list)
    summary: dict | None = None
    config: dict | None = None
    plan: dict[str, int] = field(default_factory=dict)
    """plan.json's tables per sharding type (runs of several ranks)."""
    notes: list[str] = field(default_factory=list)
    partial: bool = False
    failures: list[Failure] = field(default_factory=list)
    """The run's failures and their recoveries, oldest first (:func:`failures`)."""

    @property
    def last_step(self) -> int | None:
        steps = [r["step"] for r in self.train[-1:] + self.evals[-1:]]
        if self.summary is not None:
            steps.append(self.summary.get("step") or 0)
        return max(steps) if steps else None


# ---------------------------------------------------------------- reading


def read_metrics(path: Path) -> tuple[list[dict], list[dict], list[str]]:
    """metrics.jsonl -> (train records, eval records, notes). A line that is not a JSON
    record is skipped (the last one may be half written while the run goes on). The log is
    appended to by every resume: a record at or before a step already logged starts the
    history again from that step, so each step keeps the values of the latest run."""
    records: list[dict] = []
    last: dict[str, int] = {}
    bad, rewinds = 0, []
    text = path.read_text(encoding="utf-8", errors="replace")
    lines = text.split("\n")
    for n, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
            step, split = int(rec["step"]), rec["split"]
        except (ValueError, KeyError, TypeError):
            if n < len(lines) - 1:  # the unfinished last line of a live run is no fault
                bad += 1
            continue
        rec["step"] = step
        if step < max(last.values(), default=step) or step == last.get(split):
            rewinds.append(step)
            records = [r for r in records if r["step"] < step]
            last = {}
            for r in records:
                last[r["split"]] = r["step"]
        records.append(rec)
        last[split] = step
    notes = []
    if bad:
        notes.append(f"{path.name}: {bad} line(s) that are not JSON records skipped")
    if rewinds:
        notes.append(f"{path.name}: the run went back to an earlier step {len(rewinds)} time(s) "
                     f"(resumed or restarted, at step(s) {', '.join(map(str, rewinds[:5]))}"
                     f"{', ...' if len(rewinds) > 5 else ''}); the latest records are shown")
    evals = [r for r in records if r["split"] == "eval"]
    if not evals:  # a stream's test-then-train metrics stand where a held-out split's would
        evals = [{"step": r["step"], "auc": r.get("progressive_auc"), "log_loss": r.get("progressive_logloss"),
                  "progressive": True} for r in records if r["split"] == "progressive"]
    return [r for r in records if r["split"] == "train"], evals, notes


def _read_json(path: Path) -> dict:
    try:
        obj = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise HybridrecError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(obj, dict):
        raise HybridrecError(f"{path}: expected a JSON object")
    return obj


def load_run(path: Path, label: str | None = None) -> Run:
    """Reads a run directory; HybridrecError when it is none (the message says why)."""
    path = Path(path)
    if not path.is_dir():
        why = "not a directory" if path.exists() else "no such run directory"
        raise HybridrecError(f"{path}: {why}")
    metrics, summary = path / METRICS_FILE, path / SUMMARY_FILE
    if not metrics.is_file() and not summary.is_file():
        raise HybridrecError(f"{path}: not a run directory (no {METRICS_FILE} and no "
                             f"{SUMMARY_FILE})")
    run = Run(path, label or path.resolve().name)
    if metrics.is_file():
        run.train, run.evals, run.notes = read_metrics(metrics)
    else:
        run.notes.append(f"no {METRICS_FILE}: no curves, only the final numbers of "
                         f"{SUMMARY_FILE}")
    if summary.is_file():
        run.summary = _read_json(summary)
        if not run.evals:  # the evaluations summary.json keeps
            run.evals = list(run.summary.get("eval_history") or [])
            if run.summary.get("eval"):
                run.evals.append(run.summary["eval"])
        logged = max([r["step"] for r in run.train[-1:] + run.evals[-1:]], default=0)
        if logged > (run.summary.get("step") or 0):
            run.partial = True
            run.notes.append(f"partial: {METRICS_FILE} goes on to step {logged}, past "
                             f"{SUMMARY_FILE}'s step {run.summary.get('step')} (a resumed run "
                             "still training?); the table's final numbers are the older run's")
    else:
        run.partial = True
        run.notes.append(f"partial: no {SUMMARY_FILE} yet (still training, or stopped before "
                         f"its end); curves up to step {run.last_step}")
    config = path / CONFIG_FILE
    if config.is_file():
        run.config = _read_json(config)
    elif run.summary is not None:
        run.config = run.summary.get("config")
    if (path / PLAN_FILE).is_file():
        for t in (_read_json(path / PLAN_FILE).get("tables") or {}).values():
            kind = t.get("sharding_type", "?")
            run.plan[kind] = run.plan.get(kind, 0) + 1
    if (path / INJECTED_FILE).is_file() and read_marker(path) is None:
        run.notes.append(f"{INJECTED_FILE}: not a JSON object; the injected failures are not shown")
    run.failures = failures(injections(read_marker(path)), read_recoveries(path, run.summary))
    return run


# ---------------------------------------------------------------- failures


def read_jsonl(path: Path) -> list[dict]:
    """The JSON objects of a JSON-lines file, one per line (lines that are no object, such as
    a last line cut short, skipped; a file that cannot be read: none)."""
    out = []
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return out
    for line in text.splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if isinstance(rec, dict):
            out.append(rec)
    return out


def read_recoveries(path: Path, summary: dict | None) -> list[dict]:
    """The run's recovery records, oldest first: ``recovery.jsonl`` (lines that are no
    record skipped), else summary.json's ``recovery.events``."""
    if (path / RECOVERY_FILE).is_file():
        return read_jsonl(path / RECOVERY_FILE)
    events = ((summary or {}).get("recovery") or {}).get("events")
    return [e for e in events if isinstance(e, dict)] if isinstance(events, list) else []


def failures(injected: list[dict], recoveries: list[dict]) -> list[Failure]:
    """Each recovery with the injected kill it followed (the newest one before it resumed
    that no earlier recovery followed), and each injected kill no recovery followed (a run
    without recovery records, or one that stopped there), in the order they happened."""
    kills = sorted(injected, key=lambda k: _number(k.get("time")) or 0.0)
    out: list[Failure] = []
    for rec in recoveries:
        resumed = _number(rec.get("resumed_time"))
        before = [k for k in kills if resumed is None or (_number(k.get("time")) or 0.0) <= resumed]
        kill = before[-1] if before else None
        out += [_killed(k) for k in before[:-1]]  # (followed by no recovery of their own)
        kills = kills[len(before):]
        out.append(_recovered(rec, kill))
    return out + [_killed(k) for k in kills]


def _killed(kill: dict) -> Failure:
    rank, step = kill.get("rank"), kill.get("step")
    who = f"parameter server {rank}" if isinstance(rank, str) else f"rank {rank}"
    return Failure(_number(kill.get("time")), step, [rank] if isinstance(rank, int) else [],
                   f"{who} killed after step {step} (train.inject_failure)")


def _recovered(rec: dict, kill: dict | None) -> Failure:
    failed = [r for r in rec.get("failed_ranks") or [] if isinstance(r, int)]
    step = rec.get("failed_at_step")
    if kill is not None:
        out = _killed(kill)
    else:
        out = Failure(_number(rec.get("failed_at_time")), step, failed,
                      f"rank{'s' if len(failed) != 1 else ''} {_ranks(failed) or '?'} failed "
                      f"after step {step}")
    resumed = _number(rec.get("resumed_time"))
    out.took_s = resumed - out.time if resumed is not None and out.time is not None else None
    out.restore_s = _number(rec.get("restore_seconds"))
    out.recovery = _recovery_words(rec)
    return out


def _recovery_words(rec: dict) -> str:
    """What a recovery record says was done, and lost, in words."""
    mode, failed, survivors = rec.get("mode", "?"), rec.get("failed_ranks") or [], rec.get("survivors") or []
    base, at, resumed = rec.get("checkpoint_step") or 0, rec.get("failed_at_step"), rec.get("resumed_at_step")
    if not survivors:
        again = (f"; steps {resumed + 1}..{at} trained again"
                 if isinstance(at, int) and isinstance(resumed, int) and at > resumed else "")
        return f"{mode}: every rank resumed from step {resumed}{again}"
    lost = [s for s in rec.get("shards") or [] if s.get("steps_lost")]
    deltas = rec.get("deltas") or {}
    back = ("to their incremental saves (" + ", ".join(
        f"rank {r} to step {d.get('step')}" for r, d in sorted(deltas.items(), key=_rank_key)) + ")"
        if deltas else f"to step {base}")
    servers = [f"ps{j}" for j in rec.get("failed_servers") or []]
    whose = ([f"rank{'s' if len(failed) != 1 else ''} {_ranks(failed)}"] if failed or not servers else []) + (
        [f"parameter server{'s' if len(servers) != 1 else ''} {_ranks(servers)}"] if servers else [])
    words = (f"{mode}: rank{'s' if len(survivors) > 1 else ''} {_ranks(survivors)} kept "
             f"{'their' if len(survivors) > 1 else 'its'} state at step {resumed}; the shards of "
             f"{' and '.join(whose)} rolled back {back}")
    if lost:
        words += (f" ({len(lost)} shard{'s' if len(lost) > 1 else ''} lost up to "
                  f"{max(s['steps_lost'] for s in lost)} steps of updates)")
    return words


def _rank_key(item: tuple[str, dict]) -> tuple[int, str]:
    """Ranks named by JSON keys ("10" after "2")."""
    return (int(item[0]), "") if str(item[0]).isdigit() else (1 << 30, str(item[0]))


def _ranks(ranks: list) -> str:
    return ", ".join(map(str, ranks))


def _number(v) -> float | None:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None


def _clock(t: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t))


def _took(f: Failure) -> str:
    if f.took_s is None:
        return "n/a"
    return f"{f.took_s:.1f} s" + (f" ({f.restore_s:.1f} s loading the state)" if f.restore_s is not None else "")


def labels(paths: list[Path]) -> list[str]:
    """Each run's directory name, with as many parent names as it takes to tell runs apart
    (``dense-dct/seed0`` beside ``baseline/seed0``)."""
    parts = [Path(os.path.abspath(p)).parts for p in paths]
    out = []
    for i, p in enumerate(parts):
        others = [q for j, q in enumerate(parts) if j != i]
        depth = next((d for d in range(1, len(p)) if all(q[-d:] != p[-d:] for q in others)),
                     len(p))
        label = "/".join(p[-depth:]).replace("//", "/")
        out.append(label if label not in out else f"{label} ({i + 1})")  # a run given twice
    return out


def default_out(paths: list[Path]) -> Path:
    """RUN/report for one run; the runs' common parent directory + report for several."""
    if len(paths) == 1:
        return Path(paths[0]) / REPORT_DIR
    return Path(os.path.commonpath([os.path.abspath(p) for p in paths])) / REPORT_DIR


# ---------------------------------------------------------------- numbers


def _num(v, fmt: str = "{:.4f}") -> str:
    return "n/a" if v is None else fmt.format(v)


def final_eval(run: Run) -> dict:
    """The newest evaluation: summary.json's, or a later one in metrics.jsonl."""
    final = dict(run.summary.get("eval") or {}) if run.summary else {}
    if run.evals and run.evals[-1]["step"] > final.get("step", -1):
        final = run.evals[-1]
    return final


def samples_per_sec(run: Run) -> float | None:
    if run.summary and not run.partial:
        return run.summary.get("throughput", {}).get("samples_per_sec_overall")
    return run.train[-1].get("samples_per_sec") if run.train else None


def _per_step(run: Run) -> dict:
    return ((run.summary or {}).get("comm") or {}).get("per_step") or {}


def _predicted(run: Run) -> dict:
    return ((run.summary or {}).get("comm") or {}).get("predicted_vs_counted") or {}


def _world(run: Run) -> int | None:
    if run.summary and run.summary.get("world_size"):
        return run.summary["world_size"]
    return (run.config or {}).get("dist", {}).get("nproc")


def _memory(run: Run) -> str:
    s = run.summary or {}
    per_rank = s.get("peak_memory_bytes_per_rank") or [s.get("peak_memory_bytes")]
    per_rank = [b for b in per_rank if b is not None]
    if not per_rank:
        return "n/a"
    return fmt_bytes(max(per_rank)) + (f" (max of {len(per_rank)} ranks)"
                                       if len(per_rank) > 1 else "")


def _bytes_per_step(run: Run) -> str:
    mean = _per_step(run).get("mean")
    if not run.summary:
        return "n/a"
    if not mean or not mean.get("sent"):
        return "none"
    ratio = byte_ratio(mean.get("original"), mean.get("sent"))
    if ratio is None or abs(ratio - 1) < 1e-9:
        return fmt_bytes(mean["sent"])
    return f"{fmt_bytes(mean['sent'])} ({fmt_bytes(mean['original'])} before compression, " \
           f"{ratio:.1f}x)"


def _match(run: Run) -> str:
    pvc = _predicted(run)
    if not pvc:
        return "n/a"
    off = [f"{c} ({v.get('mismatched_steps')} steps, first {v.get('first_mismatched_step')})"
           for c, v in sorted(pvc.items()) if not v.get("match")]
    return (f"yes, all {len(pvc)} categories" if not off else "no: " + ", ".join(off))


def _keys(section: dict, keys: list[str]) -> str:
    return ", ".join(f"{k}={_value(section[k])}" for k in keys if k in section)


def _value(v) -> str:
    if isinstance(v, bool):
        return str(v).lower()
    if isinstance(v, list):
        return ",".join(map(str, v)) if v else "[]"
    return f"{v:g}" if isinstance(v, float) else str(v)


def _compress(c: dict) -> str:
    keys = []
    if c.get("dense", "none") != "none":
        keys += ["dense"] + [k for k in c if k.startswith("dense_")]
        keys += ["powersgd_rank"] if c["dense"] == "powersgd" else []
    if c.get("embedding", "none") != "none":
        keys += ["embedding"] + [k for k in c if k.startswith("embedding_")]
    return _keys(c, keys) or "none"


def _sync(s: dict) -> str:
    return "none" if s.get("algorithm", "none") == "none" else _keys(s, list(s))


def _model(m: dict) -> str:
    return (f"{m.get('arch')}, dim {m.get('embedding_dim')}, bottom "
            f"{'-'.join(map(str, m.get('bottom_mlp', [])))}, top "
            f"{'-'.join(map(str, m.get('top_mlp', [])))}, {m.get('interaction')} interaction, "
            f"{m.get('pooling')} pooling")


def _optim(o: dict) -> str:
    out = (f"dense {o.get('dense')} lr {_value(o.get('dense_lr'))}, sparse {o.get('sparse')} "
           f"lr {_value(o.get('sparse_lr'))}, warm-up {o.get('warmup_steps')} steps, "
           f"decay {o.get('decay')}")
    return out + (f" from step {o['decay_start']}" if o.get("decay", "none") != "none" else "")


def _sharding(run: Run) -> str:
    out = str((run.config or {}).get("dist", {}).get("sharding", "n/a"))
    if run.plan:
        out += " (plan.json: " + ", ".join(f"{n} {kind}" for kind, n in
                                          sorted(run.plan.items(), key=lambda kv: -kv[1])) + ")"
    return out


def _batch(run: Run) -> str:
    b, w = (run.config or {}).get("data", {}).get("batch_size"), _world(run)
    if b is None:
        return "n/a"
    return f"{b:,} per rank x {w} = {b * w:,}" if w and w > 1 else f"{b:,}"


def _status(run: Run) -> str:
    return "partial" if run.partial else "finished"


def _failures(run: Run) -> str:
    n, recovered = len(run.failures), sum(1 for f in run.failures if f.recovery)
    if not n:
        return "none recorded"
    return f"{n} ({recovered} recovered; see below)" if recovered else f"{n} (no recovery recorded; see below)"


def _cfg(section: str, fn: Callable[[dict], str]) -> Callable[[Run], str]:
    return lambda run: fn((run.config or {}).get(section, {})) if run.config else "n/a"


ROWS: list[tuple[str, Callable[[Run], str]]] = [
    ("directory", lambda r: str(r.path)),
    ("status", _status),
    ("failures", _failures),
    ("world size", lambda r: _num(_world(r), "{}")),
    ("steps", lambda r: _num(r.last_step, "{:,}")),
    ("final AUC", lambda r: _num(final_eval(r).get("auc"))),
    ("final log loss", lambda r: _num(final_eval(r).get("log_loss"))),
    ("final NE", lambda r: _num(final_eval(r).get("ne"))),
    ("evaluated at step", lambda r: _num(final_eval(r).get("step"), "{:,}")),
    ("eval rows", lambda r: _num(final_eval(r).get("count"), "{:,}")),
    ("train samples/s", lambda r: _num(samples_per_sec(r), "{:,.0f}")),
    ("peak memory", _memory),
    ("bytes sent/step (rank 0)", _bytes_per_step),
    ("predicted = counted bytes", _match),
    ("model", _cfg("model", _model)),
    ("batch", _batch),
    ("optimizers", _cfg("optim", _optim)),
    ("dist.sharding", _sharding),
    ("dist", _cfg("dist", lambda d: _keys(d, ["dense_sync", "pipeline", "exchange", "backend"]))),
    ("compress", _cfg("compress", _compress)),
    ("sync", _cfg("sync", _sync)),
    ("data", lambda r: str((r.config or {}).get("data", {}).get("path", "n/a"))),
    ("versions", lambda r: ", ".join(f"{k} {v}" for k, v in
                                     (r.summary or {}).get("versions", {}).items()
                                     if k in ("hybridrec", "torch")) or "n/a"),
]
"""The header table: one row per (name, value of a run)."""


# ---------------------------------------------------------------- charts


def _bytes_groups(runs: list[Run]) -> list[BarGroup]:
    """A group per category (most bytes first), a bar per run that sent anything: the mean
    bytes sent per step, the bytes before compression below where they differ."""
    sending = [(i, r) for i, r in enumerate(runs) if _per_step(r).get("mean_by_category")]
    cats: dict[str, float] = {}
    for _, r in sending:
        for c, v in _per_step(r)["mean_by_category"].items():
            cats[c] = max(cats.get(c, 0.0), v.get("sent") or 0.0, v.get("original") or 0.0)
    groups = []
    for c in sorted(cats, key=lambda c: (-cats[c], c)):
        bars = []
        for i, r in sending:
            v = _per_step(r)["mean_by_category"].get(c, {})
            sent, original = v.get("sent") or 0.0, v.get("original") or 0.0
            ratio = byte_ratio(original, sent)
            compressed = ratio is not None and abs(ratio - 1) > 1e-9
            bars.append(Bar(r.label, sent, color(i), text=f"{fmt_bytes(sent)} sent",
                            second=original if compressed else None,
                            second_text=f"{fmt_bytes(original)} before compression "
                                        f"({ratio:.1f}x)" if compressed else ""))
        groups.append(BarGroup(c, bars))
    return groups


def _predicted_groups(runs: list[Run]) -> list[BarGroup]:
    cats = sorted({c for r in runs for c in _predicted(r)})
    groups = []
    for c in cats:
        bars = []
        for i, r in enumerate(runs):
            v = _predicted(r).get(c)
            if v is None:
                continue
            counted = (v.get("counted_per_step") or {}).get("sent") or 0.0
            predicted = (v.get("predicted_per_step") or {}).get("sent") or 0.0
            verdict = ("equal every step" if v.get("match") else
                       f"{v.get('mismatched_steps')} steps differ, first "
                       f"{v.get('first_mismatched_step')}")
            bars.append(Bar(r.label, counted, color(i), text=f"{fmt_bytes(counted)} counted",
                            second=predicted,
                            second_text=f"{fmt_bytes(predicted)} predicted ({verdict})"))
        groups.append(BarGroup(c, bars))
    return groups


CAPTIONS = {
    "loss": "Train loss: the mean over the steps since the previous train record",
    "auc": "Held-out AUC at each evaluation",
    "log_loss": "Held-out log loss at each evaluation",
    "throughput": "Training samples/s of the global batch (all ranks), as logged",
    "bytes": "Bytes sent per step by communication category (rank 0's ledger); a lighter "
             "bar: the same data before compression",
    "predicted": "Bytes sent per step: counted by the ledger and (lighter) predicted by the "
                 "cost model",
}
CHARTS = tuple(CAPTIONS)
"""The SVG files (``<name>.svg``) a report may hold; ``predicted`` only where a run's
ledger compared predicted with counted bytes."""


def _line(runs: list[Run], split: str, key: str, title: str, y_label: str, **kw) -> str:
    """One line per run: ``key`` of its ``split`` records against the step."""
    series = [Series(r.label, [(rec["step"], rec[key]) for rec in
                               (r.train if split == "train" else r.evals)
                               if rec.get(key) is not None], color(i))
              for i, r in enumerate(runs)]
    return line_svg(series, title=title, x_label="step", y_label=y_label, x_min=0,
                    empty="no train records" if split == "train" else "no evaluation yet", **kw)


def charts(runs: list[Run]) -> dict[str, str]:
    """name -> SVG document for every chart of these runs (see :data:`CAPTIONS`)."""
    several = len(runs) > 1
    four = "{:.4f}".format
    # (stream runs: each batch scored before it trained, over a sliding window)
    held = "Test-then-train" if all(r.evals and r.evals[0].get("progressive") for r in runs) else "Held-out"
    out = {
        "loss": _line(runs, "train", "loss", "Train loss", "BCE loss"),
        "auc": _line(runs, "eval", "auc", f"{held} AUC", "AUC", last_format=four),
        "log_loss": _line(runs, "eval", "log_loss", f"{held} log loss", "log loss",
                          last_format=four),
        "throughput": _line(runs, "train", "samples_per_sec", "Throughput", "samples/s",
                            y_format="{:,.0f}".format),
    }
    one_rank = [r.label for r in runs if r.summary and not _per_step(r).get("mean_by_category")]
    note = "rank 0's ledger, mean per training step"
    if one_rank and several:
        note += "; nothing sent by " + ", ".join(one_rank)
    groups = _bytes_groups(runs)
    out["bytes"] = bar_svg(
        groups, title="Bytes sent per step by category", x_label="bytes per step",
        x_format=fmt_bytes, x_base=1024, note=note,
        legend=[*_legend(runs, groups, several), ("before compression", "#7f8c8d", True)],
        empty="nothing sent (one rank)" if any(r.summary for r in runs) else "no summary.json")
    if any(_predicted(r) for r in runs):
        groups = _predicted_groups(runs)
        out["predicted"] = bar_svg(
            groups, title="Predicted vs counted bytes per step", x_label="bytes sent per step",
            x_format=fmt_bytes, x_base=1024,
            note="rank 0, mean per step; the verdict compares every step",
            legend=[*_legend(runs, groups, several), ("predicted", "#7f8c8d", True)])
    return out


def _legend(runs: list[Run], groups: list[BarGroup], several: bool) -> list:
    """The runs that have a bar, in run order (none for a single run)."""
    shown = {b.label for g in groups for b in g.bars}
    return [(r.label, color(i), False) for i, r in enumerate(runs)
            if several and r.label in shown]


# ---------------------------------------------------------------- the page

_CSS = """body{font-family:sans-serif;margin:24px;color:#222}
table{border-collapse:collapse;margin-bottom:24px;font-size:13px}
th,td{border:1px solid #ccc;padding:3px 8px;text-align:left;vertical-align:top}
th{background:#f3f3f3}tr.differs td{background:#fff6d5}
.notes{color:#a04000}figure{margin:0 0 28px 0}figcaption{font-size:13px;color:#444}
svg{max-width:100%;height:auto}"""


def _table(runs: list[Run]) -> list[str]:
    out = ["<table>", "<tr><th></th>" + "".join(f"<th>{escape(r.label)}</th>" for r in runs)
           + "</tr>"]
    for name, fn in ROWS:
        cells = [fn(r) for r in runs]
        differs = len(runs) > 1 and len(set(cells)) > 1 and name != "directory"
        row = '<tr class="differs">' if differs else "<tr>"
        out.append(f"{row}<th>{escape(name)}</th>"
                   + "".join(f"<td>{escape(c)}</td>" for c in cells) + "</tr>")
    return out + ["</table>"]


def _failures_table(runs: list[Run]) -> list[str]:
    """A row per failure of every run (nothing when none failed)."""
    rows = [(r, f) for r in runs for f in r.failures]
    if not rows:
        return []
    several = len(runs) > 1
    head = (["run"] if several else []) + ["when", "after step", "rank", "what failed", "recovery",
                                            "recovery took"]
    out = ["<h2>Failures and recoveries</h2>", "<table>",
           "<tr>" + "".join(f"<th>{h}</th>" for h in head) + "</tr>"]
    for run, f in rows:
        cells = ([run.label] if several else []) + [
            _clock(f.time) if f.time is not None else "n/a", _num(f.step, "{:,}"),
            _ranks(f.ranks) or "n/a", f.what, f.recovery or "none recorded", _took(f)]
        out.append("<tr>" + "".join(f"<td>{escape(str(c))}</td>" for c in cells) + "</tr>")
    return out + ["</table>"]


def html_page(runs: list[Run], figures: dict[str, str]) -> str:
    """index.html: the notes, the table, the charts inline (each links its SVG file)."""
    title = "hybridrec report: " + ", ".join(r.label for r in runs)
    out = ['<?xml version="1.0" encoding="UTF-8"?>', "<!DOCTYPE html>",
           '<html xmlns="http://www.w3.org/1999/xhtml" lang="en"><head><meta charset="utf-8"/>',
           f"<title>{escape(title)}</title><style>{_CSS}</style></head><body>",
           f"<h1>{escape(title)}</h1>",
           f"<p>Written {time.strftime('%Y-%m-%d %H:%M:%S')}. "
           + ("Rows that differ between the runs are marked. " if len(runs) > 1 else "")
           + "Bytes: rank 0's communication ledger.</p>"]
    notes = [f"{r.label}: {n}" for r in runs for n in r.notes]
    if notes:
        out += ['<ul class="notes">', *(f"<li>{escape(n)}</li>" for n in notes), "</ul>"]
    out += _table(runs)
    out += _failures_table(runs)
    for name, svg in figures.items():
        out += ["<figure>", svg.split("\n", 1)[1].rstrip("\n"),
                (f"<figcaption>{escape(CAPTIONS[name])} "
                 f'(<a href="{name}.svg">{name}.svg</a>)</figcaption></figure>')]
    out.append("</body></html>")
    return "\n".join(out) + "\n"


def build_report(run_dirs: list[Path], out: Path | None = None) -> tuple[Path, list[Run]]:
    """Reads the runs, writes ``out`` (default: :func:`default_out`): the SVGs, then
    index.html; returns index.html's path and the runs (their ``notes`` say what is
    missing). HybridrecError for a directory that is no run, OSError (naming the file) for
    a report that cannot be written."""
    paths = [Path(p) for p in run_dirs]
    if not paths:
        raise HybridrecError("report: no run directory given")
    if out is None and default_out(paths).is_symlink():  # (a run's report stays in its directory)
        raise HybridrecError(f"{default_out(paths)} is a symbolic link: the report is not written through it; "
                             "remove the link, or name where the report goes (--out DIR)")
    runs = [load_run(p, label) for p, label in zip(paths, labels(paths))]
    out = Path(out) if out is not None else default_out(paths)
    figures = charts(runs)
    # A file that cannot be written raises OSError naming it (RUN/report/loss.svg: No
    # space left on device); each file is written whole or not at all.
    for name, svg in figures.items():
        write_text_atomic(out / f"{name}.svg", svg)
    for name in CHARTS:  # a chart an earlier report had and this one has not
        if name not in figures:
            (out / f"{name}.svg").unlink(missing_ok=True)
    write_text_atomic(out / "index.html", html_page(runs, figures))
    return out / "index.html", runs


def write_report(run_dir: Path, *, on_error: Callable[[str], None] | None = None) -> Path | None:
    """RUN/report/ for one run directory; returns index.html's path, or None when the
    report could not be made: the reason goes to ``on_error`` (one line), else to this
    module's logger as a warning. Never raises for a report problem (meant for the end of
    a training run, on rank 0, after summary.json is written)."""
    try:
        return build_report([Path(run_dir)])[0]
    except Exception as e:  # noqa: BLE001 (a plot must never fail the training run)
        why = os_error_message(e) if isinstance(e, OSError) else str(e)
        reason = f"report for {run_dir} not written: {why}"
        if on_error is not None:
            on_error(reason)
        else:
            _log.warning(reason)
        return None
