#!/usr/bin/env bash
# Session 18's 2-GPU round (issue 40), one device call per part, every step bounded:
#
#   benchmarks/gpu_round_s18.sh speed  OUT_DIR SECONDS     (a 2-GPU host)
#       the captured-DDP test after the one-stream fix; VGG-16's pipeline against its one-GPU
#       peers (plain and compiled) in the same call: session 17's configurations again (their
#       predictions were committed then) after the data path moved onto the GPU, and the
#       stages in channels_last with bf16 weights (new this session); ResNet-18-CIFAR weak
#       scaling with the captured step.
#       (--amp is ddp's: the pipeline reads --dtype; the first call's --amp runs were refused.)
#   benchmarks/gpu_round_s18.sh diag   OUT_DIR SECONDS     (a 2-GPU host)
#       benchmarks/fast_ddp_probe.py (which change makes the captured DDP step eager's),
#       a traced pipelined VGG-16 step merged by `timeline`, `plan --verify` for
#       resnet18-cifar training.
#   benchmarks/gpu_round_s18.sh gpt    OUT_DIR SECONDS     (a 2-GPU host)
#       `plan --verify` for the example GPT.
#   benchmarks/gpu_round_s18.sh suite  OUT_DIR SECONDS     (a 1-GPU host)
#       the GPU suite.
#   benchmarks/gpu_round_s18.sh final  OUT_DIR SECONDS     (a 2-GPU host)
#       the GPU suite on both GPUs, eager DDP run twice (fast_ddp_probe.py --determinism),
#       the GPU suite with one GPU visible and fresh compile caches.
#
# SMOKE=1 shrinks every model and uses the CPU, to check the commands here.
set -u
cd "$(dirname "$0")/.."
PART=$1
source benchmarks/round_steps.sh "$2" "${3:-540}"
AMP=(--amp bf16 --channels-last); BF16=(--dtype bf16)
if [[ $SMOKE == 1 ]]; then AMP=(--channels-last); BF16=(); fi
if [[ $SMOKE == 1 ]]; then
  R18=(resnet18-cifar --image-size 16); R18_B=16; R18_STEPS=4
  VGG=(vgg16 --image-size 32 --num-classes 10); VGG_B=32; VGG_MB=4; VGG_STEPS=2
  GPT=(--model examples/models/gpt.py:gpt --model-arg vocab=64 --model-arg seq=16
       --model-arg width=32 --model-arg heads=4 --model-arg depth=4 --input-shape 16
       --input-dtype int64 --vocab 64)
  GPT_B=8
else
  R18=(resnet18-cifar); R18_B=512; R18_STEPS=30
  VGG=(vgg16); VGG_B=256; VGG_MB=8; VGG_STEPS=16
  GPT=(--model examples/models/gpt.py:gpt --model-arg vocab=4096 --model-arg seq=512
       --model-arg width=768 --model-arg heads=12 --model-arg depth=12 --input-shape 512
       --input-dtype int64 --vocab 4096)
  GPT_B=32
fi
r18() {  # r18 NAME OUT RANKS: ddp_scaling.py's `ours` (the step captured), R18_B per GPU
  local n=$(( R18_B * $3 * R18_STEPS ))
  step "$1" "${RUN[@]}" "${R18[@]}" --strategy ddp --train --fast --device $DEV "${AMP[@]}" \
    --momentum 0.9 --ranks "$3" --batch $(( R18_B * $3 )) --train-size $n --heldout-size 512 \
    --epochs 3 --quiet --out "$2"
}
vgg() {  # vgg NAME OUT RUN-ARGS...: training, VGG_STEPS steps of the global batch
  local name=$1 out=$2; shift 2
  step "$name" "${RUN[@]}" "${VGG[@]}" --train --device $DEV --momentum 0.9 --lr 0.01 \
    --batch $VGG_B --train-size $(( VGG_B * VGG_STEPS )) --heldout-size 32 --epochs 1 --quiet \
    --out "$out" "$@"
}
PIPE=(--strategy pipeline --engine torch --ranks 2)
PLAN=(--ranks-max 2 --gpus-per-node 2 --calibrate-missing --verify 2 --repeats 1)

case $PART in
speed)
  MEAS="$OUT_DIR/measured.jsonl"
  step fast-ddp-test $PY -m pytest -m gpu -p no:randomly -p no:cacheprovider -q -rA \
    tests/test_ddp.py -k fast_ddp_step_captured
  # the one-GPU peers first (the bare model under ddp --ranks 1: bf16 autocast, NHWC)
  CUDA_VISIBLE_DEVICES=0 vgg vgg-x1 "$MEAS" --strategy ddp --ranks 1 "${AMP[@]}"
  [[ $SMOKE != 1 ]] && CUDA_VISIBLE_DEVICES=0 vgg vgg-x1-compile "$MEAS" --strategy ddp --ranks 1 \
    "${AMP[@]}" --compile
  # session 17's configurations (predicted in gpu_s17/measure/predictions*), the data now resident
  for sched in gpipe 1f1b; do
    vgg vgg-pipe-$sched "$MEAS" "${PIPE[@]}" "${BF16[@]}" --microbatches $VGG_MB --schedule $sched
  done
  vgg vgg-pipe-interleaved "$MEAS" "${PIPE[@]}" "${BF16[@]}" --microbatches $VGG_MB \
    --schedule interleaved-1f1b --virtual-stages 2
  # the stages in NHWC (ChannelsLast, new this session), bf16 weights: issue 6's configuration
  vgg vgg-pipe-1f1b-bf16-nhwc "$MEAS" "${PIPE[@]}" "${BF16[@]}" --channels-last \
    --microbatches $VGG_MB --schedule 1f1b
  vgg vgg-scalelab-1f1b-bf16-nhwc "$MEAS" --strategy pipeline --ranks 2 "${BF16[@]}" \
    --channels-last --microbatches $VGG_MB --schedule 1f1b
  CUDA_VISIBLE_DEVICES=0 r18 r18-x1 "$MEAS" 1
  r18 r18-x2 "$MEAS" 2
  ;;
diag)
  step fast-ddp-probe $PY benchmarks/fast_ddp_probe.py "$OUT_DIR/probe" $([[ $SMOKE == 1 ]] && echo --cpu)
  # the timeline of a pipelined step: GPU kernels and NCCL sends under the schedule's phases
  TL="$OUT_DIR/timeline"; mkdir -p "$TL"
  step tl-run "${RUN[@]}" "${VGG[@]}" --train --device $DEV "${PIPE[@]}" "${BF16[@]}" --channels-last \
    --microbatches $VGG_MB --schedule 1f1b --batch $VGG_B --train-size $(( VGG_B * 6 )) \
    --heldout-size 32 --steps 6 --quiet --trace "$TL/trace" --out "$TL/runs.jsonl"
  step tl-merge $PY -m scalelab timeline "$TL/runs.jsonl" -o "$TL/merged.json"
  step plan-r18 $PY -m scalelab plan "${R18[@]}" --train --device $DEV "${PLAN[@]}" \
    --ceilings benchmarks/results/gpu_s17/cal/ceilings_gpu.json --batch $(( R18_B * 2 )) \
    --train-size $(( R18_B * 2 * 16 )) -o "$OUT_DIR/plan-r18"
  ;;
gpt)
  step plan-gpt $PY -m scalelab plan "${GPT[@]}" --train --device $DEV "${PLAN[@]}" \
    --ceilings benchmarks/results/gpu_s17/cal/ceilings_gpu.json --batch $GPT_B \
    --train-size $(( GPT_B * 8 )) -o "$OUT_DIR/plan-gpt"
  ;;
suite)
  step suite bash benchmarks/gpu_suite.sh "$OUT_DIR" 300
  ;;
final)  # the last device time: the 2-GPU suite, eager DDP twice, the 1-GPU suite
  step suite-2gpu bash benchmarks/gpu_suite.sh "$OUT_DIR" 290
  step eager-twice $PY benchmarks/fast_ddp_probe.py "$OUT_DIR/eager_twice" --determinism
  # one GPU visible and fresh Triton / tuning caches: the suite as a fresh 1-GPU host runs it
  fresh=$(mktemp -d)
  CUDA_VISIBLE_DEVICES=0 TRITON_CACHE_DIR=$fresh/triton XDG_CACHE_HOME=$fresh \
    step suite-1gpu bash benchmarks/gpu_suite.sh "$OUT_DIR" 200
  ;;
*) echo "unknown part $PART (speed, diag, gpt, suite, final)"; exit 2 ;;
esac
