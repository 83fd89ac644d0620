// Who computes a matrix product: the GEMM providers and the compile-time rule
// that picks one from the operands' execution space and value types, plus the
// counters that say which provider ran. ops::gemm (weft/ops/gemm.hpp) is the
// one entry point; this header is what it dispatches on.
#pragma once

#include <KokkosBlas3_gemm.hpp>
#include <array>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <string>
#include <type_traits>

#include <weft/config.hpp>
#include <weft/core/half.hpp>
#include <weft/ops/common.hpp>

/// 1 where the oneDNN provider is compiled into this translation unit: weft
/// configured with oneDNN (WEFT_ENABLE_ONEDNN) and a host compiler. nvcc
/// (13.0) fails with an internal error on oneDNN's C++ API header, and a
/// CUDA or HIP translation unit's products belong to the device providers,
/// so there the host float products take Kokkos Kernels instead.
#if WEFT_ENABLE_ONEDNN && !defined(__NVCC__) && !defined(__CUDACC__) && !defined(__HIPCC__)
#define WEFT_ONEDNN_PROVIDER 1
#else
#define WEFT_ONEDNN_PROVIDER 0
#endif

namespace weft::ops {

/// Transpose selector of one gemm operand.
enum class Trans : char { N = 'N', T = 'T' };

/// Whether a gemm on these view types can reach the vendor BLAS in Kokkos
/// Kernels: in 3.4 its BLAS specialisations exist only when A, B and C are all
/// LayoutRight or all LayoutLeft (a LayoutStride operand silently falls back
/// to a generic kernel several times slower). weft's gemm requires it of
/// every provider, so that a product never depends on which one runs.
template <class AV, class BV, class CV>
inline constexpr bool blas_layouts_v =
    std::is_same_v<typename AV::array_layout, typename BV::array_layout> &&
    std::is_same_v<typename AV::array_layout, typename CV::array_layout> &&
    (std::is_same_v<typename AV::array_layout, Kokkos::LayoutRight> ||
     std::is_same_v<typename AV::array_layout, Kokkos::LayoutLeft>);

// ---------------------------------------------------------------------------
// The providers. Each is an empty tag type with
//   static constexpr GemmProviderId id;   and   static constexpr const char* name;
// and, where it is compiled in, a gemm_provider_runner specialisation below.
// ---------------------------------------------------------------------------

/// Stable numbering of the providers (indices into GemmCounters).
enum class GemmProviderId : int { kokkos_kernels = 0, onednn = 1, few_rows = 2, cublas = 3, rocblas = 4, widen = 5 };
/// Number of GemmProviderId values.
inline constexpr int gemm_provider_count = 6;

/// The provider's name as records and logs print it.
constexpr const char* gemm_provider_name(GemmProviderId id) {
  switch (id) {
    case GemmProviderId::kokkos_kernels: return "kokkos-kernels";
    case GemmProviderId::onednn: return "onednn";
    case GemmProviderId::few_rows: return "weft-few-rows";
    case GemmProviderId::cublas: return "cublas";
    case GemmProviderId::rocblas: return "rocblas";
    case GemmProviderId::widen: return "widen-to-fp32";
  }
  return "unknown";
}

/// Base of the provider tags: their id, and their name as
/// gemm_provider_name gives it (one spelling for records, logs and tags).
template <GemmProviderId I>
struct ProviderTag {
  static constexpr GemmProviderId id = I;
  static constexpr const char* name = gemm_provider_name(I);
};

/// Kokkos Kernels' KokkosBlas::gemm: the vendor BLAS (OpenBLAS on these
/// machines, cuBLAS or rocBLAS in device builds of Kokkos Kernels) for float,
/// double and complex, its own generic kernel for other types. The fallback
/// of every case no other provider takes.
struct KokkosKernelsGemm : ProviderTag<GemmProviderId::kokkos_kernels> {};

/// oneDNN's matmul primitive (weft/ops/gemm_onednn.hpp): float, or bf16
/// inputs with a float result, on a host execution space. Its runner exists
/// only when weft is configured with oneDNN and the compiler is a host one
/// (WEFT_ONEDNN_PROVIDER == 1).
struct OneDnnGemm : ProviderTag<GemmProviderId::onednn> {};

/// bf16 or fp16 inputs where no provider takes them as they are: op(A) and
/// op(B) are widened to float in a kernel on the operands' execution space
/// (exactly: every 2-byte value is a float) and multiplied by the float
/// provider; C is float, or rounded to nearest even into C's 2-byte type.
/// The result equals a product with fp32 accumulation of the same inputs
/// (within fp32 rounding), at the cost of one float copy of A and B.
struct WidenGemm : ProviderTag<GemmProviderId::widen> {};

/// cuBLAS (cublasGemmEx, fp32 compute, tensor cores for 2-byte inputs) on
/// CUDA memory (weft/ops/gemm_cublas.hpp). A CUDA build of Kokkos Kernels
/// already hands float and double products to cuBLAS through
/// KokkosKernelsGemm; this provider takes the bf16 and fp16 products, in
/// CUDA builds of Kokkos with WEFT_ENABLE_CUBLAS.
struct CublasGemm : ProviderTag<GemmProviderId::cublas> {};

/// rocBLAS on HIP memory, on the plan of CublasGemm (no runner yet: 2-byte
/// products on HIP take WidenGemm).
struct RocblasGemm : ProviderTag<GemmProviderId::rocblas> {};

/// The product of provider P: a static
///   run(Trans ta, Trans tb, alpha, A, B, beta, C)
/// computing C = alpha op(A) op(B) + beta C for operands that ops::gemm has
/// already checked (shapes agree, m, n, k > 0, one layout). Specialised for
/// each provider compiled into this build; a provider without one cannot be
/// chosen by gemm_provider.
template <class Provider>
struct gemm_provider_runner;

template <>
struct gemm_provider_runner<KokkosKernelsGemm> {
  template <class AV, class BV, class CV>
  static void run(Trans ta, Trans tb, typename CV::const_value_type alpha, const AV& A, const BV& B,
                  typename CV::const_value_type beta, const CV& C) {
    const char tas[2] = {static_cast<char>(ta), '\0'};
    const char tbs[2] = {static_cast<char>(tb), '\0'};
    KokkosBlas::gemm(tas, tbs, alpha, A, B, beta, C);
  }
};

namespace detail {
template <class Exec>
inline constexpr bool host_exec_v = Kokkos::SpaceAccessibility<Exec, Kokkos::HostSpace>::accessible;

/// Value types oneDNN's matmul takes in weft: A, B and C all float, or A and
/// B both bf16 with C float or bf16 (fp32 accumulation inside oneDNN).
template <class TA, class TB, class TC>
inline constexpr bool onednn_inputs_v =
    (std::is_same_v<TA, float> && std::is_same_v<TB, float> && std::is_same_v<TC, float>) ||
    (std::is_same_v<TA, bf16> && std::is_same_v<TB, bf16> && (std::is_same_v<TC, float> || std::is_same_v<TC, bf16>));

/// Products of 2-byte inputs that WidenGemm computes where no provider takes them.
template <class TA, class TB, class TC>
inline constexpr bool widen_inputs_v = is_reduced_precision_v<TA> && std::is_same_v<TA, TB> &&
                                       (std::is_same_v<TC, float> || std::is_same_v<TC, TA>);
}  // namespace detail

/// The provider of a product whose operands have value types TA, TB, TC and
/// run on execution space Exec, decided at compile time:
///   host space, weft built with oneDNN, float x float -> float, or
///     bf16 x bf16 -> float or bf16                          -> OneDnnGemm
///   CUDA space, weft built with cuBLAS (WEFT_ENABLE_CUBLAS),
///     bf16 or fp16 inputs, C float or the input type        -> CublasGemm
///   other bf16 / fp16 inputs (C float or the input type)   -> WidenGemm
///   anything else                                           -> KokkosKernelsGemm
/// (double products, float products of a build without oneDNN, and device
/// float and double products, which Kokkos Kernels hands to cuBLAS or
/// rocBLAS). Specialise it for a type of your own to route its products.
template <class Exec, class TA, class TB, class TC>
struct gemm_provider {
#if WEFT_ONEDNN_PROVIDER
  static constexpr bool onednn = detail::host_exec_v<Exec> && detail::onednn_inputs_v<TA, TB, TC>;
#else
  static constexpr bool onednn = false;
#endif
#if defined(KOKKOS_ENABLE_CUDA) && WEFT_ENABLE_CUBLAS
  // 2-byte inputs on CUDA: cublasGemmEx with fp32 compute (tensor cores).
  static constexpr bool cublas = std::is_same_v<Exec, Kokkos::Cuda> && detail::widen_inputs_v<TA, TB, TC>;
#else
  static constexpr bool cublas = false;
#endif
  using type = std::conditional_t<
      onednn, OneDnnGemm,
      std::conditional_t<cublas, CublasGemm,
                         std::conditional_t<detail::widen_inputs_v<TA, TB, TC>, WidenGemm, KokkosKernelsGemm>>>;
};

/// The provider ops::gemm uses for views AV, BV, CV (their execution space
/// is CV's).
template <class AV, class BV, class CV>
using gemm_provider_t =
    typename gemm_provider<typename CV::execution_space, typename AV::non_const_value_type,
                           typename BV::non_const_value_type, typename CV::non_const_value_type>::type;

/// The provider of float products on execution space Exec: what weft's fp32
/// layers use, as the run records name it.
template <class Exec = Kokkos::DefaultExecutionSpace>
constexpr const char* float_gemm_provider_name() {
  return gemm_provider<Exec, float, float, float>::type::name;
}

/// Calls and floating-point operations (2 m n k each) of every provider
/// since the start of the process or the last reset(): how a test checks
/// which provider ran, and how a record says it. Relaxed atomics: the
/// counts are exact, their order with other memory is not promised.
struct GemmCounters {
  std::array<std::atomic<std::uint64_t>, gemm_provider_count> calls{};
  std::array<std::atomic<double>, gemm_provider_count> flops{};

  void add(GemmProviderId id, double f) {
    calls[static_cast<int>(id)].fetch_add(1, std::memory_order_relaxed);
    auto& a = flops[static_cast<int>(id)];
    double cur = a.load(std::memory_order_relaxed);
    while (!a.compare_exchange_weak(cur, cur + f, std::memory_order_relaxed)) {
    }
  }
  std::uint64_t calls_of(GemmProviderId id) const { return calls[static_cast<int>(id)].load(std::memory_order_relaxed); }
  double flops_of(GemmProviderId id) const { return flops[static_cast<int>(id)].load(std::memory_order_relaxed); }
  void reset() {
    for (auto& c : calls) c.store(0, std::memory_order_relaxed);
    for (auto& f : flops) f.store(0, std::memory_order_relaxed);
  }
};

/// The process's counters (one object; inline, so one across translation units).
inline GemmCounters& gemm_counters() {
  static GemmCounters c;
  return c;
}

}  // namespace weft::ops
