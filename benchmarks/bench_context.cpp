// Context parallelism on 2 ranks: one causal attention layer (forward and
// backward, float) over a sequence of T tokens, sharded over CP in the
// balanced layout, for Context<Ring>, Context<AllGather> and Context<AllToAll>,
// against cp = 1 (rank 0 alone on the whole sequence, rank 1 idle) in the
// same run:
//   tok/s        T / wall time of forward + backward (median of --reps)
//   exposed      seconds the slower rank was blocked in CP communication per
//                layer, and that as a share of its attention (compute) time
//   act MiB      per-rank bytes of what the layer keeps for backward: its
//                Q, K, V, O and log-sum-exp, plus the variant's own copies
//   balance      the slowest rank's compute time over the fastest's, with the
//                balanced layout (measured in Ring) and with a contiguous
//                layout (rank r holds tokens [r T/2, (r+1) T/2): its queries
//                against all earlier keys, timed alone on each rank)
//
//   mpirun -n 2 bench_context [--seqs 4096,8192] [--heads 4] [--kv-heads 4] [--head-dim 32] [--reps 3]
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <sstream>
#include <string>
#include <vector>

#include <weft/core/parse.hpp>
#include <weft/weft.hpp>
#include <weft/parallel/context.hpp>

#include "bench_args.hpp"

namespace {

using T = float;
using V3 = Kokkos::View<T***, Kokkos::LayoutRight>;
using V2 = Kokkos::View<T**, Kokkos::LayoutRight>;
using Clock = std::chrono::steady_clock;

double now() { return std::chrono::duration<double>(Clock::now().time_since_epoch()).count(); }
double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

struct Args {
  std::string seqs = "4096,8192";
  std::size_t heads = 4, kv_heads = 4, head_dim = 32, reps = 3;
};

struct Result {
  double seconds = 0;          // median wall time of forward + backward (slowest rank)
  double exposed = 0;          // slowest rank's blocked time in CP communication, per layer
  double compute_max = 0;      // per-rank seconds outside communication: max and min over the ranks
  double compute_min = 0;
  std::size_t saved_bytes = 0;
};

double exposed_seconds(const weft::CommStats& s) {
  using K = weft::CommKind;
  double e = 0;
  for (K k : {K::send, K::recv, K::sendrecv, K::all_gather, K::reduce_scatter, K::all_to_all}) e += s[k].exposed_seconds;
  return e;
}

V3 filled(const char* name, std::size_t h, std::size_t t, std::size_t d, std::uint64_t seed) {
  V3 v(std::string(name), h, t, d);
  auto m = Kokkos::create_mirror_view(v);
  std::uint64_t x = seed * 0x9E3779B97F4A7C15ull + 1;
  for (std::size_t i = 0; i < m.size(); ++i) {  // xorshift values in [-1, 1)
    x ^= x << 13, x ^= x >> 7, x ^= x << 17;
    m.data()[i] = T(double(x % 20000) / 10000.0 - 1.0);
  }
  Kokkos::deep_copy(v, m);
  return v;
}

template <class Variant>
Result run_variant(weft::Comm& cp, const Args& a, std::size_t seq) {
  const std::size_t P = std::size_t(cp.size()), tl = seq / P;
  const T scale = T(1) / std::sqrt(T(a.head_dim));
  V3 Q = filled("q", a.heads, tl, a.head_dim, 1 + cp.rank()), K = filled("k", a.kv_heads, tl, a.head_dim, 11 + cp.rank()),
     Vv = filled("v", a.kv_heads, tl, a.head_dim, 21 + cp.rank()), dO = filled("do", a.heads, tl, a.head_dim, 31 + cp.rank());
  V3 O("o", a.heads, tl, a.head_dim), dQ("dq", a.heads, tl, a.head_dim), dK("dk", a.kv_heads, tl, a.head_dim),
      dV("dv", a.kv_heads, tl, a.head_dim);
  V2 lse("lse", a.heads, tl);
  weft::context::ContextAttention<Variant, T> attn(cp, a.heads, a.kv_heads, seq, a.head_dim, true);
  std::vector<double> wall, exposed, compute;
  for (std::size_t r = 0; r < a.reps + 1; ++r) {  // the first round warms up
    cp.barrier();
    cp.reset_stats();
    const double t0 = now();
    attn.forward(Q, K, Vv, scale, O, lse);
    attn.backward(dO, dQ, dK, dV);
    Kokkos::fence();
    const double t = now() - t0, e = exposed_seconds(cp.stats());
    if (r > 0) {
      wall.push_back(t);
      exposed.push_back(e);
      compute.push_back(t - e);
    }
  }
  Result res;
  res.saved_bytes = attn.saved_bytes();
  double w = median(wall), e = median(exposed), c = median(compute), cmin = c;
  Kokkos::View<double*, Kokkos::HostSpace> x("x", 3), y("y", 1), xm("xm", 3), ym("ym", 1);
  x(0) = w, x(1) = e, x(2) = c, y(0) = -cmin;
  cp.all_reduce(x, xm, weft::ReduceOp::max);
  cp.all_reduce(y, ym, weft::ReduceOp::max);
  res.seconds = xm(0), res.exposed = xm(1), res.compute_max = xm(2), res.compute_min = -ym(0);
  return res;
}

// Rank 0 alone: the unsharded kernel on the whole sequence.
Result run_alone(const Args& a, std::size_t seq) {
  const T scale = T(1) / std::sqrt(T(a.head_dim));
  V3 Q = filled("q", a.heads, seq, a.head_dim, 1), K = filled("k", a.kv_heads, seq, a.head_dim, 11),
     Vv = filled("v", a.kv_heads, seq, a.head_dim, 21), dO = filled("do", a.heads, seq, a.head_dim, 31);
  V3 O("o", a.heads, seq, a.head_dim), dQ("dq", a.heads, seq, a.head_dim), dK("dk", a.kv_heads, seq, a.head_dim),
      dV("dv", a.kv_heads, seq, a.head_dim);
  V2 lse("lse", a.heads, seq);
  std::vector<double> wall;
  for (std::size_t r = 0; r < a.reps + 1; ++r) {
    const double t0 = now();
    weft::ops::flash_attention_forward(Q, K, Vv, scale, true, O, lse);
    Kokkos::deep_copy(dQ, T(0));
    Kokkos::deep_copy(dK, T(0));
    Kokkos::deep_copy(dV, T(0));
    weft::ops::flash_attention_backward(Q, K, Vv, O, dO, lse, scale, true, dQ, dK, dV);
    Kokkos::fence();
    if (r > 0) wall.push_back(now() - t0);
  }
  Result res;
  res.seconds = res.compute_max = res.compute_min = median(wall);
  res.saved_bytes = (Q.size() + K.size() + Vv.size() + O.size() + lse.size()) * sizeof(T);
  return res;
}

// The contiguous layout's work on this rank: queries [r T/P, (r+1) T/P)
// against keys [0, (r+1) T/P), causal, timed alone (no communication).
double contiguous_work(weft::Comm& cp, const Args& a, std::size_t seq, double& fastest) {
  const std::size_t P = std::size_t(cp.size()), r = std::size_t(cp.rank()), tl = seq / P, keys = (r + 1) * tl;
  const T scale = T(1) / std::sqrt(T(a.head_dim));
  V3 Q = filled("q", a.heads, tl, a.head_dim, 1), K = filled("k", a.kv_heads, keys, a.head_dim, 11),
     Vv = filled("v", a.kv_heads, keys, a.head_dim, 21), dO = filled("do", a.heads, tl, a.head_dim, 31);
  V3 O("o", a.heads, tl, a.head_dim), dQ("dq", a.heads, tl, a.head_dim), dK("dk", a.kv_heads, keys, a.head_dim),
      dV("dv", a.kv_heads, keys, a.head_dim);
  V2 lse("lse", a.heads, tl);
  std::vector<double> wall;
  for (std::size_t rep = 0; rep < a.reps + 1; ++rep) {
    cp.barrier();
    const double t0 = now();
    weft::ops::flash_attention_forward(Q, K, Vv, scale, true, O, lse);
    weft::ops::flash_attention_backward(Q, K, Vv, O, dO, lse, scale, true, dQ, dK, dV);
    Kokkos::fence();
    if (rep > 0) wall.push_back(now() - t0);
  }
  Kokkos::View<double*, Kokkos::HostSpace> x("x", 2), m("m", 2);
  const double t = median(wall);
  x(0) = t, x(1) = -t;
  cp.all_reduce(x, m, weft::ReduceOp::max);
  fastest = -m(1);
  return m(0);
}

}  // namespace

int main(int argc, char** argv) {
  weft::Environment env(argc, argv);
  auto& world = env.world();
  Args a;
  weft::bench::Flags flags("bench_context");
  flags.add("--seqs", a.seqs, "comma-separated sequence lengths (multiples of 4)")
      .add("--heads", a.heads, "query heads", 1)
      .add("--kv-heads", a.kv_heads, "key/value heads (divide --heads)", 1)
      .add("--head-dim", a.head_dim, "head dimension (at most 256)", 1)
      .add("--reps", a.reps, "measured repetitions (median)", 1);
  if (const int rc = flags.parse(argc, argv, world.rank() == 0)) return rc == 1 ? 0 : rc;
  if (world.size() != 2) {
    if (world.rank() == 0) std::fprintf(stderr, "bench_context: run it on 2 ranks (mpirun -n 2), not %d\n", world.size());
    return 2;
  }
  weft::ops::set_blas_threads(1, 2);
  const bool root = world.rank() == 0;
  std::vector<std::size_t> seqs;
  {
    std::stringstream ss(a.seqs);
    std::string item;
    while (std::getline(ss, item, ',')) seqs.push_back(weft::parse_integer<std::size_t>("--seqs entry", item, 1));
  }
  if (root)
    std::printf("bench_context: 2 ranks, causal attention, H=%zu KV heads=%zu head_dim=%zu, float, forward + backward, "
                "median of %zu\n",
                a.heads, a.kv_heads, a.head_dim, a.reps);
  weft::Comm self = world.split(world.rank(), 0, "self");
  for (std::size_t seq : seqs) {
    weft::context::check_sequence(seq, 2);
    Result alone;
    if (root) alone = run_alone(a, seq);
    world.barrier();
    const Result ring = run_variant<weft::Ring>(world, a, seq);
    const Result gather = run_variant<weft::AllGather>(world, a, seq);
    Result a2a;
    const bool a2a_fits = weft::context::alltoall_fits(a.heads, a.kv_heads, 2);
    if (a2a_fits) a2a = run_variant<weft::AllToAll>(world, a, seq);
    double contiguous_fast = 0;
    const double contiguous_slow = contiguous_work(world, a, seq, contiguous_fast);
    if (!root) continue;
    std::printf("\nT = %zu\n%-20s %10s %9s %10s %11s %10s %9s\n", seq, "layout", "tok/s", "s/layer", "vs cp=1",
                "exposed s", "exposed %", "act MiB");
    auto row = [&](const char* name, const Result& r) {
      const double tps = double(seq) / r.seconds;
      std::printf("%-20s %10.0f %9.4f %10.2f %11.5f %9.1f%% %9.2f\n", name, tps, r.seconds, alone.seconds / r.seconds,
                  r.exposed, 100.0 * r.exposed / std::max(r.compute_max, 1e-12), double(r.saved_bytes) / 1048576.0);
    };
    row("cp=1 (rank 0 alone)", alone);
    row("Context<Ring>", ring);
    row("Context<AllGather>", gather);
    if (a2a_fits) row("Context<AllToAll>", a2a);
    std::printf("balance (slowest / fastest rank's compute): balanced layout (Ring) %.3f, contiguous layout %.3f\n",
                ring.compute_max / ring.compute_min, contiguous_slow / contiguous_fast);
    std::printf("activations at cp=2 / cp=1: Ring %.3f, AllGather %.3f%s\n",
                double(ring.saved_bytes) / double(alone.saved_bytes), double(gather.saved_bytes) / double(alone.saved_bytes),
                a2a_fits ? (", AllToAll " + std::to_string(double(a2a.saved_bytes) / double(alone.saved_bytes))).c_str() : "");
  }
  return 0;
}
