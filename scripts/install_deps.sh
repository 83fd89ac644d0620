#!/usr/bin/env bash
# Installs the Debian/Ubuntu packages weft's build, tests, examples and CI need,
# but only those that are missing. As root it runs apt-get itself (refreshing
# the package lists first, and only when something is missing); otherwise it
# prints the exact command to run as root and exits with status 1.
# With everything present it changes nothing and says so.
#
#   scripts/install_deps.sh          install what is missing
#   scripts/install_deps.sh --check  only report; exit 1 when something is missing
set -euo pipefail

check_only=0
case "${1:-}" in
  "") ;;
  --check) check_only=1 ;;
  -h|--help) sed -n '2,9p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
  *) echo "install_deps.sh: unknown argument '$1' (expected --check or nothing)" >&2; exit 2 ;;
esac

packages=(
  # build tools
  cmake ninja-build make g++ clang
  # Kokkos and Kokkos Kernels (Debian's Trilinos packaging), their BLAS
  libtrilinos-kokkos-dev libtrilinos-kokkos-kernels-dev libopenblas-dev
  # oneDNN: the host GEMM provider of float and bf16 products (WEFT_ENABLE_ONEDNN)
  libdnnl-dev
  # MPI: headers and libraries, and mpirun
  libopenmpi-dev openmpi-bin
  # the test framework
  doctest-dev
  # numpy, for the test that reads checkpoints without weft (tests/checkpoint/check_numpy.py)
  python3-numpy
)
# The sanitizer build uses clang, whose AddressSanitizer/UBSan runtime is a
# separate package on bookworm (libclang-rt-dev -> libclang-rt-14-dev); older
# releases ship it inside clang itself and have no such package. g++'s
# sanitizer runtimes (libasan, libubsan) come with g++.
# Without package lists (a fresh container) apt-cache knows nothing: assume it
# exists, and look again after apt-get update.
have_lists() { compgen -G '/var/lib/apt/lists/*_Packages*' > /dev/null; }
knows() { apt-cache show "$1" > /dev/null 2>&1; }
if command -v apt-cache > /dev/null && { knows libclang-rt-dev || ! have_lists; }; then
  packages+=(libclang-rt-dev)
fi

# The ThreadSanitizer variant (WEFT_CI_VARIANTS=tsan, not a default one)
# needs LLVM's OpenMP runtime and its Archer tool.
if [[ " ${WEFT_CI_VARIANTS:-} " == *" tsan "* ]]; then
  packages+=(libomp-dev)
fi

if ! command -v dpkg-query > /dev/null || ! command -v apt-get > /dev/null; then
  echo "install_deps.sh: this is not a Debian/Ubuntu system (no dpkg-query/apt-get)." >&2
  echo "Install by hand: CMake >= 3.23, a C++20 compiler, MPI, Kokkos >= 4 (or 3.4) with Kokkos Kernels, doctest." >&2
  exit 1
fi

# nvcc is not a Debian package here (the CUDA toolkit comes with the machine's
# image): only reported. With it, CI's gcc variant compiles weft.hpp with nvcc
# (cuda.nvcc_extended_lambdas), and tests/CMakeLists.txt finds it the same way.
nvcc="$(PATH="$PATH:${CUDA_PATH:+$CUDA_PATH/bin:}/usr/local/cuda/bin" command -v nvcc || true)"
if [[ -n "$nvcc" ]]; then
  echo "install_deps.sh: nvcc $("$nvcc" --version | sed -n 's/.*release \([0-9.]*\).*/\1/p') at $nvcc: the nvcc pass over weft.hpp runs in CI's gcc variant."
else
  echo "install_deps.sh: no nvcc (PATH, \$CUDA_PATH/bin, /usr/local/cuda/bin): the nvcc pass over weft.hpp will not run; install the CUDA toolkit for it."
fi

missing=()
for p in "${packages[@]}"; do
  status=$(dpkg-query -W -f='${db:Status-Status}' "$p" 2> /dev/null || true)
  [[ "$status" == installed ]] || missing+=("$p")
done

if (( ${#missing[@]} == 0 )); then
  echo "install_deps.sh: all ${#packages[@]} packages weft needs are installed; nothing to do."
  exit 0
fi

install_line="apt-get install -y ${missing[*]}"
echo "install_deps.sh: missing ${#missing[@]} of ${#packages[@]} packages: ${missing[*]}"
if (( check_only )); then
  echo "Install them as root with:"
  echo "  apt-get update && $install_line"
  exit 1
fi
if [[ "$(id -u)" != 0 ]]; then
  echo "Not running as root, so nothing was installed. Run as root (e.g. with sudo):" >&2
  echo "  apt-get update && $install_line" >&2
  exit 1
fi

export DEBIAN_FRONTEND=noninteractive
echo "+ apt-get update"
apt-get update
if [[ " ${missing[*]} " == *" libclang-rt-dev "* ]] && ! knows libclang-rt-dev; then
  missing=("${missing[@]/libclang-rt-dev}")  # this release has clang's runtime inside clang
  read -r -a missing <<< "${missing[*]}"
  install_line="apt-get install -y ${missing[*]}"
fi
echo "+ $install_line"
apt-get install -y "${missing[@]}"
echo "install_deps.sh: installed ${missing[*]}."
