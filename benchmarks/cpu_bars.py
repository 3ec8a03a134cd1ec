"""The CPU throughput bars on this machine, in one command, with a verdict per bar.

    .venv/bin/python benchmarks/cpu_bars.py                # 3 rounds, ~10 min on 2 cores
    .venv/bin/python benchmarks/cpu_bars.py --rounds 1     # a first look

Runs, in order, and reads back what they write:

1. ``benchmarks/throughput.py --rounds R --no-ablation --variant bf16=train.precision=bf16``
   with 1 process and with ``--nproc 2``: hybridrec fp32 and bf16 against TorchRec (fp32), the
   benchmark DLRM (needs ``benchmarks/peers/setup_torchrec.sh``);
2. the demo's full runs (``hybridrec demo --seed S``) in fp32 and in bf16 for each of
   ``--seeds``, held-out AUC;
3. ``benchmarks/profile_step.py`` (fp32 and bf16, 1 process): where a step's time goes, by
   phase and operator, on this processor (``--no-profile`` skips it).

and prints the bars with the measured values: fp32 >= 1.25x TorchRec (1 process and 2
ranks); bf16 >= 2x TorchRec at an AUC within 0.001 of fp32 on every seed; bf16 >= 100,000
samples/s in 1 process. The processor's name, family and model head the table (kernels are
chosen by timing on the machine, so the numbers belong to it). Writes ``cpu_bars.json``
and ``cpu_bars.md`` (the profile's tables after the bars) under ``--out``.

On a processor where ``train.precision=bf16`` is refused (no bf16 kernels: a Zen 3), the bf16
runs are left out and its bars marked "not available" with the reason; the rest runs.
"""

from __future__ import annotations

import argparse
import datetime
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

from throughput import PEER_PY, machine

from hybridrec.model.kernels import precision_problem


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "out" / "cpu_bars"), help="work directory")
    p.add_argument("--rounds", type=int, default=3, help="alternating rounds of each throughput run")
    p.add_argument("--seeds", default="0,1", help="demo seeds for the bf16 AUC check")
    p.add_argument("--nproc", default="1,2", help="process counts of the throughput runs")
    p.add_argument("--profile", action=argparse.BooleanOptionalAction, default=True,
                   help="also profile a step in fp32 and bf16 (benchmarks/profile_step.py, ~1 min)")
    return p.parse_args(argv)


def run(cmd: list[str], *, capture: bool = False) -> str | None:
    """Run ``cmd`` from the project root, shown first; its stdout when ``capture``."""
    print("$ " + " ".join(cmd), file=sys.stderr, flush=True)
    proc = subprocess.run(cmd, cwd=ROOT, stdout=subprocess.PIPE if capture else None, text=True, check=False)
    if proc.returncode:
        raise SystemExit(f"failed ({proc.returncode}): {' '.join(cmd)}")
    return proc.stdout


def throughput(nproc: int, rounds: int, out: Path, *, bf16: bool) -> dict:
    work = out / f"throughput-{nproc}"
    variant = ["--variant", "bf16=train.precision=bf16"] if bf16 else []
    run([sys.executable, "benchmarks/throughput.py", "--rounds", str(rounds), "--no-ablation", *variant,
         "--nproc", str(nproc), "--out", str(work)])
    rep = json.loads((work / f"throughput-nproc{nproc}-mh0.json").read_text())["results"]
    return {name: {"samples_per_sec": v["median_samples_per_sec"], "runs": v["runs"],
                   "vs_torchrec": v.get("vs_torchrec")} for name, v in rep.items()}


def demo_auc(seed: int, precision: str, out: Path) -> float:
    work = out / f"demo-seed{seed}-{precision}"
    run([sys.executable, "-m", "hybridrec", "demo", "--out", str(work), "--seed", str(seed),
         f"train.precision={precision}", "train.resume=false"])
    return json.loads((work / "run" / "summary.json").read_text())["eval"]["auc"]


def profile(out: Path, precisions: list[str]) -> str:
    """``benchmarks/profile_step.py``'s tables (each of ``precisions``, 1 process), as it prints them."""
    text = run([sys.executable, "benchmarks/profile_step.py", "--out", str(out / "profile"), "--top", "15",
                *(a for p in precisions for a in ("--precision", p))], capture=True)
    return "\n".join(ln for ln in text.splitlines() if not ln.startswith("written:")).strip()


NOT_AVAILABLE = "not available"
"""A bar's measurement where bf16 is refused on the processor (its verdict: None)."""


def verdicts(tp: dict, aucs: dict, bf16_problem: str | None = None) -> list[tuple[str, str, bool | None]]:
    """``(bar, measured, met)`` rows; ``met`` None where the bar cannot be measured here
    (``bf16_problem``: why bf16 is refused on this processor)."""
    rows = []
    na = f"{NOT_AVAILABLE} (bf16 refused on this processor: above)" if bf16_problem else None
    for n, r in sorted(tp.items()):
        where = "1 process" if n == 1 else f"{n} ranks"
        fp32 = r["hybridrec"]["vs_torchrec"]
        rows.append((f"fp32 >= 1.25x TorchRec, {where}", f"{fp32:.2f}x", fp32 >= 1.25))
        bf16 = None if na else r["bf16"]["vs_torchrec"]
        rows.append((f"bf16 >= 2x TorchRec (fp32), {where}", na or f"{bf16:.2f}x", None if na else bf16 >= 2.0))
    diffs = {} if na else {s: a["bf16"] - a["fp32"] for s, a in aucs.items()}
    rows.append(("bf16 AUC within 0.001 of fp32 (demo, every seed)",
                 na or ", ".join(f"seed {s}: {d:+.5f}" for s, d in diffs.items()),
                 None if na else all(abs(d) <= 0.001 for d in diffs.values())))
    if 1 in tp:
        sps = None if na else tp[1]["bf16"]["samples_per_sec"]
        rows.append(("bf16 >= 100,000 samples/s, 1 process", na or f"{sps:,.0f}", None if na else sps >= 100_000))
    return rows


def format_md(rep: dict) -> str:
    lines = [f"machine: {rep['machine']}   date: {rep['date']}   rounds: {rep['rounds']}", "",
             "| run | " + " | ".join(f"{n} proc: samples/s (vs TorchRec)" for n in rep["throughput"]) + " |",
             "|---|" + "---|" * len(rep["throughput"])]
    names = list(next(iter(rep["throughput"].values())))
    for name in names:
        cells = []
        for r in rep["throughput"].values():
            v = r.get(name)
            cells.append("-" if v is None else f"{v['samples_per_sec']:,.0f} ({v['vs_torchrec']:.2f}x)"
                         if v.get("vs_torchrec") else f"{v['samples_per_sec']:,.0f}")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    lines += ["", "| demo seed | fp32 AUC | bf16 AUC |", "|---|---|---|"]
    lines += [f"| {s} | {a['fp32']:.5f} | {a['bf16']:.5f} |" if "bf16" in a else f"| {s} | {a['fp32']:.5f} | - |"
              for s, a in rep["demo_auc"].items()]
    if rep.get("bf16_refused"):
        lines += ["", f"bf16: {rep['bf16_refused']}"]
    lines += ["", "| bar | measured | |", "|---|---|---|"]
    lines += [f"| {bar} | {got} | {'n/a' if ok is None else 'met' if ok else 'MISSED'} |"
              for bar, got, ok in rep["bars"]]
    if rep.get("profile"):
        lines += ["", "## Where a step goes (benchmarks/profile_step.py, 1 process)", "", rep["profile"]]
    return "\n".join(lines)


def main(argv=None) -> int:
    args = parse_args(argv)
    if not PEER_PY.exists():
        print("TorchRec venv missing: run benchmarks/peers/setup_torchrec.sh first", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    refused = precision_problem("bf16", "cpu")  # (a Zen 3: the bf16 runs would only be refused)
    precisions = ["fp32"] if refused else ["fp32", "bf16"]
    if refused:
        print(f"bf16 left out: {refused}", file=sys.stderr, flush=True)
    tp = {int(n): throughput(int(n), args.rounds, out, bf16=not refused) for n in args.nproc.split(",")}
    aucs = {int(s): {p: demo_auc(int(s), p, out) for p in precisions} for s in args.seeds.split(",")}
    rep = {"machine": machine(), "date": str(datetime.date.today()), "rounds": args.rounds,
           "throughput": tp, "demo_auc": aucs, "bars": verdicts(tp, aucs, refused), "bf16_refused": refused,
           "profile": profile(out, precisions) if args.profile else None}
    (out / "cpu_bars.json").write_text(json.dumps(rep, indent=2))
    md = format_md(rep)
    (out / "cpu_bars.md").write_text(md + "\n")
    print(md)
    print(f"\nwritten: {out / 'cpu_bars.md'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
