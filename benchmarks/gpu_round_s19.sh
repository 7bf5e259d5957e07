#!/usr/bin/env bash
# Session 19's GPU round (issue 40), one device call per part, every step bounded:
#
#   benchmarks/gpu_round_s19.sh two  OUT_DIR SECONDS    (a fresh 2-GPU host)
#       the GPU suite first (the host fresh: Triton autotuning included), then `plan --verify`
#       for resnet18-cifar training on session 18's calibration (its 10 runs, on a 2x H200,
#       are copied in: only the 4 verify runs are left), then the example GPT's plan.
#   benchmarks/gpu_round_s19.sh gpt  OUT_DIR SECONDS    (a 2-GPU host)
#       the example GPT's `plan --verify`, resumed on the calibration runs an earlier call
#       finished (GPT_CAL=FILE: its calibration.jsonl, copied in).
#   benchmarks/gpu_round_s19.sh held OUT_DIR SECONDS    (a fresh 2-GPU host)
#       the GPU suite again (the first call's ran past 290 s with one test left), the held-out
#       torch pipelines predicted in gpu_s19/predictions/ (benchmarks/predict_s19.sh, committed
#       before this call), then the GPT's plan resumed (GPT_CAL).
#   benchmarks/gpu_round_s19.sh one  OUT_DIR SECONDS    (a fresh 1-GPU host)
#       the GPU suite, then `bench` for alexnet, charcnn and resnet18 with every peer in the
#       same process (eager fp32, eager bf16, torch.compile, max-autotune).
#
# SMOKE=1 shrinks every model and uses the CPU, to check the commands here.
set -u
cd "$(dirname "$0")/.."
PART=$1
source benchmarks/round_steps.sh "$2" "${3:-540}"
if [[ $SMOKE == 1 ]]; then
  R18=(resnet18-cifar --image-size 16); R18_B=16
  GPT=(--model examples/models/gpt.py:gpt --model-arg vocab=64 --model-arg seq=16
       --model-arg width=32 --model-arg heads=4 --model-arg depth=4 --input-shape 16
       --input-dtype int64 --vocab 64)
  GPT_B=8; PLAN=(--ranks-max 2 --gpus-per-node 2 --calibrate-missing --verify 1 --repeats 1
                 --strategies ddp)
else
  R18=(resnet18-cifar); R18_B=512
  GPT=(--model examples/models/gpt.py:gpt --model-arg vocab=4096 --model-arg seq=512
       --model-arg width=768 --model-arg heads=12 --model-arg depth=12 --input-shape 512
       --input-dtype int64 --vocab 4096)
  GPT_B=32; PLAN=(--ranks-max 2 --gpus-per-node 2 --calibrate-missing --verify 2 --repeats 1)
fi
CEIL=benchmarks/results/gpu_s17/cal/ceilings_gpu.json

plan_gpt() {  # the GPT's plan into OUT_DIR/plan-gpt, on GPT_CAL's calibration runs if given
  mkdir -p "$OUT_DIR/plan-gpt"
  [[ -n ${GPT_CAL:-} ]] && cp "$GPT_CAL" "$OUT_DIR/plan-gpt/calibration.jsonl"
  step plan-gpt $PY -m scalelab plan "${GPT[@]}" --train --device $DEV "${PLAN[@]}" \
    --ceilings $CEIL --batch $GPT_B --train-size $(( GPT_B * 8 )) -o "$OUT_DIR/plan-gpt"
}

vgg() {  # vgg NAME RUN-ARGS...: VGG-16 training as predict_s19.sh predicts it (bf16, NCHW)
  local name=$1; shift
  step "$name" $PY -m scalelab run "${VGG[@]}" --train --device $DEV --momentum 0.9 --lr 0.01 \
    --batch $VGG_B --train-size $(( VGG_B * 16 )) --heldout-size 32 --epochs 1 --quiet \
    --out "$OUT_DIR/measured.jsonl" --strategy pipeline --engine torch --ranks 2 "$@"
}
if [[ $SMOKE == 1 ]]; then VGG=(vgg16 --image-size 32 --num-classes 10); VGG_B=32
else VGG=(vgg16 --dtype bf16); VGG_B=256; fi

case $PART in
held)
  step suite-2gpu bash benchmarks/gpu_suite.sh "$OUT_DIR" 290
  for mb in 4 16; do
    vgg vgg-pipe-interleaved-mb$mb --microbatches $mb --schedule interleaved-1f1b --virtual-stages 2
  done
  vgg vgg-pipe-looped-bfs --microbatches 8 --schedule looped-bfs --virtual-stages 2
  step gpt-pipe-interleaved $PY -m scalelab run "${GPT[@]}" --train --device $DEV --batch $GPT_B \
    --train-size $(( GPT_B * 8 )) --heldout-size 32 --epochs 1 --quiet --strategy pipeline \
    --engine torch --ranks 2 --microbatches 4 --schedule interleaved-1f1b --virtual-stages 2 \
    --out "$OUT_DIR/measured.jsonl"
  plan_gpt
  ;;
two)
  step suite-2gpu bash benchmarks/gpu_suite.sh "$OUT_DIR" 290
  mkdir -p "$OUT_DIR/plan-r18"
  cp benchmarks/results/gpu_s18/diag/plan-r18/s18_calibration.jsonl \
    "$OUT_DIR/plan-r18/calibration.jsonl"
  step plan-r18 $PY -m scalelab plan "${R18[@]}" --train --device $DEV "${PLAN[@]}" \
    --ceilings $CEIL --batch $(( R18_B * 2 )) --train-size $(( R18_B * 2 * 16 )) \
    -o "$OUT_DIR/plan-r18"
  plan_gpt
  ;;
gpt)
  plan_gpt
  ;;
one)
  fresh=$(mktemp -d)  # compile caches of this call only: the suite as a fresh host runs it
  TRITON_CACHE_DIR=$fresh/triton TORCHINDUCTOR_CACHE_DIR=$fresh/inductor XDG_CACHE_HOME=$fresh \
    step suite-1gpu bash benchmarks/gpu_suite.sh "$OUT_DIR" 290
  if [[ $SMOKE == 1 ]]; then
    step bench $PY -m scalelab bench mlp --device cpu --iters 2 --warmup 1 --out "$OUT_DIR/bench"
  else
    for w in charcnn alexnet resnet18; do
      step bench-$w $PY -m scalelab bench $w --out "$OUT_DIR/bench"
    done
  fi
  ;;
*) echo "unknown part $PART (two, held, gpt, one)"; exit 2 ;;
esac
