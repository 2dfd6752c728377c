#!/usr/bin/env bash
# Packs the header-only build dependencies of tests/device/run.sh (Catch2, nlohmann/json, CLI11,
# Eigen, with their CMake package files) into .device-deps/, for a GPU machine that has CUDA but
# no package manager or network. run.sh adds .device-deps/usr to CMAKE_PREFIX_PATH when it exists.
# Run it here (after tools/install-deps.sh); carry .device-deps (git ignores it) to that machine.
set -euo pipefail
cd "$(dirname "$0")/../.."
dest=.device-deps
rm -rf "$dest"
mkdir -p "$dest"
paths=(
  /usr/include/catch2 /usr/lib/cmake/Catch2 /usr/lib/libCatch2WithMain.a
  /usr/include/nlohmann /usr/share/cmake/nlohmann_json
  /usr/include/CLI /usr/share/cmake/CLI11
  /usr/include/eigen3 /usr/share/eigen3/cmake
)
for p in "${paths[@]}"; do
  if [ ! -e "$p" ]; then
    echo "pack-deps: $p is missing: run tools/install-deps.sh first" >&2
    exit 1
  fi
done
# The same paths under $dest: the packages' CMake files find their headers relative to themselves.
tar -C / -cf - "${paths[@]#/}" | tar -C "$dest" -xf -
du -sh "$dest"
