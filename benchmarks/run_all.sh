#!/usr/bin/env bash
# The one-GPU benchmark: `--fast` against its peers (eager fp32 and bf16, torch.compile default
# and max-autotune) for charcnn and alexnet inference, resnet18 and mlp training, one table.
#
#   benchmarks/run_all.sh [OUT_DIR]        (default: $OUT if set, else benchmarks/results/bench)
#
# Each workload runs in its own process under a time limit, so a kernel that takes down its
# CUDA context, or a hang, costs only that workload's row; its JSON record (or a failed one)
# lands in OUT_DIR as WORKLOAD-MODE.json. At most (number of workloads) x LIMIT seconds; the
# max-autotune peer compiles for minutes. WORKLOADS picks a subset ("charcnn alexnet"), extra
# arguments for every bench go in BENCH_ARGS (e.g. "--peers eager,compile"), and
# SCALELAB_FAST_DISABLE=block1,conv1d,layernorm,epilogue2d switches Triton kernels off.
set -u
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"  # works without `pip install -e .`
OUT_DIR=${1:-${OUT:-benchmarks/results/bench}}
PYTHON=${PYTHON:-python}
LIMIT=${LIMIT:-420}
mkdir -p "$OUT_DIR"
"$PYTHON" -c "import torch, triton; print('torch', torch.__version__, '| triton', triton.__version__, '|', torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'no GPU')" \
  || echo "run_all: torch/triton import failed (see above)"
for workload in ${WORKLOADS:-charcnn alexnet resnet18 mlp}; do
  start=$(date +%s)
  rm -f "$OUT_DIR/$workload"-*.json
  # shellcheck disable=SC2086
  timeout --signal=KILL "$LIMIT" "$PYTHON" -m scalelab bench "$workload" --out "$OUT_DIR" ${BENCH_ARGS:-}
  code=$?
  echo "run_all: $workload finished with exit code $code in $(( $(date +%s) - start )) s" >&2
  if ! ls "$OUT_DIR/$workload"-*.json >/dev/null 2>&1; then  # killed or crashed: say so
    "$PYTHON" -c 'import json, sys; o, w, c = sys.argv[1:]; json.dump({"schema": "scalelab.bench/1", "status": "failed", "workload": w, "error": f"process ended with exit code {c} before writing a record (137: killed at the time limit)"}, open(f"{o}/{w}-killed.json", "w"))' "$OUT_DIR" "$workload" "$code"
  fi
done
echo
"$PYTHON" -m scalelab bench --table "$OUT_DIR"
