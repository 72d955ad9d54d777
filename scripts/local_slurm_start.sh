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
#
# Several nodes: NANOEXP_SLURM_HOSTS=N makes a second, separate cluster ("nanoexp-hosts") whose nodes are the fake
# hosts of scripts/fake_hosts.sh (brought up here): one slurmd per host, in the host's network and under its name;
# the controller, slurmdbd and MariaDB on host 0, the head node (traffic stays on the hosts' own addresses and
# loopbacks). Its files live in /tmp/nanoexp-slurm-hosts, its configuration in etc/ there; clients run on host 0:
#   SLURM_CONF=/tmp/nanoexp-slurm-hosts/etc/slurm.conf bash scripts/fake_hosts.sh run 0 sinfo
set -euo pipefail

HOSTS=${NANOEXP_SLURM_HOSTS:-0}
FAKE_HOSTS="$(dirname "$0")/fake_hosts.sh"
if [ "$HOSTS" -gt 0 ]; then
  DIR=${NANOEXP_SLURM_DIR:-/tmp/nanoexp-slurm-hosts}
  CLUSTER=nanoexp-hosts
  CONF_DIR=$DIR/etc
  ON_HEAD=(bash "$FAKE_HOSTS" run 0)   # runs a command on the head node
else
  DIR=${NANOEXP_SLURM_DIR:-/tmp/nanoexp-slurm}
  CLUSTER=nanoexp
  CONF_DIR=/etc/slurm
  ON_HEAD=()
fi
export SLURM_CONF=$CONF_DIR/slurm.conf   # slurmdbd.conf is read from the same folder
CPUS=${NANOEXP_SLURM_CPUS:-8}
PARTITION=${NANOEXP_SLURM_PARTITION:-debug}
DB_PORT=${NANOEXP_SLURM_DB_PORT:-3307}
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
port_in_use() { "${ON_HEAD[@]}" bash -c '(exec 3<>"/dev/tcp/127.0.0.1/$0")' "$1" 2>/dev/null; }   # on the head
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
mkdir -p "$OURS" "$LOGS" "$DIR/state" "$DIR/spool" "$CONF_DIR"
if [ "$HOSTS" -gt 0 ]; then
  bash "$FAKE_HOSTS" up "$HOSTS" >/dev/null || fail "scripts/fake_hosts.sh up $HOSTS failed"
fi

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

# 3. Configuration: this machine as one node, or each fake host as a node sharing its memory, in one partition;
# accounting through slurmdbd.
memory_mb=$(slurmd -C | sed -n 's/.*RealMemory=\([0-9]*\).*/\1/p')
node_line() {
  echo "NodeName=$1 NodeAddr=$2 CPUs=$CPUS Boards=1 SocketsPerBoard=1 CoresPerSocket=$CPUS ThreadsPerCore=1" \
    "RealMemory=$((memory_mb / (HOSTS > 0 ? HOSTS : 1))) State=UNKNOWN"
}
if [ "$HOSTS" -gt 0 ]; then
  nodes=(); for k in $(seq 0 $((HOSTS - 1))); do nodes+=("nanoexp-host$k"); done
  address() { getent hosts "$1" | awk '{print $1}'; }   # fake_hosts.sh's /etc/hosts lines
  head_node="${nodes[0]}($(address "${nodes[0]}"))"
  node_lines=$(for node in "${nodes[@]}"; do node_line "$node" "$(address "$node")"; done)
  # The controller pings nodes every SlurmdTimeout/3: a host cut off for a moment (tests/test_multihost.py's
  # partition) shows "idle*" until the next ping, 100 s by default, 20 s with this.
  slurmd_timeout=60
else
  nodes=("$(hostname -s)")
  head_node="${nodes[0]}(127.0.0.1)"
  node_lines=$(node_line "${nodes[0]}" 127.0.0.1)
  slurmd_timeout=300   # Slurm's default
fi
changed=0
install_config "$SLURM_CONF" 0644 <<EOF && changed=1
$TAG
ClusterName=$CLUSTER
SlurmctldHost=$head_node
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
SlurmdTimeout=$slurmd_timeout
MailProg=/bin/true
StateSaveLocation=$DIR/state
SlurmdSpoolDir=$DIR/spool/%n
SlurmctldPidFile=$DIR/slurmctld.pid
SlurmdPidFile=$DIR/slurmd-%n.pid
SlurmctldLogFile=$LOGS/slurmctld.log
SlurmdLogFile=$LOGS/slurmd-%n.log
AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=localhost
JobAcctGatherType=jobacct_gather/linux
JobCompType=jobcomp/none
$node_lines
PartitionName=$PARTITION Nodes=ALL Default=YES MaxTime=INFINITE State=UP
EOF
install_config "$CONF_DIR/slurmdbd.conf" 0600 <<EOF && changed=1
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
if [ -f "$CONF_DIR/gres.conf" ] && ! grep -qF "$TAG" "$CONF_DIR/gres.conf"; then   # our nodes declare no GRES
  mv "$CONF_DIR/gres.conf" "$CONF_DIR/gres.conf.before-nanoexp"; changed=1
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
  setsid "${ON_HEAD[@]}" /usr/sbin/mariadbd --no-defaults --user=mysql --datadir="$DIR/mysql" --socket="$db_socket" \
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
  "${ON_HEAD[@]}" slurmdbd
  until_true 30 port_in_use 6819 || fail "slurmdbd did not start ($LOGS/slurmdbd.log)"
  record slurmdbd "$(pidfile_pid "$DIR/slurmdbd.pid")"
fi

# 5. The controller and the node daemons (restarted when the configuration changed). "slurmd-<node>" is the
# slurmd of <node>, started on it (with fake hosts: in that host's network and under its name).
daemons=(slurmctld); for node in "${nodes[@]}"; do daemons+=("slurmd-$node"); done
on_node() { if [ "$HOSTS" -gt 0 ]; then bash "$FAKE_HOSTS" run "${1#nanoexp-host}" "${@:2}"; else "${@:2}"; fi; }
for daemon in slurmd "${daemons[@]}"; do   # "slurmd": the one node's daemon as earlier versions named it
  pid=$(pidfile_pid "$DIR/$daemon.pid")
  if [ "$changed" = 1 ] && running "${daemon%%-*}" "$pid"; then
    [ -f "$OURS/$daemon" ] || fail "$daemon (pid $pid) was not started by this script: stop it first"
    say "configuration changed: restarting $daemon"
    kill "$pid"; until_true 30 sh -c "! kill -0 $pid" || fail "$daemon did not stop"
    rm -f "$OURS/$daemon"
  fi
done
for daemon in "${daemons[@]}"; do
  running "${daemon%%-*}" "$(pidfile_pid "$DIR/$daemon.pid")" && continue
  if [ "$daemon" = slurmctld ]; then
    "${ON_HEAD[@]}" slurmctld
  else
    mkdir -p "$DIR/spool/${daemon#slurmd-}"
    on_node "${daemon#slurmd-}" slurmd
  fi
  until_true 20 test -s "$DIR/$daemon.pid" || fail "$daemon did not start ($LOGS/$daemon.log)"
  record "$daemon" "$(pidfile_pid "$DIR/$daemon.pid")"
done

# 6. Ready when every node is idle and the cluster is known to the accounting database.
deadline=$((SECONDS + 90))
node_state() { "${ON_HEAD[@]}" sinfo -h -n "$1" -o %T 2>/dev/null; }
for node in "${nodes[@]}"; do
  until node_state "$node" | grep -qE '^(idle|mixed|allocated)'; do
    if node_state "$node" | grep -qE '^(down|drain|fail|inval)'; then
      "${ON_HEAD[@]}" scontrol update nodename="$node" state=resume 2>/dev/null || true
    fi
    if [ "$SECONDS" -ge "$deadline" ]; then
      "${ON_HEAD[@]}" sinfo; tail -5 "$LOGS"/slurm*.log; fail "node $node not idle after 90 s"
    fi
    sleep 0.3
  done
done
until_true 30 sh -c "${ON_HEAD[*]} sacctmgr -n -P show cluster format=cluster | grep -qx $CLUSTER" \
  || fail "cluster $CLUSTER is not registered in slurmdbd ($LOGS/slurmdbd.log)"
say "ready in $((SECONDS - started_at)) s: node(s) ${nodes[*]}, $CPUS CPUs each, partition $PARTITION, accounting on"
[ "$HOSTS" -eq 0 ] || say "clients run on host 0: SLURM_CONF=$SLURM_CONF bash $FAKE_HOSTS run 0 sinfo"
