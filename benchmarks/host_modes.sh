#!/usr/bin/env bash
# Where does a host-bound step's launch-to-launch spread come from? The plain FSDP2 loop
# (peer_gpt_train.py, fsdp with 200 MB units and its optimizer on the local shards: the step
# scalelab's fsdp default takes) on one GPU at GPT-2 small's shape, launched ROUNDS times
# unpinned and ROUNDS times pinned (taskset) to PIN CPUs, alternated. Per launch: sequences/s,
# the share of the host's CPU time the hypervisor took (steal, /proc/stat) and the busy share
# of the host's CPUs while it ran, and on which CPUs the rank's busiest thread was seen
# (sampled each second): a slow launch on a host stolen from, or on a CPU shared with another
# busy thread, is the host's, not the loop's.
#   benchmarks/host_modes.sh OUT_DIR [ROUNDS] [PIN]
set -u
OUT=$1; ROUNDS=${2:-3}; PIN=${3:-2-5}; mkdir -p "$OUT"
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" NCCL_NVLS_ENABLE=0
{ date -u +"%F %T UTC"; echo "${SCALELAB_GIT_COMMIT:-$(git rev-parse --short HEAD)}"; nvidia-smi -L
  lscpu | grep -i -E "numa|model name|^cpu\(s\)|thread\(s\) per core|mhz"; } | tee "$OUT/host.txt"
stat_line() { head -1 /proc/stat; }  # cpu user nice system idle iowait irq softirq steal
one() {  # one LABEL PREFIX...
  local label=$1; shift
  local before after
  before=$(stat_line)
  "$@" python3 -m torch.distributed.run --standalone --nproc-per-node=1 \
    benchmarks/peer_gpt_train.py --runs fsdp+unitmb200+localopt --out "$OUT/peer.jsonl" \
    >"$OUT/$label.log" 2>&1 &
  local launcher=$! seen=()
  while kill -0 "$launcher" 2>/dev/null; do  # the busiest thread of the newest python process
    seen+=("$(ps -eLo pid,psr,pcpu,comm --sort=-pcpu | awk '$4 ~ /python/ {print $2; exit}')")
    sleep 1
  done
  after=$(stat_line)
  python3 - "$OUT/peer.jsonl" "$label" "$before" "$after" "${seen[*]}" <<'EOF' | tee -a "$OUT/modes.txt"
import collections, json, sys
path, label, before, after, seen = sys.argv[1:6]
rate = [json.loads(line) for line in open(path)][-1]["sequences_per_s"]
b, a = ([int(v) for v in s.split()[1:9]] for s in (before, after))
d = [x - y for x, y in zip(a, b)]
total = sum(d) or 1
cpus = collections.Counter(seen.split()).most_common(3)
print(f"{label:12s} {rate:7.1f} seq/s  steal {100 * d[7] / total:5.2f}%  "
      f"busy {100 * (total - d[3] - d[4]) / total:5.1f}%  busiest thread on CPUs {cpus}")
EOF
}
for r in $(seq "$ROUNDS"); do
  one "free_$r"
  one "pinned_$r" taskset -c "$PIN"
done
