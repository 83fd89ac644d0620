#!/usr/bin/env python3
"""The floors of weft's headers (docs/architecture.md, "Layers").

Reads every `#include <weft/...>` in include/weft and fails when a header
includes one from a folder above its own, or when a folder of include/weft
has no floor in FLOORS. Usage: check_floors.py INCLUDE_DIR [--floors a,b,...]
(--floors replaces the order below, from the bottom; the test of this check
uses it to show that a climbing include is found).
"""
import os
import re
import sys

# From the bottom. "config" is the generated weft/config.hpp, "weft" the
# umbrella weft/weft.hpp, which includes every floor.
FLOORS = ["config", "core", "precision", "comm", "mesh", "ops", "placement", "metrics", "data",
          "vocabulary", "nn", "optim", "parallel", "plan", "serve", "checkpoint", "parity", "train_loop", "weft"]

INCLUDE = re.compile(r'^\s*#\s*include\s*<weft/([^>]+)>')


def floor_of(path):
    """weft/<folder>/... -> folder; weft/config.hpp -> config; weft/weft.hpp -> weft."""
    parts = path.split("/")
    return parts[0] if len(parts) > 1 else parts[0].removesuffix(".hpp")


def main(argv):
    if len(argv) < 2:
        print(__doc__, file=sys.stderr)
        return 2
    root = os.path.join(argv[1], "weft")
    floors = FLOORS
    if len(argv) == 4 and argv[2] == "--floors":
        floors = argv[3].split(",")
    if not os.path.isdir(root):
        print(f"check_floors: {root} is not a directory", file=sys.stderr)
        return 2
    level = {name: i for i, name in enumerate(floors)}
    errors, headers, includes = [], 0, 0
    for dirpath, _, files in os.walk(root):
        for name in sorted(files):
            if not name.endswith(".hpp"):
                continue
            path = os.path.join(dirpath, name)
            rel = os.path.relpath(path, root).replace(os.sep, "/")
            own = floor_of(rel)
            if own not in level:
                errors.append(f"{rel}: folder '{own}' has no floor; add it to FLOORS in tests/house/check_floors.py "
                              "and to docs/architecture.md (\"Layers\") where its includes put it")
                continue
            headers += 1
            with open(path, encoding="utf-8") as f:
                for lineno, line in enumerate(f, 1):
                    m = INCLUDE.match(line)
                    if not m:
                        continue
                    includes += 1
                    target = floor_of(m.group(1))
                    if target not in level:
                        errors.append(f"{rel}:{lineno}: includes weft/{m.group(1)}, whose folder '{target}' has no floor")
                    elif level[target] > level[own]:
                        errors.append(f"{rel}:{lineno}: includes weft/{m.group(1)}: floor '{target}' is above '{own}' "
                                      f"(from the bottom: {', '.join(floors)}); move what it needs down a floor, or the "
                                      "header up")
    for e in errors:
        print(f"check_floors: {e}")
    if errors:
        print(f"check_floors: {len(errors)} include(s) break the floors")
        return 1
    print(f"check_floors: {headers} headers, {includes} weft includes, every one on its own floor or below")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
