#!/usr/bin/env bash
# Session 17's 2-GPU round (issue 40), in parts, one device call each, every step bounded:
#
#   benchmarks/gpu_round_s17.sh cal     OUT_DIR SECONDS
#       the GPU suite (benchmarks/gpu_suite.sh), the host's ceilings (GPU, NCCL, CPU + MPI),
#       then the CALIBRATION records only: one GPU (CUDA_VISIBLE_DEVICES=0) and 1-2 CPU ranks.
#       The predictions are made from these records off the device and committed before
#       `measure` runs (benchmarks/results/gpu_s17/predictions/).
#   benchmarks/gpu_round_s17.sh measure OUT_DIR SECONDS
#       the held-out configurations the predictions name (2-GPU ddp, pipeline, tensor, fsdp;
#       MPI CPU ranks 8/16/32) with their one-GPU peers in the same call (the speed targets),
#       a traced 2-GPU ddp step merged by `scalelab timeline`, and `scalelab versions`.
#   benchmarks/gpu_round_s17.sh plan    OUT_DIR SECONDS
#       `scalelab plan --verify` on 2 GPUs (resnet18-cifar training, the example GPT).
#
# Sizes: SMOKE=1 shrinks every model and uses the CPU (DEV=cpu), to check the commands here.
set -u
cd "$(dirname "$0")/.."
PART=$1
source benchmarks/round_steps.sh "$2" "${3:-540}"
S=scalelab
GPUS=2; AMP=(--amp bf16 --channels-last)
if [[ $SMOKE == 1 ]]; then AMP=(); fi

# --- the configurations (one place: calibration, prediction and measurement read these) -----
if [[ $SMOKE == 1 ]]; then
  R18=(resnet18-cifar --image-size 16); R18_B=16; R18_STEPS=4
  VGG=(vgg16 --image-size 32 --num-classes 10); VGG_B=32; VGG_MB=4
  GPT=(--model examples/models/gpt.py:gpt --model-arg vocab=64 --model-arg seq=16
       --model-arg width=32 --model-arg heads=4 --model-arg depth=4 --input-shape 16
       --input-dtype int64 --vocab 64)
  GPT_B=8; ALEX=(alexnet --image-size 67); ALEX_B=8; MPI_RANKS=(2); MPI_BATCH=4
else
  R18=(resnet18-cifar); R18_B=512; R18_STEPS=30
  VGG=(vgg16); VGG_B=256; VGG_MB=8
  GPT=(--model examples/models/gpt.py:gpt --model-arg vocab=4096 --model-arg seq=512
       --model-arg width=768 --model-arg heads=12 --model-arg depth=12 --input-shape 512
       --input-dtype int64 --vocab 4096)
  GPT_B=32; ALEX=(alexnet); ALEX_B=64; MPI_RANKS=(8 16 32); MPI_BATCH=64
fi
# ResNet-18-CIFAR weak scaling at R18_B per GPU: ddp_scaling.py's `ours` (the step captured).
r18() {  # r18 NAME OUT RANKS
  local n=$(( R18_B * $3 * R18_STEPS ))
  step "$1" "${RUN[@]}" "${R18[@]}" --strategy ddp --train --fast --device $DEV "${AMP[@]}" --momentum 0.9 \
    --ranks "$3" --batch $(( R18_B * $3 )) --train-size $n --heldout-size 512 --epochs 3 --quiet \
    --out "$2"
}
# VGG-16: the plain and the compiled one-GPU peers are `ddp --ranks 1` (the bare model, bf16
# autocast, channels_last; --compile: torch.compile of it); torch's pipelining reads --dtype.
BF16=(--dtype bf16)
vgg() {  # vgg NAME OUT RUN-ARGS...: training, 8 steps of the global batch
  local name=$1 out=$2; shift 2
  step "$name" "${RUN[@]}" "${VGG[@]}" --train --device $DEV --momentum 0.9 --lr 0.01 \
    --batch $VGG_B --train-size $(( VGG_B * 8 )) --heldout-size 32 --epochs 1 --quiet \
    --out "$out" "$@"
}
gpt() {  # gpt NAME OUT BATCH RUN-ARGS...: training, 16 steps
  local name=$1 out=$2 b=$3; shift 3
  step "$name" "${RUN[@]}" "${GPT[@]}" --train --device $DEV --batch "$b" --train-size $(( 16 * b )) \
    --heldout-size 16 --epochs 1 --lr 1e-3 --quiet --out "$out" "$@"
}
alex() {  # alex NAME OUT RANKS SPLIT BATCH: inference on CPU ranks of one thread
  step "$1" "${RUN[@]}" "${ALEX[@]}" --strategy mpi --split "$4" --ranks "$3" --threads 1 --batch "$5" \
    --iters 5 --warmup 2 --quiet --out "$2"
}

case $PART in
cal)
  if [[ $SMOKE != 1 ]]; then
    step suite bash benchmarks/gpu_suite.sh "$OUT_DIR" 270
  fi
  CEIL="$OUT_DIR/ceilings_gpu.json"; CCPU="$OUT_DIR/ceilings_cpu.json"
  [[ $SMOKE != 1 ]] && step ceilings $PY -m scalelab ceilings --quick --device cuda --no-comm -o "$CEIL"
  [[ $SMOKE != 1 ]] && step ceilings-nccl $PY -m scalelab ceilings --quick --comm-only --ranks 2 --backend nccl -o "$CEIL"
  step ceilings-cpu $PY -m scalelab ceilings --quick --device cpu --ranks 2 --backend mpi -o "$CCPU"
  CAL="$OUT_DIR/calibration.jsonl"
  export CUDA_VISIBLE_DEVICES=0  # one GPU: nothing below sees the second
  r18 cal-r18 "$CAL" 1
  vgg cal-vgg-local "$CAL" "${BF16[@]}"
  vgg cal-vgg-local-mb "$CAL" "${BF16[@]}" --batch $(( VGG_B / VGG_MB )) --train-size $(( VGG_B ))
  gpt cal-gpt-local "$CAL" $GPT_B
  gpt cal-gpt-local-half "$CAL" $(( GPT_B / 2 ))
  gpt cal-gpt-fsdp1 "$CAL" $GPT_B --strategy fsdp --ranks 1
  gpt cal-gpt-tensor1 "$CAL" $GPT_B --strategy tensor --engine torch --ranks 1
  unset CUDA_VISIBLE_DEVICES
  for split in batch spatial; do
    b=$ALEX_B; [[ $split == spatial ]] && b=$(( ALEX_B / 2 ))
    alex cal-alex-$split-1 "$CAL" 1 $split $b
    alex cal-alex-$split-2 "$CAL" 2 $split $b
  done
  ;;
measure)
  MEAS="$OUT_DIR/measured.jsonl"
  # Why the captured DDP step's update is 0.85 off eager's (the suite's fast-ddp test).
  step fast-ddp-probe $PY benchmarks/fast_ddp_probe.py "$OUT_DIR/probe"
  # VGG-16's one-GPU calibration (the cal part's failed on a flag), then its predictions here,
  # before any VGG-16 step below runs (the other predictions were committed before this call).
  CAL="$OUT_DIR/calibration.jsonl"
  CUDA_VISIBLE_DEVICES=0 vgg cal-vgg-local "$CAL" "${BF16[@]}"
  CUDA_VISIBLE_DEVICES=0 vgg cal-vgg-local-mb "$CAL" "${BF16[@]}" --batch $(( VGG_B / VGG_MB )) \
    --train-size $(( VGG_B ))
  cp "${CEIL_DIR:-benchmarks/results/gpu_s17/cal}"/ceilings_*.json "$OUT_DIR/"
  ONLY=vgg step predict-vgg bash benchmarks/predict_s17.sh "$OUT_DIR" "$OUT_DIR/predictions"
  # The speed targets' peers first, in this call: one GPU plain (and compiled) beside 2 GPUs.
  CUDA_VISIBLE_DEVICES=0 r18 r18-x1 "$MEAS" 1
  r18 r18-x2 "$MEAS" 2
  CUDA_VISIBLE_DEVICES=0 vgg vgg-x1 "$MEAS" --strategy ddp --ranks 1 "${AMP[@]}"
  CUDA_VISIBLE_DEVICES=0 vgg vgg-x1-compile "$MEAS" --strategy ddp --ranks 1 "${AMP[@]}" --compile
  for sched in gpipe 1f1b; do
    vgg vgg-pipe-$sched "$MEAS" --strategy pipeline --engine torch --ranks 2 "${BF16[@]}" \
      --microbatches $VGG_MB --schedule $sched
  done
  vgg vgg-pipe-interleaved "$MEAS" --strategy pipeline --engine torch --ranks 2 "${BF16[@]}" \
    --microbatches $VGG_MB --schedule interleaved-1f1b --virtual-stages 2
  gpt gpt-tensor "$MEAS" $GPT_B --strategy tensor --engine torch --ranks 2
  gpt gpt-pipe "$MEAS" $GPT_B --strategy pipeline --engine torch --ranks 2 --microbatches 4 \
    --schedule 1f1b
  gpt gpt-fsdp "$MEAS" $GPT_B --strategy fsdp --ranks 2
  gpt gpt-ddp "$MEAS" $GPT_B --strategy ddp --ranks 2
  for n in "${MPI_RANKS[@]}"; do alex alex-batch-$n "$MEAS" $n batch $ALEX_B; done
  # The timeline with kernels: a traced 2-GPU ddp run, merged and analysed.
  TL="$OUT_DIR/timeline"; mkdir -p "$TL"
  step tl-run "${RUN[@]}" resnet18 --strategy ddp --train --device $DEV --ranks 2 --batch 256 \
    --train-size 2048 --heldout-size 64 --steps 4 --momentum 0.9 --quiet --trace "$TL/trace" \
    --out "$TL/runs.jsonl"
  step tl-merge $PY -m scalelab timeline "$TL/runs.jsonl" -o "$TL/merged.json"
  ;;
plan)
  step versions-alexnet $PY -m scalelab versions "${ALEX[@]}" --batch 64 --ranks 2 \
    --out "$OUT_DIR/versions.jsonl"
  CEIL=${CEIL:-benchmarks/results/gpu_s17/cal/ceilings_gpu.json}  # the cal part's, committed
  PLAN=(--ranks-max 2 --gpus-per-node 2 --ceilings "$CEIL" --calibrate-missing --verify 2)
  step plan-r18 $PY -m scalelab plan "${R18[@]}" --train --device $DEV "${PLAN[@]}" \
    --batch $(( R18_B * 2 )) -o "$OUT_DIR/plan-r18"
  step plan-gpt $PY -m scalelab plan "${GPT[@]}" --train --device $DEV "${PLAN[@]}" \
    --batch $GPT_B -o "$OUT_DIR/plan-gpt"
  ;;
*) echo "unknown part $PART (cal, measure, plan)"; exit 2 ;;
esac
