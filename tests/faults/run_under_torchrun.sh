#!/usr/bin/env bash
# ctest runner of the kill campaign under PyTorch's torchrun: takes torchrun from the PyTorch
# venv of tools/torch-venv.sh ($DDP_TORCH_VENV, which the torchrun tests install in CI), or says
# SKIPPED and exits 77 without one.
# usage: run_under_torchrun.sh FAULT_WORKER [kill_campaign.py options...]
set -uo pipefail
worker=${1:?usage: run_under_torchrun.sh FAULT_WORKER [kill_campaign.py options...]}
shift
venv=${DDP_TORCH_VENV:-}
if [ -z "$venv" ] || [ ! -x "$venv/bin/torchrun" ]; then
  echo "SKIPPED: no PyTorch venv at '${venv}' (run tools/torch-venv.sh, or the torchrun tests with DDP_TEST_INSTALL_TORCH=1)"
  exit 77
fi
exec python3 "$(dirname "$0")/kill_campaign.py" --worker "$worker" --modes torchrun --torchrun "$venv/bin/torchrun" "$@"
