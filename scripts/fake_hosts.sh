#!/usr/bin/env bash
# Several "hosts" on one machine, to try multi-node runs without a cluster: each host is a Linux network namespace
# with its own interface (eth0), address and host name, all joined by one bridge; the file system stays shared, as
# a cluster's shared file system is. Needs root (and installs iproute2 where `ip` is missing).
#
#   bash scripts/fake_hosts.sh up 2          # nanoexp-host0 at 10.213.0.1, nanoexp-host1 at 10.213.0.2
#   bash scripts/fake_hosts.sh run 1 hostname            # a command "on" host 1: its network, its host name
#   bash scripts/fake_hosts.sh run 0 torchrun --nnodes=2 --node_rank=0 ... train.py ...
#   bash scripts/fake_hosts.sh status
#   bash scripts/fake_hosts.sh down          # removes everything `up` made (namespaces, links, /etc/hosts lines)
#
# Traffic goes only to the addresses this script assigns (10.213.0.1 ... 10.213.0.N) and to each host's own
# loopback. Host names resolve through tagged lines in /etc/hosts. `up` is idempotent; `down` leaves nothing.
set -euo pipefail

PREFIX=nanoexp-host          # namespace k is also host k's name
BRIDGE=nxhostbr0
NET=10.213.0                 # host k is $NET.$((k + 1))/24
TAG="# nanoexp-fake-hosts"
MAX_HOSTS=16

die() { echo "fake_hosts.sh: $*" >&2; exit 1; }

need_root() {
  [ "$(id -u)" -eq 0 ] || die "needs root (network namespaces, links and /etc/hosts)"
  if ! command -v ip > /dev/null; then
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq iproute2 > /dev/null
  fi
}

hosts() {   # the namespaces this script made, in order
  ip netns list 2> /dev/null | awk '{print $1}' | grep -E "^${PREFIX}[0-9]+$" | sort -V || true
}

up() {
  local n=${1:-2}
  [[ "$n" =~ ^[0-9]+$ ]] && [ "$n" -ge 1 ] && [ "$n" -le "$MAX_HOSTS" ] || die "up N: N must be 1..$MAX_HOSTS"
  need_root
  ip link show "$BRIDGE" > /dev/null 2>&1 || ip link add "$BRIDGE" type bridge
  ip link set "$BRIDGE" up
  sed -i "/$TAG\$/d" /etc/hosts
  for k in $(seq 0 $((n - 1))); do
    local ns="$PREFIX$k" outer="nxh$k" inner="nxh${k}p"
    ip netns list | awk '{print $1}' | grep -qx "$ns" || ip netns add "$ns"
    if ! ip -n "$ns" link show eth0 > /dev/null 2>&1; then
      ip link del "$outer" 2> /dev/null || true
      ip link add "$outer" type veth peer name "$inner"
      ip link set "$inner" netns "$ns"
      ip -n "$ns" link set "$inner" name eth0
      ip -n "$ns" addr add "$NET.$((k + 1))/24" dev eth0
    fi
    ip link set "$outer" master "$BRIDGE" up
    ip -n "$ns" link set lo up
    ip -n "$ns" link set eth0 up
    echo "$NET.$((k + 1)) $ns $TAG" >> /etc/hosts
  done
  for extra in $(hosts); do   # hosts beyond N from an earlier, larger `up`
    [ "${extra#"$PREFIX"}" -lt "$n" ] || remove_host "$extra"
  done
  status
}

remove_host() {
  local ns=$1
  for pid in $(ip netns pids "$ns" 2> /dev/null); do kill -9 "$pid" 2> /dev/null || true; done
  ip netns del "$ns" 2> /dev/null || true
  ip link del "nxh${ns#"$PREFIX"}" 2> /dev/null || true
  sed -i "/ $ns $TAG\$/d" /etc/hosts
}

down() {
  need_root
  for ns in $(hosts); do remove_host "$ns"; done
  for link in $(ip -o link show 2> /dev/null | awk -F': ' '{print $2}' | cut -d@ -f1 | grep -E '^nxh[0-9]+$'); do
    ip link del "$link" 2> /dev/null || true
  done
  ip link del "$BRIDGE" 2> /dev/null || true
  sed -i "/$TAG\$/d" /etc/hosts
}

run() {   # run K COMMAND...: COMMAND in host K's network namespace, with host K's name (a UTS namespace of its own)
  local k=${1:?run K COMMAND...}
  shift
  local ns="$PREFIX$k"
  ip netns list | awk '{print $1}' | grep -qx "$ns" || die "no host $k: run 'bash scripts/fake_hosts.sh up N' first"
  # nsenter rather than `ip netns exec`, which remounts /sys and so hides the cgroups that slurmd needs.
  exec nsenter --net="/run/netns/$ns" unshare --uts -- sh -c 'hostname "$0" && exec "$@"' "$ns" "$@"
}

status() {
  local found=0
  for ns in $(hosts); do
    found=1
    echo "$ns $(ip -n "$ns" -4 -o addr show dev eth0 2> /dev/null | awk '{print $4}') eth0"
  done
  [ "$found" -eq 1 ] || echo "no fake hosts"
}

case "${1:-}" in
  up) up "${2:-2}" ;;
  down) down ;;
  run) shift; run "$@" ;;
  status) status ;;
  *) die "usage: fake_hosts.sh up N | run K COMMAND... | status | down" ;;
esac
