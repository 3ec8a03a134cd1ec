"""Freeze the CLI surface: commands and their options change only on purpose."""

import argparse

import pytest

from hybridrec.cli.main import build_parser, main
from hybridrec.parallel.cost_model import OPTIMIZERS

EXPECTED = {
    "data synth": {"--out", "--days", "--rows-per-day", "--multi-hot", "--multi-hot-fields", "--scale",
                   "--max-cardinality", "--zipf", "--ctr", "--gzip", "--seed", "--overwrite",
                   "--stream", "--hours", "--rows-per-hour", "--drift", "--land-every"},
    "data preprocess": {"--out", "--format", "--schema", "--table-size", "--min-count",
                        "--on-bad-line", "--multi-hot-fields", "--eval-parts", "--like", "--grow", "--overwrite"},
    "data inspect": {"--json"},
    "train": {"--config", "--recipe", "--list-keys", "--print-config",
              "--snapshot-dir"},  # (hidden: the local launcher gives it to its ranks)
    "eval": {"--checkpoint", "--data", "--out"},
    "predict": {"--out", "--checkpoint", "--keep-columns", "--on-bad-line", "--batch-size"},
    "demo": {"--out", "--days", "--rows-per-day", "--seed"},
    "plan": {"--nproc", "--nnodes", "--data", "--tables", "--dim", "--batch-size", "--memory-per-rank",
             "--bandwidth", "--optimizer", "--embedding-dtype", "--pin", "--partition-dense", "--out"},
    "bench compression": {"--data", "--out", "--nproc", "--recipe", "--setting", "--dense",
                          "--embedding", "--cross", "--seeds", "--max-steps", "--overwrite"},
    "report": {"--out"},
    "export": {"--out", "--checkpoint", "--tables", "--onnx", "--eval-rows", "--overwrite"},
    "serve": {"--host", "--port", "--max-batch-rows", "--max-wait-ms", "--max-rows", "--max-body-mb",
              "--poll-s", "--threads"},
}


def _subparsers(parser):
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            yield from action.choices.items()


def _options(parser):
    return {s for a in parser._actions for s in a.option_strings if s.startswith("--") and s != "--help"}


def _surface():
    out = {}
    for name, p in _subparsers(build_parser()):
        subs = list(_subparsers(p))
        if subs:
            for sub, sp in subs:
                out[f"{name} {sub}"] = _options(sp)
        else:
            out[name] = _options(p)
    return out


def test_cli_surface_is_frozen():
    surface = _surface()
    assert set(surface) == set(EXPECTED)
    for cmd, opts in EXPECTED.items():
        assert opts <= surface[cmd], (cmd, opts - surface[cmd])
        assert surface[cmd] - opts == set(), (cmd, surface[cmd] - opts)


def test_global_options():
    """``--debug`` comes before the command: ``hybridrec --debug train ...``."""
    assert _options(build_parser()) == {"--version", "--debug"}


def test_plan_optimizer_takes_the_cost_model_names(capsys):
    base = ["plan", "--nproc", "2", "--tables", "2x100x8"]
    for name in OPTIMIZERS:
        assert main([*base, "--optimizer", name]) == 0
        assert f"optimizer {name}," in capsys.readouterr().out
    assert main([*base, "--optimizer", "adamw"]) != 0
    assert f"--optimizer 'adamw': choose from {', '.join(OPTIMIZERS)}" in capsys.readouterr().err


@pytest.mark.parametrize("argv", [["--help"], ["plan", "--help"]])
def test_help_does_not_import_torch(argv):
    """Building the parser and printing help stay light: no torch import."""
    import subprocess
    import sys

    code = ("import sys; from hybridrec.cli.main import main\n"
            f"try: main({argv!r})\nexcept SystemExit: pass\n"
            "assert 'torch' not in sys.modules, 'torch imported'")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60, check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_train_help_lists_every_config_section(capsys):
    from hybridrec.train.setup.config import SECTIONS

    with pytest.raises(SystemExit):
        main(["train", "--help"])
    assert " ".join(f"[{s}]" for s in SECTIONS) in capsys.readouterr().out


def test_results_table_names_the_gpu_and_its_peak_only_for_a_gpu_run():
    from hybridrec.cli.train import format_results

    summary = {"eval": {"auc": 0.8, "log_loss": 0.4, "ne": 0.7, "calibration": 1.0, "accuracy": 0.8,
                        "count": 100}, "throughput": {"samples_per_sec_overall": 1000.0}, "step": 10,
               "peak_memory_bytes": 2**30, "run_dir": "runs/x", "device": "cpu", "cuda_peak_memory_bytes": None}
    cpu = format_results(summary)
    assert "GPU peak memory" not in cpu and "device" not in cpu and "1,024 MiB" in cpu
    gpu = format_results({**summary, "device": "cuda:0 NVIDIA H200", "cuda_peak_memory_bytes": 208 * 2**20})
    assert "cuda:0 NVIDIA H200" in gpu and "GPU peak memory  208 MiB" in gpu
    assert gpu.splitlines()[-2].startswith("run directory")
