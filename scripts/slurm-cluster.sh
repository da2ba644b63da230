#!/usr/bin/env bash
# A one-node Slurm cluster on 127.0.0.1 (munged, slurmctld, slurmd) for CI and trying the `launcher: slurm` path.
#
#   scripts/slurm-cluster.sh start [DIR]   # writes DIR/slurm.conf (default /tmp/kiln-slurm), starts the daemons
#   export SLURM_CONF=/tmp/kiln-slurm/slurm.conf; sinfo; sbatch ...
#   scripts/slurm-cluster.sh stop [DIR]    # stops the daemons this script started (by their pid files)
#
# Needs root and Debian's packages: apt-get install -y slurm-wlm munge (Slurm 22.05). KILL_WAIT (default 30) is the
# grace period between scancel's SIGTERM and its SIGKILL: the time a preempted training job has to save.
set -euo pipefail
cmd=${1:-}
dir=${2:-/tmp/kiln-slurm}
conf="$dir/slurm.conf"

wait_for() {  # wait_for SECONDS COMMAND...: retry COMMAND until it succeeds
  local deadline=$(( $(date +%s) + $1 )); shift
  until "$@" >/dev/null 2>&1; do
    if [ "$(date +%s)" -ge "$deadline" ]; then echo "slurm-cluster: timed out waiting for: $*" >&2; return 1; fi
    sleep 0.5
  done
}

start() {
  command -v slurmctld >/dev/null || { echo "slurm-cluster: slurmctld not found: apt-get install -y slurm-wlm munge" >&2; exit 1; }
  mkdir -p "$dir"/{state,spool,log} /run/munge /var/log/munge /var/lib/munge
  chmod 0755 /run/munge
  if [ ! -s /etc/munge/munge.key ]; then
    mkdir -p /etc/munge
    dd if=/dev/urandom of=/etc/munge/munge.key bs=1024 count=1 status=none
  fi
  chmod 0400 /etc/munge/munge.key
  if ! munge -n >/dev/null 2>&1; then
    munged --force --pid-file="$dir/munged.pid"
    wait_for 10 munge -n
  fi
  local cpus mem
  cpus=$(nproc)
  mem=$(( $(awk '/MemTotal/ {print $2}' /proc/meminfo) / 1024 - 512 ))
  cat > "$conf" <<EOF
# one-node cluster written by scripts/slurm-cluster.sh
ClusterName=kiln
SlurmctldHost=localhost(127.0.0.1)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
MpiDefault=none
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SwitchType=switch/none
ReturnToService=2
KillWait=${KILL_WAIT:-30}
MinJobAge=3600
SlurmctldPort=${SLURMCTLD_PORT:-6817}
SlurmdPort=${SLURMD_PORT:-6818}
StateSaveLocation=$dir/state
SlurmdSpoolDir=$dir/spool
SlurmctldPidFile=$dir/slurmctld.pid
SlurmdPidFile=$dir/slurmd.pid
SlurmctldLogFile=$dir/log/slurmctld.log
SlurmdLogFile=$dir/log/slurmd.log
NodeName=localhost NodeAddr=127.0.0.1 CPUs=$cpus RealMemory=$mem State=UNKNOWN
PartitionName=debug Nodes=localhost Default=YES MaxTime=INFINITE State=UP
EOF
  export SLURM_CONF="$conf"
  slurmctld -f "$conf"
  wait_for 30 scontrol ping
  slurmd -f "$conf" -N localhost
  wait_for 60 sh -c "sinfo -h -N -o %t | grep -Eq '^(idle|mix|alloc)'"
  echo "slurm-cluster: up ($cpus CPUs, ${mem} MB); export SLURM_CONF=$conf"
}

stop_pid() {  # stop_pid FILE: SIGTERM the daemon whose pid FILE holds, wait for it to go
  local pid
  [ -s "$1" ] || return 0
  pid=$(cat "$1")
  if kill -0 "$pid" 2>/dev/null; then
    kill "$pid"
    for _ in $(seq 1 40); do kill -0 "$pid" 2>/dev/null || break; sleep 0.25; done
  fi
  rm -f "$1"
}

stop() {
  stop_pid "$dir/slurmd.pid"
  stop_pid "$dir/slurmctld.pid"
  stop_pid "$dir/munged.pid"
  echo "slurm-cluster: stopped"
}

case "$cmd" in
  start) start ;;
  stop) stop ;;
  *) echo "usage: $0 start|stop [DIR]" >&2; exit 2 ;;
esac
