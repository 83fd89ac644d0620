// weft's kernels: gemm in every transpose case against a naive product (and
// proof that it reaches the vendor BLAS), forward values of each kernel
// against formulas computed here, and every backward pass against central
// finite differences in double precision (relative error <= 1e-6).
#include <cmath>
#include <limits>
#include <set>
#include <string>
#include <vector>

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

constexpr double kTol = 1e-6;

// A host copy of a matrix that may be a strided subview in device memory:
// Kokkos copies between memory spaces only contiguous views, so the matrix is
// first made contiguous in its own space.
template <class V>
auto host_copy(const V& v) {
  Kokkos::View<typename V::non_const_value_type**, Kokkos::LayoutRight, typename V::memory_space> packed(
      "packed", v.extent(0), v.extent(1));
  Kokkos::deep_copy(packed, v);
  return Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), packed);
}

// Naive C = alpha op(A) op(B) + beta C on host copies.
template <class T, class AV, class BV, class CV>
std::vector<double> naive_gemm(ops::Trans ta, ops::Trans tb, double alpha, const AV& A, const BV& B, double beta,
                               const CV& C) {
  auto a = host_copy(A);
  auto b = host_copy(B);
  auto c = host_copy(C);
  const std::size_t m = c.extent(0), n = c.extent(1), k = ta == ops::Trans::T ? a.extent(0) : a.extent(1);
  std::vector<double> out(m * n);
  for (std::size_t i = 0; i < m; ++i)
    for (std::size_t j = 0; j < n; ++j) {
      double s = 0;
      for (std::size_t p = 0; p < k; ++p) {
        const double av = ta == ops::Trans::T ? a(p, i) : a(i, p);
        const double bv = tb == ops::Trans::T ? b(j, p) : b(p, j);
        s += av * bv;
      }
      out[i * n + j] = alpha * s + beta * double(c(i, j));
    }
  return out;
}

template <class CV>
std::vector<double> host_matrix(const CV& C) {
  auto c = host_copy(C);
  std::vector<double> out;
  for (std::size_t i = 0; i < c.extent(0); ++i)
    for (std::size_t j = 0; j < c.extent(1); ++j) out.push_back(double(c(i, j)));
  return out;
}

TEST_CASE_TEMPLATE("gemm matches a naive product in every transpose case", T, float, double) {
  const std::size_t m = 5, n = 4, k = 3;
  for (auto ta : {ops::Trans::N, ops::Trans::T})
    for (auto tb : {ops::Trans::N, ops::Trans::T}) {
      Mat<T> A("A", ta == ops::Trans::T ? k : m, ta == ops::Trans::T ? m : k);
      Mat<T> B("B", tb == ops::Trans::T ? n : k, tb == ops::Trans::T ? k : n);
      Mat<T> C("C", m, n);
      fill_uniform(A, 1);
      fill_uniform(B, 2);
      fill_uniform(C, 3);
      const auto expect = naive_gemm<T>(ta, tb, 0.5, A, B, 2.0, C);
      ops::gemm(ta, tb, T(0.5), A, B, T(2.0), C);
      const auto got = host_matrix(C);
      CAPTURE(char(ta));
      CAPTURE(char(tb));
      CHECK(relative_error(got, expect) < (std::is_same_v<T, float> ? 1e-6 : 1e-14));
    }
}

TEST_CASE("gemm on head slices of a fused matrix keeps LayoutRight and is exact") {
  // A [rows, 3*8] holds three 8-wide blocks; multiply the middle block's columns 2..5.
  Mat<double> big("big", 6, 24), B("B", 4, 3), C("C", 6, 3);
  fill_uniform(big, 4);
  fill_uniform(B, 5);
  auto A = Kokkos::subview(big, Kokkos::ALL, std::make_pair(10, 14));
  static_assert(std::is_same_v<typename decltype(A)::array_layout, Kokkos::LayoutRight>,
                "a column range of a LayoutRight matrix must stay LayoutRight so gemm reaches BLAS");
  const auto expect = naive_gemm<double>(ops::Trans::N, ops::Trans::N, 1.0, A, B, 0.0, C);
  ops::gemm(ops::Trans::N, ops::Trans::N, 1.0, A, B, 0.0, C);
  CHECK(relative_error(host_matrix(C), expect) < 1e-14);
}

TEST_CASE_TEMPLATE("gemm_few_rows equals the naive product for few rows and falls back to gemm for many", T, float,
                   double) {
  // Rows around the register blocks of 4 and the limit few_rows_max (32), columns around the tiles of 64.
  for (std::size_t m : {1, 2, 3, 4, 5, 8, 17, 32, 33, 40})
    for (std::size_t n : {1, 63, 64, 65, 130})
      for (std::size_t k : {1, 7, 70}) {
        Mat<T> A("A", m, k), B("B", k, n), C("C", m, n);
        fill_uniform(A, 7 + m);
        fill_uniform(B, 8 + n);
        fill_uniform(C, 9);  // overwritten: C = A B, no beta
        const auto expect = naive_gemm<T>(ops::Trans::N, ops::Trans::N, 1.0, A, B, 0.0, C);
        ops::gemm_few_rows(A, B, C);
        CAPTURE(m);
        CAPTURE(n);
        CAPTURE(k);
        CHECK(relative_error(host_matrix(C), expect) < (std::is_same_v<T, float> ? 1e-6 : 1e-14));
      }
  // Column ranges of wider matrices: leading dimensions that are not the row lengths.
  Mat<T> big_a("big_a", 6, 90), B("B", 70, 66), big_c("big_c", 6, 200);
  fill_uniform(big_a, 10);
  fill_uniform(B, 11);
  auto A = Kokkos::subview(big_a, Kokkos::ALL, std::make_pair(10, 80));
  auto C = Kokkos::subview(big_c, Kokkos::ALL, std::make_pair(100, 166));
  const auto expect = naive_gemm<T>(ops::Trans::N, ops::Trans::N, 1.0, A, B, 0.0, C);
  ops::gemm_few_rows(A, B, C);
  CHECK(relative_error(host_matrix(C), expect) < (std::is_same_v<T, float> ? 1e-6 : 1e-14));
  Mat<T> bad("bad", 71, 66);
  CHECK_THROWS_AS(ops::gemm_few_rows(A, bad, C), ShapeError);
}

std::vector<std::string>* g_regions = nullptr;
// [[maybe_unused]]: a HIP build uses it only in a discarded if-constexpr branch.
[[maybe_unused]] void record_region(const char* name) {
  if (g_regions) g_regions->push_back(name);
}

TEST_CASE("gemm on host: double reaches the vendor BLAS, float the configured provider") {
#if defined(KOKKOSKERNELS_ENABLE_TPL_BLAS)
  if constexpr (std::is_same_v<typename Space::memory_space, Kokkos::HostSpace>) {
    std::vector<std::string> regions;
    g_regions = &regions;
    Kokkos::Tools::Experimental::set_push_region_callback(&record_region);
    Mat<float> A("A", 8, 8), B("B", 8, 8), C("C", 8, 8);
    Mat<double> big("big", 8, 24), Bd("Bd", 8, 8), Cd("Cd", 8, 8);
    auto& counters = ops::gemm_counters();
    const auto onednn0 = counters.calls_of(ops::GemmProviderId::onednn);
    ops::gemm(ops::Trans::T, ops::Trans::N, 1.0f, A, B, 0.0f, C);
    ops::gemm(ops::Trans::N, ops::Trans::T, 1.0, Kokkos::subview(big, Kokkos::ALL, std::make_pair(8, 16)), Bd, 0.0, Cd);
    Kokkos::Tools::Experimental::set_push_region_callback(nullptr);
    g_regions = nullptr;
#if WEFT_ONEDNN_PROVIDER
    // float went to oneDNN (no Kokkos Kernels region), double to the BLAS.
    CHECK(counters.calls_of(ops::GemmProviderId::onednn) == onednn0 + 1);
    REQUIRE(regions.size() == 1);
    CHECK(regions[0].find("TPL_BLAS") != std::string::npos);
#else
    CHECK(counters.calls_of(ops::GemmProviderId::onednn) == onednn0);
    REQUIRE(regions.size() == 2);
    CHECK(regions[0].find("TPL_BLAS") != std::string::npos);
    CHECK(regions[1].find("TPL_BLAS") != std::string::npos);
#endif
  }
#else
  MESSAGE("Kokkos Kernels built without a BLAS TPL: nothing to check");
#endif
}

TEST_CASE("gemm rejects mismatched shapes and handles an empty inner dimension") {
  Mat<double> A("A", 3, 2), B("B", 3, 4), C("C", 3, 4);
  CHECK_THROWS_AS(ops::gemm(ops::Trans::N, ops::Trans::N, 1.0, A, B, 0.0, C), ShapeError);
  Mat<double> A0("A0", 3, 0), B0("B0", 0, 4);
  Kokkos::deep_copy(C, 2.0);
  ops::gemm(ops::Trans::N, ops::Trans::N, 1.0, A0, B0, 0.5, C);
  for (double v : to_vector(C)) CHECK(v == 1.0);
}

TEST_CASE("gemm_batched equals one gemm per slice") {
  ops::Tensor3<double, Space> A("A", 3, 4, 5), B("B", 3, 4, 2), C("C", 3, 5, 2);
  fill_uniform(A, 6);
  fill_uniform(B, 7);
  ops::gemm_batched(ops::Trans::T, ops::Trans::N, 1.0, A, B, 0.0, C);
  for (std::size_t b = 0; b < 3; ++b) {
    auto a = Kokkos::subview(A, b, Kokkos::ALL, Kokkos::ALL);
    auto bb = Kokkos::subview(B, b, Kokkos::ALL, Kokkos::ALL);
    auto c = Kokkos::subview(C, b, Kokkos::ALL, Kokkos::ALL);
    Mat<double> zero("zero", 5, 2);
    CHECK(relative_error(host_matrix(c), naive_gemm<double>(ops::Trans::T, ops::Trans::N, 1.0, a, bb, 0.0, zero)) <
          1e-14);
  }
  ops::Tensor3<double, Space> Cbad("Cbad", 2, 5, 2);
  CHECK_THROWS_AS(ops::gemm_batched(ops::Trans::T, ops::Trans::N, 1.0, A, B, 0.0, Cbad), ShapeError);
}

TEST_CASE("bias add and its backward") {
  Mat<double> y("y", 4, 3), w("w", 4, 3);
  Vec<double> b("b", 3), db("db", 3);
  fill_uniform(b, 8);
  fill_uniform(w, 9);
  auto loss = [&] {
    Kokkos::deep_copy(y, 0.0);
    ops::bias_add(y, b);
    return weighted_sum(y, w);
  };
  loss();
  for (std::size_t i = 0; i < 4; ++i)
    CHECK(to_vector(y)[i * 3 + 1] == to_vector(b)[1]);
  ops::bias_backward(w, db);
  CHECK(relative_error(to_vector(db), numeric_gradient(b, loss)) < kTol);
  Vec<double> wrong("wrong", 2);
  CHECK_THROWS_AS(ops::bias_add(y, wrong), ShapeError);
}

TEST_CASE("GELU (tanh form) values and gradient") {
  Mat<double> x("x", 3, 5), y("y", 3, 5), w("w", 3, 5), dx("dx", 3, 5);
  fill_uniform(x, 10, -3, 3);
  fill_uniform(w, 11);
  {
    Mat<double> one("one", 1, 1), out("out", 1, 1);
    Kokkos::deep_copy(one, 1.0);
    ops::gelu_forward(one, out);
    CHECK(to_vector(out)[0] == doctest::Approx(0.8411919906082768).epsilon(1e-14));
  }
  auto loss = [&] {
    ops::gelu_forward(x, y);
    return weighted_sum(y, w);
  };
  ops::gelu_backward(w, x, dx);
  CHECK(relative_error(to_vector(dx), numeric_gradient(x, loss)) < kTol);
}

TEST_CASE("fused bias + GELU: same values as bias_add then gelu_forward, gradients of input and bias") {
  // 37 columns: one full column chunk of the backward's bias sum and a partial one.
  const std::size_t n = 3, f = 37;
  Mat<double> x("x", n, f), up("up", n, f), act("act", n, f), ref("ref", n, f), refact("refact", n, f), w("w", n, f),
      dup("dup", n, f);
  Vec<double> b("b", f), db("db", f);
  fill_uniform(x, 40, -3, 3);
  fill_uniform(b, 41);
  fill_uniform(w, 42);
  auto loss = [&] {
    Kokkos::deep_copy(up, x);
    ops::bias_gelu_forward(up, b, act);
    return weighted_sum(act, w);
  };
  loss();
  Kokkos::deep_copy(ref, x);
  ops::bias_add(ref, b);
  ops::gelu_forward(ref, refact);
  CHECK(relative_error(to_vector(up), to_vector(ref)) == 0.0);
  CHECK(relative_error(to_vector(act), to_vector(refact)) == 0.0);
  Kokkos::deep_copy(db, 1.0);  // the bias gradient accumulates
  ops::bias_gelu_backward(w, up, dup, db);
  const auto gx = numeric_gradient(x, loss), gb = numeric_gradient(b, loss);
  CHECK(relative_error(to_vector(dup), gx) < kTol);
  auto dbh = to_vector(db);
  for (double& v : dbh) v -= 1.0;
  CHECK(relative_error(dbh, gb) < kTol);
  // In place (dup = dact) gives the same gradient.
  loss();  // up again from the unperturbed x and b
  Mat<double> inplace("inplace", n, f);
  Vec<double> db2("db2", f);
  Kokkos::deep_copy(inplace, w);
  ops::bias_gelu_backward(inplace, up, inplace, db2);
  CHECK(relative_error(to_vector(inplace), to_vector(dup)) == 0.0);
  Vec<double> wrong("wrong", f - 1);
  CHECK_THROWS_AS(ops::bias_gelu_forward(up, wrong, act), ShapeError);
}

TEST_CASE("SwiGLU values and gradient") {
  Mat<double> u("u", 3, 8), y("y", 3, 4), w("w", 3, 4), du("du", 3, 8);
  fill_uniform(u, 12, -2, 2);
  fill_uniform(w, 13);
  ops::swiglu_forward(u, y);
  const auto uh = to_vector(u), yh = to_vector(y);
  const double a = uh[1], b = uh[4 + 1];
  CHECK(yh[1] == doctest::Approx(a / (1 + std::exp(-a)) * b).epsilon(1e-14));
  auto loss = [&] {
    ops::swiglu_forward(u, y);
    return weighted_sum(y, w);
  };
  ops::swiglu_backward(w, u, du);
  CHECK(relative_error(to_vector(du), numeric_gradient(u, loss)) < kTol);
  Mat<double> bad("bad", 3, 7);
  CHECK_THROWS_AS(ops::swiglu_forward(bad, y), ShapeError);
}

TEST_CASE("LayerNorm normalises rows and its gradients match finite differences") {
  const std::size_t n = 3, d = 6;
  Mat<double> x("x", n, d), y("y", n, d), w("w", n, d), dx("dx", n, d);
  Vec<double> g("g", d), b("b", d), mean("mean", n), rstd("rstd", n), dg("dg", d), db("db", d);
  fill_uniform(x, 14, -2, 3);
  fill_uniform(g, 15, 0.5, 1.5);
  fill_uniform(b, 16);
  fill_uniform(w, 17);
  const double eps = 1e-5;
  {
    Vec<double> ones("ones", d), zeros("zeros", d);
    Kokkos::deep_copy(ones, 1.0);
    ops::layernorm_forward(x, ones, zeros, eps, y, mean, rstd);
    const auto yh = to_vector(y);
    for (std::size_t i = 0; i < n; ++i) {
      double s = 0, s2 = 0;
      for (std::size_t j = 0; j < d; ++j) s += yh[i * d + j], s2 += yh[i * d + j] * yh[i * d + j];
      CHECK(std::abs(s / d) < 1e-12);
      CHECK(s2 / d == doctest::Approx(1.0).epsilon(1e-4));  // eps keeps it just below 1
    }
  }
  auto loss = [&] {
    ops::layernorm_forward(x, g, b, eps, y, mean, rstd);
    return weighted_sum(y, w);
  };
  loss();
  Kokkos::deep_copy(dx, 7.0);  // accumulate=false must overwrite
  ops::layernorm_backward(w, x, g, mean, rstd, dx, false, dg, db);
  CHECK(relative_error(to_vector(dx), numeric_gradient(x, loss)) < kTol);
  CHECK(relative_error(to_vector(dg), numeric_gradient(g, loss)) < kTol);
  CHECK(relative_error(to_vector(db), numeric_gradient(b, loss)) < kTol);
  // accumulate=true adds to what is there; parameter gradients always add.
  Mat<double> dx2("dx2", n, d);
  Kokkos::deep_copy(dx2, 1.0);
  ops::layernorm_backward(w, x, g, mean, rstd, dx2, true, dg, db);
  const auto a = to_vector(dx), c = to_vector(dx2);
  for (std::size_t i = 0; i < a.size(); ++i) CHECK(c[i] == doctest::Approx(a[i] + 1.0).epsilon(1e-14));
  const auto dg2 = to_vector(dg), num = numeric_gradient(g, loss);
  for (std::size_t j = 0; j < d; ++j) CHECK(dg2[j] == doctest::Approx(2 * num[j]).epsilon(1e-6));
}

TEST_CASE("RMSNorm gradients match finite differences") {
  const std::size_t n = 3, d = 5;
  Mat<double> x("x", n, d), y("y", n, d), w("w", n, d), dx("dx", n, d);
  Vec<double> g("g", d), rstd("rstd", n), dg("dg", d);
  fill_uniform(x, 18, -2, 2);
  fill_uniform(g, 19, 0.5, 1.5);
  fill_uniform(w, 20);
  auto loss = [&] {
    ops::rmsnorm_forward(x, g, 1e-6, y, rstd);
    return weighted_sum(y, w);
  };
  loss();
  const auto xh = to_vector(x), yh = to_vector(y), gh = to_vector(g);
  double ms = 0;
  for (std::size_t j = 0; j < d; ++j) ms += xh[d + j] * xh[d + j];
  CHECK(yh[d + 2] == doctest::Approx(xh[d + 2] / std::sqrt(ms / d + 1e-6) * gh[2]).epsilon(1e-13));
  ops::rmsnorm_backward(w, x, g, rstd, dx, false, dg);
  CHECK(relative_error(to_vector(dx), numeric_gradient(x, loss)) < kTol);
  CHECK(relative_error(to_vector(dg), numeric_gradient(g, loss)) < kTol);
}

TEST_CASE("causal softmax: rows sum to one, the future is masked, lse is kept, gradient matches") {
  for (bool causal : {true, false}) {
    const std::size_t nb = 2, t = 4;
    ops::Tensor3<double, Space> S("S", nb, t, t), P("P", nb, t, t), W("W", nb, t, t), dS("dS", nb, t, t);
    Kokkos::View<double**, Kokkos::LayoutRight, Space> lse("lse", nb, t);
    fill_uniform(S, 21, -3, 3);
    fill_uniform(W, 22);
    const double scale = 0.7;
    auto loss = [&] {
      ops::softmax_forward(S, scale, causal, P, lse);
      return weighted_sum(P, W);
    };
    loss();
    const auto ph = to_vector(P), sh = to_vector(S), lh = to_vector(lse);
    for (std::size_t r = 0; r < nb * t; ++r) {
      const std::size_t i = r % t;
      double s = 0, z = 0;
      for (std::size_t j = 0; j < t; ++j) {
        s += ph[r * t + j];
        if (causal && j > i) CHECK(ph[r * t + j] == 0.0);
        if (!causal || j <= i) z += std::exp(scale * sh[r * t + j]);
      }
      CHECK(s == doctest::Approx(1.0).epsilon(1e-14));
      CHECK(lh[r] == doctest::Approx(std::log(z)).epsilon(1e-14));
    }
    ops::softmax_backward(P, W, scale, dS);
    CAPTURE(causal);
    CHECK(relative_error(to_vector(dS), numeric_gradient(S, loss)) < kTol);
  }
}

TEST_CASE("softmax over rows longer than the lane width: in place, causal backward, float agrees with double") {
  // 21 keys: one full group of lane-wise partial sums and a tail; 3 queries
  // against 21 keys exercise the causal offset.
  const std::size_t nb = 2, tq = 3, tk = 21;
  for (bool causal : {true, false}) {
    CAPTURE(causal);
    ops::Tensor3<double, Space> S("S", nb, tq, tk), P("P", nb, tq, tk), W("W", nb, tq, tk), dS("dS", nb, tq, tk);
    Kokkos::View<double**, Kokkos::LayoutRight, Space> lse("lse", nb, tq), lse2("lse2", nb, tq);
    fill_uniform(S, 23, -3, 3);
    fill_uniform(W, 24);
    const double scale = 0.6;
    auto loss = [&] {
      ops::softmax_forward(S, scale, causal, P, lse);
      return weighted_sum(P, W);
    };
    loss();
    ops::Tensor3<double, Space> Q("Q", nb, tq, tk);  // in place: P = S
    Kokkos::deep_copy(Q, S);
    ops::softmax_forward(Q, scale, causal, Q, lse2);
    CHECK(relative_error(to_vector(Q), to_vector(P)) == 0.0);
    CHECK(relative_error(to_vector(lse2), to_vector(lse)) == 0.0);
    ops::softmax_backward(P, W, scale, dS, causal);
    CHECK(relative_error(to_vector(dS), numeric_gradient(S, loss)) < kTol);
    // In place (dS = dP); on causal probabilities the flag only skips the zeros.
    loss();  // P again from the unperturbed S
    ops::softmax_backward(P, W, scale, dS, causal);
    ops::Tensor3<double, Space> dPin("dPin", nb, tq, tk);
    Kokkos::deep_copy(dPin, W);
    ops::softmax_backward(P, dPin, scale, dPin, false);
    CHECK(relative_error(to_vector(dPin), to_vector(dS)) == 0.0);
    ops::Tensor3<float, Space> Sf("Sf", nb, tq, tk), Pf("Pf", nb, tq, tk);
    Kokkos::View<float**, Kokkos::LayoutRight, Space> lsef("lsef", nb, tq);
    auto sh = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), S);
    auto sfh = Kokkos::create_mirror_view(Sf);
    for (std::size_t i = 0; i < sh.span(); ++i) sfh.data()[i] = float(sh.data()[i]);
    Kokkos::deep_copy(Sf, sfh);
    ops::softmax_forward(Sf, float(scale), causal, Pf, lsef);
    CHECK(relative_error(to_vector(Pf), to_vector(P)) < 1e-6);
  }
}

// Naive attention on host copies: O(h, i) = sum_j softmax_j(scale q.k) v_j, keys j <= i + tk - tq when causal.
template <class QV, class KV>
std::vector<double> naive_attention(const QV& Q, const KV& K, const KV& V, double scale, bool causal) {
  const auto q = to_vector(Q), k = to_vector(K), v = to_vector(V);
  const std::size_t H = Q.extent(0), tq = Q.extent(1), hd = Q.extent(2), hk = K.extent(0), tk = K.extent(1);
  std::vector<double> o(H * tq * hd, 0.0);
  for (std::size_t h = 0; h < H; ++h)
    for (std::size_t i = 0; i < tq; ++i) {
      const std::size_t kh = h / (H / hk), n = causal ? i + tk - tq + 1 : tk;
      std::vector<double> s(n);
      double mx = -1e300, z = 0;
      for (std::size_t j = 0; j < n; ++j) {
        double d = 0;
        for (std::size_t c = 0; c < hd; ++c) d += q[(h * tq + i) * hd + c] * k[(kh * tk + j) * hd + c];
        s[j] = scale * d;
        mx = std::max(mx, s[j]);
      }
      for (std::size_t j = 0; j < n; ++j) z += std::exp(s[j] - mx);
      for (std::size_t j = 0; j < n; ++j)
        for (std::size_t c = 0; c < hd; ++c)
          o[(h * tq + i) * hd + c] += std::exp(s[j] - mx) / z * v[(kh * tk + j) * hd + c];
    }
  return o;
}

TEST_CASE("blockwise attention: output matches naive attention, gradients of Q, K and V match finite differences") {
  // 4 query heads over 2 key/value heads (grouped), 5 queries against 7 keys
  // (the causal offset), head_dim 3; then one head of 70 x 70, two key blocks.
  struct Shape {
    std::size_t H, hk, tq, tk, hd;
  };
  for (const Shape sh : {Shape{4, 2, 5, 7, 3}, Shape{1, 1, 70, 70, 2}})
    for (bool causal : {true, false}) {
      CAPTURE(causal);
      CAPTURE(sh.tk);
      using T3 = ops::Tensor3<double, Space>;
      T3 Q("Q", sh.H, sh.tq, sh.hd), K("K", sh.hk, sh.tk, sh.hd), V("V", sh.hk, sh.tk, sh.hd), O("O", sh.H, sh.tq, sh.hd),
          W("W", sh.H, sh.tq, sh.hd), dQ("dQ", sh.H, sh.tq, sh.hd), dK("dK", sh.hk, sh.tk, sh.hd),
          dV("dV", sh.hk, sh.tk, sh.hd);
      Kokkos::View<double**, Kokkos::LayoutRight, Space> lse("lse", sh.H, sh.tq);
      fill_uniform(Q, 50, -2, 2);
      fill_uniform(K, 51, -2, 2);
      fill_uniform(V, 52);
      fill_uniform(W, 53);
      const double scale = 0.8;
      auto loss = [&] {
        ops::flash_attention_forward(Q, K, V, scale, causal, O, lse);
        return weighted_sum(O, W);
      };
      loss();
      CHECK(relative_error(to_vector(O), naive_attention(Q, K, V, scale, causal)) < 1e-13);
      ops::flash_attention_backward(Q, K, V, O, W, lse, scale, causal, dQ, dK, dV);
      if (sh.tk < 64) CHECK(relative_error(to_vector(dQ), numeric_gradient(Q, loss)) < kTol);
      CHECK(relative_error(to_vector(dK), numeric_gradient(K, loss)) < kTol);
      if (sh.tk < 64) CHECK(relative_error(to_vector(dV), numeric_gradient(V, loss)) < kTol);
    }
  ops::Tensor3<double, Space> Q("Q", 3, 4, 2), K("K", 2, 4, 2), O("O", 3, 4, 2);
  Kokkos::View<double**, Kokkos::LayoutRight, Space> lse("lse", 3, 4);
  CHECK_THROWS_AS(ops::flash_attention_forward(Q, K, K, 1.0, true, O, lse), ShapeError);  // 3 heads over 2
}

TEST_CASE("softmax stays finite for huge scores") {
  ops::Tensor3<float, Space> S("S", 1, 2, 2), P("P", 1, 2, 2);
  Kokkos::View<float**, Kokkos::LayoutRight, Space> lse("lse", 1, 2);
  Kokkos::deep_copy(S, 1e30f);
  ops::softmax_forward(S, 1.0f, false, P, lse);
  for (double p : to_vector(P)) CHECK(p == doctest::Approx(0.5));
}

TEST_CASE("embedding lookup, scatter-add backward with repeated ids, and out-of-range ids") {
  const std::size_t vocab = 5, d = 3;
  Mat<double> W("W", vocab, d), y("y", 6, d), w("w", 6, d), dW("dW", vocab, d);
  ops::Tokens<Space> ids("ids", 6);
  {
    auto h = Kokkos::create_mirror_view(ids);
    const int v[6] = {4, 1, 4, 0, 4, 2};
    for (int i = 0; i < 6; ++i) h(i) = v[i];
    Kokkos::deep_copy(ids, h);
  }
  fill_uniform(W, 23);
  fill_uniform(w, 24);
  auto loss = [&] {
    ops::embedding_forward(W, ids, y);
    return weighted_sum(y, w);
  };
  loss();
  CHECK(to_vector(y)[2 * d + 1] == to_vector(W)[4 * d + 1]);
  ops::embedding_backward(w, ids, dW);
  CHECK(relative_error(to_vector(dW), numeric_gradient(W, loss)) < kTol);
  auto h = Kokkos::create_mirror_view(ids);
  Kokkos::deep_copy(h, ids);
  h(3) = 5;
  Kokkos::deep_copy(ids, h);
  CHECK_THROWS_AS(ops::embedding_forward(W, ids, y), ConfigError);
}

TEST_CASE("learned positions: forward adds the row's position, backward sums over sequences") {
  const std::size_t seq = 3, d = 2, tmax = 5;
  Mat<double> P("P", tmax, d), y("y", 2 * seq, d), w("w", 2 * seq, d), dP("dP", tmax, d);
  fill_uniform(P, 25);
  fill_uniform(w, 26);
  auto loss = [&] {
    Kokkos::deep_copy(y, 0.0);
    ops::position_forward(P, seq, 1, y);
    return weighted_sum(y, w);
  };
  loss();
  CHECK(to_vector(y)[(seq + 2) * d] == to_vector(P)[(1 + 2) * d]);
  ops::position_backward(w, seq, 1, dP);
  CHECK(relative_error(to_vector(dP), numeric_gradient(P, loss)) < kTol);
  CHECK(to_vector(dP)[0] == 0.0);  // position 0 is not used at offset 1
  CHECK_THROWS_AS(ops::position_forward(P, seq, 3, y), ConfigError);
}

TEST_CASE("fused cross-entropy: loss equals the naive formula, gradient matches") {
  const std::size_t n = 4, v = 7;
  Mat<double> Z("Z", n, v), G("G", n, v);
  ops::Tokens<Space> t("t", n);
  fill_uniform(Z, 27, -4, 4);
  {
    auto h = Kokkos::create_mirror_view(t);
    for (std::size_t i = 0; i < n; ++i) h(i) = int((3 * i + 1) % v);
    Kokkos::deep_copy(t, h);
  }
  const auto zh = to_vector(Z);
  double expect = 0;
  for (std::size_t i = 0; i < n; ++i) {
    double s = 0;
    for (std::size_t j = 0; j < v; ++j) s += std::exp(zh[i * v + j]);
    expect += std::log(s) - zh[i * v + (3 * i + 1) % v];
  }
  CHECK(ops::cross_entropy_forward(Z, t) == doctest::Approx(expect).epsilon(1e-14));
  auto loss = [&] { return 0.25 * ops::cross_entropy_forward(Z, t); };
  const auto num = numeric_gradient(Z, loss);
  Kokkos::deep_copy(G, Z);
  CHECK(ops::cross_entropy_forward_backward(G, t, 0.25) == doctest::Approx(expect).epsilon(1e-14));
  CHECK(relative_error(to_vector(G), num) < kTol);
  auto h = Kokkos::create_mirror_view(t);
  Kokkos::deep_copy(h, t);
  h(2) = int(v);
  Kokkos::deep_copy(t, h);
  CHECK_THROWS_AS(ops::cross_entropy_forward(Z, t), ConfigError);
}

TEST_CASE("rotary positions: norm-preserving, inverse undoes it, a sequence shard matches the whole") {
  const std::size_t seq = 6, hd = 4, heads = 2, cols = 3 + heads * hd;
  Mat<double> X("X", 2 * seq, cols), Y("Y", 2 * seq, cols), W("W", 2 * seq, cols), dX("dX", 2 * seq, cols);
  fill_uniform(X, 28);
  fill_uniform(W, 29);
  ops::RotarySpec spec{.col_begin = 3, .heads = heads, .head_dim = hd, .seq = seq, .offset = 0};
  Kokkos::deep_copy(Y, X);
  ops::rotary_apply(Y, spec);
  const auto xh = to_vector(X), yh = to_vector(Y);
  for (std::size_t r = 0; r < 2 * seq; ++r) {
    double nx = 0, ny = 0;
    for (std::size_t c = 3; c < cols; ++c) nx += xh[r * cols + c] * xh[r * cols + c], ny += yh[r * cols + c] * yh[r * cols + c];
    CHECK(ny == doctest::Approx(nx).epsilon(1e-13));
    for (std::size_t c = 0; c < 3; ++c) CHECK(yh[r * cols + c] == xh[r * cols + c]);
  }
  CHECK(yh[3] == xh[3]);  // position 0 is not rotated
  CHECK(yh[cols + 3] != xh[cols + 3]);
  // The second half of each sequence, rotated on its own with offset seq/2.
  Mat<double> half("half", seq / 2, cols);
  Kokkos::deep_copy(half, Kokkos::subview(X, std::make_pair(seq / 2, seq), Kokkos::ALL));
  auto spec2 = spec;
  spec2.seq = seq / 2;
  spec2.offset = seq / 2;
  ops::rotary_apply(half, spec2);
  const auto hh = to_vector(half);
  for (std::size_t i = 0; i < hh.size(); ++i) CHECK(hh[i] == yh[(seq / 2) * cols + i]);
  ops::rotary_apply(Y, spec, true);
  CHECK(relative_error(to_vector(Y), xh) < 1e-15);
  auto loss = [&] {
    Kokkos::deep_copy(Y, X);
    ops::rotary_apply(Y, spec);
    return weighted_sum(Y, W);
  };
  Kokkos::deep_copy(dX, W);
  ops::rotary_apply(dX, spec, true);
  CHECK(relative_error(to_vector(dX), numeric_gradient(X, loss)) < kTol);
  spec.head_dim = 3;
  CHECK_THROWS_AS(ops::rotary_apply(Y, spec), ConfigError);
}

TEST_CASE("counter-based init: a shard draws exactly the whole tensor's values there") {
  Mat<double> full("full", 6, 10), shard("shard", 3, 4);
  ops::init_normal(full, 42, "blocks.0.mlp.up.weight", 0.02);
  ops::init_normal(shard, 42, "blocks.0.mlp.up.weight", 0.02, {.row0 = 2, .col0 = 5, .global_cols = 10});
  const auto f = to_vector(full), s = to_vector(shard);
  for (std::size_t i = 0; i < 3; ++i)
    for (std::size_t j = 0; j < 4; ++j) CHECK(s[i * 4 + j] == f[(i + 2) * 10 + j + 5]);
  Mat<double> other("other", 6, 10), reseeded("reseeded", 6, 10);
  ops::init_normal(other, 42, "blocks.0.mlp.down.weight", 0.02);
  ops::init_normal(reseeded, 43, "blocks.0.mlp.up.weight", 0.02);
  CHECK(to_vector(other) != f);
  CHECK(to_vector(reseeded) != f);
  // Statistics of many draws: mean 0, standard deviation as asked.
  Mat<double> big("big", 200, 500);
  ops::init_normal(big, 7, "w", 2.0);
  double s1 = 0, s2 = 0;
  for (double v : to_vector(big)) s1 += v, s2 += v * v;
  const double n = 200 * 500, mean = s1 / n, sd = std::sqrt(s2 / n - mean * mean);
  CHECK(std::abs(mean) < 0.03);
  CHECK(sd == doctest::Approx(2.0).epsilon(0.01));
  CHECK_THROWS_AS(ops::init_normal(shard, 42, "w", 1.0, {.col0 = 8, .global_cols = 10}), ShapeError);
}

TEST_CASE("BLAS thread choice follows the flag, then the environment, then cores per rank") {
  auto r = ops::set_blas_threads(1, 1);
  CHECK(r.reason == "set by the user");
  if (r.controlled) CHECK(ops::blas_thread_count() == 1);
  CHECK_THROWS_AS(ops::set_blas_threads(0, 0), ConfigError);
}

TEST_CASE("BLAS threads: Kokkos threads x BLAS threads x ranks never exceed the cores") {
  using ops::BlasThreadInputs;
  using ops::choose_blas_threads;
  // The machine: 2 cores, 1 rank, 2 OpenMP threads: one BLAS thread.
  CHECK(choose_blas_threads({.ranks_per_node = 1, .cores = 2, .kokkos_threads = 2}).threads == 1);
  CHECK(choose_blas_threads({.ranks_per_node = 1, .cores = 2, .kokkos_threads = 1}).threads == 2);
  CHECK(choose_blas_threads({.ranks_per_node = 2, .cores = 2, .kokkos_threads = 1}).threads == 1);
  CHECK(choose_blas_threads({.ranks_per_node = 4, .cores = 2, .kokkos_threads = 2}).threads == 1);  // at least 1
  CHECK(choose_blas_threads({.ranks_per_node = 1, .cores = 0, .kokkos_threads = 1}).threads == 1);  // unknown cores
  for (int cores = 1; cores <= 64; ++cores)
    for (int ranks = 1; ranks <= 8; ++ranks)
      for (int k = 1; k <= 8; ++k) {
        const int b = choose_blas_threads({.ranks_per_node = ranks, .cores = cores, .kokkos_threads = k}).threads;
        CHECK(b >= 1);
        if (ranks * k <= cores) {
          CHECK(ranks * k * b <= cores);
          CHECK(ranks * k * (b + 1) > cores);  // and no more idle cores than needed
        } else {
          CHECK(b == 1);
        }
      }
  const auto r = choose_blas_threads({.ranks_per_node = 2, .cores = 16, .kokkos_threads = 4});
  CHECK(r.threads == 2);
  CHECK(r.reason == "16 cores / (2 ranks on this node x 4 Kokkos host threads per rank)");
  // The user's flag, then OPENBLAS_NUM_THREADS, win over the rule.
  CHECK(choose_blas_threads({.requested = 3, .ranks_per_node = 1, .cores = 2, .kokkos_threads = 2, .openblas_env = 5})
            .threads == 3);
  const auto e = choose_blas_threads({.ranks_per_node = 1, .cores = 2, .kokkos_threads = 2, .openblas_env = 5});
  CHECK(e.threads == 5);
  CHECK(e.reason == "kept from OPENBLAS_NUM_THREADS=5");
  CHECK_THROWS_AS(choose_blas_threads({.ranks_per_node = 0}), ConfigError);
  CHECK_THROWS_AS(choose_blas_threads({.ranks_per_node = 1, .kokkos_threads = 0}), ConfigError);
}

TEST_CASE("binding: advice when Kokkos threads outnumber the CPUs a rank may use, or OMP_PROC_BIND stacks ranks") {
  using ops::binding_advice;
  // mpirun's default --bind-to core: one CPU for two threads.
  const std::string one = binding_advice(1, 2, 1, "unset");
  CHECK(one.find("2 Kokkos threads may run on only 1 CPU (") != std::string::npos);
  CHECK(one.find("--map-by slot:PE=2 --bind-to core, or --bind-to none") != std::string::npos);
  CHECK(binding_advice(2, 4, 1, "unset").find("on only 2 CPUs") != std::string::npos);
  // Enough CPUs, nothing pinned: nothing to say.
  CHECK(binding_advice(2, 2, 1, "unset").empty());
  CHECK(binding_advice(2, 1, 2, "unset").empty());
  CHECK(binding_advice(0, 2, 1, "unset").empty());  // mask unknown
  // OMP_PROC_BIND pins the threads of two ranks that may both use all CPUs onto the same ones.
  CHECK(binding_advice(2, 1, 2, "spread").find("OMP_PROC_BIND=spread pins") != std::string::npos);
  CHECK(binding_advice(2, 1, 2, "false").empty());
  CHECK(binding_advice(2, 1, 1, "close").empty());  // one rank: pinning is its own business
  CHECK(binding_advice(2, 2, 2, "close").empty());  // every CPU in use by one rank already
  // What this process has; the line names the counts.
  const auto b = ops::host_binding(1, 1);
  CHECK(b.kokkos_threads >= 1);
  CHECK(b.cores >= 1);
  CHECK(ops::describe(b).find("Kokkos thread") != std::string::npos);
}

}  // namespace

namespace {
TEST_CASE("fast float exp and sqrt of the hot loops stay within a few float ulps") {
  double worst_exp = 0, worst_sqrt = 0;
  for (int i = -2000; i <= 2000; ++i) {
    const float x = float(i) * 0.0437f;  // [-87.4, 87.4]
    const double e = std::exp(double(x));
    if (e > 1e-37) worst_exp = std::max(worst_exp, std::abs(double(weft::ops::math::fast_exp(x)) - e) / e);
    const float s = std::ldexp(1.0f + float(i + 2000) / 4001.0f, (i % 60));
    worst_sqrt = std::max(worst_sqrt, std::abs(double(weft::ops::math::fast_sqrt(s)) - std::sqrt(double(s))) / std::sqrt(double(s)));
  }
  CHECK(worst_exp < 4e-7);
  CHECK(worst_sqrt < 4e-7);
  CHECK(weft::ops::math::fast_exp(-1000.0f) < 1e-37f);  // clamped, not garbage
  CHECK(weft::ops::math::fast_exp(-1000.0f) >= 0.0f);
  CHECK(std::isfinite(weft::ops::math::fast_exp(1000.0f)));
  CHECK(std::isnan(weft::ops::math::fast_exp(std::numeric_limits<float>::quiet_NaN())));  // a NaN comes out a NaN
  CHECK(weft::ops::math::fast_exp(-std::numeric_limits<float>::infinity()) < 1e-37f);
  CHECK(weft::ops::math::fast_sqrt(0.0f) == 0.0f);
  CHECK(weft::ops::math::fast_exp(1.0) == std::exp(1.0));  // double is exact libm
}
}  // namespace
