#!/usr/bin/env bash
# Session 19's predictions of torch's multi-stage pipeline schedules on 2 GPUs, made off the
# device from session 17's one-GPU calibration alone (the records predict_s17.sh used), before
# the configurations are measured:
#
#   [ONLY=PREFIX] benchmarks/predict_s19.sh OUT_DIR
#       (VGG_CAL, GPT_CAL, CEIL: the calibration records and ceilings; default session 17's)
#
# One `scalelab predict` per held-out configuration, each into OUT_DIR/<name>/ (predict.json,
# .csv), at predict_s17.sh's sizes: VGG-16, global batch 256, bf16 weights, NCHW (no
# --channels-last); the example GPT, batch 32, fp32. The replay of torch's runtime
# (planning/torch_schedule.py) posts each transfer of torch's lowered lists on one stream per
# pair of ranks; up to session 19 it also synced the device before each action, as the torch
# engine's timing did then (session 20 times each action with CUDA events instead, and the
# replay no longer syncs: benchmarks/results/gpu_s20/predictions/ ran this script after that).
set -u
cd "$(dirname "$0")/.."
OUT_DIR=$1
mkdir -p "$OUT_DIR"
PY=${PYTHON:-python3}
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
S17=benchmarks/results/gpu_s17
VGG_CAL=${VGG_CAL:-$S17/measure/s17_vgg_calibration.jsonl}  # one GPU, batch 256 and 32
GPT_CAL=${GPT_CAL:-$S17/cal/s17_calibration.jsonl}  # one GPU, batch 32 and 16
CEIL=${CEIL:-$S17/measure/ceilings_gpu.json}
VGG=(vgg16 --strategy pipeline --engine torch --train --dtype bf16 --batch 256)
GPT=(--model examples/models/gpt.py:gpt --model-arg vocab=4096 --model-arg seq=512
     --model-arg width=768 --model-arg heads=12 --model-arg depth=12 --input-shape 512
     --input-dtype int64 --vocab 4096 --strategy pipeline --engine torch --train --batch 32)
GPU=(--ranks 1,2 --gpus-per-node 2 --ceilings "$CEIL" --device cuda)
ONLY=${ONLY:-}
predict() {  # predict NAME CALIBRATION PREDICT-ARGS...
  local name=$1 cal=$2; shift 2
  [[ -n $ONLY && $name != $ONLY* ]] && return
  if $PY -m scalelab predict "$@" "${GPU[@]}" --calibrate "$cal" --no-plots -o "$OUT_DIR/$name" \
      >"$OUT_DIR/$name.out" 2>"$OUT_DIR/$name.err"; then
    echo "predict: $name"
  else
    echo "predict: $name FAILED: $(tail -1 "$OUT_DIR/$name.err")"
  fi
}
for mb in 4 16; do
  predict vgg-pipe-interleaved-mb$mb "$VGG_CAL" "${VGG[@]}" --microbatches $mb \
    --schedule interleaved-1f1b --virtual-stages 2
done
predict vgg-pipe-looped-bfs "$VGG_CAL" "${VGG[@]}" --microbatches 8 --schedule looped-bfs \
  --virtual-stages 2
predict vgg-pipe-1f1b "$VGG_CAL" "${VGG[@]}" --microbatches 8 --schedule 1f1b
predict gpt-pipe-interleaved "$GPT_CAL" "${GPT[@]}" --microbatches 4 \
  --schedule interleaved-1f1b --virtual-stages 2
