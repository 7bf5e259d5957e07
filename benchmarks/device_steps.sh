#!/usr/bin/env bash
# Sourced by the bounded GPU scripts (pipeline_hang_probe.sh): the environment of
# a device call (SMOKE, DEV: cuda, or cpu under SMOKE=1), OUT_DIR/host.txt (when, which
# commit, the GPUs, the cores, the CPU), RUN (`scalelab run` under PY) and `step`, which runs
# one bounded step.
#
#   source benchmarks/device_steps.sh OUT_DIR SECONDS   (from the repository's root)
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT_DIR=$1; LIMIT=$2
PY=${PYTHON:-python3}
RUN=($PY -m scalelab run)
mkdir -p "$OUT_DIR"
SMOKE=${SMOKE:-0}
DEV=cuda
[[ $SMOKE == 1 ]] && DEV=cpu
{ date -u +"%F %T UTC"; echo "${SCALELAB_GIT_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null)}";
  nvidia-smi -L 2>/dev/null; nproc; lscpu 2>/dev/null | grep -m1 "Model name"; } \
  | tee "$OUT_DIR/host.txt"
deadline=$(( $(date +%s) + LIMIT ))
step() {  # step NAME CMD...: bounded by the time left, its log under OUT_DIR
  local name=$1; shift
  local left=$(( deadline - $(date +%s) ))
  if (( left < 15 )); then echo "step: no time left for $name"; return; fi
  local t0=$(date +%s)
  timeout --signal=KILL "$left" "$@" >"$OUT_DIR/$name.out" 2>"$OUT_DIR/$name.err"
  local code=$?
  echo "step: $name exit $code after $(( $(date +%s) - t0 )) s ($(date -u +%T))"
  tail -3 "$OUT_DIR/$name.err" | sed 's/^/    /'
}
