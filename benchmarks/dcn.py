"""DLRM-DCNv2 against the dot DLRM on the demo, and the MLPerf DLRM-DCNv2 recipe at reduced size.

Part 1, the bar of ``model.interaction=dcn`` (docs/benchmarks.md, "DLRM-DCNv2"): the demo's
data (``data synth`` 7 days x 100,000 rows, seed 0, the last day held out) trained with
``--recipe demo`` once with the dot interaction and once with ``model.interaction=dcn`` (its
default layers and rank), one after the other (A/B, so that both see the same load on a shared
machine), for each training seed and precision (fp32, ``train.precision=bf16``). Recorded per
run: held-out AUC, the mean step (``summary.json`` ``throughput``: the measured steps'
seconds / steps), and ``/proc/loadavg`` before and after.

Part 2, the ``mlperf-dcnv2`` recipe end to end on a synthetic log preprocessed into the
reference's table shape at 1/1000 of its rows (``--table-size`` of
``recipes.mlperf_table_sizes(0.001)``: 4 tables of 40,000 rows, the rest in proportion, at
least 2), ``data.batch_size`` lowered to 1,024 (the 2-core machine's), one epoch; and the same
recipe on the reference's full table sizes, refused by the memory check (its one line kept).

A precision the processor refuses (bf16 without bf16 kernels, a Zen 3) is recorded with its
refusal and not run.

Part 3 (``--products``, alone with ``--skip-demo --skip-mlperf``): the six products of one
cross layer at the demo's shape (batch 512, 432 inputs, rank 16; fp32, 2 threads), each timed
through torch (MKL on an x86 CPU) and through oneDNN's linear
(:func:`~hybridrec.model.kernels.onednn_linear`, which may use instructions MKL leaves unused
on an AMD processor): whether routing the cross layers' products through oneDNN could pay on
this processor, in a few seconds. The last product accumulates in place in torch
(``addmm_``); oneDNN's is a product and an ``add_``.

Usage: ``.venv/bin/python benchmarks/dcn.py [--out DIR] [--seeds 0 1 2] [--rounds N]
[--skip-demo] [--skip-mlperf] [--products]``; writes ``DIR/results.json`` and prints a table.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

from hybridrec.files import write_json_atomic
from hybridrec.model.kernels import cpu_name, precision_problem
from hybridrec.train.setup.recipes import mlperf_table_sizes

HERE = Path(__file__).resolve().parent


def hybridrec(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    r = subprocess.run([sys.executable, "-m", "hybridrec", *args], capture_output=True, text=True, check=False)
    if check and r.returncode != 0:
        raise SystemExit(f"hybridrec {' '.join(args)} failed:\n{r.stderr[-2000:]}")
    return r


def loadavg() -> float:
    return float(Path("/proc/loadavg").read_text().split()[0])


def dataset(out: Path, name: str, *, days: int, rows: int, table_size: str | None = None) -> Path:
    raw, pre = out / f"{name}-raw", out / name
    if not (pre / "meta.json").is_file():
        hybridrec("data", "synth", "--out", str(raw), "--days", str(days), "--rows-per-day", str(rows),
                  "--seed", "0", "--overwrite")
        extra = ["--table-size", table_size] if table_size else []
        hybridrec("data", "preprocess", *sorted(str(p) for p in raw.glob("day_*.tsv")), "--out", str(pre),
                  "--overwrite", *extra)
    return pre


def train(data: Path, run: Path, *overrides: str, recipe: str = "demo") -> dict:
    before = loadavg()
    started = time.perf_counter()
    hybridrec("train", "--recipe", recipe, f"data.path={data}", f"train.run_dir={run}", "train.progress=false",
              *overrides)
    s = json.loads((run / "summary.json").read_text())
    t = s["throughput"]
    return {"auc": s["eval"]["auc"], "step_ms": 1e3 * t["measured_seconds"] / max(1, t["measured_steps"]),
            "steps": s["step"], "wall_s": round(time.perf_counter() - started, 1),
            "threads": s["versions"].get("threads"), "load_before": before, "load_after": loadavg()}


def demo_bar(out: Path, seeds: list[int], rounds: int = 1) -> list[dict]:
    data = dataset(out, "demo", days=7, rows=100_000)
    rows = []
    for precision in ("fp32", "bf16"):
        refused = precision_problem(precision, "cpu")
        if refused:  # bf16 on a processor without bf16 kernels (a Zen 3): refused, nothing to time
            print(f"{precision}: not run: {refused}", flush=True)
            rows.append({"precision": precision, "refused": refused})
            continue
        for rnd, seed in ((r, s) for r in range(rounds) for s in seeds):
            pair = {"precision": precision, "seed": seed, "round": rnd}
            for kind in ("dot", "dcn"):
                run = out / "runs" / f"{kind}-{precision}-s{seed}"
                subprocess.run(["rm", "-rf", str(run)], check=True)
                pair[kind] = train(data, run, f"model.interaction={kind}", f"train.seed={seed}",
                                   f"train.precision={precision}")
            pair["auc_diff"] = pair["dcn"]["auc"] - pair["dot"]["auc"]
            pair["step_ratio"] = pair["dcn"]["step_ms"] / pair["dot"]["step_ms"]
            print(f"{precision} seed {seed}: AUC dot {pair['dot']['auc']:.4f} dcn {pair['dcn']['auc']:.4f} "
                  f"({pair['auc_diff']:+.4f}); step dot {pair['dot']['step_ms']:.1f} ms dcn "
                  f"{pair['dcn']['step_ms']:.1f} ms ({pair['step_ratio']:.2f}x); load "
                  f"{pair['dot']['load_before']:.1f}-{pair['dcn']['load_after']:.1f}", flush=True)
            rows.append(pair)
        pairs = [r for r in rows if r["precision"] == precision]
        dot, dcn = (sum(r[k]["step_ms"] for r in pairs) for k in ("dot", "dcn"))
        print(f"{precision}: pooled over {len(pairs)} pairs: dcn step / dot step {dcn / dot:.2f}x "
              f"(single pairs {min(r['step_ratio'] for r in pairs):.2f}-{max(r['step_ratio'] for r in pairs):.2f}x)",
              flush=True)
    return rows


def mlperf(out: Path) -> dict:
    small = dataset(out, "mlperf-reduced", days=3, rows=20_000, table_size=mlperf_table_sizes(0.001))
    run = out / "runs" / "mlperf-reduced"
    subprocess.run(["rm", "-rf", str(run)], check=True)
    reduced = train(small, run, "data.batch_size=1024", "data.eval_batch_size=4096", recipe="mlperf-dcnv2")
    print(f"mlperf-dcnv2 at 1/1000 of the tables: AUC {reduced['auc']:.4f}, {reduced['steps']} steps, "
          f"{reduced['step_ms']:.0f} ms/step, {reduced['wall_s']} s", flush=True)
    full = dataset(out, "mlperf-full", days=2, rows=2_000, table_size=mlperf_table_sizes())
    r = hybridrec("train", "--recipe", "mlperf-dcnv2", f"data.path={full}", f"train.run_dir={out / 'runs' / 'full'}",
                  "data.batch_size=512", "train.progress=false", check=False)
    refusal = r.stderr.strip().splitlines()[-1] if r.stderr.strip() else ""
    print(f"mlperf-dcnv2 at full size: exit {r.returncode}: {refusal}", flush=True)
    return {"reduced": reduced, "table_size": mlperf_table_sizes(0.001), "full_exit": r.returncode,
            "full_refusal": refusal}


def products(reps: int = 2000, batch: int = 512, width: int = 432, rank: int = 16) -> dict:
    """Microseconds of each product of a cross layer (forward: ``h = x V^T``, ``y = h U^T + b``;
    backward: ``gh = gy U``, ``gV = gh^T x``, ``gU = gy^T h``, ``g += gh V``) through torch and
    through oneDNN, median of 3 passes of ``reps`` calls each."""
    import statistics

    import torch

    from hybridrec.model.kernels import onednn_available, onednn_linear

    torch.set_num_threads(2)
    g = torch.Generator().manual_seed(0)
    x, gy, g_in = (torch.randn(batch, width, generator=g) for _ in range(3))
    h, gh = (torch.randn(batch, rank, generator=g) for _ in range(2))
    v, u, b = torch.randn(rank, width, generator=g), torch.randn(width, rank, generator=g), torch.randn(width)
    cases = {
        "h = x V^T": (lambda: torch.mm(x, v.t()), lambda: onednn_linear(x, v)),
        "y = h U^T + b": (lambda: torch.addmm(b, h, u.t()), lambda: onednn_linear(h, u, b)),
        "gh = gy U": (lambda: torch.mm(gy, u), lambda: onednn_linear(gy, u.t())),
        "gV = gh^T x": (lambda: torch.mm(gh.t(), x), lambda: onednn_linear(gh.t(), x.t())),
        "gU = gy^T h": (lambda: torch.mm(gy.t(), h), lambda: onednn_linear(gy.t(), h.t())),
        "g += gh V": (lambda: g_in.addmm_(gh, v), lambda: g_in.add_(onednn_linear(gh, v.t()))),
    }

    def us(f) -> float:
        for _ in range(50):
            f()
        passes = []
        for _ in range(3):
            t = time.perf_counter()
            for _ in range(reps):
                f()
            passes.append((time.perf_counter() - t) / reps * 1e6)
        return statistics.median(passes)

    rows = {}
    for name, (plain, onednn) in cases.items():
        rows[name] = {"torch_us": us(plain), "onednn_us": us(onednn) if onednn_available() else None}
        o = rows[name]["onednn_us"]
        print(f"{name:14s} torch {rows[name]['torch_us']:7.1f} us   oneDNN "
              + (f"{o:7.1f} us ({o / rows[name]['torch_us']:.2f}x)" if o is not None else "not available"),
              flush=True)
    total = {k: sum(r[k] for r in rows.values()) if all(r[k] is not None for r in rows.values()) else None
             for k in ("torch_us", "onednn_us")}
    print(f"{'a layer':14s} torch {total['torch_us']:7.1f} us   oneDNN "
          + (f"{total['onednn_us']:7.1f} us" if total["onednn_us"] is not None else "-"), flush=True)
    return {"shape": {"batch": batch, "width": width, "rank": rank, "threads": 2}, "products": rows, "layer": total}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=str(HERE / "out" / "dcn"))
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--rounds", type=int, default=1, help="run every seed's pair this many times (the step "
                   "ratio is pooled over all pairs: the sum of dcn steps over the sum of dot steps)")
    p.add_argument("--skip-demo", action="store_true")
    p.add_argument("--skip-mlperf", action="store_true")
    p.add_argument("--products", action="store_true", help="time a cross layer's six products through "
                   "torch and through oneDNN (part 3)")
    a = p.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    result = {"cpu": cpu_name(), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
              "command": " ".join(sys.argv), "seeds": a.seeds}
    if not a.skip_demo:
        result["demo"] = demo_bar(out, a.seeds, a.rounds)
    if not a.skip_mlperf:
        result["mlperf"] = mlperf(out)
    if a.products:
        result["products"] = products()
    write_json_atomic(out / "results.json", result)
    print(f"-> {out / 'results.json'}")


if __name__ == "__main__":
    main()
