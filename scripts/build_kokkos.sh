#!/usr/bin/env bash
# Builds Kokkos and Kokkos Kernels from source trees you give (clones of the
# public kokkos/kokkos and kokkos/kokkos-kernels repositories at the same
# release, e.g. 4.6.01) and installs both into one prefix, for weft's
# Kokkos >= 4 builds and the CI variants WEFT_CI_KOKKOS_OPENMP / WEFT_CI_KOKKOS_CUDA.
#
#   scripts/build_kokkos.sh --kokkos SRC --kernels SRC --prefix DIR openmp
#   scripts/build_kokkos.sh --kokkos SRC --kernels SRC --prefix DIR cuda [--arch HOPPER90]
#
# Options: --build DIR (the copied sources and build trees; default
# <prefix>-build), --jobs N (default: the core count), --cxx CXX (host
# compiler; default g++), --no-eti (no explicit instantiations in Kokkos
# Kernels: programs instantiate what they call from its headers; 4 source
# files instead of 88 for cuda, which makes a CUDA Kernels build minutes
# instead of hours on a small machine; docs/build.md). The source trees
# are never modified: each is copied (without .git) into the build
# directory, and the copy is patched.
#
# openmp: Serial + OpenMP, built with --cxx.
# cuda:   Serial + CUDA for the Kokkos_ARCH_<ARCH> given (HOPPER90: sm_90),
#         with Kokkos' nvcc_wrapper around --cxx. CUDA 13 changed the
#         signatures of cudaGraphAddDependencies (an edge-data argument),
#         cudaMemAdvise and cudaMemPrefetchAsync (a cudaMemLocation instead of
#         a device number), which Kokkos 4.6 still calls the old way, and
#         rejects nvcc_wrapper's default sm_70. With nvcc >= 13 the script adds
#         a header to the copied Kokkos that declares the old signatures as
#         inline overloads forwarding to the new ones; in every case it sets
#         the copied nvcc_wrapper's default architecture (a hard-coded
#         default_arch in 4.6) to the one given, so the installed wrapper
#         compiles for it with no -arch flag.
# Both: shared libraries, Kokkos Kernels' BLAS and batched components with
# the system BLAS as its TPL (as Debian's Kokkos Kernels), Release.
set -euo pipefail

usage() { awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"; }
kokkos_src="" kernels_src="" prefix="" build="" backend="" arch="HOPPER90" cxx="${CXX:-g++}"
jobs="$(nproc 2> /dev/null || echo 2)"
eti=ON
while [[ $# -gt 0 ]]; do
  case "$1" in
    --kokkos) kokkos_src="$2"; shift 2 ;;
    --kernels) kernels_src="$2"; shift 2 ;;
    --prefix) prefix="$2"; shift 2 ;;
    --build) build="$2"; shift 2 ;;
    --arch) arch="$2"; shift 2 ;;
    --jobs) jobs="$2"; shift 2 ;;
    --cxx) cxx="$2"; shift 2 ;;
    --no-eti) eti=OFF; shift ;;
    openmp|cuda) backend="$1"; shift ;;
    -h|--help) usage; exit 0 ;;
    *) echo "build_kokkos.sh: unknown argument '$1'" >&2; usage >&2; exit 2 ;;
  esac
done
die() { echo "build_kokkos.sh: $*" >&2; exit 1; }
[[ -n "$backend" ]] || die "name a backend: openmp or cuda"
[[ -n "$prefix" ]] || die "--prefix DIR is required (where Kokkos and Kokkos Kernels are installed)"
[[ -f "$kokkos_src/CMakeLists.txt" && -d "$kokkos_src/core/src" ]] ||
  die "--kokkos '$kokkos_src' is not a Kokkos source tree (no CMakeLists.txt and core/src); clone github.com/kokkos/kokkos"
[[ -f "$kernels_src/CMakeLists.txt" && -d "$kernels_src/blas" ]] ||
  die "--kernels '$kernels_src' is not a Kokkos Kernels source tree (no CMakeLists.txt and blas/); clone github.com/kokkos/kokkos-kernels"
prefix="$(mkdir -p "$prefix" && cd "$prefix" && pwd)"
: "${build:=${prefix}-build}"
mkdir -p "$build"
build="$(cd "$build" && pwd)"

now() { date +%s; }
t_start=$(now)

# Fresh copies of the sources, without their git metadata.
copy_tree() {
  rm -rf "$2"
  mkdir -p "$2"
  tar -C "$1" --exclude=.git -cf - . | tar -C "$2" -xf -
}
copy_tree "$kokkos_src" "$build/kokkos-src"
copy_tree "$kernels_src" "$build/kokkos-kernels-src"
# Fresh build trees too: a cache left by a failed configure (e.g. the
# compiler checks under another default architecture) keeps what it found,
# such as an "Unknown" executable format, which then breaks the install step.
rm -rf "$build/kokkos" "$build/kokkos-kernels"

kokkos_opts=(-DKokkos_ENABLE_SERIAL=ON)
case "$backend" in
  openmp)
    kokkos_opts+=(-DKokkos_ENABLE_OPENMP=ON)
    compiler="$cxx"
    ;;
  cuda)
    command -v nvcc > /dev/null || die "cuda: nvcc is not on PATH (e.g. export PATH=/usr/local/cuda/bin:\$PATH)"
    sm="${arch//[!0-9]/}"
    [[ -n "$sm" ]] || die "--arch '$arch' names no compute capability (expected a Kokkos architecture such as HOPPER90 or AMPERE80)"
    export NVCC_WRAPPER_DEFAULT_ARCH="sm_${sm}" NVCC_WRAPPER_DEFAULT_COMPILER="$cxx"
    kokkos_opts+=(-DKokkos_ENABLE_CUDA=ON "-DKokkos_ARCH_${arch}=ON")
    compiler="$build/kokkos-src/bin/nvcc_wrapper"
    # nvcc_wrapper 4.6 hard-codes default_arch="sm_70" and reads no variable
    # for it: the copy (which is what gets installed) defaults to this
    # architecture instead, so weft's own builds with the installed wrapper
    # need no -arch either.
    grep -q '^default_arch="sm_[0-9]*"' "$compiler" || die "cuda: $compiler has no default_arch line to set to sm_${sm}"
    sed -i "s/^default_arch=\"sm_[0-9]*\"/default_arch=\"sm_${sm}\"/" "$compiler"
    echo "build_kokkos.sh: nvcc_wrapper's default architecture set to sm_${sm}"
    nvcc_major="$(nvcc --version | sed -n 's/.*release \([0-9]*\)\..*/\1/p')"
    if [[ "${nvcc_major:-0}" -ge 13 ]]; then
      setup="$build/kokkos-src/core/src/setup/Kokkos_Setup_Cuda.hpp"
      [[ -f "$setup" ]] || die "cuda: $setup is missing; this Kokkos release is not one this script knows how to adapt to CUDA 13"
      grep -q '^#include <cuda.h>' "$setup" || die "cuda: $setup does not include <cuda.h> where expected"
      cat > "$build/kokkos-src/core/src/setup/weft_cuda13_compat.hpp" << 'HDR'
// Added by weft's scripts/build_kokkos.sh: the pre-CUDA-13 signatures of three
// runtime functions that CUDA 13 changed, as inline overloads that forward to
// the new ones, so that a Kokkos written against CUDA 12 builds unchanged.
#pragma once
#include <cuda_runtime_api.h>
#if defined(CUDART_VERSION) && CUDART_VERSION >= 13000
inline cudaMemLocation weft_cuda13_location(int device) {
  cudaMemLocation loc{};
  loc.type = device == cudaCpuDeviceId ? cudaMemLocationTypeHost : cudaMemLocationTypeDevice;
  loc.id = device == cudaCpuDeviceId ? 0 : device;
  return loc;
}
inline cudaError_t cudaGraphAddDependencies(cudaGraph_t graph, const cudaGraphNode_t* from, const cudaGraphNode_t* to,
                                            size_t count) {
  return cudaGraphAddDependencies(graph, from, to, nullptr, count);
}
inline cudaError_t cudaMemAdvise(const void* ptr, size_t count, cudaMemoryAdvise advice, int device) {
  return cudaMemAdvise(ptr, count, advice, weft_cuda13_location(device));
}
inline cudaError_t cudaMemPrefetchAsync(const void* ptr, size_t count, int device, cudaStream_t stream = 0) {
  return cudaMemPrefetchAsync(ptr, count, weft_cuda13_location(device), 0u, stream);
}
#endif
HDR
      sed -i 's|^#include <cuda.h>|#include <cuda.h>\n#include "weft_cuda13_compat.hpp"|' "$setup"
      grep -q 'weft_cuda13_compat.hpp' "$setup" || die "cuda: could not add the CUDA 13 compatibility header to $setup"
      echo "build_kokkos.sh: nvcc ${nvcc_major}: added the CUDA 13 compatibility header to Kokkos_Setup_Cuda.hpp"
    fi
    ;;
esac

common=(-G "$(command -v ninja > /dev/null && echo Ninja || echo 'Unix Makefiles')" -DCMAKE_BUILD_TYPE=Release
        -DCMAKE_CXX_COMPILER="$compiler" -DCMAKE_CXX_STANDARD=20 -DBUILD_SHARED_LIBS=ON -DCMAKE_INSTALL_PREFIX="$prefix")

echo "build_kokkos.sh: Kokkos ($backend) from $kokkos_src into $prefix"
t0=$(now)
cmake -S "$build/kokkos-src" -B "$build/kokkos" "${common[@]}" "${kokkos_opts[@]}"
cmake --build "$build/kokkos" -j "$jobs"
cmake --install "$build/kokkos"
t1=$(now)

echo "build_kokkos.sh: Kokkos Kernels from $kernels_src into $prefix"
kernels_compiler="$compiler"
[[ "$backend" == cuda ]] && kernels_compiler="$prefix/bin/nvcc_wrapper"
common=("${common[@]/#-DCMAKE_CXX_COMPILER=*/-DCMAKE_CXX_COMPILER=$kernels_compiler}")
cmake -S "$build/kokkos-kernels-src" -B "$build/kokkos-kernels" "${common[@]}" -DKokkos_ROOT="$prefix" \
      -DKokkosKernels_ENABLE_ALL_COMPONENTS=OFF -DKokkosKernels_ENABLE_COMPONENT_BLAS=ON \
      -DKokkosKernels_ENABLE_COMPONENT_BATCHED=ON -DKokkosKernels_ENABLE_TPL_BLAS=ON \
      -DKokkosKernels_INST_DOUBLE="$eti" -DKokkosKernels_INST_LAYOUTLEFT="$eti" \
      -DKokkosKernels_INST_EXECSPACE_SERIAL="$eti"
cmake --build "$build/kokkos-kernels" -j "$jobs"
cmake --install "$build/kokkos-kernels"
t2=$(now)

echo "build_kokkos.sh: done: Kokkos $((t1 - t0)) s, Kokkos Kernels $((t2 - t1)) s, total $((t2 - t_start)) s"
echo "  weft:  cmake -S <weft> -B build -DKokkos_ROOT=$prefix -DKokkosKernels_ROOT=$prefix" \
     "$([[ $backend == cuda ]] && echo "-DCMAKE_CXX_COMPILER=$prefix/bin/nvcc_wrapper (with NVCC_WRAPPER_DEFAULT_ARCH=$NVCC_WRAPPER_DEFAULT_ARCH)")"
echo "  CI:    WEFT_CI_KOKKOS_$([[ $backend == cuda ]] && echo CUDA || echo OPENMP)=$prefix scripts/run_tests.sh"
