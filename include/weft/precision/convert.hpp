// Element-type conversion of whole Kokkos views -- fp32 <-> bf16 / fp16 (and
// double) -- in a parallel_for on the views' execution space: how masters
// become compute copies, and how 2-byte data is widened for a reduction.
#pragma once

#include <Kokkos_Core.hpp>

#include <cstddef>
#include <cstdint>
#include <string>
#include <type_traits>
#include <utility>

#include <weft/core/allocation.hpp>
#include <weft/core/error.hpp>
#include <weft/core/half.hpp>
#include <weft/core/kokkos_compat.hpp>

namespace weft {

/// The element types convert() reads and writes: float, double, bf16, fp16.
template <class T>
inline constexpr bool is_convertible_element_v = std::is_same_v<std::remove_cv_t<T>, float> ||
                                                 std::is_same_v<std::remove_cv_t<T>, double> ||
                                                 is_reduced_precision_v<T>;

namespace detail {

// One element: D(s) rounds once in every pair (bf16 and fp16 from double
// included, see half.hpp), and widening is exact.
template <class D, class S>
KOKKOS_INLINE_FUNCTION D convert_element(const S& s) {
  if constexpr (std::is_same_v<D, S>) return s;
  else return static_cast<D>(s);
}

template <class Dst, class Src>
std::string convert_extents_text(const Dst& dst, const Src& src) {
  std::string d, s;
  for (std::size_t r = 0; r < std::size_t(Dst::rank); ++r) {
    d += (r ? " x " : "") + std::to_string(dst.extent(r));
    s += (r ? " x " : "") + std::to_string(src.extent(r));
  }
  return "dst '" + dst.label() + "' is " + d + ", src '" + src.label() + "' is " + s;
}

template <class T, std::size_t N>
struct add_pointers {
  using type = typename add_pointers<T, N - 1>::type*;
};
template <class T>
struct add_pointers<T, 0> {
  using type = T;
};

template <class V, class Src, std::size_t... R>
V allocate_like(const Src& src, const std::string& label, std::index_sequence<R...>) {
  return allocate_view<V>(label, src.extent(R)...);
}

}  // namespace detail

/// dst(i...) = src(i...) converted to dst's element type, for every index:
/// float to bf16 or fp16 rounds to nearest even (NaN, infinities and
/// overflow as in core/half.hpp), double to either rounds once, and every
/// widening is exact. Runs as a parallel_for on dst's execution space (a
/// flat loop over the memory when both views are contiguous with the same
/// layout, an MDRange otherwise) and returns without a fence, like
/// Kokkos::deep_copy on an execution space instance: fence before the host
/// reads a device result. Both views must be accessible from that space
/// (compile-time check) and have the same rank and extents (ShapeError
/// naming both). Ranks 1-3 take any layout, higher ranks contiguous views.
template <KokkosView Dst, KokkosView Src>
void convert(const Dst& dst, const Src& src) {
  using D = typename Dst::non_const_value_type;
  using S = typename Src::non_const_value_type;
  using Exec = typename Dst::execution_space;
  // Kokkos 3.4's rank is an unnamed enum per view type: compare it as a number.
  constexpr std::size_t rank = std::size_t(Dst::rank);
  static_assert(std::is_same_v<typename Dst::value_type, D>,
                "weft::convert(dst, src): dst is a view of const elements; it is written");
  static_assert(is_convertible_element_v<D> && is_convertible_element_v<S>,
                "weft::convert(dst, src): both element types must be float, double, weft::bf16 or weft::fp16");
  static_assert(rank == std::size_t(Src::rank), "weft::convert(dst, src): the views must have the same rank");
  static_assert(Kokkos::SpaceAccessibility<Exec, typename Src::memory_space>::accessible,
                "weft::convert(dst, src): src's memory is not accessible from dst's execution space; deep_copy src "
                "into dst's memory space first (Kokkos::create_mirror_view_and_copy)");
  for (std::size_t r = 0; r < rank; ++r)
    WEFT_REQUIRE(dst.extent(r) == src.extent(r), ShapeError,
                 "weft::convert(dst, src): the views' extents differ (", detail::convert_extents_text(dst, src),
                 "); allocate dst with src's extents");
  if (dst.size() == 0) return;

  constexpr bool same_layout = std::is_same_v<typename Dst::array_layout, typename Src::array_layout>;
  if (same_layout && dst.span_is_contiguous() && src.span_is_contiguous() && dst.span() == dst.size() &&
      src.span() == src.size()) {
    // Same layout and dense: element k of one is element k of the other.
    D* out = dst.data();
    const S* in = src.data();
    Kokkos::parallel_for(
        "weft::convert", Kokkos::RangePolicy<Exec, Kokkos::IndexType<std::int64_t>>(0, std::int64_t(dst.size())),
        KOKKOS_LAMBDA(const std::int64_t k) { out[k] = detail::convert_element<D>(in[k]); });
    return;
  }
  if constexpr (rank == 1) {
    Kokkos::parallel_for(
        "weft::convert", Kokkos::RangePolicy<Exec, Kokkos::IndexType<std::int64_t>>(0, std::int64_t(dst.extent(0))),
        KOKKOS_LAMBDA(const std::int64_t i) { dst(i) = detail::convert_element<D>(src(i)); });
  } else if constexpr (rank == 2) {
    Kokkos::parallel_for(
        "weft::convert",
        Kokkos::MDRangePolicy<Exec, Kokkos::Rank<2>, Kokkos::IndexType<std::int64_t>>(
            {0, 0}, {std::int64_t(dst.extent(0)), std::int64_t(dst.extent(1))}),
        KOKKOS_LAMBDA(const std::int64_t i, const std::int64_t j) {
          dst(i, j) = detail::convert_element<D>(src(i, j));
        });
  } else if constexpr (rank == 3) {
    Kokkos::parallel_for(
        "weft::convert",
        Kokkos::MDRangePolicy<Exec, Kokkos::Rank<3>, Kokkos::IndexType<std::int64_t>>(
            {0, 0, 0}, {std::int64_t(dst.extent(0)), std::int64_t(dst.extent(1)), std::int64_t(dst.extent(2))}),
        KOKKOS_LAMBDA(const std::int64_t i, const std::int64_t j, const std::int64_t k) {
          dst(i, j, k) = detail::convert_element<D>(src(i, j, k));
        });
  } else {
    WEFT_REQUIRE(false, ShapeError, "weft::convert(dst, src): views of rank ", rank,
                 " are converted only when both are contiguous with the same layout (",
                 detail::convert_extents_text(dst, src), "); deep_copy them into contiguous views first");
  }
}

/// v(i, j) = v(i, j) rounded to H (weft::bf16 or weft::fp16, to nearest
/// even) and widened back, in place, for a rank-2 view of float or double:
/// what a 2-byte store followed by a load gives, without the 2-byte copy.
/// Runs on v's execution space without a fence, like convert().
template <class H, KokkosView V>
void round_through(const V& v) {
  using E = typename V::value_type;
  using Exec = typename V::execution_space;
  static_assert(is_reduced_precision_v<H>, "weft::round_through<H>(v): H must be weft::bf16 or weft::fp16");
  static_assert(std::size_t(V::rank) == 2 && (std::is_same_v<E, float> || std::is_same_v<E, double>),
                "weft::round_through<H>(v): v must be a rank-2 view of (non-const) float or double");
  if (v.size() == 0) return;
  Kokkos::parallel_for(
      "weft::round_through",
      Kokkos::MDRangePolicy<Exec, Kokkos::Rank<2>, Kokkos::IndexType<std::int64_t>>(
          {0, 0}, {std::int64_t(v.extent(0)), std::int64_t(v.extent(1))}),
      KOKKOS_LAMBDA(const std::int64_t i, const std::int64_t j) {
        v(i, j) = E(float(detail::convert_element<H>(v(i, j))));
      });
}

/// A new view of element type T with src's extents, layout and memory space
/// (LayoutRight for a LayoutStride src), allocated through allocate_view
/// under `label` and filled by convert(result, src):
///
///   auto compute = weft::converted<weft::bf16>(master, "compute_copy");
template <class T, KokkosView Src>
auto converted(const Src& src, const std::string& label) {
  using Layout = std::conditional_t<std::is_same_v<typename Src::array_layout, Kokkos::LayoutStride>,
                                    Kokkos::LayoutRight, typename Src::array_layout>;
  using V = Kokkos::View<typename detail::add_pointers<T, std::size_t(Src::rank)>::type, Layout,
                         typename Src::memory_space>;
  V out = detail::allocate_like<V>(src, label, std::make_index_sequence<std::size_t(Src::rank)>{});
  convert(out, src);
  return out;
}

}  // namespace weft
