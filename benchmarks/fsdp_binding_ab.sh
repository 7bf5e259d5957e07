#!/usr/bin/env bash
# Does where the host thread runs set a host-bound step's speed? The example GPT at GPT-2
# small's shape, fsdp bf16 on one GPU (host-bound: its GPU idles while the host issues FSDP2's
# work), launched ROUNDS times unbound and ROUNDS times bound (taskset) to the CPUs of the GPU's
# own NUMA node (/sys/bus/pci/devices/<gpu>/local_cpulist), alternated; ddp (GPU-bound) once
# each way beside it. One line per launch: steady sequences/s from the record.
#   benchmarks/fsdp_binding_ab.sh OUT_DIR [ROUNDS]
set -u
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" NCCL_NVLS_ENABLE=0
OUT=$1; ROUNDS=${2:-3}; mkdir -p "$OUT"
bus=$(nvidia-smi --query-gpu=pci.bus_id --format=csv,noheader -i 0 | tr 'A-Z' 'a-z' | sed 's/^0000//')
near=$(cat "/sys/bus/pci/devices/$bus/local_cpulist" 2>/dev/null || echo all)
{ date -u +"%F %T UTC"; echo "${SCALELAB_GIT_COMMIT:-$(git rev-parse --short HEAD)}"; nvidia-smi -L
  echo "GPU $bus near CPUs: $near"; lscpu | grep -i -E "numa|model name|^cpu\(s\)"; } | tee "$OUT/host.txt"
GPT=(--model examples/models/gpt.py:gpt --model-arg vocab=50304 --model-arg seq=1024
     --model-arg width=768 --model-arg heads=12 --model-arg depth=12 --input-shape 1024
     --input-dtype int64 --vocab 50304 --train --device cuda --batch 16 --train-size 640
     --heldout-size 16 --epochs 1 -q --ranks 1)
one() {  # one LABEL BIND STRATEGY ARGS...
  local label=$1 bind=$2; shift 2
  local pre=(); [[ $bind == near && $near != all ]] && pre=(taskset -c "$near")
  "${pre[@]}" python3 -m scalelab run "${GPT[@]}" --out "$OUT/runs.jsonl" "$@" >/dev/null 2>"$OUT/$label.err"
  python3 -c "import json,sys; r=[json.loads(l) for l in open(sys.argv[1])][-1]; print(sys.argv[2], round(r['steady_throughput'],1))" "$OUT/runs.jsonl" "$label" | tee -a "$OUT/ab.txt"
}
for r in $(seq "$ROUNDS"); do
  one "fsdp_unbound_$r" any --strategy fsdp --dtype bf16
  one "fsdp_near_$r" near --strategy fsdp --dtype bf16
done
one ddp_unbound any --strategy ddp --amp bf16
one ddp_near near --strategy ddp --amp bf16
