"""Checks the topology of a train_gpt run record written on the two hosts of
tests/cluster (run.sh): it names the two hosts and the host of every rank,
the mesh axes the program found crossing the hosts (topology.axes_crossing_hosts,
from Mesh::within_node) are the expected ones and every other axis of more
than one rank is inside a host, and the transport is the one run.sh
configures: shared memory (vader) inside a host, TCP between the hosts.

  check_record.py DIR HOST_A HOST_B RECORD=AXES_ACROSS [RECORD=AXES_ACROSS ...]

AXES_ACROSS: comma-separated axis names (dp, pp, tp, ...) whose groups hold
ranks of both hosts, or "none". Exits 77 with the harness's reason where it
was skipped (DIR/skip); fails where a record is older than the hosts
(DIR/env: a run that did not run).
"""
import json
import os
import sys

AXES = ["dp", "pp", "cp", "ep", "tp"]


def main(argv):
    if len(argv) < 5:
        print(__doc__, file=sys.stderr)
        return 2
    skip = os.path.join(argv[1], "skip")
    if os.path.exists(skip):
        with open(skip) as f:
            print("cluster harness skipped: " + f.read().strip())
        return 77
    env = os.path.join(argv[1], "env")
    if not os.path.exists(env):
        print(f"FAILED: {env} is missing: the hosts are not up (tests/cluster/netns.sh up)")
        return 1
    hosts = {argv[2], argv[3]}
    failures = []
    for arg in argv[4:]:
        path, _, want = arg.partition("=")
        want = set() if want == "none" else set(want.split(","))
        if not os.path.exists(path) or os.path.getmtime(path) < os.path.getmtime(env):
            failures.append(f"{path}: missing or older than the hosts ({env}): its run did not write it")
            continue
        with open(path) as f:
            rec = json.load(f)
        topo, mesh = rec["topology"], rec["mesh"]
        name = os.path.basename(path)
        rank_hosts = topo["rank_hosts"]
        if set(topo["hosts"]) != hosts or topo["host_count"] != 2:
            failures.append(f"{name}: topology hosts {topo['hosts']} (host_count {topo['host_count']}), expected {sorted(hosts)}")
        if len(rank_hosts) != mesh["world_size"] or set(rank_hosts) != hosts:
            failures.append(f"{name}: rank_hosts {rank_hosts} for {mesh['world_size']} ranks on {sorted(hosts)}")
            continue
        across, inside = topo["axes_crossing_hosts"], topo["axes_inside_host"]
        transport = topo["transport"]
        line = (f"{name}: hosts {', '.join(sorted(hosts))}; rank_hosts {' '.join(rank_hosts)}; "
                f"across hosts: {','.join(across) or 'none'}; inside a host: {','.join(inside) or 'none'}; "
                f"transport inside a host {transport['inside_host']}, between hosts {transport['between_hosts']}")
        print(line)
        if set(across) != want:
            failures.append(f"{name}: topology.axes_crossing_hosts {across}, expected {sorted(want)}")
        larger = {a for a in AXES if int(mesh.get(a, 1)) > 1}
        if set(across) | set(inside) != larger or set(across) & set(inside):
            failures.append(f"{name}: axes_crossing_hosts {across} and axes_inside_host {inside} do not split "
                            f"the axes of more than one rank {sorted(larger)}")
        if transport["inside_host"] != "vader" or transport["between_hosts"] != "tcp":
            failures.append(f"{name}: topology.transport {transport}, expected vader inside a host and tcp "
                            "between hosts (run.sh's --mca btl self,vader,tcp)")
    for f in failures:
        print("FAILED: " + f)
    if not failures:
        print("record topology: ok")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
