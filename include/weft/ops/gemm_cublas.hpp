// The cuBLAS GEMM provider: products on CUDA memory through cublasGemmEx
// with fp32 compute (tensor cores for bf16 and fp16 inputs), and the
// strided-batched form for stacks of matrices. The raw call on device
// pointers is usable wherever cuBLAS's headers are; the provider's runner on
// Kokkos views exists only in CUDA builds of Kokkos with WEFT_ENABLE_CUBLAS.
#pragma once

#if __has_include(<cublas_v2.h>)

#include <cublas_v2.h>

#include <cstdint>
#include <mutex>
#include <string>
#include <type_traits>

#include <weft/core/error.hpp>
#include <weft/core/half.hpp>

namespace weft::ops::cublas {

/// cuBLAS's data type of value type T: float, double, weft::bf16 (same bits
/// as __nv_bfloat16) and weft::fp16 (same bits as __half).
template <class T>
constexpr cudaDataType data_type() {
  if constexpr (std::is_same_v<T, float>) return CUDA_R_32F;
  else if constexpr (std::is_same_v<T, double>) return CUDA_R_64F;
  else if constexpr (std::is_same_v<T, bf16>) return CUDA_R_16BF;
  else {
    static_assert(std::is_same_v<T, fp16>, "weft::ops::cublas: value types are float, double, weft::bf16 and weft::fp16");
    return CUDA_R_16F;
  }
}

/// Compute type of a product with inputs of type T: fp64 for double, fp32
/// for everything else (the accumulation weft promises for 2-byte inputs).
template <class T>
constexpr cublasComputeType_t compute_type() {
  return std::is_same_v<T, double> ? CUBLAS_COMPUTE_64F : CUBLAS_COMPUTE_32F;
}

/// Throws weft::Error naming the call when a cuBLAS status is not success.
inline void check(cublasStatus_t s, const char* what) {
  if (s != CUBLAS_STATUS_SUCCESS)
    weft::detail::throw_error<Error>("weft::ops::gemm (cuBLAS provider): ", what, " failed with status ", int(s),
                                     "; check that the operands live in CUDA memory of the current device");
}

/// One operand as cuBLAS takes it: a device pointer, its leading dimension
/// and whether it is stored row-major (LayoutRight) or column-major.
struct Operand {
  const void* data;
  std::int64_t ld;
};

/// C = alpha op(A) op(B) + beta C on device pointers, m x n x k, every
/// operand in the same storage order (`row_major`), A and B of type TI, C of
/// type TC, alpha and beta of the compute type (float, or double for double).
/// A row-major C is the column-major C^T, so a row-major product is issued as
/// C^T = op(B)^T op(A)^T with the operands swapped; no copy either way.
/// `batch` > 1 runs the strided-batched form with element strides sa, sb, sc
/// between consecutive matrices.
template <class TI, class TC, class S>
void gemm_ex(cublasHandle_t handle, bool row_major, bool ta, bool tb, std::int64_t m, std::int64_t n, std::int64_t k,
             S alpha, Operand a, Operand b, S beta, void* c, std::int64_t ldc, std::int64_t batch = 1,
             std::int64_t sa = 0, std::int64_t sb = 0, std::int64_t sc = 0) {
  static_assert(std::is_same_v<S, std::conditional_t<std::is_same_v<TI, double>, double, float>>,
                "weft::ops::cublas::gemm_ex: alpha and beta are double for double products and float otherwise");
  const auto op = [](bool t) { return t ? CUBLAS_OP_T : CUBLAS_OP_N; };
  const auto i32 = [](std::int64_t v, const char* name) {
    WEFT_REQUIRE(v >= 0 && v <= 0x7fffffff, ShapeError, "weft::ops::gemm (cuBLAS provider): ", name, " = ", v,
                 " does not fit cuBLAS's 32-bit int; split the product");
    return int(v);
  };
  // Column-major view of the call: swap the operands for a row-major product.
  const bool sw = row_major;
  const cublasOperation_t o1 = op(sw ? tb : ta), o2 = op(sw ? ta : tb);
  const std::int64_t M = sw ? n : m, N = sw ? m : n;
  const Operand x = sw ? b : a, y = sw ? a : b;
  const std::int64_t sx = sw ? sb : sa, sy = sw ? sa : sb;
  const cudaDataType ti = data_type<TI>(), tc = data_type<TC>();
  const auto algo = std::is_same_v<TI, double> ? CUBLAS_GEMM_DEFAULT : CUBLAS_GEMM_DEFAULT_TENSOR_OP;
  if (batch <= 1) {
    check(cublasGemmEx(handle, o1, o2, i32(M, "rows"), i32(N, "columns"), i32(k, "k"), &alpha, x.data, ti,
                       i32(x.ld, "lda"), y.data, ti, i32(y.ld, "ldb"), &beta, c, tc, i32(ldc, "ldc"),
                       compute_type<TI>(), algo),
          "cublasGemmEx");
  } else {
    check(cublasGemmStridedBatchedEx(handle, o1, o2, i32(M, "rows"), i32(N, "columns"), i32(k, "k"), &alpha, x.data,
                                     ti, i32(x.ld, "lda"), sx, y.data, ti, i32(y.ld, "ldb"), sy, &beta, c, tc,
                                     i32(ldc, "ldc"), sc, i32(batch, "batch"), compute_type<TI>(), algo),
          "cublasGemmStridedBatchedEx");
  }
}

/// The process's cuBLAS handle, created on first use (cuBLAS handles are
/// expensive to create and may be shared by sequential calls on one thread).
inline cublasHandle_t handle() {
  static cublasHandle_t h = [] {
    cublasHandle_t out = nullptr;
    check(cublasCreate(&out), "cublasCreate");
    return out;
  }();
  return h;
}

}  // namespace weft::ops::cublas

#endif  // __has_include(<cublas_v2.h>)

// The provider's runner on Kokkos views: CUDA builds with cuBLAS linked.
#if defined(KOKKOS_ENABLE_CUDA) && WEFT_ENABLE_CUBLAS && __has_include(<cublas_v2.h>)
#include <weft/ops/gemm_provider.hpp>

namespace weft::ops {
template <>
struct gemm_provider_runner<CublasGemm> {
  template <class AV, class BV, class CV>
  static void run(Trans ta, Trans tb, typename CV::const_value_type alpha, const AV& A, const BV& B,
                  typename CV::const_value_type beta, const CV& C) {
    using TI = typename AV::non_const_value_type;
    using TC = typename CV::non_const_value_type;
    using S = std::conditional_t<std::is_same_v<TI, double>, double, float>;
    constexpr bool row = std::is_same_v<typename CV::array_layout, Kokkos::LayoutRight>;
    // The leading dimension: the stride between rows (row-major) or columns;
    // at least the other extent, which a view of one row or column may not say.
    auto ld = [](const auto& v) {
      const std::int64_t s = std::int64_t(row ? v.stride(0) : v.stride(1));
      const std::int64_t e = std::int64_t(row ? v.extent(1) : v.extent(0));
      return s > e ? s : (e > 0 ? e : 1);
    };
    const bool at = ta == Trans::T, bt = tb == Trans::T;
    const auto h = cublas::handle();
    cublas::check(cublasSetStream(h, Kokkos::Cuda().cuda_stream()), "cublasSetStream");
    cublas::gemm_ex<TI, TC>(h, row, at, bt, std::int64_t(C.extent(0)), std::int64_t(C.extent(1)),
                            std::int64_t(at ? A.extent(0) : A.extent(1)), S(to_float(alpha)), {A.data(), ld(A)},
                            {B.data(), ld(B)}, S(to_float(beta)), C.data(), ld(C));
  }
};
}  // namespace weft::ops
#endif
