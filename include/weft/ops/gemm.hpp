// Matrix products: C = alpha op(A) op(B) + beta C for every transpose case,
// a batched form over stacks of matrices (attention heads), and the few-row
// products of a decode step. Every product goes to the GEMM provider that
// gemm_provider_t picks at compile time (weft/ops/gemm_provider.hpp): oneDNN
// for float on the host when weft is built with it, Kokkos Kernels (and so
// the vendor BLAS) otherwise.
#pragma once

#include <type_traits>

// The few-row kernel's AVX-512 form: host compilers targeting AVX-512 only
// (weft's own programs build with -march=native; consumers choose).
#if defined(__AVX512F__) && !defined(__NVCC__) && !defined(__CUDACC__) && !defined(__HIPCC__)
#include <immintrin.h>
#define WEFT_FEW_ROWS_AVX512 1
#else
#define WEFT_FEW_ROWS_AVX512 0
#endif

#include <weft/ops/common.hpp>
#include <weft/ops/gemm_onednn.hpp>
#if WEFT_ENABLE_CUBLAS
#include <weft/ops/gemm_cublas.hpp>
#endif
#include <weft/ops/gemm_provider.hpp>
#include <weft/precision/convert.hpp>

namespace weft::ops {

/// C = alpha * op(A) * op(B) + beta * C, with op = identity or transpose,
/// computed by gemm_provider_t<AV, BV, CV> and counted in gemm_counters().
/// Row slices of a LayoutRight matrix (and column ranges of them) stay
/// LayoutRight with their leading dimension, so heads inside a fused QKV
/// matrix can be multiplied without a copy. m == 0 or n == 0 does nothing;
/// k == 0 leaves beta * C (0 where beta == 0, whatever C held). C must not
/// overlap A or B. A shape mismatch throws ShapeError before any work.
template <class AV, class BV, class CV>
void gemm(Trans ta, Trans tb, typename CV::const_value_type alpha, const AV& A, const BV& B,
          typename CV::const_value_type beta, const CV& C) {
  static_assert(AV::rank == 2 && BV::rank == 2 && CV::rank == 2, "weft::ops::gemm takes rank-2 views");
  static_assert(blas_layouts_v<AV, BV, CV>,
                "weft::ops::gemm needs A, B and C in one layout (all LayoutRight or all LayoutLeft) so that every "
                "provider takes them as they are (Kokkos Kernels reaches the vendor BLAS only then); copy the "
                "LayoutStride operand into a LayoutRight view first");
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
    using TC = typename CV::non_const_value_type;
    const float b = to_float(beta);
    Kokkos::parallel_for(
        "weft::gemm_scale", detail::range(C, m), KOKKOS_LAMBDA(std::size_t i) {
          for (std::size_t j = 0; j < n; ++j) C(i, j) = b == 0 ? TC(0) : TC(b * to_float(C(i, j)));
        });
    return;
  }
  using P = gemm_provider_t<AV, BV, CV>;
  gemm_counters().add(P::id, 2.0 * double(m) * double(n) * double(k));
  gemm_provider_runner<P>::run(ta, tb, alpha, A, B, beta, C);
}

/// WidenGemm's product: op(A) and op(B) widened into float matrices (one
/// kernel each, on C's execution space), multiplied by the float provider
/// into C, or into a float scratch that is then rounded into C's 2-byte type.
template <>
struct gemm_provider_runner<WidenGemm> {
  template <class AV, class BV, class CV>
  static void run(Trans ta, Trans tb, typename CV::const_value_type alpha, const AV& A, const BV& B,
                  typename CV::const_value_type beta, const CV& C) {
    using Space = typename CV::execution_space;
    using F = Kokkos::View<float**, Kokkos::LayoutRight, typename CV::memory_space>;
    const bool at = ta == Trans::T, bt = tb == Trans::T;
    const std::size_t m = C.extent(0), n = C.extent(1), k = at ? A.extent(0) : A.extent(1);
    F a(Kokkos::view_alloc(Kokkos::WithoutInitializing, "weft::gemm.widen.A"), m, k);
    F b(Kokkos::view_alloc(Kokkos::WithoutInitializing, "weft::gemm.widen.B"), k, n);
    Kokkos::parallel_for(
        "weft::gemm_widen_A", Kokkos::RangePolicy<Space>(0, m), KOKKOS_LAMBDA(std::size_t i) {
          for (std::size_t q = 0; q < k; ++q) a(i, q) = to_float(at ? A(q, i) : A(i, q));
        });
    Kokkos::parallel_for(
        "weft::gemm_widen_B", Kokkos::RangePolicy<Space>(0, k), KOKKOS_LAMBDA(std::size_t q) {
          for (std::size_t j = 0; j < n; ++j) b(q, j) = to_float(bt ? B(j, q) : B(q, j));
        });
    using TC = typename CV::non_const_value_type;
    if constexpr (std::is_same_v<TC, float> && std::is_same_v<typename CV::array_layout, Kokkos::LayoutRight>) {
      gemm(Trans::N, Trans::N, to_float(alpha), a, b, to_float(beta), C);
    } else {
      F c(Kokkos::view_alloc(Kokkos::WithoutInitializing, "weft::gemm.widen.C"), m, n);
      gemm(Trans::N, Trans::N, to_float(alpha), a, b, 0.0f, c);
      const float be = to_float(beta);
      Kokkos::parallel_for(
          "weft::gemm_widen_C", Kokkos::RangePolicy<Space>(0, m), KOKKOS_LAMBDA(std::size_t i) {
            for (std::size_t j = 0; j < n; ++j)
              C(i, j) = TC(c(i, j) + (be == 0 ? 0.0f : be * to_float(C(i, j))));
          });
    }
  }
};

namespace detail {
/// Columns of C one work item of gemm_few_rows computes: four AVX-512
/// registers of floats.
inline constexpr std::size_t few_rows_cols = 64;
/// Rows of C kept in registers together while B's rows stream past.
inline constexpr std::size_t few_rows_block = 4;

/// Rows of B fetched ahead of the one being multiplied.
inline constexpr std::size_t few_rows_ahead = 8;
/// Rows of B one pass of few_rows_group takes.
inline constexpr std::size_t few_rows_depth = 16;
/// Rows of a 2-byte B fetched ahead by the widening kernel: the same 32
/// cache lines in flight as few_rows_ahead rows of a float tile. Its
/// prefetches run on into the next pass's rows, so the stream never waits
/// for the hardware prefetcher to find a run again.
inline constexpr std::size_t few_rows_ahead_narrow = 16;
/// Column tiles one work item of gemm_few_rows takes.
inline constexpr std::size_t few_rows_group_tiles = 8;

/// c[r][0..W) (+)= sum_q a[r][q] b[q][0..W) for R rows and q in [0, k): a
/// is R rows of leading dimension lda, b a column tile of k rows of leading
/// dimension ldb, c R rows of leading dimension ldc. With `accumulate` the
/// sums continue from c's values (the previous rows of B), so splitting k
/// into consecutive passes adds in the same order as one pass.
#if WEFT_FEW_ROWS_AVX512
/// 16 elements of a B row as floats in a register: a float row loaded as
/// is; a bf16 or fp16 row widened exactly (a bf16 is the top half of a
/// float: zero-extend, shift left by 16; an fp16 goes through vcvtph2ps).
template <class TB>
inline __m512 few_rows_load16(const TB* p) {
  if constexpr (std::is_same_v<TB, float>) {
    return _mm512_loadu_ps(p);
  } else {
    const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    // The zero-masked forms with every lane set: gcc 12 warns (-Wmaybe-uninitialized)
    // that the plain intrinsics' undefined pass-through operand is uninitialised.
    constexpr __mmask16 all = 0xffff;
    if constexpr (std::is_same_v<TB, bf16>)
      return _mm512_castsi512_ps(_mm512_maskz_slli_epi32(all, _mm512_maskz_cvtepu16_epi32(all, raw), 16));
    else
      return _mm512_maskz_cvtph_ps(all, raw);
  }
}

/// few_rows_tile for float A and C, B in float, bf16 or fp16, and W = 64, in
/// AVX-512 registers: each q loads B's four vectors once (a 2-byte B widened
/// in registers, few_rows_load16) and multiplies them by every row's
/// broadcast element, so a q costs 4 + R loads for 4 R FMAs (the plain loop
/// below, as compiled, folds B's load into each FMA and reads it once per
/// row). The same sums in the same order as the plain loop, on B's exact
/// float values. A 2-byte B is read in its own 2 bytes, so a decode step
/// bound by reading the weights reads half the bytes.
///
/// Prefetches: a float row of the tile is four cache lines, fetched
/// few_rows_ahead rows ahead within this pass's k rows; a 2-byte row is two
/// lines, fetched few_rows_ahead_narrow rows ahead and on into the next
/// pass's rows (`k_rows` >= k: the rows of B from b).
template <std::size_t R, class TB>
[[gnu::noinline]] inline void few_rows_tile_avx512(const float* __restrict a, std::size_t lda, const TB* __restrict b,
                                                   std::size_t ldb, float* __restrict c, std::size_t ldc,
                                                   std::size_t k, bool accumulate, std::size_t k_rows) {
  constexpr bool narrow = sizeof(TB) == 2;
  constexpr std::size_t ahead = narrow ? few_rows_ahead_narrow : few_rows_ahead;
  const std::size_t ahead_limit = narrow ? k_rows : k;
  const float* ar_ptr[R];
  WEFT_UNROLL(16)
  for (std::size_t r = 0; r < R; ++r) ar_ptr[r] = a + r * lda;
  __m512 acc[R][4];
  WEFT_UNROLL(16)
  for (std::size_t r = 0; r < R; ++r)
    WEFT_UNROLL(4)
    for (std::size_t j = 0; j < 4; ++j)
      acc[r][j] = accumulate ? _mm512_loadu_ps(c + r * ldc + 16 * j) : _mm512_setzero_ps();
  for (std::size_t q = 0; q < k; ++q) {
    const TB* bq = b + q * ldb;
    if (q + ahead < ahead_limit)
      WEFT_UNROLL(4)
      for (std::size_t j = 0; j < 64; j += 64 / sizeof(TB)) __builtin_prefetch(bq + ahead * ldb + j);
    __m512 bv[4];
    WEFT_UNROLL(4)
    for (std::size_t j = 0; j < 4; ++j) {
      bv[j] = few_rows_load16(bq + 16 * j);
      // Keep B's vectors in registers: without this the compiler folds the
      // load (or widening) into every row's FMA and does it R times per q.
      asm("" : "+v"(bv[j]));
    }
    WEFT_UNROLL(16)
    for (std::size_t r = 0; r < R; ++r) {
      const __m512 ar = _mm512_set1_ps(ar_ptr[r][q]);
      WEFT_UNROLL(4)
      for (std::size_t j = 0; j < 4; ++j) acc[r][j] = _mm512_fmadd_ps(ar, bv[j], acc[r][j]);
    }
  }
  WEFT_UNROLL(16)
  for (std::size_t r = 0; r < R; ++r)
    WEFT_UNROLL(4)
    for (std::size_t j = 0; j < 4; ++j) _mm512_storeu_ps(c + r * ldc + 16 * j, acc[r][j]);
}
#endif

/// The plain form (any element types; the AVX-512 forms above where they
/// apply): elements of A and B are read into C's accumulation type
/// (accumulation_t: float for a 2-byte B), so a bf16 or fp16 B costs no copy.
/// `k_rows` (>= k): the rows of B from b, for the widening kernel's prefetches.
template <std::size_t R, std::size_t W, class TA, class TB, class TC>
inline void few_rows_tile(const TA* __restrict a, std::size_t lda, const TB* __restrict b, std::size_t ldb,
                          TC* __restrict c, std::size_t ldc, std::size_t k, bool accumulate, std::size_t k_rows) {
#if WEFT_FEW_ROWS_AVX512
  if constexpr (std::is_same_v<TA, float> && std::is_same_v<TC, float> && W == 64 &&
                (std::is_same_v<TB, float> || std::is_same_v<TB, bf16> || std::is_same_v<TB, fp16>)) {
    few_rows_tile_avx512<R>(a, lda, b, ldb, c, ldc, k, accumulate, k_rows);
    return;
  }
#endif
  using Acc = accumulation_t<TC>;
  Acc acc[R][W];
  WEFT_UNROLL(16)
  for (std::size_t r = 0; r < R; ++r)
    WEFT_UNROLL(64)
    for (std::size_t j = 0; j < W; ++j) acc[r][j] = accumulate ? load<Acc>(c[r * ldc + j]) : Acc(0);
  (void)k_rows;
  for (std::size_t q = 0; q < k; ++q) {
    const TB* bq = b + q * ldb;
    // B's rows are a page or more apart, which the hardware prefetcher does
    // not follow: fetch the row a few ahead, one cache line at a time.
    if (q + few_rows_ahead < k)
      WEFT_UNROLL(16)
      for (std::size_t j = 0; j < W; j += 64 / sizeof(TB)) __builtin_prefetch(bq + few_rows_ahead * ldb + j);
    WEFT_UNROLL(16)
    for (std::size_t r = 0; r < R; ++r) {
      const Acc ar = load<Acc>(a[r * lda + q]);
      WEFT_UNROLL(64)
      for (std::size_t j = 0; j < W; ++j) acc[r][j] += ar * load<Acc>(bq[j]);
    }
  }
  WEFT_UNROLL(16)
  for (std::size_t r = 0; r < R; ++r)
    WEFT_UNROLL(64)
    for (std::size_t j = 0; j < W; ++j) c[r * ldc + j] = store<TC>(acc[r][j]);
}

/// One column group of gemm_few_rows (G tiles of W columns), all m rows:
/// B's rows in passes of few_rows_depth; in each pass every tile of the
/// group, and for each tile A's rows in blocks of few_rows_block and then
/// one block of the 1-3 rows left. A pass reads few_rows_depth rows of B
/// as that many runs of G x W contiguous elements, which the hardware
/// prefetcher follows, while C's group stays in cache between passes.
template <std::size_t W, class TA, class TB, class TC>
inline void few_rows_group(const TA* a, std::size_t lda, const TB* b, std::size_t ldb, TC* c, std::size_t ldc,
                           std::size_t m, std::size_t k, std::size_t tiles) {
  constexpr std::size_t RB = few_rows_block;
  static_assert(RB == 4, "the row remainder below is written for blocks of 4");
  for (std::size_t q0 = 0; q0 < k; q0 += few_rows_depth) {
    const std::size_t kq = k - q0 < few_rows_depth ? k - q0 : few_rows_depth;
    const TA* aq = a + q0;
    const bool acc = q0 > 0;
    for (std::size_t t = 0; t < tiles; ++t) {
      const TB* bq = b + q0 * ldb + t * W;
      TC* ct = c + t * W;
      std::size_t r = 0;
      for (; r + RB <= m; r += RB) few_rows_tile<RB, W>(aq + r * lda, lda, bq, ldb, ct + r * ldc, ldc, kq, acc, k - q0);
      switch (m - r) {
        case 3: few_rows_tile<3, W>(aq + r * lda, lda, bq, ldb, ct + r * ldc, ldc, kq, acc, k - q0); break;
        case 2: few_rows_tile<2, W>(aq + r * lda, lda, bq, ldb, ct + r * ldc, ldc, kq, acc, k - q0); break;
        case 1: few_rows_tile<1, W>(aq + r * lda, lda, bq, ldb, ct + r * ldc, ldc, kq, acc, k - q0); break;
        default: break;
      }
    }
  }
}

/// The w < few_rows_cols columns after the last whole tile, all rows: a
/// plain loop, each element summed over k in order.
template <class TA, class TB, class TC>
inline void few_rows_edge(const TA* a, std::size_t lda, const TB* b, std::size_t ldb, TC* c, std::size_t ldc,
                          std::size_t k, std::size_t rows, std::size_t w) {
  using Acc = accumulation_t<TC>;
  for (std::size_t r = 0; r < rows; ++r)
    for (std::size_t j = 0; j < w; ++j) {
      Acc acc = 0;
      for (std::size_t q = 0; q < k; ++q) acc += load<Acc>(a[r * lda + q]) * load<Acc>(b[q * ldb + j]);
      c[r * ldc + j] = store<TC>(acc);
    }
}
}  // namespace detail

/// Most rows of A for which gemm_few_rows streams B itself on a host
/// execution space; above it, and on a device, it calls gemm.
inline constexpr std::size_t few_rows_max = 32;

/// C = A B for row-major A [m, k], B [k, n] and C [m, n]: the products of a
/// decode step, where A has a few rows (one per sequence) and B is a weight
/// matrix. A BLAS packs B into its own buffer before multiplying, which for a
/// few rows costs more than the product: it reads and writes all of B and
/// then reads it again. With m <= few_rows_max on a host execution space,
/// this kernel reads B once instead. A work item is a group of 8 column
/// tiles of 64; it goes down B in passes of 16 rows, and in each pass every
/// tile is multiplied by blocks of 4 of A's rows kept in registers, so B is
/// read as runs of 512 contiguous elements (which the hardware prefetcher
/// follows) and C's group stays in cache between passes. Each element of C
/// sums over k in order.
///
/// Element types: A, B and C of one type; or float A and C with B in bf16 or
/// fp16 (weights stored in 2 bytes, activations in float). Then the kernel
/// reads B's 2-byte elements where they lie and widens them exactly in
/// registers (AVX-512 where the compiler targets it, a plain loop
/// otherwise): the result is the float product of A with B's exact values,
/// summed in float, and the bytes of B read are half those of a float B.
///
/// Otherwise (more rows, or a device, where cuBLAS handles few rows well) it
/// is gemm(N, N, 1, A, B, 0, C); with a 2-byte B and a float A, A is first
/// rounded into a scratch of B's type (one rounding of each activation, as
/// a 2-byte product of the providers takes its inputs) and the 2-byte
/// product computed with float accumulation by the provider gemm_provider_t
/// picks (oneDNN on the host, cuBLAS on CUDA, WidenGemm elsewhere).
/// C must not overlap A or B (as for a BLAS); a shape mismatch throws
/// ShapeError.
template <class AV, class BV, class CV>
void gemm_few_rows(const AV& A, const BV& B, const CV& C) {
  static_assert(AV::rank == 2 && BV::rank == 2 && CV::rank == 2, "weft::ops::gemm_few_rows takes rank-2 views");
  using TA = typename AV::non_const_value_type;
  using TB = typename BV::non_const_value_type;
  using TC = typename CV::non_const_value_type;
  constexpr bool same = std::is_same_v<TA, TB> && std::is_same_v<TB, TC>;
  constexpr bool narrow_b = std::is_same_v<TA, float> && std::is_same_v<TC, float> && is_reduced_precision_v<TB>;
  static_assert(same || narrow_b,
                "weft::ops::gemm_few_rows: A, B and C must share one element type, or A and C be float with B in "
                "bf16 or fp16 (2-byte weights, float activations)");
  using Exec = detail::exec_t<CV>;
  const std::size_t m = A.extent(0), k = A.extent(1), n = B.extent(1);
  if constexpr (Kokkos::SpaceAccessibility<Exec, Kokkos::HostSpace>::accessible &&
                std::is_same_v<typename AV::array_layout, Kokkos::LayoutRight> &&
                std::is_same_v<typename BV::array_layout, Kokkos::LayoutRight> &&
                std::is_same_v<typename CV::array_layout, Kokkos::LayoutRight>) {
    if (m <= few_rows_max && m > 0 && k > 0 && n > 0) {
      WEFT_REQUIRE(B.extent(0) == k && C.extent(0) == m && C.extent(1) == n, ShapeError,
                   "weft::ops::gemm_few_rows: A is ", detail::shape_string(A), ", B ", detail::shape_string(B), " and C ",
                   detail::shape_string(C), "; expected A m x k, B k x n and C m x n");
      detail::require_contiguous_rows("weft::ops::gemm_few_rows", "A", A, 1);
      detail::require_contiguous_rows("weft::ops::gemm_few_rows", "B", B, 1);
      detail::require_contiguous_rows("weft::ops::gemm_few_rows", "C", C, 1);
      constexpr std::size_t W = detail::few_rows_cols;
      // A 2-byte B: twice the tiles, so a row of a group is as many bytes (2 KiB) as a float one.
      constexpr std::size_t G = detail::few_rows_group_tiles * (sizeof(float) / sizeof(TB) > 1 ? sizeof(float) / sizeof(TB) : 1);
      const std::size_t full = n / W, groups = (full + G - 1) / G;  // whole tiles, in groups; then the edge
      const std::size_t lda = A.stride(0), ldb = B.stride(0), ldc = C.stride(0);
      const TA* a = A.data();
      const TB* b = B.data();
      TC* c = C.data();
      gemm_counters().add(GemmProviderId::few_rows, 2.0 * double(m) * double(n) * double(k));
      Kokkos::parallel_for(
          "weft::gemm_few_rows", Kokkos::RangePolicy<Exec>(0, groups + (n % W ? 1 : 0)),
          [=](std::size_t g) {  // host code: a host execution space
            if (g < groups) {
              const std::size_t t0 = g * G, nt = full - t0 < G ? full - t0 : G;
              detail::few_rows_group<W>(a, lda, b + t0 * W, ldb, c + t0 * W, ldc, m, k, nt);
            } else {
              const std::size_t j0 = full * W;
              detail::few_rows_edge(a, lda, b + j0, ldb, c + j0, ldc, k, m, n - j0);
            }
          });
      return;
    }
  }
  if constexpr (same) {
    gemm(Trans::N, Trans::N, TC(1), A, B, TC(0), C);
  } else {
    gemm(Trans::N, Trans::N, 1.0f, weft::converted<TB>(A, "weft::gemm_few_rows.A_rounded"), B, 0.0f, C);
  }
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
