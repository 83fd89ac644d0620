// Context parallelism, one attention layer: the output, log-sum-exp and the
// gradients of Context<Ring>, Context<AllGather> and Context<AllToAll> over
// cp = world size equal the unsharded layer's, element by element, in double
// within 1e-12 relative -- with and without the causal mask, and with
// grouped-query attention (K/V heads fewer than query heads, and fewer than
// cp for AllToAll, where they are replicated). Plus the balanced layout's
// arithmetic and the errors for lengths and heads that do not fit.
#include <cmath>
#include <string>
#include <vector>

#include <weft/parallel/context.hpp>
#include <weft/vocabulary/strategy.hpp>

#include "weft_test.hpp"

using namespace weft;

namespace {

using D3 = Kokkos::View<double***, Kokkos::LayoutRight>;
using D2 = Kokkos::View<double**, Kokkos::LayoutRight>;

// Deterministic values in [-1, 1) from (tensor, head, token, feature).
double value(int which, std::size_t h, std::size_t t, std::size_t d) {
  std::uint64_t x = (std::uint64_t(which) * 0x9E3779B97F4A7C15ull) ^ (h * 0xBF58476D1CE4E5B9ull) ^
                    (t * 0x94D049BB133111EBull) ^ (d * 0x2545F4914F6CDD1Dull);
  x ^= x >> 31;
  x *= 0xD6E8FEB86659FD93ull;
  x ^= x >> 32;
  return double(x % 20000) / 10000.0 - 1.0;
}

D3 global_tensor(int which, std::size_t heads, std::size_t T, std::size_t hd) {
  D3 v("global", heads, T, hd);
  for (std::size_t h = 0; h < heads; ++h)
    for (std::size_t t = 0; t < T; ++t)
      for (std::size_t d = 0; d < hd; ++d) v(h, t, d) = value(which, h, t, d);
  return v;
}

// This rank's tokens of a global [heads, T, hd] tensor, in the balanced layout.
D3 local_of(const D3& g, std::size_t cp, std::size_t rank) {
  const std::size_t T = g.extent(1), tl = T / cp;
  D3 v("local", g.extent(0), tl, g.extent(2));
  for (std::size_t h = 0; h < g.extent(0); ++h)
    for (std::size_t t = 0; t < tl; ++t)
      for (std::size_t d = 0; d < g.extent(2); ++d) v(h, t, d) = g(h, context::global_index(t, T, cp, rank), d);
  return v;
}

// max |local − global slice| / max |global| over this rank's tokens.
double rel_diff(const D3& local, const D3& g, std::size_t cp, std::size_t rank) {
  const std::size_t T = g.extent(1);
  double diff = 0, scale = 0;
  for (std::size_t h = 0; h < g.extent(0); ++h)
    for (std::size_t t = 0; t < local.extent(1); ++t)
      for (std::size_t d = 0; d < g.extent(2); ++d) {
        const double ref = g(h, context::global_index(t, T, cp, rank), d);
        diff = std::max(diff, std::abs(local(h, t, d) - ref));
        scale = std::max(scale, std::abs(ref));
      }
  return scale > 0 ? diff / scale : diff;
}
double rel_diff_lse(const D2& local, const D2& g, std::size_t cp, std::size_t rank) {
  const std::size_t T = g.extent(1);
  double diff = 0, scale = 0;
  for (std::size_t h = 0; h < g.extent(0); ++h)
    for (std::size_t t = 0; t < local.extent(1); ++t) {
      const double ref = g(h, context::global_index(t, T, cp, rank));
      diff = std::max(diff, std::abs(local(h, t) - ref));
      scale = std::max(scale, std::abs(ref));
    }
  return scale > 0 ? diff / scale : diff;
}

struct Case {
  std::size_t heads, kv_heads, chunk, hd;
  bool causal;
};

// Runs one variant on this rank's tokens and compares everything with the
// unsharded kernel on the whole sequence (computed on every rank).
template <class Variant>
void check_variant(Comm& cp, const Case& c) {
  const std::size_t P = std::size_t(cp.size()), r = std::size_t(cp.rank());
  const std::size_t T = 2 * P * c.chunk, tl = T / P;
  const double scale = 1.0 / std::sqrt(double(c.hd));
  const D3 Qg = global_tensor(1, c.heads, T, c.hd), Kg = global_tensor(2, c.kv_heads, T, c.hd),
           Vg = global_tensor(3, c.kv_heads, T, c.hd), dOg = global_tensor(4, c.heads, T, c.hd);
  D3 Og("O", c.heads, T, c.hd), dQg("dQ", c.heads, T, c.hd), dKg("dK", c.kv_heads, T, c.hd),
      dVg("dV", c.kv_heads, T, c.hd);
  D2 lg("lse", c.heads, T);
  ops::flash_attention_forward(Qg, Kg, Vg, scale, c.causal, Og, lg);
  ops::flash_attention_backward(Qg, Kg, Vg, Og, dOg, lg, scale, c.causal, dQg, dKg, dVg);

  const D3 Q = local_of(Qg, P, r), K = local_of(Kg, P, r), V = local_of(Vg, P, r), dO = local_of(dOg, P, r);
  D3 O("O", c.heads, tl, c.hd), dQ("dQ", c.heads, tl, c.hd), dK("dK", c.kv_heads, tl, c.hd),
      dV("dV", c.kv_heads, tl, c.hd);
  D2 l("lse", c.heads, tl);
  context::ContextAttention<Variant, double> attn(cp, c.heads, c.kv_heads, T, c.hd, c.causal);
  CHECK(attn.local_tokens() == tl);
  attn.forward(Q, K, V, scale, O, l);
  // Gradients are overwritten, not accumulated: start from garbage.
  Kokkos::deep_copy(dQ, 7.0);
  Kokkos::deep_copy(dK, 7.0);
  Kokkos::deep_copy(dV, 7.0);
  attn.backward(dO, dQ, dK, dV);

  INFO(Context<Variant>::policy_name(), " cp=", P, " heads=", c.heads, " kv_heads=", c.kv_heads, " T=", T,
       " causal=", c.causal);
  CHECK(rel_diff(O, Og, P, r) <= 1e-12);
  CHECK(rel_diff_lse(l, lg, P, r) <= 1e-12);
  CHECK(rel_diff(dQ, dQg, P, r) <= 1e-12);
  CHECK(rel_diff(dK, dKg, P, r) <= 1e-12);
  CHECK(rel_diff(dV, dVg, P, r) <= 1e-12);
  // The check can fail: a wrong layout (tokens of another rank) is far off.
  if (P > 1) CHECK(rel_diff(O, Og, P, (r + 1) % P) > 1e-3);
}

template <class Variant>
void check_all_cases(Comm& cp) {
  const std::size_t P = std::size_t(cp.size());
  const std::vector<Case> cases = {
      {4, 4, 5, 8, false}, {4, 4, 5, 8, true},   // multi-head
      {4, 2, 6, 8, true},  {4, 1, 3, 16, true},  // grouped-query, one K/V head
      {4, 2, 70, 4, true},                       // chunks longer than a key block (64)
  };
  for (const Case& c : cases) {
    if (std::is_same_v<Variant, AllToAll> && !context::alltoall_fits(c.heads, c.kv_heads, P)) continue;
    check_variant<Variant>(cp, c);
  }
}


}  // namespace

TEST_CASE("context: the balanced layout gives rank r chunks r and 2cp-1-r") {
  // T = 16 over cp = 2: chunks of 4; rank 0 holds 0-3 and 12-15, rank 1 4-7 and 8-11.
  std::vector<std::size_t> r0, r1;
  for (std::size_t t = 0; t < 8; ++t) {
    r0.push_back(context::global_index(t, 16, 2, 0));
    r1.push_back(context::global_index(t, 16, 2, 1));
  }
  CHECK(r0 == std::vector<std::size_t>{0, 1, 2, 3, 12, 13, 14, 15});
  CHECK(r1 == std::vector<std::size_t>{4, 5, 6, 7, 8, 9, 10, 11});
  // Every token exactly once at cp = 4.
  std::vector<int> seen(48, 0);
  for (std::size_t r = 0; r < 4; ++r)
    for (std::size_t t = 0; t < 12; ++t) ++seen[context::global_index(t, 48, 4, r)];
  for (int s : seen) CHECK(s == 1);
  // Causal work per rank (visible keys summed over its queries) is equal.
  std::vector<std::size_t> work(4, 0);
  for (std::size_t r = 0; r < 4; ++r)
    for (std::size_t t = 0; t < 12; ++t) work[r] += context::global_index(t, 48, 4, r) + 1;
  for (std::size_t r = 1; r < 4; ++r) CHECK(work[r] == work[0]);
}

TEST_CASE("context: lengths and heads that do not fit are errors that name what works") {
  const auto len = test::error_text<ConfigError>([] { context::check_sequence(7, 2); });
  CHECK(test::contains(len, "the sequence length 7 does not divide into 2·cp = 4 equal chunks"));
  CHECK(test::contains(len, "e.g. 4 or 8"));
  CHECK(test::contains(len, "No token is dropped"));
  CHECK(test::error_text<ConfigError>([] { context::check_sequence(3, 2); }).find("e.g. 4") != std::string::npos);
  CHECK(test::error_text<ConfigError>([] { context::check_sequence(8, 2); }).empty());
  const auto heads = test::error_text<ConfigError>([] { context::check_alltoall(6, 2, 4); });
  CHECK(test::contains(heads, "6 query heads and 2 K/V heads cannot be sharded over cp = 4"));
  CHECK(test::contains(heads, "cp sizes that work: 1, 2, 6"));
  CHECK(test::error_text<ConfigError>([] { context::check_alltoall(8, 2, 4); }).empty());  // K/V heads divide cp: replicated
  CHECK(context::alltoall_sizes(8, 8) == std::vector<std::size_t>{1, 2, 4, 8});
  static_assert(context::alltoall_fits(8, 1, 8) && !context::alltoall_fits(8, 3, 2));
  static_assert(context::static_alltoall_check<8, 2, 4>() && context::static_sequence_check<12, 3>());

  auto& world = test::world();
  const std::size_t n = std::size_t(world.size());
  // At construction, with this communicator's size.
  const auto ctor = test::error_text<ConfigError>([&] { context::ContextAttention<Ring, double> a(world, 4, 4, 2 * n + 1, 8, true); });
  CHECK(test::contains(ctor, "does not divide into 2·cp = " + std::to_string(2 * n)));
  if (n == 4) {
    const auto a2a = test::error_text<ConfigError>([&] { context::ContextAttention<AllToAll, double> a(world, 6, 6, 16, 8, true); });
    CHECK(test::contains(a2a, "cp sizes that work: 1, 2, 3, 6"));
  }
  CHECK(Context<AllGather>::policy_name() == "Context<AllGather>");
}

TEST_CASE("context: Ring equals the unsharded attention layer") { check_all_cases<Ring>(test::world()); }
TEST_CASE("context: AllGather equals the unsharded attention layer") { check_all_cases<AllGather>(test::world()); }
TEST_CASE("context: AllToAll equals the unsharded attention layer") { check_all_cases<AllToAll>(test::world()); }

TEST_CASE("context: Context<Variant> is the CP axis' policy in a strategy") {
  using S = Strategy<On<DP, FullyShard>, On<CP, Context<Ring>>, On<TP, TensorParallel<>>>;
  CHECK(S::name() == "Strategy<On<dp, FullyShard>, On<cp, Context<Ring>>, On<tp, TensorParallel<>>>");
  static_assert(std::is_same_v<S::policy<CP>, Context<Ring>>);
  static_assert(is_context_policy_v<Context<AllToAll>> && !is_context_policy_v<Ring>);
}
