#!/usr/bin/env bash
# Where does a host-bound step's launch-to-launch spread come from? The plain FSDP2 loop
# (peer_gpt_train.py, fsdp with 200 MB units and its optimizer on the local shards: the step
# scalelab's fsdp default takes) on one GPU at GPT-2 small's shape, launched ROUNDS times
# unpinned and ROUNDS times pinned (taskset) to PIN CPUs, alternated; with PIN=scalelab, the
# peer and `scalelab run --strategy fsdp --dtype bf16` (the same model, batch, steps and SGD as
# benchmarks/transformer_speed.py) alternated instead, both unpinned. Per launch: sequences/s,
# the share of the host's CPU time the hypervisor took (steal, /proc/stat) and the busy share
# of the host's CPUs while it ran, and on which CPUs the rank's busiest thread was seen
# (sampled each second), and how fast one other CPU (PROBE) ran a loop of small torch ops on
# the host meanwhile (ops/s, median of half-second windows): a slow launch on a host stolen
# from, on a CPU shared with another busy thread, or while the host's cores ran slower, is the
# host's, not the loop's.
# SCALELAB_EXTRA adds options to scalelab's run (`--threads 1`). Each launch's busiest threads
# ten seconds in: OUT_DIR/LABEL.threads.
#   benchmarks/host_modes.sh OUT_DIR [ROUNDS] [PIN] [PROBE]
set -u
OUT=$1; ROUNDS=${2:-3}; PIN=${3:-2-5}; PROBE=${4:-10}; mkdir -p "$OUT"
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" NCCL_NVLS_ENABLE=0
{ date -u +"%F %T UTC"; echo "${SCALELAB_GIT_COMMIT:-$(git rev-parse --short HEAD)}"; nvidia-smi -L
  lscpu | grep -i -E "numa|model name|^cpu\(s\)|thread\(s\) per core|mhz"; } | tee "$OUT/host.txt"
stat_line() { head -1 /proc/stat; }  # cpu user nice system idle iowait irq softirq steal
probe() {  # probe FILE: small torch ops per second on CPU PROBE, a line per half second
  taskset -c "$PROBE" python3 -c '
import sys, time, torch
torch.set_num_threads(1)
x, out = torch.ones(8), open(sys.argv[1], "w")
while True:
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < 0.5:
        for _ in range(100):
            x = x + 1.0
        n += 100
    print(n / (time.perf_counter() - t0), file=out, flush=True)' "$1" &
}
GPT=(--model examples/models/gpt.py:gpt --model-arg vocab=50304
     --model-arg seq=1024 --model-arg width=768 --model-arg heads=12 --model-arg depth=12
     --input-shape 1024 --input-dtype int64 --vocab 50304 --train --device cuda --ranks 1
     --batch 16 --train-size 640 --heldout-size 1 --steps 40 --epochs 1 --lr 0.01
     --momentum 0.9 --seed 0 -q --strategy fsdp --dtype bf16 --warmup 10)
one() {  # one LABEL PREFIX...  (PREFIX "scalelab": scalelab's run in place of the peer)
  local label=$1; shift
  local before after
  probe "$OUT/$label.probe"; local prober=$!
  sleep 3  # the probe's own start-up (torch's import) before the launch
  before=$(stat_line)
  if [[ ${1:-} == scalelab ]]; then
    # shellcheck disable=SC2086  # SCALELAB_EXTRA: options, split on spaces
    python3 -m scalelab run "${GPT[@]}" ${SCALELAB_EXTRA:-} --out "$OUT/runs.jsonl" \
      >"$OUT/$label.log" 2>&1 &
  else
    "$@" python3 -m torch.distributed.run --standalone --nproc-per-node=1 \
      benchmarks/peer_gpt_train.py --runs fsdp+unitmb200+localopt --out "$OUT/peer.jsonl" \
      >"$OUT/$label.log" 2>&1 &
  fi
  local launcher=$! seen=()
  while kill -0 "$launcher" 2>/dev/null; do  # the busiest thread of the newest python process
    seen+=("$(ps -eLo pid,psr,pcpu,comm --sort=-pcpu | awk '$4 ~ /python/ {print $2; exit}')")
    [[ ${#seen[@]} == 10 ]] && top -H -b -n 1 -w 120 | head -25 >"$OUT/$label.threads"
    sleep 1
  done
  after=$(stat_line)
  kill "$prober"
  local from="$OUT/peer.jsonl"; [[ ${1:-} == scalelab ]] && from="$OUT/runs.jsonl"
  python3 - "$from" "$label" "$before" "$after" "${seen[*]}" "$OUT/$label.probe" <<'EOF' | tee -a "$OUT/modes.txt"
import collections, json, statistics, sys
path, label, before, after, seen, probe = sys.argv[1:7]
ops = statistics.median(float(v) for v in open(probe).read().split()[6:])  # the launch's
last = [json.loads(line) for line in open(path)][-1]
rate = last.get("sequences_per_s") or last["steady_throughput"]
b, a = ([int(v) for v in s.split()[1:9]] for s in (before, after))
d = [x - y for x, y in zip(a, b)]
total = sum(d) or 1
cpus = collections.Counter(seen.split()).most_common(3)
print(f"{label:12s} {rate:7.1f} seq/s  probe {ops / 1e3:6.1f} kops/s  steal "
      f"{100 * d[7] / total:5.2f}%  busy {100 * (total - d[3] - d[4]) / total:5.1f}%  "
      f"busiest thread on CPUs {cpus}")
EOF
}
for r in $(seq "$ROUNDS"); do
  one "peer_$r"
  if [[ $PIN == scalelab ]]; then one "scalelab_$r" scalelab; else one "pinned_$r" taskset -c "$PIN"; fi
done
