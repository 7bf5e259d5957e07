#!/usr/bin/env bash
# Session 20's predictions of AlexNet inference, `mpi --split batch`, 64 images, at 8, 16 and
# 32 CPU ranks of one thread on a 32-core host, made before they are measured from:
#   - the one- and two-rank calibration runs of gpu_s20/two (s20_calibration.jsonl);
#   - the host's contention at k ranks timed on AlexNet's own forward at 64/k items
#     (benchmarks/step_contention.py, gpu_s20/suite/contention/ceilings_b<64/k>.json: session
#     17's CPU ceilings with that curve as their cpu_concurrency).
#
#   [CURVES=DIR] [CAL=FILE] benchmarks/predict_s20_mpi.sh OUT_DIR
#       CURVES: the ceilings_b<B>.json files to read (posthoc_mpi/ used copies whose curves
#       say which step they timed, `step`, added after the measurement); CAL: the calibration
#       runs (gpu_round_s21.sh owed writes both, CURVES=OUT/contention CAL=OUT/calibration.jsonl)
set -u
cd "$(dirname "$0")/.."
OUT_DIR=$1
mkdir -p "$OUT_DIR"
PY=${PYTHON:-python3}
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
S20=benchmarks/results/gpu_s20
CURVES=${CURVES:-$S20/suite/contention}
CAL=${CAL:-$S20/two/s20_calibration.jsonl}
for n in 8 16 32; do
  b=$(( 64 / n )); name=alex-batch-$n
  if $PY -m scalelab predict alexnet --strategy mpi --split batch --batch 64 --ranks $n \
      --threads 1 --device cpu --ceilings "$CURVES/ceilings_b$b.json" \
      --calibrate "$CAL" --no-plots -o "$OUT_DIR/$name" \
      >"$OUT_DIR/$name.out" 2>"$OUT_DIR/$name.err"; then
    echo "predict: $name $(awk -F, 'NR==2{print $5}' "$OUT_DIR/$name/predict.csv") ms"
  else
    echo "predict: $name FAILED: $(tail -1 "$OUT_DIR/$name.err")"
  fi
done
