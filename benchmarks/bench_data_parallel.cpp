// Data-parallel scaling on one node, all phases in one run on 2 ranks (one
// BLAS thread each), config M by default (L=8, D=512, H=8, T=256, per-rank
// micro-batch 4, V=8192):
//   dp1-alone       rank 0 trains alone (rank 1 idle): one process, one core
//   dp1-concurrent  both ranks train independent dp=1 models at the same time
//   replicate       dp=2, bucketed all-reduce overlapped with backward
//   replicate-no-overlap, zero1, zero2, fsdp
// Weak scaling (same per-rank micro-batch): efficiency = tok/s(dp=2) /
// (2 x tok/s(dp=1)), printed against both dp=1 divisors. Exposed
// communication = time ranks were blocked in DP collectives / step time.
//
//   mpirun -n 2 bench_data_parallel [--profile] [--bucket-mb 25] [--steps 4] [--warmup 1] [--layers 8 --d-model 512 --seq 256 --micro 4 --vocab 8192]
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <string>
#include <vector>

#include <weft/weft.hpp>

#include "bench_args.hpp"

namespace {

using Space = Kokkos::DefaultExecutionSpace;
using weft::parallel::DPMode;

struct Args {
  bool profile = false;  // print where each phase's time goes
  double bucket_mb = weft::parallel::DPOptions{}.bucket_mb;
  std::size_t steps = 4, warmup = 1;
  weft::bench::ModelFlags model;  // batch: sequences per rank per step (--micro)
};

struct Result {
  double tokens_per_second = 0;  // global tokens per second of the phase
  double step_seconds = 0;       // median step time
  double exposed_fraction = 0;   // exposed DP communication / step time (rank 0)
};

int world_rank() {
  int r = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &r);
  return r;
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// Trains `steps` steps after `warmup` on the given communicator with DP policy Policy.
template <class Policy>
Result run(weft::Comm& comm, bool overlap, const Args& a, const weft::data::TokenStream& data) {
  constexpr DPMode mode = Policy::mode;
  const weft::nn::GPTConfig c = a.model.config();
  weft::nn::GPT<float, weft::SingleProcess, Space> gpt(c);
  weft::parallel::DPOptions o;
  o.overlap = overlap;
  o.bucket_mb = a.bucket_mb;
  weft::parallel::DataParallel<float, Policy, Space> dp(comm, gpt.parameter_groups(), o);
  gpt.set_hooks(&dp);
  weft::optim::AdamW<float, Space> opt(dp.optimizer_parameters());
  weft::ops::Tokens<Space> ids("ids", c.tokens()), tg("tg", c.tokens());
  weft::metrics::Profiler prof;
  if (a.profile) gpt.set_profiler(&prof);
  const std::size_t global = a.model.batch * std::size_t(comm.size());
  std::vector<double> times;
  double exposed = 0, total = 0;
  for (std::size_t s = 0; s < a.warmup + a.steps; ++s) {
    if (s == a.warmup) {
      comm.reset_stats();
      prof.reset();
    }
    comm.barrier();
    const auto t0 = std::chrono::steady_clock::now();
    weft::parallel::train_step(gpt, dp, opt, data, s, global, 1, ids, tg, 1e-4, 1.0, a.profile ? &prof : nullptr);
    Kokkos::fence();
    const double t = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (s >= a.warmup) {
      times.push_back(t);
      total += t;
    }
  }
  // All DP traffic counts (the loss all-reduce of train_step is a scalar),
  // except the barrier that lines the ranks up before each timed step.
  exposed = comm.stats().total().exposed_seconds - comm.stats()[weft::CommKind::barrier].exposed_seconds;
  if (a.profile && world_rank() == 0) {
    std::printf("  profile of %s (dp=%d), seconds per step:", weft::parallel::to_string(mode), comm.size());
    for (const auto& [name, e] : prof.entries()) std::printf(" %s %.3f", name.c_str(), e.seconds / double(a.steps));
    std::printf("\n");
  }
  Result r;
  r.step_seconds = median(times);
  r.tokens_per_second = double(global * c.seq) / r.step_seconds;
  r.exposed_fraction = exposed / total;
  return r;
}

}  // namespace

int main(int argc, char** argv) {
  weft::Environment env(argc, argv);
  auto& world = env.world();
  Args a;
  weft::bench::Flags flags("bench_data_parallel");
  flags.add("--steps", a.steps, "measured steps", 1).add("--warmup", a.warmup, "steps before measuring");
  a.model.add_to(flags, "--micro", "sequences per rank per step");
  flags.add("--bucket-mb", a.bucket_mb, "replicate's gradient bucket size in MiB")
      .add_switch("--profile", a.profile, "print where each phase's time goes");
  if (const int rc = flags.parse(argc, argv, world.rank() == 0)) return rc == 1 ? 0 : rc;
  if (world.size() != 2) {
    if (world.rank() == 0) std::fprintf(stderr, "bench_data_parallel: run it on 2 ranks (mpirun -n 2), not %d\n", world.size());
    return 2;
  }
  const auto bt = weft::ops::set_blas_threads(1, 2);
  const bool root = world.rank() == 0;
  weft::data::TokenStream data(weft::data::synthetic_corpus(1 << 20, 0), a.model.seq, 1);
  if (root)
    std::printf("bench_data_parallel: L=%zu D=%zu H=%zu T=%zu micro-batch %zu per rank V=%zu; %zu steps after %zu warm-up; BLAS threads %d; buckets %.3g MiB\n",
                a.model.layers, a.model.d_model, a.model.heads, a.model.seq, a.model.batch, a.model.vocab, a.steps, a.warmup, bt.threads, a.bucket_mb);

  weft::Comm self = world.split(world.rank(), 0, "self");
  Result alone;
  if (root) alone = run<weft::Replicated>(self, true, a, data);
  world.barrier();
  const Result concurrent = run<weft::Replicated>(self, true, a, data);

  struct Phase {
    const char* name;
    Result (*run)(weft::Comm&, bool, const Args&, const weft::data::TokenStream&);  // run<Policy>
    bool overlap;
    Result r;
  };
  std::vector<Phase> phases = {{"replicate", &run<weft::Replicated>, true, {}},
                               {"replicate-no-overlap", &run<weft::Replicated>, false, {}},
                               {"zero1", &run<weft::ZeRO<1>>, true, {}},
                               {"zero2", &run<weft::ZeRO<2>>, true, {}},
                               {"fsdp", &run<weft::FullyShard>, true, {}}};
  for (auto& p : phases) p.r = p.run(world, p.overlap, a, data);
  if (!root) return 0;
  std::printf("\n%-22s %12s %10s %14s %16s %10s\n", "phase", "tok/s", "step s", "eff vs alone", "eff vs concurrent", "exposed");
  std::printf("%-22s %12.0f %10.3f %14s %16s %10s\n", "dp1-alone", alone.tokens_per_second, alone.step_seconds, "-", "-", "-");
  std::printf("%-22s %12.0f %10.3f %14s %16s %10s   (per rank; both ranks training)\n", "dp1-concurrent",
              concurrent.tokens_per_second, concurrent.step_seconds, "-", "-", "-");
  for (const auto& p : phases)
    std::printf("%-22s %12.0f %10.3f %14.3f %16.3f %9.1f%%\n", p.name, p.r.tokens_per_second, p.r.step_seconds,
                p.r.tokens_per_second / (2 * alone.tokens_per_second),
                p.r.tokens_per_second / (2 * concurrent.tokens_per_second), 100 * p.r.exposed_fraction);
  const double rep = phases[0].r.tokens_per_second;
  std::printf("\nweak-scaling efficiency of replicate at dp=2: %.3f (divisor: 2 x dp1-alone tok/s), %.3f (divisor: 2 x dp1-concurrent tok/s); target >= 0.95\n",
              rep / (2 * alone.tokens_per_second), rep / (2 * concurrent.tokens_per_second));
  std::printf("exposed DP communication of replicate: %.1f%% of the step with overlap, %.1f%% without; target <= 10%%\n",
              100 * phases[0].r.exposed_fraction, 100 * phases[1].r.exposed_fraction);
  std::printf("fsdp tokens/s relative to replicate: %.3f; target >= 0.85\n", phases[4].r.tokens_per_second / rep);
  return 0;
}
