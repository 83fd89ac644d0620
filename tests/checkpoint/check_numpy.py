#!/usr/bin/env python3
"""Reads weft checkpoints with numpy alone, as a Python user would.

usage: check_numpy.py CHECKPOINT [OTHER]

Every tensor of CHECKPOINT is assembled from its .npy chunks (numpy.load),
each chunk's crc32 is checked with zlib against the manifest, and every
element must be covered exactly once. With OTHER (a checkpoint of the same
run at the same step, saved from another mesh), every tensor must have the
same name, shape and values to --rtol (default 1e-4) and --atol (1e-5).
With --test-values, CHECKPOINT is one that tests/checkpoint/test_checkpoint.cpp
saved, whose values weft set by formula: "w"[r, c] = 100000 + 1000 r + c and
"b"[0, c] = 200000 + c; numpy must read exactly those.
Prints one line per checkpoint and exits 1 on the first difference.
"""
import json
import os
import sys
import zlib

import numpy as np


def load(path):
    with open(os.path.join(path, "manifest.json")) as f:
        m = json.load(f)
    assert m["format"] == "weft-checkpoint", f"{path}: not a weft checkpoint"
    out = {}
    for t in m["tensors"]:
        rows, cols = t["shape"]
        full = np.zeros((rows, cols), dtype=np.float32)
        seen = np.zeros((rows, cols), dtype=np.int32)
        for c in t["chunks"]:
            file = os.path.join(path, c["file"])
            a = np.load(file, allow_pickle=False)
            assert a.dtype == np.float32 and list(a.shape) == c["shape"], f"{file}: {a.dtype} {a.shape}, manifest {c['shape']}"
            with open(file, "rb") as f:
                f.seek(c["byte_offset"])
                data = f.read(c["bytes"])
            assert zlib.crc32(data) == c["crc32"], f"{file}: crc32 {zlib.crc32(data)} != manifest {c['crc32']}"
            assert np.array_equal(np.frombuffer(data, dtype="<f4").reshape(a.shape), a), f"{file}: bytes != numpy.load"
            r0, c0 = c["offset"]
            full[r0:r0 + a.shape[0], c0:c0 + a.shape[1]] = a
            seen[r0:r0 + a.shape[0], c0:c0 + a.shape[1]] += 1
        assert (seen == 1).all(), f"{path}: tensor {t['name']}: elements covered {seen.min()}..{seen.max()} times, not once"
        out[t["name"]] = full
    return m, out


def main():
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    rtol = float(next((a.split("=")[1] for a in sys.argv if a.startswith("--rtol=")), "1e-4"))
    atol = float(next((a.split("=")[1] for a in sys.argv if a.startswith("--atol=")), "1e-5"))
    m, a = load(args[0])
    n = sum(x.size for x in a.values())
    print(f"{args[0]}: {len(a)} tensors, {n} elements, step {m['step']}, every chunk's crc32 matches")
    if "--test-values" in sys.argv:
        for name, salt in (("w", 1), ("b", 2)):
            rows, cols = a[name].shape
            want = salt * 100000 + 1000 * np.arange(rows)[:, None] + np.arange(cols)[None, :]
            if not np.array_equal(a[name], want.astype(np.float32)):
                print(f"tensor {name}: numpy reads other values than weft wrote")
                return 1
        print(f"{args[0]}: tensors w {a['w'].shape} and b {a['b'].shape} hold exactly the values weft wrote")
    if len(args) > 1:
        m2, b = load(args[1])
        if sorted(a) != sorted(b):
            print(f"tensor names differ: {sorted(set(a) ^ set(b))}")
            return 1
        worst = 0.0
        for k in a:
            if a[k].shape != b[k].shape:
                print(f"tensor {k}: shape {a[k].shape} vs {b[k].shape}")
                return 1
            if not np.allclose(a[k], b[k], rtol=rtol, atol=atol):
                d = np.abs(a[k] - b[k]).max()
                print(f"tensor {k}: values differ by up to {d} (rtol {rtol}, atol {atol})")
                return 1
            worst = max(worst, float(np.abs(a[k] - b[k]).max()))
        print(f"{args[1]}: the same {len(b)} tensors, values equal to rtol {rtol} / atol {atol} "
              f"(max abs difference {worst:.3g}; meshes {m['run']['mesh']['strategy']} and {m2['run']['mesh']['strategy']})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
