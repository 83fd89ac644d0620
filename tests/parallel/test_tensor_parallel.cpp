// Tensor parallelism over the whole world as the TP axis: the placed Linear
// pair equals the single-process pair; the GPT split over TP (with and
// without sequence parallelism, GELU and SwiGLU, learned and rotary
// positions, grouped-query heads) follows the single-process loss curve and
// gradient norm for 20 steps; the TP collectives of a step move exactly the
// bytes of the formula in docs/tensor_parallel.md; indivisible sizes are
// ConfigErrors naming the quantity and the valid TP sizes; the model type
// comes from the strategy's layer policy alone.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <type_traits>
#include <vector>

#include "../plan/spec_of_gpt.hpp"
#include "weft_test.hpp"

namespace {

using weft::nn::GPTConfig;

// The two tensor-parallel strategies of these tests (the world is the TP axis).
using TPOnly = weft::Strategy<weft::On<weft::TP, weft::TensorParallel<>>>;
using SeqPar = weft::Strategy<weft::On<weft::TP, weft::TensorParallel<weft::SequenceParallel>>>;

// Strategies that differ only in what wraps the model share one model type.
static_assert(std::is_same_v<weft::nn::GPT<float, weft::Strategy<weft::On<weft::DP, weft::FullyShard>,
                                                                 weft::On<weft::TP, weft::TensorParallel<>>>>,
                             weft::nn::GPT<float, weft::Strategy<weft::On<weft::DP, weft::ZeRO<1>>,
                                                                 weft::On<weft::TP, weft::TensorParallel<>>>>>);
static_assert(std::is_same_v<weft::nn::GPT<float, TPOnly>, weft::nn::GPTModel<float, Kokkos::DefaultExecutionSpace,
                                                                            weft::TensorParallel<>>>);
static_assert(std::is_same_v<weft::nn::GPT<float, weft::Strategy<weft::On<weft::DP, weft::ZeRO<2>>>>, weft::nn::GPT<float>>);
static_assert(!std::is_same_v<weft::nn::GPT<float, TPOnly>, weft::nn::GPT<float, SeqPar>>);
static_assert(weft::nn::GPT<float, SeqPar>::sequence_parallel_v && !weft::nn::GPT<float, TPOnly>::sequence_parallel_v);

// Calls f.template operator()<S>() for TPOnly and, where the world has more
// than one rank to shard tokens over, SeqPar.
template <class F>
void for_each_tp_strategy(F&& f) {
  f.template operator()<TPOnly>();
  if (weft::test::world().size() > 1) f.template operator()<SeqPar>();
}

double rel(double a, double b) { return std::abs(a - b) / std::max(std::abs(b), 1e-30); }

weft::data::TokenStream stream(std::size_t seq, int vocab) {
  std::vector<int> toks(4000);
  std::uint64_t x = 4242;
  int prev = 0;
  for (auto& t : toks) {
    x = x * 6364136223846793005ull + 1442695040888963407ull;
    t = (x >> 60) < 3 ? int((x >> 33) % std::uint64_t(vocab)) : (prev * 7 + 3) % vocab;
    prev = t;
  }
  return weft::data::TokenStream(std::move(toks), seq, 17);
}

// GPT-2 shaped: GELU, learned positions, LayerNorm, full heads.
GPTConfig gpt2_tiny() {
  GPTConfig c;
  c.layers = 2;
  c.d_model = 16;
  c.heads = 4;
  c.seq = 8;
  c.vocab = 32;
  c.batch = 4;
  c.seed = 11;
  return c;
}

// Llama shaped: SwiGLU, rotary positions, RMSNorm, grouped-query heads.
GPTConfig llama_tiny() {
  GPTConfig c = gpt2_tiny();
  c.d_model = 32;
  c.heads = 8;
  c.kv_heads = 4;
  c.mlp = weft::nn::MlpKind::swiglu;
  c.position = weft::nn::PositionKind::rotary;
  c.norm = weft::nn::NormKind::rmsnorm;
  return c;
}

struct Curve {
  std::vector<double> loss, norm;
};

// 20 AdamW steps of 2 microbatches each (gradient accumulation across
// microbatches is where partial gradients could be double-counted).
template <class Model>
Curve train(Model& gpt, std::size_t steps = 20) {
  const GPTConfig& c = gpt.config();
  weft::optim::AdamW<float, Kokkos::DefaultExecutionSpace> opt(gpt.parameters());
  auto data = stream(c.seq, int(c.vocab));
  Kokkos::View<int*> ids("ids", c.tokens()), tg("tg", c.tokens());
  Curve r;
  for (std::size_t s = 0; s < steps; ++s) {
    auto st = weft::optim::train_step(gpt, opt, data, s, 2, ids, tg, 3e-3, 0.5);
    r.loss.push_back(st.loss);
    r.norm.push_back(st.grad_norm);
  }
  return r;
}

}  // namespace

TEST_CASE("placed Linear: column-parallel then row-parallel equals the single-process pair, forward and backward") {
  auto& w = weft::test::world();
  weft::Mesh<weft::TP> mesh(w, w.size());
  using Col = weft::nn::Linear<float, weft::On<weft::TP, weft::Shard<0>>>;
  using Row = weft::nn::Linear<float, weft::On<weft::TP, weft::Shard<1>>>;
  const std::size_t n = 6, d = 8, f = 16;
  Col up(mesh, d, f, {.name = "up", .bias = true, .seed = 3, .init_std = 0.5});
  Row down(mesh, f, d, {.name = "down", .bias = true, .seed = 3, .init_std = 0.5});
  static_assert(std::is_same_v<Col::output_placement, weft::Shard<1>>);
  static_assert(std::is_same_v<Row::output_placement, weft::Partial<weft::Sum>>);
  // Biases are zero-initialised: give them values so that adding them once matters.
  Kokkos::deep_copy(down.local().bias().value, 0.25f);
  auto cbias = up.local().bias().value;
  const std::size_t c0 = std::size_t(w.rank()) * (f / std::size_t(w.size()));
  Kokkos::parallel_for("bias", cbias.extent(0), KOKKOS_LAMBDA(std::size_t j) { cbias(j) = 0.01f * float(c0 + j); });

  weft::DistView<float, 2> x(mesh, n, d);
  auto hx = Kokkos::create_mirror_view(x.local());
  for (std::size_t i = 0; i < n; ++i)
    for (std::size_t j = 0; j < d; ++j) hx(i, j) = std::sin(float(i * d + j));
  Kokkos::deep_copy(x.local(), hx);

  auto h = up.forward(x);  // On<TP, Shard<1>>
  static_assert(std::is_same_v<typename decltype(h)::template placement_on<weft::TP>, weft::Shard<1>>);
  auto yp = down.forward(h);  // On<TP, Partial<Sum>>
  static_assert(std::is_same_v<typename decltype(yp)::template placement_on<weft::TP>, weft::Partial<weft::Sum>>);
  auto y = weft::redistribute<weft::Replicate>(yp, weft::TP{});

  // Single process: the same names and seed give the same values.
  auto ctx = std::make_shared<weft::nn::LayerContext>();
  weft::nn::Linear<float> up1(ctx, "up", d, f, true, 3, 0.5), down1(ctx, "down", f, d, true, 3, 0.5);
  Kokkos::deep_copy(down1.bias().value, 0.25f);
  auto b1 = up1.bias().value;
  Kokkos::parallel_for("bias1", f, KOKKOS_LAMBDA(std::size_t j) { b1(j) = 0.01f * float(j); });
  weft::ops::Matrix<float> h1("h1", n, f), y1("y1", n, d);
  up1.forward(x.local(), h1);
  down1.forward(h1, y1);
  auto hy = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), y.local());
  auto hy1 = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), y1);
  for (std::size_t i = 0; i < n; ++i)
    for (std::size_t j = 0; j < d; ++j) CHECK(std::abs(hy(i, j) - hy1(i, j)) <= 1e-5f * (1 + std::abs(hy1(i, j))));

  // Backward with dy = y: row-parallel gives dh Shard<1>, column-parallel dx Partial<Sum>.
  auto dh = down.backward(h, y);
  static_assert(std::is_same_v<typename decltype(dh)::template placement_on<weft::TP>, weft::Shard<1>>);
  auto dxp = up.backward(x, dh);
  static_assert(std::is_same_v<typename decltype(dxp)::template placement_on<weft::TP>, weft::Partial<weft::Sum>>);
  auto dx = weft::redistribute<weft::Replicate>(dxp, weft::TP{});
  weft::ops::Matrix<float> dh1("dh1", n, f), dx1("dx1", n, d);
  down1.backward(h1, y1, dh1);
  up1.backward(x.local(), dh1, dx1);
  auto hdx = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), dx.local());
  auto hdx1 = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), dx1);
  for (std::size_t i = 0; i < n; ++i)
    for (std::size_t j = 0; j < d; ++j) CHECK(std::abs(hdx(i, j) - hdx1(i, j)) <= 1e-4f * (1 + std::abs(hdx1(i, j))));
  // This rank's weight gradient is its block of the single-process one.
  auto gw = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), up.local().weight().grad_matrix());
  auto gw1 = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), up1.weight().grad_matrix());
  for (std::size_t i = 0; i < d; ++i)
    for (std::size_t j = 0; j < gw.extent(1); ++j)
      CHECK(std::abs(gw(i, j) - gw1(i, c0 + j)) <= 1e-4f * (1 + std::abs(gw1(i, c0 + j))));
  // The row-parallel bias gradient is complete on every rank.
  auto gb = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), down.local().bias().grad);
  auto gb1 = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), down1.bias().grad);
  for (std::size_t j = 0; j < d; ++j) CHECK(std::abs(gb(j) - gb1(j)) <= 1e-5f * (1 + std::abs(gb1(j))));
}

TEST_CASE("placed Linear: a dropped output's storage is reused by the next step, a held one never") {
  auto& w = weft::test::world();
  weft::Mesh<weft::TP> mesh(w, w.size());
  using Col = weft::nn::Linear<float, weft::On<weft::TP, weft::Shard<0>>>;
  using Row = weft::nn::Linear<float, weft::On<weft::TP, weft::Shard<1>>>;
  const std::size_t n = 4, d = 8, f = 16;
  Col up(mesh, d, f, {.name = "up", .seed = 5, .init_std = 0.5});
  Row down(mesh, f, d, {.name = "down", .seed = 5, .init_std = 0.5});
  auto input = [&](float phase) {
    weft::DistView<float, 2> x(mesh, n, d);
    auto hx = Kokkos::create_mirror_view(x.local());
    for (std::size_t i = 0; i < n; ++i)
      for (std::size_t j = 0; j < d; ++j) hx(i, j) = std::sin(phase + float(i * d + j));
    Kokkos::deep_copy(x.local(), hx);
    return x;
  };
  // A copy (a host mirror of a host view would be the view itself, and hold it).
  auto host = [](const auto& v) {
    Kokkos::View<float**, Kokkos::HostSpace> c("copy", v.local().extent(0), v.local().extent(1));
    Kokkos::deep_copy(c, v.local());
    return c;
  };
  const auto xa = input(0.f), xb = input(1.f);

  // Two outputs held at once (two microbatches in flight): two blocks, and
  // the second forward leaves the first one's values alone.
  auto ha = up.forward(xa);
  const auto ha_values = host(ha);
  auto hb = up.forward(xb);
  CHECK(ha.local().data() != hb.local().data());
  const auto ha_after = host(ha), hb_values = host(hb);
  for (std::size_t i = 0; i < ha_values.extent(0); ++i)
    for (std::size_t j = 0; j < ha_values.extent(1); ++j) CHECK(ha_after(i, j) == ha_values(i, j));
  CHECK(up.output_storage().allocations() == 2);

  // Both dropped: the next forward takes one of their blocks, overwritten
  // whole (the values of a fresh computation of the same input).
  const float* a_block = ha.local().data();
  const float* b_block = hb.local().data();
  ha = {};
  hb = {};
  auto again = up.forward(xb);
  CHECK((again.local().data() == a_block || again.local().data() == b_block));
  CHECK(up.output_storage().allocations() == 2);
  CHECK(up.output_storage().reuses() == 1);
  const auto again_values = host(again);
  for (std::size_t i = 0; i < hb_values.extent(0); ++i)
    for (std::size_t j = 0; j < hb_values.extent(1); ++j) CHECK(again_values(i, j) == hb_values(i, j));
  again = {};

  // A training loop that drops each step's tensors allocates each result once.
  const std::size_t down_before = down.output_storage().allocations();
  for (int step = 0; step < 5; ++step) {
    auto h = up.forward(xa);
    auto y = weft::redistribute<weft::Replicate>(down.forward(h), weft::TP{});
    auto dh = down.backward(h, y);
    auto dx = weft::redistribute<weft::Replicate>(up.backward(xa, dh), weft::TP{});
    CHECK(dx.local().extent(1) == d);
  }
  CHECK(up.output_storage().allocations() == 2);
  CHECK(down.output_storage().allocations() - down_before == 1);
  CHECK(down.input_gradient_storage().allocations() == 1);
  CHECK(up.input_gradient_storage().allocations() == 1);
  CHECK(up.input_gradient_storage().reuses() == 4);
}

TEST_CASE("the GPT split over TP follows the single-process loss curve and gradient norm (fp32, 20 steps, 1e-5)") {
  auto& w = weft::test::world();
  for (const GPTConfig& c : {gpt2_tiny(), llama_tiny()}) {
    if (c.kv() % std::size_t(w.size()) != 0 || c.heads % std::size_t(w.size()) != 0) continue;
    weft::nn::GPT<float> single(c);
    const Curve ref = train(single);
    CHECK(ref.loss.back() < ref.loss.front());  // it trains
    for_each_tp_strategy([&]<class S>() {
      INFO("mlp ", c.mlp == weft::nn::MlpKind::gelu ? "gelu" : "swiglu", " tp ", w.size(), " ", S::name());
      weft::nn::GPT<float, S> gpt(c, w);
      const Curve r = train(gpt);
      for (std::size_t s = 0; s < ref.loss.size(); ++s) {
        INFO("step ", s, " loss ", r.loss[s], " reference ", ref.loss[s], " norm ", r.norm[s], " reference ", ref.norm[s]);
        CHECK(rel(r.loss[s], ref.loss[s]) <= 1e-5);
        CHECK(rel(r.norm[s], ref.norm[s]) <= 1e-4);
      }
    });
  }
}

TEST_CASE("recompute under sequence parallelism keeps the curve") {
  auto& w = weft::test::world();
  if (w.size() == 1) return;  // sequence parallelism needs tp > 1
  GPTConfig c = gpt2_tiny();
  c.recompute = true;
  weft::nn::GPT<float> single(c);
  weft::nn::GPT<float, SeqPar> split(c, w);
  const Curve ref = train(single, 5);
  const Curve r = train(split, 5);
  for (std::size_t s = 0; s < ref.loss.size(); ++s) CHECK(rel(r.loss[s], ref.loss[s]) <= 1e-5);
}

TEST_CASE("the TP collectives of one step move exactly the bytes of the analytic formula") {
  auto& w = weft::test::world();
  if (w.size() == 1) return;
  for (const GPTConfig& c : {gpt2_tiny(), llama_tiny()}) {
    if (c.kv() % std::size_t(w.size()) != 0) continue;
    for_each_tp_strategy([&]<class S>() {
      constexpr bool sp = S::sequence_parallel;
      INFO("tp ", w.size(), " sequence parallel ", sp, " mlp ", c.mlp == weft::nn::MlpKind::gelu ? "gelu" : "swiglu");
      weft::nn::GPT<float, S> gpt(c, w);
      weft::optim::AdamW<float, Kokkos::DefaultExecutionSpace> opt(gpt.parameters());
      auto data = stream(c.seq, int(c.vocab));
      Kokkos::View<int*> ids("ids", c.tokens()), tg("tg", c.tokens());
      const std::size_t M = 2;  // microbatches per step
      w.reset_stats();
      weft::optim::train_step(gpt, opt, data, 0, M, ids, tg, 1e-3, 1.0);
      const auto& st = w.stats();
      // Per microbatch (b = 4 bytes, n = tokens of a microbatch, L layers):
      const std::uint64_t b = sizeof(float), n = c.tokens(), D = c.d_model, L = c.layers;
      const std::uint64_t nd = n * D * b;
      const std::uint64_t ce = n * b + 2 * n * b;  // row maxima, then sums of exp and target logits
      const std::uint64_t clip = sizeof(double);   // once per step: the TP-sharded squares of the gradient norm
      const bool ln = c.norm == weft::nn::NormKind::layernorm;
      const std::uint64_t norm_params = (ln ? 2 : 1) * D;
      const std::uint64_t pos = c.position == weft::nn::PositionKind::learned ? c.seq * D : 0;
      using K = weft::CommKind;
      if constexpr (!sp) {
        // all-reduce: embedding, 2 per block forward, head input gradient, 2 per block backward.
        CHECK(st[K::all_reduce].bytes == M * ((4 * L + 2) * nd + ce) + clip);
        CHECK(st[K::all_reduce].calls == M * (4 * L + 4) + 1);
        CHECK(st[K::all_gather].bytes == 0);
        CHECK(st[K::reduce_scatter].bytes == 0);
      } else {
        // all-gather: 2 per block forward + ln_f, 2 per block backward + embedding gradient.
        CHECK(st[K::all_gather].bytes == M * (4 * L + 2) * nd);
        CHECK(st[K::all_gather].calls == M * (4 * L + 2));
        // reduce-scatter: embedding + 2 per block forward, head + 2 per block backward.
        CHECK(st[K::reduce_scatter].bytes == M * (4 * L + 2) * nd);
        CHECK(st[K::reduce_scatter].calls == M * (4 * L + 2));
        // all-reduce: cross-entropy, the norms' (and positions') token-shard gradients per block and root.
        CHECK(st[K::all_reduce].bytes == M * (ce + (L * 2 * norm_params + norm_params + pos) * b) + clip);
        CHECK(st[K::all_reduce].calls == M * (2 + L + 1) + 1);
      }
    });
  }
}

TEST_CASE("sizes that tp does not divide are ConfigErrors naming the quantity, tp and the valid TP sizes") {
  auto& w = weft::test::world();
  if (w.size() < 2) return;
  const std::string tp = std::to_string(w.size());
  auto message = [&](GPTConfig c, bool sp) -> std::string {
    try {
      if (sp) weft::nn::GPT<float, SeqPar> g(c, w);
      else weft::nn::GPT<float, TPOnly> g(c, w);
    } catch (const weft::ConfigError& e) {
      return e.what();
    }
    return "no error";
  };
  GPTConfig c = gpt2_tiny();
  c.vocab = 33;
  auto m = message(c, false);
  INFO(m);
  CHECK(m.find("the vocabulary (--vocab) 33 is not divisible by tp " + tp) != std::string::npos);
  CHECK(m.find("weft does not pad or truncate") != std::string::npos);
  CHECK(m.find("TP sizes valid for this model: 1") != std::string::npos);
  c = gpt2_tiny();
  c.kv_heads = 1;
  m = message(c, false);
  CHECK(m.find("the key/value heads (--kv-heads) 1 is not divisible by tp " + tp) != std::string::npos);
  if (w.size() == 4) {
    c = gpt2_tiny();
    c.heads = 2;
    m = message(c, false);
    CHECK(m.find("the query heads (--heads) 2 is not divisible by tp 4") != std::string::npos);
    CHECK(m.find("TP sizes valid for this model: 1, 2") != std::string::npos);
    c = gpt2_tiny();
    c.ffn_hidden = 18;
    m = message(c, false);
    CHECK(m.find("the MLP hidden size 18 is not divisible by tp 4") != std::string::npos);
    c = gpt2_tiny();
    c.batch = 1;
    c.seq = 6;
    m = message(c, true);
    CHECK(m.find("the tokens of a microbatch") != std::string::npos);
    CHECK(m.find("6 is not divisible by tp 4") != std::string::npos);
  }
}

TEST_CASE("the planner's per-rank parameter count is what the split GPT holds, element for element") {
  auto& w = weft::test::world();
  for (const GPTConfig& c : {gpt2_tiny(), llama_tiny()}) {
    if (c.kv() % std::size_t(w.size()) != 0) continue;
    weft::Mesh<weft::TP> mesh(w, w.size());
    weft::nn::GPT<float, TPOnly> gpt(mesh, c);
    std::size_t held = 0;
    for (auto* p : gpt.parameters()) held += p->size();
    const weft::plan::ModelSpec m = weft::test::spec_of(c);
    weft::plan::MeshSpec s;
    s.tp = std::size_t(w.size());
    INFO("tp ", w.size(), " held ", held);
    CHECK(weft::plan::stage_params(m, s).total() == double(held));
  }
}

TEST_CASE("the strategy's checks: sequence parallelism needs tp > 1; a mesh's TP axis needs a TP policy") {
  auto& w = weft::test::world();
  // A DP x TP mesh whose TP axis has one rank.
  weft::Mesh<weft::DP, weft::TP> flat(w, w.size(), 1);
  const GPTConfig c = gpt2_tiny();
  try {
    weft::nn::GPT<float, SeqPar> g(flat, c);
    FAIL("no error");
  } catch (const weft::ConfigError& e) {
    const std::string m = e.what();
    INFO(m);
    CHECK(m.find("TensorParallel<SequenceParallel>: sequence parallelism shards the tokens over the TP ranks and "
                 "needs a TP axis of more than one rank") != std::string::npos);
    CHECK(m.find("(tp is 1)") != std::string::npos);
  }
  // TensorParallel<> on one TP rank is the single-process model.
  weft::nn::GPT<float, TPOnly> one(flat, c);
  CHECK(!one.tensor_parallel().active());
  if (w.size() == 1) return;
  weft::Mesh<weft::TP> split(w, w.size());
  try {
    weft::nn::GPT<float> g(split, c);
    FAIL("no error");
  } catch (const weft::ConfigError& e) {
    const std::string m = e.what();
    INFO(m);
    CHECK(m.find("the mesh's tp axis has extent " + std::to_string(w.size()) +
                 " but the strategy gives it no policy") != std::string::npos);
  }
}
