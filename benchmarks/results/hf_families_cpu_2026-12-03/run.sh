for t in llama gpt2 mistral qwen2 qwen3 phi3 gemma gemma2 gpt_neox opt falcon olmo2 granite stablelm; do
 for s in "tensor --ranks 2 --engine torch" "pipeline --ranks 2 --engine torch"; do
  start=$(date +%s)
  out=$(timeout 300 /work/main/.venv/bin/scalelab run --model hf:$t --input-shape 16 --input-dtype int64 --vocab 128 --strategy $s --train --dtype fp64 --check --no-record --quiet --batch 8 --train-size 32 --heldout-size 8 --epochs 1 2>&1)
  rc=$?
  echo "== $t | $s | rc=$rc | $(( $(date +%s) - start )) s | $(echo "$out" | grep -iE "check|error|refus|scalelab:" | tail -2 | tr '\n' ' ' | cut -c1-300)"
 done
done
