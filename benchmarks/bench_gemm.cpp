// The GEMM providers against the machine's limits, in one process on one
// thread: every weight product of configs S and M (forward NN, input gradient
// NT, weight gradient TN with beta = 1) in fp32 through each provider compiled
// in, and in bf16 (bf16 inputs, fp32 accumulation and output), each as a
// fraction of the core's peak measured by the probe in the same run; the
// per-call cost of attention-sized products; and the decode products (few
// rows times a weight matrix) against a streaming read of memory measured in
// the same run. Runs of the providers alternate, and each figure is the
// median of --reps runs, by CPU time.
//
//   bench_gemm [--section all|fp32|bf16|calls|decode] [--reps N] [--decode-mb MB]
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <functional>
#include <string>
#include <vector>

#include <weft/weft.hpp>

#include "bench_args.hpp"

namespace {

using Space = Kokkos::DefaultHostExecutionSpace;
using weft::ops::Trans;
template <class T>
using Mat = weft::ops::Matrix<T, Space>;

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// CPU seconds of one call of f, median of reps after a warm-up call.
double cpu_time(const std::function<void()>& f, int reps) {
  f();
  std::vector<double> t;
  for (int r = 0; r < reps; ++r) {
    const double c0 = weft::metrics::process_cpu_seconds();
    f();
    t.push_back(weft::metrics::process_cpu_seconds() - c0);
  }
  return median(t);
}

template <class T>
Mat<T> filled(const char* label, std::size_t r, std::size_t c, float v) {
  Mat<T> m(std::string(label), r, c);
  Kokkos::deep_copy(m, T(v));
  return m;
}

struct Shape {
  const char* name;
  std::size_t n, in, out;  // tokens, input and output features
};

std::vector<std::pair<const char*, std::vector<Shape>>> configs() {
  // S: D=256, V=4096; M: D=512, V=8192; 1024 tokens each (docs/model.md).
  auto make = [](std::size_t D, std::size_t V) {
    const std::size_t N = 1024;
    return std::vector<Shape>{
        {"qkv", N, D, 3 * D}, {"proj", N, D, D}, {"up", N, D, 4 * D}, {"down", N, 4 * D, D}, {"head", N, D, V}};
  };
  return {{"S", make(256, 4096)}, {"M", make(512, 8192)}};
}

// The three products of one weight: forward y = x W, dx = dy W^T, dW += x^T dy.
template <class Provider, class TI, class TO>
std::array<double, 3> weight_products(const Shape& s, int reps) {
  auto x = filled<TI>("x", s.n, s.in, 0.5f), w = filled<TI>("w", s.in, s.out, 0.25f), dy = filled<TI>("dy", s.n, s.out, 0.125f);
  auto y = filled<TO>("y", s.n, s.out, 0), dx = filled<TO>("dx", s.n, s.in, 0), dw = filled<TO>("dw", s.in, s.out, 0);
  using R = weft::ops::gemm_provider_runner<Provider>;
  const double flop = 2.0 * double(s.n) * double(s.in) * double(s.out);
  const double fw = cpu_time([&] { R::run(Trans::N, Trans::N, TO(1), x, w, TO(0), y); }, reps);
  const double bx = cpu_time([&] { R::run(Trans::N, Trans::T, TO(1), dy, w, TO(0), dx); }, reps);
  const double bw = cpu_time([&] { R::run(Trans::T, Trans::N, TO(1), x, dy, TO(1), dw); }, reps);
  return {flop / fw, flop / bx, flop / bw};
}

void print_row(const Shape& s, const std::array<double, 3>& r, double peak) {
  std::printf("    %-5s [%zu x %zu] x [%zu x %zu]: %6.1f %.2f | %6.1f %.2f | %6.1f %.2f\n", s.name, s.n, s.in, s.in, s.out,
              r[0] * 1e-9, r[0] / peak, r[1] * 1e-9, r[1] / peak, r[2] * 1e-9, r[2] / peak);
}

// Bytes per second of a streaming read (a sum over `bytes` of floats, 16
// independent accumulators), best of reps: the memory-bandwidth limit of a
// product that reads its weights once.
double stream_read_bandwidth(std::size_t bytes, int reps) {
  const std::size_t n = bytes / sizeof(float);
  std::vector<float> a(n, 1.0f);
  double best = 0;
  volatile float keep = 0;
  for (int r = 0; r <= reps; ++r) {
    const auto t0 = std::chrono::steady_clock::now();
    float acc[16] = {};
    for (std::size_t i = 0; i + 16 <= n; i += 16)
      for (int j = 0; j < 16; ++j) acc[j] += a[i + j];
    const double t = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    float s = 0;
    for (float v : acc) s += v;
    keep = keep + s;
    if (r > 0) best = std::max(best, double(n * sizeof(float)) / t);
  }
  return best;
}

}  // namespace

int main(int argc, char** argv) {
  weft::Environment env(argc, argv);
  std::string section = "all";
  std::size_t reps = 5, decode_mb = 256;
  weft::bench::Flags flags("bench_gemm");
  flags.add("--section", section, "what to measure: all, fp32, bf16, calls or decode")
      .add("--reps", reps, "timed runs per figure (median)", 1)
      .add("--decode-mb", decode_mb, "MiB of weights the decode products cycle through (more than the last-level cache)", 1);
  if (const int rc = flags.parse(argc, argv, env.world().rank() == 0)) return rc == 1 ? 0 : rc;
  if (section != "all" && section != "fp32" && section != "bf16" && section != "calls" && section != "decode") {
    std::fprintf(stderr, "bench_gemm: --section %s is not one of all, fp32, bf16, calls, decode\n", section.c_str());
    return 2;
  }
  const int R = int(reps);
  const auto bt = weft::ops::set_blas_threads(1, 1);
  std::printf("threads: 1 (BLAS/oneDNN %d: %s)\n", bt.threads, bt.reason.c_str());
  const auto core = weft::metrics::measure_core_peak();
  std::printf("core peak (probe, CPU time): fp32 %.1f GFLOP/s (%s), bf16 %.1f GFLOP/s (%s)\n", core.fp32 * 1e-9,
              core.fp32_isa, core.bf16 * 1e-9, core.bf16_isa);
  std::printf("providers: float %s, bf16 %s, double %s\n", weft::ops::float_gemm_provider_name<Space>(),
              weft::ops::gemm_provider<Space, weft::bf16, weft::bf16, float>::type::name,
              weft::ops::gemm_provider<Space, double, double, double>::type::name);
  const bool all = section == "all";

  if (all || section == "fp32") {
    for (const auto& [cname, shapes] : configs()) {
      std::printf("config %s, fp32 weight products, GFLOP/s (CPU, median of %d) and fraction of the fp32 FMA peak: "
                  "forward NN | dx NT | dW TN\n",
                  cname, R);
      for (const auto& s : shapes) {
        // Alternate the providers shape by shape, so drift in the machine's load falls on both.
        std::printf("  %s\n", "kokkos-kernels (system BLAS):");
        print_row(s, weight_products<weft::ops::KokkosKernelsGemm, float, float>(s, R), core.fp32);
#if WEFT_ONEDNN_PROVIDER
        std::printf("  %s\n", "onednn:");
        print_row(s, weight_products<weft::ops::OneDnnGemm, float, float>(s, R), core.fp32);
#endif
      }
    }
  }

  if ((all || section == "bf16") && core.bf16 > 0) {
    using BP = weft::ops::gemm_provider<Space, weft::bf16, weft::bf16, float>::type;
    for (const auto& [cname, shapes] : configs()) {
      std::printf("config %s, bf16 weight products (bf16 inputs, fp32 accumulation and output) through %s, GFLOP/s "
                  "(CPU, median of %d) and fraction of the bf16 peak: forward NN | dx NT | dW TN\n",
                  cname, BP::name, R);
      for (const auto& s : shapes) print_row(s, weight_products<BP, weft::bf16, float>(s, R), core.bf16);
    }
  }

  if (all || section == "calls") {
    // Attention's per-(sequence, head) products: T x hd by hd x T, and back.
    std::printf("attention-sized products, microseconds per call (CPU, median of %d x 200 calls): provider | "
                "kokkos-kernels\n",
                R);
    for (auto [t, hd] : {std::pair<std::size_t, std::size_t>{128, 32}, {256, 64}}) {
      auto q = filled<float>("q", t, hd, 0.5f), k = filled<float>("k", t, hd, 0.25f), s = filled<float>("s", t, t, 0);
      auto provider = [&] {
        for (int i = 0; i < 200; ++i) weft::ops::gemm(Trans::N, Trans::T, 1.0f, q, k, 0.0f, s);
      };
      auto kk = [&] {
        for (int i = 0; i < 200; ++i)
          weft::ops::gemm_provider_runner<weft::ops::KokkosKernelsGemm>::run(Trans::N, Trans::T, 1.0f, q, k, 0.0f, s);
      };
      const double a = cpu_time(provider, R) / 200, b = cpu_time(kk, R) / 200;
      const double flop = 2.0 * double(t) * double(t) * double(hd);
      std::printf("  [%zu x %zu] x [%zu x %zu]: %.2f us (%.1f GFLOP/s) | %.2f us (%.1f GFLOP/s)\n", t, hd, hd, t, a * 1e6,
                  flop / a * 1e-9, b * 1e6, flop / b * 1e-9);
    }
  }

  if (all || section == "decode") {
    const double bw = stream_read_bandwidth(decode_mb << 20, R);
    std::printf("decode products: streaming read %.2f GB/s (%zu MiB, best of %d); each product cycles through %zu "
                "MiB of weight matrices, time per product by wall clock (median of %d)\n",
                bw * 1e-9, decode_mb, R, decode_mb, R);
    std::printf("  rows  weights [k x n]    | few-rows kernel: GB/s of weights, fraction of the read | %s\n",
                weft::ops::float_gemm_provider_name<Space>());
    for (auto [kk, nn] : {std::pair<std::size_t, std::size_t>{1024, 3072}, {1024, 4096}, {4096, 1024}}) {
      const std::size_t wbytes = kk * nn * sizeof(float);
      const std::size_t count = std::max<std::size_t>(2, (decode_mb << 20) / wbytes);
      std::vector<Mat<float>> ws;
      for (std::size_t i = 0; i < count; ++i) ws.push_back(filled<float>("w", kk, nn, 0.01f));
      for (std::size_t m : {1, 4, 16}) {
        auto a = filled<float>("a", m, kk, 0.5f), c = filled<float>("c", m, nn, 0);
        auto timed = [&](auto&& product) {
          std::vector<double> t;
          for (int r = 0; r <= R; ++r) {
            const auto t0 = std::chrono::steady_clock::now();
            for (const auto& w : ws) product(w);
            if (r > 0)
              t.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() / double(count));
          }
          return median(t);
        };
        const double few = timed([&](const Mat<float>& w) { weft::ops::gemm_few_rows(a, w, c); });
        const double prov = timed([&](const Mat<float>& w) { weft::ops::gemm(Trans::N, Trans::N, 1.0f, a, w, 0.0f, c); });
        std::printf("  %4zu  [%zu x %zu] %5.1f MB | %6.2f GB/s %.2f | %6.2f GB/s %.2f\n", m, kk, nn, wbytes * 1e-6,
                    wbytes / few * 1e-9, wbytes / few / bw, wbytes / prov * 1e-9, wbytes / prov / bw);
      }
    }
  }
  return 0;
}
