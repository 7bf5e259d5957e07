#!/usr/bin/env bash
# A real Slurm for the tests: two emulated nodes (n1, n2) on this host.
#
#   tests/slurm/cluster.sh up     install slurm-wlm + munge (Debian's packages) when absent,
#                                 start munged, slurmctld and one slurmd per node, wait until
#                                 both nodes are idle; prints `started` (or `already up`) and
#                                 `export SLURM_CONF=...`
#   tests/slurm/cluster.sh down   stop exactly the daemons `up` started, undo /etc/hosts
#
# Everything lives in $SCALELAB_SLURM_DIR (default /run/scalelab-slurm): the config, a private
# munge key and socket, spool and state dirs, logs and the pids of the daemons it started. The
# system's /etc/slurm and /etc/munge are not touched; /etc/hosts gets two marked lines mapping
# n1 and n2 to 127.0.0.1 (a rendezvous on the job's first node must resolve its name), and
# `down` removes exactly those lines. Both verbs are idempotent. Exit 77: Slurm cannot be
# installed here (not root, or no apt-get), so the tests skip.
set -euo pipefail

DIR=${SCALELAB_SLURM_DIR:-/run/scalelab-slurm}
CONF=$DIR/slurm.conf
MARK="# scalelab-slurm"
CTLD_PORT=${SCALELAB_SLURM_PORT:-16817}
CPUS=${SCALELAB_SLURM_CPUS:-8}  # per emulated node (both share this host's cores)

die() { echo "cluster.sh: $*" >&2; exit "${2:-1}"; }

alive() { [ -f "$DIR/$1.pid" ] && kill -0 "$(cat "$DIR/$1.pid")" 2>/dev/null; }

install() {
  command -v slurmctld >/dev/null && command -v munged >/dev/null && return
  [ "$(id -u)" = 0 ] || die "Slurm is not installed and installing it needs root" 77
  command -v apt-get >/dev/null || die "Slurm is not installed and there is no apt-get" 77
  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq slurm-wlm munge) \
    >"${TMPDIR:-/tmp}/scalelab-slurm-apt.log" 2>&1 || die "apt-get install slurm-wlm munge failed" 77
}

write_conf() {
  local host
  host=$(hostname -s)
  cat >"$CONF" <<EOF
ClusterName=scalelab
# Job ids start fresh with each cluster; MPICH names its shared-memory segments after the PMI
# job and step, and a rank killed earlier leaves its segment in /dev/shm, so a later cluster's
# job 5 met an old job 5's segment ("MPIDI_POSIX_comm_bootstrap: Out of memory"). Start the
# ids where no earlier cluster on this host has been: seconds since the epoch, folded in range.
FirstJobId=$(( $(date +%s) % 50000000 + 1000 ))
SlurmctldHost=$host(127.0.0.1)
SlurmctldPort=$CTLD_PORT
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket=$DIR/munge.sock
CredType=cred/munge
StateSaveLocation=$DIR/ctld
SlurmdSpoolDir=$DIR/spool-%n
SlurmctldPidFile=$DIR/slurmctld-own.pid
SlurmdPidFile=$DIR/slurmd-%n-own.pid
SlurmctldLogFile=$DIR/slurmctld.log
SlurmdLogFile=$DIR/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SlurmdParameters=config_overrides
MpiDefault=none
SchedulerType=sched/backfill
ReturnToService=2
KillWait=20
MinJobAge=600
InactiveLimit=0
SlurmctldTimeout=60
SlurmdTimeout=60
JobCompType=jobcomp/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
NodeName=n1 NodeHostname=$host NodeAddr=127.0.0.1 Port=$((CTLD_PORT + 4)) CPUs=$CPUS State=UNKNOWN
NodeName=n2 NodeHostname=$host NodeAddr=127.0.0.1 Port=$((CTLD_PORT + 5)) CPUs=$CPUS State=UNKNOWN
PartitionName=debug Nodes=n[1-2] Default=YES MaxTime=INFINITE State=UP
EOF
}

map_hosts() {
  grep -q "$MARK" /etc/hosts && return
  printf '127.0.0.1 n1 %s\n127.0.0.1 n2 %s\n' "$MARK" "$MARK" >>/etc/hosts
}

unmap_hosts() {
  grep -q "$MARK" /etc/hosts || return 0
  local kept
  kept=$(grep -v "$MARK" /etc/hosts || true)
  printf '%s\n' "$kept" >/etc/hosts  # in place: /etc/hosts may be a bind mount
}

# start NAME CMD...: run a daemon in the foreground mode, in the background; record its pid
start() {
  local name=$1; shift
  alive "$name" && return
  "$@" >>"$DIR/$name.out" 2>&1 &
  echo $! >"$DIR/$name.pid"
}

wait_idle() {
  local i
  for i in $(seq 60); do
    if [ "$(sinfo -h -N -o '%N %t' 2>/dev/null | grep -c ' idle$')" = 2 ]; then return 0; fi
    sleep 1
  done
  sinfo -N >&2 || true
  tail -n 20 "$DIR"/*.log >&2 || true
  down
  die "nodes n1, n2 not idle after 60 s"
}

up() {
  [ "$(id -u)" = 0 ] || die "the test cluster runs its daemons as root" 77
  if alive slurmctld && alive slurmd-n1 && alive slurmd-n2; then
    echo "already up"
    echo "export SLURM_CONF=$CONF"
    return
  fi
  install
  mkdir -p "$DIR"/ctld "$DIR"/spool-n1 "$DIR"/spool-n2
  chmod 0700 "$DIR"
  [ -f "$DIR/munge.key" ] || { dd if=/dev/urandom of="$DIR/munge.key" bs=1024 count=1 2>/dev/null; chmod 0600 "$DIR/munge.key"; }
  write_conf
  map_hosts
  export SLURM_CONF=$CONF
  start munged munged --foreground --force --key-file="$DIR/munge.key" \
    --socket="$DIR/munge.sock" --pid-file="$DIR/munged-own.pid" \
    --log-file="$DIR/munged.log" --seed-file="$DIR/munge.seed"
  for _ in $(seq 50); do [ -S "$DIR/munge.sock" ] && break; sleep 0.1; done
  alive slurmctld || rm -rf "${DIR:?}"/ctld/*  # a fresh controller: no jobs of an earlier run
  start slurmctld slurmctld -D -f "$CONF"
  start slurmd-n1 slurmd -D -N n1 -f "$CONF"
  start slurmd-n2 slurmd -D -N n2 -f "$CONF"
  wait_idle
  echo "started"
  echo "export SLURM_CONF=$CONF"
}

down() {
  local name pid
  for name in slurmd-n1 slurmd-n2 slurmctld munged; do
    if alive "$name"; then
      pid=$(cat "$DIR/$name.pid")
      kill "$pid"
      for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
      kill -0 "$pid" 2>/dev/null && kill -9 "$pid"
    fi
    rm -f "$DIR/$name.pid"
  done
  unmap_hosts
}

case "${1:-}" in
  up) up ;;
  down) down ;;
  *) die "usage: $0 up|down" 2 ;;
esac
