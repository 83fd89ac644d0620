// Element-wise kernels of the transformer and their backward passes: bias add
// and its column-sum gradient, residual add, tanh-approximated GELU and SwiGLU.
// Column reductions loop over rows inside one thread per column so that the
// result does not depend on how many threads run (bit-reproducible training).
//
// Mixed precision: every view may hold bf16 or fp16 (activations) or float
// (biases and their gradients); each kernel computes in detail::compute_t of
// its views (float for 2-byte types), reads convert exactly and every write
// rounds once. Column sums (bias gradients) are accumulated in float and
// added to the gradient view once per call.
#pragma once

#include <weft/ops/common.hpp>

namespace weft::ops {

/// y(i, j) += b(j): the bias of a Linear layer.
template <class YV, class BV>
void bias_add(const YV& y, const BV& b) {
  detail::require_extent("weft::ops::bias_add", "bias", b, 0, y.extent(1));
  const std::size_t n = y.extent(1);
  using T = detail::compute_t<YV, BV>;
  using Y = detail::value_t<YV>;
  Kokkos::parallel_for(
      "weft::bias_add", detail::range(y, y.extent(0)), KOKKOS_LAMBDA(std::size_t i) {
        for (std::size_t j = 0; j < n; ++j) y(i, j) = detail::store<Y>(detail::load<T>(y(i, j)) + detail::load<T>(b(j)));
      });
}

/// db(j) += sum_i dy(i, j): the bias gradient (accumulates, for microbatches).
/// One thread per chunk of columns walks the rows in order: contiguous reads,
/// and a summation order independent of the thread count.
template <class DYV, class DBV>
void bias_backward(const DYV& dy, const DBV& db) {
  detail::require_extent("weft::ops::bias_backward", "bias gradient", db, 0, dy.extent(1));
  const std::size_t rows = dy.extent(0), n = dy.extent(1), C = detail::column_chunk;
  using T = accumulation_t<detail::value_t<DBV>>;
  using DB = detail::value_t<DBV>;
  Kokkos::parallel_for(
      "weft::bias_backward", detail::range(db, (n + C - 1) / C), KOKKOS_LAMBDA(std::size_t c) {
        T acc[detail::column_chunk] = {};
        const std::size_t j0 = c * C, w = n - j0 < C ? n - j0 : C;
        for (std::size_t i = 0; i < rows; ++i)
          for (std::size_t jj = 0; jj < w; ++jj) acc[jj] += detail::load<T>(dy(i, j0 + jj));
        for (std::size_t jj = 0; jj < w; ++jj) db(j0 + jj) = detail::store<DB>(detail::load<T>(db(j0 + jj)) + acc[jj]);
      });
}

/// y = a + b (element-wise, rank 2); y may alias a or b. The residual connection.
template <class YV, class AV, class BV>
void add(const YV& y, const AV& a, const BV& b) {
  detail::require_extent("weft::ops::add", "a", a, 0, y.extent(0));
  detail::require_extent("weft::ops::add", "a", a, 1, y.extent(1));
  detail::require_extent("weft::ops::add", "b", b, 0, y.extent(0));
  detail::require_extent("weft::ops::add", "b", b, 1, y.extent(1));
  const std::size_t n = y.extent(1);
  using T = detail::compute_t<YV, AV, BV>;
  using Y = detail::value_t<YV>;
  Kokkos::parallel_for(
      "weft::add", detail::range(y, y.extent(0)), KOKKOS_LAMBDA(std::size_t i) {
        for (std::size_t j = 0; j < n; ++j)
          y(i, j) = detail::store<Y>(detail::load<T>(a(i, j)) + detail::load<T>(b(i, j)));
      });
}

namespace detail {
// GELU with the tanh approximation (GPT-2's): 0.5 x (1 + tanh(u)),
// u = c (x + 0.044715 x^3). Since 0.5 (1 + tanh(u)) = 1 / (1 + exp(-2u)), it
// costs one exponential and no tanh (libm's tanh is the slowest call here).
template <class T>
KOKKOS_INLINE_FUNCTION T gelu_gate(T x) {
  const T c = T(0.7978845608028654);  // sqrt(2 / pi)
  return T(1) / (T(1) + math::fast_exp(T(-2) * c * (x + T(0.044715) * x * x * x)));
}
template <class T>
KOKKOS_INLINE_FUNCTION T gelu_value(T x) {
  return x * gelu_gate(x);
}
template <class T>
KOKKOS_INLINE_FUNCTION T gelu_derivative(T x) {
  const T c = T(0.7978845608028654);
  const T s = gelu_gate(x);
  return s + x * s * (T(1) - s) * T(2) * c * (T(1) + T(3) * T(0.044715) * x * x);
}
template <class T>
KOKKOS_INLINE_FUNCTION T sigmoid(T x) {
  return T(1) / (T(1) + math::fast_exp(-x));
}
// One row of bias_gelu_forward: u += b, a = gelu(u), n elements, computed
// in T. Blocks of a fixed width and then the rest, on __restrict
// parameters: at -O2 a compiler vectorises the blocks, not a loop of
// unknown trip count, and not this loop written inline in the kernel (its
// pointers are locals). The GELU is taken of u as stored (rounded, for a
// 2-byte u), the value the backward pass reads.
template <class T, class U, class A, class B>
KOKKOS_INLINE_FUNCTION void bias_gelu_row(U* __restrict u, A* __restrict a, const B* __restrict b, std::size_t n) {
  std::size_t j = 0;
  for (; j + row_lanes <= n; j += row_lanes)
    for (std::size_t k = 0; k < row_lanes; ++k) {
      const U x = store<U>(load<T>(u[j + k]) + load<T>(b[j + k]));
      u[j + k] = x;
      a[j + k] = store<A>(gelu_value(load<T>(x)));
    }
  for (; j < n; ++j) {
    const U x = store<U>(load<T>(u[j]) + load<T>(b[j]));
    u[j] = x;
    a[j] = store<A>(gelu_value(load<T>(x)));
  }
}
}  // namespace detail

/// y = gelu(x), tanh approximation. The backward pass needs x (not y).
template <class XV, class YV>
void gelu_forward(const XV& x, const YV& y) {
  detail::require_extent("weft::ops::gelu_forward", "y", y, 0, x.extent(0));
  detail::require_extent("weft::ops::gelu_forward", "y", y, 1, x.extent(1));
  const std::size_t n = x.extent(1);
  using T = detail::compute_t<XV, YV>;
  using Y = detail::value_t<YV>;
  Kokkos::parallel_for(
      "weft::gelu_forward", detail::range(x, x.extent(0)), KOKKOS_LAMBDA(std::size_t i) {
        for (std::size_t j = 0; j < n; ++j) y(i, j) = detail::store<Y>(detail::gelu_value(detail::load<T>(x(i, j))));
      });
}

/// dx = gelu'(x) * dy; dx may alias dy.
template <class DYV, class XV, class DXV>
void gelu_backward(const DYV& dy, const XV& x, const DXV& dx) {
  detail::require_extent("weft::ops::gelu_backward", "dy", dy, 0, x.extent(0));
  detail::require_extent("weft::ops::gelu_backward", "dy", dy, 1, x.extent(1));
  detail::require_extent("weft::ops::gelu_backward", "dx", dx, 0, x.extent(0));
  detail::require_extent("weft::ops::gelu_backward", "dx", dx, 1, x.extent(1));
  const std::size_t n = x.extent(1);
  using T = detail::compute_t<DYV, XV, DXV>;
  using DX = detail::value_t<DXV>;
  Kokkos::parallel_for(
      "weft::gelu_backward", detail::range(x, x.extent(0)), KOKKOS_LAMBDA(std::size_t i) {
        for (std::size_t j = 0; j < n; ++j)
          dx(i, j) = detail::store<DX>(detail::load<T>(dy(i, j)) * detail::gelu_derivative(detail::load<T>(x(i, j))));
      });
}

/// up(i, j) += b(j), then act(i, j) = gelu(up(i, j)): the bias of the MLP's
/// up-projection and its GELU in one pass over the product (up keeps the
/// biased pre-activation, which the backward pass needs). Same values as
/// bias_add followed by gelu_forward.
template <class UV, class BV, class AV>
void bias_gelu_forward(const UV& up, const BV& b, const AV& act) {
  detail::require_extent("weft::ops::bias_gelu_forward", "bias", b, 0, up.extent(1));
  detail::require_extent("weft::ops::bias_gelu_forward", "act", act, 0, up.extent(0));
  detail::require_extent("weft::ops::bias_gelu_forward", "act", act, 1, up.extent(1));
  detail::require_contiguous_rows("weft::ops::bias_gelu_forward", "up", up, 1);
  detail::require_contiguous_rows("weft::ops::bias_gelu_forward", "act", act, 1);
  detail::require_contiguous_rows("weft::ops::bias_gelu_forward", "bias", b, 0);
  const std::size_t n = up.extent(1);
  using T = detail::compute_t<UV, AV>;
  Kokkos::parallel_for(
      "weft::bias_gelu_forward", detail::range(up, up.extent(0)), KOKKOS_LAMBDA(std::size_t i) {
        detail::bias_gelu_row<T>(&up(i, 0), &act(i, 0), b.data(), n);
      });
}

/// dup = gelu'(up) * dact and db += colsum(dup): GELU's backward fused with
/// the bias gradient of the up-projection, so that dup is not read back.
/// Each column still sums its rows in order (as bias_backward does), so db
/// is the same on every run and thread count. dup may alias dact.
template <class DAV, class UV, class DUV, class DBV>
void bias_gelu_backward(const DAV& dact, const UV& up, const DUV& dup, const DBV& db) {
  const std::size_t rows = up.extent(0), n = up.extent(1), C = detail::column_chunk;
  detail::require_extent("weft::ops::bias_gelu_backward", "dact", dact, 0, rows);
  detail::require_extent("weft::ops::bias_gelu_backward", "dact", dact, 1, n);
  detail::require_extent("weft::ops::bias_gelu_backward", "dup", dup, 0, rows);
  detail::require_extent("weft::ops::bias_gelu_backward", "dup", dup, 1, n);
  detail::require_extent("weft::ops::bias_gelu_backward", "bias gradient", db, 0, n);
  using T = detail::compute_t<DAV, UV, DUV>;
  using DU = detail::value_t<DUV>;
  using DB = detail::value_t<DBV>;
  using detail::load;
  Kokkos::parallel_for(
      "weft::bias_gelu_backward", detail::range(up, (n + C - 1) / C), KOKKOS_LAMBDA(std::size_t c) {
        // The bias gradient sums the unrounded d (a 2-byte dup rounds only what it stores).
        T acc[detail::column_chunk] = {};
        const std::size_t j0 = c * C, w = n - j0 < C ? n - j0 : C;
        if (w == C) {  // the common case: a fixed trip count the compiler vectorises fully
          for (std::size_t i = 0; i < rows; ++i)
            for (std::size_t jj = 0; jj < detail::column_chunk; ++jj) {
              const T d = load<T>(dact(i, j0 + jj)) * detail::gelu_derivative(load<T>(up(i, j0 + jj)));
              dup(i, j0 + jj) = detail::store<DU>(d);
              acc[jj] += d;
            }
        } else {
          for (std::size_t i = 0; i < rows; ++i)
            for (std::size_t jj = 0; jj < w; ++jj) {
              const T d = load<T>(dact(i, j0 + jj)) * detail::gelu_derivative(load<T>(up(i, j0 + jj)));
              dup(i, j0 + jj) = detail::store<DU>(d);
              acc[jj] += d;
            }
        }
        for (std::size_t jj = 0; jj < w; ++jj) db(j0 + jj) = detail::store<DB>(load<T>(db(j0 + jj)) + acc[jj]);
      });
}

/// SwiGLU: u is [rows, 2F] holding the gate a = u(:, 0:F) and the value
/// b = u(:, F:2F) side by side (one fused up-projection); y = silu(a) * b, [rows, F].
template <class UV, class YV>
void swiglu_forward(const UV& u, const YV& y) {
  const std::size_t f = y.extent(1);
  detail::require_extent("weft::ops::swiglu_forward", "u", u, 1, 2 * f);
  detail::require_extent("weft::ops::swiglu_forward", "u", u, 0, y.extent(0));
  using T = detail::compute_t<UV, YV>;
  using Y = detail::value_t<YV>;
  Kokkos::parallel_for(
      "weft::swiglu_forward", detail::range(u, u.extent(0)), KOKKOS_LAMBDA(std::size_t i) {
        for (std::size_t j = 0; j < f; ++j) {
          const T a = detail::load<T>(u(i, j));
          y(i, j) = detail::store<Y>(a * detail::sigmoid(a) * detail::load<T>(u(i, f + j)));
        }
      });
}

/// du = d/du of sum(dy * swiglu(u)), [rows, 2F] (overwritten, not accumulated).
template <class DYV, class UV, class DUV>
void swiglu_backward(const DYV& dy, const UV& u, const DUV& du) {
  const std::size_t f = dy.extent(1);
  detail::require_extent("weft::ops::swiglu_backward", "u", u, 1, 2 * f);
  detail::require_extent("weft::ops::swiglu_backward", "du", du, 1, 2 * f);
  detail::require_extent("weft::ops::swiglu_backward", "du", du, 0, u.extent(0));
  using T = detail::compute_t<DYV, UV, DUV>;
  using DU = detail::value_t<DUV>;
  Kokkos::parallel_for(
      "weft::swiglu_backward", detail::range(u, u.extent(0)), KOKKOS_LAMBDA(std::size_t i) {
        for (std::size_t j = 0; j < f; ++j) {
          const T a = detail::load<T>(u(i, j)), b = detail::load<T>(u(i, f + j)), g = detail::load<T>(dy(i, j));
          const T s = detail::sigmoid(a);
          du(i, j) = detail::store<DU>(g * b * s * (T(1) + a * (T(1) - s)));
          du(i, f + j) = detail::store<DU>(g * a * s);
        }
      });
}

}  // namespace weft::ops
