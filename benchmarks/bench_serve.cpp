// bench_serve: continuous (iteration-level) batching against static batching
// of the same requests at the same offered load, in the same run: time to
// first token and inter-token latency percentiles, and throughput, with the
// ratios static / continuous. Then pure decode steps against the
// memory-bandwidth limit: the bytes of weights and KV cache a decode step
// reads, per token, over the copy bandwidth measured in the same run.
// Last, decode at batch 1 with bf16 weights and KV cache against fp32
// (weft::Precision<BF16> against Precision<>): --precision-runs runs of each,
// alternating, the ratio of their median tokens/s.
//
//   mpirun -n 1 bench_serve --requests 64 --rate 40
//
// The world is the TP axis (the model and its KV cache split over it).
#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <string>
#include <thread>
#include <vector>

#include <weft/comm/environment.hpp>
#include <weft/serve/serve.hpp>
#include <weft/metrics/counters.hpp>

#include "bench_args.hpp"

namespace {

using TPOnly = weft::Strategy<weft::On<weft::TP, weft::TensorParallel<>>>;
using Model = weft::nn::GPT<float, TPOnly>;
using Engine = weft::serve::Engine<float, Kokkos::DefaultExecutionSpace, weft::TensorParallel<>>;
using EngineBF16 =
    weft::serve::Engine<float, Kokkos::DefaultExecutionSpace, weft::TensorParallel<>, weft::Precision<weft::BF16>>;

double percentile(std::vector<double> v, double p) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const double x = p / 100.0 * double(v.size() - 1);
  const std::size_t i = std::size_t(x);
  return i + 1 < v.size() ? v[i] + (x - double(i)) * (v[i + 1] - v[i]) : v.back();
}

struct Result {
  std::vector<double> ttft, itl;
  double seconds = 0;
  std::size_t tokens = 0, steps = 0, preemptions = 0;
  double tokens_per_second() const { return seconds > 0 ? double(tokens) / seconds : 0; }
};

// Serves `reqs` arriving at `arrival` (seconds from the start) in real time.
// TP rank 0's clock decides what has arrived; the count is broadcast so that
// every rank submits the same requests at the same step.
Result serve(Model& model, weft::Comm& world, const weft::serve::EngineConfig& ec,
             const std::vector<weft::serve::Request>& reqs, const std::vector<double>& arrival) {
  Engine e(model, ec);
  Result r;
  std::vector<double> at(reqs.size());
  std::size_t next = 0, done = 0;
  const double t0 = e.now();
  while (done < reqs.size()) {
    double now = e.now() - t0;
    long n = 0;
    if (world.rank() == 0) {
      if (e.idle() && next < reqs.size() && arrival[next] > now) {
        std::this_thread::sleep_for(std::chrono::duration<double>(arrival[next] - now));
        now = e.now() - t0;
      }
      while (next + std::size_t(n) < reqs.size() && arrival[next + std::size_t(n)] <= now) ++n;
    }
    Kokkos::View<long*, Kokkos::HostSpace, Kokkos::MemoryTraits<Kokkos::Unmanaged>> nv(&n, 1);
    world.broadcast(nv, 0);
    for (long k = 0; k < n; ++k, ++next) {
      const auto s = e.submit(reqs[next]);
      WEFT_REQUIRE(s.accepted, weft::ConfigError, "request ", next, " rejected: ", s.error);
      at[s.id] = t0 + arrival[next];
    }
    if (e.idle()) continue;
    e.step();
    ++r.steps;
    for (const auto& c : e.take_finished()) {
      r.ttft.push_back(c.token_times.front() - at[c.id]);
      for (std::size_t k = 1; k < c.token_times.size(); ++k) r.itl.push_back(c.token_times[k] - c.token_times[k - 1]);
      r.tokens += c.tokens.size();
      ++done;
    }
  }
  r.seconds = e.now() - t0;
  r.preemptions = e.preemptions();
  return r;
}

// Seconds per decode step of one sequence through an engine of type E: a
// fresh engine, a prompt of `context` tokens prefilled (untimed), then
// `steps` timed steps of one token. Also the engine's weight bytes.
template <class E>
std::pair<double, std::size_t> one_sequence_step(Model& model, weft::Comm& world, weft::serve::EngineConfig ec,
                                                 std::size_t context, std::size_t steps, std::size_t vocab,
                                                 std::size_t seq) {
  ec.batching = weft::serve::Batching::continuous;
  ec.max_seqs = 1;
  ec.token_budget = context;
  ec.blocks = weft::serve::blocks_for(seq, ec.block_size);
  E e(model, ec);
  weft::serve::Request r;
  for (std::size_t k = 0; k < context; ++k) r.prompt.push_back(int((k * 7) % vocab));
  r.max_new_tokens = steps + 2;
  WEFT_REQUIRE(e.submit(r).accepted, weft::Error, "decode request rejected");
  e.step();  // the prompt in one step
  world.barrier();
  const auto t = std::chrono::steady_clock::now();
  for (std::size_t s = 0; s < steps; ++s) e.step();
  const double dt = std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count();
  return {dt / double(steps), e.runner().memory().weights};
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const std::size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

}  // namespace

int main(int argc, char** argv) {
  weft::Environment env(argc, argv);
  weft::Comm& world = env.world();
  std::size_t layers = 4, d_model = 256, heads = 8, seq = 256, vocab = 256, requests = 64, prompt_lo = 16,
              prompt_hi = 128, out_lo = 16, out_hi = 96, max_seqs = 16, block_size = 16, token_budget = 256,
              decode_batch = 16, decode_steps = 32, decode_context = 128, copy_mb = 256, seed = 11,
              precision_runs = 5;
  double rate = 40, prompt_scale = 0, output_scale = 0, prompt_sigma = 1, output_sigma = 1;
  std::string prompt_dist = "uniform", output_dist = "uniform";
  weft::bench::Flags flags("bench_serve");
  flags.add("--layers", layers, "transformer blocks", 1)
      .add("--d-model", d_model, "model width", 1)
      .add("--heads", heads, "attention heads", 1)
      .add("--seq", seq, "context (tokens per sequence)", 2)
      .add("--vocab", vocab, "vocabulary size", 2)
      .add("--requests", requests, "requests of the latency comparison", 1)
      .add("--rate", rate, "offered load: Poisson arrivals per second", 1e-6)
      .add("--prompt-min", prompt_lo, "shortest prompt", 1)
      .add("--prompt-max", prompt_hi, "longest prompt", 1)
      .add("--output-min", out_lo, "fewest generated tokens", 1)
      .add("--output-max", out_hi, "most generated tokens", 1)
      .add("--prompt-dist", prompt_dist, "prompt lengths: uniform, exponential or lognormal (docs/serving.md)")
      .add("--prompt-scale", prompt_scale,
           "prompts' excess over --prompt-min: its mean (exponential) or median (lognormal); 0: a quarter / an eighth of the range")
      .add("--prompt-sigma", prompt_sigma, "lognormal prompts: deviation of the excess' logarithm", 1e-9)
      .add("--output-dist", output_dist, "output lengths: uniform, exponential or lognormal (docs/serving.md)")
      .add("--output-scale", output_scale,
           "outputs' excess over --output-min: its mean (exponential) or median (lognormal); 0: a quarter / an eighth of the range")
      .add("--output-sigma", output_sigma, "lognormal outputs: deviation of the excess' logarithm", 1e-9)
      .add("--max-seqs", max_seqs, "sequences per step (both policies)", 1)
      .add("--block-size", block_size, "tokens per KV block", 1)
      .add("--token-budget", token_budget, "tokens per step (both policies)", 1)
      .add("--decode-batch", decode_batch, "sequences of the decode-bandwidth measurement", 1)
      .add("--decode-steps", decode_steps, "timed decode steps", 1)
      .add("--decode-context", decode_context, "prompt tokens before the timed decode steps", 1)
      .add("--copy-mb", copy_mb, "MiB of the copy-bandwidth measurement", 1)
      .add("--precision-runs", precision_runs,
           "runs each of fp32 and bf16 decode at batch 1, alternating (0: none)")
      .add("--seed", seed, "model and traffic seed");
  if (const int rc = flags.parse(argc, argv, world.rank() == 0)) return rc == 1 ? 0 : rc;
  try {
    weft::nn::GPTConfig c;
    c.layers = layers;
    c.d_model = d_model;
    c.heads = heads;
    c.seq = seq;
    c.vocab = vocab;
    c.batch = 1;
    c.seed = seed;
    const weft::serve::LengthDist prompt_len{prompt_lo, prompt_hi, weft::serve::parse_length_shape("--prompt-dist", prompt_dist),
                                             prompt_scale, prompt_sigma},
        output_len{out_lo, out_hi, weft::serve::parse_length_shape("--output-dist", output_dist), output_scale, output_sigma};
    prompt_len.validate("--prompt-min/--prompt-max");  // each range in order
    output_len.validate("--output-min/--output-max");
    WEFT_REQUIRE(prompt_hi + out_hi <= seq, weft::ConfigError, "prompts of ", prompt_lo, "-", prompt_hi,
                 " and outputs of ", out_lo, "-", out_hi, " tokens must fit the context --seq ", seq);
    Model model(c, world);
    // The traffic: Poisson arrivals and the lengths' distributions, the same for both policies.
    std::vector<weft::serve::Request> reqs;
    std::vector<double> arrival;
    double clock = 0;
    for (std::size_t i = 0; i < requests; ++i) {
      const weft::ops::Philox p(seed, 77, i);
      weft::serve::Request r;
      const std::size_t np = prompt_len.draw((std::uint64_t(p.x[2]) << 32) ^ p.x[0]);
      r.max_new_tokens = output_len.draw((std::uint64_t(p.x[3]) << 32) ^ p.x[1]);
      for (std::size_t k = 0; k < np; ++k) r.prompt.push_back(int(weft::ops::Philox(seed, 78 + i, k).x[0] % vocab));
      clock += -std::log(weft::ops::Philox(seed, 79, i).uniform()) / rate;
      arrival.push_back(clock);
      reqs.push_back(std::move(r));
    }
    weft::serve::EngineConfig ec;
    ec.block_size = block_size;
    ec.max_seqs = max_seqs;
    ec.token_budget = token_budget;
    ec.blocks = weft::serve::blocks_for(max_seqs * seq, block_size);
    const bool root = world.rank() == 0;
    if (root)
      std::printf("bench_serve: L=%zu D=%zu H=%zu context=%zu V=%zu tp=%d; %zu requests at %.1f/s, prompts %zu-%zu (%s, mean "
                  "%.1f), outputs %zu-%zu (%s, mean %.1f); max %zu sequences, %zu tokens per step\n",
                  layers, d_model, heads, seq, vocab, world.size(), requests, rate, prompt_lo, prompt_hi,
                  prompt_len.shape_name(), prompt_len.mean(), out_lo, out_hi, output_len.shape_name(), output_len.mean(),
                  max_seqs, token_budget);
    ec.batching = weft::serve::Batching::continuous;
    const Result cont = serve(model, world, ec, reqs, arrival);
    ec.batching = weft::serve::Batching::static_batch;
    const Result stat = serve(model, world, ec, reqs, arrival);
    if (root) {
      auto line = [](const char* name, const Result& r) {
        std::printf("  %-10s TTFT p50 %8.4f p90 %8.4f p99 %8.4f s | inter-token p50 %8.5f p90 %8.5f p99 %8.5f s | %8.1f tokens/s "
                    "(%zu tokens, %.2f s, %zu steps, %zu preemptions)\n",
                    name, percentile(r.ttft, 50), percentile(r.ttft, 90), percentile(r.ttft, 99), percentile(r.itl, 50),
                    percentile(r.itl, 90), percentile(r.itl, 99), r.tokens_per_second(), r.tokens, r.seconds, r.steps,
                    r.preemptions);
      };
      line("continuous", cont);
      line("static", stat);
      std::printf("  static / continuous: TTFT p99 %.2fx, inter-token p99 %.2fx, p50 %.2fx; throughput continuous / static %.2fx\n",
                  percentile(stat.ttft, 99) / percentile(cont.ttft, 99), percentile(stat.itl, 99) / percentile(cont.itl, 99),
                  percentile(stat.itl, 50) / percentile(cont.itl, 50), cont.tokens_per_second() / stat.tokens_per_second());
    }

    // Copy bandwidth: best of 5 deep_copies of copy_mb MiB, counting bytes read + written.
    const std::size_t n = copy_mb * (1u << 20) / sizeof(float);
    Kokkos::View<float*> a("copy.a", n), b("copy.b", n);
    Kokkos::deep_copy(a, 1.0f);
    Kokkos::deep_copy(b, 2.0f);
    double best = 1e30;
    for (int rep = 0; rep < 5; ++rep) {
      Kokkos::fence();
      const auto t = std::chrono::steady_clock::now();
      Kokkos::deep_copy(b, a);
      Kokkos::fence();
      best = std::min(best, std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count());
    }
    const double bandwidth = 2.0 * double(n * sizeof(float)) / best;

    // Pure decode: decode_batch sequences of decode_context prompt tokens, then timed steps of one token each.
    WEFT_REQUIRE(decode_context + decode_steps + 3 <= seq, weft::ConfigError, "--decode-context ",
                 decode_context, " + --decode-steps ", decode_steps, " + 3 exceed the context --seq ", seq);
    // Bytes of the weights a decode step reads on this rank: every weight except the embedding tables (it
    // reads one row of those per sequence).
    std::size_t tables = 0;
    for (auto* p : model.parameters())
      if (p->name() == "tok_emb.weight" || p->name() == "pos_emb.weight") tables += p->size() * sizeof(float);
    if (root)
      std::printf("  copy bandwidth %.2f GB/s (read + written, best of 5 copies of %zu MiB)\n", bandwidth / 1e9, copy_mb);
    // A step of one sequence first (when --decode-batch is more): how a step's time grows with its sequences is
    // what continuous batching's gain depends on.
    double one_seq_step = 0;
    for (const std::size_t batch : decode_batch > 1 ? std::vector<std::size_t>{1, decode_batch} : std::vector<std::size_t>{1}) {
      weft::serve::EngineConfig dc = ec;
      dc.batching = weft::serve::Batching::continuous;
      dc.max_seqs = batch;
      dc.token_budget = batch * decode_context;  // every prompt in one step, so all sequences decode together
      dc.blocks = weft::serve::blocks_for(batch * seq, block_size);
      Engine e(model, dc);
      for (std::size_t i = 0; i < batch; ++i) {
        weft::serve::Request r;
        for (std::size_t k = 0; k < decode_context; ++k) r.prompt.push_back(int((i * 31 + k * 7) % vocab));
        r.max_new_tokens = decode_steps + 3;  // the prefill's, the first decode step's, the timed ones, one counted
        WEFT_REQUIRE(e.submit(r).accepted, weft::Error, "decode request rejected");
      }
      // Prefill (untimed) until every sequence is decoding.
      std::size_t guard = 0;
      for (;;) {
        const auto st = e.step();
        if (st.tokens == batch && st.sampled == batch) break;
        WEFT_REQUIRE(++guard < 10000, weft::Error, "the decode batch never formed");
      }
      world.barrier();
      const auto t = std::chrono::steady_clock::now();
      for (std::size_t s = 0; s < decode_steps; ++s) e.step();
      const double dt = std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count();
      // One more decode step (every request has a token left), counted:
      // Kokkos' kernels, fences, deep copies and allocations of a step.
      weft::metrics::CountedRegion region;
      const auto counted = e.step();
      const auto k = region.counts();
      weft::metrics::KernelCounters::uninstall();
      const auto mem = e.runner().memory();
      // Each sequence's keys and values of every layer at its mean context in the timed steps.
      const double ctx = double(decode_context) + 1.0 + double(decode_steps) / 2.0;
      const double kv_width = double(c.kv() / std::size_t(world.size()) * c.head_dim());
      const double kv_read = double(batch) * double(layers) * 2.0 * ctx * kv_width * sizeof(float);
      const double step_bytes = double(mem.weights - tables) + kv_read;
      const double tokens_per_s = double(batch * decode_steps) / dt;
      const double limit = bandwidth / (step_bytes / double(batch));
      const double step = dt / double(decode_steps);
      if (batch == 1) one_seq_step = step;
      if (root)
        std::printf("  decode: %zu sequences x %zu steps at context ~%.0f: %.1f tokens/s, %.2f ms a step (%.2fx a step of one "
                    "sequence); a step reads %.2f MB (weights %.2f, KV %.2f) = %.3f MB per token; bandwidth limit %.1f "
                    "tokens/s; measured / limit %.3f\n",
                    batch, decode_steps, ctx, tokens_per_s, step * 1e3, step / one_seq_step, step_bytes / 1e6,
                    double(mem.weights - tables) / 1e6, kv_read / 1e6, step_bytes / double(batch) / 1e6, limit,
                    tokens_per_s / limit);
      if (root)
        std::printf("  decode: Kokkos events per step of %zu sequences (rank 0): %s\n", counted.sequences,
                    k.summary().c_str());
    }

    // bf16 weights and KV cache against fp32 at batch 1: alternating runs, medians.
    if (precision_runs > 0) {
      std::size_t table_elems = 0;  // the embedding tables: a decode step reads one row of each
      for (auto* p : model.parameters())
        if (p->name() == "tok_emb.weight" || p->name() == "pos_emb.weight") table_elems += p->size();
      std::array<std::vector<double>, 2> rate_of;  // fp32, bf16: tokens/s of each run
      std::array<std::size_t, 2> weights{};
      for (std::size_t run = 0; run < precision_runs; ++run)
        for (int k = 0; k < 2; ++k) {
          const auto [step, w] =
              k == 0 ? one_sequence_step<Engine>(model, world, ec, decode_context, decode_steps, vocab, seq)
                     : one_sequence_step<EngineBF16>(model, world, ec, decode_context, decode_steps, vocab, seq);
          rate_of[std::size_t(k)].push_back(1.0 / step);
          weights[std::size_t(k)] = w;
        }
      if (root) {
        const double ctx = double(decode_context) + 1.0 + double(decode_steps) / 2.0;
        const double kv_elems = double(layers) * 2.0 * ctx * double(c.kv() / std::size_t(world.size()) * c.head_dim());
        const char* names[2] = {"fp32", "bf16"};
        const double elem[2] = {4, 2};
        for (int k = 0; k < 2; ++k) {
          const auto& v = rate_of[std::size_t(k)];
          const double bytes = double(weights[std::size_t(k)]) - double(table_elems) * elem[k] + kv_elems * elem[k];
          const double med = median(v);
          std::printf("  decode at batch 1, %s weights and KV cache: median %.1f tokens/s (runs %.1f-%.1f) at context "
                      "~%.0f; a token reads %.2f MB; %.2f GB/s read, %.3f of the copy bandwidth's limit\n",
                      names[k], med, *std::min_element(v.begin(), v.end()), *std::max_element(v.begin(), v.end()), ctx,
                      bytes / 1e6, bytes * med / 1e9, med / (bandwidth / bytes));
        }
        std::printf("  bf16 / fp32 decode tokens/s at batch 1: %.2fx (medians of %zu alternating runs of %zu steps)\n",
                    median(rate_of[1]) / median(rate_of[0]), precision_runs, decode_steps);
      }
    }
  } catch (const weft::Error& err) {
    return weft::report_error_once(env, err, "bench_serve", 2);
  }
  return 0;
}
