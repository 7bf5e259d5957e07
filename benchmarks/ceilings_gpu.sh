#!/usr/bin/env bash
# Ceilings of the GPU machine: GEMM per dtype, HBM copy, h2d/d2h pinned and pageable, NumPy
# GEMM/copy, then (with 2+ GPUs) NCCL and MPI all-reduce / point-to-point alpha-beta fits.
# Each step prints its table; the JSON lands in $OUT (or the first argument, or ./scalelab-results).
#   usage: benchmarks/ceilings_gpu.sh [OUT_DIR]
set -euo pipefail
out="${1:-${OUT:-scalelab-results}}"
py="${PYTHON:-python}"
mkdir -p "$out"
gpu=$("$py" -c "import torch; n = torch.cuda.get_device_name(0).split(); print(n[1].lower())")
file="$out/ceilings_${gpu}.json"
"$py" -m scalelab ceilings -o "$file"
if [ "$("$py" -c 'import torch; print(torch.cuda.device_count())')" -ge 2 ]; then
  "$py" -m scalelab ceilings --comm-only --ranks 2 --backend nccl -o "$file"
  "$py" -m scalelab ceilings --comm-only --ranks 2 --backend mpi -o "$file"
fi
"$py" -m scalelab ceilings --peaks
