"""Results of a compression sweep: per-run records, per-setting aggregates, the Pareto
front of held-out AUC against bytes sent, and the files ``results.json``,
``results.md`` and ``pareto.svg`` (each written atomically).

Bytes are rank 0's ledger (``summary.json``'s ``comm``): the mean per training step of
what it sent to other ranks, by category; ``ratio`` is the ledger's original float32
bytes over the bytes sent (indices, scales and headers counted). Every ratio is a ratio of
means: a run's mean original bytes per step over its mean sent bytes per step, and a
setting's mean original bytes (over its seeds) over its mean sent bytes, never a mean of
per-seed ratios (which overstates whenever the seeds send different amounts).
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

from hybridrec.bench.svg import Panel, Point, scatter_svg
from hybridrec.files import write_json_atomic, write_text_atomic

BASELINE = "baseline"
"""The setting every sweep includes: no compression, the reference of the others' AUC and bytes."""

CATEGORIES = ("dense_allreduce", "output_dist")
"""The table's byte columns: dense data-parallel gradients and pooled embeddings."""

LINKS = {"1gbit": 1e9, "100mbit": 1e8}
"""Link rates (bit/s per direction) of the modelled end-to-end times."""


def modelled_seconds(steps: int, step_seconds: float, sent: float, received: float, rate_bps: float) -> float:
    """A run's time on a link of ``rate_bps`` per direction, modelled: every step takes its
    measured time (on the machine the sweep ran on, ranks on loopback) plus the time rank 0's
    bytes of the step need at the line rate, ``max(sent, received) * 8 / rate`` (full duplex),
    with no overlap of compute and communication. A model, not a measurement: gloo reaches
    ~50-95% of a real link's rate (docs/benchmarks.md, "Link rate of gloo collectives") and
    overlaps part of it with compute."""
    return steps * (step_seconds + max(sent, received) * 8 / rate_bps)


def run_record(result: dict) -> dict:
    """One run's numbers (from :func:`compression.train_one`), without the full summary."""
    rec = {k: v for k, v in result.items() if k != "summary"}
    s = result.get("summary")
    if s is None:
        return rec
    comm = s.get("comm", {})
    per_cat = comm.get("per_step", {}).get("mean_by_category", {})
    total = comm.get("per_step", {}).get("mean", {})
    sent = {c: v.get("sent", 0.0) for c, v in per_cat.items()}
    original = {c: v.get("original", 0.0) for c, v in per_cat.items()}
    rec.update(
        auc=s["eval"].get("auc"), log_loss=s["eval"].get("log_loss"), ne=s["eval"].get("ne"),
        steps=s.get("step"), world_size=s.get("world_size"),
        samples_per_sec=s.get("throughput", {}).get("samples_per_sec_overall"),
        sent_per_step=sent, original_per_step=original,
        ratio={c: byte_ratio(original[c], sent[c]) for c in per_cat},
        total_sent_per_step=total.get("sent", 0.0),
        total_received_per_step=total.get("received", 0.0),
        total_original_per_step=total.get("original", 0.0))
    tp = s.get("throughput", {})
    if tp.get("measured_steps") and tp.get("measured_seconds") and rec["steps"]:
        rec["step_seconds"] = tp["measured_seconds"] / tp["measured_steps"]
        rec["modelled_seconds"] = {
            link: modelled_seconds(rec["steps"], rec["step_seconds"], rec["total_sent_per_step"],
                                   rec["total_received_per_step"], rate) for link, rate in LINKS.items()}
    return rec


def progress_text(result: dict) -> str:
    """The second half of a progress line: metrics and bytes, or why the run failed."""
    if result["status"] == "failed":
        return f"FAILED after {result['seconds']:.0f} s: {result['error']} (log: {result['log']})"
    r = run_record(result)
    how = "reused" if result["status"] == "reused" else f"{result['seconds']:.0f} s"
    return (f"AUC {_num(r['auc'])}, log loss {_num(r['log_loss'])}, "
            f"{fmt_bytes(r['total_sent_per_step'])}/step sent ({how})")


def _num(v, fmt: str = "{:.4f}") -> str:
    return "n/a" if v is None or (isinstance(v, float) and math.isnan(v)) else fmt.format(v)


def fmt_bytes(n: float | None) -> str:
    if n is None:
        return "n/a"
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.3g} {unit}" if n % size else f"{n // size:.0f} {unit}"
    return f"{n:.0f} B"


def byte_ratio(original: float | None, sent: float | None) -> float | None:
    """``original / sent``; None where nothing was sent (or a mean is missing)."""
    if original is None or sent is None or sent <= 0:
        return None
    return original / sent


def mean_std(values: list[float]) -> tuple[float | None, float | None]:
    """Mean and sample standard deviation (None with fewer than 2 values)."""
    vals = [v for v in values if v is not None and not math.isnan(v)]
    if not vals:
        return None, None
    m = sum(vals) / len(vals)
    if len(vals) < 2:
        return m, None
    return m, math.sqrt(sum((v - m) ** 2 for v in vals) / (len(vals) - 1))


def pareto_front(points: list[tuple[float, float]], *, maximize_y: bool = True) -> list[bool]:
    """``points`` = (cost x, quality y); True where no other point is at least as good in
    both (x lower or equal, y higher or equal, or lower with ``maximize_y=False``) and
    better in one. Identical points are both on the front.

    ``pareto_front([(1, 0.70), (2, 0.75), (3, 0.74)])`` -> ``[True, True, False]``.
    """
    sign = 1 if maximize_y else -1

    def dominates(a, b):
        return a[0] <= b[0] and sign * a[1] >= sign * b[1] and (a[0] < b[0] or a[1] != b[1])

    return [not any(dominates(q, p) for q in points) for p in points]


def compressor_labels(compress: dict) -> tuple[str, str]:
    """``(dense, embedding)`` in words with their eta, e.g. ``("dct η=0.01", "none")``."""
    d = compress.get("dense", "none")
    if d in ("dct", "topk"):
        d += f" η={compress['dense_ratio']:g}"
    elif d == "powersgd":
        d += f" r={compress['powersgd_rank']}"
    e = compress.get("embedding", "none")
    if e == "dct":
        e += f" η={compress['embedding_ratio']:g}"
        if compress.get("embedding_values", "fp32") != "fp32":
            e += f" {compress['embedding_values']}"
    if e != "none" and compress.get("embedding_tables"):
        e += f" [{','.join(compress['embedding_tables'])}]"
    if e != "none" and compress.get("embedding_min_rows"):
        e += f" [>={compress['embedding_min_rows']:,} rows]"
    return d, e


def aggregate(name: str, runs: list[dict]) -> dict:
    """One setting over its seeds: means (and std of AUC / log loss) of the finished runs."""
    ok = [r for r in runs if r["status"] in ("ok", "reused")]
    dense, emb = compressor_labels(runs[0].get("compress", {})) if runs else ("?", "?")
    out = {"name": name, "dense": dense, "embedding": emb, "runs_ok": len(ok),
           "runs_failed": len(runs) - len(ok)}
    out["auc"], out["auc_std"] = mean_std([r["auc"] for r in ok])
    out["log_loss"], out["log_loss_std"] = mean_std([r["log_loss"] for r in ok])
    out["samples_per_sec"] = mean_std([r["samples_per_sec"] for r in ok])[0]
    out["total_sent_per_step"] = mean_std([r["total_sent_per_step"] for r in ok])[0]
    out["modelled_seconds"] = {link: mean_std([r.get("modelled_seconds", {}).get(link) for r in ok])[0]
                               for link in LINKS}
    out["sent_per_step"], out["original_per_step"], out["ratio"] = {}, {}, {}
    for c in CATEGORIES:
        sent = mean_std([r["sent_per_step"].get(c, 0.0) for r in ok])[0]
        original = mean_std([r.get("original_per_step", {}).get(c, 0.0) for r in ok])[0]
        out["sent_per_step"][c], out["original_per_step"][c] = sent, original
        # The ratio of the means, not the mean of the per-seed ratios.
        out["ratio"][c] = byte_ratio(original, sent)
    return out


def summarize(runs: dict[str, list[dict]], baseline: str) -> list[dict]:
    """Aggregates in sweep order, with ``delta_auc`` vs the baseline and ``pareto``
    (AUC vs total bytes sent per step, over the settings with a finished run)."""
    rows = [aggregate(name, rs) for name, rs in runs.items()]
    base = next((r["auc"] for r in rows if r["name"] == baseline), None)
    for r in rows:
        r["delta_auc"] = None if base is None or r["auc"] is None else r["auc"] - base
        r["pareto"] = False
    have = [r for r in rows if r["auc"] is not None and r["total_sent_per_step"] is not None]
    for r, on in zip(have, pareto_front([(r["total_sent_per_step"], r["auc"]) for r in have])):
        r["pareto"] = on
    return rows


def write_results(spec, runs: dict[str, list[dict]], *, complete: bool) -> dict:
    """results.json, results.md and pareto.svg for the runs so far (``spec`` is the
    :class:`~hybridrec.bench.compression.SweepSpec`)."""
    rows = summarize(runs, BASELINE)
    finished = sum(len(rs) for rs in runs.values())
    results = {
        "complete": complete,
        "runs_finished": finished,
        "runs_total": len(spec.settings) * len(spec.seeds),
        "written": time.strftime("%Y-%m-%d %H:%M:%S"),
        "data": str(spec.data), "nproc": spec.nproc, "recipe": spec.recipe, "seeds": spec.seeds,
        "max_steps": spec.max_steps, "overrides": list(spec.overrides), "baseline": BASELINE,
        "settings": [{**row, "overrides": list(s.overrides), "runs": runs.get(s.name, [])}
                     for s in spec.settings for row in rows if row["name"] == s.name],
    }
    write_text_atomic(spec.out / "pareto.svg", pareto_svg(rows, spec))
    write_text_atomic(spec.out / "results.md", format_markdown(results))
    write_json_atomic(spec.out / "results.json", results)  # last: its "complete" is the truth
    return results


def load_results(out: Path) -> dict:
    return json.loads((Path(out) / "results.json").read_text())


def pareto_svg(rows: list[dict], spec) -> str:
    """AUC and log loss against total bytes sent per step; the AUC panel marks the front
    of the table, the log-loss panel its own (lower is better)."""
    have = [r for r in rows if r["auc"] is not None and r["total_sent_per_step"] is not None]
    ll = [r for r in have if r["log_loss"] is not None]
    ll_front = pareto_front([(r["total_sent_per_step"], r["log_loss"]) for r in ll],
                            maximize_y=False)
    panels = [
        Panel("held-out AUC (higher is better)", "AUC",
              [Point(r["name"], r["total_sent_per_step"], r["auc"], r["auc_std"] or 0.0,
                     r["pareto"]) for r in have]),
        Panel("held-out log loss (lower is better)", "log loss",
              [Point(r["name"], r["total_sent_per_step"], r["log_loss"],
                     r["log_loss_std"] or 0.0, on) for r, on in zip(ll, ll_front)]),
    ]
    seeds = ",".join(map(str, spec.seeds))
    note = (f"{spec.nproc} rank(s), recipe {spec.recipe}, seeds {seeds}; bars: std over seeds; "
            "filled: Pareto front; bytes: rank 0's mean per step, all categories")
    if any(r["total_sent_per_step"] <= 0 for r in have):
        note += "; 0 B drawn at the left edge"
    return scatter_svg(panels, title="Compression sweep: quality vs bytes sent",
                       x_label="bytes sent per step (log scale)", x_format=fmt_bytes, x_base=1024,
                       note=note)


def _pm(mean, std) -> str:
    return _num(mean) + ("" if std is None else f" ± {std:.4f}")


def _bytes_cell(row: dict, cat: str) -> str:
    sent, ratio = row["sent_per_step"].get(cat), row["ratio"].get(cat)
    return fmt_bytes(sent) + ("" if ratio is None else f" ({ratio:.1f}x)")


def _time_cell(row: dict, base: dict | None, link: str) -> str:
    """Modelled minutes on ``link``, with the speed-up against the baseline's."""
    t = row.get("modelled_seconds", {}).get(link)
    if t is None:
        return "n/a"
    b = None if base is None else base.get("modelled_seconds", {}).get(link)
    return f"{t / 60:.1f} min" + (f" ({b / t:.2f}x)" if b else "")


def format_markdown(results: dict) -> str:
    """The table (one row per setting) with a header saying what was run and how."""
    steps = results["max_steps"] or "recipe's epochs"
    lines = ["# Compression sweep", ""]
    if not results["complete"]:
        lines += [(f"**Partial: {results['runs_finished']} of {results['runs_total']} runs "
                   "finished; the sweep is still running or was stopped.**"), ""]
    lines += [f"Data `{results['data']}`, {results['nproc']} rank(s), recipe "
              f"`{results['recipe']}`, seeds {', '.join(map(str, results['seeds']))}, "
              f"steps: {steps}" + (f", overrides `{' '.join(results['overrides'])}`"
                                  if results["overrides"] else "") + f". {results['written']}.",
              "",
              ("Bytes: rank 0's mean per training step sent to other ranks (ledger), with the "
               "mean original float32 bytes / mean bytes sent in parentheses (a ratio of means "
               "over seeds); total = every category. "
               "AUC and log loss on the held-out split: mean ± std over seeds. Pareto: no other "
               "setting has a higher AUC for no more bytes. At 1 Gbit/s and 100 Mbit/s: the "
               "run's time modelled as its measured step time plus its bytes per step at the line "
               "rate, no overlap (a model, not a measurement; speed-up against the baseline)."), "",
              ("| setting | dense (η) | embedding (η) | AUC | ΔAUC | log loss "
               "| dense all-reduce/step | output_dist/step | total sent/step | samples/s "
               "| at 1 Gbit/s | at 100 Mbit/s | Pareto |"),
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    base = next((r for r in results["settings"] if r["name"] == results["baseline"]), None)
    for r in results["settings"]:
        delta = ("ref" if r["name"] == results["baseline"] else
                 "n/a" if r["delta_auc"] is None else f"{r['delta_auc']:+.4f}")
        runs = "" if not r["runs_failed"] else f" ({r['runs_failed']} failed)"
        lines.append(
            f"| {r['name']}{runs} | {r['dense']} | {r['embedding']} "
            f"| {_pm(r['auc'], r['auc_std'])} | {delta} | {_pm(r['log_loss'], r['log_loss_std'])} "
            f"| {_bytes_cell(r, 'dense_allreduce')} | {_bytes_cell(r, 'output_dist')} "
            f"| {fmt_bytes(r['total_sent_per_step'])} | {_num(r['samples_per_sec'], '{:,.0f}')} "
            f"| {_time_cell(r, base, '1gbit')} | {_time_cell(r, base, '100mbit')} "
            f"| {'yes' if r['pareto'] else ''} |")
    failed = [(s["name"], run) for s in results["settings"] for run in s["runs"]
              if run["status"] == "failed"]
    if failed:
        lines += ["", "Failed runs:", ""]
        lines += [f"- `{name}` seed {run['seed']}: {run['error']} (log: `{run['log']}`)"
                  for name, run in failed]
    lines += ["", ("Plot: `pareto.svg`. Every number: `results.json`; every run: "
               "`<setting>/seed<k>/summary.json`.")]
    return "\n".join(lines) + "\n"
