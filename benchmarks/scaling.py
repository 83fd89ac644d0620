#!/usr/bin/python3
"""Weak- and strong-scaling series of train_gpt over rank counts and data-parallel modes.

Every point is one train_gpt run with --record; the driver reads the records
and prints, per series, mode and rank count: the global batch, tokens/s, the
step time, exposed communication per step, MFU and the scaling efficiency,
naming its divisor and its reference. It writes the table as JSON and a PNG
plot of tokens/s and efficiency against ranks (drawn here, with the standard
library only: no plotting package is needed).

  weak scaling    the per-rank batch is fixed (--local-batch sequences per rank),
                  the global batch grows with the ranks:
                  efficiency(n) = tokens/s(n) / (n x tokens/s of the 1-rank reference)
  strong scaling  the global batch is fixed (--global-batch sequences):
                  efficiency(n) = tokens/s(n) / (n x tokens/s of the 1-rank reference)
                                = step time(1) / (n x step time(n))
  reference       the 1-rank run of the same series in replicate mode (at one
                  rank the modes have nothing to shard and train the same model).

  /usr/bin/python3 benchmarks/scaling.py --train-gpt build/examples/train_gpt \
      --ranks 1,2,4 --modes replicate,zero1,zero2,fsdp --out scaling --plot scaling/scaling.png

Use /usr/bin/python3: the script needs only the standard library.
"""

import argparse
import json
import math
import os
import shlex
import struct
import subprocess
import sys
import zlib

DEFAULT_MODEL = "--layers 2 --d-model 64 --heads 4 --seq 32"
DEFAULT_LAUNCHER = "mpirun --oversubscribe --bind-to none --mca mpi_yield_when_idle 1 -n {n}"


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--train-gpt", required=True, help="the train_gpt executable")
    p.add_argument("--ranks", default="1,2,4", help="rank counts, comma-separated; must include 1 (the reference)")
    p.add_argument("--modes", default="replicate,zero1,zero2,fsdp", help="data-parallel modes, comma-separated")
    p.add_argument("--series", default="weak,strong", help="weak, strong or both")
    p.add_argument("--model", default=DEFAULT_MODEL, help="train_gpt model flags (default: %(default)s)")
    p.add_argument("--local-batch", type=int, default=4, help="weak scaling: sequences per rank per step")
    p.add_argument("--global-batch", type=int, default=16, help="strong scaling: sequences per step, all ranks")
    p.add_argument("--steps", type=int, default=30, help="optimizer steps per run")
    p.add_argument("--launcher", default=DEFAULT_LAUNCHER, help="launch command; {n} is the rank count")
    p.add_argument("--extra", default="", help="more train_gpt flags for every run (e.g. --extra=--threads=1, with '=' so that the value is not read as a flag; Kokkos takes '--threads N' with a space as its own flag)")
    p.add_argument("--out", default="scaling", help="directory for records, logs and scaling.json")
    p.add_argument("--plot", default="", help="PNG file to write (default: OUT/scaling.png; 'none': no plot)")
    p.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")
    a = p.parse_args(argv)
    a.ranks = [int(x) for x in a.ranks.split(",") if x]
    a.modes = [x for x in a.modes.split(",") if x]
    a.series = [x for x in a.series.split(",") if x]
    if 1 not in a.ranks:
        p.error("--ranks must include 1: it is the reference of both series")
    for s in a.series:
        if s not in ("weak", "strong"):
            p.error("--series: unknown series '%s' (weak, strong)" % s)
    for n in a.ranks:
        if n < 1 or a.global_batch % n:
            p.error("--global-batch %d is not divisible by %d ranks" % (a.global_batch, n))
    if "{n}" not in a.launcher:
        p.error("--launcher must contain {n}")
    if not a.plot:
        a.plot = os.path.join(a.out, "scaling.png")
    return a


def runs(a):
    """(series, mode, ranks, global batch) of every run, the references first."""
    out = []
    for s in a.series:
        for n in sorted(a.ranks):
            for mode in (["replicate"] if n == 1 else a.modes):
                out.append((s, mode, n, a.local_batch * n if s == "weak" else a.global_batch))
    return out


def command(a, series, mode, n, batch, record):
    cmd = shlex.split(a.launcher.replace("{n}", str(n))) + [a.train_gpt] + shlex.split(a.model)
    cmd += ["--batch", str(batch), "--steps", str(a.steps), "--mesh", "dp=%d" % n, "--dp", mode, "--record", record]
    return cmd + shlex.split(a.extra)


def measure(a):
    os.makedirs(a.out, exist_ok=True)
    points = []
    for series, mode, n, batch in runs(a):
        base = os.path.join(a.out, "%s_%s_np%d" % (series, mode, n))
        cmd = command(a, series, mode, n, batch, base + ".json")
        print("$ " + " ".join(shlex.quote(c) for c in cmd), flush=True)
        if a.dry_run:
            continue
        with open(base + ".log", "w") as log:
            rc = subprocess.call(cmd, stdout=log, stderr=subprocess.STDOUT)
        if rc != 0:
            sys.exit("scaling.py: train_gpt failed (exit %d) for %s %s np%d; see %s.log" % (rc, series, mode, n, base))
        with open(base + ".json") as f:
            r = json.load(f)
        steady = r["batch"]["steps"] - r["warmup_steps_excluded"]
        exposed = sum(r["exposed_comm_seconds_after_warmup"][k] for k in
                      ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "point_to_point")) / max(1, steady)
        points.append({"series": series, "mode": mode, "ranks": n, "global_batch": batch,
                       "tokens_per_step": r["tokens_per_step"], "tokens_per_second": r["tokens_per_second"],
                       "step_seconds": r["tokens_per_step"] / r["tokens_per_second"], "mfu": r["mfu"],
                       "exposed_comm_seconds_per_step": exposed,
                       "slowest_over_fastest": r["step_time_seconds"]["slowest_over_fastest"],
                       "record": base + ".json"})
    return points


def efficiencies(points):
    ref = {p["series"]: p for p in points if p["ranks"] == 1}
    for p in points:
        r = ref[p["series"]]
        p["efficiency"] = p["tokens_per_second"] / (p["ranks"] * r["tokens_per_second"])
        p["efficiency_divisor"] = "%d x %.0f tokens/s" % (p["ranks"], r["tokens_per_second"])
        p["efficiency_reference"] = "%s series, 1 rank, replicate, global batch %d" % (p["series"], r["global_batch"])
    return points


def report(a, points):
    for series in a.series:
        ps = [p for p in points if p["series"] == series]
        r = next(p for p in ps if p["ranks"] == 1)
        if series == "weak":
            print("\nweak scaling: %d sequences per rank; efficiency = tokens/s(n) / (n x tokens/s of the reference)" % a.local_batch)
        else:
            print("\nstrong scaling: global batch %d sequences; efficiency = tokens/s(n) / (n x tokens/s of the reference)"
                  " = step time(1) / (n x step time(n))" % a.global_batch)
        print("reference: 1 rank, replicate, %.0f tokens/s (%s)" % (r["tokens_per_second"], r["record"]))
        print("%-9s %5s %6s %10s %9s %12s %6s %8s %11s  %s" % ("mode", "ranks", "batch", "tokens/s", "step ms",
                                                              "exposed ms", "mfu", "slow/fast", "efficiency", "divisor"))
        print("(step ms: median after warm-up, rank 0; exposed ms: time blocked in communication per step after\n"
              " warm-up, mean over steps, worst rank; slow/fast: slowest rank's median step over the fastest's)")
        for p in ps:
            print("%-9s %5d %6d %10.0f %9.3f %12.3f %6.3f %8.2f %11.3f  %s" % (
                p["mode"], p["ranks"], p["global_batch"], p["tokens_per_second"], 1e3 * p["step_seconds"],
                1e3 * p["exposed_comm_seconds_per_step"], p["mfu"], p["slowest_over_fastest"], p["efficiency"],
                p["efficiency_divisor"]))


# ---- a small PNG plotter (standard library only) ----------------------------

# 5x7 glyphs, one 5-bit row each (bit 4 = leftmost column); lower case is drawn as upper case.
FONT = {
    "0": (14, 17, 19, 21, 25, 17, 14), "1": (4, 12, 4, 4, 4, 4, 14), "2": (14, 17, 1, 2, 4, 8, 31),
    "3": (31, 2, 4, 2, 1, 17, 14), "4": (2, 6, 10, 18, 31, 2, 2), "5": (31, 16, 30, 1, 1, 17, 14),
    "6": (6, 8, 16, 30, 17, 17, 14), "7": (31, 1, 2, 4, 8, 8, 8), "8": (14, 17, 17, 14, 17, 17, 14),
    "9": (14, 17, 17, 15, 1, 2, 12), "A": (14, 17, 17, 31, 17, 17, 17), "B": (30, 17, 17, 30, 17, 17, 30),
    "C": (14, 17, 16, 16, 16, 17, 14), "D": (28, 18, 17, 17, 17, 18, 28), "E": (31, 16, 16, 30, 16, 16, 31),
    "F": (31, 16, 16, 30, 16, 16, 16), "G": (14, 17, 16, 23, 17, 17, 15), "H": (17, 17, 17, 31, 17, 17, 17),
    "I": (14, 4, 4, 4, 4, 4, 14), "J": (7, 2, 2, 2, 2, 18, 12), "K": (17, 18, 20, 24, 20, 18, 17),
    "L": (16, 16, 16, 16, 16, 16, 31), "M": (17, 27, 21, 21, 17, 17, 17), "N": (17, 17, 25, 21, 19, 17, 17),
    "O": (14, 17, 17, 17, 17, 17, 14), "P": (30, 17, 17, 30, 16, 16, 16), "Q": (14, 17, 17, 17, 21, 18, 13),
    "R": (30, 17, 17, 30, 20, 18, 17), "S": (15, 16, 16, 14, 1, 1, 30), "T": (31, 4, 4, 4, 4, 4, 4),
    "U": (17, 17, 17, 17, 17, 17, 14), "V": (17, 17, 17, 17, 17, 10, 4), "W": (17, 17, 17, 21, 21, 21, 10),
    "X": (17, 17, 10, 4, 10, 17, 17), "Y": (17, 17, 17, 10, 4, 4, 4), "Z": (31, 1, 2, 4, 8, 16, 31),
    " ": (0,) * 7, ".": (0, 0, 0, 0, 0, 12, 12), ",": (0, 0, 0, 0, 12, 4, 8), "-": (0, 0, 0, 31, 0, 0, 0),
    "/": (0, 1, 2, 4, 8, 16, 0), "(": (2, 4, 8, 8, 8, 4, 2), ")": (8, 4, 2, 2, 2, 4, 8),
    ":": (0, 12, 12, 0, 12, 12, 0), "=": (0, 0, 31, 0, 31, 0, 0), "%": (24, 25, 2, 4, 8, 19, 3),
    "_": (0, 0, 0, 0, 0, 0, 31), "+": (0, 4, 4, 31, 4, 4, 0), "x": (0, 0, 17, 10, 4, 10, 17),
}


class Canvas:
    def __init__(self, w, h):
        self.w, self.h = w, h
        self.px = bytearray(b"\xff" * (w * h * 3))

    def dot(self, x, y, c):
        if 0 <= x < self.w and 0 <= y < self.h:
            i = 3 * (y * self.w + x)
            self.px[i:i + 3] = bytes(c)

    def rect(self, x0, y0, x1, y1, c):
        for y in range(int(y0), int(y1) + 1):
            for x in range(int(x0), int(x1) + 1):
                self.dot(x, y, c)

    def line(self, x0, y0, x1, y1, c, width=1):
        x0, y0, x1, y1 = int(round(x0)), int(round(y0)), int(round(x1)), int(round(y1))
        n = max(abs(x1 - x0), abs(y1 - y0), 1)
        for k in range(n + 1):
            x, y = x0 + (x1 - x0) * k // n, y0 + (y1 - y0) * k // n
            self.rect(x - width // 2, y - width // 2, x + (width - 1) // 2, y + (width - 1) // 2, c)

    def text(self, x, y, s, c=(0, 0, 0), scale=2):
        for ch in s:
            rows = FONT.get(ch, FONT.get(ch.upper(), FONT[" "]))
            for r, bits in enumerate(rows):
                for col in range(5):
                    if bits & (16 >> col):
                        self.rect(x + col * scale, y + r * scale, x + col * scale + scale - 1, y + r * scale + scale - 1, c)
            x += 6 * scale

    @staticmethod
    def text_width(s, scale=2):
        return 6 * scale * len(s)

    def png(self, path):
        raw = b"".join(b"\x00" + bytes(self.px[3 * y * self.w:3 * (y + 1) * self.w]) for y in range(self.h))

        def chunk(kind, data):
            return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xffffffff)

        with open(path, "wb") as f:
            f.write(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", self.w, self.h, 8, 2, 0, 0, 0)) +
                    chunk(b"IDAT", zlib.compress(raw, 9)) + chunk(b"IEND", b""))


COLORS = {"replicate": (31, 119, 180), "zero1": (255, 127, 14), "zero2": (44, 160, 44), "fsdp": (214, 39, 40)}


def fmt(v):
    if v >= 1e6:
        return "%.3gM" % (v / 1e6)
    if v >= 1e3:
        return "%.3gk" % (v / 1e3)
    return "%.3g" % v


def panel(cv, x0, y0, w, h, title, ylabel, ranks, lines, ymax):
    """Axes at (x0, y0) of size w x h; lines: (label, colour, dashed, [(ranks, value)])."""
    cv.text(x0 + (w - cv.text_width(title)) // 2, y0 - 30, title)
    cv.line(x0, y0, x0, y0 + h, (0, 0, 0), 2)
    cv.line(x0, y0 + h, x0 + w, y0 + h, (0, 0, 0), 2)
    lo, hi = min(ranks), max(ranks)
    # ranks on a log2 axis: 1, 2, 4, 8 equally spaced
    X = lambda r: x0 + 20 + (w - 40) * (math.log2(r / lo) / math.log2(hi / lo) if hi > lo else 0.5)
    Y = lambda v: y0 + h - h * v / ymax
    for r in ranks:
        cv.line(X(r), y0 + h, X(r), y0 + h + 6, (0, 0, 0), 2)
        cv.text(X(r) - cv.text_width(str(r)) // 2, y0 + h + 12, str(r))
    cv.text(x0 + (w - cv.text_width("ranks (log scale)")) // 2, y0 + h + 34, "ranks (log scale)")
    for k in range(6):
        v = ymax * k / 5
        cv.line(x0 - 6, Y(v), x0, Y(v), (0, 0, 0), 2)
        cv.line(x0 + 1, Y(v), x0 + w, Y(v), (225, 225, 225), 1)
        cv.text(x0 - 10 - cv.text_width(fmt(v)), Y(v) - 7, fmt(v))
    cv.text(x0 - 10 - cv.text_width(ylabel), y0 - 30, ylabel)
    for _, colour, dashed, pts in lines:
        pts = sorted(pts)
        for (r0, v0), (r1, v1) in zip(pts, pts[1:]):
            if dashed:  # dashes: every other tenth of the segment
                for k in range(0, 10, 2):
                    cv.line(X(r0) + (X(r1) - X(r0)) * k / 10, Y(v0) + (Y(v1) - Y(v0)) * k / 10,
                            X(r0) + (X(r1) - X(r0)) * (k + 1) / 10, Y(v0) + (Y(v1) - Y(v0)) * (k + 1) / 10, colour, 3)
            else:
                cv.line(X(r0), Y(v0), X(r1), Y(v1), colour, 3)
        for r, v in pts:
            cv.rect(X(r) - 4, Y(v) - 4, X(r) + 4, Y(v) + 4, colour)


def plot(a, points, path):
    ranks = sorted(a.ranks)
    cv = Canvas(1200, 560)
    cv.text(40, 14, "train_gpt scaling: solid = weak (%d seq/rank), dashed = strong (global %d seq)" %
            (a.local_batch, a.global_batch))
    lines_tps, lines_eff = [], []
    for series in a.series:
        for mode in a.modes:
            pts = [p for p in points if p["series"] == series and (p["mode"] == mode or p["ranks"] == 1)]
            lines_tps.append((mode, COLORS.get(mode, (0, 0, 0)), series == "strong",
                              [(p["ranks"], p["tokens_per_second"]) for p in pts]))
            lines_eff.append((mode, COLORS.get(mode, (0, 0, 0)), series == "strong",
                              [(p["ranks"], p["efficiency"]) for p in pts]))
    ymax_t = max(p["tokens_per_second"] for p in points) * 1.15
    ymax_e = max(1.2, max(p["efficiency"] for p in points) * 1.1)
    panel(cv, 120, 90, 440, 360, "tokens/s (global)", "tok/s", ranks, lines_tps, ymax_t)
    panel(cv, 700, 90, 440, 360, "efficiency = tok/s(n) / (n x tok/s(1))", "", ranks, lines_eff, ymax_e)
    x = 120
    for mode in a.modes:
        c = COLORS.get(mode, (0, 0, 0))
        cv.rect(x, 522, x + 24, 528, c)
        cv.text(x + 32, 518, mode)
        x += 40 + cv.text_width(mode) + 30
    cv.png(path)


def main(argv):
    a = parse_args(argv)
    points = measure(a)
    if a.dry_run:
        print("dry run: %d runs listed, none started" % len(runs(a)))
        return 0
    efficiencies(points)
    report(a, points)
    with open(os.path.join(a.out, "scaling.json"), "w") as f:
        json.dump({"ranks": a.ranks, "modes": a.modes, "model": a.model, "local_batch": a.local_batch,
                   "global_batch": a.global_batch, "steps": a.steps, "points": points}, f, indent=2)
    print("\nwrote %s" % os.path.join(a.out, "scaling.json"))
    if a.plot != "none":
        plot(a, points, a.plot)
        print("wrote %s" % a.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
