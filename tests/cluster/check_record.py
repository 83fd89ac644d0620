"""Checks the topology of a train_gpt run record written on the two hosts of
tests/cluster (run.sh): it names the two hosts, the host of every rank, and
the mesh axes whose groups span both hosts are the expected ones.

  check_record.py DIR HOST_A HOST_B RECORD=AXES_ACROSS [RECORD=AXES_ACROSS ...]

AXES_ACROSS: comma-separated axis names (dp, pp, tp, ...) whose groups hold
ranks of both hosts, or "none". train_gpt's mesh is dp, pp, cp, ep, tp from
the outermost axis to the innermost (consecutive world ranks share the
innermost). Exits 77 with the harness's reason where it was skipped (DIR/skip);
fails where a record is older than the hosts (DIR/env: a run that did not run).
"""
import itertools
import json
import os
import sys

AXES = ["dp", "pp", "cp", "ep", "tp"]


def axis_groups(extents, axis):
    """The world-rank groups of one axis of a row-major mesh."""
    others = [range(n) if a != axis else [None] for a, n in zip(AXES, extents)]
    k = AXES.index(axis)
    groups = []
    for fixed in itertools.product(*others):
        ranks = []
        for i in range(extents[k]):
            coord = list(fixed)
            coord[k] = i
            r = 0
            for c, n in zip(coord, extents):
                r = r * n + c
            ranks.append(r)
        groups.append(ranks)
    return groups


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
        extents = [int(mesh.get(a, 1)) for a in AXES]
        across = set()
        for axis, n in zip(AXES, extents):
            if n > 1 and any(len({rank_hosts[r] for r in g}) > 1 for g in axis_groups(extents, axis)):
                across.add(axis)
        inside = sorted(a for a, n in zip(AXES, extents) if n > 1 and a not in across)
        line = (f"{name}: hosts {', '.join(sorted(hosts))}; rank_hosts {' '.join(rank_hosts)}; "
                f"across hosts: {','.join(sorted(across)) or 'none'}; inside a host: {','.join(inside) or 'none'}")
        print(line)
        if across != want:
            failures.append(f"{name}: axes across hosts {sorted(across)}, expected {sorted(want)}")
    for f in failures:
        print("FAILED: " + f)
    if not failures:
        print("record topology: ok")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
