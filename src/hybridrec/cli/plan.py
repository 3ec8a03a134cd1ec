"""``hybridrec plan``: propose a sharding plan and show what it costs (no processes started)."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

from hybridrec.errors import ConfigError
from hybridrec.train.setup.config import DataConfig, ModelConfig, OptimConfig

_EPILOG = """\
examples:
  hybridrec plan --nproc 8 --tables 26x100000x64 --memory-per-rank 4GiB
  hybridrec plan --nproc 4 --nnodes 2 --data data/criteo-pre --pin C3=row_wise --out plan.json
  hybridrec plan --nproc 4 --tables 26x100000x16 --partition-dense top_mlp
  hybridrec train ... dist.plan=plan.json     # train with the plan

--tables COUNTxROWSxDIM[,...] makes tables t0, t1, ...; --pin NAME=TYPE[,TYPE][@RANK,...]
pins a table's sharding types and/or ranks (e.g. C1=table_wise@3, C2=@0,1).
Sizes take B, KB, MB, GB (powers of 1000) or KiB, MiB, GiB (powers of 1024);
bandwidth takes bit/s units (1Gbit, 100Mbit) or bytes/s (1.25GB).
--partition-dense MODULE (bottom_mlp, top_mlp; repeatable) splits the module's widest linear
layer by output columns over all ranks (as dist.partition_dense); --partition-dense auto splits
each one whose activation bytes are fewer than the all-reduce bytes saved; the dense part shown is for
the default MLP widths (model.bottom_mlp ending in the embedding dim, model.top_mlp).
"""


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("plan", help="plan how embedding tables are sharded over ranks",
                       description="Run the sharding planner (a pure function: no process is "
                       "started) and print each rank's embedding memory and predicted bytes per "
                       "step, and each table's sharding.",
                       epilog=_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nproc", type=int, required=True, metavar="N", help="ranks per node")
    p.add_argument("--nnodes", type=int, default=1, metavar="M", help="nodes (host groups) [1]")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--data", metavar="DIR",
                     help="a preprocessed dataset: its tables and id stats")
    src.add_argument("--tables", metavar="SPEC", help="tables as COUNTxROWSxDIM[,...]")
    p.add_argument("--dim", type=int, default=16, metavar="D",
                   help="embedding dim with --data [16]")
    p.add_argument("--batch-size", type=int, default=DataConfig().batch_size, metavar="B",
                   help=f"batch per rank (as data.batch_size) [{DataConfig().batch_size}]")
    p.add_argument("--memory-per-rank", default=None, metavar="SIZE",
                   help="embedding memory cap per rank, e.g. 4GiB [no cap]")
    p.add_argument("--bandwidth", default="1Gbit", metavar="RATE",
                   help="network bandwidth per rank, e.g. 10Gbit [1Gbit]")
    # No argparse choices: the names are cost_model.OPTIMIZERS, checked in _plan so that
    # building the parser does not import torch.
    p.add_argument("--optimizer", default=OptimConfig().sparse, metavar="NAME",
                   help=f"sparse optimizer (as optim.sparse), its state counts as memory "
                        f"[{OptimConfig().sparse}]")
    p.add_argument("--embedding-dtype", default="fp32", choices=["fp32", "bf16"],
                   help="storage of the tables (model.embedding_dtype): bf16 counts 2 bytes per value, "
                        "the optimizer state 4 [fp32]")
    p.add_argument("--pin", action="append", default=[], metavar="NAME=TYPE[@RANKS]",
                   help="constrain a table (repeatable)")
    p.add_argument("--partition-dense", action="append", default=[], metavar="MODULE",
                   help="split this dense module's widest layer over the ranks (repeatable)")
    p.add_argument("--out", metavar="FILE", help="write the plan as JSON (for dist.plan)")
    p.set_defaults(func=_plan)


def _plan(args: argparse.Namespace) -> int:
    from hybridrec.parallel.cost_model import OPTIMIZERS, describe_plan, ids_per_sample
    from hybridrec.parallel.planner import plan_sharding

    if args.optimizer not in OPTIMIZERS:
        raise ConfigError(f"--optimizer {args.optimizer!r}: choose from {', '.join(OPTIMIZERS)}")
    if args.nproc < 1 or args.nnodes < 1:
        raise ConfigError("--nproc and --nnodes must be >= 1")
    if args.batch_size < 1:
        raise ConfigError("--batch-size must be >= 1")
    tables, stats, num_dense = _load_tables(args)
    world = args.nproc * args.nnodes
    memory = None if args.memory_per_rank in (None, "none") else parse_size(args.memory_per_rank)
    weight_bytes = 2 if args.embedding_dtype == "bf16" else 4
    bandwidth = parse_bandwidth(args.bandwidth)
    try:
        plan = plan_sharding(tables, world_size=world, local_world_size=args.nproc, stats=stats,
                             batch_size_per_rank=args.batch_size, memory_per_rank_bytes=memory,
                             bandwidth_bytes_per_s=bandwidth, optimizer=args.optimizer,
                             constraints=parse_pins(args.pin), weight_bytes=weight_bytes)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    modules = default_dense_modules(num_dense, tables)
    plan.dense = _plan_dense(modules, args.partition_dense, world, args.batch_size)
    report = describe_plan(plan, tables, batch_sizes=[args.batch_size] * world,
                           ids_per_bag=ids_per_sample(tables, stats), optimizer=args.optimizer,
                           weight_bytes=weight_bytes)
    cap = "none" if memory is None else fmt_bytes(memory)
    print(f"{world} ranks ({args.nnodes} host group(s) of {args.nproc}), "
          f"batch {args.batch_size}/rank, optimizer {args.optimizer}, {args.embedding_dtype} tables, memory cap {cap}, "
          f"bandwidth {args.bandwidth} ({bandwidth:,.0f} B/s)")
    print("\n".join(format_ranks(report, bandwidth)))
    print("(bytes per step exclude the dense all-reduce: 2(W-1)/W x the replicated dense parameters' "
          "bytes, and the partitioned layers' activations below)")
    print()
    print("\n".join(format_tables(report)))
    print()
    print("\n".join(format_dense(plan.dense, modules, args.batch_size, world)))
    if args.out:
        Path(args.out).write_text(plan.to_json() + "\n")
        print(f"\nplan written to {args.out}")
    return 0


def _load_tables(args):
    from hybridrec.model.embedding import TableConfig

    if args.data:
        from hybridrec.data.schema import DatasetMeta

        meta = DatasetMeta.load(args.data)
        if args.dim < 1:
            raise ConfigError("--dim must be >= 1")
        return ([TableConfig(name=f.name, num_embeddings=f.num_embeddings, embedding_dim=args.dim)
                 for f in meta.schema.features], meta.stats, len(meta.schema.dense))
    tables = []
    for spec in args.tables.split(","):
        m = re.fullmatch(r"\s*(?:(\d+)x)?(\d+)x(\d+)\s*", spec)
        if not m or int(m.group(2)) < 1 or int(m.group(3)) < 1:
            raise ConfigError(f"--tables: {spec!r} is not COUNTxROWSxDIM (e.g. 26x100000x64)")
        for _ in range(int(m.group(1) or 1)):
            tables.append(TableConfig(name=f"t{len(tables)}", num_embeddings=int(m.group(2)),
                                      embedding_dim=int(m.group(3))))
    if not tables:
        raise ConfigError("--tables: no tables")
    return tables, None, CRITEO_DENSE


CRITEO_DENSE = 13
"""Dense input features assumed with --tables (Criteo's)."""


def default_dense_modules(num_dense: int, tables: list) -> dict:
    """The dense modules' layers with the default MLP widths (``ModelConfig``), the bottom
    MLP ending in the embedding dim: ``{"bottom": [LinearSpec...], "interaction": [], "top": ...}``."""
    from hybridrec.model.interaction import make_interaction
    from hybridrec.parallel.placement import mlp_linears

    m, dim = ModelConfig(), tables[0].embedding_dim
    _, top_in = make_interaction(m.interaction, len(tables), dim)
    return {"bottom": mlp_linears([num_dense, *m.bottom_mlp[:-1], dim]), "interaction": [],
            "top": mlp_linears([top_in, *m.top_mlp])}


def _plan_dense(modules: dict, names: list[str], world: int, batch: int) -> dict:
    from hybridrec.parallel.placement import plan_dense
    from hybridrec.parallel.planner import AUTO, choose_dense

    try:
        if names == [AUTO]:  # the planner decides each MLP by its bytes per step
            return choose_dense(modules, world, batch)
        return plan_dense(modules, names, world, option="--partition-dense")
    except ValueError as e:
        raise ConfigError(str(e)) from None


_SIZE_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
               "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
_BIT_UNITS = {"bit": 1, "kbit": 10**3, "mbit": 10**6, "gbit": 10**9, "tbit": 10**12}


def _number_unit(text: str, what: str) -> tuple[float, str]:
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([a-zA-Z]*)(?:/s|ps)?\s*", text)
    if not m:
        raise ConfigError(f"{what}: cannot read {text!r}")
    return float(m.group(1)), m.group(2).lower()


def parse_size(text: str) -> int:
    """``"4GiB"`` -> 4294967296; ``"4GB"`` -> 4000000000; a plain number is bytes."""
    value, unit = _number_unit(text, "--memory-per-rank")
    if unit not in _SIZE_UNITS:
        raise ConfigError(f"--memory-per-rank: unknown unit in {text!r} "
                          "(use B, MB, GB, MiB, GiB...)")
    return int(value * _SIZE_UNITS[unit])


def parse_bandwidth(text: str) -> float:
    """Bytes per second: ``"1Gbit"`` -> 1.25e8, ``"1.25GB"`` -> 1.25e9."""
    value, unit = _number_unit(text, "--bandwidth")
    if unit in _BIT_UNITS:
        out = value * _BIT_UNITS[unit] / 8
    elif unit in _SIZE_UNITS:
        out = value * _SIZE_UNITS[unit]
    else:
        raise ConfigError(f"--bandwidth: unknown unit in {text!r} (use Gbit, Mbit, GB, MB...)")
    if out <= 0:
        raise ConfigError(f"--bandwidth must be > 0, got {text!r}")
    return out


def parse_pins(pins: list[str]) -> dict:
    """``["C1=table_wise@3", "C2=row_wise", "C3=@0,1"]`` -> ``{name: TableConstraint}``."""
    from hybridrec.parallel.planner import TableConstraint

    out = {}
    for pin in pins:
        m = re.fullmatch(r"([^=]+)=([a-z_,]*)(?:@([0-9,]+))?", pin.strip())
        if not m or not (m.group(2) or m.group(3)):
            raise ConfigError(f"--pin {pin!r}: expected NAME=TYPE[,TYPE][@RANK,...]")
        types = [t for t in m.group(2).split(",") if t] or None
        ranks = [int(r) for r in m.group(3).split(",") if r] if m.group(3) else None
        out[m.group(1)] = TableConstraint(sharding_types=types, ranks=ranks)
    return out


def fmt_bytes(n: float) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n:.0f} B"


_COLUMNS = (("input", ("input_dist_counts/fwd", "input_dist/fwd")),
            ("output fwd", ("output_dist/fwd",)), ("output bwd", ("output_dist/bwd",)),
            ("dp allreduce", ("dp_table_allreduce/bwd",)))


def format_ranks(report: dict, bandwidth: float) -> list[str]:
    """One line per rank: memory, lookups, bytes sent per step by category, totals."""
    head = f"{'rank':>4} {'host':>4} {'memory':>11} {'lookups':>11}"
    head += "".join(f" {name + ' sent':>17}" for name, _ in _COLUMNS)
    lines = [head + f" {'sent/step':>11} {'recv/step':>11} {'comm ms':>8}"]
    for r in report["ranks"]:
        by = r["bytes_per_step"]
        line = (f"{r['rank']:>4} {r['host']:>4} {fmt_bytes(r['memory_bytes']):>11} "
                f"{r['lookup_values']:>11,}")
        for _, keys in _COLUMNS:
            line += f" {fmt_bytes(sum(by.get(k, {}).get('sent', 0) for k in keys)):>17}"
        ms = 1e3 * (r["sent_bytes"] + r["received_bytes"]) / bandwidth
        lines.append(line + f" {fmt_bytes(r['sent_bytes']):>11} "
                     f"{fmt_bytes(r['received_bytes']):>11} {ms:>8.2f}")
    return lines


def _ranks_text(ranks: list[int]) -> str:
    if len(ranks) > 2 and ranks == list(range(ranks[0], ranks[-1] + 1)):
        return f"{ranks[0]}-{ranks[-1]}"
    return ",".join(map(str, ranks))


def format_tables(report: dict) -> list[str]:
    """One line per table: size, sharding type, ranks, memory (all copies)."""
    w = max([5] + [len(t["table"]) for t in report["tables"]])
    lines = [(f"{'table':<{w}} {'rows':>13} {'dim':>5} {'sharding':<15} {'ranks':<12} "
              f"{'memory':>11}")]
    for t in report["tables"]:
        lines.append(f"{t['table']:<{w}} {t['rows']:>13,} {t['dim']:>5} {t['sharding_type']:<15} "
                     f"{_ranks_text(t['ranks']):<12} {fmt_bytes(t['memory_bytes']):>11}")
    return lines


def _spread(values: list[int], fmt=str) -> str:
    """One value when every rank has it (``128 x 4``), else every rank's."""
    if len(set(values)) == 1:
        return f"{fmt(values[0])} x {len(values)}"
    return ",".join(fmt(v) for v in values)


def format_dense(dense: dict, modules: dict, batch: int, world: int) -> list[str]:
    """One line per dense module: placement, the split layer, its columns per rank and the
    activation bytes each rank sends and receives per step (forward + backward, float32)."""
    from hybridrec.parallel.placement import activation_bytes

    widths = {n: "-".join(map(str, [ls[0].in_features, *(x.out_features for x in ls)]))
              for n, ls in modules.items() if ls}
    title = (f"dense part (default MLPs: {'; '.join(f'{n} {w}' for n, w in widths.items())}; "
             f"activations per rank at batch {batch}/rank, float32)")
    head = (f"{'module':<12} {'placement':<12} {'layer':<9} {'in->out':>11} {'columns per rank':<18} "
            f"{'act. sent/step':>15} {'act. recv/step':>15}")
    lines = [title, head]
    for name, layers in modules.items():
        d = dense.get(name)
        if d is None or d.placement != "partitioned":
            lines.append(f"{name:<12} {'replicated':<12} {'-' if layers else '- (no parameters)'}")
            lines += _choice(d)
            continue
        moved = [activation_bytes(d, batch, r) for r in range(world)]
        sent = [m["fwd"][0] + m["bwd"][0] for m in moved]
        recv = [m["fwd"][1] + m["bwd"][1] for m in moved]
        cols = [next(s.num_cols for s in d.shards if s.rank == r) for r in range(world)]
        shape = f"{d.in_features}->{d.out_features}"
        lines.append(f"{name:<12} {'partitioned':<12} {d.layer:<9} {shape:>11} "
                     f"{_spread(cols):<18} {_spread(sent, fmt_bytes):>15} {_spread(recv, fmt_bytes):>15}")
        lines += _choice(d)
    return lines


def _choice(d) -> list[str]:
    """The planner's reason (``--partition-dense auto``), under its module's line."""
    c = d.cost if d is not None else None
    if not c:
        return []
    if "why" in c:
        return [f"{'':<12} auto: not partitioned ({c['why']})"]
    verdict = "partitioned: pays" if c["pays"] else "replicated: does not pay"
    return [(f"{'':<12} auto: {verdict}; its {c['layer']} per rank per step at batch {c['batch']}: "
             f"activations {fmt_bytes(c['activation_bytes'])} vs all-reduce saved "
             f"{fmt_bytes(c['allreduce_bytes_saved'])} (sent + received)")]
