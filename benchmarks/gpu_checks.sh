#!/usr/bin/env bash
# The GPU checks in one command, from a checkout (no install needed): the machine, the tests
# marked gpu (exactness against the CPU, no host waits in the step), then benchmarks/gpu.py.
#
#   bash benchmarks/gpu_checks.sh [OUT_DIR [gpu.py options...]]     (OUT_DIR: benchmarks/out/gpu)
#
# Writes machine.txt, gpu_tests.txt, gpu_bench.txt and gpu.py's gpu.md, gpu.json, kernels.txt.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:-benchmarks/out/gpu}
mkdir -p "$out"
shift || true
py=${PYTHON:-python3}
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
{
    nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv
    $py -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"
    grep -m1 "model name" /proc/cpuinfo
    nproc
} > "$out/machine.txt" 2>&1
cat "$out/machine.txt"
$py -m pytest -q -m gpu -p no:cacheprovider tests/test_gpu.py tests/test_gpu_ops.py 2>&1 | tee "$out/gpu_tests.txt"
tests=${PIPESTATUS[0]}
$py benchmarks/gpu.py --out "$out" "$@" 2>&1 | tee "$out/gpu_bench.txt"
bench=${PIPESTATUS[0]}
echo "tests: exit $tests, benchmark: exit $bench"
exit $(( tests || bench ))
