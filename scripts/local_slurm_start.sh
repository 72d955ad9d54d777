#!/usr/bin/env bash
# local_slurm_start.sh - a real single-node SLURM cluster on this machine, for nanoexp's SLURM tests (.ci/run
# starts it before pytest; the tests themselves never start it) and for trying
# `python train.py -m hydra/launcher=slurm ...` without a cluster. Debian/Ubuntu, run as root, no systemd needed.
#
# Promise: when it exits 0, `sinfo` shows this machine's node idle in partition $NANOEXP_SLURM_PARTITION
# and `sacct` works (submitit needs accounting to notice a job killed from outside). It is idempotent:
# packages, configs and daemons that are already there are kept. Every daemon it starts has its PID
# written to $NANOEXP_SLURM_DIR/ours/<daemon>; scripts/local_slurm_stop.sh stops those and nothing else.
#
# Settings chosen for tests (each measured on a 2-core machine):
#   SchedulerParameters=batch_sched_delay=0  new jobs start at once (a submitit round trip 3.2 s -> 1.1 s)
#   EnforcePartLimits=ALL                    impossible requests fail at submission instead of pending
#   KillWait=5                               a cancelled job that ignores SIGTERM is killed after 5 s
#   AuthInfo=cred_expire=10                  a requeued job may start again after 10 s (default 120 s)
#   sched_interval=2,bf_interval=2           ...and is started within 2 s of that (default passes: 60 s, 30 s)
#   CPUs=$NANOEXP_SLURM_CPUS (default 8)     more CPUs than cores, so 8-task jobs fit on a small machine
#
# Environment knobs: NANOEXP_SLURM_DIR (default /tmp/nanoexp-slurm), NANOEXP_SLURM_CPUS (8),
# NANOEXP_SLURM_PARTITION (debug), NANOEXP_SLURM_DB_PORT (3307, the private MariaDB on 127.0.0.1).
set -euo pipefail

DIR=${NANOEXP_SLURM_DIR:-/tmp/nanoexp-slurm}
CPUS=${NANOEXP_SLURM_CPUS:-8}
PARTITION=${NANOEXP_SLURM_PARTITION:-debug}
DB_PORT=${NANOEXP_SLURM_DB_PORT:-3307}
CLUSTER=nanoexp
OURS=$DIR/ours
LOGS=$DIR/log
TAG="# written by nanoexp scripts/local_slurm_start.sh"

say() { echo "[local_slurm_start] $*"; }
fail() { echo "[local_slurm_start] error: $*" >&2; exit 1; }
[ "$(id -u)" = 0 ] || fail "run as root (it installs packages and starts daemons)"
started_at=$SECONDS

# running NAME PID: PID is a live (non-zombie) process whose command is NAME.
running() {
  [ -n "${2:-}" ] && [ "$(cat "/proc/$2/comm" 2>/dev/null)" = "$1" ] \
    && ! grep -q '^State:[[:space:]]*Z' "/proc/$2/status" 2>/dev/null
}
pidfile_pid() { [ -s "$1" ] && tr -dc '0-9' <"$1" || true; }
port_in_use() { (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }
# until_true SECONDS COMMAND...: poll every 0.2 s; fails when the time is up.
until_true() {
  local deadline=$((SECONDS + $1)); shift
  until "$@" >/dev/null 2>&1; do
    [ "$SECONDS" -lt "$deadline" ] || return 1
    sleep 0.2
  done
}
record() { echo "$2" >"$OURS/$1"; say "started $1 (pid $2)"; }
# install_config DEST MODE < content: replace DEST when the content differs (keeping a copy of a file
# this script did not write); returns 0 when it changed.
install_config() {
  local new; new=$(mktemp)
  cat >"$new"
  if cmp -s "$new" "$1"; then rm -f "$new"; return 1; fi
  if [ -f "$1" ] && ! grep -qF "$TAG" "$1"; then cp -p "$1" "$1.before-nanoexp"; say "kept a copy of $1"; fi
  install -m "$2" "$new" "$1"; rm -f "$new"
}

# 1. Packages (about 10 s the first time).
needed=()
for package in munge slurmctld slurmd slurm-client slurmdbd mariadb-server; do
  dpkg-query -W -f='${Status}' "$package" 2>/dev/null | grep -q "install ok installed" || needed+=("$package")
done
if [ ${#needed[@]} -gt 0 ]; then
  command -v apt-get >/dev/null || fail "apt-get not found: install Slurm, munge and MariaDB by hand"
  say "installing ${needed[*]}"
  export DEBIAN_FRONTEND=noninteractive
  { apt-get update -q && apt-get install -y -q --no-install-recommends "${needed[@]}"; } >"$DIR.apt.log" 2>&1 \
    || { tail -20 "$DIR.apt.log"; fail "package installation failed (log: $DIR.apt.log)"; }
fi
mkdir -p "$OURS" "$LOGS" "$DIR/state" "$DIR/spool" /etc/slurm

# 2. munge: the authentication every Slurm daemon and client uses.
if [ ! -s /etc/munge/munge.key ]; then
  install -d -o munge -g munge -m 0700 /etc/munge
  mungekey --create --keyfile=/etc/munge/munge.key
fi
chown munge:munge /etc/munge/munge.key && chmod 0600 /etc/munge/munge.key
install -d -o munge -g munge -m 0755 /run/munge
install -d -o munge -g munge -m 0700 /var/lib/munge /var/log/munge
if ! { munge -n | unmunge; } >/dev/null 2>&1; then
  runuser -u munge -- /usr/sbin/munged --pid-file=/run/munge/munged.pid
  until_true 10 sh -c "munge -n | unmunge" || fail "munged did not start (/var/log/munge/munged.log)"
  record munged "$(pidfile_pid /run/munge/munged.pid)"
fi

# 3. Configuration: one node (this machine) in one partition, accounting through slurmdbd.
node=$(hostname -s)
memory_mb=$(slurmd -C | sed -n 's/.*RealMemory=\([0-9]*\).*/\1/p')
changed=0
install_config /etc/slurm/slurm.conf 0644 <<EOF && changed=1
$TAG
ClusterName=$CLUSTER
SlurmctldHost=$node(127.0.0.1)
SlurmUser=root
AuthType=auth/munge
AuthInfo=cred_expire=10
CredType=cred/munge
MpiDefault=none
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/backfill
SchedulerParameters=batch_sched_delay=0,sched_interval=2,bf_interval=2
EnforcePartLimits=ALL
ReturnToService=2
SlurmdParameters=config_overrides
KillWait=5
MailProg=/bin/true
StateSaveLocation=$DIR/state
SlurmdSpoolDir=$DIR/spool
SlurmctldPidFile=$DIR/slurmctld.pid
SlurmdPidFile=$DIR/slurmd.pid
SlurmctldLogFile=$LOGS/slurmctld.log
SlurmdLogFile=$LOGS/slurmd.log
AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=localhost
JobAcctGatherType=jobacct_gather/linux
JobCompType=jobcomp/none
NodeName=$node NodeAddr=127.0.0.1 CPUs=$CPUS Boards=1 SocketsPerBoard=1 CoresPerSocket=$CPUS ThreadsPerCore=1 RealMemory=$memory_mb State=UNKNOWN
PartitionName=$PARTITION Nodes=ALL Default=YES MaxTime=INFINITE State=UP
EOF
install_config /etc/slurm/slurmdbd.conf 0600 <<EOF && changed=1
$TAG
AuthType=auth/munge
DbdHost=localhost
SlurmUser=root
LogFile=$LOGS/slurmdbd.log
PidFile=$DIR/slurmdbd.pid
StorageType=accounting_storage/mysql
StorageHost=127.0.0.1
StoragePort=$DB_PORT
StorageUser=slurm
StoragePass=slurm
StorageLoc=slurm_acct_db
EOF
if [ -f /etc/slurm/gres.conf ] && ! grep -qF "$TAG" /etc/slurm/gres.conf; then   # our node declares no GRES
  mv /etc/slurm/gres.conf /etc/slurm/gres.conf.before-nanoexp; changed=1
fi

# 4. Accounting: a private MariaDB (datadir under $DIR, TCP only on 127.0.0.1) and slurmdbd.
db_run=$DIR/mysql-run   # socket and pid file, writable by the mysql user
db_socket=$db_run/mysqld.sock
if [ ! -d "$DIR/mysql/mysql" ]; then
  install -d -o mysql -g mysql -m 0750 "$DIR/mysql"
  mariadb-install-db --no-defaults --user=mysql --datadir="$DIR/mysql" --skip-test-db \
    >"$LOGS/mariadb-install.log" 2>&1 || fail "mariadb-install-db failed ($LOGS/mariadb-install.log)"
fi
install -d -o mysql -g mysql -m 0755 "$db_run"
if ! running mariadbd "$(pidfile_pid "$db_run/mariadbd.pid")"; then
  port_in_use "$DB_PORT" && fail "port $DB_PORT is taken: set NANOEXP_SLURM_DB_PORT"
  setsid /usr/sbin/mariadbd --no-defaults --user=mysql --datadir="$DIR/mysql" --socket="$db_socket" \
    --pid-file="$db_run/mariadbd.pid" --port="$DB_PORT" --bind-address=127.0.0.1 --log-error="$LOGS/mariadb.log" \
    </dev/null >/dev/null 2>&1 &
  until_true 60 mariadb-admin --socket="$db_socket" ping || fail "mariadbd did not start ($LOGS/mariadb.log)"
  until_true 10 test -s "$db_run/mariadbd.pid"
  record mariadbd "$(pidfile_pid "$db_run/mariadbd.pid")"
fi
mariadb --socket="$db_socket" -e "CREATE DATABASE IF NOT EXISTS slurm_acct_db;
  CREATE USER IF NOT EXISTS 'slurm'@'127.0.0.1' IDENTIFIED BY 'slurm';
  GRANT ALL ON slurm_acct_db.* TO 'slurm'@'127.0.0.1';" || fail "could not create the accounting database"
if ! running slurmdbd "$(pidfile_pid "$DIR/slurmdbd.pid")"; then
  port_in_use 6819 && fail "port 6819 is taken by a slurmdbd this script did not start"
  slurmdbd
  until_true 30 port_in_use 6819 || fail "slurmdbd did not start ($LOGS/slurmdbd.log)"
  record slurmdbd "$(pidfile_pid "$DIR/slurmdbd.pid")"
fi

# 5. The controller and the node daemon (restarted when the configuration changed).
for daemon in slurmd slurmctld; do
  pid=$(pidfile_pid "$DIR/$daemon.pid")
  if [ "$changed" = 1 ] && running "$daemon" "$pid"; then
    [ -f "$OURS/$daemon" ] || fail "$daemon (pid $pid) was not started by this script: stop it first"
    say "configuration changed: restarting $daemon"
    kill "$pid"; until_true 30 sh -c "! kill -0 $pid" || fail "$daemon did not stop"
  fi
done
for daemon in slurmctld slurmd; do
  running "$daemon" "$(pidfile_pid "$DIR/$daemon.pid")" && continue
  "$daemon"
  until_true 20 test -s "$DIR/$daemon.pid" || fail "$daemon did not start ($LOGS/$daemon.log)"
  record "$daemon" "$(pidfile_pid "$DIR/$daemon.pid")"
done

# 6. Ready when the node is idle and the cluster is known to the accounting database.
deadline=$((SECONDS + 90))
until sinfo -h -n "$node" -o %T 2>/dev/null | grep -qE '^(idle|mixed|allocated)'; do
  if sinfo -h -n "$node" -o %T 2>/dev/null | grep -qE '^(down|drain|fail|inval)'; then
    scontrol update nodename="$node" state=resume 2>/dev/null || true
  fi
  [ "$SECONDS" -lt "$deadline" ] || { sinfo; tail -5 "$LOGS"/slurm*.log; fail "node $node not idle after 90 s"; }
  sleep 0.3
done
until_true 30 sh -c "sacctmgr -n -P show cluster format=cluster | grep -qx $CLUSTER" \
  || fail "cluster $CLUSTER is not registered in slurmdbd ($LOGS/slurmdbd.log)"
say "ready in $((SECONDS - started_at)) s: node $node, $CPUS CPUs, partition $PARTITION, accounting on"
