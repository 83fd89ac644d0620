// Tensor-parallel strong scaling on one node, 2 ranks (one BLAS thread each),
// config M by default (L=8, D=512, H=8, T=256, V=8192) on one global batch of
// B sequences per step (default 4):
//   tp1-alone  rank 0 trains the whole batch alone (rank 1 idle): the divisor
//   tp2        both ranks train the same batch, every layer split over TP
//   tp2-sp     the same with sequence parallelism
// Speed-up = tok/s(tp=2) / tok/s(tp1-alone) (ideal 2). Exposed TP collective
// time = seconds rank 0 was blocked in TP collectives / step time (weft's TP
// collectives are blocking: all of their time is exposed). Parameter memory
// per rank = bytes of the parameters rank 0 holds, against tp=1's.
//
//   mpirun -n 2 bench_tensor_parallel [--steps 4] [--warmup 1] [--batch 4] [--layers 8 --d-model 512 --heads 8 --seq 256 --vocab 8192]
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include <weft/weft.hpp>

#include "bench_args.hpp"

namespace {

using Space = Kokkos::DefaultExecutionSpace;

struct Args {
  std::size_t steps = 4, warmup = 1;
  weft::bench::ModelFlags model;  // batch: the global batch in sequences (--batch)
};

struct Result {
  double tokens_per_second = 0;  // tokens of the global batch per second
  double step_seconds = 0;       // median step time
  double exposed_seconds = 0;    // per step, rank 0 blocked in TP collectives
  std::size_t parameter_bytes = 0;
  double bytes_per_step = 0;     // TP collective bytes per step (rank 0)
};

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// The strategies measured: tensor parallelism with and without sequence parallelism.
using TPOnly = weft::Strategy<weft::On<weft::TP, weft::TensorParallel<>>>;
using SeqPar = weft::Strategy<weft::On<weft::TP, weft::TensorParallel<weft::SequenceParallel>>>;

// Trains `steps` steps after `warmup` of the model strategy S selects, split
// over tp (S = weft::SingleProcess, tp == nullptr: the single-process model).
template <class S>
Result run(weft::Comm& sync, weft::Comm* tp, const Args& a, const weft::data::TokenStream& data) {
  const weft::nn::GPTConfig c = a.model.config();
  using Model = weft::nn::GPT<float, S, Space>;
  const auto model = [&] {
    if constexpr (Model::tensor_parallel_v) return std::make_unique<Model>(c, *tp);
    else return std::make_unique<Model>(c);
  }();
  Model& gpt = *model;
  weft::optim::AdamW<float, Space> opt(gpt.parameters());
  weft::ops::Tokens<Space> ids("ids", c.tokens()), tg("tg", c.tokens());
  Result r;
  for (auto* p : gpt.parameters()) r.parameter_bytes += p->size() * sizeof(float);
  std::vector<double> times;
  for (std::size_t s = 0; s < a.warmup + a.steps; ++s) {
    if (s == a.warmup && tp) tp->reset_stats();
    sync.barrier();
    const auto t0 = std::chrono::steady_clock::now();
    weft::optim::train_step(gpt, opt, data, s, 1, ids, tg, 1e-4, 1.0);
    Kokkos::fence();
    if (s >= a.warmup) times.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  r.step_seconds = median(times);
  r.tokens_per_second = double(c.tokens()) / r.step_seconds;
  if (tp) {
    const auto total = tp->stats().total();
    r.exposed_seconds = total.exposed_seconds / double(a.steps);
    r.bytes_per_step = double(total.bytes) / double(a.steps);
  }
  return r;
}

}  // namespace

int main(int argc, char** argv) {
  weft::Environment env(argc, argv);
  auto& world = env.world();
  Args a;
  weft::bench::Flags flags("bench_tensor_parallel");
  flags.add("--steps", a.steps, "measured steps", 1).add("--warmup", a.warmup, "steps before measuring");
  a.model.add_to(flags, "--batch", "global batch in sequences");
  if (const int rc = flags.parse(argc, argv, world.rank() == 0)) return rc == 1 ? 0 : rc;
  if (world.size() != 2) {
    if (world.rank() == 0)
      std::fprintf(stderr, "bench_tensor_parallel: run it on 2 ranks (mpirun -n 2), not %d\n", world.size());
    return 2;
  }
  const auto bt = weft::ops::set_blas_threads(1, 2);
  const bool root = world.rank() == 0;
  weft::data::TokenStream data(weft::data::synthetic_corpus(1 << 20, 0), a.model.seq, 1);
  if (root)
    std::printf("bench_tensor_parallel: L=%zu D=%zu H=%zu T=%zu V=%zu, global batch %zu sequences (%zu tokens) per "
                "step; %zu steps after %zu warm-up; BLAS threads %d per rank\n",
                a.model.layers, a.model.d_model, a.model.heads, a.model.seq, a.model.vocab, a.model.batch, a.model.batch * a.model.seq, a.steps, a.warmup, bt.threads);
  weft::Comm self = world.split(world.rank(), 0, "self");
  Result alone;
  if (root) alone = run<weft::SingleProcess>(self, nullptr, a, data);
  world.barrier();
  const Result tp2 = run<TPOnly>(world, &world, a, data);
  const Result sp2 = run<SeqPar>(world, &world, a, data);
  if (!root) return 0;
  std::printf("\n%-10s %10s %9s %10s %12s %12s %14s %12s\n", "phase", "tok/s", "step s", "speed-up", "TP exposed",
              "exposed %", "TP MB/step", "param MiB");
  std::printf("%-10s %10.0f %9.3f %10s %12s %12s %14s %12.1f\n", "tp1-alone", alone.tokens_per_second,
              alone.step_seconds, "1", "-", "-", "-", double(alone.parameter_bytes) / 1048576.0);
  auto row = [&](const char* name, const Result& r) {
    std::printf("%-10s %10.0f %9.3f %10.3f %11.3fs %11.1f%% %14.1f %12.1f\n", name, r.tokens_per_second, r.step_seconds,
                r.tokens_per_second / alone.tokens_per_second, r.exposed_seconds,
                100 * r.exposed_seconds / r.step_seconds, r.bytes_per_step / 1e6, double(r.parameter_bytes) / 1048576.0);
  };
  row("tp2", tp2);
  row("tp2-sp", sp2);
  std::printf("\nstrong-scaling speed-up of tp=2: %.3f, with sequence parallelism %.3f (divisor: tp1-alone tok/s on the "
              "same global batch; ideal 2)\n",
              tp2.tokens_per_second / alone.tokens_per_second, sp2.tokens_per_second / alone.tokens_per_second);
  std::printf("exposed TP collective time: %.1f%% of the tp=2 step, %.1f%% with sequence parallelism\n",
              100 * tp2.exposed_seconds / tp2.step_seconds, 100 * sp2.exposed_seconds / sp2.step_seconds);
  std::printf("per-rank parameter memory at tp=2: %.4f of tp=1's; target <= 0.55\n",
              double(tp2.parameter_bytes) / double(alone.parameter_bytes));
  return 0;
}
