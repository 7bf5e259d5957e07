#!/usr/bin/env bash
# What issue 40 still owes, as two device calls on 2-GPU hosts, every step bounded (written
# in session 21, which had no device time left to run it):
#
#   benchmarks/gpu_round_s21.sh owed OUT_DIR SECONDS   (a fresh 2-GPU host, ~540 s)
#       the GPU suite with fresh Triton/Inductor caches (the green 2-GPU log: session 20's
#       one failure, the split versions test's own parsing, is fixed); AlexNet's one- and
#       two-rank CPU calibration and the host's contention curves on AlexNet's own forward at
#       8, 4 and 2 items, now timed in lock-step rounds (slowdown_lockstep, the step's time
#       alone); then the example GPT's `plan --verify` on its complete calibration (GPT_CAL,
#       default gpu_s20's), so that plan prints its own verify table. After this call, the MPI
#       predictions are made from its files (benchmarks/predict_s20_mpi.sh with CURVES and
#       CAL) and committed before `measure`.
#   benchmarks/gpu_round_s21.sh measure OUT_DIR SECONDS  (a 2-GPU host)
#       AlexNet `mpi --split batch` at 8, 16 and 32 CPU ranks of one thread; then the VGG-16
#       speed target: the one-GPU peers (`ddp --ranks 1`, bf16 autocast, NHWC; the same
#       compiled) at batch 256 and 512, against torch's pipelining on 2 GPUs with NHWC stages
#       and bf16 weights: 1F1B and interleaved-1F1B at batch 256 over 8 micro-batches (32
#       items each), and at batch 1024 over 8 (128 each). Session 18's timeline put the
#       1.9x out of reach at micro-batches of 32 (each costs 1.3x its share of the one-GPU
#       work); predict (session 17's calibration) gives interleaved-1F1B at 1024 / 8 a speedup
#       of 1.86 over its own one-rank run, against 1.72 for 1F1B at 256 / 8.
# SMOKE=1 shrinks every model and uses the CPU, to check the commands here.
set -u
cd "$(dirname "$0")/.."
PART=$1
source benchmarks/round_steps.sh "$2" "${3:-540}"
if [[ $SMOKE == 1 ]]; then
  VGG=(vgg16 --image-size 32 --num-classes 10); VGG_B=(16 32); BIG_B=64; MB=4; STEPS=2
  AMP=(--channels-last); BF16=(); COMPILE=()
  ALEX=(alexnet --image-size 67); ALEX_B=8; MPI_RANKS=(2); CURVE_B=(--batch 4:2)
  GPT=(--model examples/models/gpt.py:gpt --model-arg vocab=64 --model-arg seq=16
       --model-arg width=32 --model-arg heads=4 --model-arg depth=4 --input-shape 16
       --input-dtype int64 --vocab 64)
  GPT_B=8; PLAN=()  # the plan's smoke is skipped: it ran as here on the device in session 20
else
  VGG=(vgg16); VGG_B=(256 512); BIG_B=1024; MB=8; STEPS=12
  AMP=(--amp bf16 --channels-last); BF16=(--dtype bf16); COMPILE=(--compile)
  ALEX=(alexnet); ALEX_B=64; MPI_RANKS=(8 16 32); CURVE_B=(--batch 8:8 --batch 4:16 --batch 2:32)
  GPT=(--model examples/models/gpt.py:gpt --model-arg vocab=4096 --model-arg seq=512
       --model-arg width=768 --model-arg heads=12 --model-arg depth=12 --input-shape 512
       --input-dtype int64 --vocab 4096)
  GPT_B=32; PLAN=(--ranks-max 2 --gpus-per-node 2 --calibrate-missing --verify 2 --repeats 1)
fi
GPT_CAL=${GPT_CAL:-benchmarks/results/gpu_s20/gpt_calibration_complete.jsonl}
CEIL=benchmarks/results/gpu_s17/cal/ceilings_gpu.json
CCPU=benchmarks/results/gpu_s17/cal/ceilings_cpu.json
PIPE=(--strategy pipeline --engine torch --ranks 2 --channels-last "${BF16[@]}")

vgg() {  # vgg NAME BATCH RUN-ARGS...: VGG-16 training, STEPS steps of BATCH, into MEAS
  local name=$1 batch=$2; shift 2
  step "$name" "${RUN[@]}" "${VGG[@]}" --train --device $DEV --momentum 0.9 --lr 0.01 \
    --batch "$batch" --train-size $(( batch * STEPS )) --heldout-size 32 --epochs 1 --quiet \
    --out "$OUT_DIR/measured.jsonl" "$@"
}
alex() {  # alex NAME OUT RANKS: AlexNet inference, batch split over CPU ranks of one thread
  step "$1" "${RUN[@]}" "${ALEX[@]}" --strategy mpi --split batch --ranks "$3" --threads 1 \
    --batch $ALEX_B --iters 5 --warmup 2 --quiet --out "$2"
}

case $PART in
owed)
  fresh=$(mktemp -d)  # compile caches of this call only: the suite as a fresh host runs it
  [[ $SMOKE == 1 ]] || TRITON_CACHE_DIR=$fresh/triton TORCHINDUCTOR_CACHE_DIR=$fresh/inductor \
    XDG_CACHE_HOME=$fresh step suite-2gpu bash benchmarks/gpu_suite.sh "$OUT_DIR" 290
  alex cal-alex-batch-1 "$OUT_DIR/calibration.jsonl" 1
  alex cal-alex-batch-2 "$OUT_DIR/calibration.jsonl" 2
  step curves $PY benchmarks/step_contention.py $CCPU "$OUT_DIR/contention" "${CURVE_B[@]}"
  [[ $SMOKE == 1 ]] && exit 0
  mkdir -p "$OUT_DIR/plan-gpt"
  cp "$GPT_CAL" "$OUT_DIR/plan-gpt/calibration.jsonl"
  step plan-gpt $PY -m scalelab plan "${GPT[@]}" --train --device $DEV "${PLAN[@]}" \
    --ceilings $CEIL --batch $GPT_B --train-size $(( GPT_B * 8 )) -o "$OUT_DIR/plan-gpt"
  ;;
measure)
  for n in "${MPI_RANKS[@]}"; do alex alex-batch-$n "$OUT_DIR/measured.jsonl" $n; done
  for b in "${VGG_B[@]}"; do
    CUDA_VISIBLE_DEVICES=0 vgg vgg-x1-b$b $b --strategy ddp --ranks 1 "${AMP[@]}"
    [[ $SMOKE == 1 ]] || CUDA_VISIBLE_DEVICES=0 vgg vgg-x1-compile-b$b $b --strategy ddp \
      --ranks 1 "${AMP[@]}" "${COMPILE[@]}"
  done
  for b in "${VGG_B[0]}" $BIG_B; do
    vgg vgg-pipe-1f1b-b$b $b "${PIPE[@]}" --microbatches $MB --schedule 1f1b
    vgg vgg-pipe-interleaved-b$b $b "${PIPE[@]}" --microbatches $MB \
      --schedule interleaved-1f1b --virtual-stages 2
  done
  ;;
*) echo "unknown part $PART (owed, measure)"; exit 2 ;;
esac
