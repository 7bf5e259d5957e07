#!/usr/bin/env bash
# The predictions of session 17's round (issue 40), made off the device from the `cal` part's
# records alone (one GPU, 1-2 CPU ranks, the host's ceilings), before `measure` runs:
#
#   [ONLY=PREFIX] benchmarks/predict_s17.sh CAL_DIR OUT_DIR
#
# One `scalelab predict` per held-out configuration of gpu_round_s17.sh's `measure` part (the
# same sizes: SMOKE=1 for its smoke sizes), each into OUT_DIR/<name>/ (predict.json, .csv).
set -u
cd "$(dirname "$0")/.."
CAL_DIR=$1; OUT_DIR=$2
mkdir -p "$OUT_DIR"
PY=${PYTHON:-python3}
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
CAL=$(ls "$CAL_DIR"/*calibration.jsonl | head -1)  # the round writes calibration.jsonl; committed: s17_*
CEIL="$CAL_DIR/ceilings_gpu.json"; CCPU="$CAL_DIR/ceilings_cpu.json"
DEV=cuda; AMP=(--amp bf16 --channels-last)
if [[ ${SMOKE:-0} == 1 ]]; then
  DEV=cpu; AMP=(); CEIL=$CCPU
  R18=(resnet18-cifar --image-size 16); R18_B=16; VGG=(vgg16 --image-size 32 --num-classes 10)
  VGG_B=32; VGG_MB=4; GPT_B=8; ALEX=(alexnet --image-size 67); ALEX_B=8; MPI_RANKS=1,2
  GPT=(--model examples/models/gpt.py:gpt --model-arg vocab=64 --model-arg seq=16
       --model-arg width=32 --model-arg heads=4 --model-arg depth=4 --input-shape 16
       --input-dtype int64 --vocab 64)
else
  R18=(resnet18-cifar); R18_B=512; VGG=(vgg16); VGG_B=256; VGG_MB=8; GPT_B=32
  ALEX=(alexnet); ALEX_B=64; MPI_RANKS=1,2,8,16,32
  GPT=(--model examples/models/gpt.py:gpt --model-arg vocab=4096 --model-arg seq=512
       --model-arg width=768 --model-arg heads=12 --model-arg depth=12 --input-shape 512
       --input-dtype int64 --vocab 4096)
fi
ONLY=${ONLY:-}  # a name prefix: only those predictions (vgg: made on the device, see the round)
predict() {  # predict NAME PREDICT-ARGS...
  local name=$1; shift
  [[ -n $ONLY && $name != $ONLY* ]] && return
  if $PY -m scalelab predict "$@" --calibrate "$CAL" --no-plots -o "$OUT_DIR/$name" \
      >"$OUT_DIR/$name.out" 2>"$OUT_DIR/$name.err"; then
    echo "predict: $name"
  else
    echo "predict: $name FAILED: $(tail -1 "$OUT_DIR/$name.err")"
  fi
}
GPU=(--ranks 1,2 --gpus-per-node 2 --ceilings "$CEIL" --device $DEV)
predict r18-ddp "${R18[@]}" --strategy ddp --train --fast "${AMP[@]}" --per-rank-batch $R18_B "${GPU[@]}"
for sched in gpipe 1f1b; do
  predict vgg-pipe-$sched "${VGG[@]}" --strategy pipeline --engine torch --train --dtype bf16 \
    --batch $VGG_B --microbatches $VGG_MB --schedule $sched "${GPU[@]}"
done
predict vgg-pipe-interleaved "${VGG[@]}" --strategy pipeline --engine torch --train --dtype bf16 \
  --batch $VGG_B --microbatches $VGG_MB --schedule interleaved-1f1b --virtual-stages 2 "${GPU[@]}"
predict gpt-tensor "${GPT[@]}" --strategy tensor --engine torch --train --batch $GPT_B "${GPU[@]}"
predict gpt-pipe "${GPT[@]}" --strategy pipeline --engine torch --train --batch $GPT_B \
  --microbatches 4 --schedule 1f1b "${GPU[@]}"
predict gpt-fsdp "${GPT[@]}" --strategy fsdp --train --batch $GPT_B "${GPU[@]}"
predict gpt-ddp "${GPT[@]}" --strategy ddp --train --batch $GPT_B "${GPU[@]}"
CPU=(--ranks $MPI_RANKS --ceilings "$CCPU" --threads 1)
predict alex-batch "${ALEX[@]}" --strategy mpi --split batch --batch $ALEX_B "${CPU[@]}"
predict alex-spatial "${ALEX[@]}" --strategy mpi --split spatial --batch $(( ALEX_B / 2 )) "${CPU[@]}"
