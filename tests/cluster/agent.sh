#!/usr/bin/env bash
# Open MPI's launch agent for the two-host harness (--mca plm_rsh_agent): it
# stands where ssh would. Open MPI calls it as `agent.sh HOST COMMAND...` for
# every host other than the one mpirun runs on; HOST is a namespace that
# netns.sh made (weftc-TAG-a or -b), so the command (the orted, and through it
# the ranks) runs in that network namespace, in a UTS namespace of its own
# whose hostname is HOST. Like a remote shell, it runs the words it is given
# as one command line.
set -u
host="${1:-}"
shift || true
if [[ ! "$host" =~ ^weftc-[a-z0-9]{1,6}-[ab]$ ]]; then
  echo "agent.sh: '$host' is not a host of the two-host harness (weftc-TAG-a or weftc-TAG-b)" >&2
  exit 2
fi
if ! ip netns list 2> /dev/null | awk '{print $1}' | grep -qx "$host"; then
  echo "agent.sh: no network namespace $host (tests/cluster/netns.sh up makes it)" >&2
  exit 2
fi
exec ip netns exec "$host" unshare --uts -- /bin/bash -c 'hostname "$0" && eval "$1"' "$host" "$*"
