#!/usr/bin/env bash
# The scaling study on one host of 4 (or 8) GPUs, in device calls of < 10 minutes:
#
#   benchmarks/multi_gpu_study.sh ddp  [OUT_DIR]   ddp ResNet-18 (torchvision layout and the
#       CIFAR variant), bf16, --fast: weak 512/GPU and 128/GPU, strong at global 1024 and
#       4096, on 1/2/4(/8) GPUs; plain DDP beside ours on 1 and 2 GPUs; bucket/graph variants
#   benchmarks/multi_gpu_study.sh rest [OUT_DIR]   NCCL all-reduce bus bandwidth by size over
#       all GPUs; charcnn mpi-gpu and nccl on 1/2/4(/8) GPUs; AlexNet mpi on 1..64 CPU
#       ranks (height split to its limit of 14 ranks, batch split beyond); pipeline VGG-16
#       with 1, 2, 4(, 8) stages, bubble against (K-1)/(M+K-1)
#   benchmarks/multi_gpu_study.sh ceilings [OUT_DIR]   the host's full ceilings (for predict)
#
# GPU counts follow the machine (powers of two up to torch.cuda.device_count()). Results:
# OUT_DIR (default $OUT, else benchmarks/results/multi_gpu): ddp_scaling.json, mpi/runs.jsonl
# and mpi/summary.json, ceilings_host.json, pipeline_vgg.jsonl; tables on stdout.
set -u
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
part=${1:?usage: multi_gpu_study.sh ddp|rest|ceilings [OUT_DIR]}
out=${2:-${OUT:-benchmarks/results/multi_gpu}}
py=${PYTHON:-python}
mkdir -p "$out"
n=$("$py" -c 'import torch; print(torch.cuda.device_count())')
gpus=$("$py" -c "print(','.join(str(g) for g in (1, 2, 4, 8) if g <= $n))")
cores=$("$py" -c 'import os; print(os.cpu_count())')
wide=$("$py" -c "print(','.join(str(r) for r in (16, 32, 64) if r <= $cores))")
stages=$("$py" -c "print(','.join(str(k) for k in (1, 2, 4, 8) if k <= $n))")
echo "multi_gpu_study $part: $n GPUs ($gpus), $cores cores -> $out"
case "$part" in
  ddp)
    "$py" benchmarks/ddp_scaling.py "$out" --gpus "$gpus" --cifar --variants ;;
  rest)
    "$py" -m scalelab ceilings --comm-only --ranks "$n" --backend nccl -o "$out/ceilings_host.json" --quiet \
      || echo "ceilings nccl x$n failed"
    "$py" benchmarks/mpi_scaling.py "$out/mpi" --ranks 1,2,4,8,14 --batch-ranks "$wide" --gpus "$gpus" --markdown
    "$py" benchmarks/pipeline_vgg.py "$out" --stages "$stages" --no-deepstack ;;
  ceilings)
    # This host's own ceilings (GEMM, HBM, PCIe; NCCL over all GPUs; MPI host buffers), so
    # `scalelab predict --validate` does not borrow another host's figures (~2 minutes).
    "$py" -m scalelab ceilings -o "$out/ceilings_host.json" --quiet || echo "ceilings failed"
    "$py" -m scalelab ceilings --comm-only --ranks "$n" --backend nccl -o "$out/ceilings_host.json" --quiet \
      || echo "ceilings nccl x$n failed"
    "$py" -m scalelab ceilings --comm-only --ranks 2 --backend mpi -o "$out/ceilings_host.json" --quiet \
      || echo "ceilings mpi x2 failed" ;;
  *) echo "unknown part $part (ddp, rest or ceilings)"; exit 2 ;;
esac
