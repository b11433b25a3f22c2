#!/usr/bin/env bash
# Install what the real-SLURM tests (tests/test_slurm_*.py) need on a Debian/Ubuntu machine, as root:
# slurmctld + slurmd + the client commands (Debian's slurm-wlm 22.05 split packages), munge for
# authentication, and iproute2 (`ip netns`) for the two-host tests. Nothing is started or enabled:
# the tests start their own daemons under a temp dir (tests/slurm_cluster.py).
#
# Idempotent: exits 0 without touching apt when every binary is already there.
# Usage (CI): sudo scripts/ci_install_slurm.sh
set -euo pipefail

PACKAGES=(slurmctld slurmd slurm-client munge iproute2)
BINARIES=(/usr/sbin/slurmctld /usr/sbin/slurmd /usr/sbin/munged /usr/bin/sbatch /usr/bin/srun
          /usr/bin/scontrol /usr/bin/sinfo /usr/bin/squeue /usr/bin/scancel)

missing=0
for b in "${BINARIES[@]}"; do [[ -x "$b" ]] || missing=1; done
command -v ip >/dev/null 2>&1 || missing=1
if [[ $missing -eq 0 ]]; then
    echo "ci_install_slurm: slurm, munge and iproute2 already installed"
    exit 0
fi

if [[ $(id -u) -ne 0 ]]; then
    echo "ci_install_slurm: must run as root (try: sudo $0)" >&2
    exit 1
fi

export DEBIAN_FRONTEND=noninteractive
# policy-rc.d 101 keeps the packages' maintainer scripts from starting daemons where an init system
# exists (Debian's own mechanism); the tests start their own, with their own slurm.conf.
policy=/usr/sbin/policy-rc.d
created_policy=0
if [[ ! -e $policy ]]; then
    printf '#!/bin/sh\nexit 101\n' > "$policy"
    chmod +x "$policy"
    created_policy=1
fi
trap 'if [[ $created_policy -eq 1 ]]; then rm -f "$policy"; fi' EXIT

apt-get update -qq
apt-get install -y -qq --no-install-recommends "${PACKAGES[@]}" >/dev/null
echo "ci_install_slurm: installed ${PACKAGES[*]}"
