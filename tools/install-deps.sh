#!/usr/bin/env bash
# Installs, with apt-get, what building and testing ddp needs and this machine lacks.
# Debian bookworm or later, as root (or with sudo). Safe to run again: installs only what is missing.
set -euo pipefail
packages=(cmake make ninja-build g++ clang catch2 nlohmann-json3-dev libeigen3-dev libthrust-dev libcli11-dev
          libopenmpi-dev openmpi-bin iproute2 procps)
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -eq 0 ]; then
  exit 0
fi
sudo=""
[ "$(id -u)" -eq 0 ] || sudo="sudo"
echo "ddp: installing ${missing[*]}" >&2
export DEBIAN_FRONTEND=noninteractive
$sudo apt-get update -qq
$sudo apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
