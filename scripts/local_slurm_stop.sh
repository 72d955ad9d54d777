#!/usr/bin/env bash
# local_slurm_stop.sh - stop the daemons scripts/local_slurm_start.sh started, and nothing else.
#
# Reads $NANOEXP_SLURM_DIR/ours/<daemon> (the PIDs the start script recorded), cancels the jobs still
# in the queue while our controller is up (so no job step outlives its slurmd), then stops the daemons
# in reverse start order: SIGTERM, and SIGKILL after 30 s. A PID that now belongs to another program is
# only forgotten. Packages, configuration, the munge key and the accounting database stay.
set -uo pipefail

# NANOEXP_SLURM_HOSTS=N: the fake hosts' cluster (see local_slurm_start.sh), whose clients run on host 0.
if [ "${NANOEXP_SLURM_HOSTS:-0}" -gt 0 ]; then
  DIR=${NANOEXP_SLURM_DIR:-/tmp/nanoexp-slurm-hosts}
  export SLURM_CONF=$DIR/etc/slurm.conf
  ON_HEAD=(bash "$(dirname "$0")/fake_hosts.sh" run 0)
else
  DIR=${NANOEXP_SLURM_DIR:-/tmp/nanoexp-slurm}
  ON_HEAD=()
fi
OURS=$DIR/ours
say() { echo "[local_slurm_stop] $*"; }
[ "$(id -u)" = 0 ] || { echo "[local_slurm_stop] error: run as root" >&2; exit 1; }
[ -d "$OURS" ] || { say "nothing to stop"; exit 0; }

running() {
  [ -n "${2:-}" ] && [ "$(cat "/proc/$2/comm" 2>/dev/null)" = "$1" ] \
    && ! grep -q '^State:[[:space:]]*Z' "/proc/$2/status" 2>/dev/null
}
recorded() { [ -f "$OURS/$1" ] && tr -dc '0-9' <"$OURS/$1"; }

if running slurmctld "$(recorded slurmctld)"; then
  jobs=$("${ON_HEAD[@]}" squeue -h -o %A 2>/dev/null | tr '\n' ' ')
  if [ -n "${jobs// /}" ]; then
    say "cancelling jobs $jobs"
    "${ON_HEAD[@]}" scancel $jobs 2>/dev/null
    for _ in $(seq 100); do [ -z "$("${ON_HEAD[@]}" squeue -h -o %A 2>/dev/null)" ] && break; sleep 0.2; done   # KillWait=5
  fi
fi

status=0
slurmds=$(cd "$OURS" && ls -d slurmd-* 2>/dev/null || true)   # one per node: slurmd-<node>
for daemon in $slurmds slurmd slurmctld slurmdbd mariadbd munged; do
  [ -f "$OURS/$daemon" ] || continue
  pid=$(recorded "$daemon")
  if running "${daemon%%-*}" "$pid"; then
    kill -TERM "$pid"
    for _ in $(seq 150); do running "${daemon%%-*}" "$pid" || break; sleep 0.2; done
    running "${daemon%%-*}" "$pid" && { say "$daemon ignored SIGTERM for 30 s: SIGKILL"; kill -KILL "$pid"; sleep 0.5; }
  fi
  if running "${daemon%%-*}" "$pid"; then
    say "could not stop $daemon (pid $pid)"; status=1
  else
    say "stopped $daemon (pid ${pid:-?})"; rm -f "$OURS/$daemon"
  fi
done
exit $status
