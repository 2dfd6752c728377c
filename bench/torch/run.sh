#!/usr/bin/env bash
# train_ddp against PyTorch DDP (gloo, CPU), side by side: installs PyTorch from PyPI into a
# virtual environment when no torchrun is found (TORCH_VENV, default build/torch-venv; a few GB),
# builds train_ddp and ddprun, then runs compare.py. Writes bench/results/train.{md,csv,png}.
#   REPS=5 bench/torch/run.sh
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
build=${BUILD_DIR:-$root/build/default}
venv=${TORCH_VENV:-$root/build/torch-venv}

"$root/tools/install-deps.sh"
if ! command -v gnuplot >/dev/null; then
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends gnuplot-nox >/dev/null
fi
if [ -n "${TORCHRUN:-}" ]; then
  torchrun=$TORCHRUN
elif command -v torchrun >/dev/null; then
  torchrun=$(command -v torchrun)
else
  if [ ! -x "$venv/bin/torchrun" ]; then
    dpkg-query -W -f='${Status}' python3-venv 2>/dev/null | grep -q "install ok installed" ||
      DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends python3-venv >/dev/null
    echo "bench: installing PyTorch into $venv (pip install torch numpy)" >&2
    python3 -m venv "$venv"
    "$venv/bin/pip" install -q torch numpy
  fi
  torchrun=$venv/bin/torchrun
fi
python=$(head -1 "$torchrun" | sed 's/^#!//')   # the interpreter that has torch

[ -f "$build/CMakeCache.txt" ] || cmake --preset default >/dev/null
cmake --build "$build" -j2 --target train_ddp ddprun >/dev/null
mkdir -p "$root/bench/results"
exec "$python" "$here/compare.py" --torchrun "$torchrun" --build "$build" --reps "${REPS:-5}" \
     --out "$root/bench/results/train" "$@"
