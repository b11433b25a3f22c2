#!/usr/bin/env bash
# Install Chromium from Debian's packages for the run report's browser test (tests/test_report.py opens
# report.html headless and checks the screenshot). Fonts come with the package's dependencies; nothing is
# started. Idempotent: exits 0 without touching apt when chromium is already there.
# Usage (CI, as root; scripts/test.sh calls it): sudo scripts/ci_install_browser.sh
set -euo pipefail

if command -v chromium >/dev/null 2>&1; then
    echo "ci_install_browser: chromium already installed ($(command -v chromium))"
    exit 0
fi

if [[ $(id -u) -ne 0 ]]; then
    echo "ci_install_browser: must run as root (try: sudo $0)" >&2
    exit 1
fi

export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
# --no-install-recommends: no desktop extras; chromium's hard dependencies (fonts, libnss3, ...) still come.
apt-get install -y -qq --no-install-recommends chromium >/dev/null
echo "ci_install_browser: installed $(chromium --version 2>/dev/null || echo chromium)"
