#!/usr/bin/env bash
# ci/netns_cluster.sh: an emulated multi-node cluster on one Linux machine (root needed).
#
#   ci/netns_cluster.sh up N RATE DELAY   N "nodes": network namespaces hvdc0..hvdc{N-1}, node i at
#                                         10.77.0.{i+1}/24 (eth0, loopback up), all plugged into one
#                                         bridge that lives in its own namespace (hvdcbr)
#   ci/netns_cluster.sh run RANK CMD...   run CMD inside node RANK's namespace (`ip netns exec`, plus
#                                         hostname hvdcRANK in a UTS namespace when unshare exists)
#   ci/netns_cluster.sh ssh HOST CMD...   ssh stand-in for launchers: HOST is 10.77.0.{i+1} or hvdc{i};
#                                         runs CMD (one shell string, as ssh does) in that namespace
#   ci/netns_cluster.sh status            namespaces, addresses and qdiscs
#   ci/netns_cluster.sh down              remove everything `up` created (idempotent)
#
# Every link is shaped in both directions with netem: the node's eth0 egress gets
# `rate RATE delay DELAY`, the bridge's port toward the node `rate RATE`; so each node has a
# full-duplex RATE link and the one-way latency between two nodes is DELAY. Kernels without
# netem (CONFIG_NET_SCH_NETEM unset) get tbf at RATE instead, and no added delay (with a warning).
# Example: ci/netns_cluster.sh up 2 1gbit 0.1ms
#
# Nothing is created in the root namespace: the veth pairs are made directly inside the bridge
# namespace and the node namespaces, so the machine's own interfaces and routes are never
# touched and traffic between nodes cannot leave the namespaces. `down` deletes the
# namespaces, which deletes their interfaces and qdiscs; a failing `up` calls `down` itself.
# Env: HVDC_PREFIX (default hvdc) names the namespaces, so two clusters can coexist.
set -euo pipefail

P="${HVDC_PREFIX:-hvdc}"
BR="${P}br"
SUBNET=10.77.0

die() { echo "netns_cluster: $*" >&2; exit 1; }
nodes() { ip netns list 2>/dev/null | awk '{print $1}' | grep -E "^${P}[0-9]+$" | sort -V || true; }

down() {
  local ns
  for ns in $(nodes) "$BR"; do
    ip netns del "$ns" 2>/dev/null || true
  done
}

up() {
  [[ $# -eq 3 ]] || die "usage: up N RATE DELAY   (e.g. up 2 1gbit 0.1ms)"
  local n="$1" rate="$2" delay="$3" i ns
  [[ "$n" =~ ^[0-9]+$ && "$n" -ge 1 && "$n" -le 250 ]] || die "N must be 1..250, got '$n'"
  [[ "$(id -u)" == 0 ]] || die "needs root (ip netns, tc)"
  command -v ip >/dev/null && command -v tc >/dev/null || die "needs ip and tc (apt-get install iproute2)"
  [[ -z "$(nodes)" ]] && ! ip netns list | awk '{print $1}' | grep -qx "$BR" \
    || die "a cluster with prefix '$P' exists; run '$0 down' first"
  trap 'rc=$?; [[ $rc -ne 0 ]] && { echo "netns_cluster: up failed, removing what it created" >&2; down; }; exit $rc' EXIT

  ip netns add "$BR"
  ip -n "$BR" link set lo up
  ip -n "$BR" link add br0 type bridge
  ip -n "$BR" link set br0 up
  for ((i = 0; i < n; i++)); do
    ns="$P$i"
    ip netns add "$ns"
    ip -n "$ns" link set lo up
    ip -n "$BR" link add "v$i" type veth peer name eth0 netns "$ns"
    ip -n "$BR" link set "v$i" master br0
    ip -n "$BR" link set "v$i" up
    ip -n "$ns" addr add "$SUBNET.$((i + 1))/24" dev eth0
    ip -n "$ns" link set eth0 up
    shape "$ns" eth0 "$rate" "$delay"
    shape "$BR" "v$i" "$rate" 0ms
  done
  trap - EXIT
  echo "netns_cluster: $n nodes up (${P}0..${P}$((n - 1)) = $SUBNET.1..$SUBNET.$n), rate $rate, one-way delay $delay${NO_NETEM:+ NOT emulated (no netem: shaped with tbf, rate only)}"
}

# shape NS DEV RATE DELAY: netem (rate + delay) where the kernel has it (CONFIG_NET_SCH_NETEM),
# else tbf (rate only; the delay is then not emulated and `up` says so).
NO_NETEM=
shape() {
  local ns="$1" dev="$2" rate="$3" delay="$4"
  # netem limit: packets; far above the bandwidth-delay product, so it never tail-drops
  if [[ -z "$NO_NETEM" ]] && tc -n "$ns" qdisc add dev "$dev" root netem rate "$rate" delay "$delay" limit 100000 2>/dev/null; then
    return
  fi
  if [[ -z "$NO_NETEM" ]]; then
    NO_NETEM=1
    echo "netns_cluster: warning: this kernel has no netem qdisc; shaping with tbf, delay $delay is not emulated" >&2
  fi
  # burst 256 KB (~2 ms at 1 Gbit/s) lets a GSO burst through; 64 MB of queue, no drops
  tc -n "$ns" qdisc add dev "$dev" root tbf rate "$rate" burst 256kb limit 64mb
}

ns_of() {  # RANK | hvdcRANK | 10.77.0.(RANK+1) -> namespace name
  local h="$1"
  h="${h#*@}"  # user@host
  if [[ "$h" =~ ^[0-9]+$ ]]; then echo "$P$h"
  elif [[ "$h" =~ ^${P}[0-9]+$ ]]; then echo "$h"
  elif [[ "$h" =~ ^${SUBNET//./\\.}\.([0-9]+)$ ]]; then echo "$P$((BASH_REMATCH[1] - 1))"
  else die "unknown node '$1' (want RANK, ${P}RANK or $SUBNET.(RANK+1))"
  fi
}

# in_ns NS CMD...: CMD in NS's network namespace and, with unshare (util-linux), in its own UTS
# namespace with hostname NS: Open MPI takes ranks on one hostname for one node (shared memory)
# and fails ("Socket closed") when they are in different network namespaces.
in_ns() {
  local ns="$1"; shift
  if command -v unshare >/dev/null; then
    exec ip netns exec "$ns" unshare --uts /bin/sh -c 'hostname "$0" && exec "$@"' "$ns" "$@"
  fi
  exec ip netns exec "$ns" "$@"
}

cmd="${1:-}"; shift || true
case "$cmd" in
  up) up "$@" ;;
  down) down; echo "netns_cluster: down" ;;
  run)
    [[ $# -ge 2 ]] || die "usage: run RANK CMD..."
    ns="$(ns_of "$1")"; shift
    in_ns "$ns" "$@" ;;
  ssh)
    # Called by launchers as `AGENT [ssh options] HOST CMD...`; skip options like ssh does.
    while [[ $# -gt 0 && "$1" == -* ]]; do
      case "$1" in -[bcDEeFIiJLlmOopQRSWw]) shift 2 ;; *) shift ;; esac
    done
    [[ $# -ge 1 ]] || die "usage: ssh HOST CMD..."
    ns="$(ns_of "$1")"; shift
    in_ns "$ns" /bin/sh -c "$*" ;;
  status)
    for ns in $(nodes); do
      echo "== $ns: $(ip -n "$ns" -4 -o addr show dev eth0 2>/dev/null | awk '{print $4}')"
      tc -n "$ns" qdisc show dev eth0
    done
    if ip netns list | awk '{print $1}' | grep -qx "$BR"; then
      echo "== $BR (bridge ports)"; tc -n "$BR" qdisc show | grep -E "netem|tbf" || true
    else
      echo "no cluster (prefix $P)"
    fi ;;
  *) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; [[ -z "$cmd" || "$cmd" == -h || "$cmd" == --help || "$cmd" == help ]] ;;
esac
