#!/usr/bin/env bash
# A one-node SLURM on this machine, for trying hydra/launcher=slurm (docs/sweeps.md) and for
# tests/test_launchers.py. Needs root and the packages of scripts/install_slurm.sh.
#   eval "$(bash scripts/slurm.sh start /tmp/slurm)"   # prints: export SLURM_CONF=/tmp/slurm/slurm.conf
#   bash scripts/slurm.sh stop /tmp/slurm
# Config, munge key and socket, spool, logs and pid files all live in the state dir; munged,
# slurmctld and slurmd run as daemons (no systemd). No accounting (slurmdbd): sacct fails.
set -euo pipefail
usage="usage: slurm.sh start|stop <state dir>"
action=${1:?$usage}
dir=$(realpath -m "${2:?$usage}")
export SLURM_CONF=$dir/slurm.conf
DAEMONS=(munged slurmctld slurmd)   # started in this order, stopped in the reverse one
WAIT_S=30                           # for the node to come up idle, and for a daemon to exit

write_config() {
  mkdir -p "$dir"/{log,run,ctld,spool}
  [ -f "$dir/munge.key" ] || mungekey --create --keyfile="$dir/munge.key"
  cat >"$SLURM_CONF" <<EOF
ClusterName=rlexp-local
SlurmctldHost=$(hostname -s)
SlurmctldPort=${SLURMCTLD_PORT:-6817}
SlurmdPort=${SLURMD_PORT:-6818}
SlurmUser=root
AuthInfo=socket=$dir/run/munge.socket
StateSaveLocation=$dir/ctld
SlurmdSpoolDir=$dir/spool
SlurmctldPidFile=$dir/run/slurmctld.pid
SlurmdPidFile=$dir/run/slurmd.pid
SlurmctldLogFile=$dir/log/slurmctld.log
SlurmdLogFile=$dir/log/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
ReturnToService=2
MinJobAge=3600                      # no accounting: squeue and scontrol show ended jobs this long (s)
KillWait=5                          # SIGTERM to SIGKILL of a cancelled job (submitit ignores SIGTERM)
$(slurmd -C | head -1) State=UNKNOWN
PartitionName=local Nodes=ALL Default=YES MaxTime=INFINITE State=UP
EOF
}

log_tails() {
  for f in "$dir"/log/*.log; do
    if [ -f "$f" ]; then echo "== $f"; tail -n 20 "$f"; fi
  done >&2
}

fail() {  # $1: what went wrong; stops what did start
  echo "slurm.sh: $1" >&2
  log_tails
  stop
  exit 1
}

start() {
  write_config
  # --force: munged wants every dir above its socket open to all (pytest's tmp dirs are not);
  # only root uses this SLURM, so that check is left a warning.
  munged --key-file="$dir/munge.key" --socket="$dir/run/munge.socket" --pid-file="$dir/run/munged.pid" \
         --log-file="$dir/log/munged.log" --seed-file="$dir/run/munged.seed" --force \
    || fail "munged did not start"
  slurmctld || fail "slurmctld did not start"
  slurmd || fail "slurmd did not start"
  local deadline=$((SECONDS + WAIT_S))
  until [ "$(timeout 2 sinfo -h -N -o %t 2>/dev/null)" = idle ]; do   # sinfo alone retries for long
    [ $SECONDS -lt $deadline ] \
      || fail "the node is not idle after ${WAIT_S}s: $(timeout 2 sinfo -h -N -o '%t %E' 2>&1)"
    sleep 0.5
  done
  echo "export SLURM_CONF=$SLURM_CONF"
}

running() {  # $1: a pid; an exited daemon may stay a zombie until init reaps it
  [[ "$(ps -o stat= -p "$1")" =~ ^[^Z] ]]
}

stop_daemon() {  # $1: its pid file
  local pid
  [ -f "$1" ] && pid=$(cat "$1") || return 0
  kill "$pid" 2>/dev/null || return 0
  for _ in $(seq $((WAIT_S * 10))); do running "$pid" || return 0; sleep 0.1; done
  echo "slurm.sh: pid $pid ($1) did not exit after SIGTERM in ${WAIT_S}s: SIGKILL" >&2
  kill -9 "$pid" 2>/dev/null || true
}

cancel_jobs() {  # jobs still running would outlive slurmd (their slurmstepd)
  local ctld=$dir/run/slurmctld.pid deadline=$((SECONDS + WAIT_S))
  [ -f "$ctld" ] && running "$(cat "$ctld")" || return 0
  timeout 10 scancel --partition=local || true
  while [ -n "$(timeout 2 squeue -h -t RUNNING,COMPLETING 2>&1)" ] && [ $SECONDS -lt $deadline ]; do
    sleep 0.5
  done
}

stop() {
  cancel_jobs
  for ((i = ${#DAEMONS[@]} - 1; i >= 0; i--)); do stop_daemon "$dir/run/${DAEMONS[i]}.pid"; done
}

case $action in
  start) start ;;
  stop) stop ;;
  *) echo "$usage" >&2; exit 2 ;;
esac
