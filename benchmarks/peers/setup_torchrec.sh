#!/usr/bin/env bash
# Create (or reuse) a separate virtual environment with TorchRec 1.8 on CPU.
#
#   benchmarks/peers/setup_torchrec.sh [VENV_DIR]
#
# VENV_DIR defaults to benchmarks/peers/.venv-torchrec (git-ignored by the
# ".venv-*/" pattern). Never point it at the project's own .venv: TorchRec and
# fbgemm are peer-benchmark dependencies only.
#
# The install recipe is fixed on purpose:
#   * torch==2.13.0 + fbgemm-gpu-cpu==1.8.0 + torchrec's runtime deps, all under
#     constraints-torchrec.txt so nothing can upgrade torch (a newer torch would
#     pull GBs of CUDA wheels);
#   * torchrec==1.8.0 with --no-deps (its declared dependencies resolve to a
#     broken set, the unpinned install does not import).
# Idempotent: re-running on a working venv only re-checks the imports.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
VENV="${1:-$HERE/.venv-torchrec}"
CONSTRAINTS="$HERE/constraints-torchrec.txt"
PYTHON="${PYTHON:-python3}"

die() { echo "setup_torchrec.sh: error: $*" >&2; exit 1; }

[[ -f "$CONSTRAINTS" ]] || die "constraints file missing: $CONSTRAINTS"
command -v "$PYTHON" >/dev/null || die "'$PYTHON' not found (set PYTHON=/path/to/python3.10+)"
"$PYTHON" -c 'import sys; sys.exit(sys.version_info < (3, 10))' \
    || die "$PYTHON is $("$PYTHON" -V 2>&1); Python >= 3.10 is needed"

case "$(cd "$(dirname "$VENV")" 2>/dev/null && pwd)/$(basename "$VENV")" in
    "$(cd "$HERE/../.." && pwd)/.venv") die "refusing to install TorchRec into the project's own .venv" ;;
esac

check() {
    "$VENV/bin/python" - <<'EOF'
import torch, fbgemm_gpu, torchrec
from importlib.metadata import version
print(f"torch {torch.__version__}  fbgemm-gpu-cpu {version('fbgemm-gpu-cpu')}  "
      f"torchrec {version('torchrec')}  (cuda available: {torch.cuda.is_available()})")
EOF
}

if [[ -x "$VENV/bin/python" ]] && check 2>/dev/null; then
    echo "TorchRec venv already set up: $VENV"
    exit 0
fi

if [[ ! -x "$VENV/bin/python" ]]; then
    echo "creating venv $VENV"
    "$PYTHON" -m venv "$VENV" || die "could not create venv at $VENV (is python3-venv installed?)"
fi
PIP=("$VENV/bin/pip" install --disable-pip-version-check -c "$CONSTRAINTS")

echo "installing torch, fbgemm-gpu-cpu and TorchRec's runtime dependencies"
"${PIP[@]}" torch==2.13.0 fbgemm-gpu-cpu==1.8.0 tensordict torchmetrics==1.0.3 \
    tqdm pyre-extensions numpy \
    || die "dependency install failed (see pip output above)"

echo "installing torchrec==1.8.0 (--no-deps)"
"${PIP[@]}" --no-deps torchrec==1.8.0 || die "torchrec install failed"

echo "verifying imports"
check || die "import torchrec / fbgemm_gpu failed in $VENV (see traceback above)"
echo "TorchRec venv ready: $VENV"
