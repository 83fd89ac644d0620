#!/usr/bin/env bash
# Quick start, part 1: installs what is missing (scripts/install_deps.sh),
# builds the main example -- examples/train_gpt, the reference GPT's training
# job -- and runs it on 2 data-parallel ranks (fully sharded), 300 steps of a
# small GPT on the synthetic language, writing a run record.
#   scripts/run_example.sh
#   WEFT_RANKS=4 WEFT_DP_MODE=replicate scripts/run_example.sh
#   WEFT_EXAMPLE=mesh_demo scripts/run_example.sh     the Mesh and Comm demo on 8 ranks
#   WEFT_EXAMPLE=custom_model scripts/run_example.sh  a model of the user's own layers on dp x pp x tp = 2 x 2 x 2
# The build tree is build-ci-gcc, shared with the g++ variant of scripts/run_tests.sh.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
cd "$WEFT_ROOT"

scripts/install_deps.sh
weft_configure gcc
dir="$(weft_build_dir gcc)"
example="${WEFT_EXAMPLE:-train_gpt}"
cmake --build "$dir" --target "$example" -j "$WEFT_CI_JOBS"
if [[ "$example" == mesh_demo ]]; then
  echo "+ mpirun -n ${WEFT_RANKS:-8} ${WEFT_MPIRUN_FLAGS[*]} $dir/examples/mesh_demo"
  OPENBLAS_NUM_THREADS=1 mpirun -n "${WEFT_RANKS:-8}" "${WEFT_MPIRUN_FLAGS[@]}" "$dir/examples/mesh_demo"
  exit 0
fi
if [[ "$example" == custom_model ]]; then
  cm_args=(--mesh dp=2,pp=2,tp=2 --dp fsdp --schedule zb --batch 16 --microbatches 4 --steps 100 --record "$dir/custom_model_run.json")
  echo "+ mpirun -n 8 ${WEFT_MPIRUN_FLAGS[*]} $dir/examples/custom_model ${cm_args[*]}"
  OPENBLAS_NUM_THREADS=1 mpirun -n 8 "${WEFT_MPIRUN_FLAGS[@]}" "$dir/examples/custom_model" "${cm_args[@]}"
  exit 0
fi
ranks="${WEFT_RANKS:-2}"
args=(--layers 4 --d-model 128 --heads 4 --seq 64 --batch 16 --steps 300 --lr 2e-3 --warmup 20
      --mesh "dp=$ranks" --dp "${WEFT_DP_MODE:-fsdp}" --record "$dir/train_gpt_run.json")
echo "+ mpirun -n $ranks ${WEFT_MPIRUN_FLAGS[*]} $dir/examples/train_gpt ${args[*]}"
mpirun -n "$ranks" "${WEFT_MPIRUN_FLAGS[@]}" "$dir/examples/train_gpt" "${args[@]}"
