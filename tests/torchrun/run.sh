#!/usr/bin/env bash
# ctest runner of torchrun_test.py: finds (or, with DDP_TEST_INSTALL_TORCH=1, installs) the PyTorch
# virtual environment of tools/torch-venv.sh, then runs one case with its python and torchrun.
# usage: run.sh TRAIN_DDP SOURCE_DIR CASE
# Without PyTorch it prints SKIPPED and exits 77.
set -uo pipefail
train_ddp=${1:?usage: run.sh TRAIN_DDP SOURCE_DIR CASE}
src=${2:?usage: run.sh TRAIN_DDP SOURCE_DIR CASE}
case=${3:?usage: run.sh TRAIN_DDP SOURCE_DIR CASE}
venv=${DDP_TORCH_VENV:-$src/build/torch-venv}
if ! { [ -x "$venv/bin/torchrun" ] && "$venv/bin/python" -c 'import torch' 2>/dev/null; }; then
  if [ "${DDP_TEST_INSTALL_TORCH:-0}" = 1 ]; then
    venv=$("$src/tools/torch-venv.sh" "$venv") || { echo "SKIPPED: PyTorch could not be installed"; exit 77; }
  else
    echo "SKIPPED: no PyTorch venv at $venv (run tools/torch-venv.sh, or set DDP_TEST_INSTALL_TORCH=1)"
    exit 77
  fi
fi
exec "$venv/bin/python" "$src/tests/torchrun/torchrun_test.py" --train-ddp "$train_ddp" --source "$src" \
     --torchrun "$venv/bin/torchrun" "$case"
