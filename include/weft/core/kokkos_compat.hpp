// Shims over the differences between Kokkos 3.4 (Debian) and Kokkos 4.x, and
// small view traits weft uses everywhere (host accessibility, element types).
#pragma once

#include <Kokkos_Core.hpp>
#include <type_traits>

namespace weft {

/// True for Kokkos::View types.
template <class V>
concept KokkosView = Kokkos::is_view<std::remove_cvref_t<V>>::value;

/// True when host code may read the view's memory directly.
template <class V>
inline constexpr bool host_accessible_v =
    Kokkos::SpaceAccessibility<Kokkos::HostSpace, typename std::remove_cvref_t<V>::memory_space>::accessible;

/// The view's element type without const.
template <class V>
using element_t = typename std::remove_cvref_t<V>::non_const_value_type;

namespace detail {

inline bool kokkos_is_initialized() { return Kokkos::is_initialized(); }

// Kokkos::is_finalized arrived in 3.7; before that weft tracks it itself.
inline bool& kokkos_finalized_by_weft() {
  static bool flag = false;
  return flag;
}
inline bool kokkos_is_finalized() {
#if KOKKOS_VERSION >= 30700
  return Kokkos::is_finalized();
#else
  return kokkos_finalized_by_weft();
#endif
}

}  // namespace detail
}  // namespace weft
