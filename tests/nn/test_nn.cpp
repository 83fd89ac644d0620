// weft's layers and the reference GPT: every layer's and the whole model's
// gradients against central finite differences in double precision (relative
// error <= 1e-6), GPT-2 shape and the options (RMSNorm, SwiGLU, rotary,
// grouped-query attention), recomputation giving bit-identical gradients,
// layout-independent initialisation, memory attribution and config errors.
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

constexpr double kTol = 1e-6;

nn::GPTConfig tiny() {
  nn::GPTConfig c;
  c.layers = 1;
  c.d_model = 8;
  c.heads = 2;
  c.seq = 4;
  c.batch = 2;
  c.vocab = 11;
  c.seed = 99;
  c.init_std = 0.3;  // large enough that attention is far from uniform
  return c;
}

// Checks d(loss)/d(p) for every parameter against `grads` taken before.
void check_params(const std::vector<Param*>& params, const std::map<std::string, std::vector<double>>& grads,
                  const std::function<double()>& loss) {
  for (auto* p : params) {
    CAPTURE(p->name());
    const double err = relative_error(grads.at(p->name()), numeric_gradient(p->value, loss));
    CHECK(err < kTol);
  }
}

std::map<std::string, std::vector<double>> grads_of(const std::vector<Param*>& params) {
  std::map<std::string, std::vector<double>> g;
  for (auto* p : params) g[p->name()] = to_vector(p->grad);
  return g;
}

void zero(const std::vector<Param*>& params) {
  for (auto* p : params) Kokkos::deep_copy(p->grad, 0.0);
}

TEST_CASE("Linear: gradients of input, weight and bias; accumulate_dx adds") {
  auto ctx = std::make_shared<nn::LayerContext>();
  nn::Linear<double, Space> lin(ctx, "lin", 3, 4, true, 5, 0.5);
  fill_uniform(lin.bias().value, 1);
  Mat x("x", 5, 3), y("y", 5, 4), w("w", 5, 4), dx("dx", 5, 3);
  fill_uniform(x, 2);
  fill_uniform(w, 3);
  auto loss = [&] {
    lin.forward(x, y);
    return weighted_sum(y, w);
  };
  std::vector<Param*> ps;
  lin.collect(ps);
  REQUIRE(ps.size() == 2);
  zero(ps);
  loss();
  lin.backward(x, w, dx);
  CHECK(relative_error(to_vector(dx), numeric_gradient(x, loss)) < kTol);
  check_params(ps, grads_of(ps), loss);
  Mat dx2("dx2", 5, 3);
  Kokkos::deep_copy(dx2, 1.0);
  lin.backward(x, w, dx2, true);
  const auto a = to_vector(dx), b = to_vector(dx2);
  for (std::size_t i = 0; i < a.size(); ++i) CHECK(b[i] == doctest::Approx(a[i] + 1).epsilon(1e-14));
  Mat none("none", 0, 3);
  lin.backward(x, w, none);  // no input gradient wanted: must not throw
}

struct LayerCase {
  const char* name;
  nn::NormKind norm;
  nn::MlpKind mlp;
  nn::PositionKind pos;
  std::size_t kv;
};
const LayerCase kCases[] = {
    {"gpt2", nn::NormKind::layernorm, nn::MlpKind::gelu, nn::PositionKind::learned, 0},
    {"rmsnorm+swiglu+rotary+gqa", nn::NormKind::rmsnorm, nn::MlpKind::swiglu, nn::PositionKind::rotary, 1},
};

nn::GPTConfig with(const LayerCase& lc) {
  auto c = tiny();
  c.norm = lc.norm;
  c.mlp = lc.mlp;
  c.position = lc.pos;
  c.kv_heads = lc.kv;
  return c;
}

TEST_CASE("Attention: causal, and its gradients match finite differences") {
  for (const auto& lc : kCases) {
    CAPTURE(lc.name);
    const auto c = with(lc);
    auto ctx = std::make_shared<nn::LayerContext>();
    nn::Attention<double, Space> attn(ctx, "attn", c);
    typename nn::Attention<double, Space>::Saved s("attn", c);
    typename nn::Attention<double, Space>::Workspace ws(c);
    std::vector<Param*> ps;
    attn.collect(ps);
    for (auto* p : ps)
      if (p->name().find("bias") != std::string::npos) fill_uniform(p->value, 4, -0.3, 0.3);
    Mat h("h", c.tokens(), c.d_model), out("out", c.tokens(), c.d_model), w("w", c.tokens(), c.d_model),
        dh("dh", c.tokens(), c.d_model);
    fill_uniform(h, 5);
    fill_uniform(w, 6);
    auto loss = [&] {
      attn.forward(h, s, out);
      return weighted_sum(out, w);
    };
    // Causality: changing the last token of sequence 0 leaves its earlier outputs alone.
    loss();
    const auto before = to_vector(out);
    auto hh = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), h);
    hh(c.seq - 1, 0) += 1.0;
    Kokkos::deep_copy(h, hh);
    loss();
    const auto after = to_vector(out);
    for (std::size_t i = 0; i < (c.seq - 1) * c.d_model; ++i) CHECK(after[i] == before[i]);
    CHECK(after[(c.seq - 1) * c.d_model] != before[(c.seq - 1) * c.d_model]);
    zero(ps);
    loss();
    attn.backward(h, s, w, dh, ws);
    CHECK(relative_error(to_vector(dh), numeric_gradient(h, loss)) < kTol);
    check_params(ps, grads_of(ps), loss);
  }
}

TEST_CASE("MLP (GELU and SwiGLU): gradients match finite differences") {
  for (const auto& lc : kCases) {
    CAPTURE(lc.name);
    const auto c = with(lc);
    auto ctx = std::make_shared<nn::LayerContext>();
    nn::MLP<double, Space> mlp(ctx, "mlp", c);
    typename nn::MLP<double, Space>::Saved s("mlp", c);
    typename nn::MLP<double, Space>::Workspace ws(c);
    std::vector<Param*> ps;
    mlp.collect(ps);
    Mat h("h", c.tokens(), c.d_model), out("out", c.tokens(), c.d_model), w("w", c.tokens(), c.d_model),
        dh("dh", c.tokens(), c.d_model);
    fill_uniform(h, 7);
    fill_uniform(w, 8);
    auto loss = [&] {
      mlp.forward(h, s, out);
      return weighted_sum(out, w);
    };
    zero(ps);
    loss();
    mlp.backward(h, s, w, dh, ws);
    CHECK(relative_error(to_vector(dh), numeric_gradient(h, loss)) < kTol);
    check_params(ps, grads_of(ps), loss);
  }
}

TEST_CASE("Block (with and without recompute): gradients match finite differences") {
  for (const auto& lc : kCases)
    for (bool rc : {false, true}) {
      CAPTURE(lc.name);
      CAPTURE(rc);
      auto c = with(lc);
      c.recompute = rc;
      auto ctx = std::make_shared<nn::LayerContext>();
      auto saved = std::make_shared<nn::Block<double, Space>::Saved>("b", c);
      auto ws = std::make_shared<nn::Block<double, Space>::Workspace>(c);
      nn::Block<double, Space> blk(ctx, 0, c, saved, ws);
      std::vector<Param*> ps;
      blk.collect(ps);
      Mat x("x", c.tokens(), c.d_model), y("y", c.tokens(), c.d_model), w("w", c.tokens(), c.d_model),
          dx("dx", c.tokens(), c.d_model);
      fill_uniform(x, 9);
      fill_uniform(w, 10);
      auto loss = [&] {
        blk.forward(x, y);
        return weighted_sum(y, w);
      };
      zero(ps);
      loss();
      if (rc) saved->holder = -1;  // as if another block had overwritten the shared activations
      blk.backward(x, w, dx);
      CHECK(relative_error(to_vector(dx), numeric_gradient(x, loss)) < kTol);
      check_params(ps, grads_of(ps), loss);
    }
}

template <class V>
ops::Tokens<Space> tokens(const std::string& label, const V& values) {
  ops::Tokens<Space> t(label, values.size());
  auto h = Kokkos::create_mirror_view(t);
  for (std::size_t i = 0; i < values.size(); ++i) h(i) = values[i];
  Kokkos::deep_copy(t, h);
  return t;
}

std::vector<int> ids_for(const nn::GPTConfig& c, int salt) {
  std::vector<int> v(c.tokens());
  for (std::size_t i = 0; i < v.size(); ++i) v[i] = int((i * 7 + std::size_t(salt) * 3 + i * i) % c.vocab);
  return v;
}

TEST_CASE("GPT: whole-model gradients match finite differences") {
  for (const auto& lc : kCases) {
    CAPTURE(lc.name);
    auto c = with(lc);
    c.layers = 2;
    nn::GPT<double, SingleProcess, Space> gpt(c);
    auto ps = gpt.parameters();
    for (auto* p : ps)
      if (p->name().find("bias") != std::string::npos || p->name().find("ln") != std::string::npos)
        fill_uniform(p->value, 11, 0.5, 1.0);  // non-trivial biases and norm scales
    auto ids = tokens("ids", ids_for(c, 0)), tgt = tokens("targets", ids_for(c, 1));
    gpt.zero_grad();
    const double l0 = gpt.forward_backward(ids, tgt);
    CHECK(l0 == doctest::Approx(gpt.loss(ids, tgt)).epsilon(1e-14));
    check_params(ps, grads_of(ps), [&] { return gpt.loss(ids, tgt); });
  }
}

TEST_CASE("GPT: recompute gives bit-identical losses and gradients, with less activation memory") {
  auto c = tiny();
  c.layers = 3;
  nn::GPT<float, SingleProcess, Space> a(c);
  c.recompute = true;
  nn::GPT<float, SingleProcess, Space> b(c);
  auto ids = ops::Tokens<Space>("ids", c.tokens());
  auto tgt = ops::Tokens<Space>("tgt", c.tokens());
  {
    auto h1 = Kokkos::create_mirror_view(ids);
    auto h2 = Kokkos::create_mirror_view(tgt);
    const auto v1 = ids_for(c, 2), v2 = ids_for(c, 3);
    for (std::size_t i = 0; i < c.tokens(); ++i) h1(i) = v1[i], h2(i) = v2[i];
    Kokkos::deep_copy(ids, h1);
    Kokkos::deep_copy(tgt, h2);
  }
  a.zero_grad();
  b.zero_grad();
  CHECK(a.forward_backward(ids, tgt) == b.forward_backward(ids, tgt));
  auto pa = a.parameters(), pb = b.parameters();
  REQUIRE(pa.size() == pb.size());
  for (std::size_t i = 0; i < pa.size(); ++i) {
    CAPTURE(pa[i]->name());
    CHECK(to_vector(pa[i]->grad) == to_vector(pb[i]->grad));
  }
  using C = metrics::MemoryCategory;
  CHECK(b.memory().bytes(C::activations) < a.memory().bytes(C::activations));
  CHECK(b.memory().bytes(C::parameters) == a.memory().bytes(C::parameters));
}

TEST_CASE("GPT: the automatic attention kernel keeps BLAS until the probabilities pass the budget; both give the same loss") {
  auto c = tiny();
  c.layers = 2;
  const double probs = double(c.batch * c.heads * c.seq * c.seq * sizeof(double));  // one block's [B H, T, T]
  CHECK_FALSE(nn::detail::use_blockwise_attention<double>(c));  // far under the 1 GiB default
  c.attention_budget = probs;                                     // at the budget: still BLAS
  CHECK_FALSE(nn::detail::use_blockwise_attention<double>(c));
  nn::GPT<double, SingleProcess, Space> blas(c);
  c.attention_budget = probs - 1;                                 // one byte over it: blockwise
  CHECK(nn::detail::use_blockwise_attention<double>(c));
  nn::GPT<double, SingleProcess, Space> blockwise(c);
  c.attention_budget = 0;
  c.attention = nn::AttentionKernel::blas;  // an explicit choice overrides the budget
  CHECK_FALSE(nn::detail::use_blockwise_attention<double>(c));
  c.attention = nn::AttentionKernel::blockwise;
  c.attention_budget = 1e30;
  CHECK(nn::detail::use_blockwise_attention<double>(c));
  auto ids = ops::Tokens<Space>("ids", c.tokens());
  auto tgt = ops::Tokens<Space>("tgt", c.tokens());
  {
    auto h1 = Kokkos::create_mirror_view(ids);
    auto h2 = Kokkos::create_mirror_view(tgt);
    const auto v1 = ids_for(c, 4), v2 = ids_for(c, 5);
    for (std::size_t i = 0; i < c.tokens(); ++i) h1(i) = v1[i], h2(i) = v2[i];
    Kokkos::deep_copy(ids, h1);
    Kokkos::deep_copy(tgt, h2);
  }
  blas.zero_grad();
  blockwise.zero_grad();
  const double la = blas.forward_backward(ids, tgt), lb = blockwise.forward_backward(ids, tgt);
  CHECK(std::fabs(la - lb) <= 1e-12 * std::fabs(la));
  auto pa = blas.parameters(), pb = blockwise.parameters();
  for (std::size_t i = 0; i < pa.size(); ++i) {
    CAPTURE(pa[i]->name());
    CHECK(relative_error(to_vector(pa[i]->grad), to_vector(pb[i]->grad)) <= 1e-10);
  }
  using C = metrics::MemoryCategory;
  // The blockwise model holds no probabilities: two blocks' [B H, T, T] less, and no dprobs scratch.
  CHECK(double(blas.memory().bytes(C::activations) - blockwise.memory().bytes(C::activations)) == 2 * probs);
  CHECK(double(blas.memory().bytes(C::buffers) - blockwise.memory().bytes(C::buffers)) == probs);
}

TEST_CASE("GPT: initialisation depends on (seed, name, index) only, not on the batch") {
  auto c = tiny();
  nn::GPT<double, SingleProcess, Space> a(c);
  c.batch = 3;
  nn::GPT<double, SingleProcess, Space> b(c);
  auto pa = a.parameters(), pb = b.parameters();
  for (std::size_t i = 0; i < pa.size(); ++i) CHECK(to_vector(pa[i]->value) == to_vector(pb[i]->value));
  // A parameter is exactly init_normal of its name; its residual projection is scaled down.
  Param* qkv = nullptr;
  Param* proj = nullptr;
  for (auto* p : pa) {
    if (p->name() == "blocks.0.attn.qkv.weight") qkv = p;
    if (p->name() == "blocks.0.attn.proj.weight") proj = p;
  }
  REQUIRE(qkv);
  REQUIRE(proj);
  Mat ref("ref", qkv->rows(), qkv->cols());
  ops::init_normal(ref, c.seed, "blocks.0.attn.qkv.weight", c.init_std);
  CHECK(to_vector(ref) == to_vector(qkv->value));
  Mat ref2("ref2", proj->rows(), proj->cols());
  ops::init_normal(ref2, c.seed, "blocks.0.attn.proj.weight", c.init_std / std::sqrt(2.0 * double(c.layers)));
  CHECK(to_vector(ref2) == to_vector(proj->value));
  c.seed += 1;
  nn::GPT<double, SingleProcess, Space> d(c);
  CHECK(to_vector(d.parameters()[0]->value) != to_vector(pa[0]->value));
}

TEST_CASE("GPT: parameter count, model FLOPs formula and memory categories") {
  nn::GPTConfig c;  // GPT-2 shaped defaults
  c.layers = 2;
  c.d_model = 16;
  c.heads = 4;
  c.seq = 8;
  c.batch = 2;
  c.vocab = 32;
  const double L = 2, D = 16, V = 32, T = 8;
  CHECK(c.matmul_params() == 12 * L * D * D + D * V);
  CHECK(c.flops_per_token() == 6 * (12 * L * D * D + D * V) + 12 * L * T * D);
  nn::GPT<float, SingleProcess, Space> gpt(c);
  // Embeddings V*D + T*D; per block 2 norms (4D), qkv D*3D+3D, proj D*D+D, up D*4D+4D, down 4D*D+D; ln_f 2D; head D*V.
  const std::size_t per_block = 4 * 16 + (16 * 48 + 48) + (16 * 16 + 16) + (16 * 64 + 64) + (64 * 16 + 16);
  CHECK(gpt.num_parameters() == 32 * 16 + 8 * 16 + 2 * per_block + 2 * 16 + 16 * 32);
  auto m = gpt.memory();
  using C = metrics::MemoryCategory;
  CHECK(m.bytes(C::parameters) == gpt.num_parameters() * sizeof(float));
  CHECK(m.bytes(C::gradients) == m.bytes(C::parameters));
  CHECK(m.bytes(C::activations) > 0);
  CHECK(m.bytes(C::buffers) > 0);
  CHECK(m.total() == m.bytes(C::parameters) + m.bytes(C::gradients) + m.bytes(C::activations) + m.bytes(C::buffers));
}

TEST_CASE("GPT config errors name the flag and the value") {
  auto expect = [](nn::GPTConfig c, const std::string& needle) {
    try {
      c.validate();
      FAIL("no error for ", needle);
    } catch (const ConfigError& e) {
      CHECK_MESSAGE(std::string(e.what()).find(needle) != std::string::npos, e.what());
    }
  };
  auto c = tiny();
  c.heads = 3;
  expect(c, "--heads 3 does not divide --d-model 8");
  c = tiny();
  c.layers = 0;
  expect(c, "--layers is 0");
  c = tiny();
  c.kv_heads = 3;
  c.heads = 2;
  expect(c, "--kv-heads 3");
  c = tiny();
  c.d_model = 6;
  c.heads = 2;
  c.position = nn::PositionKind::rotary;
  expect(c, "even head dimension");
  c = tiny();
  CHECK_THROWS_AS(nn::GPT<float>([&] { auto x = c; x.vocab = 0; return x; }()), ConfigError);
  nn::GPT<float> g(c);
  ops::Tokens<> short_ids("ids", 3);
  CHECK_THROWS_AS(g.loss(short_ids, short_ids), ShapeError);
}

}  // namespace
