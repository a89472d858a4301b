#!/usr/bin/env bash
# ci/run_multinode.sh: launch a training script on several hosts with horovodrun (Gloo) or mpirun,
# with the NCCL / Gloo / Open MPI network environment set for one interface. See ci/multinode.md.
#
#   ci/run_multinode.sh [options] -- SCRIPT [ARGS...]
#     --launcher horovodrun|mpirun   default horovodrun (always --gloo; see ci/multinode.md)
#     -np N                          total processes (default: sum of slots)
#     -H host1:8,host2:8             hosts and slots, or
#     --hostfile FILE                Open MPI hostfile ("host slots=8" lines, ci/hostfile.example)
#     --iface IFACE                  NIC for all traffic (default eth0): NCCL_SOCKET_IFNAME,
#                                    GLOO_SOCKET_IFNAME, HOROVOD_GLOO_IFACE, OMPI_MCA_btl/oob_tcp_if_include
#     --ib                           let NCCL use InfiniBand (default NCCL_IB_DISABLE=1: sockets on IFACE)
#     --python PATH                  interpreter on every host (default: this repo's .venv/bin/python)
#     --launcher-arg ARG             passed to the launcher (repeatable), e.g. --launcher-arg --prtemca ...
#     --dry-run                      print the command and exit
# Every host needs passwordless ssh from this one and the repo + .venv at this same path.
# Variables already set in the environment win over the defaults above (e.g. NCCL_DEBUG=INFO).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
LAUNCHER=horovodrun NP= HOSTS= HOSTFILE= IFACE=eth0 IB=0 DRY=0 PY="$ROOT/.venv/bin/python"
EXTRA=()
die() { echo "run_multinode: $*" >&2; exit 2; }
while [[ $# -gt 0 ]]; do
  case "$1" in
    --launcher) LAUNCHER="$2"; shift 2 ;;
    -np) NP="$2"; shift 2 ;;
    -H) HOSTS="$2"; shift 2 ;;
    --hostfile) HOSTFILE="$2"; shift 2 ;;
    --iface) IFACE="$2"; shift 2 ;;
    --ib) IB=1; shift ;;
    --python) PY="$2"; shift 2 ;;
    --launcher-arg) EXTRA+=("$2"); shift 2 ;;
    --dry-run) DRY=1; shift ;;
    --) shift; break ;;
    -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    *) die "unknown option $1 (script and its args go after --)" ;;
  esac
done
[[ $# -ge 1 ]] || die "no script (usage: $0 [options] -- SCRIPT [ARGS...])"
[[ -n "$HOSTS" || -n "$HOSTFILE" ]] || die "give -H host1:8,host2:8 or --hostfile FILE"
[[ -z "$HOSTS" || -z "$HOSTFILE" ]] || die "give -H or --hostfile, not both"
if [[ -z "$NP" ]]; then  # sum of slots
  if [[ -n "$HOSTS" ]]; then NP=$(tr ',' '\n' <<<"$HOSTS" | awk -F: '{n += ($2 == "" ? 1 : $2)} END {print n}')
  else NP=$(awk '!/^[[:space:]]*(#|$)/ {s = 1; for (i = 2; i <= NF; i++) if ($i ~ /^slots=/) {sub("slots=", "", $i); s = $i}; n += s} END {print n}' "$HOSTFILE")
  fi
fi

# ---- the network environment (exported: horovodrun forwards it, mpirun gets -x for each) ----
export NCCL_SOCKET_IFNAME="${NCCL_SOCKET_IFNAME:-$IFACE}"
export NCCL_IB_DISABLE="${NCCL_IB_DISABLE:-$((1 - IB))}"
export NCCL_DEBUG="${NCCL_DEBUG:-WARN}"
export GLOO_SOCKET_IFNAME="${GLOO_SOCKET_IFNAME:-$IFACE}"       # torch.distributed gloo
export HOROVOD_GLOO_IFACE="${HOROVOD_GLOO_IFACE:-$IFACE}"       # Horovod's Gloo controller
export OMPI_MCA_btl_tcp_if_include="${OMPI_MCA_btl_tcp_if_include:-$IFACE}"   # MPI data
export OMPI_MCA_oob_tcp_if_include="${OMPI_MCA_oob_tcp_if_include:-$IFACE}"
export PRTE_MCA_oob_tcp_if_include="${PRTE_MCA_oob_tcp_if_include:-$IFACE}"   # Open MPI 5 runtime
export TF_USE_LEGACY_KERAS="${TF_USE_LEGACY_KERAS:-1}"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export PATH="$(dirname "$PY"):$PATH"
if [[ "$(id -u)" == 0 ]]; then export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1; fi
VARS=(NCCL_SOCKET_IFNAME NCCL_IB_DISABLE NCCL_DEBUG GLOO_SOCKET_IFNAME HOROVOD_GLOO_IFACE
      TF_USE_LEGACY_KERAS PYTHONPATH PATH LD_LIBRARY_PATH CUDA_VISIBLE_DEVICES HVD_COMPRESS_DEVICE)

case "$LAUNCHER" in
  horovodrun)
    CMD=(horovodrun -np "$NP" --gloo --network-interface "$IFACE")
    if [[ -n "$HOSTS" ]]; then CMD+=(-H "$HOSTS")
    else CMD+=(-H "$(awk '!/^[[:space:]]*(#|$)/ {s = 1; for (i = 2; i <= NF; i++) if ($i ~ /^slots=/) {sub("slots=", "", $i); s = $i}; printf "%s%s:%s", sep, $1, s; sep = ","}' "$HOSTFILE")")
    fi ;;
  mpirun)
    CMD=(mpirun -np "$NP" --bind-to none --map-by slot)
    if [[ -n "$HOSTS" ]]; then CMD+=(-H "$HOSTS"); else CMD+=(--hostfile "$HOSTFILE"); fi
    for v in "${VARS[@]}"; do [[ -n "${!v:-}" ]] && CMD+=(-x "$v"); done
    ;;
  *) die "--launcher must be horovodrun or mpirun, got $LAUNCHER" ;;
esac
CMD+=("${EXTRA[@]}" "$PY" "$@")

echo "run_multinode: $(printf '%q ' "${CMD[@]}")" >&2
[[ "$DRY" == 1 ]] && exit 0
cd "$ROOT"
exec "${CMD[@]}"
