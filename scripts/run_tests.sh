#!/usr/bin/env bash
# Quick start, part 2 (and what CI runs, through .ci/run): installs what is
# missing (scripts/install_deps.sh), then builds and runs the whole test suite
# in each build variant:
#   gcc            g++ RelWithDebInfo against Debian's Kokkos 3.4 (Serial)    build-ci-gcc
#   asan           clang++ with -fsanitize=address,undefined, same Kokkos      build-ci-asan
#   kokkos-openmp  g++ RelWithDebInfo against Kokkos 3.4 with OpenMP, built    build-ci-kokkos-openmp
#                  from Debian's trilinos sources (scripts/build_kokkos_debian.sh,
#                  cached between runs), the suite at 2 OpenMP threads per rank
# and, on request only (WEFT_CI_VARIANTS=clang or tsan),
#   clang          clang++ Release                                             build-ci-clang
#   tsan           clang++ -O1 with -fsanitize=thread against Kokkos 3.4 with   build-ci-tsan
#                  OpenMP built with clang++ (LLVM's libomp) from the same
#                  Debian sources, the 1-rank tests at 2 OpenMP threads, with
#                  LLVM's Archer OpenMP tool (libomp-dev; install_deps.sh
#                  installs it when WEFT_CI_VARIANTS names tsan). Not a default
#                  variant: over the whole 1-rank suite it found no race that
#                  kokkos-openmp's tests miss (docs/build.md, "ThreadSanitizer")
# The asan variant is also the clang build: it compiles the library's tests
# and tools with clang++ (-Werror); the examples (and their runs), the 4- and
# 8-rank tests, the compile-fail tests and the downstream builds are left to
# gcc and kokkos-openmp unless WEFT_CI_ASAN_NP8=1.
# The gcc and kokkos-openmp variants also install weft and build a
# downstream project against the installed package (CTest test
# downstream.installed_package).
# The two-host tests (label cluster, tests/cluster: network namespaces; root
# only, skipped with the reason elsewhere) run in the gcc variant only.
#
#   scripts/run_tests.sh                         the default variants (gcc asan kokkos-openmp)
#   WEFT_CI_VARIANTS=gcc scripts/run_tests.sh    one variant
#   scripts/run_tests.sh -R mesh                 extra arguments go to ctest
# Other knobs: WEFT_CI_JOBS (parallel compile jobs, default: the core count),
# WEFT_CI_TEST_JOBS (ctest -j of every variant, default 4: see below),
# WEFT_CI_WERROR=0 (warnings do not fail the build), WEFT_CI_ASAN_CXX (default clang++),
# WEFT_CI_ASAN_NP8=1 (the full sanitizer run: also the examples, the 4- and 8-rank and downstream tests),
# WEFT_CI_KOKKOS_OPENMP_THREADS (OpenMP threads per rank of the kokkos-openmp
# suite, one run per entry; default "2"), WEFT_KOKKOS_CACHE (where the
# Kokkos builds are kept; default /var/cache/weft).
# kokkos-openmp fails (it is never skipped) when Debian's source registry
# cannot be reached for a Kokkos not yet in the cache. It uses a Kokkos >= 4
# with OpenMP instead when given one:
#   WEFT_CI_KOKKOS_OPENMP=<prefix>  (scripts/build_kokkos.sh ... openmp)
# The CUDA and HIP variants run when their Kokkos is there and are reported
# as skipped otherwise:
#   WEFT_CI_KOKKOS_CUDA=<prefix>    variant kokkos-cuda: compile every target
#       with that prefix's nvcc_wrapper (NVCC_WRAPPER_DEFAULT_ARCH, default
#       sm_90); compile only, nothing runs
#   WEFT_CI_KOKKOS_HIP=<prefix>     variant kokkos-hip: compile every target
#       with the compiler that prefix's Kokkos was built with
#       (scripts/build_kokkos.sh ... hip); compile only, nothing runs
# Naming kokkos-cuda or kokkos-hip in WEFT_CI_VARIANTS without its prefix is an error.
# Without a CUDA Kokkos, the gcc variant still runs nvcc over weft.hpp
# (cuda.nvcc_extended_lambdas) whenever nvcc is installed, and says so.
# Prints one line per variant (ran: ok or FAILED and why; or skipped and why)
# and the time each one took; exits non-zero when any variant fails.
set -uo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
cd "$WEFT_ROOT"

scripts/install_deps.sh || exit 1

read -r -a variants <<< "${WEFT_CI_VARIANTS:-gcc asan kokkos-openmp}"
summary=()
if [[ -z "${WEFT_CI_VARIANTS:-}" ]]; then
  # The GPU variants, compile only: run when their Kokkos is given (WEFT_CI_KOKKOS_CUDA, WEFT_CI_KOKKOS_HIP).
  for backend in CUDA HIP; do
    prefix_var="WEFT_CI_KOKKOS_${backend}"
    v="kokkos-${backend,,}"
    if [[ -n "${!prefix_var:-}" ]]; then
      variants+=("$v")
    else
      line=$(printf '%-13s skipped (%s unset: no %s Kokkos to build against; see docs/build.md)' "$v" "$prefix_var" "$backend")
      echo "[run_tests] $line"
      summary+=("$line")
    fi
  done
fi

asan_env=(
  "ASAN_OPTIONS=detect_leaks=0:abort_on_error=0:halt_on_error=1:detect_stack_use_after_return=0"
  "UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1"
)

# ctest -j: 4 slots on these 2-core machines. Most tests are short MPI runs
# whose ranks wait on each other, on mpirun's start-up and on their
# deadlines more than they compute, so two of them at a time leave the
# cores partly idle: the gcc suite took 527 s at -j4 against 609-655 s at
# -j2 on the Zen 5 host (7 Dec 2026, 514 tests, all passed both ways). A
# test needing more slots than that (PROCESSORS: its rank count) runs alone.
test_jobs="${WEFT_CI_TEST_JOBS:-4}"

now() { date +%s; }
fmt() { printf '%dm%02ds' $(($1 / 60)) $(($1 % 60)); }

# without_ranks_from N DIR [no-pipelines]: ctest arguments that leave out
# every test of the tree that runs N ranks or more (PROCESSORS >= N, whatever
# its labels: some checkpoint and example runs carry no npN label) and every
# test that needs a fixture one of those sets up (ctest would otherwise run
# the setup anyway).
# The gcc variant runs every test; the others leave out the 4- and 8-rank
# runs (N=4: the same code as the 1- and 2-rank ones, more ranks on the same
# 2 cores; see the kokkos-openmp and asan cases below).
# With no-pipelines, also the tests that train train_gpt with pp > 1: their
# commands (as ctest lists them) name train_gpt and a mesh with pp=2 or
# more; and weft-plan's --run-top tests, which train the planner's layouts,
# pipelines among them. The kokkos-openmp tree is built without those
# strategies (WEFT_TRAIN_GPT_PIPELINES=OFF, scripts/common.sh) and its
# train_gpt refuses pp > 1 before step 0, so a test this misses fails, with
# that reason, rather than passing unchecked. A fourth argument names
# (space-separated) further tests to leave out.
without_ranks_from() {
  (cd "$2" && ctest -N --show-only=json-v1) | python3 -c '
import json, re, sys
limit = int(sys.argv[1])
no_pipelines = len(sys.argv) > 2 and sys.argv[2] == "no-pipelines"
extra = set(sys.argv[3].split()) if len(sys.argv) > 3 else set()
tests = json.load(sys.stdin)["tests"]
props = {t["name"]: {p["name"]: p["value"] for p in (t.get("properties") or [])} for t in tests}
out = {n for n, p in props.items() if int(p.get("PROCESSORS", 1)) >= limit or n in extra}
if no_pipelines:
    pp = re.compile(r"(^|[ ,=|;])pp=([2-9]|[1-9][0-9]+)\b")
    for t in tests:
        cmd = " ".join(t.get("command") or [])
        if t["name"] == "example.train_gpt.bad_pipelines_not_compiled":
            continue  # the refusal itself, registered in such a tree only
        if (re.search(r"[/|]train_gpt([ |]|$)", cmd) and pp.search(cmd)) or t["name"].startswith("weft_plan.run_top"):
            out.add(t["name"])
while True:
    fixtures = {f for n in out for f in props[n].get("FIXTURES_SETUP", [])}
    more = {n for n, p in props.items() if n not in out and fixtures & set(p.get("FIXTURES_REQUIRED", []))}
    if not more:
        break
    out |= more
if out:
    print("-E")
    print("^(" + "|".join(re.escape(n) for n in sorted(out)) + ")$")
' "$1" "${3:-}" "${4:-}"
}

# debian_kokkos [CXX]: Kokkos 3.4 and Kokkos Kernels 3.4 with OpenMP from
# Debian's trilinos sources (scripts/build_kokkos_debian.sh), built with CXX
# (default: the script's, g++) or taken from its cache. On success sets
# kprefix (the install prefix) and note (the time it took); otherwise sets
# status to the failure, naming an unreachable source registry (exit status
# 3 of the script) apart from a failed build, and returns non-zero.
debian_kokkos() {
  local kstatus=0
  kprefix="$(env ${1:+CXX="$1"} WEFT_CI_JOBS="$WEFT_CI_JOBS" scripts/build_kokkos_debian.sh)" || kstatus=$?
  if (( kstatus == 3 )); then
    status="FAILED (Debian's source registry unreachable: no Kokkos with OpenMP; see the build_kokkos_debian.sh line above)"
  elif (( kstatus != 0 )); then
    status="FAILED (the Kokkos 3.4 OpenMP build${1:+ with $1} from Debian's sources failed; see above)"
  else
    note="Kokkos $(fmt $(($(now) - t0)))"
  fi
  return "$kstatus"
}

failed=0
t_all=$(now)
for v in "${variants[@]}"; do
  echo
  echo "======================== variant $v ========================"
  dir="$(weft_build_dir "$v")"
  env_v=()
  select_v=()
  note=""
  t0=$(now)
  status=ok
  if [[ "$v" == tsan ]]; then
    # The same Debian sources built with clang++, so that Kokkos' OpenMP is
    # libomp, which loads the Archer tool (OMP_TOOL_LIBRARIES, below): Archer
    # tells ThreadSanitizer about OpenMP's barriers and tasks, which libgomp
    # (g++'s OpenMP) hides from it, so that every report is a real race.
    # libomp and Archer sit in LLVM's library folder, two levels above
    # clang's resource folder (Debian: /usr/lib/llvm-14/lib).
    archer="$(realpath -m "$(clang++ -print-resource-dir)/../..")/libarcher.so"
    if [[ ! -f "$archer" ]]; then
      status="FAILED (no LLVM OpenMP runtime with Archer at $archer: apt-get install libomp-dev, or WEFT_CI_VARIANTS=tsan scripts/install_deps.sh)"
    elif debian_kokkos clang++; then
      export WEFT_CI_KOKKOS_TSAN="$kprefix"
    fi
  fi
  if [[ "$v" == kokkos-openmp && -z "${WEFT_CI_KOKKOS_OPENMP:-}" ]]; then
    # Kokkos 3.4 with OpenMP from Debian's trilinos sources, kept in
    # ${WEFT_KOKKOS_CACHE:-/var/cache/weft}: built on a machine's first run
    # (about a minute), reused afterwards.
    debian_kokkos && WEFT_CI_KOKKOS_OPENMP="$kprefix"
  fi
  omp_threads=(${WEFT_CI_KOKKOS_OPENMP_THREADS:-2})
  WEFT_CI_OMP_THREADS="${omp_threads[0]}"
  if [[ "$status" != ok ]]; then
    t1=$(now)
  elif weft_configure "$v" && cmake --build "$dir" -j "$WEFT_CI_JOBS"; then
    t1=$(now)
    case "$v" in
      kokkos-cuda|kokkos-hip)
        status="ok (compile only)" ;;  # nothing here runs CUDA or HIP code
      kokkos-openmp)
        # Left out here, because another variant runs them on the same code:
        # the 4- and 8-rank tests (gcc; see without_ranks_from): at 2 OpenMP
        # threads per rank they put 8 or 16 threads on 2 cores, and in the
        # 5 Dec rehearsal the 4-rank runs alone were 332 s of this suite's
        # 899 s, run one at a time (the fault tests' rank-stopped cases up to
        # 101 s against 6 s in gcc), while every kernel runs with 2 threads in
        # the 1- and 2-rank runs of the same programs; the compile-fail tests
        # (they check g++'s messages, which the Kokkos backend does not
        # change: gcc runs them with the same compiler) and the nvcc pass
        # (label cuda; gcc). The benchmarks are not built (weft_configure):
        # their kernels are those the tests run.
        # The two-host suite (label cluster) is gcc's too: it checks the
        # launch across network namespaces, which no Kokkos backend changes.
        # And the runs of train_gpt's pipelined strategies, which this tree
        # does not compile (scripts/common.sh); gcc runs them.
        mapfile -t select_v < <(without_ranks_from 4 "$dir" no-pipelines)
        select_v+=(-LE '^(compile_fail|cuda|cluster)$')
        for threads in "${omp_threads[@]}"; do
          if [[ "$threads" != "$WEFT_CI_OMP_THREADS" ]]; then
            WEFT_CI_OMP_THREADS="$threads"
            weft_configure "$v" > /dev/null || { status="FAILED (configure, OMP_NUM_THREADS=$threads)"; continue; }
          fi
          echo "[run_tests] kokkos-openmp: the suite with OMP_NUM_THREADS=$threads per rank (Kokkos at $WEFT_CI_KOKKOS_OPENMP)"
          (cd "$dir" && ctest -j"$test_jobs" --output-on-failure "${select_v[@]}" "$@") ||
            status="FAILED (tests, OMP_NUM_THREADS=$threads)"
        done ;;
      tsan)
        # Every 1-rank run (the tree registers no other runs of the MPI
        # tests; the tests registered by hand at 2 ranks or more are left
        # out with without_ranks_from). A report fails the test
        # (halt_on_error, exit status 66). Races inside libraries that are
        # not instrumented (Open MPI, OpenBLAS) are not reported
        # (ignore_noninstrumented_modules): they are not weft's, and TSan
        # cannot see their synchronisation. scripts/tsan.supp names the one
        # synchronisation of Kokkos' own that TSan cannot see (the OpenMP
        # parallel_scan's rendezvous). Nor the compile-fail, nvcc,
        # two-host and downstream tests: they run no weft kernel.
        mapfile -t select_v < <(without_ranks_from 2 "$dir")
        select_v+=(-LE '^(compile_fail|cuda|cluster|downstream)$')
        (cd "$dir" && env "TSAN_OPTIONS=halt_on_error=1:exitcode=66:ignore_noninstrumented_modules=1:report_signal_unsafe=0:second_deadlock_stack=1:suppressions=$WEFT_ROOT/scripts/tsan.supp" \
                          "OMP_TOOL_LIBRARIES=$archer" \
                          ctest -j"$test_jobs" --output-on-failure "${select_v[@]}" "$@") || status="FAILED (tests)" ;;
      *)
        if [[ "$v" == asan ]]; then
          # Sanitizer runtime settings: Open MPI's own allocations are never
          # freed, so leak checking stays off; UBSan's findings abort the rank
          # (the build also passes -fno-sanitize-recover=undefined), which
          # fails the test. Under the sanitizers the 4- and 8-rank tests cost
          # minutes of serialised time for no memory or UB check that the 1-
          # and 2-rank runs of the same programs do not make: every rank runs
          # the same kernels and the same message paths at 2 ranks, and the
          # 4-rank-only compositions (dp x tp, pp x tp, ...) are the gcc and
          # kokkos-openmp variants' to check (WEFT_CI_ASAN_NP8=1 runs them all).
          # The downstream tests build the installed package with the same
          # Kokkos as gcc, which runs them.
          # The compile-fail tests are gcc's here too: their messages are
          # weft's own static_assert sentences, which clang prints as g++
          # does, and they were 226 s of this variant's 381 s of tests (5 Dec);
          # this variant still compiles every test and tool with clang++
          # -Werror. WEFT_CI_ASAN_NP8=1 runs them with clang as well.
          env_v=("${asan_env[@]}")
          # The two-host suite (label cluster) is gcc's, also under
          # WEFT_CI_ASAN_NP8=1: it checks the launch across namespaces and
          # the link, which the sanitizers add nothing to.
          # Nor do the two weft-plan runs that rank every layout of a 70B
          # model on 64 devices: the same planner code test_plan's ranking
          # case runs here, 143 and 66 s of this variant's tests at -O0
          # (7 Dec 2026); gcc runs them.
          if [[ "${WEFT_CI_ASAN_NP8:-0}" != 1 ]]; then
            mapfile -t select_v < <(without_ranks_from 4 "$dir" "" "weft_plan.preset_70b weft_plan.schedule_interleaved")
            select_v+=(-LE '^(downstream|compile_fail|cluster)$')
          else
            select_v=(-LE '^cluster$')
          fi
        fi
        if [[ "$v" == gcc ]]; then
          if grep -q 'cuda.nvcc_extended_lambdas' "$dir/tests/CTestTestfile.cmake" 2> /dev/null; then
            nvcc_path="$(sed -n 's/^WEFT_NVCC:FILEPATH=//p' "$dir/CMakeCache.txt")"
            note="with the nvcc pass, nvcc $("$nvcc_path" --version | sed -n 's/.*release \([0-9.]*\).*/\1/p')"
            echo "[run_tests] gcc: nvcc found at $nvcc_path: cuda.nvcc_extended_lambdas (nvcc over weft.hpp, extended-lambda rules) runs in this variant"
          else
            note="without the nvcc pass: no nvcc"
            echo "[run_tests] gcc: no nvcc found (PATH, CUDA_PATH, /usr/local/cuda/bin): cuda.nvcc_extended_lambdas does not run"
          fi
        fi
        # gcc runs the compile-fail tests (asan too with WEFT_CI_ASAN_NP8=1:
        # clang's messages; the sanitizer flags do not change them).
        (cd "$dir" && env "${env_v[@]}" ctest -j"$test_jobs" --output-on-failure "${select_v[@]}" "$@") || status="FAILED (tests)" ;;
    esac
  else
    t1=$(now)
    status="FAILED (build)"
  fi
  t2=$(now)
  [[ "$status" == ok* ]] || failed=1
  if [[ "$status" == ok* ]]; then result="ran, passed${status#ok}"; else result="ran, ${status}"; fi
  line=$(printf '%-13s %-13s configure+build %s   tests %s   total %s%s' "$v" "$result" \
         "$(fmt $((t1 - t0)))" "$(fmt $((t2 - t1)))" "$(fmt $((t2 - t0)))" "${note:+   ($note)}")
  echo "[run_tests] $line"
  summary+=("$line")
done

echo
echo "======================== summary ========================"
printf '%s\n' "${summary[@]}"
echo "all variants: $(fmt $(($(now) - t_all)))"
exit $failed
