// nn::Chain and nn::Residual (weft/nn/chain.hpp): a block declared as a
// sequence of placed steps, its backward generated. On Mesh<TP> with tp =
// the world size (1 or 2), in double:
// - the residual MLP of examples/custom_model.cpp, declared as
//   Residual<Chain<Rep, Up, Gelu, Down, Reduce<TP>>>, gives the output, the
//   input gradient and every parameter gradient of the hand-written block
//   it replaced, bit for bit, with and without the split backward's
//   deferred weight gradients;
// - with Gelu, Relu and Silu, the generated input gradient matches central
//   differences of sum(y * r) (a wrong activation derivative fails it: Silu's
//   as g s(x) is 4.6e-2 off). At tp = 2 the chain all-reduces the
//   Partial<Sum> gradient of its Replicate input; a chain that did not
//   would not compile (the gradient could not be added to the Replicate
//   residual, weft::add's static_assert);
// - saved_bytes counts the kept intermediate tensors but not the chain's
//   input or the input nn::Reduce does not need.
#include <cmath>
#include <cstdio>
#include <string>
#include <vector>

#include <weft/nn/chain.hpp>
#include <weft/nn/tensor_parallel.hpp>

#include "weft_test.hpp"

namespace {

using namespace weft;
using T = double;
using Space = Kokkos::DefaultExecutionSpace;
using Matrix = Kokkos::View<T**, Kokkos::LayoutRight, Space>;
using MeshT = Mesh<TP>;
using Up = nn::Linear<T, On<TP, Shard<0>>>;
using Down = nn::Linear<T, On<TP, Shard<1>>>;
using Rep = DistView<T, 2, On<TP, Replicate>>;
using Param = nn::Parameter<T, Space>;
constexpr std::size_t kRows = 3, kWidth = 4, kHidden = 8;

Up make_up(MeshT& mesh) { return Up(mesh, kWidth, kHidden, {"block.up", true, 7, 0.3}); }
Down make_down(MeshT& mesh) { return Down(mesh, kHidden, kWidth, {"block.down", true, 7, 0.2}); }

// The block as examples/custom_model.cpp wrote it by hand before nn::Chain.
class HandWritten {
  using Hidden = decltype(std::declval<const Up&>().forward(std::declval<const Rep&>()));

 public:
  struct Saved {
    Hidden h, a;
  };
  explicit HandWritten(MeshT& mesh) : mesh_(&mesh), up_(make_up(mesh)), down_(make_down(mesh)) {}
  void forward(const Matrix& x, const Matrix& y, Saved& s) {
    const Rep X(*mesh_, {x.extent(0), kWidth}, x);
    s.h = up_.forward(X);
    s.a = weft::gelu(s.h);
    auto r = weft::redistribute<weft::Replicate>(down_.forward(s.a), weft::TP{});
    weft::add(X, r, Rep(*mesh_, {y.extent(0), kWidth}, y));
  }
  void backward(const Matrix& x, const Matrix& dy, const Matrix& dx, Saved& s, nn::DeferredWork* work) {
    up_.defer_weight_gradients(work);
    down_.defer_weight_gradients(work);
    const Rep X(*mesh_, {x.extent(0), kWidth}, x), DY(*mesh_, {dy.extent(0), kWidth}, dy);
    auto da = down_.backward(s.a, DY);
    weft::ops::gelu_backward(da.local(), s.h.local(), da.local());
    auto dr = weft::redistribute<weft::Replicate>(up_.backward(X, da), weft::TP{});
    weft::add(DY, dr, Rep(*mesh_, {dx.extent(0), kWidth}, dx));
    up_.defer_weight_gradients(nullptr);
    down_.defer_weight_gradients(nullptr);
  }
  void collect(std::vector<Param*>& ps) {
    up_.local().collect(ps);
    down_.local().collect(ps);
  }

 private:
  MeshT* mesh_;
  Up up_;
  Down down_;
};

template <class Act>
using Body = nn::Chain<Rep, Up, Act, Down, nn::Reduce<TP>>;
template <class Act>
Body<Act> make_body(MeshT& mesh) {
  return Body<Act>(make_up(mesh), Act{}, make_down(mesh), nn::Reduce<TP>{});
}

Matrix filled(const char* name, std::size_t salt) {
  Matrix m(std::string(name), kRows, kWidth);
  auto h = Kokkos::create_mirror_view(m);
  for (std::size_t i = 0; i < kRows; ++i)
    for (std::size_t j = 0; j < kWidth; ++j) h(i, j) = std::sin(double(salt * 31 + i * kWidth + j) * 0.7) * 1.5;
  Kokkos::deep_copy(m, h);
  return m;
}
std::vector<double> host(const Matrix& m) {
  auto h = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), m);
  return std::vector<double>(h.data(), h.data() + h.size());
}
std::vector<std::vector<double>> grads(std::vector<Param*> ps) {
  std::vector<std::vector<double>> out;
  for (auto* p : ps) {
    auto h = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), p->grad);
    out.emplace_back(h.data(), h.data() + h.size());
  }
  return out;
}

}  // namespace

TEST_CASE("a Residual<Chain> block gives the hand-written block's output and gradients bit for bit") {
  auto& w = test::world();
  if (w.size() > 2) return;
  MeshT mesh(w, w.size());
  for (bool deferred : {false, true}) {
    CAPTURE(deferred);
    const Matrix x = filled("x", 1), dy = filled("dy", 2);
    Matrix y1("y1", kRows, kWidth), y2("y2", kRows, kWidth), dx1("dx1", kRows, kWidth), dx2("dx2", kRows, kWidth);
    HandWritten hand(mesh);
    HandWritten::Saved hs;
    nn::Residual<Body<nn::Gelu>> chain(make_body<nn::Gelu>(mesh));
    Body<nn::Gelu>::Saved cs;
    std::vector<Param*> hp, cp;
    hand.collect(hp);
    chain.collect(cp);
    REQUIRE(hp.size() == 4);
    REQUIRE(cp.size() == 4);
    for (int pass = 0; pass < 2; ++pass) {  // twice: gradients accumulate, outputs are reused
      nn::DeferredWork hw, cw;
      hand.forward(x, y1, hs);
      hand.backward(x, dy, dx1, hs, deferred ? &hw : nullptr);
      chain.forward(Rep(mesh, {kRows, kWidth}, x), Rep(mesh, {kRows, kWidth}, y2), cs);
      if (deferred) chain.defer_weight_gradients(&cw);
      chain.backward(Rep(mesh, {kRows, kWidth}, dy), Rep(mesh, {kRows, kWidth}, dx2), cs);
      chain.defer_weight_gradients(nullptr);
      hw.run();
      cw.run();
    }
    CHECK(host(y1) == host(y2));
    CHECK(host(dx1) == host(dx2));
    CHECK(grads(hp) == grads(cp));
    // Kept: the hidden pre-activation and activation (this rank's columns);
    // not x (the caller's) nor the row-parallel output that Reduce does not need.
    CHECK(chain.body().saved_bytes(cs) == 2 * kRows * (kHidden / std::size_t(w.size())) * sizeof(T));
  }
}

namespace {
// sum(y * r) for the chain's output y on x.
template <class Act>
double objective(Body<Act>& f, MeshT& mesh, const Matrix& x, const Matrix& r) {
  typename Body<Act>::Saved s;
  const auto y = f.forward(Rep(mesh, {kRows, kWidth}, x), s);
  const auto hy = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), y.local());
  const auto hr = host(r);
  double sum = 0;
  for (std::size_t i = 0; i < hr.size(); ++i) sum += hy.data()[i] * hr[i];
  return sum;
}

template <class Act>
void check_input_gradient(const char* name) {
  auto& w = test::world();
  MeshT mesh(w, w.size());
  auto f = make_body<Act>(mesh);
  const Matrix x = filled("x", 3), r = filled("r", 4);
  typename Body<Act>::Saved s;
  f.forward(Rep(mesh, {kRows, kWidth}, x), s);
  const auto dx = f.backward(Rep(mesh, {kRows, kWidth}, r), s);
  const auto g = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), dx.local());
  auto hx = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), x);
  const double eps = 1e-6;
  double worst = 0;
  for (std::size_t i = 0; i < kRows; ++i)
    for (std::size_t j = 0; j < kWidth; ++j) {
      const double v = hx(i, j);
      hx(i, j) = v + eps;
      Kokkos::deep_copy(x, hx);
      const double up = objective(f, mesh, x, r);
      hx(i, j) = v - eps;
      Kokkos::deep_copy(x, hx);
      const double down = objective(f, mesh, x, r);
      hx(i, j) = v;
      Kokkos::deep_copy(x, hx);
      const double fd = (up - down) / (2 * eps);
      worst = std::max(worst, std::abs(fd - g(i, j)) / std::max(1.0, std::abs(fd)));
    }
  CAPTURE(name);
  CAPTURE(worst);
  CHECK(worst < 1e-7);
}
}  // namespace

TEST_CASE("the generated input gradient of Gelu, Relu and Silu chains matches central differences") {
  if (test::world().size() > 2) return;
  check_input_gradient<nn::Gelu>("gelu");
  check_input_gradient<nn::Relu>("relu");
  check_input_gradient<nn::Silu>("silu");
}
