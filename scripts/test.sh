#!/usr/bin/env bash
# The tests, as CI runs them (after `bash scripts/setup.sh --test`):
#   1. ruff (pinned in the test extra) over src, tests, benchmarks and scripts;
#   2. the fast tier: pytest -m "not slow and not distributed" (under a minute);
#   3. the rest: pytest -m "slow or distributed" (runs over ~5 s, and those that start ranks).
# The two markers' selections together are the whole suite (a test is in one or the other).
# Both tiers always hold tests: pytest's exit 5 (nothing collected) fails like any other.
# Each tier runs on 2 pytest-xdist workers (HYBRIDREC_TEST_WORKERS=N to change, 0 for none):
# most slow tests wait on processes they start (launches, ranks, servers, kills), so two
# overlap well even on 2 cores (the slow tier: 14 -> 9 minutes on a 2-core Zen 4).
# Extra arguments go to both pytest runs (e.g. -x, -k NAME).
set -euo pipefail
cd "$(dirname "$0")/.."
workers=${HYBRIDREC_TEST_WORKERS:-2}
parallel=()
[ "$workers" != 0 ] && parallel=(-n "$workers" --dist worksteal)
.venv/bin/ruff check src tests benchmarks scripts
.venv/bin/python -m pytest -q "${parallel[@]}" -m "not slow and not distributed" "$@"
.venv/bin/python -m pytest -q "${parallel[@]}" -m "slow or distributed" --durations=15 "$@"
