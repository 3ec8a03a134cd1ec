"""DCT-MP's codec alone: what each implementation costs one rank on the benchmark's shapes.

For every implementation of :data:`hybridrec.comm.codecs.TOPK_IMPLS` that runs here (``native``
needs a C compiler), the four steps of a coded hop on ``[rows, pieces, cols]`` normal values,
one thread, best of ``--reps``:

- the selection alone (:func:`~hybridrec.comm.codecs.row_topk`),
- ``encode`` (the sender: selection, cast, pack), ``decode`` (the receiver: scatter into zeros),
- ``encode_grad`` (the receiver: the gradients at the kept positions), ``decode_grad`` (the
  sender: scatter into zeros).

Each is the fastest of ``--reps`` rounds that alternate the five (``kernels.race``).

The defaults are the benchmark DLRM's step on 2 ranks since a rank codes only the rows that
travel: 2,048 samples of the other rank x 13 tables of 64 columns, k 4 (eta 0.05), fp16 values.

    .venv/bin/python benchmarks/codec_speed.py
    .venv/bin/python benchmarks/codec_speed.py --rows 4096 --values fp32
"""

from __future__ import annotations

import argparse
import datetime
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from throughput import machine  # this folder's: the CPU model


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=2048, help="samples coded (rows of the block)")
    p.add_argument("--pieces", type=int, default=13, help="pieces per row (tables of this rank)")
    p.add_argument("--cols", type=int, default=64, help="columns of a piece (the tables' dim)")
    p.add_argument("--eta", type=float, default=0.05, help="kept share of a row (k = ceil(eta * cols))")
    p.add_argument("--values", default="fp16", choices=["fp32", "fp16", "bf16"], help="value type on the wire")
    p.add_argument("--reps", type=int, default=10, help="timed repetitions (the best is kept)")
    args = p.parse_args(argv)

    import torch

    from hybridrec.comm.codecs import TOPK_IMPLS, TopKCodec, row_topk
    from hybridrec.model.kernels import race

    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(args.rows, args.pieces, args.cols, generator=gen)
    g = torch.randn(args.rows, args.pieces, args.cols, generator=gen)
    k = TopKCodec(args.eta, args.values).k(args.cols)
    print(f"machine: {machine()}   date: {datetime.date.today()}   torch {torch.__version__}, 1 thread")
    print(f"block: {args.rows} rows x {args.pieces} pieces x {args.cols} columns, k {k}, {args.values} values; "
          f"best of {args.reps} alternating rounds, ms\n")
    print("| implementation | select | encode | decode | encode_grad | decode_grad | round trip |")
    print("|---|---|---|---|---|---|---|")

    def row(impl: str) -> str:
        """One implementation's table row (a function, so that the timed closures hold this
        implementation's codec and payloads, not the loop's latest)."""
        codec = TopKCodec(args.eta, args.values)
        codec.impls[args.cols] = impl
        try:
            payload, sent = codec.encode(x)
        except RuntimeError as e:  # (native where no compiler runs)
            return f"| {impl} | not here: {e} | | | | | |"
        _, received = codec.decode(payload, args.cols)
        gbytes = codec.encode_grad(g, received)
        steps = {"select": lambda: row_topk(x, k, impl), "encode": lambda: codec.encode(x),
                 "decode": lambda: codec.decode(payload, args.cols),
                 "encode_grad": lambda: codec.encode_grad(g, received),
                 "decode_grad": lambda: codec.decode_grad(gbytes, args.cols, sent)}
        seconds = race(list(steps), lambda name: steps[name](), reps=args.reps, budget_s=float("inf"))
        ms = [seconds[name] * 1e3 for name in steps]
        return f"| {impl} | " + " | ".join(f"{v:.2f}" for v in ms) + f" | {sum(ms[1:]):.2f} |"

    for impl in TOPK_IMPLS:
        print(row(impl))


if __name__ == "__main__":
    main()
