// Pipeline parallelism measured, in two parts.
//
// bubble (4 ranks): every schedule (gpipe, 1f1b, interleaved:2, zb) runs its
//   plan on pp=4 with equal stages; each rank's idle fraction = 1 - (its
//   compute time) / (the step's span from the first rank's start to the last
//   rank's end), against the schedule's analytic bubble (zb: with the F, B, W
//   times measured in the same run). The timeline of the last measured step
//   of each schedule is written as a Chrome trace (chrome://tracing, Perfetto)
//   and printed as text. The optimizer is not part of the step measured here.
// throughput (2 ranks): tokens/s of one optimizer step of config M (L=8,
//   D=512, H=8, T=256, V=8192) on pp=2 (1f1b) against pp=1 (rank 0 alone, the
//   same global batch and microbatches through gradient accumulation).
//
//   mpirun -n 4 bench_pipeline [--microbatches 8] [--steps 5] [--warmup 1] [--trace-dir .]
//   mpirun -n 2 bench_pipeline [--microbatches 4] [--micro 2] [--steps 3]
//
// With 4 ranks only the bubble part runs, with 2 only the throughput part.
// On machines with fewer cores than ranks (oversubscribed, ranks yielding
// when idle) the idle fractions include the effect of ranks sharing cores.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <string>
#include <type_traits>
#include <vector>

#include <weft/weft.hpp>

#include "bench_args.hpp"

namespace {

using Space = Kokkos::DefaultExecutionSpace;

struct Args {
  std::size_t steps = 0, warmup = 1, microbatches = 0, micro = 0;  // steps 0: 5 (bubble), 3 (throughput)
  std::size_t layers = 8, d_model = 0, heads = 0, seq = 0, vocab = 0;
  std::string trace_dir = ".";
};

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

double now() { return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count(); }

weft::nn::GPTConfig config(const Args& a, std::size_t d, std::size_t h, std::size_t t, std::size_t v, std::size_t micro) {
  weft::nn::GPTConfig c;
  c.layers = a.layers;
  c.d_model = a.d_model ? a.d_model : d;
  c.heads = a.heads ? a.heads : h;
  c.seq = a.seq ? a.seq : t;
  c.vocab = a.vocab ? a.vocab : v;
  c.batch = a.micro ? a.micro : micro;
  return c;
}

// ---------------------------------------------------------------- bubble
int bubble_part(weft::Comm& world, Args a) {
  if (a.steps == 0) a.steps = 5;
  const int p = world.size();
  const bool root = world.rank() == 0;
  const int m = int(a.microbatches ? a.microbatches : 8);
  // Small vocabulary: embedding and head cost little, so equal block counts are equal stages.
  const auto cfg = config(a, 256, 4, 128, 256, 4);
  weft::data::TokenStream data(weft::data::synthetic_corpus(1 << 18, 0), cfg.seq, 1);
  if (root)
    std::printf("bubble: pp=%d, %d microbatches of %zu x %zu tokens, L=%zu D=%zu H=%zu V=%zu, equal stages; %zu steps after %zu warm-up\n",
                p, m, cfg.batch, cfg.seq, cfg.layers, cfg.d_model, cfg.heads, cfg.vocab, a.steps, a.warmup);
  if (root)
    std::printf("\n%-14s %9s %9s   %s\n", "schedule", "analytic", "measured", "idle fraction per stage (rank 0..p-1)");
  for (std::string name : {"gpipe", "1f1b", "interleaved:2", "zb"}) {
    weft::pipeline::visit_schedule(name, [&]<class S>(std::type_identity<S>) {
    const auto part = weft::pipeline::equal_partition(cfg.layers, std::size_t(p * S::chunks));
    weft::pipeline::Stage<float> stage(cfg, part, p, world.rank(), S::chunks);
    weft::pipeline::Executor ex(stage, world, weft::Pipeline<S>(p, m));
    const std::size_t tok = cfg.tokens();
    for (std::size_t i = 0; i < std::size_t(m); ++i)
      data.fill(0, std::size_t(m) * cfg.batch, i * cfg.batch, cfg.batch, stage.ids(i), stage.targets(i));
    std::vector<double> idle_sum(std::size_t(p), 0.0);
    double fwd = 0, bin = 0, bw = 0, nf = 0, nb = 0, nw = 0;
    Kokkos::View<double*, Kokkos::HostSpace> mine("mine", 3), all("all", 3 * std::size_t(p));
    std::vector<weft::PipeEvent> last_events;
    double last_span = 0;
    for (std::size_t s = 0; s < a.warmup + a.steps; ++s) {
      stage.zero_grad();
      world.barrier();
      ex.run(1.0 / double(std::size_t(m) * tok));
      double busy = 0;
      for (const auto& e : ex.timeline()) {
        if (!weft::is_compute(e.op)) continue;
        busy += e.end - e.start;
        if (s < a.warmup) continue;
        const double d = e.end - e.start;
        if (e.op == weft::PipeOp::forward) {
          fwd += d;
          nf += 1;
        } else if (e.op == weft::PipeOp::backward_input) {
          bin += d;
          nb += 1;
        } else if (e.op == weft::PipeOp::backward_weight) {
          bw += d;
          nw += 1;
        }
      }
      const auto span = ex.last_run_span();
      mine(0) = busy;
      mine(1) = span.first;
      mine(2) = span.second;
      world.all_gather(mine, all);
      double t0 = all(1), t1 = all(2);
      for (int r = 0; r < p; ++r) {
        t0 = std::min(t0, all(3 * std::size_t(r) + 1));
        t1 = std::max(t1, all(3 * std::size_t(r) + 2));
      }
      if (s < a.warmup) continue;
      for (int r = 0; r < p; ++r) idle_sum[std::size_t(r)] += 1.0 - all(3 * std::size_t(r)) / (t1 - t0);
      if (s + 1 < a.warmup + a.steps) continue;
      // The last step's timeline, gathered on rank 0 for the trace.
      Kokkos::View<double*, Kokkos::HostSpace> ev("events", 5 * ex.timeline().size());
      std::size_t n = 0;
      for (const auto& e : ex.timeline())
        if (weft::is_compute(e.op)) {
          ev(5 * n) = double(int(e.op));
          ev(5 * n + 1) = e.microbatch;
          ev(5 * n + 2) = e.chunk;
          ev(5 * n + 3) = e.start - t0;
          ev(5 * n + 4) = e.end - t0;
          ++n;
        }
      Kokkos::View<double*, Kokkos::HostSpace> cnt("count", 1);
      cnt(0) = double(n);
      last_span = t1 - t0;
      if (root) {
        for (int r = 0; r < p; ++r) {
          Kokkos::View<double*, Kokkos::HostSpace> buf = ev;
          std::size_t k = n;
          if (r > 0) {
            world.recv(cnt, r, 7);
            k = std::size_t(cnt(0));
            buf = Kokkos::View<double*, Kokkos::HostSpace>("events", std::max<std::size_t>(5 * k, 1));
            if (k) world.recv(Kokkos::subview(buf, std::make_pair(std::size_t(0), 5 * k)), r, 8);
          }
          for (std::size_t i = 0; i < k; ++i)
            last_events.push_back({r, weft::PipeOp(int(buf(5 * i))), int(buf(5 * i + 1)), int(buf(5 * i + 2)),
                                   buf(5 * i + 3), buf(5 * i + 4)});
        }
      } else {
        world.send(cnt, 0, 7);
        if (n) world.send(Kokkos::subview(ev, std::make_pair(std::size_t(0), 5 * n)), 0, 8);
      }
    }
    // Mean F, B, W over every rank (zb's analytic bubble depends on them).
    Kokkos::View<double*, Kokkos::HostSpace> sums("sums", 6);
    sums(0) = fwd, sums(1) = nf, sums(2) = bin, sums(3) = nb, sums(4) = bw, sums(5) = nw;
    world.all_reduce(sums);
    weft::PipeCosts costs;
    costs.forward = sums(0) / std::max(sums(1), 1.0);
    costs.backward_input = sums(3) > 0 ? sums(2) / sums(3) : 1.0;
    costs.backward_weight = sums(5) > 0 ? sums(4) / sums(5) : 1.0;
    const double analytic = S::bubble_fraction(p, m, costs);
    if (!root) return;
    double mean = 0;
    for (double x : idle_sum) mean += x / double(a.steps) / double(p);
    std::printf("%-14s %8.1f%% %8.1f%%  ", name.c_str(), 100 * analytic, 100 * mean);
    for (double x : idle_sum) std::printf(" %5.1f%%", 100 * x / double(a.steps));
    std::printf("   (stage - analytic, worst: %+.1f pp)", [&] {
      double worst = 0;
      for (double x : idle_sum) {
        const double d = 100 * (x / double(a.steps) - analytic);
        if (std::abs(d) > std::abs(worst)) worst = d;
      }
      return worst;
    }());
    if (name == "zb")
      std::printf("\n%14s measured F %.1f ms, B %.1f ms, W %.1f ms (formula valid for W <= min(F, B))", "",
                  costs.forward * 1e3, costs.backward_input * 1e3, costs.backward_weight * 1e3);
    std::printf("\n");
    weft::PipeSimulation sim;
    sim.stages = p;
    sim.microbatches = m;
    sim.chunks = S::chunks;
    sim.makespan = last_span;
    sim.busy.assign(std::size_t(p), 0.0);
    sim.events = last_events;
    for (const auto& e : last_events) sim.busy[std::size_t(e.rank)] += e.end - e.start;
    std::string file = name;
    std::replace(file.begin(), file.end(), ':', '_');
    file = a.trace_dir + "/pipeline_" + file + ".json";
    weft::write_pipeline_chrome_trace(sim, file, 1e6);
    // The text timeline, about 120 columns wide.
    weft::PipeSimulation scaled = sim;
    const double unit = sim.makespan / 120.0;
    scaled.makespan = 120.0;
    for (auto& e : scaled.events) e.start /= unit, e.end /= unit;
    for (auto& b : scaled.busy) b /= unit;
    std::printf("%s  (trace: %s; one column = %.1f ms)\n", weft::pipeline_timeline_text(scaled, 1).c_str(), file.c_str(),
                unit * 1e3);
    });
  }
  return 0;
}

// ------------------------------------------------------------ throughput
int throughput_part(weft::Comm& world, Args a) {
  if (a.steps == 0) a.steps = 3;
  const bool root = world.rank() == 0;
  const int m = int(a.microbatches ? a.microbatches : 4);
  const auto cfg = config(a, 512, 8, 256, 8192, 2);
  const std::size_t global = std::size_t(m) * cfg.batch, tokens = global * cfg.seq;
  weft::data::TokenStream data(weft::data::synthetic_corpus(1 << 20, 0), cfg.seq, 1);
  if (root)
    std::printf("throughput: config L=%zu D=%zu H=%zu T=%zu V=%zu; global batch %zu = %d microbatches of %zu; %zu steps after %zu warm-up; one BLAS thread per rank\n",
                cfg.layers, cfg.d_model, cfg.heads, cfg.seq, cfg.vocab, global, m, cfg.batch, a.steps, a.warmup);
  // pp=1: rank 0 alone, gradient accumulation over the same microbatches.
  double pp1 = 0;
  if (root) {
    weft::nn::GPT<float, weft::SingleProcess, Space> gpt(cfg);
    weft::optim::AdamW<float, Space> opt(gpt.parameters());
    weft::ops::Tokens<Space> ids("ids", cfg.tokens()), tg("tg", cfg.tokens());
    std::vector<double> t;
    for (std::size_t s = 0; s < a.warmup + a.steps; ++s) {
      const double t0 = now();
      weft::optim::train_step(gpt, opt, data, s, std::size_t(m), ids, tg, 1e-4, 1.0);
      Kokkos::fence();
      if (s >= a.warmup) t.push_back(now() - t0);
    }
    pp1 = double(tokens) / median(t);
  }
  world.barrier();
  // pp=2, 1f1b, auto stages would need a measurement: equal blocks here.
  const auto part = weft::pipeline::equal_partition(cfg.layers, 2);
  weft::pipeline::Stage<float> stage(cfg, part, 2, world.rank(), 1);
  weft::pipeline::Executor ex(stage, world, weft::Pipeline<weft::OneFOneB>(2, m));
  weft::optim::AdamW<float, Space> opt(stage.parameters());
  std::vector<double> t;
  double waited = 0, total = 0;
  for (std::size_t s = 0; s < a.warmup + a.steps; ++s) {
    world.barrier();
    const double t0 = now();
    weft::pipeline::train_step(ex, static_cast<weft::parallel::DataParallel<float, weft::Replicated, Space>*>(nullptr), opt, data, s, global,
                               1e-4, 1.0);
    Kokkos::fence();
    const double dt = now() - t0;
    if (s < a.warmup) continue;
    t.push_back(dt);
    total += dt;
    for (const auto& e : ex.timeline())
      if (!weft::is_compute(e.op)) waited += e.end - e.start;
  }
  const double pp2 = double(tokens) / median(t);
  if (!root) return 0;
  std::printf("  pp=1 (rank 0 alone)   %10.0f tok/s\n", pp1);
  std::printf("  pp=2 (1f1b, stages %s) %10.0f tok/s   ratio %.3f (ideal on 2 cores with bubble %.3f: %.3f); rank 0 blocked in receives %.1f%% of its step\n",
              part.to_string(cfg.layers).c_str(), pp2, pp2 / pp1, weft::OneFOneB::bubble_fraction(2, m, {}), 2 * (1 - weft::OneFOneB::bubble_fraction(2, m, {})),
              100 * waited / total);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  weft::Environment env(argc, argv);
  auto& world = env.world();
  Args a;
  weft::bench::Flags flags("bench_pipeline");
  flags.add("--trace-dir", a.trace_dir, "folder for the Chrome traces (4 ranks)")
      .add("--steps", a.steps, "measured steps (0: 5 on 4 ranks, 3 on 2)")
      .add("--warmup", a.warmup, "steps before measuring")
      .add("--microbatches", a.microbatches, "microbatches per step (0: 8 on 4 ranks, 4 on 2)")
      .add("--micro", a.micro, "sequences per microbatch (0: 4 on 4 ranks, 2 on 2)")
      .add("--layers", a.layers, "transformer blocks", 1)
      .add("--d-model", a.d_model, "model width (0: 256 on 4 ranks, 512 on 2)")
      .add("--heads", a.heads, "attention heads (0: 4 on 4 ranks, 8 on 2)")
      .add("--seq", a.seq, "tokens per sequence (0: 128 on 4 ranks, 256 on 2)")
      .add("--vocab", a.vocab, "vocabulary size (0: 256 on 4 ranks, 8192 on 2)");
  if (const int rc = flags.parse(argc, argv, world.rank() == 0)) return rc == 1 ? 0 : rc;
  const auto bt = weft::ops::set_blas_threads(1, world.size());
  if (world.rank() == 0) std::printf("bench_pipeline: %d ranks, BLAS threads %d\n", world.size(), bt.threads);
  if (world.size() == 4) return bubble_part(world, a);
  if (world.size() == 2) return throughput_part(world, a);
  if (world.rank() == 0) std::fprintf(stderr, "bench_pipeline: run it on 4 ranks (bubble) or 2 (throughput), not %d\n", world.size());
  return 2;
}
