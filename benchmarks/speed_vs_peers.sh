#!/usr/bin/env bash
# Speed against peers on one GPU, in one device call: bench runs in separate processes, each
# under the time left before a shared deadline, so the call ends inside the device's 10 minutes.
#
#   benchmarks/speed_vs_peers.sh OUT_DIR SECONDS "WORKLOAD ARGS..." ["WORKLOAD ARGS..." ...]
#
# e.g. speed_vs_peers.sh $OUT/b 570 "alexnet --peers eager,compile" "alexnet --peers eager --out SUB:c"
# ("--out SUB:c" writes that step's record under OUT_DIR/c: the tuning cache's second process).
set -u
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
OUT_DIR=$1; shift
deadline=$(( $(date +%s) + $1 )); shift
PYTHON=${PYTHON:-python3}
for step in "$@"; do
  left=$(( deadline - $(date +%s) ))
  if (( left < 20 )); then echo "speed_vs_peers: no time left for: $step" >&2; continue; fi
  out=$OUT_DIR
  case "$step" in *"--out SUB:"*) sub=${step##*--out SUB:}; out=$OUT_DIR/${sub%% *}; step=${step/--out SUB:$sub/};; esac
  mkdir -p "$out"
  start=$(date +%s)
  # shellcheck disable=SC2086
  timeout --signal=KILL "$left" "$PYTHON" -m scalelab bench $step --out "$out"
  echo "speed_vs_peers: '$step' exit $? after $(( $(date +%s) - start )) s (limit $left s)" >&2
done
"$PYTHON" -m scalelab bench --table "$OUT_DIR" 2>/dev/null
