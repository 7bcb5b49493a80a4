#!/usr/bin/env bash
# A real single-node Slurm cluster on this machine, for scripts/test-launchers.sh: munged,
# slurmctld and slurmd (Debian's slurm-wlm and munge; scripts/install-launchers.sh installs
# them), all started and stopped by this script, with every file (munge key and socket,
# slurm.conf, state, spool, logs, pid files) in one temporary folder and nothing under /etc,
# /run or /var. Free TCP ports are picked at start, so it can run beside another cluster.
#
#     scripts/slurm-local.sh up [DIR]     start one (DIR: default a new mktemp -d); prints
#                                         SLURM_CONF=DIR/slurm.conf, for the clients (srun,
#                                         sbatch, squeue, ...) to use: export it
#     scripts/slurm-local.sh down [DIR]   cancel its jobs, stop its daemons, remove DIR
#                                         (default: the folder of $SLURM_CONF)
#     scripts/slurm-local.sh run CMD...   up, CMD with SLURM_CONF set, down (also when CMD or
#                                         the start fails, or on Ctrl-C); CMD's exit status
#
# An `up` that fails prints the daemons' own log lines and tears down what it started. The
# node has $SLURM_LOCAL_CPUS CPUs (default 4, more than this machine may have: slurmd is told to
# believe the configuration) and a GRES gpu:2 whose device files are two empty files in DIR, so
# that jobs asking for GPUs (scripts/expseg.sbatch's --gpus-per-node=2) are accepted; they get no
# GPU (slurmd counts a GPU only by its File, and a count alone registers none). Jobs
# run as the user running this script (root in CI), with the environment they are given.
set -euo pipefail

say() { echo "slurm-local: $*" >&2; }
die() { say "$*"; exit 1; }

# down DIR: stop what DIR's pid files name (only those processes), remove DIR.
down() {
  local d=$1 f pid i
  [ -d "$d" ] || return 0
  if [ -f "$d/slurm.conf" ] && [ -f "$d/slurmctld.pid" ]; then
    # Running jobs first: their slurmstepd processes are in no pid file.
    SLURM_CONF=$d/slurm.conf timeout 10 scancel --full --quiet --user "$(id -un)" >/dev/null 2>&1 || true
    for i in $(seq 20); do
      [ -z "$(SLURM_CONF=$d/slurm.conf timeout 5 squeue -h -o %i 2>/dev/null)" ] && break
      sleep 0.5
    done
  fi
  for f in slurmd slurmctld munged; do
    [ -f "$d/$f.pid" ] || continue
    pid=$(cat "$d/$f.pid" 2>/dev/null) || continue
    [ -n "$pid" ] && kill -0 "$pid" 2>/dev/null || continue
    kill -TERM "$pid" 2>/dev/null || true
    for i in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.2; done
    if kill -0 "$pid" 2>/dev/null; then
      say "$f ($pid) did not stop on SIGTERM: SIGKILL"
      kill -KILL "$pid" 2>/dev/null || true
    fi
  done
  rm -rf "$d"
}

free_ports() { # N: N free TCP ports on the loopback
  python3 - "$1" <<'PY'
import socket, sys
socks = [socket.socket() for _ in range(int(sys.argv[1]))]
for s in socks:
    s.bind(("127.0.0.1", 0))
print(" ".join(str(s.getsockname()[1]) for s in socks))
PY
}

# wait_for WHAT SECONDS CMD...: until CMD succeeds; false (and a word) after SECONDS.
wait_for() {
  local what=$1 secs=$2 i
  shift 2
  for i in $(seq $((secs * 5))); do
    "$@" >/dev/null 2>&1 && return 0
    sleep 0.2
  done
  say "$what not up after ${secs}s"
  return 1
}

# write_conf DIR NODE USER CTLD_PORT SLURMD_PORT
write_conf() {
  cat >"$1/slurm.conf" <<EOF
# Written by scripts/slurm-local.sh: one node, this machine, everything under $1.
ClusterName=expseg-local
SlurmctldHost=$2(127.0.0.1)
SlurmctldPort=$4
SlurmdPort=$5
SlurmUser=$3
SlurmdUser=$3
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$1/munge/munge.socket
StateSaveLocation=$1/ctld
SlurmdSpoolDir=$1/spool
SlurmctldPidFile=$1/slurmctld.pid
SlurmdPidFile=$1/slurmd.pid
SlurmctldLogFile=$1/slurmctld.log
SlurmdLogFile=$1/slurmd.log
PlugStackConfig=$1/plugstack.conf
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SchedulerType=sched/builtin
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
MpiDefault=none
ReturnToService=2
SlurmdParameters=config_overrides
SlurmdTimeout=60
InactiveLimit=0
KillWait=5
GresTypes=gpu
NodeName=$2 NodeAddr=127.0.0.1 CPUs=${SLURM_LOCAL_CPUS:-4} RealMemory=1024 Gres=gpu:2 State=UNKNOWN
PartitionName=local Nodes=ALL Default=YES MaxTime=INFINITE State=UP
EOF
  # Two plain files as the GPUs' device files: slurmd counts a GPU only by its File.
  mkdir -p "$1/dev" && touch "$1/dev/gpu0" "$1/dev/gpu1" &&
    echo "NodeName=$2 Name=gpu File=$1/dev/gpu[0-1]" >"$1/gres.conf" && : >"$1/plugstack.conf"
}

# start DIR: munged, slurmctld, slurmd on DIR. Each step is checked by hand (this runs under
# `if`, where set -e does not hold); false at the first that fails.
start() {
  local d=$1 user node ports
  user=$(id -un)
  node=$(hostname -s)
  ports=$(free_ports 2) || return 1
  mkdir -p "$d/munge" "$d/ctld" "$d/spool" && chmod 700 "$d/munge" || return 1
  # munge: its own key, socket, pid and seed files (--force: munged refuses a folder under the
  # world-writable /tmp otherwise). Daemons get no stdout: `$(slurm-local.sh up)` would wait
  # for them to close it.
  dd if=/dev/urandom of="$d/munge/munge.key" bs=1024 count=1 status=none && chmod 400 "$d/munge/munge.key" || return 1
  munged --force --key-file="$d/munge/munge.key" --socket="$d/munge/munge.socket" \
    --pid-file="$d/munged.pid" --log-file="$d/munged.log" --seed-file="$d/munge/munged.seed" </dev/null >/dev/null ||
    { say "munged failed to start"; return 1; }
  wait_for munged 10 munge --socket="$d/munge/munge.socket" -n || return 1
  # shellcheck disable=SC2086 # two port numbers
  write_conf "$d" "$node" "$user" $ports || return 1
  export SLURM_CONF=$d/slurm.conf
  slurmctld -f "$SLURM_CONF" </dev/null >/dev/null || { say "slurmctld failed to start"; return 1; }
  wait_for slurmctld 30 scontrol ping || return 1
  slurmd -f "$SLURM_CONF" -N "$node" </dev/null >/dev/null || { say "slurmd failed to start"; return 1; }
  # The node registers and turns idle.
  wait_for "node $node" 30 bash -c '[ "$(sinfo -h -N -n "$0" -o %T 2>/dev/null)" = idle ]' "$node" ||
    { say "node $node: $(sinfo -h -N -o '%T %E' 2>&1 | head -n 1)"; return 1; }
}

show_logs() {
  local f
  for f in munged slurmctld slurmd; do
    if [ -s "$1/$f.log" ]; then say "--- $1/$f.log"; tail -n 15 "$1/$f.log" >&2; fi
  done
  return 0
}

# up [DIR]: a cluster in DIR (default a new temporary folder). Prints SLURM_CONF=...
up() {
  local d=${1:-} c
  for c in munged munge slurmctld slurmd scontrol srun sbatch sinfo squeue scancel; do
    command -v "$c" >/dev/null || die "$c not found: install Slurm and munge (scripts/install-launchers.sh, or apt-get install slurm-wlm munge)"
  done
  if [ -z "$d" ]; then d=$(mktemp -d "${TMPDIR:-/tmp}/slurm-local.XXXXXX"); else mkdir -p "$d"; fi
  d=$(cd "$d" && pwd)
  chmod 700 "$d"
  if ! start "$d"; then
    show_logs "$d"
    down "$d"
    die "could not start a Slurm cluster (the daemons' logs above)"
  fi
  echo "SLURM_CONF=$d/slurm.conf"
}

cmd=${1:-}
shift || true
case "$cmd" in
  up) up "${1:-}" ;;
  down)
    d=${1:-}
    [ -n "$d" ] || [ -n "${SLURM_CONF:-}" ] || die "down: which cluster? (DIR, or SLURM_CONF set)"
    down "${d:-$(dirname "$SLURM_CONF")}"
    ;;
  run)
    [ $# -gt 0 ] || die "usage: slurm-local.sh run CMD [ARGS...]"
    d=$(mktemp -d "${TMPDIR:-/tmp}/slurm-local.XXXXXX")
    trap 'down "$d"' EXIT
    trap 'exit 130' INT TERM
    conf=$(up "$d") || exit 1
    export "${conf?}"
    rc=0
    "$@" || rc=$?
    exit $rc
    ;;
  *)
    echo "usage: slurm-local.sh up [DIR] | down [DIR] | run CMD [ARGS...]" >&2
    exit 2
    ;;
esac
