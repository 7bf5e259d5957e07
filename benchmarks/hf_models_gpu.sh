#!/usr/bin/env bash
# Hugging Face models as users have them (`--model hf:TYPE`, the GPU image's own torch and
# transformers) trained on one GPU under every one-GPU strategy and dtype, each with --check
# (2 training steps against one float64 process), then the tokens/s and MFU each record says:
#
#   benchmarks/hf_models_gpu.sh OUT_DIR [TYPES] [STRATEGIES]
#
# TYPES default "llama gpt2 mistral qwen2"; STRATEGIES default "local ddp fsdp"; MODES (the
# environment) the precision flags of each run, `|`-separated, default "--dtype fp32|--dtype
# bf16" (MODES="--amp bf16 --compile": each model compiled, its loss too). Writes
# OUT_DIR/hf_runs.jsonl (the records), OUT_DIR/hf_models.log and, last, one line per run:
# type, strategy, dtype, status, check, relerr, tokens/s, MFU against the datasheet peak.
set -u
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT_DIR=$1
TYPES=${2:-llama gpt2 mistral qwen2}
STRATEGIES=${3:-local ddp fsdp}
PYTHON=${PYTHON:-python3}
DEVICE=$("$PYTHON" -c "import torch; print('cuda' if torch.cuda.is_available() else 'cpu')")
mkdir -p "$OUT_DIR"
runs="$OUT_DIR/hf_runs.jsonl"
{
  date -u +"%F %T UTC"; git rev-parse --short HEAD 2>/dev/null
  "$PYTHON" -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
  for t in $TYPES; do
    for s in $STRATEGIES; do
      IFS='|' read -ra modes <<< "${MODES:---dtype fp32|--dtype bf16}"
      for m in "${modes[@]}"; do
        echo "== hf:$t $s $m"
        timeout 300 "$PYTHON" -m scalelab run --model "hf:$t" --model-arg hidden_size=256 \
          --model-arg intermediate_size=512 --input-shape 128 --input-dtype int64 \
          --vocab 4096 --batch 8 --strategy "$s" $m --device "$DEVICE" --train \
          --steps 6 --check --out "$runs" 2>&1 | tail -4
      done
    done
  done
} 2>&1 | tee "$OUT_DIR/hf_models.log"
"$PYTHON" - "$runs" <<'PY'
import json, sys
for line in open(sys.argv[1]):
    r = json.loads(line)
    c = r.get("config", {})
    mfu = (r.get("mfu") or {}).get("datasheet")
    print(c.get("model"), r.get("strategy"), r.get("precision"), (r.get("compile") or {}).get("loss"),
          r.get("status"),
          r.get("check_passed"), f"{r.get('relerr') or float('nan'):.2e}",
          f"{r.get('tokens_per_s') or float('nan'):.0f} tok/s", f"mfu {mfu}")
PY
