#!/usr/bin/env bash
# A language model's training step on one GPU: scalelab `run --compile` (local and one ddp
# rank) against the plain loops of benchmarks/compiled_loss_probe.py, alternated in one call.
# The example GPT with every position's logits (lm=True) at GPT-2 small's shape, 16 x 1024
# tokens a step, bf16, SGD lr 0.01 momentum 0.9 (the plain loops' optimizer). Writes OUT/probe.jsonl (the plain loops), OUT/runs.jsonl (scalelab's
# records: steady seq/s, tokens_per_s, mfu), OUT/*.txt (their summaries), OUT/host.txt.
#     bash benchmarks/lm_speed_one_gpu.sh OUT [ROUNDS]
set -euo pipefail
out=$1; rounds=${2:-2}
mkdir -p "$out"
export NCCL_NVLS_ENABLE=0 PYTHONPATH=${PYTHONPATH:-src}
{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
  python -c "import torch; print(torch.__version__)"
  echo "commit ${SCALELAB_GIT_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}"
  date -u; } > "$out/host.txt"
gpt=(--model examples/models/gpt.py:gpt --model-arg lm=True --model-arg depth=12
     --model-arg width=768 --model-arg heads=12 --model-arg seq=1024 --model-arg vocab=50304
     --input-shape 1024 --input-dtype int64 --vocab 50304 --train --batch 16 --steps 30
     --lr 0.01 --momentum 0.9 --device cuda --amp bf16 --compile --out "$out/runs.jsonl")
for r in $(seq 1 "$rounds"); do
  python benchmarks/compiled_loss_probe.py --rounds 1 --runs whole,fused,blocks+loss \
    --out "$out/probe.jsonl" 2>&1 | grep '^{'
  python -m scalelab run "${gpt[@]}" --strategy local > "$out/local_compile_$r.txt" 2>&1
  python -m scalelab run "${gpt[@]}" --strategy ddp --ranks 1 > "$out/ddp1_compile_$r.txt" 2>&1
  grep -h "items/s" "$out/local_compile_$r.txt" "$out/ddp1_compile_$r.txt" | head -4
done
