#!/usr/bin/env bash
# Makes (once) and names the Python virtual environment with PyPI's PyTorch that the torchrun,
# libtorch and golden-data scripts use, then prints its folder on stdout.
#   tools/torch-venv.sh [VENV]      default: $DDP_TORCH_VENV, else build/torch-venv
# PyPI's default torch wheel carries CUDA libraries (a few GB) and runs on the CPU as well; the
# folder is reused by every later call, so the download happens once per machine and build tree.
# Exits 77 (with one line on stderr saying why) when PyTorch cannot be installed, so a test that
# calls it can say SKIPPED.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
venv=${1:-${DDP_TORCH_VENV:-$root/build/torch-venv}}

if [ -x "$venv/bin/python" ] && "$venv/bin/python" -c 'import torch, numpy' 2>/dev/null; then
  echo "$venv"
  exit 0
fi
if ! python3 -c 'import venv, ensurepip' 2>/dev/null; then
  if [ "$(id -u)" -eq 0 ] && command -v apt-get >/dev/null; then
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends python3-venv >/dev/null 2>&1 || true
  fi
fi
echo "ddp: installing PyTorch from PyPI into $venv (once; a few GB)" >&2
if ! { python3 -m venv "$venv" && "$venv/bin/pip" install -q --disable-pip-version-check torch numpy; } >&2; then
  echo "ddp: SKIPPED: PyTorch could not be installed into $venv (no python3-venv, or PyPI unreachable)" >&2
  exit 77
fi
"$venv/bin/python" -c 'import torch' >&2 || { echo "ddp: SKIPPED: torch does not import in $venv" >&2; exit 77; }
echo "$venv"
