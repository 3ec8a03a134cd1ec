#!/usr/bin/env bash
# The many-GPU checks in one command, from a checkout, installing nothing: 2 ranks sharing the
# GPU over gloo (tests/test_gpu_distributed.py: exactness against one GPU process for
# table-wise, row-wise and column-wise sharding with ddp and allreduce, predicted == counted
# bytes, a DCT run stopped and resumed, background sync and a hierarchical 2x1 run), plus the
# device-choice tests. Budget: under 6 minutes on an H200 (the pytest run is cut at 330 s).
#
#   bash scripts/gpu_checks.sh [OUT_DIR]       (OUT_DIR: benchmarks/results/gpu-multi-YYYY-MM-DD)
#
# Writes machine.txt, tests.txt (pytest's output), junit.xml and gpu_distributed.jsonl (what
# each test measured: samples/s of the runs it compared). Assumes, as on the machine of
# benchmarks/results/gpu-2026-11-27, that `python3` imports torch (CUDA) and pytest; without
# pytest it stops with one line (exit 2) rather than run half the checks.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:-benchmarks/results/gpu-multi-$(date -u +%Y-%m-%d)}
mkdir -p "$out"
py=${PYTHON:-python3}
export PYTHONPATH="$PWD/src:$PWD/tests${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export HYBRIDREC_GPU_RESULTS="$PWD/$out"
rm -f "$out/gpu_distributed.jsonl"
{
    date -u +%Y-%m-%dT%H:%M:%SZ
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
    $py -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'gpus', torch.cuda.device_count())"
    nproc
} > "$out/machine.txt" 2>&1
cat "$out/machine.txt"
if ! $py -c "import pytest" 2>/dev/null; then
    echo "pytest is not importable by $py: the gpu checks need it (nothing was run)" | tee "$out/tests.txt"
    exit 2
fi
start=$(date +%s)
$py -m pytest -q -p no:cacheprovider -o addopts="" -m "not distributed" tests/test_device_generic.py 2>&1 \
    | tee "$out/tests.txt"
choice=${PIPESTATUS[0]}
timeout 330 $py -m pytest -q -rA -p no:cacheprovider -o addopts="" -m gpu --junitxml="$out/junit.xml" \
    tests/test_gpu_distributed.py 2>&1 | tee -a "$out/tests.txt"
gpu=${PIPESTATUS[0]}
rc=$(( choice || gpu ))
echo "gpu checks: device-choice tests exit $choice, gpu tests exit $gpu (124: cut at 330 s), in $(( $(date +%s) - start )) s" | tee -a "$out/tests.txt"
exit "$rc"
