#!/usr/bin/env bash
# Session 13's 2-GPU measurements in one device call, each step bounded:
#   1. the example GPT at a GPU size (12 blocks, width 768, 12 heads, sequence 512) under
#      local, pipeline (torch engine, 2 stages) and tensor (DTensor, 2 ranks), checked against
#      float64 (inference), then trained 12 steps under each (step time, memory per GPU);
#   2. a user transformer (nn.TransformerEncoder) in fp32 on CUDA: --check --explain, then
#      --strict-fp32 (where the error entered, which kernel);
#   3. benchmarks/fsdp_memory.py: ddp vs fsdp peak memory per GPU of a 1.03e9-parameter model
#      against plan/memory's prediction, step times in the same launch.
#
#   benchmarks/gpu_round_s13.sh OUT_DIR SECONDS
set -u
cd "$(dirname "$0")/.."
source benchmarks/round_steps.sh "$1" "${2:-500}"
GPT=(--model examples/models/gpt.py:gpt --model-arg vocab=4096 --model-arg seq=512
     --model-arg width=768 --model-arg heads=12 --model-arg depth=12 --input-shape 512
     --input-dtype int64 --vocab 4096 --device cuda --nvml --out "$OUT_DIR/transformer_gpu.jsonl")
INFER=(--batch 8 --check --iters 10 --warmup 3)
TRAIN=(--train --batch 16 --train-size 192 --heldout-size 16 --epochs 1 --lr 1e-3)
step gpt-local-infer $PY -m scalelab run "${GPT[@]}" "${INFER[@]}"
step gpt-pipe-infer $PY -m scalelab run "${GPT[@]}" "${INFER[@]}" --strategy pipeline --engine torch --ranks 2 --microbatches 4
step gpt-tensor-infer $PY -m scalelab run "${GPT[@]}" "${INFER[@]}" --strategy tensor --engine torch --ranks 2
step gpt-local-train $PY -m scalelab run "${GPT[@]}" "${TRAIN[@]}"
step gpt-pipe-train $PY -m scalelab run "${GPT[@]}" "${TRAIN[@]}" --strategy pipeline --engine torch --ranks 2 --schedule 1f1b --microbatches 4
step gpt-tensor-train $PY -m scalelab run "${GPT[@]}" "${TRAIN[@]}" --strategy tensor --engine torch --ranks 2
step gpt-ddp-train $PY -m scalelab run "${GPT[@]}" "${TRAIN[@]}" --strategy ddp --ranks 2
step gpt-fsdp-train $PY -m scalelab run "${GPT[@]}" "${TRAIN[@]}" --strategy fsdp --ranks 2
ENC=(--model tests/programs/transformer_nets.py:encoder --model-arg feats=64 --model-arg seq=128
     --model-arg width=256 --model-arg heads=8 --model-arg depth=4 --input-shape 128,64
     --device cuda --batch 32 --out "$OUT_DIR/explain_gpu.jsonl")
step explain-fp32 $PY -m scalelab run "${ENC[@]}" --check --explain
step explain-strict $PY -m scalelab run "${ENC[@]}" --check --explain --strict-fp32
step fsdp-memory $PY benchmarks/fsdp_memory.py "$OUT_DIR/fsdp_memory_2gpu.json"
$PY - "$OUT_DIR" <<'PYEOF'
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
for name in ("transformer_gpu.jsonl", "explain_gpu.jsonl"):
    f = out / name
    if not f.exists():
        continue
    for line in f.read_text().splitlines():
        r = json.loads(line)
        cfg = r.get("config", {})
        mem = [n.get("peak_mem_bytes") for n in (r.get("rank_nvml") or [r.get("nvml") or {}])]
        mem = [round(m / 2**30, 2) for m in mem if m]
        print(f"{r.get('strategy'):9} {r.get('mode'):5} {r.get('status'):12} relerr={r.get('relerr')} "
              f"wall_ms={round(1e3 * (r.get('wall_s') or 0), 2)} steady={r.get('steady_throughput')} "
              f"tol={r.get('tolerance')} mem_GiB={mem} strict={cfg.get('strict_fp32')}")
PYEOF
