#!/usr/bin/env bash
# The three runs of tests/test_pipeline_gpu.py::test_pipeline_on_two_gpus_agrees_with_one, each
# bounded and logged on its own (the GPU suite was once killed twice at 290 s with this
# test the only one left), then the suite with one GPU visible and fresh compile caches.
#   benchmarks/pipeline_hang_probe.sh OUT_DIR
set -u
cd "$(dirname "$0")/.."
source benchmarks/device_steps.sh "$1" 540
C=(deepstack --device cuda --dtype fp64 --batch 6 --image-size 16 --convs 4 --fcs 2 --num-classes 10)
P=(--strategy pipeline --ranks 2 --stages 2 --microbatches 3)
T=(--train --steps 2 --train-size 12 --heldout-size 6)
probe() { local name=$1 secs=$2; shift 2
  local t0=$(date +%s)
  timeout --signal=KILL $secs $PY -m scalelab run -v "$@" --out "$OUT_DIR/runs.jsonl" \
    >"$OUT_DIR/$name.out" 2>"$OUT_DIR/$name.err"
  echo "probe: $name exit $? after $(( $(date +%s) - t0 )) s"; tail -4 "$OUT_DIR/$name.err"; }
probe check 90 "${C[@]}" "${P[@]}" --check
probe pipe-train 90 "${C[@]}" "${P[@]}" "${T[@]}" --schedule 1f1b --save-weights "$OUT_DIR/pipe.pt"
probe local-train 90 "${C[@]}" "${T[@]}" --save-weights "$OUT_DIR/local.pt"
[[ ${SUITE:-1} == 1 ]] || exit 0
fresh=$(mktemp -d)
CUDA_VISIBLE_DEVICES=0 TRITON_CACHE_DIR=$fresh/triton TORCHINDUCTOR_CACHE_DIR=$fresh/inductor \
  XDG_CACHE_HOME=$fresh step suite-1gpu bash benchmarks/gpu_suite.sh "$OUT_DIR" 240
