// Matrix products through Kokkos Kernels: C = alpha op(A) op(B) + beta C for
// every transpose case, and a batched form over stacks of matrices (attention
// heads). Operands must share one layout so Kokkos Kernels can hand the call
// to the vendor BLAS (OpenBLAS, cuBLAS) instead of its own generic kernel.
#pragma once

#include <KokkosBlas3_gemm.hpp>
#include <type_traits>

#include <weft/ops/common.hpp>

namespace weft::ops {

/// Whether a gemm on these view types can reach the vendor BLAS in Kokkos
/// Kernels: in 3.4 its BLAS specialisations exist only when A, B and C are all
/// LayoutRight or all LayoutLeft (a LayoutStride operand silently falls back
/// to a generic kernel several times slower).
template <class AV, class BV, class CV>
inline constexpr bool blas_layouts_v =
    std::is_same_v<typename AV::array_layout, typename BV::array_layout> &&
    std::is_same_v<typename AV::array_layout, typename CV::array_layout> &&
    (std::is_same_v<typename AV::array_layout, Kokkos::LayoutRight> ||
     std::is_same_v<typename AV::array_layout, Kokkos::LayoutLeft>);

/// Transpose selector of one gemm operand.
enum class Trans : char { N = 'N', T = 'T' };

/// C = alpha * op(A) * op(B) + beta * C, with op = identity or transpose.
/// Row slices of a LayoutRight matrix (and column ranges of them) stay
/// LayoutRight with their leading dimension, so heads inside a fused QKV
/// matrix can be multiplied without a copy.
template <class AV, class BV, class CV>
void gemm(Trans ta, Trans tb, typename CV::const_value_type alpha, const AV& A, const BV& B,
          typename CV::const_value_type beta, const CV& C) {
  static_assert(AV::rank == 2 && BV::rank == 2 && CV::rank == 2, "weft::ops::gemm takes rank-2 views");
  static_assert(blas_layouts_v<AV, BV, CV>,
                "weft::ops::gemm needs A, B and C in one layout (all LayoutRight or all LayoutLeft) so that Kokkos "
                "Kernels reaches the vendor BLAS; copy the LayoutStride operand into a LayoutRight view first");
  const bool at = ta == Trans::T, bt = tb == Trans::T;
  const std::size_t m = at ? A.extent(1) : A.extent(0);
  const std::size_t k = at ? A.extent(0) : A.extent(1);
  const std::size_t kb = bt ? B.extent(1) : B.extent(0);
  const std::size_t n = bt ? B.extent(0) : B.extent(1);
  WEFT_REQUIRE(k == kb && C.extent(0) == m && C.extent(1) == n, ShapeError, "weft::ops::gemm: op(A) is ", m, "x", k,
               " (A ", detail::shape_string(A), at ? " transposed" : "", "), op(B) is ", kb, "x", n, " (B ",
               detail::shape_string(B), bt ? " transposed" : "", ") and C is ", detail::shape_string(C),
               "; expected op(A) m x k, op(B) k x n and C m x n");
  if (m == 0 || n == 0) return;
  if (k == 0) {
    // BLAS leaves C untouched for k == 0; the product is still beta * C.
    Kokkos::parallel_for(
        "weft::gemm_scale", detail::range(C, m), KOKKOS_LAMBDA(std::size_t i) {
          for (std::size_t j = 0; j < n; ++j) C(i, j) = beta == 0 ? 0 : beta * C(i, j);
        });
    return;
  }
  const char tas[2] = {static_cast<char>(ta), '\0'};
  const char tbs[2] = {static_cast<char>(tb), '\0'};
  KokkosBlas::gemm(tas, tbs, alpha, A, B, beta, C);
}

/// The same product for every matrix of a stack: C[b] = alpha op(A[b]) op(B[b])
/// + beta C[b], for rank-3 views [batch, rows, cols]. It loops over the batch
/// and calls the vendor gemm on each slice; on one CPU thread that is as fast
/// as a batched kernel for attention-sized matrices, since each slice is a
/// full BLAS-3 call.
template <class AV, class BV, class CV>
void gemm_batched(Trans ta, Trans tb, typename CV::const_value_type alpha, const AV& A, const BV& B,
                  typename CV::const_value_type beta, const CV& C) {
  static_assert(AV::rank == 3 && BV::rank == 3 && CV::rank == 3, "weft::ops::gemm_batched takes rank-3 views");
  const std::size_t nb = C.extent(0);
  WEFT_REQUIRE(A.extent(0) == nb && B.extent(0) == nb, ShapeError, "weft::ops::gemm_batched: batch sizes differ: A ",
               detail::shape_string(A), ", B ", detail::shape_string(B), ", C ", detail::shape_string(C),
               "; all three need the same leading extent");
  for (std::size_t b = 0; b < nb; ++b) {
    auto a = Kokkos::subview(A, b, Kokkos::ALL, Kokkos::ALL);
    auto bb = Kokkos::subview(B, b, Kokkos::ALL, Kokkos::ALL);
    auto c = Kokkos::subview(C, b, Kokkos::ALL, Kokkos::ALL);
    gemm(ta, tb, alpha, a, bb, beta, c);
  }
}

}  // namespace weft::ops
