#!/usr/bin/env bash
# Where a bf16 transformer training step loses its time on N GPUs: the example GPT at GPT-2
# small's shape (12 x 768, seq 1024, vocab 50304), 16 sequences per GPU, under ddp --amp bf16,
# fsdp bf16 and compiled ddp, each with a kernel trace of 3 steady steps per rank, then
# `scalelab timeline` (per rank: compute, communication, their overlap, exposed communication,
# wait) and `scalelab phases`.
#   benchmarks/diag_transformer_step.sh OUT_DIR [GPUS]
#   RUNS="fsdp ddp-compile" benchmarks/diag_transformer_step.sh OUT_DIR 4   # some of the runs
set -u
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=$1; N=${2:-4}; mkdir -p "$OUT"
{ date -u +"%F %T UTC"; echo "${SCALELAB_GIT_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null)}";
  nvidia-smi -L 2>/dev/null; python3 -c "import torch; print('torch', torch.__version__)"; } | tee "$OUT/host.txt"
DEV=${DEV:-cuda}
GPT=(--model examples/models/gpt.py:gpt --model-arg vocab=50304 --model-arg seq=1024
     --model-arg width=768 --model-arg heads=12 --model-arg depth=12 --input-shape 1024
     --input-dtype int64 --vocab 50304)
B=$(( 16 * N )); STEPS=14
if [[ ${SMOKE:-0} == 1 ]]; then
  GPT=(--model examples/models/gpt.py:gpt --input-shape 16 --input-dtype int64 --vocab 64); B=4; STEPS=3
fi
one() {  # one NAME ARGS...: a traced training run, its record in OUT/runs.jsonl
  local name=$1; shift
  local t0=$(date +%s)
  timeout --signal=KILL 240 python3 -m scalelab run "${GPT[@]}" --train --device $DEV \
    --batch $B --train-size $(( B * STEPS )) --heldout-size 16 --epochs 1 -q \
    --trace "$OUT/$name" --out "$OUT/runs.jsonl" "$@" >"$OUT/$name.out" 2>"$OUT/$name.err"
  echo "$name exit $? after $(( $(date +%s) - t0 )) s"; tail -2 "$OUT/$name.err"
}
declare -A RUN=(
  [ddp]="--strategy ddp --ranks $N --amp bf16"
  [fsdp]="--strategy fsdp --ranks $N --dtype bf16"
  [fsdp-block]="--strategy fsdp --ranks $N --dtype bf16 --fsdp-unit-mb 0"
  [fsdp-fp32]="--strategy fsdp --ranks $N"
  [ddp-compile]="--strategy ddp --ranks $N --amp bf16 --compile"
  [fsdp-compile]="--strategy fsdp --ranks $N --dtype bf16 --compile"
)
for name in ${RUNS:-ddp fsdp fsdp-fp32 ddp-compile}; do
  # shellcheck disable=SC2086  # the run's options, split
  one "$name" ${RUN[$name]}
done
python3 -m scalelab timeline "$OUT/runs.jsonl" -o "$OUT/trace.json" > "$OUT/timeline.txt" 2>&1
python3 -m scalelab phases "$OUT/runs.jsonl" > "$OUT/phases.txt" 2>&1
python3 - "$OUT/runs.jsonl" <<'PY' | tee "$OUT/summary.txt"
import json, sys
for line in open(sys.argv[1]):
    r = json.loads(line); c = r["config"]
    top = {k: round(v, 4) for k, v in (r.get("phases") or {}).items() if "/" not in k}
    print(c["strategy"], "amp", c.get("amp"), "dtype", c.get("dtype"), "compile", c.get("compile"),
          "ranks", c["ranks"], "steady items/s", round(r.get("steady_throughput") or 0, 1), top)
PY
cat "$OUT/timeline.txt" | head -80
for d in "$OUT"/*/; do rm -f "$d"/rank[1-9]*.json.gz; done  # keep rank 0's traces only
du -sh "$OUT"
