// The version of weft and the backends this translation unit is built for:
// WEFT_ENABLE_<BACKEND> mirrors Kokkos' KOKKOS_ENABLE_<BACKEND> macros so that
// weft code never tests Kokkos' macros directly.
#pragma once

#include <Kokkos_Core.hpp>
#include <weft/config.hpp>

#if defined(KOKKOS_ENABLE_SERIAL)
#define WEFT_ENABLE_SERIAL 1
#endif
#if defined(KOKKOS_ENABLE_OPENMP)
#define WEFT_ENABLE_OPENMP 1
#endif
#if defined(KOKKOS_ENABLE_CUDA)
#define WEFT_ENABLE_CUDA 1
#endif
#if defined(KOKKOS_ENABLE_HIP)
#define WEFT_ENABLE_HIP 1
#endif

namespace weft {
/// weft's version, "major.minor.patch".
inline constexpr const char* version_string = WEFT_VERSION_STRING;
/// The git commit weft was configured from (e.g. "fa5accd...", "...-dirty", or "unknown").
inline constexpr const char* git_commit = WEFT_GIT_COMMIT;
/// Kokkos' version as Kokkos encodes it (major*10000 + minor*100 + patch).
inline constexpr int kokkos_version = KOKKOS_VERSION;
}  // namespace weft
