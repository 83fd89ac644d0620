#!/usr/bin/env python3
"""Checks what a train_gpt checkpoint's manifest says about the saving mesh.

usage: check_run_mesh.py CHECKPOINT KEY=VALUE...

Every KEY of the manifest's run.mesh object must hold VALUE (compared as
text, so integers are written as such: cp=2, context=Context<Ring>). Prints
the object, then one line naming what matched; exits 1 on the first
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
        mesh = json.load(f)["run"]["mesh"]
    print(f"{path}: run.mesh = {json.dumps(mesh)}")
    for pair in sys.argv[2:]:
        key, want = pair.split("=", 1)
        if key not in mesh:
            print(f"{path}: run.mesh has no '{key}' (expected {want})")
            return 1
        got = mesh[key]
        got = json.dumps(got) if not isinstance(got, str) else got
        if got != want:
            print(f"{path}: run.mesh.{key} is {got}, expected {want}")
            return 1
    print("run.mesh holds " + " ".join(sys.argv[2:]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
