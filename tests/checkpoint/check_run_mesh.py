#!/usr/bin/env python3
"""Checks what a train_gpt checkpoint's manifest says about the saving mesh.

usage: check_run_mesh.py CHECKPOINT KEY=VALUE...

Every KEY of the manifest's run.mesh object must hold VALUE (compared as
text, so integers are written as such: cp=2, context=Context<Ring>); a
dotted KEY is a path from run instead (precision.products=fp16). Prints
the objects, then one line naming what matched; exits 1 on the first
difference or a missing key.
"""
import json
import os
import sys


def main():
    if len(sys.argv) < 3:
        print(__doc__)
        return 2
    path = os.path.join(sys.argv[1], "manifest.json")
    with open(path) as f:
        run = json.load(f)["run"]
    print(f"{path}: run.mesh = {json.dumps(run['mesh'])}")
    for pair in sys.argv[2:]:
        key, want = pair.split("=", 1)
        obj, name, where = run["mesh"], key, "run.mesh"
        if "." in key:
            *parents, name = key.split(".")
            obj, where = run, "run"
            for p in parents:
                obj = obj.get(p) if isinstance(obj, dict) else None
                where += "." + p
            print(f"{path}: {where} = {json.dumps(obj)}")
        if not isinstance(obj, dict) or name not in obj:
            print(f"{path}: {where} has no '{name}' (expected {want})")
            return 1
        got = obj[name]
        got = json.dumps(got) if not isinstance(got, str) else got
        if got != want:
            print(f"{path}: {where}.{name} is {got}, expected {want}")
            return 1
    print(("run holds " if any("." in a.split("=", 1)[0] for a in sys.argv[2:]) else "run.mesh holds ")
          + " ".join(sys.argv[2:]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
