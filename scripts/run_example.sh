#!/usr/bin/env bash
# Quick start, part 1: installs what is missing (scripts/install_deps.sh),
# builds the main example and runs it.
#   scripts/run_example.sh            mesh_demo on 8 ranks
#   WEFT_RANKS=4 scripts/run_example.sh
# The build tree is build-ci-gcc, shared with the g++ variant of scripts/run_tests.sh.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
cd "$WEFT_ROOT"

scripts/install_deps.sh
weft_configure gcc
dir="$(weft_build_dir gcc)"
cmake --build "$dir" --target mesh_demo -j "$WEFT_CI_JOBS"
echo "+ mpirun -n ${WEFT_RANKS:-8} ${WEFT_MPIRUN_FLAGS[*]} $dir/examples/mesh_demo"
OPENBLAS_NUM_THREADS=1 mpirun -n "${WEFT_RANKS:-8}" "${WEFT_MPIRUN_FLAGS[@]}" "$dir/examples/mesh_demo"
