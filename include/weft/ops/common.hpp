// Shared vocabulary of weft's kernels: the view shapes they take (row-major
// matrices of tokens x features), the shape checks that turn a mismatch into a
// weft::ShapeError, and a math shim over Kokkos 3.4 / 4.x spellings.
#pragma once

#include <Kokkos_Core.hpp>
#include <cstddef>
#include <string>

#include <weft/core/error.hpp>
#include <weft/core/kokkos_compat.hpp>

namespace weft::ops {

/// A row-major matrix: rows are tokens (or heads x tokens), columns features.
/// LayoutRight because the BLAS path of Kokkos Kernels takes all-LayoutRight
/// (or all-LayoutLeft) operands, and row slices of it stay LayoutRight.
template <class T, class Space = Kokkos::DefaultExecutionSpace>
using Matrix = Kokkos::View<T**, Kokkos::LayoutRight, Space>;

/// A vector of features (bias, norm scale) or per-row statistics.
template <class T, class Space = Kokkos::DefaultExecutionSpace>
using Vector = Kokkos::View<T*, Space>;

/// A stack of row-major matrices [batch, rows, cols] (attention scores per head).
template <class T, class Space = Kokkos::DefaultExecutionSpace>
using Tensor3 = Kokkos::View<T***, Kokkos::LayoutRight, Space>;

/// Token ids.
template <class Space = Kokkos::DefaultExecutionSpace>
using Tokens = Kokkos::View<int*, Space>;

namespace detail {

/// The execution space a kernel on view V runs in.
template <class V>
using exec_t = typename std::remove_cvref_t<V>::execution_space;

template <class V>
Kokkos::RangePolicy<exec_t<V>> range(const V&, std::size_t n) {
  return Kokkos::RangePolicy<exec_t<V>>(0, n);
}

template <class V>
std::string shape_string(const V& v) {
  std::string s = "[";
  for (unsigned r = 0; r < V::rank; ++r) s += (r ? ", " : "") + std::to_string(v.extent(r));
  return s + "]";
}

/// Throws ShapeError unless v's extent along `dim` is `expected`.
template <class V>
void require_extent(const char* op, const char* arg, const V& v, unsigned dim, std::size_t expected) {
  WEFT_REQUIRE(v.extent(dim) == expected, ShapeError, op, ": ", arg, " (label '", v.label(), "') has shape ",
               shape_string(v), " but its dimension ", dim, " must be ", expected,
               "; allocate it with the matching size");
}

}  // namespace detail

/// Device-safe math functions (Kokkos 3.4 keeps them in Kokkos::Experimental).
namespace math {
#if KOKKOS_VERSION >= 40000
using Kokkos::cos;
using Kokkos::exp;
using Kokkos::log;
using Kokkos::sin;
using Kokkos::sqrt;
using Kokkos::tanh;
using Kokkos::pow;
#else
using Kokkos::Experimental::cos;
using Kokkos::Experimental::exp;
using Kokkos::Experimental::log;
using Kokkos::Experimental::sin;
using Kokkos::Experimental::sqrt;
using Kokkos::Experimental::tanh;
using Kokkos::Experimental::pow;
#endif
}  // namespace math

}  // namespace weft::ops
