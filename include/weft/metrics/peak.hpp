// The yardsticks of MFU: the core's own floating-point peak (a probe of its
// FMA and bf16 dot-product throughput, built with the instructions the target
// has), and the best single-precision gemm rate this process reaches through
// its GEMM provider right now, measured by wall time and by process CPU time.
#pragma once

#if defined(__x86_64__) && (defined(__AVX512F__) || defined(__AVX2__))
#include <immintrin.h>
#endif

#include <time.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include <weft/ops/common.hpp>
#include <weft/ops/gemm.hpp>

namespace weft::metrics {

/// CPU seconds used by this process so far (all its threads).
inline double process_cpu_seconds() {
  timespec ts{};
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
  return double(ts.tv_sec) + 1e-9 * double(ts.tv_nsec);
}

/// FLOP/s by wall-clock time and by CPU time (the two differ when other jobs
/// share the cores: CPU time leaves out the waits for a core).
struct Rate {
  double wall = 0;
  double cpu = 0;
};

/// One core's floating-point peak as the probe measured it, in FLOP/s (a
/// fused multiply-add counts 2, a bf16 pair product with its add 2).
struct CorePeak {
  double fp32 = 0;            ///< fp32 fused multiply-adds per second, times 2
  double bf16 = 0;            ///< bf16 dot-product FLOP/s (0: this build has no bf16 instruction)
  const char* fp32_isa = "";  ///< the instruction the fp32 probe ran: "avx512 vfmadd", "avx2 vfmadd" or "scalar"
  const char* bf16_isa = "";  ///< "avx512_bf16 vdpbf16ps", or "none"
};

namespace detail {
/// Independent accumulator chains of the probe: more than FMA latency (4
/// cycles) x FMA pipes (2) on current x86 cores, so the pipes never wait.
/// The chain loops are unrolled completely (WEFT_UNROLL) so that the
/// accumulators stay in registers: kept in memory, each would wait on a
/// store and a load, and the probe would measure that instead (71 against
/// 220 GFLOP/s on the development machine).
inline constexpr int peak_chains = 12;

// Each probe runs `iters` rounds of peak_chains independent instructions and
// returns a value that depends on every accumulator, so none is optimised away.
#if defined(__x86_64__) && defined(__AVX512F__)
/// The sum of every lane of every chain: a value that depends on all of them.
/// Not _mm512_reduce_add_ps: GCC 12's header trips its own -Wuninitialized.
inline float sum_chains(const __m512 (&acc)[peak_chains]) {
  __m512 s = acc[0];
  for (int c = 1; c < peak_chains; ++c) s = _mm512_add_ps(s, acc[c]);
  alignas(64) float lanes[16];
  _mm512_store_ps(lanes, s);
  float out = 0;
  for (float e : lanes) out += e;
  return out;
}

[[gnu::noinline]] inline float fp32_probe(long iters, float x, float y) {
  __m512 acc[peak_chains];
  for (int c = 0; c < peak_chains; ++c) acc[c] = _mm512_set1_ps(float(c) * 1e-3f);
  const __m512 a = _mm512_set1_ps(x), b = _mm512_set1_ps(y);
  for (long i = 0; i < iters; ++i)
    WEFT_UNROLL(12)
    for (int c = 0; c < peak_chains; ++c) acc[c] = _mm512_fmadd_ps(acc[c], a, b);
  return sum_chains(acc);
}
inline constexpr int fp32_lanes = 16;
inline constexpr const char* fp32_isa = "avx512 vfmadd";
#elif defined(__x86_64__) && defined(__AVX2__) && defined(__FMA__)
[[gnu::noinline]] inline float fp32_probe(long iters, float x, float y) {
  __m256 acc[peak_chains];
  for (int c = 0; c < peak_chains; ++c) acc[c] = _mm256_set1_ps(float(c) * 1e-3f);
  const __m256 a = _mm256_set1_ps(x), b = _mm256_set1_ps(y);
  for (long i = 0; i < iters; ++i)
    WEFT_UNROLL(12)
    for (int c = 0; c < peak_chains; ++c) acc[c] = _mm256_fmadd_ps(acc[c], a, b);
  float out = 0;
  for (int c = 0; c < peak_chains; ++c) {
    alignas(32) float v[8];
    _mm256_store_ps(v, acc[c]);
    for (float e : v) out += e;
  }
  return out;
}
inline constexpr int fp32_lanes = 8;
inline constexpr const char* fp32_isa = "avx2 vfmadd";
#else
[[gnu::noinline]] inline float fp32_probe(long iters, float x, float y) {
  float acc[peak_chains];
  for (int c = 0; c < peak_chains; ++c) acc[c] = float(c) * 1e-3f;
  for (long i = 0; i < iters; ++i)
    WEFT_UNROLL(12)
    for (int c = 0; c < peak_chains; ++c) acc[c] = acc[c] * x + y;
  float out = 0;
  for (float e : acc) out += e;
  return out;
}
inline constexpr int fp32_lanes = 1;
inline constexpr const char* fp32_isa = "scalar";
#endif

#if defined(__x86_64__) && defined(__AVX512BF16__)
[[gnu::noinline]] inline float bf16_probe(long iters, float x) {
  __m512 acc[peak_chains];
  for (int c = 0; c < peak_chains; ++c) acc[c] = _mm512_setzero_ps();
  const __m512 v = _mm512_set1_ps(x);
  const __m512bh a = _mm512_cvtne2ps_pbh(v, v), b = _mm512_cvtne2ps_pbh(v, v);
  for (long i = 0; i < iters; ++i)
    WEFT_UNROLL(12)
    for (int c = 0; c < peak_chains; ++c) acc[c] = _mm512_dpbf16_ps(acc[c], a, b);
  return sum_chains(acc);
}
inline constexpr bool has_bf16_probe = true;
#else
inline float bf16_probe(long, float) { return 0; }
inline constexpr bool has_bf16_probe = false;
#endif

/// Best FLOP/s of `probe(iters)` over `reps` timed runs after one warm-up,
/// by CPU time of the process (the probe is single-threaded: CPU time leaves
/// out the time a busy machine kept the core from it).
template <class Probe>
double best_probe_rate(Probe&& probe, long iters, double flop_per_iter, int reps, float& sink) {
  double best = 0;
  for (int r = 0; r <= reps; ++r) {
    const double c0 = process_cpu_seconds();
    sink += probe(iters);
    const double t = process_cpu_seconds() - c0;
    if (r > 0 && t > 0) best = std::max(best, flop_per_iter * double(iters) / t);
  }
  return best;
}
}  // namespace detail

/// Measures one core's peak with the instructions this translation unit was
/// compiled for: peak_chains independent chains of 512-bit (or 256-bit, or
/// scalar) FMAs, and of vdpbf16ps where the target has AVX512_BF16; best of
/// `reps` runs of `iters` rounds each, by CPU time. About 2 x 5 x 20 ms at
/// the defaults on a 3.5 GHz core. Call it from one thread; multiply by the
/// threads that compute to get a process's peak.
inline CorePeak measure_core_peak(long iters = 2'000'000, int reps = 5) {
  CorePeak out;
  float sink = 0;
  out.fp32 = detail::best_probe_rate([](long n) { return detail::fp32_probe(n, 0.999999f, 1e-7f); }, iters,
                                     2.0 * detail::peak_chains * detail::fp32_lanes, reps, sink);
  out.fp32_isa = detail::fp32_isa;
  if constexpr (detail::has_bf16_probe) {
    // 16 lanes, each the sum of 2 bf16 products: 4 FLOP per lane.
    out.bf16 = detail::best_probe_rate([](long n) { return detail::bf16_probe(n, 1e-3f); }, iters,
                                       4.0 * detail::peak_chains * 16, reps, sink);
    out.bf16_isa = "avx512_bf16 vdpbf16ps";
  } else {
    out.bf16_isa = "none";
  }
  // The sums are meaningless; storing them keeps the probes from being dropped.
  volatile float keep = sink;
  (void)keep;
  return out;
}

/// A device's dense peak from its data sheet (no sparsity), in FLOP/s: the
/// yardstick of MFU on a GPU, where no probe of weft's is the limit.
struct DevicePeak {
  std::string device;  ///< the name the runtime reported
  double fp32 = 0;     ///< dense fp32 (no tensor-core TF32)
  double bf16 = 0;     ///< dense bf16 tensor-core, fp32 accumulation
  const char* source = "";
};

/// The data-sheet peak of the device whose runtime name contains one of the
/// known models (NVIDIA H200, H100 SXM/PCIe, A100; AMD MI300X, MI250X),
/// nullopt for others. Figures: NVIDIA's H100/H200 and A100 data sheets, AMD's
/// MI300X and MI250X product pages (dense, boost clock).
inline std::optional<DevicePeak> datasheet_peak(std::string_view name) {
  struct Row {
    const char* match;
    double fp32_tflops, bf16_tflops;
    const char* source;
  };
  static constexpr Row rows[] = {
      {"H200", 67.0, 989.4, "NVIDIA H200 data sheet (SXM): 67 TFLOP/s fp32, 989 TFLOP/s bf16 dense"},
      {"H100 PCIe", 51.2, 756.0, "NVIDIA H100 data sheet (PCIe): 51 TFLOP/s fp32, 756 TFLOP/s bf16 dense"},
      {"H100", 67.0, 989.4, "NVIDIA H100 data sheet (SXM): 67 TFLOP/s fp32, 989 TFLOP/s bf16 dense"},
      {"A100", 19.5, 312.0, "NVIDIA A100 data sheet: 19.5 TFLOP/s fp32, 312 TFLOP/s bf16 dense"},
      {"MI300X", 163.4, 1307.4, "AMD Instinct MI300X: 163.4 TFLOP/s fp32, 1307.4 TFLOP/s bf16 dense"},
      {"MI250X", 47.9, 383.0, "AMD Instinct MI250X: 47.9 TFLOP/s fp32 (vector), 383 TFLOP/s bf16 dense"},
  };
  for (const auto& r : rows)
    if (name.find(r.match) != std::string_view::npos)
      return DevicePeak{std::string(name), r.fp32_tflops * 1e12, r.bf16_tflops * 1e12, r.source};
  return std::nullopt;
}

/// The name of the current CUDA or HIP device as its runtime reports it
/// ("NVIDIA H200"), or "" in builds without a device backend or when the
/// runtime cannot tell.
inline std::string device_name() {
#if defined(KOKKOS_ENABLE_CUDA)
  int dev = 0;
  cudaDeviceProp p{};
  if (cudaGetDevice(&dev) == cudaSuccess && cudaGetDeviceProperties(&p, dev) == cudaSuccess) return p.name;
#elif defined(KOKKOS_ENABLE_HIP)
  int dev = 0;
  hipDeviceProp_t p{};
  if (hipGetDevice(&dev) == hipSuccess && hipGetDeviceProperties(&p, dev) == hipSuccess) return p.name;
#endif
  return "";
}

/// Best rate over `reps` runs (after one warm-up) of float gemms
/// C[m, n] = A[m, k] B[k, n] for each {m, n, k} in shapes; the maximum over shapes.
template <class Space = Kokkos::DefaultExecutionSpace>
Rate measure_sgemm_peak(const std::vector<std::array<std::size_t, 3>>& shapes, int reps = 5) {
  Rate out;
  for (const auto& [m, n, k] : shapes) {
    ops::Matrix<float, Space> A("peak.A", m, k), B("peak.B", k, n), C("peak.C", m, n);
    Kokkos::deep_copy(A, 0.5f);
    Kokkos::deep_copy(B, 0.25f);
    double wall = 1e30, cpu = 1e30;
    for (int r = 0; r <= reps; ++r) {
      Kokkos::fence();
      const auto t0 = std::chrono::steady_clock::now();
      const double c0 = process_cpu_seconds();
      ops::gemm(ops::Trans::N, ops::Trans::N, 1.0f, A, B, 0.0f, C);
      Kokkos::fence();
      if (r == 0) continue;
      wall = std::min(wall, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
      cpu = std::min(cpu, process_cpu_seconds() - c0);
    }
    const double flop = 2.0 * double(m) * double(n) * double(k);
    out.wall = std::max(out.wall, flop / wall);
    out.cpu = std::max(out.cpu, cpu > 0 ? flop / cpu : 0.0);
  }
  return out;
}

}  // namespace weft::metrics
