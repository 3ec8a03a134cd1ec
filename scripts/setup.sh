#!/usr/bin/env bash
# Set up hybridrec in ./.venv: torch 2.13.0 (the CPU build), numpy, and the package itself.
#   bash scripts/setup.sh          # runtime
#   bash scripts/setup.sh --test   # + pytest, pytest-timeout, pyarrow
# torch is pinned through scripts/constraints.txt so that pip can never resolve a newer
# torch (on a CPU machine that would pull several GB of CUDA packages).
set -euo pipefail
cd "$(dirname "$0")/.."

extras=""
case "${1:-}" in
  "") ;;
  --test) extras="[test]" ;;
  -h|--help) sed -n '2,6p' "$0"; exit 0 ;;
  *) echo "setup.sh: unknown option '$1' (use --test or nothing)" >&2; exit 2 ;;
esac

python=${PYTHON:-python3}
if ! "$python" -c 'import sys; sys.exit(sys.version_info < (3, 10))' 2>/dev/null; then
  echo "setup.sh: need Python >= 3.10 ('$python'); set PYTHON=/path/to/python3" >&2
  exit 1
fi
[ -x .venv/bin/python ] || "$python" -m venv .venv

pip=(.venv/bin/python -m pip install --quiet --disable-pip-version-check -c scripts/constraints.txt)
# torch and numpy first and explicitly (torch does not pull numpy).
"${pip[@]}" torch==2.13.0 numpy
"${pip[@]}" -e ".${extras}"
.venv/bin/python -c 'import torch, numpy, hybridrec; print(f"hybridrec {hybridrec.__version__} ready: torch {torch.__version__}, numpy {numpy.__version__}")'
