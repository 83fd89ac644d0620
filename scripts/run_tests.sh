#!/usr/bin/env bash
# Quick start, part 2 (and what CI runs, through .ci/run): installs what is
# missing (scripts/install_deps.sh), then builds and runs the whole test suite
# in each build variant:
#   gcc    g++ RelWithDebInfo                      build tree build-ci-gcc
#   asan   clang++ with -fsanitize=address,undefined  build tree build-ci-asan
# and, on request only (WEFT_CI_VARIANTS=clang),
#   clang  clang++ Release                         build tree build-ci-clang
# The asan variant is also the clang build: it compiles every target with
# clang++ (-Werror) and runs clang's compile-fail tests, so a separate clang
# Release build adds no check that these two do not make.
# Every variant also installs weft and builds a downstream project against the
# installed package (CTest test downstream.installed_package).
#
#   scripts/run_tests.sh                         the default variants (gcc asan)
#   WEFT_CI_VARIANTS=gcc scripts/run_tests.sh    one variant
#   scripts/run_tests.sh -R mesh                 extra arguments go to ctest
# Other knobs: WEFT_CI_JOBS (parallel compile jobs, default: the core count),
# WEFT_CI_WERROR=0 (warnings do not fail the build), WEFT_CI_ASAN_CXX (default clang++),
# WEFT_CI_ASAN_NP8=1 (the sanitizer variant also runs the 8-rank tests).
# Backend variants, run when their Kokkos is there (build it with
# scripts/build_kokkos.sh) and reported as skipped otherwise:
#   WEFT_CI_KOKKOS_OPENMP=<prefix>  variant kokkos-openmp: build everything
#       against that Kokkos >= 4 with OpenMP and run the whole suite once per
#       thread count in WEFT_CI_KOKKOS_OPENMP_THREADS (default "1 2",
#       OMP_NUM_THREADS per rank)
#   WEFT_CI_KOKKOS_CUDA=<prefix>    variant kokkos-cuda: compile every target
#       with that prefix's nvcc_wrapper (NVCC_WRAPPER_DEFAULT_ARCH, default
#       sm_90); compile only, nothing runs
# They are added to the default variants; naming them in WEFT_CI_VARIANTS
# without their prefix is an error.
# Exits non-zero when any variant fails; prints the time each one took.
set -uo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
cd "$WEFT_ROOT"

scripts/install_deps.sh || exit 1

read -r -a variants <<< "${WEFT_CI_VARIANTS:-gcc asan}"
summary=()
if [[ -z "${WEFT_CI_VARIANTS:-}" ]]; then
  for pair in kokkos-openmp:WEFT_CI_KOKKOS_OPENMP kokkos-cuda:WEFT_CI_KOKKOS_CUDA; do
    v="${pair%%:*}" var="${pair#*:}"
    if [[ -n "${!var:-}" ]]; then
      variants+=("$v")
    else
      line=$(printf '%-13s skipped (%s unset)' "$v" "$var")
      echo "[run_tests] $line"
      summary+=("$line")
    fi
  done
fi

# Sanitizer runtime settings: Open MPI's own allocations are never freed, so
# leak checking stays off; UBSan's findings abort the rank (the build also
# passes -fno-sanitize-recover=undefined), which fails the test.
asan_env=(
  "ASAN_OPTIONS=detect_leaks=0:abort_on_error=0:halt_on_error=1:detect_stack_use_after_return=0"
  "UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1"
)

now() { date +%s; }
fmt() { printf '%dm%02ds' $(($1 / 60)) $(($1 % 60)); }

failed=0
t_all=$(now)
for v in "${variants[@]}"; do
  echo
  echo "======================== variant $v ========================"
  dir="$(weft_build_dir "$v")"
  env_v=()
  select_v=()
  # The 8-rank runs (label np8) exercise the same code as the 1-4-rank ones
  # with more ranks on the same 2 cores; the gcc variant runs them, and under
  # the sanitizers they cost 74 s of serialised time for no check the 1-4-rank
  # runs do not make. WEFT_CI_ASAN_NP8=1 runs them there too.
  if [[ "$v" == asan ]]; then
    env_v=("${asan_env[@]}")
    [[ "${WEFT_CI_ASAN_NP8:-0}" == 1 ]] || select_v=(-LE np8)
  fi
  t0=$(now)
  status=ok
  if weft_configure "$v" && cmake --build "$dir" -j "$WEFT_CI_JOBS"; then
    t1=$(now)
    if [[ "$v" == kokkos-cuda ]]; then
      status="ok (compile only)"  # nothing here runs CUDA code
    elif [[ "$v" == kokkos-openmp ]]; then
      for threads in ${WEFT_CI_KOKKOS_OPENMP_THREADS:-1 2}; do
        echo "[run_tests] kokkos-openmp: the suite with OMP_NUM_THREADS=$threads"
        (cd "$dir" && env OMP_NUM_THREADS="$threads" ctest -j2 --output-on-failure "$@") || status="FAILED (OMP_NUM_THREADS=$threads)"
      done
    else
      # Every variant runs the compile-fail tests: they check each compiler's
      # messages (the sanitizer flags do not change them).
      (cd "$dir" && env "${env_v[@]}" ctest -j2 --output-on-failure "${select_v[@]}" "$@") || status=FAILED
    fi
  else
    t1=$(now)
    status="FAILED (build)"
  fi
  t2=$(now)
  [[ "$status" == ok* ]] || failed=1
  line=$(printf '%-13s %-17s configure+build %s   tests %s   total %s' "$v" "$status" \
         "$(fmt $((t1 - t0)))" "$(fmt $((t2 - t1)))" "$(fmt $((t2 - t0)))")
  echo "[run_tests] $line"
  summary+=("$line")
done

echo
echo "======================== summary ========================"
printf '%s\n' "${summary[@]}"
echo "all variants: $(fmt $(($(now) - t_all)))"
exit $failed
