#!/usr/bin/env bash
# Three CPU plans on a quiet host (alexnet inference
# at batch 32 over 1-2 ranks x threads, mlp training on MNIST, a user model), each pinned to
# 4 cores of a 16-core machine that runs nothing else, and a GPU plan (resnet18-cifar
# training on one GPU: ddp --ranks 1 plain, --fast, --compile, and mpi-dp). The shared 2-core
# development host swings by more than the 10% and 5% being checked (its load moves between
# calibration and verification), so this is where they are measured. One plan at a time:
# four side by side on one machine disturbed each other by up to 2x.
#
#   benchmarks/plan_quiet_host.sh OUT_DIR MNIST_DIR SECONDS PLAN [PLAN ...]
#       PLAN: alexnet | mlp | mlp4 | tokcnn | pipetorch | resnet18-gpu
#       (pipetorch: the mlp's training under torch.distributed.pipelining over 2 ranks,
#       gpipe/1f1b/interleaved-1f1b/zero-bubble/zbv, the top 3 verified)
#       (mlp4: the mlp's tensor split over 2-4 ranks x threads, every candidate verified:
#       the tensor model against more than 2 ranks; a run there takes ~11 s, mostly
#       start-up, so mpi-dp's 12 more candidates do not fit one 10-minute call with them)
#
# Ceilings are measured once per OUT_DIR on the same cores (`cpu_cores` 4). Everything is
# packed into OUT_DIR.tgz at the end (the device tool brings back few files).
set -u
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" NCCL_NVLS_ENABLE=0
OUT=$1; MNIST=$2; LIMIT=$3; shift 3
PYTHON=${PYTHON:-python3}
CORES=0-3
mkdir -p "$OUT"
deadline=$(( $(date +%s) + LIMIT ))
pinned() { taskset -c "$CORES" "$PYTHON" -m scalelab "$@"; }

cpu_ceilings() {  # CEILINGS=FILE: one measured before on the same pinning, reused
  [ -n "${CEILINGS:-}" ] && [ ! -f "$OUT/ceilings_cpu4.json" ] && cp "$CEILINGS" "$OUT/"
  [ -f "$OUT/ceilings_cpu4.json" ] && return
  pinned ceilings --quick --device cpu -q -o "$OUT/ceilings_cpu4.json"
  pinned ceilings --comm-only --ranks 2 --backend gloo -q -o "$OUT/ceilings_cpu4.json"
}

plan() {  # plan NAME ARGS...: one plan, its stdout/stderr in NAME.txt/.err
  local name=$1 start; shift
  start=$(date +%s)
  timeout --signal=KILL $(( deadline - start )) taskset -c "$CORES" "$PYTHON" -m scalelab \
      plan "$@" -o "$OUT/$name" > "$OUT/$name.txt" 2> "$OUT/$name.err"
  echo "plan_quiet_host: $name exit $? after $(( $(date +%s) - start )) s" | tee -a "$OUT/$name.err"
}

CPU=(--ranks-max 2 --ceilings "$OUT/ceilings_cpu4.json" --calibrate-missing)
for which in "$@"; do
  case $which in
    alexnet) cpu_ceilings; plan alexnet alexnet --batch 32 --image-size 99 --iters 10 \
        --warmup 1 "${CPU[@]}" --repeats 2 --verify 3 --timeout 120 ;;
    mlp) cpu_ceilings; plan mlp mlp --train --batch 100 --steps 40 --data-dir "$MNIST" \
        --strategies mpi-dp,ddp,tensor "${CPU[@]}" --repeats 2 --verify 3 --timeout 120 ;;
    mlp4) cpu_ceilings; plan mlp4 mlp --train --batch 100 --steps 40 --data-dir "$MNIST" \
        --strategies tensor --ranks-max 4 --ceilings "$OUT/ceilings_cpu4.json" \
        --calibrate-missing --repeats 2 --verify 99 --timeout 120 ;;
    tokcnn) cpu_ceilings; plan tokcnn --model examples/models/tokcnn.py:tokcnn \
        --model-arg dim=64 --model-arg vocab=500 --input-shape 512 --input-dtype int64 \
        --vocab 500 --batch 8 --iters 40 --warmup 2 "${CPU[@]}" --repeats 2 --verify 2 \
        --timeout 120 ;;
    pipetorch) cpu_ceilings; plan pipetorch mlp --train --batch 64 --steps 40 \
        --strategies pipeline-torch "${CPU[@]}" --repeats 2 --verify 3 --timeout 60 ;;
    resnet18-gpu)
      [ -f "$OUT/ceilings_gpu.json" ] || pinned ceilings --quick --device cuda --no-comm -q \
          -o "$OUT/ceilings_gpu.json"
      plan resnet18_gpu resnet18-cifar --train --device cuda --ranks-max 1 --batch 512 \
          --steps 200 --precisions bf16 --ceilings "$OUT/ceilings_gpu.json" \
          --calibrate-missing --verify 99 --repeats 2 --timeout 150 ;;
    *) echo "plan_quiet_host: unknown plan $which" >&2 ;;
  esac
done
tail -n 2 "$OUT"/*.txt
tar czf "$OUT.tgz" -C "$(dirname "$OUT")" "$(basename "$OUT")"
