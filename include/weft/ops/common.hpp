// Shared vocabulary of weft's kernels: the view shapes they take (row-major
// matrices of tokens x features), the shape checks that turn a mismatch into a
// weft::ShapeError, the element-type rules of mixed precision (compute_t,
// load, store), and a math shim over Kokkos 3.4 / 4.x spellings.
#pragma once

#include <Kokkos_Core.hpp>
#include <cstddef>
#include <string>
#include <type_traits>

#include <weft/core/error.hpp>
#include <weft/core/half.hpp>
#include <weft/core/kokkos_compat.hpp>

/// WEFT_UNROLL(n) before a loop asks GCC and Clang to unroll it n times
/// (`#pragma GCC unroll n`), which host kernels use to keep small
/// accumulator arrays in registers at -O2. nvcc and hipcc reject that
/// pragma, so under them it expands to nothing.
#if defined(__NVCC__) || defined(__CUDACC__) || defined(__HIPCC__)
#define WEFT_UNROLL(n)
#else
#define WEFT_PRAGMA_(x) _Pragma(#x)
#define WEFT_UNROLL(n) WEFT_PRAGMA_(GCC unroll n)
#endif

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

/// The element type of view V, without const.
template <class V>
using value_t = typename std::remove_cvref_t<V>::non_const_value_type;

/// The type a kernel over views Vs computes in: the widest accumulation
/// type of their elements (weft::accumulation_t), so float for bf16 and
/// fp16 views, float for float views and double for double views. A kernel
/// reads every element into it (exactly: widening) and rounds once when it
/// stores into a narrower view; with views of one type nothing converts, so
/// fp32 and double results are those of a kernel written for that type.
template <class... Vs>
using compute_t = std::common_type_t<accumulation_t<value_t<Vs>>...>;

/// x read as the compute type A: exact for bf16/fp16 -> float and float -> double.
template <class A, class X>
KOKKOS_FORCEINLINE_FUNCTION A load(const X& x) {
  return static_cast<A>(x);
}

/// a stored as element type S: rounded once to nearest even (bf16, fp16),
/// unchanged when S is a's own type.
template <class S, class A>
KOKKOS_FORCEINLINE_FUNCTION S store(const A& a) {
  return static_cast<S>(a);
}

/// Whether views of element type S are written by a kernel computing in A
/// without rounding (S is A): then a kernel may keep intermediate results
/// in the output view; otherwise it must keep them in A and store once.
template <class S, class A>
inline constexpr bool stores_exactly_v = std::is_same_v<std::remove_cv_t<S>, A>;

template <class V>
Kokkos::RangePolicy<exec_t<V>> range(const V&, std::size_t n) {
  return Kokkos::RangePolicy<exec_t<V>>(0, n);
}

template <class V>
std::string shape_string(const V& v) {
  std::string s = "[";
  for (unsigned r = 0; r < V::rank; ++r) {
    if (r) s += ", ";
    s += std::to_string(v.extent(r));
  }
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

/// exp for the kernels' hot loops. For float, a Cody-Waite reduction and the
/// Cephes degree-6 polynomial (about 2 ulp) written without calls or
/// branches, so that compilers vectorise the loops around it (a call to libm's
/// expf keeps them scalar). For double, std-accurate exp: the gradient tests
/// run in double and compare to 1e-6.
template <class T>
KOKKOS_INLINE_FUNCTION T fast_exp(T x) {
#if defined(__CUDA_ARCH__) || defined(__HIP_DEVICE_COMPILE__)
  return exp(x);  // GPU exp is a fast hardware path already
#else
  if constexpr (std::is_same_v<T, float>) {
    // Clamp to the range where 2^n is a normal float. The selects are done on
    // the bit patterns: a float select counts as control flow to the
    // vectoriser unless -fno-trapping-math, which weft cannot ask of users.
    // A NaN is computed as 0 and returned as NaN at the end: converting it
    // to int below would be undefined (a diverged run's NaNs must come out).
    const int nan = -int(x != x);
    {
      const int lo = -int(x < -87.0f), hi = -int(x > 88.0f);
      int b = __builtin_bit_cast(int, x) & ~nan;
      b = (b & ~lo) | (__builtin_bit_cast(int, -87.0f) & lo);
      b = (b & ~hi) | (__builtin_bit_cast(int, 88.0f) & hi);
      x = __builtin_bit_cast(float, b);
    }
    // Round x log2(e) to the nearest integer with the 1.5 * 2^23 trick.
    float n = x * 1.44269504088896341f + 12582912.0f;
    n -= 12582912.0f;
    const float f = (x - n * 0.693359375f) - n * -2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * f + 1.3981999507e-3f;
    p = p * f + 8.3334519073e-3f;
    p = p * f + 4.1665795894e-2f;
    p = p * f + 1.6666665459e-1f;
    p = p * f + 5.0000001201e-1f;
    const float y = p * f * f + f + 1.0f;
    const int bits = (int(n) + 127) << 23;
    const int r = __builtin_bit_cast(int, y * __builtin_bit_cast(float, bits));
    return __builtin_bit_cast(float, (r & ~nan) | (0x7fc00000 & nan));
  } else {
    return exp(x);
  }
#endif
}

/// sqrt for hot loops. For float on the host, the classic reciprocal square
/// root estimate refined by three Newton steps (relative error near float
/// rounding), because libm's sqrtf keeps errno semantics that stop compilers
/// from vectorising the loop. Exact sqrt otherwise.
template <class T>
KOKKOS_INLINE_FUNCTION T fast_sqrt(T x) {
#if defined(__CUDA_ARCH__) || defined(__HIP_DEVICE_COMPILE__)
  return sqrt(x);
#else
  if constexpr (std::is_same_v<T, float>) {
    float y = __builtin_bit_cast(float, 0x5f3759df - (__builtin_bit_cast(int, x) >> 1));
    const float h = 0.5f * x;
    y = y * (1.5f - h * y * y);
    y = y * (1.5f - h * y * y);
    y = y * (1.5f - h * y * y);
    return x * y;  // x = 0 gives 0: y stays finite
  } else {
    return sqrt(x);
  }
#endif
}
}  // namespace math

namespace detail {
/// Columns per thread of the column reductions: wide enough for SIMD and
/// cache lines, and the same on every backend so sums keep their order.
inline constexpr std::size_t column_chunk = 32;

/// Partial sums kept by the row reductions below: one AVX-512 register of
/// floats. Without -ffast-math a compiler keeps a plain `s += x[j]` loop in
/// source order (one add at a time) and does not vectorise a running maximum
/// at all; with this many independent partials, combined in a fixed order at
/// the end, it does both, and the result is still the same on every run and
/// thread count.
inline constexpr std::size_t row_lanes = 16;

/// acc[k] += acc[k + W] for k < W, then the same for W / 2, ..., 1: the
/// partial sums folded in a fixed order. Each step has a constant trip
/// count, so a compiler vectorises it; a loop over W it left scalar, which
/// cost a short dot product (a head's 32 or 64 elements) more than its
/// multiplies.
template <std::size_t W, class T>
KOKKOS_INLINE_FUNCTION void fold_lanes(T* acc) {
  if constexpr (W > 0) {
    for (std::size_t k = 0; k < W; ++k) acc[k] += acc[k + W];
    fold_lanes<W / 2>(acc);
  }
}

/// sum_j f(j) for j in [0, n) with row_lanes partial sums.
template <class T, class F>
KOKKOS_INLINE_FUNCTION T lane_sum(std::size_t n, const F& f) {
  T acc[row_lanes] = {};
  std::size_t j = 0;
  for (; j + row_lanes <= n; j += row_lanes)
    for (std::size_t k = 0; k < row_lanes; ++k) acc[k] += f(j + k);
  for (std::size_t k = 0; j + k < n; ++k) acc[k] += f(j + k);
  fold_lanes<row_lanes / 2>(acc);
  return acc[0];
}

/// Element-wise row kernels over n elements, in blocks of row_lanes and then
/// the rest: y = a x (row_scale_to), y += a x (row_axpy), y *= a
/// (row_scale). At -O2 the compiler's cheap cost model leaves a plain loop
/// of unknown trip count scalar; these blocks it vectorises, given that y
/// and x do not overlap (`__restrict`, which the callers must honour).
template <class T>
KOKKOS_INLINE_FUNCTION void row_scale_to(T* __restrict y, const T* __restrict x, T a, std::size_t n) {
  std::size_t j = 0;
  for (; j + row_lanes <= n; j += row_lanes)
    for (std::size_t k = 0; k < row_lanes; ++k) y[j + k] = a * x[j + k];
  for (; j < n; ++j) y[j] = a * x[j];
}
/// See row_scale_to; x may be of a narrower type than y (read as T).
template <class T, class X>
KOKKOS_INLINE_FUNCTION void row_axpy(T* __restrict y, const X* __restrict x, T a, std::size_t n) {
  std::size_t j = 0;
  for (; j + row_lanes <= n; j += row_lanes)
    for (std::size_t k = 0; k < row_lanes; ++k) y[j + k] += a * load<T>(x[j + k]);
  for (; j < n; ++j) y[j] += a * load<T>(x[j]);
}
/// See row_scale_to.
template <class T>
KOKKOS_INLINE_FUNCTION void row_scale(T* __restrict y, T a, std::size_t n) {
  std::size_t j = 0;
  for (; j + row_lanes <= n; j += row_lanes)
    for (std::size_t k = 0; k < row_lanes; ++k) y[j + k] *= a;
  for (; j < n; ++j) y[j] *= a;
}

/// max_j f(j) for j in [0, n), n >= 1, with row_lanes partial maxima.
template <class T, class F>
KOKKOS_INLINE_FUNCTION T lane_max(std::size_t n, const F& f) {
  T acc[row_lanes];
  const T first = f(0);
  for (std::size_t k = 0; k < row_lanes; ++k) acc[k] = first;
  std::size_t j = 0;
  for (; j + row_lanes <= n; j += row_lanes)
    for (std::size_t k = 0; k < row_lanes; ++k) {
      const T v = f(j + k);
      acc[k] = v > acc[k] ? v : acc[k];
    }
  for (std::size_t k = 0; j + k < n; ++k) {
    const T v = f(j + k);
    acc[k] = v > acc[k] ? v : acc[k];
  }
  for (std::size_t w = row_lanes / 2; w > 0; w /= 2)
    for (std::size_t k = 0; k < w; ++k) acc[k] = acc[k + w] > acc[k] ? acc[k + w] : acc[k];
  return acc[0];
}

/// Throws ShapeError unless the rows of v are contiguous (stride 1 along
/// dimension `dim`), as the kernels that walk a row through a pointer need.
template <class V>
void require_contiguous_rows(const char* op, const char* arg, const V& v, unsigned dim) {
  WEFT_REQUIRE(v.extent(dim) <= 1 || v.stride(dim) == 1, ShapeError, op, ": ", arg, " (label '", v.label(),
               "') must have contiguous rows (LayoutRight or a column range of it)");
}
}  // namespace detail

}  // namespace weft::ops
