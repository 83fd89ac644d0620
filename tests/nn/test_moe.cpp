// The mixture-of-experts layer and the GPT with MoE blocks: gradients of the
// router, the experts, the load-balancing loss and the z-loss against central
// finite differences in double precision, a router that sends every token to
// one expert (statistics, zero-token experts, drops), the capacity rule
// checked against its definition, the selection-bias update and config errors.
#include <algorithm>
#include <cmath>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include <weft/nn/nn.hpp>

#include "../ops/gradcheck.hpp"

namespace {

using namespace weft;
using weft::test::fill_uniform;
using weft::test::numeric_gradient;
using weft::test::relative_error;
using weft::test::to_vector;
using weft::test::weighted_sum;
using Space = Kokkos::DefaultExecutionSpace;
using Mat = ops::Matrix<double, Space>;
using Param = nn::Parameter<double, Space>;
using MoE = nn::MoE<double, Space>;

constexpr double kTol = 1e-6;

nn::GPTConfig tiny_moe() {
  nn::GPTConfig c;
  c.layers = 1;
  c.d_model = 8;
  c.heads = 2;
  c.seq = 4;
  c.batch = 2;
  c.vocab = 11;
  c.seed = 99;
  c.init_std = 0.3;
  c.experts = 4;
  c.top_k = 2;
  c.ffn_hidden = 12;
  return c;
}

bool is_selection_bias(const Param* p) { return p->name().find("expert_bias") != std::string::npos; }

void zero(const std::vector<Param*>& ps) {
  for (auto* p : ps) Kokkos::deep_copy(p->grad, 0.0);
}

std::map<std::string, std::vector<double>> grads_of(const std::vector<Param*>& ps) {
  std::map<std::string, std::vector<double>> g;
  for (auto* p : ps) g[p->name()] = to_vector(p->grad);
  return g;
}

// Every trained parameter's gradient against finite differences; the
// selection bias' gradient must be exactly zero (it is moved by update_bias only).
void check_params(const std::vector<Param*>& ps, const std::map<std::string, std::vector<double>>& g,
                  const std::function<double()>& loss) {
  for (auto* p : ps) {
    CAPTURE(p->name());
    if (is_selection_bias(p)) {
      for (double v : g.at(p->name())) CHECK(v == 0.0);
      continue;
    }
    CHECK(relative_error(g.at(p->name()), numeric_gradient(p->value, loss)) < kTol);
  }
}

struct Case {
  const char* name;
  nn::RouterKind router;
  nn::MlpKind mlp;
  std::size_t k;
  double capacity;  // 0: dropless
  bool normalize;
  std::size_t shared;
};
const Case kCases[] = {
    {"softmax gelu top2 dropless shared", nn::RouterKind::softmax, nn::MlpKind::gelu, 2, 0, true, 1},
    {"sigmoid swiglu top2 capacity 0.75", nn::RouterKind::sigmoid, nn::MlpKind::swiglu, 2, 0.75, true, 0},
    {"softmax gelu top1 raw gates capacity 1", nn::RouterKind::softmax, nn::MlpKind::gelu, 1, 1.0, false, 0},
    {"sigmoid gelu top3 raw gates dropless", nn::RouterKind::sigmoid, nn::MlpKind::gelu, 3, 0, false, 2},
};

TEST_CASE("MoE: gradients of router, experts, aux loss and z-loss match finite differences") {
  for (const auto& k : kCases) {
    CAPTURE(k.name);
    auto c = tiny_moe();
    c.router = k.router;
    c.mlp = k.mlp;
    c.top_k = k.k;
    c.capacity_factor = k.capacity;
    c.normalize_gates = k.normalize;
    c.shared_experts = k.shared;
    c.aux_loss = 0.3;
    c.z_loss = 0.05;
    auto ctx = std::make_shared<nn::LayerContext>();
    MoE moe(ctx, "moe", c);
    MoE::Saved s("moe", c);
    MoE::Workspace ws(c);
    std::vector<Param*> ps;
    moe.collect(ps);
    for (auto* p : ps)
      if (p->name().find(".bias") != std::string::npos && !is_selection_bias(p)) fill_uniform(p->value, 3, -0.5, 0.5);
    Mat h("h", c.tokens(), c.d_model), out("out", c.tokens(), c.d_model), w("w", c.tokens(), c.d_model),
        dh("dh", c.tokens(), c.d_model);
    fill_uniform(h, 7);
    fill_uniform(w, 8);
    auto loss = [&] {
      moe.forward(h, s, out);
      return weighted_sum(out, w) + moe.last_aux_loss() + moe.last_z_loss();
    };
    zero(ps);
    loss();
    CHECK(moe.last_aux_loss() > 0);
    CHECK(moe.last_z_loss() > 0);
    if (k.capacity > 0 && k.k > 1) CHECK(!s.dropped.empty());  // the case exercises drops
    const auto dropped = s.dropped;
    moe.backward(h, s, w, dh, ws);
    CHECK(relative_error(to_vector(dh), numeric_gradient(h, loss)) < kTol);
    check_params(ps, grads_of(ps), loss);
    CHECK(s.dropped == dropped);  // the perturbations did not change the routing
  }
}

TEST_CASE("MoE: the aux loss and z-loss values follow their definitions") {
  auto c = tiny_moe();
  c.aux_loss = 0.5;
  c.z_loss = 0.25;
  auto ctx = std::make_shared<nn::LayerContext>();
  MoE moe(ctx, "moe", c);
  MoE::Saved s("moe", c);
  Mat h("h", c.tokens(), c.d_model), out("out", c.tokens(), c.d_model);
  fill_uniform(h, 17);
  moe.forward(h, s, out);
  const std::size_t n = c.tokens(), N = c.experts;
  auto u = to_vector(s.logits);
  double aux = 0, z = 0;
  std::vector<double> f(N, 0.0), P(N, 0.0);
  for (std::size_t t = 0; t < n; ++t) {
    double m = *std::max_element(u.begin() + long(t * N), u.begin() + long(t * N + N)), se = 0;
    for (std::size_t e = 0; e < N; ++e) se += std::exp(u[t * N + e] - m);
    const double lse = m + std::log(se);
    z += lse * lse / double(n);
    for (std::size_t e = 0; e < N; ++e) P[e] += std::exp(u[t * N + e] - lse) / double(n);
    for (std::size_t q = 0; q < c.top_k; ++q) f[std::size_t(s.slot_expert[t * c.top_k + q])] += 1.0 / double(n * c.top_k);
  }
  for (std::size_t e = 0; e < N; ++e) aux += f[e] * P[e];
  CHECK(moe.last_aux_loss() == doctest::Approx(0.5 * double(N) * aux).epsilon(1e-12));
  CHECK(moe.last_z_loss() == doctest::Approx(0.25 * z).epsilon(1e-12));
  // The top-k choices are the k largest scores, the gates their normalised scores.
  for (std::size_t t = 0; t < n; ++t) {
    std::vector<double> p(s.scores.begin() + long(t * N), s.scores.begin() + long(t * N + N));
    std::vector<double> sorted = p;
    std::sort(sorted.rbegin(), sorted.rend());
    const double sum = sorted[0] + sorted[1];
    for (std::size_t q = 0; q < 2; ++q) {
      CHECK(p[std::size_t(s.slot_expert[t * 2 + q])] == sorted[q]);
      CHECK(s.slot_gate[t * 2 + q] == doctest::Approx(sorted[q] / sum).epsilon(1e-14));
    }
  }
}

// A router whose weight is zero and whose selection bias favours expert 2
// sends every token there: the other experts get no tokens.
TEST_CASE("MoE: every token to one expert -- statistics, zero-token experts, drops by token index") {
  for (double cf : {0.0, 1.0}) {
    CAPTURE(cf);
    auto c = tiny_moe();
    c.top_k = 1;
    c.capacity_factor = cf;
    c.aux_loss = 0.1;
    auto ctx = std::make_shared<nn::LayerContext>();
    MoE moe(ctx, "moe", c);
    MoE::Saved s("moe", c);
    MoE::Workspace ws(c);
    Kokkos::deep_copy(moe.router().weight().value, 0.0);
    auto bh = Kokkos::create_mirror_view(moe.expert_bias().value);
    for (std::size_t e = 0; e < c.experts; ++e) bh(e) = e == 2 ? 1.0 : 0.0;
    Kokkos::deep_copy(moe.expert_bias().value, bh);
    std::vector<Param*> ps;
    moe.collect(ps);
    Mat h("h", c.tokens(), c.d_model), out("out", c.tokens(), c.d_model), w("w", c.tokens(), c.d_model),
        dh("dh", c.tokens(), c.d_model);
    fill_uniform(h, 5);
    fill_uniform(w, 6);
    zero(ps);
    moe.forward(h, s, out);
    moe.backward(h, s, w, dh, ws);
    const double n = double(c.tokens());
    const auto& st = moe.statistics();
    CHECK(st.selected == std::vector<double>{0, 0, n, 0});
    CHECK(st.min_tokens() == 0);
    CHECK(st.max_tokens() == n);
    CHECK(st.imbalance() == doctest::Approx(double(c.experts)));
    CHECK(st.entropy() == doctest::Approx(std::log(double(c.experts))));  // zero weights: uniform scores
    const std::size_t cap = moe.capacity(c.tokens());
    if (cf == 0) {
      CHECK(st.dropped == 0);
      CHECK(s.offsets == std::vector<std::size_t>{0, 0, 0, c.tokens(), c.tokens()});
    } else {
      CHECK(cap == c.tokens() / c.experts);  // ceil(1.0 * 8 * 1 / 4) = 2
      CHECK(st.dropped == n - double(cap));
      // Equal scores: the lowest token indices are kept, the rest dropped, and they get no output.
      std::vector<std::size_t> expect;
      for (std::size_t t = cap; t < c.tokens(); ++t) expect.push_back(t);
      CHECK(s.dropped == expect);
      auto o = to_vector(out);
      for (std::size_t t = cap; t < c.tokens(); ++t)
        for (std::size_t j = 0; j < c.d_model; ++j) CHECK(o[t * c.d_model + j] == 0.0);
    }
    // The zero-token experts' gradients are exactly zero; the chosen one's are not.
    for (auto* p : ps) {
      CAPTURE(p->name());
      const auto g = to_vector(p->grad);
      const bool any = std::any_of(g.begin(), g.end(), [](double v) { return v != 0; });
      if (p->name().find("experts.") != std::string::npos) CHECK(any == (p->name().find("experts.2.") != std::string::npos));
    }
    // The gradients are still right with empty groups.
    auto loss = [&] {
      moe.forward(h, s, out);
      return weighted_sum(out, w) + moe.last_aux_loss();
    };
    moe.set_recording(false);
    std::vector<Param*> smooth;  // with capacity, equal scores sit on a tie: moving the router moves the drops
    for (auto* p : ps)
      if (cf == 0 || p->name() != "moe.router.weight") smooth.push_back(p);
    check_params(smooth, grads_of(smooth), loss);
    CHECK(relative_error(to_vector(dh), numeric_gradient(h, loss)) < kTol);
  }
}

// The capacity rule on its definition: per expert the kept slots are the C of
// highest score, ties by token index; it depends on nothing else.
TEST_CASE("MoE: dropped slots are the lowest scores per expert, ties by token index, the same on every run") {
  auto c = tiny_moe();
  c.batch = 8;  // 32 tokens
  c.top_k = 2;
  c.capacity_factor = 1.0;
  auto ctx = std::make_shared<nn::LayerContext>();
  MoE a(ctx, "moe", c), b(ctx, "moe", c);
  MoE::Saved sa("a", c), sb("b", c);
  Mat h("h", c.tokens(), c.d_model), out("out", c.tokens(), c.d_model);
  fill_uniform(h, 21);
  a.forward(h, sa, out);
  b.forward(h, sb, out);
  CHECK(!sa.dropped.empty());
  CHECK(sa.dropped == sb.dropped);  // two models from the same seed
  const std::size_t K = c.top_k, N = c.experts, cap = a.capacity(c.tokens());
  std::vector<std::size_t> expect;
  for (std::size_t e = 0; e < N; ++e) {
    std::vector<std::size_t> cand;
    for (std::size_t q = 0; q < c.tokens() * K; ++q)
      if (std::size_t(sa.slot_expert[q]) == e) cand.push_back(q);
    std::stable_sort(cand.begin(), cand.end(), [&](std::size_t x, std::size_t y) {
      return sa.scores[(x / K) * N + e] > sa.scores[(y / K) * N + e];
    });
    CHECK(sa.offsets[e + 1] - sa.offsets[e] == std::min(cap, cand.size()));
    for (std::size_t i = cap; i < cand.size(); ++i) expect.push_back(cand[i]);
  }
  std::sort(expect.begin(), expect.end());
  CHECK(sa.dropped == expect);
  // Routing the same tokens again gives the same drops (no state leaks between passes).
  a.forward(h, sa, out);
  CHECK(sa.dropped == expect);
  CHECK(a.statistics().dropped == 2 * double(expect.size()));
}

TEST_CASE("MoE: the selection bias moves against the load, is model state, and changes selection only") {
  auto c = tiny_moe();
  c.top_k = 2;
  c.bias_balance = 0.01;
  auto ctx = std::make_shared<nn::LayerContext>();
  MoE moe(ctx, "moe", c);
  MoE::Saved s("moe", c);
  Kokkos::deep_copy(moe.router().weight().value, 0.0);
  auto bh = Kokkos::create_mirror_view(moe.expert_bias().value);
  for (std::size_t e = 0; e < c.experts; ++e) bh(e) = e == 1 ? 0.5 : 0.0;
  Kokkos::deep_copy(moe.expert_bias().value, bh);
  Mat h("h", c.tokens(), c.d_model), out("out", c.tokens(), c.d_model);
  fill_uniform(h, 2);
  moe.forward(h, s, out);
  // Uniform scores: every token picks expert 1 (its bias) and expert 0 (the
  // lower index of the tie); the gates come from the scores alone: 1/2 each.
  for (std::size_t t = 0; t < c.tokens(); ++t) {
    CHECK(s.slot_expert[2 * t] == 1);
    CHECK(s.slot_expert[2 * t + 1] == 0);
  }
  for (double g : s.slot_gate) CHECK(g == doctest::Approx(0.5));
  moe.update_bias(c.bias_balance);
  auto after = to_vector(moe.expert_bias().value);
  CHECK(after[1] == doctest::Approx(0.5 - 0.01));  // overloaded: chosen by every token
  CHECK(after[0] == doctest::Approx(-0.01));
  CHECK(after[2] == doctest::Approx(0.01));  // idle
  CHECK(after[3] == doctest::Approx(0.01));
  moe.update_bias(c.bias_balance);  // nothing counted since: no change
  CHECK(to_vector(moe.expert_bias().value) == after);
  // It is a parameter of the model (so checkpoints save it), without decay.
  std::vector<Param*> ps;
  moe.collect(ps);
  auto it = std::find_if(ps.begin(), ps.end(), [](Param* p) { return p->name() == "moe.router.expert_bias"; });
  REQUIRE(it != ps.end());
  CHECK_FALSE((*it)->decay());
}

TEST_CASE("GPT with MoE blocks: whole-model gradients include the auxiliary losses") {
  for (bool rc : {false, true}) {
    CAPTURE(rc);
    auto c = tiny_moe();
    c.layers = 2;
    c.moe_every = 2;  // block 0 dense, block 1 MoE
    c.shared_experts = 1;
    c.aux_loss = 0.2;
    c.z_loss = 0.1;
    c.recompute = rc;
    nn::GPT<double, SingleProcess, Space> gpt(c);
    CHECK(gpt.moe_layer(0) == nullptr);
    REQUIRE(gpt.moe_layer(1) != nullptr);
    auto ps = gpt.parameters();
    bool router = false;
    for (auto* p : ps) router = router || p->name() == "blocks.1.mlp.router.weight";
    CHECK(router);
    ops::Tokens<Space> ids("ids", c.tokens()), tgt("tgt", c.tokens());
    auto hi = Kokkos::create_mirror_view(ids);
    auto ht = Kokkos::create_mirror_view(tgt);
    for (std::size_t i = 0; i < c.tokens(); ++i) {
      hi(i) = int((i * 5 + 1) % c.vocab);
      ht(i) = int((i * 3 + 2) % c.vocab);
    }
    Kokkos::deep_copy(ids, hi);
    Kokkos::deep_copy(tgt, ht);
    gpt.zero_grad();
    gpt.reset_moe_statistics();
    const double l0 = gpt.forward_backward(ids, tgt);
    const double aux = gpt.moe_loss();
    CHECK(aux > 0);
    const auto st = gpt.moe_statistics();
    CHECK(st.passes == 1);  // recompute does not count the routing twice
    CHECK(st.tokens == double(c.tokens()));
    CHECK(st.slots == double(c.tokens() * c.top_k));
    CHECK(l0 == doctest::Approx(gpt.loss(ids, tgt)).epsilon(1e-14));
    std::map<std::string, std::vector<double>> g;
    for (auto* p : ps) g[p->name()] = to_vector(p->grad);
    for (auto* p : ps) {
      CAPTURE(p->name());
      if (is_selection_bias(p)) continue;
      CHECK(relative_error(g.at(p->name()),
                           numeric_gradient(p->value, [&] { return gpt.loss(ids, tgt) + gpt.moe_loss(); })) < kTol);
    }
  }
}

TEST_CASE("GPT with MoE: recompute gives bit-identical gradients; FLOPs count the active experts") {
  auto c = tiny_moe();
  c.layers = 2;
  c.aux_loss = 0.01;
  c.capacity_factor = 1.0;
  std::vector<std::vector<double>> grads[2];
  for (int rc = 0; rc < 2; ++rc) {
    c.recompute = rc == 1;
    nn::GPT<double, SingleProcess, Space> gpt(c);
    ops::Tokens<Space> ids("ids", c.tokens());
    auto hi = Kokkos::create_mirror_view(ids);
    for (std::size_t i = 0; i < c.tokens(); ++i) hi(i) = int((i * 7 + 3) % c.vocab);
    Kokkos::deep_copy(ids, hi);
    gpt.zero_grad();
    gpt.forward_backward(ids, ids);
    for (auto* p : gpt.parameters()) grads[rc].push_back(to_vector(p->grad));
  }
  CHECK(grads[0] == grads[1]);
  const double d = 8, fe = 12, V = 11, N = 4, k = 2;
  const double attn = d * d * 3 + d * d;
  CHECK(c.matmul_params() == doctest::Approx(2 * (attn + k * 2 * d * fe + d * N) + d * V));
}

// Gradient accumulation passes grad_scale = 1 / (tokens x microbatches):
// the auxiliary losses must scale with it as the token loss does.
TEST_CASE("GPT with MoE: the auxiliary losses' gradients scale with grad_scale") {
  auto c = tiny_moe();
  c.aux_loss = 0.5;
  c.z_loss = 0.5;
  nn::GPT<double, SingleProcess, Space> gpt(c);
  ops::Tokens<Space> ids("ids", c.tokens());
  auto hi = Kokkos::create_mirror_view(ids);
  for (std::size_t i = 0; i < c.tokens(); ++i) hi(i) = int((i * 3 + 1) % c.vocab);
  Kokkos::deep_copy(ids, hi);
  gpt.zero_grad();
  gpt.forward_backward(ids, ids);
  std::vector<std::vector<double>> full;
  for (auto* p : gpt.parameters()) full.push_back(to_vector(p->grad));
  gpt.zero_grad();
  gpt.forward_backward(ids, ids, 0.25 / double(c.tokens()));
  std::size_t i = 0;
  for (auto* p : gpt.parameters()) {
    CAPTURE(p->name());
    auto g = to_vector(p->grad);
    for (auto& v : g) v *= 4;
    CHECK(relative_error(g, full[i++]) < 1e-12);
  }
}

TEST_CASE("MoE config errors name the flag") {
  auto c = tiny_moe();
  c.top_k = 5;
  CHECK_THROWS_WITH_AS(c.validate(), doctest::Contains("--top-k 5 must be between 1 and --experts 4"), ConfigError);
  c.top_k = 2;
  c.moe_every = 0;
  CHECK_THROWS_WITH_AS(c.validate(), doctest::Contains("--moe-every"), ConfigError);
  c.moe_every = 1;
  c.capacity_factor = -1;
  CHECK_THROWS_WITH_AS(c.validate(), doctest::Contains("--capacity-factor"), ConfigError);
}

}  // namespace
