// Optimizers: one AdamW and one SGD step against values computed here by the
// published update rules; weight decay only where a parameter asks for it;
// clipping to the global norm; AdamW minimising a quadratic.
#include <cmath>
#include <vector>

#include <weft/optim/optim.hpp>

#include "../ops/gradcheck.hpp"

namespace {

using namespace weft;
using weft::test::fill_uniform;
using weft::test::to_vector;
using Space = Kokkos::DefaultExecutionSpace;
using Param = nn::Parameter<double, Space>;

TEST_CASE("AdamW: two steps follow the bias-corrected update; decay only on decay() parameters") {
  Param w("w", 2, 3, true), b("b", 1, 3, false);
  fill_uniform(w.value, 1);
  fill_uniform(b.value, 2);
  std::vector<Param*> ps{&w, &b};
  optim::AdamWOptions o{.beta1 = 0.8, .beta2 = 0.9, .eps = 1e-8, .weight_decay = 0.5};
  optim::AdamW<double, Space> opt(ps, o);
  std::vector<std::vector<double>> p0{to_vector(w.value), to_vector(b.value)}, m(2), v(2);
  for (int k = 0; k < 2; ++k) m[k].assign(p0[k].size(), 0), v[k].assign(p0[k].size(), 0);
  const double lr = 0.1;
  for (int t = 1; t <= 2; ++t) {
    fill_uniform(w.grad, 10 + t);
    fill_uniform(b.grad, 20 + t);
    for (int k = 0; k < 2; ++k) {
      const auto g = to_vector(ps[k]->grad);
      const double keep = ps[k]->decay() ? 1 - lr * o.weight_decay : 1.0;
      for (std::size_t i = 0; i < g.size(); ++i) {
        m[k][i] = o.beta1 * m[k][i] + (1 - o.beta1) * g[i];
        v[k][i] = o.beta2 * v[k][i] + (1 - o.beta2) * g[i] * g[i];
        const double mh = m[k][i] / (1 - std::pow(o.beta1, t)), vh = v[k][i] / (1 - std::pow(o.beta2, t));
        p0[k][i] = keep * p0[k][i] - lr * mh / (std::sqrt(vh) + o.eps);
      }
    }
    opt.step(lr);
  }
  CHECK(opt.steps() == 2);
  for (int k = 0; k < 2; ++k) {
    const auto got = to_vector(ps[k]->value);
    for (std::size_t i = 0; i < got.size(); ++i) CHECK(got[i] == doctest::Approx(p0[k][i]).epsilon(1e-12));
  }
  CHECK(opt.memory().bytes(metrics::MemoryCategory::optimizer_state) == 2 * (6 + 3) * sizeof(double));
  CHECK_THROWS_AS(opt.step(-1.0), ConfigError);
  using Adam = optim::AdamW<double, Space>;
  CHECK_THROWS_AS(Adam(ps, {.beta1 = 1.0}), ConfigError);
}

TEST_CASE("SGD with momentum and weight decay follows b = mu b + g + wd p, p -= lr b") {
  Param w("w", 1, 4, true), b("b", 1, 2, false);
  fill_uniform(w.value, 3);
  fill_uniform(b.value, 4);
  std::vector<Param*> ps{&w, &b};
  optim::SGD<double, Space> opt(ps, {.momentum = 0.9, .weight_decay = 0.1});
  std::vector<std::vector<double>> p{to_vector(w.value), to_vector(b.value)}, buf{{0, 0, 0, 0}, {0, 0}};
  for (int t = 0; t < 3; ++t) {
    fill_uniform(w.grad, 30 + t);
    fill_uniform(b.grad, 40 + t);
    for (int k = 0; k < 2; ++k) {
      const auto g = to_vector(ps[k]->grad);
      for (std::size_t i = 0; i < g.size(); ++i) {
        buf[k][i] = 0.9 * buf[k][i] + g[i] + (k == 0 ? 0.1 * p[k][i] : 0.0);
        p[k][i] -= 0.05 * buf[k][i];
      }
    }
    opt.step(0.05);
  }
  for (int k = 0; k < 2; ++k) {
    const auto got = to_vector(ps[k]->value);
    for (std::size_t i = 0; i < got.size(); ++i) CHECK(got[i] == doctest::Approx(p[k][i]).epsilon(1e-13));
  }
  optim::SGD<double, Space> plain(ps);
  CHECK(plain.memory().total() == 0);  // no momentum, no state
}

TEST_CASE("clip_grad_norm returns the global norm and scales gradients down to max_norm") {
  Param a("a", 1, 2, true), b("b", 1, 1, false);
  auto set = [](Param& p, std::vector<double> v) {
    auto h = Kokkos::create_mirror_view(p.grad);
    for (std::size_t i = 0; i < v.size(); ++i) h(i) = v[i];
    Kokkos::deep_copy(p.grad, h);
  };
  set(a, {3, 0});
  set(b, {4});
  std::vector<Param*> ps{&a, &b};
  CHECK(optim::clip_grad_norm(ps, 10.0) == doctest::Approx(5.0));
  CHECK(to_vector(a.grad)[0] == 3.0);  // under the limit: untouched
  CHECK(optim::clip_grad_norm(ps, 1.0) == doctest::Approx(5.0));
  CHECK(optim::grad_norm(ps) == doctest::Approx(1.0).epsilon(1e-6));
  CHECK(to_vector(b.grad)[0] == doctest::Approx(0.8).epsilon(1e-6));
  CHECK(optim::clip_grad_norm(ps, 0.0) == doctest::Approx(1.0).epsilon(1e-6));  // 0: report only
}

TEST_CASE("AdamW: parameters adjacent in memory are one segment, updated as if one by one") {
  // Four parameters over one flat buffer, given in an order other than their
  // memory order, with an undecayed one in the middle: three segments (a b |
  // c | d), and each element follows the same update as separate parameters.
  using Flat = Kokkos::View<double*, Space>;
  Flat values("values", 20), grads("grads", 20);
  auto slice = [](Flat v, std::size_t lo, std::size_t n) { return Flat(Kokkos::subview(v, std::make_pair(lo, lo + n))); };
  Param a("a", slice(values, 0, 6), slice(grads, 0, 6), true), b("b", slice(values, 6, 4), slice(grads, 6, 4), true),
      c("c", slice(values, 10, 3), slice(grads, 10, 3), false), d("d", slice(values, 13, 7), slice(grads, 13, 7), true);
  Param a2("a", 1, 6, true), b2("b", 1, 4, true), c2("c", 1, 3, false), d2("d", 1, 7, true);
  fill_uniform(values, 7);
  std::vector<Param*> flat{&d, &b, &c, &a}, apart{&d2, &b2, &c2, &a2};
  for (std::size_t k = 0; k < 4; ++k) Kokkos::deep_copy(apart[k]->value, flat[k]->value);
  optim::AdamWOptions o{.beta1 = 0.8, .beta2 = 0.9, .eps = 1e-8, .weight_decay = 0.5};
  optim::AdamW<double, Space> one(flat, o), each(apart, o);
  CHECK(one.segments() == 3);
  CHECK(each.segments() == 4);
  for (int t = 1; t <= 3; ++t) {
    fill_uniform(grads, 30 + t);
    for (std::size_t k = 0; k < 4; ++k) Kokkos::deep_copy(apart[k]->grad, flat[k]->grad);
    one.step(0.1);
    each.step(0.1);
  }
  for (std::size_t k = 0; k < 4; ++k) {
    CHECK(to_vector(flat[k]->value) == to_vector(apart[k]->value));
    CHECK(to_vector(one.first_moment(k)) == to_vector(each.first_moment(k)));
    CHECK(to_vector(one.second_moment(k)) == to_vector(each.second_moment(k)));
  }
  // Storage that moves is found again: b now lives elsewhere, so it is its
  // own segment and a's run ends at a.
  Flat bv("bv", 4), bg("bg", 4);
  Kokkos::deep_copy(bv, b.value);
  b.value = bv;
  b.grad = bg;
  one.step(0.1);
  CHECK(one.segments() == 4);
}

TEST_CASE("AdamW minimises a quadratic") {
  Param x("x", 1, 5, false);
  fill_uniform(x.value, 5, -3, 3);
  std::vector<Param*> ps{&x};
  optim::AdamW<double, Space> opt(ps, {.weight_decay = 0});
  for (int t = 0; t < 500; ++t) {
    Kokkos::deep_copy(x.grad, x.value);  // gradient of |x|^2 / 2
    opt.step(0.05);
  }
  for (double v : to_vector(x.value)) CHECK(std::abs(v) < 0.05);
}

}  // namespace
