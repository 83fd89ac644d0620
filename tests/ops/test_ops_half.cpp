// Every kernel weft owns, run on bf16 (and some on fp16) views against the
// same kernel on fp32 views, and the backward kernels' gradients in mixed
// precision against double-precision finite differences.
//
// The forward bound, and why it holds. Each comparison feeds the 2-byte run
// and the fp32 run the same input values: inputs are drawn, rounded to the
// 2-byte type, and the fp32 run gets them widened (exactly). For 2-byte
// views a kernel computes in float (ops::detail::compute_t) with the same
// operations in the same order as for fp32 views, and rounds each output
// element once, so each 2-byte output is the fp32 output rounded to nearest:
//
//   |y16 - y32| <= ulp16(y32) / 2      (at most 2^-8 |y32| for bf16, 2^-11 for fp16)
//
// where ulp16 is the spacing of the 2-byte type in y32's binade (the
// relative bounds are the unit roundoffs 2^-p, p = 8 and 11 significant
// bits, reached at the bottom of a binade), and every
// output kept in float (norm statistics, the log-sum-exp, parameter
// gradients, losses) equals the fp32 one bit for bit. A kernel that rounded
// an intermediate to 2 bytes (a double rounding) or accumulated in bf16
// breaks the bound: "the bounds are not vacuous" computes such variants and
// checks that they exceed it. Where a kernel deliberately reads back a value
// it stored in 2 bytes, the test adds that value's rounding times the
// function's slope (bias_gelu_forward).
//
// The gradient bound. A gradient stored in bf16 differs from the exact one
// by its rounding (2^-8 relative, norm-wise), float arithmetic (relative
// 2e-5 covers sums of a few hundred terms at 2^-24 each, and fast_exp's 2
// ulp) and the finite differences themselves (< 1e-6, as test_ops checks in
// double). Softmax and attention backward passes read the forward's rounded
// output (P, O) as the model does; that rounding's effect is computed
// exactly, in double, by running the double kernel with the rounded and
// with the exact output, and added to the tolerance.
#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include <weft/serve/decode.hpp>

#include "gradcheck.hpp"

namespace {

using namespace weft;
using weft::test::fill_uniform;
using weft::test::numeric_gradient;
using weft::test::relative_error;
using weft::test::to_vector;
using weft::test::weighted_sum;
using Space = Kokkos::DefaultExecutionSpace;
template <class T>
using Mat = ops::Matrix<T, Space>;
template <class T>
using Vec = ops::Vector<T, Space>;
template <class T>
using Ten = ops::Tensor3<T, Space>;

/// float arithmetic and finite differences, relative (see the header).
constexpr double kFloatTol = 2e-5;
/// bf16's rounding, relative: its unit roundoff, half an ulp at 8
/// significant bits relative to the bottom of a binade.
constexpr double kBf16Rounding = 1.0 / 256;

/// Half the spacing of H's values in the binade of v (subnormal spacing
/// below H's smallest normal): the largest error of rounding v to H.
template <class H>
double half_ulp(double v) {
  v = std::abs(v);
  if (v == 0) return 0;
  int e = 0;
  std::frexp(v, &e);  // v = m 2^e, m in [0.5, 1): v's binade starts at 2^(e - 1)
  const int binade = std::max(e - 1, std::numeric_limits<H>::min_exponent - 1);
  return std::ldexp(1.0, binade - std::numeric_limits<H>::digits);
}

/// max_i |got_i - ref_i| / bound_i with bound_i = half_ulp(|ref_i| + extra_i)
/// + extra_i: <= 1 when every element is within its bound (0 / 0 counts 0).
template <class H>
double worst_ratio(const std::vector<double>& got, const std::vector<double>& ref,
                   const std::vector<double>& extra = {}) {
  REQUIRE(got.size() == ref.size());
  double worst = 0;
  for (std::size_t i = 0; i < got.size(); ++i) {
    const double x = extra.empty() ? 0.0 : extra[i];
    const double bound = half_ulp<H>(std::abs(ref[i]) + x) + x, err = std::abs(got[i] - ref[i]);
    if (err == 0) continue;
    worst = std::max(worst, bound > 0 ? err / bound : std::numeric_limits<double>::infinity());
  }
  return worst;
}

/// Every 2-byte element of `got` is fp32's `ref` rounded once (the bound above).
template <class H, class GV, class RV>
void require_rounded_once(const GV& got, const RV& ref, const char* what) {
  const double r = worst_ratio<H>(to_vector(got), to_vector(ref));
  INFO(what << ": worst error " << r << " half-ulps");
  CHECK(r <= 1.0);
}

/// Float outputs computed from the same values: bit for bit.
template <class AV, class BV>
void require_identical(const AV& a, const BV& b, const char* what) {
  INFO(what);
  CHECK(to_vector(a) == to_vector(b));
}

/// A view of H with values uniform in [lo, hi), and f (a float or double
/// view of the same shape) set to the same values, widened.
template <class H, class FV>
auto rounded(const FV& f, std::uint64_t seed, double lo = -1.0, double hi = 1.0) {
  fill_uniform(f, seed, lo, hi);
  auto h = converted<H>(f, f.label() + ".half");
  convert(f, h);
  Kokkos::fence();
  return h;
}

/// A view of T with v's values (widened, exactly).
template <class T, class V>
auto widened(const V& v) {
  auto w = converted<T>(v, v.label() + ".wide");
  Kokkos::fence();
  return w;
}

// ------------------------------------------------------------------ forward

TEST_CASE_TEMPLATE("norms on 2-byte views round the fp32 result once; statistics and gradients stay fp32", H, bf16,
                   fp16) {
  const std::size_t R = 9, D = 100;
  Mat<float> x("x", R, D), dy("dy", R, D), y("y", R, D), dx("dx", R, D);
  Vec<float> g("g", D), b("b", D), mean("mean", R), rstd("rstd", R), dg("dg", D), db("db", D);
  const auto x16 = rounded<H>(x, 1, -1.0, 3.0);  // a mean far from 0: the two-pass variance matters
  const auto dy16 = rounded<H>(dy, 2);
  fill_uniform(g, 3, 0.5, 1.5);
  fill_uniform(b, 4);
  Mat<H> y16("y16", R, D), dx16("dx16", R, D);
  Vec<float> mean16("mean16", R), rstd16("rstd16", R), dg16("dg16", D), db16("db16", D);

  ops::layernorm_forward(x, g, b, 1e-5f, y, mean, rstd);
  ops::layernorm_forward(x16, g, b, 1e-5f, y16, mean16, rstd16);
  require_rounded_once<H>(y16, y, "layernorm y");
  require_identical(mean16, mean, "layernorm mean");
  require_identical(rstd16, rstd, "layernorm rstd");
  ops::layernorm_backward(dy, x, g, mean, rstd, dx, false, dg, db);
  ops::layernorm_backward(dy16, x16, g, mean16, rstd16, dx16, false, dg16, db16);
  require_rounded_once<H>(dx16, dx, "layernorm dx");
  require_identical(dg16, dg, "layernorm dgamma (float under 2-byte activations)");
  require_identical(db16, db, "layernorm dbeta");
  // Accumulating into a 2-byte dx: one rounding of (dx + d/dx), computed in float.
  const auto dxw = widened<float>(dx16);
  ops::layernorm_backward(dy, x, g, mean, rstd, dxw, true, dg, db);
  ops::layernorm_backward(dy16, x16, g, mean16, rstd16, dx16, true, dg16, db16);
  require_rounded_once<H>(dx16, dxw, "layernorm dx, accumulated");

  ops::rmsnorm_forward(x, g, 1e-5f, y, rstd);
  ops::rmsnorm_forward(x16, g, 1e-5f, y16, rstd16);
  require_rounded_once<H>(y16, y, "rmsnorm y");
  require_identical(rstd16, rstd, "rmsnorm rstd");
  ops::rmsnorm_backward(dy, x, g, rstd, dx, false, dg);
  ops::rmsnorm_backward(dy16, x16, g, rstd16, dx16, false, dg16);
  require_rounded_once<H>(dx16, dx, "rmsnorm dx");
  require_identical(dg16, dg, "rmsnorm dgamma");
}

TEST_CASE("GELU, SwiGLU, bias and residual kernels on bf16 views round the fp32 result once") {
  using H = bf16;
  const std::size_t R = 7, F = 70;
  Mat<float> x("x", R, F), dy("dy", R, F), y("y", R, F), dx("dx", R, F);
  const auto x16 = rounded<H>(x, 5, -4.0, 4.0);
  const auto dy16 = rounded<H>(dy, 6);
  Mat<H> y16("y16", R, F), dx16("dx16", R, F);
  ops::gelu_forward(x, y);
  ops::gelu_forward(x16, y16);
  require_rounded_once<H>(y16, y, "gelu");
  ops::gelu_backward(dy, x, dx);
  ops::gelu_backward(dy16, x16, dx16);
  require_rounded_once<H>(dx16, dx, "gelu backward");

  // bias_add and add read a 2-byte y and a float bias; one rounding of the float sum.
  Vec<float> b("b", F), db("db", F), db16("db16", F);
  fill_uniform(b, 7);
  auto yw = widened<float>(y16);
  ops::bias_add(yw, b);
  ops::bias_add(y16, b);
  require_rounded_once<H>(y16, yw, "bias_add");
  ops::add(yw, x, dy);
  ops::add(y16, x16, dy16);
  require_rounded_once<H>(y16, yw, "add");
  ops::bias_backward(dy, db);
  ops::bias_backward(dy16, db16);
  require_identical(db16, db, "bias gradient (float) from bf16 dy");

  // bias_gelu_forward stores the biased pre-activation u (rounded) and takes
  // the GELU of that stored value, as the backward pass will read it: the
  // bound adds u's rounding times GELU's largest slope (1.13 < 1.2).
  Mat<float> u("u", R, F), act("act", R, F);
  const auto u16 = rounded<H>(u, 8, -4.0, 4.0);
  Mat<H> act16("act16", R, F);
  ops::bias_gelu_forward(u, b, act);
  ops::bias_gelu_forward(u16, b, act16);
  require_rounded_once<H>(u16, u, "bias_gelu u");
  {
    const auto uv = to_vector(u);
    std::vector<double> extra(uv.size());
    for (std::size_t i = 0; i < uv.size(); ++i) extra[i] = 1.2 * half_ulp<H>(uv[i]);
    const double r = worst_ratio<H>(to_vector(act16), to_vector(act), extra);
    INFO("bias_gelu act: " << r);
    CHECK(r <= 1.0);
  }
  // The backward reads the stored u16: the fp32 run reads the same values.
  const auto uw = widened<float>(u16);
  Mat<H> du16("du16", R, F);
  Mat<float> du("du", R, F);
  ops::bias_gelu_backward(dy, uw, du, db);
  ops::bias_gelu_backward(dy16, u16, du16, db16);
  require_rounded_once<H>(du16, du, "bias_gelu backward");
  require_identical(db16, db, "bias_gelu bias gradient (float, from unrounded terms)");

  Mat<float> s("s", R, 2 * F), sy("sy", R, F), ds("ds", R, 2 * F);
  const auto s16 = rounded<H>(s, 9, -3.0, 3.0);
  Mat<H> sy16("sy16", R, F), ds16("ds16", R, 2 * F);
  ops::swiglu_forward(s, sy);
  ops::swiglu_forward(s16, sy16);
  require_rounded_once<H>(sy16, sy, "swiglu");
  ops::swiglu_backward(dy, s, ds);
  ops::swiglu_backward(dy16, s16, ds16);
  require_rounded_once<H>(ds16, ds, "swiglu backward");
}

TEST_CASE_TEMPLATE("softmax on 2-byte scores rounds each probability once; the log-sum-exp stays fp32", H, bf16,
                   fp16) {
  const std::size_t B = 3, TQ = 20, TK = 70;
  Ten<float> S("S", B, TQ, TK), P("P", B, TQ, TK), dP("dP", B, TQ, TK), dS("dS", B, TQ, TK);
  const auto S16 = rounded<H>(S, 10, -6.0, 6.0);
  const auto dP16 = rounded<H>(dP, 11);
  Mat<float> lse("lse", B, TQ), lse16("lse16", B, TQ);
  Ten<H> P16("P16", B, TQ, TK), dS16("dS16", B, TQ, TK);
  for (bool causal : {false, true}) {
    ops::softmax_forward(S, 0.7f, causal, P, lse);
    ops::softmax_forward(S16, 0.7f, causal, P16, lse16);
    require_rounded_once<H>(P16, P, "softmax P");
    require_identical(lse16, lse, "softmax lse");
    const auto Pw = widened<float>(P16);  // the backward reads the stored probabilities
    ops::softmax_backward(Pw, dP, 0.7f, dS, causal);
    ops::softmax_backward(P16, dP16, 0.7f, dS16, causal);
    require_rounded_once<H>(dS16, dS, "softmax backward");
  }
  // In place (P = S, dS = dP), as the attention layer calls it.
  auto Sc = widened<float>(S16);
  auto Sc16 = converted<H>(S16, "Sc16");
  ops::softmax_forward(Sc, 0.7f, true, Sc, lse);
  ops::softmax_forward(Sc16, 0.7f, true, Sc16, lse16);
  require_rounded_once<H>(Sc16, Sc, "softmax in place");
  require_identical(lse16, lse, "softmax in place lse");
}

TEST_CASE("rotary positions on bf16 heads round each rotated feature once") {
  using H = bf16;
  Mat<float> X("X", 12, 80);
  auto X16 = rounded<H>(X, 12, -2.0, 2.0);
  const ops::RotarySpec spec{.col_begin = 8, .heads = 3, .head_dim = 16, .seq = 6, .offset = 5};
  ops::rotary_apply(X, spec);
  ops::rotary_apply(X16, spec);
  require_rounded_once<H>(X16, X, "rotary");
  auto Xw = widened<float>(X16);
  ops::rotary_apply(Xw, spec, true);
  ops::rotary_apply(X16, spec, true);
  require_rounded_once<H>(X16, Xw, "rotary inverse");
}

TEST_CASE("cross-entropy on bf16 logits: the loss is the fp32 loss, the gradient rounded once") {
  using H = bf16;
  const std::size_t R = 11, V = 300;
  Mat<float> z("z", R, V);
  auto z16 = rounded<H>(z, 13, -5.0, 5.0);
  ops::Tokens<Space> t("t", R);
  {
    auto h = Kokkos::create_mirror_view(t);
    for (std::size_t i = 0; i < R; ++i) h(i) = int((i * 37 + 3) % V);
    Kokkos::deep_copy(t, h);
  }
  CHECK(ops::cross_entropy_forward(z16, t) == ops::cross_entropy_forward(z, t));
  // Vocabulary-parallel pieces over bf16 logits with float statistics.
  Vec<float> m("m", R), m16("m16", R);
  Kokkos::View<float**, Space> st("st", R, 2), st16("st16", R, 2);
  ops::vocab_parallel_max(z, m);
  ops::vocab_parallel_max(z16, m16);
  ops::vocab_parallel_sums(z, t, 0, V, m, st);
  ops::vocab_parallel_sums(z16, t, 0, V, m16, st16);
  require_identical(m16, m, "vocab_parallel_max");
  require_identical(st16, st, "vocab_parallel_sums");
  auto zc = widened<float>(z16);
  auto zc16 = converted<H>(z16, "zc16");
  CHECK(ops::vocab_parallel_finish(zc16, t, 0, m16, st16, 1.0f / R, true) ==
        ops::vocab_parallel_finish(zc, t, 0, m, st, 1.0f / R, true));
  require_rounded_once<H>(zc16, zc, "vocab_parallel_finish gradient");

  const double loss = ops::cross_entropy_forward_backward(z, t, 1.0f / R);
  CHECK(ops::cross_entropy_forward_backward(z16, t, 1.0f / R) == loss);
  require_rounded_once<H>(z16, z, "cross-entropy gradient");
}

TEST_CASE("embeddings: bf16 lookups round the float table once, scatters accumulate into float gradients") {
  using H = bf16;
  const std::size_t N = 13, D = 40, VOC = 50;
  Mat<float> W("W", VOC, D), y("y", N, D), dy("dy", N, D), dW("dW", VOC, D), dW16("dW16", VOC, D);
  fill_uniform(W, 14);
  const auto dy16 = rounded<H>(dy, 15);
  ops::Tokens<Space> ids("ids", N);
  {
    auto h = Kokkos::create_mirror_view(ids);
    for (std::size_t i = 0; i < N; ++i) h(i) = int((i * 7) % 11);  // repeated ids: the scatter adds up
    Kokkos::deep_copy(ids, h);
  }
  Mat<H> y16("y16", N, D);
  ops::embedding_forward(W, ids, y);
  ops::embedding_forward(W, ids, y16);
  require_rounded_once<H>(y16, y, "embedding lookup");
  auto yw = widened<float>(y16);
  Mat<float> P("P", 20, D);
  fill_uniform(P, 16);
  ops::position_forward(P, 13, 2, yw);
  ops::position_forward(P, 13, 2, y16);
  require_rounded_once<H>(y16, yw, "positions added");
  ops::embedding_backward(dy, ids, dW);
  ops::embedding_backward(dy16, ids, dW16);
  require_identical(dW16, dW, "embedding gradient (float) from bf16 dy");
  Mat<float> dP("dP", 20, D), dP16("dP16", 20, D);
  ops::position_backward(dy, 13, 2, dP);
  ops::position_backward(dy16, 13, 2, dP16);
  require_identical(dP16, dP, "position gradient");
  // A bf16 compute copy of the table: the lookup is an exact copy.
  const auto W16 = converted<H>(W, "W16");
  ops::vocab_embedding_forward(W16, ids, 0, VOC, y16);
  ops::vocab_embedding_forward(widened<float>(W16), ids, 0, VOC, y);
  require_identical(y16, y, "bf16 table lookup");
}

TEST_CASE("flash attention on bf16 heads: outputs and gradients rounded once, the log-sum-exp fp32") {
  using H = bf16;
  const std::size_t HQ = 4, HK = 2, TQ = 19, TK = 70, HD = 24;  // grouped heads; keys past one block of 64
  Ten<float> Q("Q", HQ, TQ, HD), K("K", HK, TK, HD), V("V", HK, TK, HD), dO("dO", HQ, TQ, HD), O("O", HQ, TQ, HD);
  const auto Q16 = rounded<H>(Q, 17), K16 = rounded<H>(K, 18), V16 = rounded<H>(V, 19), dO16 = rounded<H>(dO, 20);
  Ten<H> O16("O16", HQ, TQ, HD), dQ16("dQ16", HQ, TQ, HD), dK16("dK16", HK, TK, HD), dV16("dV16", HK, TK, HD);
  Ten<float> dQ("dQ", HQ, TQ, HD), dK("dK", HK, TK, HD), dV("dV", HK, TK, HD);
  Mat<float> lse("lse", HQ, TQ), lse16("lse16", HQ, TQ);
  const float scale = 0.3f;
  ops::flash_attention_forward(Q, K, V, scale, true, O, lse);
  ops::flash_attention_forward(Q16, K16, V16, scale, true, O16, lse16);
  require_rounded_once<H>(O16, O, "flash O");
  require_identical(lse16, lse, "flash lse");
  const auto Ow = widened<float>(O16);  // the backward reads the stored output
  ops::flash_attention_backward(Q, K, V, Ow, dO, lse, scale, true, dQ, dK, dV);
  ops::flash_attention_backward(Q16, K16, V16, O16, dO16, lse16, scale, true, dQ16, dK16, dV16);
  require_rounded_once<H>(dQ16, dQ, "flash dQ");
  require_rounded_once<H>(dK16, dK, "flash dK (accumulated over the group in float)");
  require_rounded_once<H>(dV16, dV, "flash dV");
}

TEST_CASE("serving decode kernels on a bf16 KV cache round each stored element once") {
  using H = bf16;
  const std::size_t HQ = 4, HK = 2, HD = 16, W = (HQ + 2 * HK) * HD, BS = 4;
  // Two sequences prefilled in one pass: 9 and 20 tokens (past one tile of 16).
  const std::vector<int> len{9, 20};
  const std::size_t N = 29;
  serve::DecodeTokens<Space> tok{ops::Tokens<Space>("pos", N), ops::Tokens<Space>("seq", N),
                                 Kokkos::View<int**, Kokkos::LayoutRight, Space>("tables", 2, 5), N};
  {
    auto p = Kokkos::create_mirror_view(tok.positions);
    auto s = Kokkos::create_mirror_view(tok.seqs);
    auto t = Kokkos::create_mirror_view(tok.tables);
    std::size_t r = 0;
    for (int q = 0; q < 2; ++q)
      for (int i = 0; i < len[std::size_t(q)]; ++i, ++r) {
        p(r) = i;
        s(r) = q;
      }
    const int blocks[2][5] = {{6, 1, 3, -1, -1}, {0, 7, 2, 5, 4}};  // out of order
    for (int q = 0; q < 2; ++q)
      for (int k = 0; k < 5; ++k) t(q, k) = blocks[q][k];
    Kokkos::deep_copy(tok.positions, p);
    Kokkos::deep_copy(tok.seqs, s);
    Kokkos::deep_copy(tok.tables, t);
  }
  const serve::DecodeHeads hs{HD, HQ, HK, HQ * HD};
  Mat<float> qkv("qkv", N, W), out("out", N, HQ * HD);
  auto qkv16 = rounded<H>(qkv, 21, -2.0, 2.0);
  Mat<H> out16("out16", N, HQ * HD);
  serve::decode_rotary(qkv, tok, hs, 10000.0);
  serve::decode_rotary(qkv16, tok, hs, 10000.0);
  require_rounded_once<H>(qkv16, qkv, "decode rotary");
  const auto q32 = widened<float>(qkv16);  // the float pass continues from the same values
  using Pool32 = Kokkos::View<float****, Kokkos::LayoutRight, Space>;
  using Pool16 = Kokkos::View<H****, Kokkos::LayoutRight, Space>;
  Pool32 K("K", 1, 8, BS, HK * HD), V("V", 1, 8, BS, HK * HD);
  Pool16 K16("K16", 1, 8, BS, HK * HD), V16("V16", 1, 8, BS, HK * HD);
  serve::decode_store_kv(q32, tok, hs, K, V, 0);
  serve::decode_store_kv(qkv16, tok, hs, K16, V16, 0);
  require_identical(K16, K, "cached keys (bf16 values stored exactly)");
  serve::decode_attention(q32, tok, hs, K, V, 0, out);
  serve::decode_attention(qkv16, tok, hs, K16, V16, 0, out16);
  require_rounded_once<H>(out16, out, "decode attention");
  // A float output from the bf16 cache: nothing rounded at all.
  Mat<float> outf("outf", N, HQ * HD);
  serve::decode_attention(qkv16, tok, hs, K16, V16, 0, outf);
  require_identical(outf, out, "decode attention, float output from a bf16 cache");
}

// -------------------------------------------------------- the bound bites

TEST_CASE("the bounds are not vacuous: a double rounding or a bf16 accumulation exceeds them") {
  using H = bf16;
  // Softmax rounding the exponentials to bf16 before normalising (two
  // roundings per probability): some probabilities leave the half-ulp bound.
  const std::size_t B = 2, TQ = 16, TK = 64;
  Ten<float> S("S", B, TQ, TK), P("P", B, TQ, TK);
  Mat<float> lse("lse", B, TQ);
  rounded<H>(S, 22, -6.0, 6.0);
  ops::softmax_forward(S, 1.0f, false, P, lse);
  const auto s = to_vector(S);
  std::vector<double> bad(s.size());
  for (std::size_t r = 0; r < B * TQ; ++r) {
    float mx = -1e30f, sum = 0;
    for (std::size_t j = 0; j < TK; ++j) mx = std::max(mx, float(s[r * TK + j]));
    std::vector<float> e(TK);
    for (std::size_t j = 0; j < TK; ++j) sum += (e[j] = std::exp(float(s[r * TK + j]) - mx));
    for (std::size_t j = 0; j < TK; ++j) bad[r * TK + j] = float(H(float(H(e[j])) * (1.0f / sum)));
  }
  const double softmax_ratio = worst_ratio<H>(bad, to_vector(P));
  INFO("double-rounded softmax: " << softmax_ratio << " half-ulps");
  CHECK(softmax_ratio > 1.0);

  // Layernorm whose row sums are accumulated in bf16 (the running sum
  // rounded after each add): far outside the bound.
  const std::size_t R = 4, D = 256;
  Mat<float> x("x", R, D), y("y", R, D);
  Vec<float> g("g", D), b("b", D), mean("mean", R), rstd("rstd", R);
  Kokkos::deep_copy(g, 1.0f);
  rounded<H>(x, 23, 1.0, 3.0);
  ops::layernorm_forward(x, g, b, 1e-5f, y, mean, rstd);
  const auto xv = to_vector(x);
  std::vector<double> ybad(xv.size());
  for (std::size_t i = 0; i < R; ++i) {
    H s1(0.0f), s2(0.0f);
    for (std::size_t j = 0; j < D; ++j) s1 = H(float(s1) + float(xv[i * D + j]));
    const float mu = float(s1) / float(D);
    for (std::size_t j = 0; j < D; ++j) {
      const float c = float(xv[i * D + j]) - mu;
      s2 = H(float(s2) + c * c);
    }
    const float r = 1.0f / std::sqrt(float(s2) / float(D) + 1e-5f);
    for (std::size_t j = 0; j < D; ++j) ybad[i * D + j] = float(H((float(xv[i * D + j]) - mu) * r));
  }
  const double norm_ratio = worst_ratio<H>(ybad, to_vector(y));
  INFO("layernorm accumulated in bf16: " << norm_ratio << " half-ulps");
  CHECK(norm_ratio > 10.0);
}

TEST_CASE("rmsnorm of fp32 inputs rounded to bf16: the input rounding through the condition number") {
  // With u = 2^-8, bf16's unit roundoff: x16 = x (1 + e_j), |e_j| <= u.
  // rms(x16) = rms(x) (1 + n) with |n| <= u (a norm moves by at most the
  // largest relative change of its entries; eps only damps it), so before
  // the output rounding y16 / y32 - 1 lies within (1 + u) / (1 - u) - 1 =
  // 2u + 2u^2 + ...; the output rounding adds u (1 + 2u) and float
  // arithmetic about 2^-20, so |y16 - y32| <= (3u + 2^-14) |y32| (2^-14 >
  // 4u^2 + 2^-20). A result beyond u alone shows the input rounding at work.
  using H = bf16;
  const std::size_t R = 6, D = 128;
  Mat<float> x("x", R, D), y("y", R, D);
  Vec<float> g("g", D), rstd("rstd", R);
  fill_uniform(x, 24, -2.0, 2.0);  // not rounded: the bf16 run sees x16 != x
  fill_uniform(g, 25, 0.5, 1.5);
  const auto x16 = converted<H>(x, "x16");
  Mat<H> y16("y16", R, D);
  ops::rmsnorm_forward(x, g, 1e-6f, y, rstd);
  ops::rmsnorm_forward(x16, g, 1e-6f, y16, rstd);
  const auto a = to_vector(y16), r = to_vector(y);
  double worst = 0;
  for (std::size_t i = 0; i < a.size(); ++i) worst = std::max(worst, std::abs(a[i] - r[i]) / std::abs(r[i]));
  INFO("worst relative error " << worst);
  CHECK(worst <= 3 * kBf16Rounding + std::ldexp(1.0, -14));
  CHECK(worst > kBf16Rounding);  // the input rounding is visible: the bound is not just the output's
}

// ------------------------------------------------ gradients against double

/// Norm-wise relative error of a gradient (any element type) against a double one.
template <class GV>
double gradient_error(const GV& got, const std::vector<double>& ref) {
  return relative_error(to_vector(got), ref);
}

TEST_CASE("norm gradients with bf16 activations against double finite differences") {
  using H = bf16;
  const std::size_t R = 6, D = 40;
  Mat<double> xd("xd", R, D), dyd("dyd", R, D), yd("yd", R, D);
  Vec<double> gd("gd", D), bd("bd", D), md("md", R), rd("rd", R);
  const auto x16 = rounded<H>(xd, 30, -1.0, 2.0);
  // dy mostly positive: row sums of dy * gamma grow large, which a bf16 accumulation would show.
  const auto dy16 = rounded<H>(dyd, 31, -0.2, 1.0);
  fill_uniform(gd, 32, 0.5, 1.5);
  fill_uniform(bd, 33);
  const auto g = converted<float>(gd, "g"), b = converted<float>(bd, "b");
  convert(gd, g);  // float parameters: the double run uses their values
  convert(bd, b);
  Kokkos::fence();
  Mat<H> y16("y16", R, D), dx16("dx16", R, D);
  Vec<float> mean("mean", R), rstd("rstd", R), dg("dg", D), db("db", D);
  const double tol16 = kBf16Rounding + kFloatTol;

  ops::layernorm_forward(x16, g, b, 1e-5f, y16, mean, rstd);
  ops::layernorm_backward(dy16, x16, g, mean, rstd, dx16, false, dg, db);
  auto ln = [&] {
    ops::layernorm_forward(xd, gd, bd, 1e-5, yd, md, rd);
    return weighted_sum(yd, dyd);
  };
  const auto gx = numeric_gradient(xd, ln), gg = numeric_gradient(gd, ln), gb = numeric_gradient(bd, ln);
  const double ex = gradient_error(dx16, gx);
  INFO("layernorm dx " << ex << ", dgamma " << gradient_error(dg, gg) << ", dbeta " << gradient_error(db, gb));
  CHECK(ex <= tol16);
  CHECK(gradient_error(dg, gg) <= kFloatTol);
  CHECK(gradient_error(db, gb) <= kFloatTol);

  // Not vacuous: dx whose two row sums are accumulated in bf16 misses the tolerance.
  {
    const auto x = to_vector(xd), dy = to_vector(dyd), gv = to_vector(gd);
    const auto mu = to_vector(mean), rs = to_vector(rstd);
    std::vector<double> bad(x.size());
    for (std::size_t i = 0; i < R; ++i) {
      H sg(0.0f), sgx(0.0f);
      for (std::size_t j = 0; j < D; ++j) {
        const float gj = float(dy[i * D + j] * gv[j]);
        sg = H(float(sg) + gj);
        sgx = H(float(sgx) + gj * float((x[i * D + j] - mu[i]) * rs[i]));
      }
      for (std::size_t j = 0; j < D; ++j) {
        const float xh = float((x[i * D + j] - mu[i]) * rs[i]);
        bad[i * D + j] = float(H(float(rs[i]) * (float(dy[i * D + j] * gv[j]) - float(sg) / D - xh * float(sgx) / D)));
      }
    }
    const double eb = relative_error(bad, gx);
    INFO("layernorm dx with bf16 sums: " << eb);
    CHECK(eb > tol16);
  }

  ops::rmsnorm_forward(x16, g, 1e-5f, y16, rstd);
  Kokkos::deep_copy(dg, 0.0f);
  ops::rmsnorm_backward(dy16, x16, g, rstd, dx16, false, dg);
  auto rms = [&] {
    ops::rmsnorm_forward(xd, gd, 1e-5, yd, rd);
    return weighted_sum(yd, dyd);
  };
  const auto rx = numeric_gradient(xd, rms), rg = numeric_gradient(gd, rms);
  INFO("rmsnorm dx " << gradient_error(dx16, rx) << ", dgamma " << gradient_error(dg, rg));
  CHECK(gradient_error(dx16, rx) <= tol16);
  CHECK(gradient_error(dg, rg) <= kFloatTol);
}

TEST_CASE("GELU, SwiGLU and cross-entropy gradients with bf16 activations against double finite differences") {
  using H = bf16;
  const double tol16 = kBf16Rounding + kFloatTol;
  const std::size_t R = 5, F = 24;
  Mat<double> xd("xd", R, F), dyd("dyd", R, F), yd("yd", R, F);
  const auto x16 = rounded<H>(xd, 40, -3.0, 3.0);
  const auto dy16 = rounded<H>(dyd, 41);
  Mat<H> dx16("dx16", R, F);
  ops::gelu_backward(dy16, x16, dx16);
  auto gelu = [&] {
    ops::gelu_forward(xd, yd);
    return weighted_sum(yd, dyd);
  };
  const double eg = gradient_error(dx16, numeric_gradient(xd, gelu));
  INFO("gelu " << eg);
  CHECK(eg <= tol16);

  Mat<double> ud("ud", R, 2 * F);
  const auto u16 = rounded<H>(ud, 42, -3.0, 3.0);
  Mat<H> du16("du16", R, 2 * F);
  ops::swiglu_backward(dy16, u16, du16);
  auto swiglu = [&] {
    ops::swiglu_forward(ud, yd);
    return weighted_sum(yd, dyd);
  };
  const double es = gradient_error(du16, numeric_gradient(ud, swiglu));
  INFO("swiglu " << es);
  CHECK(es <= tol16);

  const std::size_t V = 50;
  Mat<double> zd("zd", R, V);
  auto z16 = rounded<H>(zd, 43, -4.0, 4.0);
  ops::Tokens<Space> t("t", R);
  {
    auto h = Kokkos::create_mirror_view(t);
    for (std::size_t i = 0; i < R; ++i) h(i) = int((i * 11) % V);
    Kokkos::deep_copy(t, h);
  }
  ops::cross_entropy_forward_backward(z16, t, 1.0f / R);
  const double ec =
      gradient_error(z16, numeric_gradient(zd, [&] { return ops::cross_entropy_forward(zd, t) / double(R); }));
  INFO("cross-entropy " << ec);
  CHECK(ec <= tol16);
}

TEST_CASE("softmax and attention gradients with bf16 activations against double finite differences") {
  using H = bf16;
  // Softmax: dS16 from the stored P16. The double backward run with P16
  // instead of the exact P gives that rounding's effect exactly (rel_p).
  {
    const std::size_t B = 2, TQ = 5, TK = 9;
    const double scale = 0.6;
    Ten<double> Sd("Sd", B, TQ, TK), dPd("dPd", B, TQ, TK), Pd("Pd", B, TQ, TK), dSd("dSd", B, TQ, TK);
    Mat<double> lsed("lsed", B, TQ);
    const auto S16 = rounded<H>(Sd, 50, -3.0, 3.0);
    const auto dP16 = rounded<H>(dPd, 51);
    Ten<H> P16("P16", B, TQ, TK), dS16("dS16", B, TQ, TK);
    Mat<float> lse("lse", B, TQ);
    ops::softmax_forward(S16, float(scale), true, P16, lse);
    ops::softmax_backward(P16, dP16, float(scale), dS16, true);
    auto loss = [&] {
      ops::softmax_forward(Sd, scale, true, Pd, lsed);
      return weighted_sum(Pd, dPd);
    };
    const auto ref = numeric_gradient(Sd, loss);
    ops::softmax_forward(Sd, scale, true, Pd, lsed);
    ops::softmax_backward(Pd, dPd, scale, dSd, true);
    const auto exact = to_vector(dSd);
    ops::softmax_backward(widened<double>(P16), dPd, scale, dSd, true);
    const double rel_p = relative_error(to_vector(dSd), exact);
    const double e = gradient_error(dS16, ref);
    INFO("softmax dS " << e << ", of which P's rounding " << rel_p);
    CHECK(e <= kBf16Rounding + rel_p + kFloatTol);
  }
  // Attention: dQ, dK, dV from the stored O16 (through D = rowsum(dO * O)).
  {
    const std::size_t HQ = 2, HK = 1, T = 9, HD = 8;
    const double scale = 0.4;
    Ten<double> Q("Q", HQ, T, HD), K("K", HK, T, HD), V("V", HK, T, HD), dO("dO", HQ, T, HD), O("O", HQ, T, HD);
    Mat<double> lsed("lsed", HQ, T);
    const auto Q16 = rounded<H>(Q, 52), K16 = rounded<H>(K, 53), V16 = rounded<H>(V, 54), dO16 = rounded<H>(dO, 55);
    Ten<H> O16("O16", HQ, T, HD), dQ16("dQ16", HQ, T, HD), dK16("dK16", HK, T, HD), dV16("dV16", HK, T, HD);
    Mat<float> lse("lse", HQ, T);
    ops::flash_attention_forward(Q16, K16, V16, float(scale), true, O16, lse);
    ops::flash_attention_backward(Q16, K16, V16, O16, dO16, lse, float(scale), true, dQ16, dK16, dV16);
    auto loss = [&] {
      ops::flash_attention_forward(Q, K, V, scale, true, O, lsed);
      return weighted_sum(O, dO);
    };
    const auto rq = numeric_gradient(Q, loss), rk = numeric_gradient(K, loss), rv = numeric_gradient(V, loss);
    // O's rounding, exactly: the double backward from the exact O and from O16.
    auto grads = [&](const Ten<double>& Ox) {
      Ten<double> a("a", HQ, T, HD), b("b", HK, T, HD), c("c", HK, T, HD);
      ops::flash_attention_forward(Q, K, V, scale, true, O, lsed);
      ops::flash_attention_backward(Q, K, V, Ox, dO, lsed, scale, true, a, b, c);
      return std::vector<std::vector<double>>{to_vector(a), to_vector(b), to_vector(c)};
    };
    ops::flash_attention_forward(Q, K, V, scale, true, O, lsed);
    const auto exact = grads(Ten<double>(O));
    const auto from16 = grads(widened<double>(O16));
    const double eq = gradient_error(dQ16, rq), ek = gradient_error(dK16, rk), ev = gradient_error(dV16, rv);
    const double oq = relative_error(from16[0], exact[0]), ok = relative_error(from16[1], exact[1]);
    INFO("attention dQ " << eq << " (O's rounding " << oq << "), dK " << ek << " (" << ok << "), dV " << ev);
    CHECK(eq <= kBf16Rounding + oq + kFloatTol);
    CHECK(ek <= kBf16Rounding + ok + kFloatTol);
    CHECK(ev <= kBf16Rounding + kFloatTol);  // dV = P^T dO does not read O
  }
}

}  // namespace

// ------------------------------------------------------------ 2-byte weights

TEST_CASE_TEMPLATE("gemm_few_rows reads bf16 and fp16 weights where they lie: the float product of their values", H,
                   bf16, fp16) {
  // Up to few_rows_max rows, float A and C with a 2-byte B: the kernel widens
  // B's elements in registers, exactly, and then runs the float kernel's
  // products and sums in the same order. So C must equal, bit for bit, the
  // float product of A with B's values widened to a float matrix -- no
  // tolerance. Rows around the blocks of 4, columns around the tiles of 64
  // and a group of 8 tiles, depths around the passes of 16.
  auto& cnt = ops::gemm_counters();
  for (std::size_t m : {1, 2, 3, 4, 5, 17, 32})
    for (std::size_t n : {1, 63, 64, 65, 130, 600})
      for (std::size_t k : {1, 7, 70}) {
        CAPTURE(m);
        CAPTURE(n);
        CAPTURE(k);
        Mat<float> A("A", m, k), Bf("Bf", k, n), C("C", m, n), ref("ref", m, n);
        fill_uniform(A, 3 + m);
        const auto Bh = rounded<H>(Bf, 5 + n + k);
        const auto few0 = cnt.calls_of(ops::GemmProviderId::few_rows);
        const auto widen0 = cnt.calls_of(ops::GemmProviderId::widen);
        ops::gemm_few_rows(A, Bh, C);
        const bool host = Kokkos::SpaceAccessibility<Space, Kokkos::HostSpace>::accessible;
        CHECK(cnt.calls_of(ops::GemmProviderId::few_rows) == few0 + (host ? 1 : 0));
        CHECK(cnt.calls_of(ops::GemmProviderId::widen) == widen0);  // no float copy of B
        ops::gemm_few_rows(A, Bf, ref);
        if (host) require_identical(C, ref, "float A x 2-byte B against float A x B widened");
        else CHECK(relative_error(to_vector(C), to_vector(ref)) < 1e-2);  // a device provider, A rounded
      }
  // More rows: A is rounded into B's type once, and a provider multiplies
  // the 2-byte matrices with float accumulation. Against the exact product
  // of A with B's values, in double, each element is within A's rounding
  // (the unit roundoff u of H, relative, on each product: u sum |a||b|) plus
  // float summation (2e-5 sum |a||b| covers k = 70).
  for (std::size_t m : {33, 64}) {
    const std::size_t n = 130, k = 70;
    Mat<float> A("A", m, k), Bf("Bf", k, n), C("C", m, n);
    fill_uniform(A, 11);
    const auto Bh = rounded<H>(Bf, 12);
    ops::gemm_few_rows(A, Bh, C);
    Kokkos::fence();
    auto a = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), A);
    auto b = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), Bf);
    auto c = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), C);
    const double u = std::ldexp(1.0, -std::numeric_limits<H>::digits);
    double worst = 0;
    for (std::size_t i = 0; i < m; ++i)
      for (std::size_t j = 0; j < n; ++j) {
        double exact = 0, mag = 0;
        for (std::size_t q = 0; q < k; ++q) {
          exact += double(a(i, q)) * double(b(q, j));
          mag += std::abs(double(a(i, q)) * double(b(q, j)));
        }
        worst = std::max(worst, std::abs(double(c(i, j)) - exact) / ((u + kFloatTol) * mag));
      }
    CAPTURE(m);
    CHECK(worst <= 1.0);
  }
}
