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
set +e
.venv/bin/python -m pytest -q "$@"
rc=$?
set -e
if [ "$rc" = "5" ]; then
  echo "pytest collected no tests: failing on purpose" >&2
fi
exit $rc
