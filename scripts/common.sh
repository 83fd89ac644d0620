# Sourced by scripts/run_example.sh and scripts/run_tests.sh: the build
# variants they share, so that the example and the g++ test variant reuse one
# build tree. Not meant to be run on its own.

WEFT_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
: "${WEFT_CI_JOBS:=$(nproc 2> /dev/null || echo 2)}"
: "${WEFT_CI_WERROR:=1}"       # 0: warnings in weft's own code do not fail the build
: "${WEFT_CI_ASAN_CXX:=clang++}"

# Launcher settings of the examples (the tests take theirs from cmake/weftTesting.cmake):
# ranks may outnumber cores, and idle ranks must yield the core they wait on.
WEFT_MPIRUN_FLAGS=(--oversubscribe --bind-to none --mca mpi_yield_when_idle 1)
if [[ "$(id -u)" == 0 ]]; then
  export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
fi

# The build tree of a variant.
weft_build_dir() { echo "${WEFT_ROOT}/build-ci-$1"; }

# weft_configure VARIANT: configures (or refreshes) the variant's build tree.
#   gcc    g++, RelWithDebInfo
#   clang  clang++, Release
#   asan   ${WEFT_CI_ASAN_CXX}, RelWithDebInfo, AddressSanitizer + UndefinedBehaviorSanitizer
#   kokkos-openmp  g++, RelWithDebInfo, the Kokkos + Kokkos Kernels with OpenMP
#                  installed in ${WEFT_CI_KOKKOS_OPENMP} (scripts/run_tests.sh sets
#                  it to scripts/build_kokkos_debian.sh's prefix unless given one,
#                  e.g. of scripts/build_kokkos.sh ... openmp); tests run with
#                  ${WEFT_CI_OMP_THREADS:-2} OpenMP threads per rank; no benchmarks
#                  (the tests run their kernels); without oneDNN
#                  (-DWEFT_ENABLE_ONEDNN=OFF), so that one variant checks the
#                  Kokkos Kernels products that every machine without oneDNN uses;
#                  without train_gpt's pipelined strategies
#                  (-DWEFT_TRAIN_GPT_PIPELINES=OFF: 354 s of this variant's
#                  1723 s of compile time on 5 Dec; the pipeline runtime's own
#                  tests, test_pipeline and custom_model's pp runs, still run
#                  here, and gcc trains train_gpt's pipelines); without the
#                  test programs that run at 4 ranks or more only
#                  (-DWEFT_TEST_MAX_RANKS=3: test_pipeline_tp and
#                  test_all_policies, 130 s of compile time; run_tests.sh
#                  leaves every run of 4 ranks or more out of this variant)
#   tsan   clang++, RelWithDebInfo, ThreadSanitizer, against the Kokkos + Kokkos
#          Kernels with OpenMP in ${WEFT_CI_KOKKOS_TSAN} (run_tests.sh builds it
#          from Debian's sources with clang++, so that OpenMP is LLVM's libomp,
#          whose Archer tool tells TSan about OpenMP's barriers); the tests
#          only (no examples, benchmarks or oneDNN), their 1-rank runs
#          (-DWEFT_TEST_MAX_RANKS=1), 2 OpenMP threads per rank; on request only
#          (WEFT_CI_VARIANTS=tsan)
#   kokkos-cuda    that prefix's nvcc_wrapper, RelWithDebInfo, the Kokkos + Kokkos
#                  Kernels installed in ${WEFT_CI_KOKKOS_CUDA} (... cuda), for
#                  ${NVCC_WRAPPER_DEFAULT_ARCH:-sm_90}
#   kokkos-hip     the compiler that prefix's Kokkos was built with (its
#                  Kokkos_CXX_COMPILER: clang++-16 or hipcc), RelWithDebInfo,
#                  the Kokkos + Kokkos Kernels with HIP installed in
#                  ${WEFT_CI_KOKKOS_HIP} (scripts/build_kokkos.sh ... hip);
#                  without oneDNN (a host library; the variant checks the
#                  device code) and the precompiled header (CMake's PCH does
#                  not cover -xhip's two compilations); the CUDA toolkit is
#                  not looked for (CMAKE_DISABLE_FIND_PACKAGE_CUDAToolkit):
#                  where it is installed, test_cublas_gemm would otherwise be
#                  compiled with the HIP headers and CUDA's together, whose
#                  vector types (uchar1, ...) clash
# Optimisation and debug information (CMAKE_CXX_FLAGS_RELWITHDEBINFO):
# - asan: -O0 -g1. The sanitizers check at every optimisation level, and at
#   -O0 they see every access as written; what -O1 (the sanitizers'
#   documentation's advice) buys is run time, and this variant's time is
#   mostly compiling: clang++ 14 compiles tests/parallel/test_pipeline.cpp
#   with ASan+UBSan in 22 s of CPU at -O0 -g1 against 82 s at -O1 -g1
#   (76 s at -O1 -g0), and the program runs at 1 rank in 4.6 s against
#   3.0 s (6 Dec 2026). Line tables (-g1) so that the sanitizers' reports
#   keep file and line.
# - gcc and kokkos-openmp: -O1 -g0. Compile time is most of a CI run, and a
#   failing test here reports through its own messages, not a debugger:
#   g++ 12 compiles tests/parallel/test_pipeline_tp.cpp in 36 s of CPU at
#   -O1 -g0 against 42 s at -O1 -g1 and 59 s at -O2 -g1.
# - tsan: -O1 -g1, ThreadSanitizer's advice; line tables for its reports.
# - kokkos-cuda: -O2 -g1 (clang is a Release build, -O3; neither is in the
#   default run).
# - kokkos-hip: -O1 -g0, as gcc: compile only, and every file is compiled
#   twice (host and gfx90a); the times in docs/build.md were measured so.
# WEFT_CI_OPT overrides the flags of every variant (e.g. "-O2 -g1").
# -Werror applies to weft's own targets only (CMAKE_COMPILE_WARNING_AS_ERROR
# sets their COMPILE_WARNING_AS_ERROR property); Kokkos' headers are system
# headers and consumers of the installed package are untouched.
weft_configure() {
  local variant="$1" cxx type extra=() opt="-O2 -g1"
  case "$variant" in
    gcc)   cxx=g++;                 type=RelWithDebInfo; opt="-O1 -g0" ;;
    clang) cxx=clang++;             type=Release; extra=(-DWEFT_BUILD_BENCHMARKS=OFF) ;;
    asan)  cxx="$WEFT_CI_ASAN_CXX"; type=RelWithDebInfo; opt="-O0 -g1"
           extra=(-DWEFT_SANITIZE=address,undefined -DWEFT_BUILD_BENCHMARKS=OFF)
           # The library's tests only, unless the full sanitizer run is asked for
           # (run_tests.sh: WEFT_CI_ASAN_NP8=1): the example programs were 37 % of
           # this variant's compile time, and their runs are the gcc and
           # kokkos-openmp variants' to check.
           # Nor are the test programs built that run at 4 ranks or more only
           # (WEFT_TEST_MAX_RANKS; run_tests.sh leaves their runs out here).
           [[ "${WEFT_CI_ASAN_NP8:-0}" == 1 ]] || extra+=(-DWEFT_BUILD_EXAMPLES=OFF -DWEFT_TEST_MAX_RANKS=2) ;;
    kokkos-openmp)
      [[ -n "${WEFT_CI_KOKKOS_OPENMP:-}" ]] || { echo "variant kokkos-openmp needs WEFT_CI_KOKKOS_OPENMP=<prefix>" >&2; return 2; }
      cxx=g++; type=RelWithDebInfo; opt="-O1 -g0"
      extra=(-DKokkos_ROOT="$WEFT_CI_KOKKOS_OPENMP" -DKokkosKernels_ROOT="$WEFT_CI_KOKKOS_OPENMP"
             -DWEFT_BUILD_BENCHMARKS=OFF -DWEFT_ENABLE_ONEDNN=OFF -DWEFT_TRAIN_GPT_PIPELINES=OFF
             -DWEFT_TEST_OMP_NUM_THREADS="${WEFT_CI_OMP_THREADS:-2}" -DWEFT_TEST_MAX_RANKS=3) ;;
    tsan)
      [[ -n "${WEFT_CI_KOKKOS_TSAN:-}" ]] || { echo "variant tsan needs WEFT_CI_KOKKOS_TSAN=<prefix>" >&2; return 2; }
      cxx=clang++; type=RelWithDebInfo; opt="-O1 -g1"
      extra=(-DKokkos_ROOT="$WEFT_CI_KOKKOS_TSAN" -DKokkosKernels_ROOT="$WEFT_CI_KOKKOS_TSAN"
             -DWEFT_SANITIZE=thread -DWEFT_BUILD_BENCHMARKS=OFF -DWEFT_BUILD_EXAMPLES=OFF
             -DWEFT_ENABLE_ONEDNN=OFF -DWEFT_TEST_OMP_NUM_THREADS=2 -DWEFT_TEST_MAX_RANKS=1) ;;
    kokkos-cuda)
      [[ -n "${WEFT_CI_KOKKOS_CUDA:-}" ]] || { echo "variant kokkos-cuda needs WEFT_CI_KOKKOS_CUDA=<prefix>" >&2; return 2; }
      [[ -x "$WEFT_CI_KOKKOS_CUDA/bin/nvcc_wrapper" ]] ||
        { echo "variant kokkos-cuda: $WEFT_CI_KOKKOS_CUDA/bin/nvcc_wrapper is missing (not a CUDA Kokkos install?)" >&2; return 2; }
      # nvcc_wrapper's own default, sm_70, is rejected by CUDA 13; CMake's
      # compiler checks run before any Kokkos flag is known.
      export NVCC_WRAPPER_DEFAULT_ARCH="${NVCC_WRAPPER_DEFAULT_ARCH:-sm_90}"
      cxx="$WEFT_CI_KOKKOS_CUDA/bin/nvcc_wrapper"; type=RelWithDebInfo
      extra=(-DKokkos_ROOT="$WEFT_CI_KOKKOS_CUDA" -DKokkosKernels_ROOT="$WEFT_CI_KOKKOS_CUDA") ;;
    kokkos-hip)
      [[ -n "${WEFT_CI_KOKKOS_HIP:-}" ]] || { echo "variant kokkos-hip needs WEFT_CI_KOKKOS_HIP=<prefix>" >&2; return 2; }
      local kconf="$WEFT_CI_KOKKOS_HIP/lib/cmake/Kokkos/KokkosConfigCommon.cmake"
      grep -qs '^set(Kokkos_DEVICES .*HIP' "$kconf" ||
        { echo "variant kokkos-hip: $kconf is missing or names no HIP device (not a HIP Kokkos install?)" >&2; return 2; }
      cxx="$(sed -n 's/^set(Kokkos_CXX_COMPILER "\(.*\)")$/\1/p' "$kconf")"
      [[ -x "$cxx" ]] || { echo "variant kokkos-hip: the compiler of that Kokkos ('$cxx') is not there" >&2; return 2; }
      type=RelWithDebInfo; opt="-O1 -g0"
      extra=(-DKokkos_ROOT="$WEFT_CI_KOKKOS_HIP" -DKokkosKernels_ROOT="$WEFT_CI_KOKKOS_HIP"
             -DWEFT_ENABLE_ONEDNN=OFF -DWEFT_PCH=OFF -DCMAKE_DISABLE_FIND_PACKAGE_CUDAToolkit=ON) ;;
    *) echo "unknown variant '$variant' (expected gcc, clang, asan, tsan, kokkos-openmp, kokkos-cuda or kokkos-hip)" >&2; return 2 ;;
  esac
  local generator=()
  command -v ninja > /dev/null && generator=(-G Ninja)
  local dir; dir="$(weft_build_dir "$variant")"
  # A tree made with another generator cannot be reconfigured with this one.
  if [[ -f "$dir/CMakeCache.txt" ]] && ! grep -q "^CMAKE_GENERATOR:INTERNAL=${generator[1]:-Unix Makefiles}\$" "$dir/CMakeCache.txt"; then
    rm -rf "$dir"
  fi
  cmake -S "$WEFT_ROOT" -B "$dir" "${generator[@]}" -DCMAKE_CXX_COMPILER="$cxx" -DCMAKE_BUILD_TYPE="$type" \
        -DCMAKE_CXX_FLAGS_RELWITHDEBINFO="${WEFT_CI_OPT:-$opt} -DNDEBUG" \
        -DCMAKE_COMPILE_WARNING_AS_ERROR="$([[ $WEFT_CI_WERROR == 1 ]] && echo ON || echo OFF)" "${extra[@]}"
}
