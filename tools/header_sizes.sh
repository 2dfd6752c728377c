#!/usr/bin/env bash
# Every header of include/ddp with its line count, longest first; the ones over 400 lines are
# marked (docs/design.md says why each of those is one file).
set -euo pipefail
cd "$(dirname "$0")/.."
find include -name '*.hpp' -print0 | xargs -0 wc -l | grep -v ' total$' | sort -rn |
  awk '{ printf "%6d  %s%s\n", $1, $2, ($1 > 400 ? "   (over 400: see docs/design.md)" : "") }'
