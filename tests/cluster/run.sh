#!/usr/bin/env bash
# Runs an MPI program on the two hosts of netns.sh, 2 ranks on each:
#
#   run.sh DIR MAP -- PROGRAM ARGS...
#
# DIR is netns.sh's directory; MAP is Open MPI's --map-by: `slot` (ranks 0, 1
# on host a and 2, 3 on host b) or `node` (0, 2 on a and 1, 3 on b). mpirun
# itself runs on host a (in its namespaces: the orted of host b reaches it
# over the veth link), starts host b's orted through agent.sh, and keeps
# every byte between the hosts on the link: the out-of-band channel and the
# TCP BTL are restricted to the link's /24. Inside a host the ranks use
# shared memory (vader). WEFTC_MPIRUN names the mpirun (default: mpirun on
# PATH; Open MPI's only: netns.sh up checks). Exits 77 with netns.sh's reason
# where it skipped.
set -u
dir="${1:-}" map="${2:-}"
if [[ -z "$dir" || -z "$map" || "${3:-}" != "--" || -z "${4:-}" ]]; then
  echo "usage: run.sh DIR slot|node -- PROGRAM ARGS..." >&2
  exit 2
fi
shift 3
if [[ -f "$dir/skip" ]]; then
  echo "cluster harness skipped: $(cat "$dir/skip")"
  exit 77
fi
if [[ ! -f "$dir/env" ]]; then
  echo "run.sh: $dir/env is missing: the hosts are not up (tests/cluster/netns.sh up TAG $dir)" >&2
  exit 1
fi
source "$dir/env"
mpirun="${WEFTC_MPIRUN:-mpirun}"
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
# The ranks inherit this environment on both hosts (agent.sh is mpirun's
# child); weft's and the thread counts' variables are also passed with -x,
# as they would be to real hosts.
forward=()
for v in $(compgen -e | grep -E '^(WEFT_|OMP_|OPENBLAS_)'); do forward+=(-x "$v"); done
echo "run.sh: 4 ranks on $WEFTC_NS_A and $WEFTC_NS_B (--map-by $map), link $WEFTC_LINK_A-$WEFTC_LINK_B at $WEFTC_RATE"
exec ip netns exec "$WEFTC_NS_A" unshare --uts -- /bin/bash -c 'hostname "$0" && exec "$@"' "$WEFTC_NS_A" \
  "$mpirun" -n 4 --hostfile "$dir/hostfile" --map-by "$map" --bind-to none \
  --mca plm_rsh_agent "$here/agent.sh" \
  --mca btl self,vader,tcp --mca btl_tcp_if_include "$WEFTC_NET.0/24" --mca oob_tcp_if_include "$WEFTC_NET.0/24" \
  --mca mpi_yield_when_idle 1 \
  "${forward[@]}" "$@"
