#!/usr/bin/env bash
# stop_local_slurm.sh -- stop the test cluster that start_local_slurm.sh (beside this file) started.
#
# Cancels the jobs still queued (by job id, so no slurmstepd outlives its slurmd), then stops
# each slurmd and the slurmctld named by the pid files that /etc/slurm/slurm.conf names: those
# of the cluster running now, even one started by an older copy of the start script with other
# paths. A process is signalled only when its pid file's pid still runs that daemon (never by
# name): TERM, then KILL after 10 s. munged is stopped too when the start script started it
# (its pid file under SLURM_LOCAL_BASE), unless --keep-munge is given (the start script's
# restart with a new configuration keeps it).
# Environment: SLURM_LOCAL_BASE (default /tmp/local-slurm), as for the start script.
# Needs root (the daemons run as root); run as another user it re-executes itself with sudo -E.
set -uo pipefail
[ "$(id -u)" -eq 0 ] || exec sudo -E "$0" "$@"
BASE=${SLURM_LOCAL_BASE:-/tmp/local-slurm}
CONF=/etc/slurm/slurm.conf
say() { echo "[stop_local_slurm] $*" >&2; }

# a zombie is as good as gone (some container inits reap late)
running() { local st; st=$(awk '{print $3}' "/proc/$1/stat" 2>/dev/null) && [ -n "$st" ] && [ "$st" != Z ]; }

stop_pidfile() {  # PIDFILE DAEMON
  [ -s "$1" ] || return 0
  local pid; pid=$(tr -dc 0-9 <"$1")
  if [ -n "$pid" ] && running "$pid" && [ "$(cat "/proc/$pid/comm" 2>/dev/null)" = "$2" ]; then
    kill -TERM "$pid" 2>/dev/null
    for _ in $(seq 100); do running "$pid" || break; sleep 0.1; done
    if running "$pid"; then say "$2 (pid $pid) ignored SIGTERM for 10 s: SIGKILL"; kill -KILL "$pid" 2>/dev/null; fi
    say "stopped $2 (pid $pid)"
  fi
  rm -f "$1"
}

conf_value() { sed -n "s/^$1=\([^[:space:]#]*\).*/\1/p" "$CONF" | tail -n 1; }

if [ -f "$CONF" ]; then
  if scontrol ping >/dev/null 2>&1; then
    jobs=$(squeue -h -o %A 2>/dev/null | sort -u | xargs)
    if [ -n "$jobs" ]; then
      say "cancelling jobs $jobs"
      # shellcheck disable=SC2086  # one word per job id
      scancel $jobs
      for _ in $(seq 50); do [ -z "$(squeue -h -o %A 2>/dev/null)" ] && break; sleep 0.2; done
    fi
  fi
  slurmd_pids=$(conf_value SlurmdPidFile)
  for node in $(sed -n 's/^NodeName=\([^[:space:]]*\).*/\1/p' "$CONF"); do
    [ -n "$slurmd_pids" ] && stop_pidfile "${slurmd_pids//%n/$node}" slurmd
  done
  ctld_pid=$(conf_value SlurmctldPidFile)
  [ -n "$ctld_pid" ] && stop_pidfile "$ctld_pid" slurmctld
fi
[ "${1:-}" = --keep-munge ] || stop_pidfile "$BASE/run/munge/munged.pid" munged
exit 0
