#!/usr/bin/env bash
# Set up the environment and run the whole test suite (what CI runs).
#   bash scripts/test.sh [pytest args]
# As root it also installs SLURM + munge from Debian for the SLURM tests (they start their own daemons).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
if [ "$(id -u)" = "0" ] && [ -f scripts/ci_install_slurm.sh ]; then
  bash scripts/ci_install_slurm.sh
fi
# ... and Chromium from Debian for the run report's headless-browser test (tests/test_report.py).
if [ "$(id -u)" = "0" ] && [ -f scripts/ci_install_browser.sh ]; then
  bash scripts/ci_install_browser.sh
fi
# One pytest worker per core (at most 3: a worker's heaviest tests take several GB); most tests are
# one-thread processes (measured on 2 cores: 63 min with 2 workers for 729 tests). Serial:
# bash scripts/test.sh -n 0
WORKERS=${PYTEST_WORKERS:-$(nproc)}
if [ "$WORKERS" -gt 3 ]; then WORKERS=3; fi
set +e
# --no-loadscope-reorder: work units start in tests/conftest.py's order (longest modules first); xdist's
# default sorts them by test count, which left the long one-test runs (elastic, distributed) for the end.
.venv/bin/python -m pytest -q -n "$WORKERS" --dist loadgroup --no-loadscope-reorder "$@"
rc=$?
set -e
if [ "$rc" = "5" ]; then
  echo "pytest collected no tests: failing on purpose" >&2
fi
exit $rc
