#!/usr/bin/env bash
# The GPU test suite (`pytest -m gpu`) on the device machine, bounded and logged:
#
#   benchmarks/gpu_suite.sh OUT_DIR [SECONDS] [PYTEST ARGS...]
#
# writes OUT_DIR/gpu_suite_<N>gpu.log (every test's outcome as it ends, the durations, the
# summary; nvidia-smi's GPU list first) and exits with pytest's code (124: it ran past SECONDS,
# default 300, the time the suite must end in on a fresh host, Triton autotuning included).
set -u
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT_DIR=$1; shift
LIMIT=${1:-300}; shift || true
PYTHON=${PYTHON:-python3}
mkdir -p "$OUT_DIR"
# the GPUs the tests see (CUDA_VISIBLE_DEVICES=0 on a 2-GPU host runs the 1-GPU suite)
gpus=$("$PYTHON" -c "import torch; print(torch.cuda.device_count())" 2>/dev/null || echo 0)
log="$OUT_DIR/gpu_suite_${gpus}gpu.log"
{
  date -u +"%F %T UTC"; git rev-parse --short HEAD 2>/dev/null; nvidia-smi -L
  start=$(date +%s)
  # Tests in parallel (pytest-xdist where the image has it), one by one rather than a file
  # per worker: on a fresh 2x H200 the files one after another took over 420 s, and a file
  # per worker 351 s, one worker running test_fast_gpu.py's ~30 kernel tests (each autotuning
  # in its own process) while the others had finished; 4 workers one by one, 300 s with
  # the three 2-GPU pipeline tests (94, 73, 62 s) still running at the end.
  par=()
  # --maxschedchunk 1: a free worker takes the next test in order (by default xdist deals
  # each worker a batch up front, so a long test could still start last: a 2-GPU run once
  # ended at 290 s with test_pipeline_on_two_gpus_agrees_with_one running).
  "$PYTHON" -c "import xdist" 2>/dev/null && par=(-n "${WORKERS:-8}" --dist load --maxschedchunk 1)
  # xdist still sends each worker two tests up front and its next one before the current one
  # ends, so a test queued behind a long one waits for it: a run once ended at
  # 290 s with test_pipeline_on_two_gpus_agrees_with_one queued behind test_versions' whole
  # 2-GPU table (~280 s), which now runs as three tests (test_versions.GPU_ROWS).
  # The longest tests first (pytest keeps the order of the files it is given), so none
  # starts last: a 2-GPU run once ended at 290 s with test_versions' 2-GPU table,
  # started at 71%, still running.
  first=(tests/test_versions.py tests/test_pipeline_gpu.py tests/test_ddp.py tests/test_fast_gpu.py)
  rest=()
  for f in tests/test_*.py; do [[ " ${first[*]} " == *" $f "* ]] || rest+=("$f"); done
  (( $# )) || set -- "${first[@]}" "${rest[@]}"
  timeout --signal=KILL "$LIMIT" "$PYTHON" -m pytest -m gpu -p no:randomly -p no:cacheprovider \
    "${par[@]}" -rA -v --durations=15 "$@"
  code=$?
  echo "gpu_suite: exit $code after $(( $(date +%s) - start )) s (limit $LIMIT s) on $gpus GPU(s)"
  exit $code
} 2>&1 | tee "$log"
exit "${PIPESTATUS[0]}"
