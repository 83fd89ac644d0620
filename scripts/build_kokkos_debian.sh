#!/usr/bin/env bash
# Kokkos 3.4 and Kokkos Kernels 3.4 with the OpenMP backend (and Serial), built
# from Debian's own `trilinos` source package, for CI's kokkos-openmp variant.
# Debian packages Kokkos with the Serial backend only, and no other Kokkos can
# be installed from a package registry here; the Trilinos 13.2 sources that
# Debian serves hold the standalone CMake builds of both.
#
#   scripts/build_kokkos_debian.sh            build if needed; print the prefix on stdout
#   scripts/build_kokkos_debian.sh --prefix   only print the prefix it would use
#
# The sources come through apt's own client: a deb-src entry for the same
# registry (site and release) as the system's deb entries, kept in a private
# sources file and lists directory under the cache (the system's apt
# configuration is not changed), then `apt-get source --download-only
# trilinos`, whose files apt checks against the signed index. Only the
# packages/kokkos and packages/kokkos-kernels subtrees are extracted; the
# tarball is deleted afterwards. Nothing of this enters weft's repository.
#
# The install goes to ${WEFT_KOKKOS_CACHE:-/var/cache/weft}/kokkos-<version>-openmp-<hash>,
# where <hash> covers the build flags, the compiler and this script's
# recipe version, and is kept between runs: a prefix with its completion
# stamp is used as it is, with no network access. Concurrent runs on one
# machine take a lock on the prefix. If the source registry cannot be
# reached, the script fails and says so (exit status 3): CI must show a
# missing backend, not skip it.
#
# Kept small: Release at -O2, shared libraries, no tests or examples, Kokkos
# Kernels with no explicit instantiations (programs instantiate what they
# call from its headers, as weft's float products already do with Debian's
# double-only instantiations) and the BLAS TPL (OpenBLAS), so gemm on float
# and double reaches the vendor BLAS as with Debian's Kokkos Kernels.
# Progress goes to stderr; stdout gets only the prefix. Jobs: WEFT_CI_JOBS
# (default: the core count).
set -euo pipefail

kokkos_version=3.4.01          # the Kokkos of Trilinos 13.2 (checked after extraction)
trilinos_version=13.2.0        # Debian bookworm's trilinos source package
recipe=1                       # bump when the build below changes in a way the flags do not show
cache="${WEFT_KOKKOS_CACHE:-/var/cache/weft}"
jobs="${WEFT_CI_JOBS:-$(nproc 2> /dev/null || echo 2)}"
cxx="${CXX:-g++}"

log() { echo "build_kokkos_debian.sh: $*" >&2; }
die() { log "$1"; exit "${2:-1}"; }

only_prefix=0
case "${1:-}" in
  "") ;;
  --prefix) only_prefix=1 ;;
  -h|--help) awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"; exit 0 ;;
  *) die "unknown argument '$1' (expected --prefix or nothing)" 2 ;;
esac

generator=("Unix Makefiles")
command -v ninja > /dev/null && generator=(Ninja)
common=(-G "${generator[0]}" -DCMAKE_BUILD_TYPE=Release -DCMAKE_CXX_FLAGS_RELEASE="-O2 -DNDEBUG"
        -DCMAKE_CXX_COMPILER="$cxx" -DCMAKE_CXX_STANDARD=17 -DBUILD_SHARED_LIBS=ON)
kokkos_opts=(-DKokkos_ENABLE_SERIAL=ON -DKokkos_ENABLE_OPENMP=ON -DKokkos_ENABLE_TESTS=OFF
             -DKokkos_ENABLE_EXAMPLES=OFF)
# No explicit instantiations at all (every INST_* off), the BLAS TPL on
# OpenBLAS, no LAPACK (weft calls no LAPACK routine through Kokkos Kernels).
kernels_opts=(-DKokkosKernels_ENABLE_TESTS=OFF -DKokkosKernels_ENABLE_EXAMPLES=OFF
              -DKokkosKernels_ENABLE_PERFTESTS=OFF
              -DKokkosKernels_INST_DOUBLE=OFF -DKokkosKernels_INST_FLOAT=OFF
              -DKokkosKernels_INST_COMPLEX_DOUBLE=OFF -DKokkosKernels_INST_COMPLEX_FLOAT=OFF
              -DKokkosKernels_INST_LAYOUTLEFT=OFF -DKokkosKernels_INST_LAYOUTRIGHT=OFF
              -DKokkosKernels_INST_ORDINAL_INT=OFF -DKokkosKernels_INST_ORDINAL_INT64_T=OFF
              -DKokkosKernels_INST_OFFSET_INT=OFF -DKokkosKernels_INST_OFFSET_SIZE_T=OFF
              -DKokkosKernels_INST_EXECSPACE_SERIAL=OFF -DKokkosKernels_INST_EXECSPACE_OPENMP=OFF
              -DKokkosKernels_ENABLE_TPL_BLAS=ON -DBLAS_LIBRARIES=openblas
              -DKokkosKernels_ENABLE_TPL_LAPACK=OFF)
compiler_id="$("$cxx" --version 2> /dev/null | head -1)" || die "compiler '$cxx' not found"
key="$(printf '%s\n' "$recipe" "$trilinos_version" "$compiler_id" "${common[@]}" "${kokkos_opts[@]}" "${kernels_opts[@]}" |
       sha256sum | cut -c1-12)"
prefix="$cache/kokkos-${kokkos_version}-openmp-${key}"
stamp="$prefix/.weft-build-complete"

if (( only_prefix )); then echo "$prefix"; exit 0; fi

mkdir -p "$cache"
exec 9> "$cache/.lock-$(basename "$prefix")"
if ! flock -n 9; then
  log "another run is building $prefix; waiting for it"
  flock 9
fi
if [[ -f "$stamp" ]]; then
  log "using $prefix (built $(cat "$stamp")); nothing to build"
  echo "$prefix"
  exit 0
fi

now() { date +%s; }
t_start=$(now)
work="$cache/build-$(basename "$prefix")"
rm -rf "$work" "$prefix"
mkdir -p "$work/apt/lists/partial" "$work/download"

# The deb-src entry: the site of the system's deb entry for its own release.
codename="$(. /etc/os-release 2> /dev/null && echo "${VERSION_CODENAME:-}")"
[[ -n "$codename" ]] || die "cannot tell the Debian release (no VERSION_CODENAME in /etc/os-release)"
site="$(apt-get indextargets --format '$(SITE)' "Created-By: Packages" "Release: $codename" "Target-Of: deb" 2> /dev/null |
        head -1)"
[[ -n "$site" ]] || die "no deb entry for '$codename' in apt's sources, so no registry to ask for the trilinos sources"
{
  echo "Types: deb-src"
  echo "URIs: $site"
  echo "Suites: $codename"
  echo "Components: main"
  [[ -f /usr/share/keyrings/debian-archive-keyring.gpg ]] && echo "Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg"
} > "$work/apt/deb-src.sources"
apt_opts=(-o "Dir::Etc::sourcelist=$work/apt/deb-src.sources" -o Dir::Etc::sourceparts=-
          -o "Dir::State::Lists=$work/apt/lists" -o APT::Get::List-Cleanup=0)
log "deb-src $site $codename main (private sources file $work/apt/deb-src.sources)"
unreachable() {
  die "FAILED: Debian's source registry ($site, deb-src $codename) could not be reached or does not serve trilinos $trilinos_version; the kokkos-openmp variant needs it ($1)" 3
}
t0=$(now)
apt-get "${apt_opts[@]}" -q update >&2 || unreachable "apt-get update failed"
# Only the sources index matters: an index that failed to download leaves apt-get update
# with status 0 and a warning.
compgen -G "$work/apt/lists/*_source_Sources*" > /dev/null || unreachable "no Sources index was downloaded"
(cd "$work/download" && apt-get "${apt_opts[@]}" -q source --download-only trilinos >&2) ||
  unreachable "apt-get source --download-only trilinos failed"
tarball="$work/download/trilinos_${trilinos_version}.orig.tar.gz"
[[ -f "$tarball" ]] || unreachable "got $(ls "$work/download" | tr '\n' ' '), not trilinos_${trilinos_version}.orig.tar.gz"
t1=$(now)
log "downloaded $(du -h "$tarball" | cut -f1) in $((t1 - t0)) s; extracting packages/kokkos and packages/kokkos-kernels"
mkdir -p "$work/src"
tar -C "$work/src" --strip-components=2 -xzf "$tarball" --wildcards '*/packages/kokkos/*' '*/packages/kokkos-kernels/*'
rm -rf "$work/download"
src="$work/src"
found="$(sed -n 's/^set(Kokkos_VERSION_\(MAJOR\|MINOR\|PATCH\) \([0-9]*\))$/\2/p' "$src/kokkos/CMakeLists.txt" | paste -sd.)"
[[ "$found" == "$kokkos_version" ]] || die "trilinos $trilinos_version holds Kokkos '$found', not $kokkos_version; update this script"

log "Kokkos $kokkos_version (Serial + OpenMP) into $prefix"
t2=$(now)
cmake -S "$src/kokkos" -B "$work/kokkos" "${common[@]}" -DCMAKE_INSTALL_PREFIX="$prefix" "${kokkos_opts[@]}" >&2
cmake --build "$work/kokkos" -j "$jobs" >&2
cmake --install "$work/kokkos" >&2
t3=$(now)
log "Kokkos Kernels $kokkos_version into $prefix"
cmake -S "$src/kokkos-kernels" -B "$work/kokkos-kernels" "${common[@]}" -DCMAKE_INSTALL_PREFIX="$prefix" \
      -DKokkos_ROOT="$prefix" "${kernels_opts[@]}" >&2
cmake --build "$work/kokkos-kernels" -j "$jobs" >&2
cmake --install "$work/kokkos-kernels" >&2
t4=$(now)
rm -rf "$work"
date -u +%Y-%m-%dT%H:%M:%SZ > "$stamp"
log "done: sources $((t1 - t0)) s, Kokkos $((t3 - t2)) s, Kokkos Kernels $((t4 - t3)) s, total $((t4 - t_start)) s"
echo "$prefix"
