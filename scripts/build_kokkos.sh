#!/usr/bin/env bash
# Builds Kokkos and Kokkos Kernels from source trees you give (clones of the
# public kokkos/kokkos and kokkos/kokkos-kernels repositories at the same
# release, e.g. 4.6.01) and installs both into one prefix, for weft's
# Kokkos >= 4 builds and the CI variants WEFT_CI_KOKKOS_OPENMP / WEFT_CI_KOKKOS_CUDA /
# WEFT_CI_KOKKOS_HIP.
#
#   scripts/build_kokkos.sh --kokkos SRC --kernels SRC --prefix DIR openmp
#   scripts/build_kokkos.sh --kokkos SRC --kernels SRC --prefix DIR cuda [--arch HOPPER90]
#   scripts/build_kokkos.sh --kokkos SRC --kernels SRC --prefix DIR hip [--arch AMD_GFX90A] [--cxx clang++-16]
#
# Options: --build DIR (the copied sources and build trees; default
# <prefix>-build), --jobs N (default: the core count), --cxx CXX (host
# compiler; default g++; for hip: hipcc), --no-eti (no explicit
# instantiations in Kokkos Kernels: programs instantiate what they call
# from its headers; 4 source files instead of 88 for cuda, which makes a
# CUDA or HIP Kernels build minutes instead of hours on a small machine;
# docs/build.md). The source trees are never modified: each is copied
# (without .git) into the build directory, and the copy is patched.
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
# hip:    Serial + HIP for the Kokkos_ARCH_<ARCH> given (AMD_GFX90A: MI200),
#         compiled by hipcc (ROCm >= 5.2, e.g. Debian bookworm's hipcc and
#         libamdhip64-dev 5.2.3) or, with --cxx, by a clang++ of its own
#         (Kokkos' Clang HIP build: -xhip). The compiler is also the one of
#         weft's own HIP builds. rocThrust (Kokkos' default for HIP, used
#         only by its sort) is turned off: Debian does not package it.
#         Where the compiler's clang is older than 16 (ROCm < 5.5; Debian's
#         hipcc runs clang 15), Kokkos and Kokkos Kernels are compiled as
#         C++17, not C++20: clang 15's device pass crashes (a segmentation
#         fault) on some libstdc++ 12 templates in C++20 mode
#         (llvm/llvm-project#62017, fixed in clang 16): <regex>, which three
#         of Kokkos' sources include, and std::map with some key types,
#         which weft's headers use, so weft itself needs clang >= 16
#         (docs/build.md, "HIP (compile only)"). With a clang++ given,
#         the flags that hipcc would add are given to Kokkos as its
#         Kokkos_IMPL_AMDGPU_FLAGS, which its CMake package hands on to
#         every program built against it: --offload-arch, --rocm-path
#         ($ROCM_PATH, default /usr as on Debian), the device libraries'
#         directory (the one holding ocml.bc under it) and -B with the
#         compiler's own directory, so that it links device code with its
#         own lld (Debian's /usr/bin/lld can be an older one).
# All: shared libraries, Kokkos Kernels' BLAS and batched components with
# the system BLAS as its TPL (as Debian's Kokkos Kernels), Release.
set -euo pipefail

usage() { awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"; }
kokkos_src="" kernels_src="" prefix="" build="" backend="" arch="" cxx="${CXX:-g++}" cxx_given=0
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
    --cxx) cxx="$2"; cxx_given=1; shift 2 ;;
    --no-eti) eti=OFF; shift ;;
    openmp|cuda|hip) backend="$1"; shift ;;
    -h|--help) usage; exit 0 ;;
    *) echo "build_kokkos.sh: unknown argument '$1'" >&2; usage >&2; exit 2 ;;
  esac
done
die() { echo "build_kokkos.sh: $*" >&2; exit 1; }
[[ -n "$backend" ]] || die "name a backend: openmp, cuda or hip"
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
cxx_std=20
case "$backend" in
  openmp)
    kokkos_opts+=(-DKokkos_ENABLE_OPENMP=ON)
    compiler="$cxx"
    ;;
  cuda)
    : "${arch:=HOPPER90}"
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
  hip)
    : "${arch:=AMD_GFX90A}"
    [[ "$arch" == AMD_GFX* || "$arch" == VEGA* ]] ||
      die "--arch '$arch' is not an AMD GPU architecture of Kokkos (expected e.g. AMD_GFX90A or AMD_GFX942)"
    kokkos_opts+=(-DKokkos_ENABLE_HIP=ON "-DKokkos_ARCH_${arch}=ON" -DKokkos_ENABLE_ROCTHRUST=OFF)
    if [[ "$cxx_given" == 1 ]]; then
      compiler="$(command -v "$cxx")" || die "hip: --cxx '$cxx' is not on PATH"
    else
      compiler="$(command -v hipcc)" || die "hip: hipcc is not on PATH (Debian: apt-get install hipcc libamdhip64-dev)"
    fi
    if [[ "$(basename "$compiler")" != hipcc* ]]; then
      [[ "$arch" == AMD_GFX* ]] || die "hip: with --cxx, name the architecture as AMD_GFX<NNN> (e.g. AMD_GFX90A)"
      gfx="$(echo "${arch#AMD_}" | tr '[:upper:]' '[:lower:]')"
      rocm="${ROCM_PATH:-/usr}"
      devlib="$(find "$rocm/amdgcn" "$rocm/lib" -path '*amdgcn/bitcode/ocml.bc' -print -quit 2> /dev/null || true)"
      [[ -n "$devlib" ]] || die "hip: no ROCm device libraries (amdgcn/bitcode/ocml.bc) under $rocm (Debian: apt-get install rocm-device-libs)"
      bindir="$(dirname "$(readlink -f "$compiler")")"
      kokkos_opts+=("-DKokkos_IMPL_AMDGPU_FLAGS=--offload-arch=${gfx};--rocm-path=${rocm};--rocm-device-lib-path=$(dirname "$devlib");-B${bindir}")
    fi
    clang_major="$("$compiler" --version 2> /dev/null | sed -n 's/.*clang version \([0-9]*\)\..*/\1/p' | head -n 1)"
    if [[ "${clang_major:-0}" -lt 16 ]]; then
      cxx_std=17
      echo "build_kokkos.sh: $(basename "$compiler") runs clang ${clang_major:-unknown} (< 16): Kokkos and Kokkos Kernels compiled as C++17 (clang 15 crashes on <regex> in C++20 device code); weft itself needs clang >= 16"
    fi
    ;;
esac

common=(-G "$(command -v ninja > /dev/null && echo Ninja || echo 'Unix Makefiles')" -DCMAKE_BUILD_TYPE=Release
        -DCMAKE_CXX_COMPILER="$compiler" -DCMAKE_CXX_STANDARD="$cxx_std" -DBUILD_SHARED_LIBS=ON -DCMAKE_INSTALL_PREFIX="$prefix")

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
case "$backend" in
  cuda) weft_cxx="-DCMAKE_CXX_COMPILER=$prefix/bin/nvcc_wrapper (with NVCC_WRAPPER_DEFAULT_ARCH=$NVCC_WRAPPER_DEFAULT_ARCH)" ;;
  hip) weft_cxx="-DCMAKE_CXX_COMPILER=$compiler" ;;
  *) weft_cxx="" ;;
esac
echo "  weft:  cmake -S <weft> -B build -DKokkos_ROOT=$prefix -DKokkosKernels_ROOT=$prefix $weft_cxx"
echo "  CI:    WEFT_CI_KOKKOS_${backend^^}=$prefix scripts/run_tests.sh"
