// Mesh axis tags. An axis tag is any type with a `static constexpr
// std::string_view name`; weft provides the five strategies' axes, and users
// can declare their own the same way.
#pragma once

#include <concepts>
#include <cstddef>
#include <limits>
#include <string_view>

namespace weft {

/// An axis tag: a type with a static `name` convertible to std::string_view.
template <class T>
concept AxisTag = requires {
  { T::name } -> std::convertible_to<std::string_view>;
};

/// Data-parallel axis (batch split; gradients reduced over it).
struct DP {
  static constexpr std::string_view name = "dp";
};
/// Tensor-parallel axis (matrix dimensions inside a layer split over it).
struct TP {
  static constexpr std::string_view name = "tp";
};
/// Pipeline-parallel axis (groups of layers on different ranks).
struct PP {
  static constexpr std::string_view name = "pp";
};
/// Context-parallel axis (the sequence dimension split inside attention).
struct CP {
  static constexpr std::string_view name = "cp";
};
/// Expert-parallel axis (mixture-of-experts experts split over it).
struct EP {
  static constexpr std::string_view name = "ep";
};

/// Marks an extent known only at run time, as std::dynamic_extent does for mdspan.
inline constexpr std::size_t dynamic_extent = std::numeric_limits<std::size_t>::max();

/// An axis with a static extent N (or dynamic_extent): Mesh<Axis<TP, 2>, DP>.
/// A bare tag in a Mesh is an axis of dynamic extent.
template <AxisTag Tag, std::size_t N = dynamic_extent>
struct Axis {
  using tag = Tag;
  static constexpr std::size_t static_extent = N;
  static_assert(N == dynamic_extent || N >= 1, "weft::Axis: a static axis extent must be at least 1");
};

namespace detail {
template <class A>
struct axis_traits {
  static_assert(AxisTag<A>,
                "weft::Mesh: every mesh axis must be an axis tag (a type with `static constexpr std::string_view "
                "name`, such as weft::DP) or weft::Axis<Tag, N>");
  using tag = A;
  static constexpr std::size_t static_extent = dynamic_extent;
};
template <class Tag, std::size_t N>
struct axis_traits<Axis<Tag, N>> {
  using tag = Tag;
  static constexpr std::size_t static_extent = N;
};
}  // namespace detail

/// The tag of a mesh axis specification (Tag or Axis<Tag, N>).
template <class A>
using axis_tag_t = typename detail::axis_traits<A>::tag;

}  // namespace weft
