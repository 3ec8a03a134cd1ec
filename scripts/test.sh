#!/usr/bin/env bash
# The tests, as CI runs them (after `bash scripts/setup.sh --test`):
#   1. ruff (pinned in the test extra) over src, tests, benchmarks and scripts;
#   2. the fast tier: pytest -m "not slow and not distributed" (a few minutes);
#   3. the rest: pytest -m "slow or distributed" (runs over ~5 s, and those that start ranks).
# The two markers' selections together are the whole suite (a test is in one or the other).
# Both tiers always hold tests: pytest's exit 5 (nothing collected) fails like any other.
# Extra arguments go to both pytest runs (e.g. -x, -k NAME).
set -euo pipefail
cd "$(dirname "$0")/.."
.venv/bin/ruff check src tests benchmarks scripts
.venv/bin/python -m pytest -q -m "not slow and not distributed" "$@"
.venv/bin/python -m pytest -q -m "slow or distributed" "$@"
