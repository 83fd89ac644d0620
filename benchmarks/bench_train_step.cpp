// Training-step benchmark of the reference GPT on one process: tokens/s,
// model FLOP/s and MFU against two yardsticks measured in the same run: the
// core's fp32 FMA peak (metrics::measure_core_peak, times the threads) and
// the best single-precision gemm of the GEMM provider at the same thread
// count; the weight products alone against both, and the step time broken
// down by kernel. Configs S and M are those of the issue that set the targets.
//
//   bench_train_step [--config S|M|all] [--steps N] [--warmup N] [--threads N]
//   bench_train_step --attention-seqs 128,1024,4096 [--heads 8] [--head-dim 32] [--reps 3]
//     only the attention comparison: one causal layer of one sequence at each
//     T, BLAS products around stored [T, T] probabilities against the
//     blockwise kernel (CPU seconds, median of --reps, alternating)
//   bench_train_step --config M --precision-ratio 7 [--warmup 2]
//     bf16 products (weft::Precision<BF16>) against fp32: one step of each
//     model in turn, medians of the wall times, and the ratio
#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <sstream>
#include <string>
#include <tuple>
#include <vector>

#include <time.h>

#include <weft/core/parse.hpp>
#include <weft/weft.hpp>

namespace {

using Space = Kokkos::DefaultExecutionSpace;
using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

// CPU seconds of this process. On a machine shared with other jobs, wall time
// also counts the time this process waited for a core; CPU time does not, so
// the benchmark reports both (and both for the peak).
double cpu_seconds() {
  timespec ts{};
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
  return double(ts.tv_sec) + 1e-9 * double(ts.tv_nsec);
}

struct Timing {
  double wall, cpu;
};

// Best-of-reps FLOP/s (wall, cpu) of a float gemm C[m,n] = op(A) op(B) through Kokkos Kernels.
Timing sgemm_flops(std::size_t m, std::size_t n, std::size_t k, int reps, weft::ops::Trans ta = weft::ops::Trans::N,
                   weft::ops::Trans tb = weft::ops::Trans::N, float beta = 0.0f) {
  using weft::ops::Trans;
  weft::ops::Matrix<float, Space> A("A", ta == Trans::N ? m : k, ta == Trans::N ? k : m),
      B("B", tb == Trans::N ? k : n, tb == Trans::N ? n : k), C("C", m, n);
  Kokkos::deep_copy(A, 0.5f);
  Kokkos::deep_copy(B, 0.25f);
  Timing best{1e30, 1e30};
  for (int r = 0; r < reps + 1; ++r) {  // the first call warms caches and BLAS buffers
    Kokkos::fence();
    const auto t0 = Clock::now();
    const double c0 = cpu_seconds();
    weft::ops::gemm(ta, tb, 1.0f, A, B, beta, C);
    Kokkos::fence();
    if (r > 0) {
      best.wall = std::min(best.wall, seconds_since(t0));
      best.cpu = std::min(best.cpu, cpu_seconds() - c0);
    }
  }
  const double flop = 2.0 * double(m) * double(n) * double(k);
  return {flop / best.wall, flop / best.cpu};
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// CPU seconds (median of reps) of one layer's causal attention, forward and
// backward, at the config's shapes: per-head BLAS products around a softmax
// over stored [T, T] probabilities, and the blockwise kernel. nn::Attention's
// automatic kernel keeps the BLAS path unless the probabilities would not
// fit its budget; this is the measurement behind that choice.
std::pair<double, double> attention_kernels(const weft::nn::GPTConfig& c, int reps) {
  using T = float;
  namespace ops = weft::ops;
  const std::size_t B = c.batch, H = c.heads, S = c.seq, hd = c.head_dim(), D = c.d_model, N = c.tokens();
  ops::Matrix<T, Space> qkv("qkv", N, 3 * D), heads("heads", N, D), dheads("dheads", N, D), dqkv("dqkv", N, 3 * D),
      lse("lse", B * H, S);
  ops::Tensor3<T, Space> P("P", B * H, S, S), dP("dP", B * H, S, S);
  weft::ops::init_normal(qkv, 1, "qkv", 1.0);
  weft::ops::init_normal(dheads, 1, "dheads", 1.0);
  const T scale = T(1) / std::sqrt(T(hd));
  auto cols = [&](std::size_t c0) { return std::make_pair(c0, c0 + hd); };
  auto rows = [&](std::size_t b) { return std::make_pair(b * S, (b + 1) * S); };
  auto blk = [&](const ops::Matrix<T, Space>& m, std::size_t b, std::size_t c0) {
    return Kokkos::subview(m, rows(b), cols(c0));
  };
  auto blas = [&] {
    for (std::size_t b = 0; b < B; ++b)
      for (std::size_t h = 0; h < H; ++h)
        ops::gemm(ops::Trans::N, ops::Trans::T, T(1), blk(qkv, b, h * hd), blk(qkv, b, D + h * hd), T(0),
                  Kokkos::subview(P, b * H + h, Kokkos::ALL, Kokkos::ALL));
    ops::softmax_forward(P, scale, true, P, lse);
    for (std::size_t b = 0; b < B; ++b)
      for (std::size_t h = 0; h < H; ++h)
        ops::gemm(ops::Trans::N, ops::Trans::N, T(1), Kokkos::subview(P, b * H + h, Kokkos::ALL, Kokkos::ALL),
                  blk(qkv, b, 2 * D + h * hd), T(0), blk(heads, b, h * hd));
    Kokkos::deep_copy(dqkv, T(0));
    for (std::size_t b = 0; b < B; ++b)
      for (std::size_t h = 0; h < H; ++h) {
        auto p = Kokkos::subview(P, b * H + h, Kokkos::ALL, Kokkos::ALL);
        auto dp = Kokkos::subview(dP, b * H + h, Kokkos::ALL, Kokkos::ALL);
        ops::gemm(ops::Trans::T, ops::Trans::N, T(1), p, blk(dheads, b, h * hd), T(1), blk(dqkv, b, 2 * D + h * hd));
        ops::gemm(ops::Trans::N, ops::Trans::T, T(1), blk(dheads, b, h * hd), blk(qkv, b, 2 * D + h * hd), T(0), dp);
      }
    ops::softmax_backward(P, dP, scale, dP, true);
    for (std::size_t b = 0; b < B; ++b)
      for (std::size_t h = 0; h < H; ++h) {
        auto ds = Kokkos::subview(dP, b * H + h, Kokkos::ALL, Kokkos::ALL);
        ops::gemm(ops::Trans::N, ops::Trans::N, T(1), ds, blk(qkv, b, D + h * hd), T(0), blk(dqkv, b, h * hd));
        ops::gemm(ops::Trans::T, ops::Trans::N, T(1), ds, blk(qkv, b, h * hd), T(1), blk(dqkv, b, D + h * hd));
      }
  };
  using SV = Kokkos::View<T***, Kokkos::LayoutStride, Space, Kokkos::MemoryTraits<Kokkos::Unmanaged>>;
  auto hv = [&](const ops::Matrix<T, Space>& m, std::size_t b, std::size_t c0) {
    return SV(&m(b * S, c0), Kokkos::LayoutStride(H, hd, S, m.stride(0), hd, 1));
  };
  auto flash = [&] {
    for (std::size_t b = 0; b < B; ++b)
      ops::flash_attention_forward(hv(qkv, b, 0), hv(qkv, b, D), hv(qkv, b, 2 * D), scale, true, hv(heads, b, 0),
                                   Kokkos::subview(lse, std::make_pair(b * H, (b + 1) * H), Kokkos::ALL));
    Kokkos::deep_copy(dqkv, T(0));
    for (std::size_t b = 0; b < B; ++b)
      ops::flash_attention_backward(hv(qkv, b, 0), hv(qkv, b, D), hv(qkv, b, 2 * D), hv(heads, b, 0),
                                    hv(dheads, b, 0), Kokkos::subview(lse, std::make_pair(b * H, (b + 1) * H), Kokkos::ALL),
                                    scale, true, hv(dqkv, b, 0), hv(dqkv, b, D), hv(dqkv, b, 2 * D));
  };
  std::vector<double> tb, tf;
  for (int r = 0; r < reps + 1; ++r) {  // alternating; the first round warms up
    Kokkos::fence();
    double c0 = cpu_seconds();
    blas();
    Kokkos::fence();
    if (r > 0) tb.push_back(cpu_seconds() - c0);
    c0 = cpu_seconds();
    flash();
    Kokkos::fence();
    if (r > 0) tf.push_back(cpu_seconds() - c0);
  }
  return {median(tb), median(tf)};
}

struct Named {
  const char* name;
  weft::nn::GPTConfig cfg;
};

weft::nn::GPTConfig make(std::size_t L, std::size_t D, std::size_t H, std::size_t T, std::size_t B, std::size_t V) {
  weft::nn::GPTConfig c;
  c.layers = L;
  c.d_model = D;
  c.heads = H;
  c.seq = T;
  c.batch = B;
  c.vocab = V;
  c.seed = 1;
  return c;
}

// The attention comparison alone at each T of `seqs` (one sequence, H heads of hd).
int attention_only(const std::string& seqs, std::size_t H, std::size_t hd, int reps) {
  std::printf("attention of one causal layer, one sequence, %zu heads of %zu, forward + backward, CPU seconds "
              "(median of %d, alternating)\n",
              H, hd, reps);
  std::printf("%8s %12s %12s %16s %14s\n", "T", "BLAS s", "blockwise s", "blockwise/BLAS", "[T,T] MiB");
  std::stringstream in(seqs);
  for (std::string item; std::getline(in, item, ',');) {
    const std::size_t T = weft::parse_integer<std::size_t>("--attention-seqs entry", item, 1);
    const weft::nn::GPTConfig c = make(1, H * hd, H, T, 1, 256);
    const auto [tb, tf] = attention_kernels(c, reps);
    std::printf("%8zu %12.4f %12.4f %16.2f %14.1f\n", T, tb, tf, tf / tb,
                2.0 * double(H) * double(T) * double(T) * sizeof(float) / 1048576.0);
    std::fflush(stdout);
  }
  return 0;
}

// Where the time goes: one more training step of `gpt` with fenced kernel
// scopes (metrics::Profiler), printed as seconds and percentages of the step.
template <class Model, class Opt, class Stream, class Ids>
void print_breakdown(Model& gpt, Opt& opt, Stream& stream, std::uint64_t step, const Ids& ids, const Ids& tg,
                     const char* what) {
  weft::metrics::Profiler prof;
  gpt.set_profiler(&prof);
  Kokkos::fence();
  const auto t0 = Clock::now();
  weft::optim::train_step(gpt, opt, stream, step, 1, ids, tg, 1e-4, 1.0, &prof);
  const double total = seconds_since(t0);
  gpt.set_profiler(nullptr);
  std::vector<std::pair<double, std::string>> rows;
  for (const auto& [k, e] : prof.entries()) rows.emplace_back(e.seconds, k);
  std::sort(rows.rbegin(), rows.rend());
  std::printf("  breakdown of one profiled step%s (%.4f s):\n", what, total);
  for (const auto& [s, k] : rows) std::printf("    %-16s %9.4f s %6.1f%%\n", k.c_str(), s, 100.0 * s / total);
  std::printf("    %-16s %9.4f s %6.1f%%\n", "(untimed)", total - prof.total_seconds(),
              100.0 * (total - prof.total_seconds()) / total);
}

// bf16 products against fp32: the same config as nn::GPT<float> and as
// nn::GPT<float, Strategy<Precision<BF16>>>, one step of each in turn for
// `rounds` rounds after a warm-up, medians of the wall times.
template <class Config>
void precision_ratio(const char* name, const Config& c, const std::vector<std::uint8_t>& corpus, int rounds, int warmup) {
  using BF16 = weft::Strategy<weft::Precision<weft::BF16>>;
  weft::nn::GPT<float, weft::SingleProcess, Space> f32(c);
  weft::nn::GPT<float, BF16, Space> b16(c);
  weft::optim::AdamW<float, Space> opt32(f32.parameters()), opt16(b16.parameters());
  weft::data::TokenStream s32(corpus, c.seq, c.seed), s16(corpus, c.seq, c.seed);
  const std::size_t N = c.tokens();
  weft::ops::Tokens<Space> ids("ids", N), tg("targets", N);
  std::vector<double> t32, t16;
  double l32 = 0, l16 = 0;
  for (int r = 0; r < warmup + rounds; ++r) {
    auto timed = [&](auto& gpt, auto& opt, auto& stream, double& loss) {
      Kokkos::fence();
      const auto t0 = Clock::now();
      loss = weft::optim::train_step(gpt, opt, stream, std::uint64_t(r), 1, ids, tg, 1e-4, 1.0).loss;
      Kokkos::fence();
      return seconds_since(t0);
    };
    const double a = timed(f32, opt32, s32, l32), b = timed(b16, opt16, s16, l16);
    if (r >= warmup) t32.push_back(a), t16.push_back(b);
  }
  const double m32 = median(t32), m16 = median(t16);
  std::printf("config %s, bf16 products against fp32 (alternating steps, median of %d): fp32 %.0f tok/s (loss %.4f), "
              "bf16 %.0f tok/s (loss %.4f), bf16 / fp32 %.2fx\n",
              name, rounds, double(N) / m32, l32, double(N) / m16, l16, m32 / m16);
  const auto step = std::uint64_t(warmup + rounds);
  print_breakdown(f32, opt32, s32, step, ids, tg, ", fp32");
  print_breakdown(b16, opt16, s16, step, ids, tg, ", bf16");
}

int run(int argc, char** argv) {
  std::string which = "all", attention_seqs;
  int steps = 0, warmup = 2, threads = 1, reps = 3, precision_rounds = 0;
  std::size_t heads = 8, head_dim = 32;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto value = [&]() -> std::string {
      WEFT_REQUIRE(i + 1 < argc, weft::ConfigError, a, " needs a value");
      return argv[++i];
    };
    if (a == "--config") which = value();
    else if (a == "--steps") steps = weft::parse_integer<int>(a, value(), 0);
    else if (a == "--warmup") warmup = weft::parse_integer<int>(a, value(), 0);
    else if (a == "--threads") threads = weft::parse_integer<int>(a, value(), 1, 1024);
    else if (a == "--attention-seqs") attention_seqs = value();
    else if (a == "--heads") heads = weft::parse_integer<std::size_t>(a, value(), 1);
    else if (a == "--head-dim") head_dim = weft::parse_integer<std::size_t>(a, value(), 1);
    else if (a == "--reps") reps = weft::parse_integer<int>(a, value(), 1);
    else if (a == "--precision-ratio") precision_rounds = weft::parse_integer<int>(a, value(), 1);
    else
      weft::detail::throw_error<weft::ConfigError>("unknown flag ", a,
                                                   "; expected --config S|M|all, --steps N, --warmup N, --threads N, "
                                                   "--attention-seqs T,T,... [--heads H] [--head-dim D] [--reps N], --precision-ratio ROUNDS");
  }
  WEFT_REQUIRE(reps >= 1 && heads >= 1 && head_dim >= 1, weft::ConfigError, "--reps, --heads and --head-dim must be positive");
  if (!attention_seqs.empty()) {
    weft::ops::set_blas_threads(threads, 1);
    return attention_only(attention_seqs, heads, head_dim, reps);
  }
  WEFT_REQUIRE(which == "S" || which == "M" || which == "all", weft::ConfigError, "--config ", which,
               ": expected S, M or all");
  const auto bt = weft::ops::set_blas_threads(threads, 1);
  std::printf("BLAS threads: %d (%s)\n", bt.threads, bt.reason.c_str());
  std::printf("host threads: %s\n", weft::ops::describe(weft::ops::host_binding(bt.threads, 1)).c_str());

  std::vector<Named> configs;
  if (which != "M") configs.push_back({"S", make(4, 256, 8, 128, 8, 4096)});
  if (which != "S") configs.push_back({"M", make(8, 512, 8, 256, 4, 8192)});

  std::printf("GEMM provider of float products: %s\n", weft::ops::float_gemm_provider_name<Space>());
  const auto core = weft::metrics::measure_core_peak();
  const int compute_threads = std::max(1, bt.threads);
  const double fma_peak = core.fp32 * compute_threads;
  std::printf("core peak (probe, CPU time): fp32 %.1f GFLOP/s (%s), bf16 %.1f GFLOP/s (%s); x %d thread(s): fp32 %.1f\n",
              core.fp32 * 1e-9, core.fp32_isa, core.bf16 * 1e-9, core.bf16_isa, compute_threads, fma_peak * 1e-9);

  const auto corpus = weft::data::synthetic_corpus(1 << 20, 0);
  if (precision_rounds > 0) {
    for (const auto& [name, c] : configs) precision_ratio(name, c, corpus, precision_rounds, warmup);
    return 0;
  }
  for (const auto& [name, c] : configs) {
    // The peak: the best of a square gemm and the model's own largest shapes.
    const std::size_t N = c.tokens(), D = c.d_model;
    Timing peak{0, 0};
    const std::size_t shapes[][3] = {{1024, 1024, 1024}, {N, 4 * D, D}, {N, D, 4 * D}, {N, c.vocab, D}};
    for (const auto& s : shapes) {
      const auto f = sgemm_flops(s[0], s[1], s[2], 5);
      peak.wall = std::max(peak.wall, f.wall);
      peak.cpu = std::max(peak.cpu, f.cpu);
    }

    weft::nn::GPT<float, weft::SingleProcess, Space> gpt(c);
    weft::optim::AdamW<float, Space> opt(gpt.parameters());
    weft::data::TokenStream stream(corpus, c.seq, c.seed);
    weft::ops::Tokens<Space> ids("ids", N), tg("targets", N);
    const int nsteps = steps > 0 ? steps : (name[0] == 'S' ? 10 : 4);
    std::uint64_t step = 0;
    for (int i = 0; i < warmup; ++i) weft::optim::train_step(gpt, opt, stream, step++, 1, ids, tg, 1e-4, 1.0);
    std::vector<double> walls, cpus;
    double loss = 0;
    for (int i = 0; i < nsteps; ++i) {
      Kokkos::fence();
      const auto t0 = Clock::now();
      const double c0 = cpu_seconds();
      loss = weft::optim::train_step(gpt, opt, stream, step++, 1, ids, tg, 1e-4, 1.0).loss;
      Kokkos::fence();
      walls.push_back(seconds_since(t0));
      cpus.push_back(cpu_seconds() - c0);
    }
    std::printf("config %s (L=%zu D=%zu H=%zu T=%zu B=%zu V=%zu, %zu params, %.1f MFLOP/token), median of %d steps, last loss %.4f:\n",
                name, c.layers, c.d_model, c.heads, c.seq, c.batch, c.vocab, gpt.num_parameters(),
                c.flops_per_token() * 1e-6, nsteps, loss);
    for (const auto& [what, t, p] : {std::tuple{"wall", median(walls), peak.wall}, std::tuple{"cpu ", median(cpus), peak.cpu}}) {
      const double tps = double(N) / t, flops = c.flops_per_token() * tps;
      std::printf("  %s: step %.4f s, %.0f tok/s, model %.2f GFLOP/s, MFU %.3f against the fp32 FMA peak (%.1f GFLOP/s), "
                  "%.3f against the best sgemm (%.2f GFLOP/s)\n",
                  what, t, tps, flops * 1e-9, flops / fma_peak, fma_peak * 1e-9, flops / p, p * 1e-9);
    }

    {
      // Each weight product of the step alone (best of 3, CPU time) against the
      // peak: forward NN, input gradient NT, weight gradient TN (beta = 1).
      using weft::ops::Trans;
      const std::size_t F = c.hidden();
      const std::pair<const char*, std::array<std::size_t, 2>> layers[] = {
          {"qkv", {D, c.qkv_cols()}}, {"proj", {D, D}}, {"up", {D, F}}, {"down", {F, D}}, {"head", {D, c.vocab}}};
      std::printf("  weight products alone, GFLOP/s (CPU) and fraction of the fp32 FMA peak: forward NN | dx NT | dW TN\n");
      for (const auto& [lname, io] : layers) {
        const auto fw = sgemm_flops(N, io[1], io[0], 3);
        const auto dx = sgemm_flops(N, io[0], io[1], 3, Trans::N, Trans::T);
        const auto dw = sgemm_flops(io[0], io[1], N, 3, Trans::T, Trans::N, 1.0f);
        std::printf("    %-5s [%zu x %zu] x [%zu x %zu]: %6.1f %.2f | %6.1f %.2f | %6.1f %.2f\n", lname, N, io[0], io[0],
                    io[1], fw.cpu * 1e-9, fw.cpu / fma_peak, dx.cpu * 1e-9, dx.cpu / fma_peak, dw.cpu * 1e-9,
                    dw.cpu / fma_peak);
      }
    }
    {
      const auto [tb, tf] = attention_kernels(c, 5);
      std::printf("  attention of one layer, forward + backward (CPU s, median of 5): BLAS products + softmax %.4f, "
                  "blockwise %.4f, blockwise / BLAS %.2f\n",
                  tb, tf, tf / tb);
    }

    // Kokkos events of one more step (kernels, fences, deep copies,
    // allocations), counted after the timed steps so that none of them pays
    // for the callbacks.
    {
      weft::metrics::CountedRegion region;
      weft::optim::train_step(gpt, opt, stream, step++, 1, ids, tg, 1e-4, 1.0);
      const auto k = region.counts();
      weft::metrics::KernelCounters::uninstall();
      std::printf("  Kokkos events per step: %s\n", k.summary().c_str());
    }

    // Where the time goes: one more step with fenced kernel scopes.
    print_breakdown(gpt, opt, stream, step++, ids, tg, "");
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  weft::Environment env(argc, argv);
  try {
    return run(argc, argv);
  } catch (const weft::Error& e) {
    std::fprintf(stderr, "bench_train_step: %s\n", e.what());
    return 2;
  }
}
