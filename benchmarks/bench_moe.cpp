// Mixture of experts under expert parallelism, on P ranks of one node (one
// BLAS thread each): an N-expert top-k GPT (default 8 experts, top 2, every
// block a MoE block, experts of width --expert-hidden) with its experts split
// over ep = P (Experts<8>, EP folded over DP), against the dense GPT with the
// same active parameters (MLP width k x expert width) under data parallelism
// over the same P ranks, on the same global batch. In the same run:
//   dense      tok/s of the dense model (DataParallel<Replicated>, dp = P)
//   moe        tok/s of the MoE model (ExpertDataParallel<Replicated>, ep = P)
//   exposed    seconds rank 0 spent in the blocking expert all_to_allv calls
//              per step, over the step time
//   imbalance  max / mean slots per expert (the router's, before capacity)
//   d+c        seconds per step of the MoE blocks' dispatch and combine
//              (profiler scopes moe_dispatch + moe_combine, forward and
//              backward: the gathers, counts, permutations, all_to_allv and
//              the gate-weighted sums)
//              inside the training steps, so with the waits for the rank
//              whose experts got the most tokens
//   exchange   after training, each MoE block's dispatch and combine alone,
//              forward and backward, on its last routing, after a barrier
//              (MoE::replay_exchange: the path the blocks take, node-shared
//              or all_to_allv, with its counts, permutations and gate sums)
//   moe16      with --bf16: the MoE model under Precision<BF16> (bf16
//              products; its exchange carries 2-byte rows, docs/moe.md), the
//              same columns, and its exchange bytes, exchange time and tok/s
//              over the fp32 MoE model's
//   bare       the same exchanges as bare Comm::all_to_allv calls of the same
//              per-rank counts on preallocated buffers (4 per MoE block),
//              each block after a barrier, interleaved with the replays;
//              ratio = bare / exchange (target >= 0.9)
//
//   mpirun -n 2 bench_moe [--steps 3] [--warmup 1] [--batch 4] [--layers 4 --d-model 256 --heads 4 --seq 128 --vocab 4096]
//                         [--expert-hidden 512] [--top-k 2] [--capacity-factor 1.25] [--bf16]
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include <weft/parallel/expert_parallel.hpp>
#include <weft/weft.hpp>

#include "bench_args.hpp"

namespace {

using Space = Kokkos::DefaultExecutionSpace;
constexpr std::size_t kExperts = 8;
using MoEStrategy = weft::Strategy<weft::On<weft::DP, weft::Replicated>, weft::On<weft::EP, weft::Experts<kExperts>>>;
using MoEBF16Strategy = weft::Strategy<weft::On<weft::DP, weft::Replicated>, weft::On<weft::EP, weft::Experts<kExperts>>,
                                       weft::Precision<weft::BF16>>;
using DenseStrategy = weft::Strategy<weft::On<weft::DP, weft::Replicated>>;

struct Args {
  std::size_t steps = 3, warmup = 1, expert_hidden = 512, top_k = 2;
  double capacity = 1.25;
  bool bf16 = false;  // also the MoE model under Precision<BF16> (its exchange in 2 bytes)
  weft::bench::ModelFlags model;  // batch: the global batch in sequences
};

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

struct Result {
  double step_seconds = 0, tokens_per_second = 0;
  double a2a_seconds = 0, a2a_bytes = 0;  // per step, rank 0
  double dispatch_combine = 0;            // per step, rank 0
  double imbalance = 0, dropped = 0;      // over the measured steps
  double bare = 0;                        // per step, rank 0: the same exchanges as bare all_to_allv
  double replay = 0;                      // per step, rank 0: the blocks' exchanges alone (replay_exchange)
  bool node_exchange = false;             // the blocks took the node-shared exchange
};

template <class Step>
std::vector<double> timed_steps(weft::Comm& world, const Args& a, Step&& step) {
  std::vector<double> times;
  for (std::size_t s = 0; s < a.warmup + a.steps; ++s) {
    world.barrier();
    const auto t0 = std::chrono::steady_clock::now();
    step(s, s >= a.warmup);
    Kokkos::fence();
    if (s >= a.warmup) times.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  return times;
}

Result run_dense(weft::Environment& env, const Args& a, const weft::data::TokenStream& data) {
  auto& world = env.world();
  weft::nn::GPTConfig c = a.model.config();
  c.batch = a.model.batch / std::size_t(world.size());
  c.ffn_hidden = a.top_k * a.expert_hidden;  // the active MLP width of the MoE model
  weft::Mesh<weft::DP> mesh(world, world.size());
  weft::nn::GPT<float, DenseStrategy> gpt(mesh, c);
  weft::parallel::DataParallel<float, weft::Replicated> dp(mesh.axis<weft::DP>(), gpt.parameter_groups());
  gpt.set_hooks(&dp);
  weft::optim::AdamW<float, Space> opt(dp.optimizer_parameters());
  weft::ops::Tokens<Space> ids("ids", c.tokens()), tg("tg", c.tokens());
  const auto times = timed_steps(world, a, [&](std::size_t s, bool) {
    weft::parallel::train_step(gpt, dp, opt, data, s, a.model.batch, 1, ids, tg, 1e-4, 1.0);
  });
  Result r;
  r.step_seconds = median(times);
  r.tokens_per_second = double(a.model.batch * c.seq) / r.step_seconds;
  return r;
}

template <class S>
Result run_moe(weft::Environment& env, const Args& a, const weft::data::TokenStream& data) {
  auto& world = env.world();
  weft::nn::GPTConfig c = a.model.config();
  c.batch = a.model.batch / std::size_t(world.size());
  c.experts = kExperts;
  c.top_k = a.top_k;
  c.expert_hidden = a.expert_hidden;
  c.capacity_factor = a.capacity;
  c.aux_loss = 0.01;
  weft::Mesh<weft::DP, weft::EP> mesh(world, 1, world.size());
  weft::nn::GPT<float, S> gpt(mesh, c, weft::nn::expert_split_of<S>(mesh, c));
  weft::parallel::ExpertDataParallel<float, weft::Replicated> dp(mesh.axes<weft::DP, weft::EP>(), mesh.axis<weft::DP>(),
                                                                mesh.axis<weft::EP>(), gpt.parameter_groups());
  gpt.set_hooks(&dp);
  weft::optim::AdamW<float, Space> opt(dp.optimizer_parameters());
  weft::ops::Tokens<Space> ids("ids", c.tokens()), tg("tg", c.tokens());
  weft::metrics::Profiler prof;
  gpt.set_profiler(&prof);
  Result r;
  double selected_max = 0, selected_mean = 0;
  const auto times = timed_steps(world, a, [&](std::size_t s, bool measured) {
    gpt.reset_moe_statistics();
    if (measured && s == a.warmup) prof.reset();
    weft::parallel::train_step(gpt, dp, opt, data, s, a.model.batch, 1, ids, tg, 1e-4, 1.0);
    if (!measured) return;
    const auto st = gpt.moe_statistics();
    r.a2a_seconds += st.a2a_seconds;
    r.a2a_bytes += st.a2a_bytes;
    r.dropped += st.slots > 0 ? st.dropped / st.slots : 0;
    selected_max += st.max_tokens();
    selected_mean += st.mean_tokens();
  });
  const double n = double(a.steps);
  r.step_seconds = median(times);
  r.tokens_per_second = double(a.model.batch * c.seq) / r.step_seconds;
  r.a2a_seconds /= n;
  r.a2a_bytes /= n;
  r.dropped /= n;
  r.imbalance = selected_mean > 0 ? selected_max / selected_mean : 0;
  for (const auto& [name, e] : prof.entries())
    if (name == "moe_dispatch" || name == "moe_combine") r.dispatch_combine += e.seconds;
  r.dispatch_combine /= n;
  // The exchanges alone, each MoE block after a barrier (so that no rank
  // waits for another's experts): the blocks' own dispatch and combine,
  // forward and backward, replayed on their last routing
  // (MoE::replay_exchange), against bare all_to_allv calls of the same
  // per-rank counts on preallocated buffers (4 per block), in the same run.
  auto& ep = mesh.axis<weft::EP>();
  const std::size_t D = c.d_model, P = std::size_t(world.size());
  std::vector<std::vector<int>> sends, recvs;
  std::size_t most = 1;
  for (std::size_t l = 0; l < c.layers; ++l) {
    if (!gpt.moe_layer(l)) continue;
    const auto& s = gpt.moe_saved(l);
    std::vector<int> sc(P), rc(P);
    std::size_t st = 0, rt = 0;
    for (std::size_t d = 0; d < P; ++d) {
      sc[d] = int(std::size_t(s.send_rows[d]) * D);
      rc[d] = int(std::size_t(s.recv_rows[d]) * D);
      st += std::size_t(sc[d]);
      rt += std::size_t(rc[d]);
    }
    most = std::max({most, st, rt});
    sends.push_back(sc);
    recvs.push_back(rc);
  }
  Kokkos::View<float*, Space> x("bare.send", most), y("bare.recv", most);
  Kokkos::deep_copy(x, 1.0f);
  weft::ops::Matrix<float, Space> h("replay.h", c.tokens(), D), out("replay.out", c.tokens(), D),
      dout("replay.dout", c.tokens(), D), dh("replay.dh", c.tokens(), D);
  Kokkos::deep_copy(h, 1.0f);
  Kokkos::deep_copy(dout, 1e-3f);
  typename weft::nn::MoE<float, Space>::Workspace w(c);
  std::vector<double> bare, replay;
  for (std::size_t rep = 0; rep < a.warmup + a.steps; ++rep) {
    double tb = 0, tr = 0;
    for (std::size_t i = 0, l = 0; l < c.layers; ++l) {
      auto* moe = gpt.moe_layer(l);
      if (!moe) continue;
      world.barrier();
      auto t0 = std::chrono::steady_clock::now();
      moe->replay_exchange(h, gpt.moe_saved(l), out, dout, dh, w);
      Kokkos::fence();
      tr += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      world.barrier();
      t0 = std::chrono::steady_clock::now();
      for (int pass = 0; pass < 2; ++pass) {  // forward and backward
        ep.all_to_allv(x, std::span<const int>(sends[i]), y, std::span<const int>(recvs[i]));
        ep.all_to_allv(y, std::span<const int>(recvs[i]), x, std::span<const int>(sends[i]));
      }
      tb += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      ++i;
    }
    if (rep >= a.warmup) {
      bare.push_back(tb);
      replay.push_back(tr);
    }
  }
  r.replay = median(replay);
  r.node_exchange = gpt.moe_layer(0) ? gpt.moe_layer(0)->node_exchange() : false;
  r.bare = median(bare);
  return r;
}

}  // namespace

int main(int argc, char** argv) {
  weft::Environment env(argc, argv);
  auto& world = env.world();
  Args a;
  a.model.layers = 4;
  a.model.d_model = 256;
  a.model.heads = 4;
  a.model.seq = 128;
  a.model.vocab = 4096;
  a.model.batch = 4;
  weft::bench::Flags flags("bench_moe");
  flags.add("--steps", a.steps, "measured steps", 1)
      .add("--warmup", a.warmup, "steps before measuring")
      .add("--expert-hidden", a.expert_hidden, "each expert's hidden width (the dense model's MLP: top-k x this)", 1)
      .add("--top-k", a.top_k, "experts per token", 1)
      .add("--capacity-factor", a.capacity, "capacity factor (0: dropless)")
      .add_switch("--bf16", a.bf16, "also run the MoE model under Precision<BF16>, its exchange in 2 bytes");
  a.model.add_to(flags, "--batch", "global batch in sequences (a multiple of the ranks)");
  if (const int rc = flags.parse(argc, argv, world.rank() == 0)) return rc == 1 ? 0 : rc;
  const std::size_t P = std::size_t(world.size());
  if (kExperts % P != 0 || a.model.batch % P != 0 || a.top_k > kExperts) {
    if (world.rank() == 0)
      std::fprintf(stderr, "bench_moe: %zu experts and --batch %zu over %zu ranks: the ranks must divide both (2, 4 or 8 "
                           "ranks), and --top-k %zu must be at most %zu\n",
                   kExperts, a.model.batch, P, a.top_k, kExperts);
    return 2;
  }
  const auto bt = weft::ops::set_blas_threads(1, int(P));
  const bool root = world.rank() == 0;
  weft::data::TokenStream data(weft::data::synthetic_corpus(1 << 20, 0), a.model.seq, 1);
  if (root)
    std::printf("bench_moe: L=%zu D=%zu H=%zu T=%zu V=%zu, %zu experts top-%zu of width %zu (dense: MLP %zu), capacity "
                "%g; global batch %zu sequences on %zu ranks (ep = %zu); %zu steps after %zu warm-up; BLAS threads %d per rank\n",
                a.model.layers, a.model.d_model, a.model.heads, a.model.seq, a.model.vocab, kExperts, a.top_k,
                a.expert_hidden, a.top_k * a.expert_hidden, a.capacity, a.model.batch, P, P, a.steps, a.warmup, bt.threads);
  const Result dense = run_dense(env, a, data);
  const Result moe = run_moe<MoEStrategy>(env, a, data);
  const Result bf16 = a.bf16 ? run_moe<MoEBF16Strategy>(env, a, data) : Result{};
  if (!root) return 0;
  std::printf("\n%-6s %10s %9s %12s %10s %11s %10s %10s %10s %8s\n", "model", "tok/s", "step s", "a2a exposed", "a2a MB",
              "imbalance", "d+c s", "exchange s", "bare s", "dropped");
  std::printf("%-6s %10.0f %9.4f %12s %10s %11s %10s %10s %10s %8s\n", "dense", dense.tokens_per_second, dense.step_seconds,
              "-", "-", "-", "-", "-", "-", "-");
  std::printf("%-6s %10.0f %9.4f %11.1f%% %10.2f %11.3f %10.4f %10.4f %10.4f %7.1f%%\n", "moe", moe.tokens_per_second,
              moe.step_seconds, 100 * moe.a2a_seconds / moe.step_seconds, moe.a2a_bytes / 1e6, moe.imbalance,
              moe.dispatch_combine, moe.replay, moe.bare, 100 * moe.dropped);
  if (a.bf16)
    std::printf("%-6s %10.0f %9.4f %11.1f%% %10.2f %11.3f %10.4f %10.4f %10s %7.1f%%\n", "moe16", bf16.tokens_per_second,
                bf16.step_seconds, 100 * bf16.a2a_seconds / bf16.step_seconds, bf16.a2a_bytes / 1e6, bf16.imbalance,
                bf16.dispatch_combine, bf16.replay, "-", 100 * bf16.dropped);
  std::printf("\nMoE tok/s / dense tok/s (same active parameters): %.3f\n", moe.tokens_per_second / dense.tokens_per_second);
  if (a.bf16)
    std::printf("bf16 (Precision<BF16>) against fp32 MoE: exchange bytes %.3f, exchange time %.3f, tok/s %.3f\n",
                bf16.a2a_bytes / moe.a2a_bytes, bf16.replay / moe.replay, bf16.tokens_per_second / moe.tokens_per_second);
  std::printf("exposed all-to-all: %.1f%% of the MoE step; imbalance max/mean %.3f\n",
              100 * moe.a2a_seconds / moe.step_seconds, moe.imbalance);
  std::printf("exchange path: %s\n", moe.node_exchange ? "node-shared rows" : "all_to_allv");
  std::printf("bare all_to_allv / (dispatch + combine) of the same bytes, each block after a barrier: %.3f (target >= 0.9)\n",
              moe.replay > 0 ? moe.bare / moe.replay : 0.0);
  std::printf("  in the training steps: dispatch + combine %.4f s per step, of which %.4f s in the exchanges (with the "
              "wait for the slowest peer's experts)\n",
              moe.dispatch_combine, moe.a2a_seconds);
  return 0;
}
