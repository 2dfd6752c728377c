#!/usr/bin/env bash
# ctest runner of libtorch_test.py. usage: run.sh CASE LIBTORCH_DDP ADAPTER_TEST DDPRUN SOURCE_DIR
# The cases against live PyTorch need the venv of tools/torch-venv.sh (DDP_TORCH_VENV); without
# it they print SKIPPED and exit 77.
set -uo pipefail
case=${1:?usage: run.sh CASE LIBTORCH_DDP ADAPTER_TEST DDPRUN SOURCE_DIR}
src=${5:?usage: run.sh CASE LIBTORCH_DDP ADAPTER_TEST DDPRUN SOURCE_DIR}
venv=${DDP_TORCH_VENV:-$src/build/torch-venv}
python=python3
if [ -x "$venv/bin/torchrun" ] && "$venv/bin/python" -c 'import torch' 2>/dev/null; then
  python=$venv/bin/python
elif [[ $case == torchrun_* ]]; then
  echo "SKIPPED: no PyTorch venv at $venv (tools/torch-venv.sh)"
  exit 77
fi
exec "$python" "$src/tests/libtorch/libtorch_test.py" --example "$2" --adapter-test "$3" --ddprun "$4" --source "$src" \
     --venv "$venv" "$case"
