#!/usr/bin/env bash
# Compiled fsdp against compiled ddp and eager fsdp on one GPU, with dynamo's recompile and
# graph-break logs counted, and the plain FSDP2 peer compiled beside them. OUT: where to write.
set -u
export NCCL_NVLS_ENABLE=0 PYTHONPATH=src SCALELAB_GIT_COMMIT=${SCALELAB_GIT_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
o=${OUT:?set OUT}; mkdir -p $o; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > $o/host.txt; date -u >> $o/host.txt
g=(--model examples/models/gpt.py:gpt --model-arg depth=12 --model-arg width=768 --model-arg heads=12 --model-arg seq=1024 --model-arg vocab=50304 --input-shape 1024 --input-dtype int64 --vocab 50304 --train --batch 16 --steps 30 --device cuda --out $o/runs.jsonl)
for s in "fsdp --dtype bf16 --compile" "ddp --amp bf16 --compile" "fsdp --dtype bf16"; do
  n=$(echo $s | tr ' ' '_' | tr -d '-')
  TORCH_LOGS=recompiles,graph_breaks timeout 200 python -m scalelab run "${g[@]}" --strategy $s --ranks 1 > $o/$n.txt 2>&1
  echo "$s: rc=$? recompile=$(grep -ci 'recompil' $o/$n.txt) breaks=$(grep -ci 'graph break' $o/$n.txt) limit=$(grep -ci 'cache_size_limit\|recompile_limit' $o/$n.txt) $(grep -h 'steady' $o/$n.txt | head -1)"
done
TORCH_LOGS=recompiles,graph_breaks timeout 200 torchrun --standalone --nproc-per-node 1 benchmarks/peer_gpt_train.py --runs fsdp+unitmb200+localopt+compile --out $o/peer.jsonl > $o/peer_fsdp_compile.txt 2>&1
echo "peer: rc=$? recompile=$(grep -ci 'recompil' $o/peer_fsdp_compile.txt) limit=$(grep -ci 'cache_size_limit\|recompile_limit' $o/peer_fsdp_compile.txt)"; cat $o/peer.jsonl | cut -c1-300
