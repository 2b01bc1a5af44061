#!/usr/bin/env bash
# SLURM (slurmctld, slurmd, the client commands) and munge from Debian's packages, for the
# one-node SLURM of scripts/slurm.sh (tests/test_launchers.py, docs/sweeps.md). Installs only
# what is missing. Not root and something missing: says so and exits 0 (the SLURM tests skip).
#   bash scripts/install_slurm.sh [stamp]    # stamp: a file touched once all are installed (make)
set -euo pipefail
PACKAGES=(munge slurmctld slurmd slurm-client)
missing=()
for p in "${PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  if [ "$(id -u)" -ne 0 ]; then
    echo "install_slurm: ${missing[*]} not installed and not root: the SLURM launcher tests will be" \
         "skipped (as root: bash scripts/install_slurm.sh)"
    exit 0
  fi
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi
echo "install_slurm: slurm $(dpkg-query -W -f='${Version}' slurmctld), munge $(dpkg-query -W -f='${Version}' munge)"
if [ -n "${1:-}" ]; then mkdir -p "$(dirname "$1")" && touch "$1"; fi
