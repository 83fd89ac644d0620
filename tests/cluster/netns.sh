#!/usr/bin/env bash
# Two hosts on one machine: two network namespaces, each later entered with
# its own UTS namespace (hostname), joined by one veth pair whose two ends are
# rate-limited by a tbf qdisc. Nothing of it lives in the machine's own
# network namespace, and the only addresses are the two ends' (NET.1, NET.2).
#
#   netns.sh up   TAG DIR   create; write DIR/hostfile and DIR/env (exit 0),
#                           or DIR/skip with the reason (exit 77) where the
#                           machine refuses (not root, no ip/tc/unshare, a
#                           namespace, veth or tbf refused)
#   netns.sh down TAG DIR   end the processes left in the namespaces, delete
#                           the namespaces (their veth ends and qdiscs go with
#                           them), remove DIR/env and DIR/hostfile
#
# Names: namespaces and hostnames weftc-TAG-a and weftc-TAG-b, veth ends
# weftcTAGa (in a) and weftcTAGb (in b); TAG is at most 6 characters, so that
# interface names stay within the kernel's 15. Environment: WEFTC_RATE (tbf
# rate, default 1gbit), WEFTC_NET (the /24's first three octets, default
# 10.213.77), WEFTC_MPIRUN (the mpirun run.sh uses, default mpirun; skipped
# unless it is Open MPI's).
set -u
action="${1:-}" tag="${2:-}" dir="${3:-}"
if [[ -z "$action" || -z "$tag" || -z "$dir" || ! "$tag" =~ ^[a-z0-9]{1,6}$ ]]; then
  echo "usage: netns.sh up|down TAG DIR (TAG: 1-6 of [a-z0-9])" >&2
  exit 2
fi
nsa="weftc-$tag-a" nsb="weftc-$tag-b"
va="weftc${tag}a" vb="weftc${tag}b"
rate="${WEFTC_RATE:-1gbit}"
net="${WEFTC_NET:-10.213.77}"
mkdir -p "$dir"

has_ns() { ip netns list 2> /dev/null | awk '{print $1}' | grep -qx "$1"; }

# Every process still inside one of our namespaces (an orted or rank of a run
# that was killed), ended by its id: TERM, then KILL after at most 3 s.
end_processes() {
  local ns pids
  for ns in "$nsa" "$nsb"; do
    has_ns "$ns" || continue
    pids=$(ip netns pids "$ns" 2> /dev/null | tr '\n' ' ')
    [[ -n "${pids// }" ]] || continue
    echo "netns.sh: ending processes left in $ns: $pids"
    kill -TERM $pids 2> /dev/null
    for _ in $(seq 1 30); do
      pids=$(ip netns pids "$ns" 2> /dev/null | tr '\n' ' ')
      [[ -n "${pids// }" ]] || break
      sleep 0.1
    done
    [[ -z "${pids// }" ]] || kill -KILL $pids 2> /dev/null
  done
}

down() {
  local ns
  end_processes
  for ns in "$nsa" "$nsb"; do
    if has_ns "$ns"; then
      ip netns del "$ns" || echo "netns.sh: could not delete namespace $ns" >&2
    fi
  done
  rm -f "$dir/env" "$dir/hostfile"
  # Deleting a namespace destroys the veth end inside it and its peer; check.
  for ns in "$nsa" "$nsb"; do
    has_ns "$ns" && { echo "netns.sh: namespace $ns is still there" >&2; return 1; }
  done
  if ip -o link show 2> /dev/null | grep -qE ": (${va}|${vb})[@:]"; then
    echo "netns.sh: link $va or $vb is still there" >&2
    return 1
  fi
  return 0
}

skip() {
  echo "cluster harness skipped: $*"
  echo "$*" > "$dir/skip"
  exit 77
}

# A step that the machine may refuse: on failure, undo what was made and skip.
try() {
  local what="$1" out
  shift
  if ! out=$("$@" 2>&1); then
    down > /dev/null 2>&1
    skip "$what refused: '$*' said: ${out:-nothing}"
  fi
}

case "$action" in
  down)
    rm -f "$dir/skip"
    down
    exit $? ;;
  up) ;;
  *) echo "netns.sh: unknown action '$action' (up or down)" >&2; exit 2 ;;
esac

rm -f "$dir/skip" "$dir/env" "$dir/hostfile"
[[ "$(id -u)" == 0 ]] || skip "not root (uid $(id -u)): network namespaces, veth links and qdiscs need root"
for cmd in ip tc unshare hostname; do
  command -v "$cmd" > /dev/null || skip "no '$cmd' command on this machine"
done
mpirun="${WEFTC_MPIRUN:-mpirun}"
# The hosts are reached through Open MPI's plm_rsh_agent (agent.sh).
"$mpirun" --version 2>&1 | grep -qE "Open MPI|OpenRTE" ||
  skip "'$mpirun' is not Open MPI's mpirun or mpiexec (run.sh launches through Open MPI's plm_rsh_agent)"
# Left over from a run that was killed before its cleanup: start afresh.
down > /dev/null 2>&1 || skip "namespaces $nsa/$nsb left over from an earlier run cannot be removed"

trap 'down > /dev/null 2>&1' INT TERM
try "creating a network namespace" ip netns add "$nsa"
try "creating a network namespace" ip netns add "$nsb"
try "creating a veth pair" ip link add "$va" netns "$nsa" type veth peer name "$vb" netns "$nsb"
try "an address" ip -n "$nsa" addr add "$net.1/24" dev "$va"
try "an address" ip -n "$nsb" addr add "$net.2/24" dev "$vb"
for pair in "$nsa $va" "$nsb $vb"; do
  read -r ns link <<< "$pair"
  try "bringing up lo" ip -n "$ns" link set lo up
  try "bringing up a veth end" ip -n "$ns" link set "$link" up
  # The rate limit on each end's egress: traffic either way passes one tbf.
  try "the tbf qdisc (rate $rate)" ip netns exec "$ns" tc qdisc add dev "$link" root tbf rate "$rate" burst 256kb latency 50ms
done
try "a UTS namespace (unshare --uts)" ip netns exec "$nsa" unshare --uts -- hostname "$nsa"
trap - INT TERM

printf '%s slots=2\n%s slots=2\n' "$nsa" "$nsb" > "$dir/hostfile"
cat > "$dir/env" << ENV
WEFTC_NS_A=$nsa
WEFTC_NS_B=$nsb
WEFTC_LINK_A=$va
WEFTC_LINK_B=$vb
WEFTC_NET=$net
WEFTC_RATE=$rate
ENV
echo "netns.sh: hosts $nsa ($net.1, $va) and $nsb ($net.2, $vb), one veth pair, tbf $rate each way"
ip netns exec "$nsa" tc qdisc show dev "$va"
exit 0
