#!/usr/bin/env bash
# Session 16's 2-GPU round in one device call, each step bounded by what is left:
#   1. the host's ceilings (GEMM, copies, NCCL all-reduce / p2p fits on 2 GPUs, quick);
#   2. per model, calibration on ONE GPU only, then `scalelab predict --strategy fsdp` of its
#      2-GPU steps from those records (OUT_DIR/predict-*), then the 2-GPU measurements:
#      - the 1.0e9-parameter deepstack of fsdp_memory.py, plain and fsdp --ranks 1 at 32
#        items; measured by benchmarks/fsdp_memory.py (ddp vs fsdp peak memory per GPU
#        against fit's estimate, with the allocator's account of what was alive at each peak);
#      - the example GPT (12 blocks, width 768, seq 512), plain at 16 and 32 items and fsdp
#        --ranks 1 at 16; measured under fsdp (reshard on and off) and ddp at 32 items;
#      - the deepstack's fsdp step again with its collectives timed (--timeline): an A/B of
#        the timing hooks;
#   3. predicted vs measured, one line per configuration (predict-vs-measured.txt).
#
#   benchmarks/gpu_round_s16.sh OUT_DIR SECONDS
set -u
cd "$(dirname "$0")/.."
source benchmarks/round_steps.sh "$1" "${2:-540}"
CEIL="$OUT_DIR/ceilings.json"
step ceilings $PY -m scalelab ceilings --quick --device cuda --no-comm -o "$CEIL"
step ceilings-nccl $PY -m scalelab ceilings --quick --comm-only --ranks 2 --backend nccl -o "$CEIL"

GPT=(--model examples/models/gpt.py:gpt --model-arg vocab=4096 --model-arg seq=512
     --model-arg width=768 --model-arg heads=12 --model-arg depth=12 --input-shape 512
     --input-dtype int64 --vocab 4096 --device cuda --train)
DEEP=(deepstack --convs 1 --fcs 60 --image-size 32 --device cuda --train)
gpt_run() {  # gpt_run NAME BATCH OUT RUN-ARGS...: 16 steps, one epoch
  local name=$1 b=$2 out=$3; shift 3
  step "$name" $PY -m scalelab run "${GPT[@]}" --batch "$b" --train-size $(( 16 * b )) \
    --heldout-size 16 --epochs 1 --lr 1e-3 --quiet --out "$out" "$@"
}
# The deepstack first (calibrate, predict, then measure with fsdp_memory.py), then the GPT.
CAL="$OUT_DIR/calibration.jsonl"
step cal-deep-local $PY -m scalelab run "${DEEP[@]}" --batch 32 --train-size 256 --heldout-size 32 \
  --epochs 1 --lr 1e-3 --momentum 0.9 --quiet --out "$CAL"
step cal-deep-fsdp1 $PY -m scalelab run "${DEEP[@]}" --batch 32 --train-size 256 --heldout-size 32 \
  --epochs 1 --lr 1e-3 --momentum 0.9 --quiet --out "$CAL" --strategy fsdp --ranks 1
PRED=(--ranks 1,2 --gpus-per-node 2 --ceilings "$CEIL" --calibrate "$CAL" --no-plots)
step predict-deep-fsdp $PY -m scalelab predict "${DEEP[@]}" --strategy fsdp --batch 64 "${PRED[@]}" \
  -o "$OUT_DIR/predict-deep-fsdp"
step predict-deep-fsdp-off $PY -m scalelab predict "${DEEP[@]}" --strategy fsdp --batch 64 \
  --reshard-after-forward off "${PRED[@]}" -o "$OUT_DIR/predict-deep-fsdp-off"
step fsdp-memory $PY benchmarks/fsdp_memory.py "$OUT_DIR/fsdp_memory_2gpu.json"

gpt_run cal-gpt-local16 16 "$CAL"
gpt_run cal-gpt-local32 32 "$CAL"
gpt_run cal-gpt-fsdp1 16 "$CAL" --strategy fsdp --ranks 1

# Predictions from the one-GPU records and the ceilings, before any 2-GPU GPT step runs.
step predict-gpt-fsdp $PY -m scalelab predict "${GPT[@]}" --strategy fsdp --batch 32 "${PRED[@]}" \
  -o "$OUT_DIR/predict-gpt-fsdp"
step predict-gpt-fsdp-off $PY -m scalelab predict "${GPT[@]}" --strategy fsdp --batch 32 \
  --reshard-after-forward off "${PRED[@]}" -o "$OUT_DIR/predict-gpt-fsdp-off"

MEAS="$OUT_DIR/measured.jsonl"
gpt_run gpt-fsdp 32 "$MEAS" --strategy fsdp --ranks 2
gpt_run gpt-fsdp-off 32 "$MEAS" --strategy fsdp --ranks 2 --reshard-after-forward off
gpt_run gpt-ddp 32 "$MEAS" --strategy ddp --ranks 2
# A/B: the same deepstack fsdp step with its collectives timed (--timeline installs FSDP's
# custom all-gather / reduce-scatter); the untimed one is fsdp_memory.py's.
step deep-fsdp-timed $PY -m scalelab run "${DEEP[@]}" --batch 64 --train-size 512 --heldout-size 64 \
  --epochs 1 --lr 1e-3 --momentum 0.9 --quiet --out "$OUT_DIR/timed.jsonl" --strategy fsdp \
  --ranks 2 --timeline

$PY - "$OUT_DIR" <<'PYEOF' | tee "$OUT_DIR/predict-vs-measured.txt"
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
def predicted(name):
    f = out / name / "predict.json"
    if not f.exists():
        return None
    rows = json.loads(f.read_text())["rows"]
    return next((r for r in rows if int(r["ranks"]) == 2), None)
measured = []
for f in (out / "measured.jsonl", out / "fsdp_memory_2gpu.runs" / "runs.jsonl"):
    if f.exists():
        measured += [json.loads(line) for line in f.read_text().splitlines() if line.strip()]
def step_ms(rec):
    return 1e3 * rec["global_batch"] / rec["steady_throughput"]
print("configuration                 predicted_ms  measured_ms  error")
for name, model, reshard in (("predict-gpt-fsdp", "gpt", "on"), ("predict-gpt-fsdp-off", "gpt", "off"),
                             ("predict-deep-fsdp", "deepstack", "on"),
                             ("predict-deep-fsdp-off", "deepstack", "off")):
    p = predicted(name)
    recs = [r for r in measured if r.get("strategy") == "fsdp" and r.get("status") == "ok"
            and (model in str(r["config"].get("model") or "") or r["config"].get("workload") == model)
            and r["config"].get("reshard_after_forward", "on") == reshard]
    if p is None or not recs:
        print(f"{name:28} {'-' if p is None else round(p['ms'], 2)}  (no measurement)")
        continue
    m = step_ms(recs[-1])
    print(f"{name:28} {p['ms']:12.2f} {m:12.2f}  {100 * (p['ms'] / m - 1):+.1f}%")
timed = out / "timed.jsonl"
for r in measured + ([json.loads(x) for x in timed.read_text().splitlines()] if timed.exists() else []):
    if r.get("status") == "ok":
        cfg = r["config"]
        print(f"  {cfg.get('workload')} {r['strategy']} reshard={cfg.get('reshard_after_forward')} "
              f"ranks={r['ranks']} step_ms={step_ms(r):.2f} comm={json.dumps(r.get('fsdp_comm'))[:200]}")
PYEOF
