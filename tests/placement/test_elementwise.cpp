// Element-wise operations on DistViews (weft/placement/elementwise.hpp,
// mul included): for
// each operation and each placement combination it accepts, on Mesh<TP> and
// Mesh<DP, TP>, the result gathered with redistribute<Replicate> equals the
// operation on the full tensor computed in one process, element by element.
// And gelu after the all-reduce of a Partial<Sum> tensor is the
// single-process value, which gelu on the .local() block of the partial sums
// is not. The misuses are compile_fail.strategy_* tests.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <string>
#include <type_traits>
#include <vector>

#include "placement_test_util.hpp"

using namespace weft;
using weft::test::contains;
using weft::test::contribution;
using weft::test::error_text;
using weft::test::fill;
using weft::test::reduced;
using weft::test::wrong;

namespace {

using T = float;

// Dyadic values in [-1, 1] and [-2, 2]: their sums and small multiples are
// exact in float, so the linear operations compare exactly.
T value_a(std::size_t g) { return T(int((g * 37 + 11) % 33) - 16) / T(16); }
T value_b(std::size_t g) { return T(int((g * 13 + 5) % 29) - 14) / T(8); }

template <class P, class Axis, class MeshT>
T contribute(T v, MeshT& mesh) {
  if constexpr (is_partial_v<P>) return contribution<typename P::op>(v, mesh.template coord<Axis>());
  else return v;
}
template <class P, class Axis, class MeshT>
T reduce(T v, MeshT& mesh) {
  if constexpr (is_partial_v<P>) return reduced<typename P::op>(v, mesh.template extent<Axis>());
  else return v;
}

// Fills x so that it holds the global tensor f: over a Partial axis, what
// this rank contributes to it.
template <class DV, class MeshT, class F>
void fill_placed(MeshT& mesh, const DV& x, F f) {
  fill(x, [&](std::size_t g) {
    T v = f(g);
    [&]<class... O>(type_list<O...>) {
      ((v = contribute<typename O::placement, typename O::axis>(v, mesh)), ...);
    }(typename DV::placements{});
    return v;
  });
}

// The global tensor x holds (the reduction of what fill_placed wrote), in
// row-major order: what a single process computes with.
template <class DV, class MeshT, class F>
std::vector<T> full_of(MeshT& mesh, std::size_t n, F f) {
  std::vector<T> out(n);
  for (std::size_t g = 0; g < n; ++g) {
    T v = f(g);
    [&]<class... O>(type_list<O...>) {
      ((v = reduce<typename O::placement, typename O::axis>(v, mesh)), ...);
    }(typename DV::placements{});
    out[g] = v;
  }
  return out;
}

// The last-listed axis over which a placement list is not Replicate (void if none).
template <class List>
struct last_open {
  using type = void;
};
template <class First, class... Rest>
struct last_open<type_list<First, Rest...>> {
  using rest = typename last_open<type_list<Rest...>>::type;
  using type = std::conditional_t<!std::is_void_v<rest>, rest,
                                  std::conditional_t<is_replicate_v<typename First::placement>, void, typename First::axis>>;
};

// y redistributed to Replicate over every axis, inner (later-listed) axes first.
template <class DV>
auto gather(const DV& y) {
  using A = typename last_open<typename DV::placements>::type;
  if constexpr (std::is_void_v<A>) return y;
  else return gather(redistribute<Replicate>(y, A{}));
}

// How many elements of y (gathered) differ from want by more than tol relative.
template <class DV>
std::size_t differ(const DV& y, const std::vector<T>& want, T tol) {
  auto full = gather(y);
  auto h = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), full.local());
  if (h.size() != want.size()) return want.size() + 1;
  std::size_t bad = 0;
  for (std::size_t n = 0; n < h.size(); ++n) {
    const T d = std::abs(h.data()[n] - want[n]);
    if (!(d <= tol * std::max(T(1), std::abs(want[n])))) ++bad;
  }
  return bad;
}

template <class F>
std::vector<T> map(const std::vector<T>& in, F f) {
  std::vector<T> out(in.size());
  for (std::size_t n = 0; n < in.size(); ++n) out[n] = f(in[n]);
  return out;
}

// The activations compare to about an ulp (the same formula on the host);
// the linear operations exactly.
constexpr T activation_tol = T(1e-6);

template <class List>
using Dist = with_placements_t<DistView<T, 2>, List>;

template <class List, class MeshT>
void check_unary(MeshT& mesh, std::size_t rows, std::size_t cols, const std::string& where) {
  using X = Dist<List>;
  const std::string what = where + " " + X::describe();
  X x(mesh, rows, cols);
  fill_placed(mesh, x, value_a);
  const auto in = full_of<X>(mesh, rows * cols, value_a);
  constexpr bool partial = []<class... O>(type_list<O...>) {
    return (false || ... || is_partial_v<typename O::placement>);
  }(List{});
  if constexpr (!partial) {
    CHECK(wrong(what + " gelu", differ(gelu(x), map(in, [](T v) { return ops::detail::gelu_value(v); }), activation_tol)) ==
          wrong(what + " gelu", 0));
    CHECK(wrong(what + " relu", differ(relu(x), map(in, [](T v) { return v > 0 ? v : T(0); }), 0)) ==
          wrong(what + " relu", 0));
    CHECK(wrong(what + " silu", differ(silu(x), map(in, [](T v) { return v * ops::detail::sigmoid(v); }), activation_tol)) ==
          wrong(what + " silu", 0));
    static_assert(std::is_same_v<decltype(gelu(x)), X>);
  }
  auto s = scale(T(-3), x);
  static_assert(std::is_same_v<decltype(s), X>);
  CHECK(wrong(what + " scale", differ(s, map(in, [](T v) { return T(-3) * v; }), 0)) == wrong(what + " scale", 0));
}

// A binary operation of kind Kind, op(a, b) and op(a, b, y), against
// combine on the full tensors: exact for the dyadic values (and their rank
// multiples) used here; in place too when a has the result's type.
template <class Kind, class LA, class LB, class MeshT, class Op, class Combine>
void check_binary(MeshT& mesh, std::size_t rows, std::size_t cols, const std::string& where, const char* sym, Op op,
                  Combine combine) {
  using A = Dist<LA>;
  using B = Dist<LB>;
  const std::string what = where + " " + A::describe() + sym + B::describe();
  A a(mesh, rows, cols);
  B b(mesh, rows, cols);
  fill_placed(mesh, a, value_a);
  fill_placed(mesh, b, value_b);
  const auto ia = full_of<A>(mesh, rows * cols, value_a), ib = full_of<B>(mesh, rows * cols, value_b);
  std::vector<T> want(ia.size());
  for (std::size_t n = 0; n < want.size(); ++n) want[n] = combine(ia[n], ib[n]);
  auto y = op(a, b);
  static_assert(std::is_same_v<decltype(y), elementwise_result_t<Kind, A, B>>);
  CHECK(wrong(what, differ(y, want, 0)) == wrong(what, 0));
  decltype(y) into(mesh, rows, cols);
  op(a, b, into);
  CHECK(wrong(what + " into", differ(into, want, 0)) == wrong(what + " into", 0));
  if constexpr (std::is_same_v<A, decltype(y)>) {
    op(a, b, a);
    CHECK(wrong(what + " in place", differ(a, want, 0)) == wrong(what + " in place", 0));
  }
}

// weft::add and weft::mul, each as one callable for both of its forms.
struct AddOp {
  template <class A, class B>
  auto operator()(const A& a, const B& b) const { return add(a, b); }
  template <class A, class B, class Y>
  void operator()(const A& a, const B& b, const Y& y) const { add(a, b, y); }
};
struct MulOp {
  template <class A, class B>
  auto operator()(const A& a, const B& b) const { return mul(a, b); }
  template <class A, class B, class Y>
  void operator()(const A& a, const B& b, const Y& y) const { mul(a, b, y); }
};

template <class LA, class LB, class MeshT>
void check_add(MeshT& mesh, std::size_t rows, std::size_t cols, const std::string& where) {
  check_binary<Additive, LA, LB>(mesh, rows, cols, where, " + ", AddOp{}, [](T x, T y) { return x + y; });
}
template <class LA, class LB, class MeshT>
void check_mul(MeshT& mesh, std::size_t rows, std::size_t cols, const std::string& where) {
  check_binary<Multiplicative, LA, LB>(mesh, rows, cols, where, " * ", MulOp{}, [](T x, T y) { return x * y; });
}

template <class LX, class LB, class MeshT>
void check_bias(MeshT& mesh, std::size_t rows, std::size_t cols, const std::string& where) {
  using X = Dist<LX>;
  using B = with_placements_t<DistView<T, 1>, LB>;
  const std::string what = where + " " + X::describe() + " + bias " + B::describe();
  X x(mesh, rows, cols);
  B b(mesh, cols);
  fill_placed(mesh, x, value_a);
  fill(b, value_b);
  const auto ix = full_of<X>(mesh, rows * cols, value_a);
  std::vector<T> want(ix.size());
  for (std::size_t n = 0; n < want.size(); ++n) want[n] = ix[n] + value_b(n % cols);
  auto y = bias_add(x, b);
  static_assert(std::is_same_v<decltype(y), X>);
  CHECK(wrong(what, differ(y, want, 0)) == wrong(what, 0));
}

template <class... O>
using L = type_list<O...>;

}  // namespace

TEST_CASE("element-wise operations on a 1-axis mesh equal the single-process result") {
  auto& world = weft::test::world();
  const std::size_t w = std::size_t(world.size());
  Mesh<TP> mesh(world, int(w));
  const std::size_t rows = 2 * w, cols = 4 * w;
  const std::string where = mesh.describe();

  check_unary<L<>>(mesh, rows, cols, where);
  check_unary<L<On<TP, Replicate>>>(mesh, rows, cols, where);
  check_unary<L<On<TP, Shard<0>>>>(mesh, rows, cols, where);
  check_unary<L<On<TP, Shard<1>>>>(mesh, rows, cols, where);
  check_unary<L<On<TP, Partial<Sum>>>>(mesh, rows, cols, where);  // scale only: linear
  check_unary<L<On<TP, Partial<Avg>>>>(mesh, rows, cols, where);

  check_add<L<>, L<>>(mesh, rows, cols, where);
  check_add<L<>, L<On<TP, Replicate>>>(mesh, rows, cols, where);
  check_add<L<On<TP, Shard<0>>>, L<On<TP, Shard<0>>>>(mesh, rows, cols, where);
  check_add<L<On<TP, Shard<1>>>, L<On<TP, Shard<1>>>>(mesh, rows, cols, where);
  check_add<L<On<TP, Partial<Sum>>>, L<On<TP, Partial<Sum>>>>(mesh, rows, cols, where);
  check_add<L<On<TP, Partial<Avg>>>, L<On<TP, Partial<Avg>>>>(mesh, rows, cols, where);

  check_mul<L<>, L<>>(mesh, rows, cols, where);
  check_mul<L<On<TP, Shard<0>>>, L<On<TP, Shard<0>>>>(mesh, rows, cols, where);
  check_mul<L<On<TP, Shard<1>>>, L<On<TP, Shard<1>>>>(mesh, rows, cols, where);
  check_mul<L<On<TP, Partial<Sum>>>, L<On<TP, Replicate>>>(mesh, rows, cols, where);
  check_mul<L<>, L<On<TP, Partial<Sum>>>>(mesh, rows, cols, where);  // Replicate * Partial: Partial
  check_mul<L<On<TP, Partial<Avg>>>, L<>>(mesh, rows, cols, where);

  check_bias<L<>, L<>>(mesh, rows, cols, where);
  check_bias<L<On<TP, Shard<0>>>, L<>>(mesh, rows, cols, where);
  check_bias<L<On<TP, Shard<0>>>, L<On<TP, Replicate>>>(mesh, rows, cols, where);
  check_bias<L<On<TP, Shard<1>>>, L<On<TP, Shard<0>>>>(mesh, rows, cols, where);
}

TEST_CASE("element-wise operations on a 2-axis mesh equal the single-process result") {
  auto& world = weft::test::world();
  const int w = world.size();
  const int dp = w % 2 == 0 ? 2 : 1;
  Mesh<DP, TP> mesh(world, dp, w / dp);
  const std::size_t rows = 2 * std::size_t(w), cols = 4 * std::size_t(w);
  const std::string where = mesh.describe();

  check_unary<L<On<DP, Shard<0>>, On<TP, Shard<1>>>>(mesh, rows, cols, where);
  check_unary<L<On<DP, Shard<0>>, On<TP, Shard<0>>>>(mesh, rows, cols, where);
  check_unary<L<On<DP, Shard<0>>, On<TP, Partial<Sum>>>>(mesh, rows, cols, where);
  check_unary<L<On<DP, Partial<Sum>>, On<TP, Partial<Sum>>>>(mesh, rows, cols, where);

  check_add<L<On<DP, Shard<0>>, On<TP, Shard<1>>>, L<On<TP, Shard<1>>, On<DP, Shard<0>>>>(mesh, rows, cols, where);
  check_add<L<On<TP, Shard<1>>>, L<On<DP, Replicate>, On<TP, Shard<1>>>>(mesh, rows, cols, where);
  check_add<L<On<DP, Shard<0>>, On<TP, Partial<Sum>>>, L<On<DP, Shard<0>>, On<TP, Partial<Sum>>>>(mesh, rows, cols,
                                                                                                   where);

  check_mul<L<On<DP, Shard<0>>, On<TP, Shard<1>>>, L<On<TP, Shard<1>>, On<DP, Shard<0>>>>(mesh, rows, cols, where);
  check_mul<L<On<DP, Shard<0>>, On<TP, Partial<Sum>>>, L<On<DP, Shard<0>>>>(mesh, rows, cols, where);

  check_bias<L<On<DP, Shard<0>>, On<TP, Shard<1>>>, L<On<TP, Shard<0>>>>(mesh, rows, cols, where);
  check_bias<L<On<DP, Shard<1>>, On<TP, Shard<0>>>, L<On<DP, Shard<0>>>>(mesh, rows, cols, where);
  check_bias<L<On<DP, Shard<0>>, On<TP, Shard<1>>>, L<On<DP, Replicate>, On<TP, Shard<0>>>>(mesh, rows, cols, where);

  // A reduced tensor goes through the activations: all-reduce over TP, or
  // reduce-scatter to the features' Shard<1>.
  using P = DistView<T, 2, On<DP, Shard<0>>, On<TP, Partial<Sum>>>;
  P x(mesh, rows, cols);
  fill_placed(mesh, x, value_a);
  const auto gelu_in = map(full_of<P>(mesh, rows * cols, value_a), [](T v) { return ops::detail::gelu_value(v); });
  CHECK(wrong(where + " gelu after all-reduce", differ(gelu(redistribute<Replicate>(x, TP{})), gelu_in, activation_tol)) ==
        wrong(where + " gelu after all-reduce", 0));
  CHECK(wrong(where + " gelu after reduce-scatter", differ(gelu(redistribute<Shard<1>>(x, TP{})), gelu_in,
                                                           activation_tol)) == wrong(where + " gelu after reduce-scatter", 0));
}

TEST_CASE("gelu after the all-reduce of partial sums is the single-process value") {
  auto& world = weft::test::world();
  const int w = world.size();
  Mesh<TP> mesh(world, w);
  const int c = mesh.coord<TP>();
  // Partial sums of 0.1: ranks 0 and 1 hold 0.01 and 0.09 (one rank: 0.1), the others 0.
  const T part = w == 1 ? T(0.1) : c == 0 ? T(0.01) : c == 1 ? T(0.09) : T(0);
  const T whole = w == 1 ? T(0.1) : T(0.01) + T(0.09);
  DistView<T, 2, On<TP, Partial<Sum>>> x(mesh, 1, 1);
  Kokkos::deep_copy(x.local(), part);
  const T single = ops::detail::gelu_value(whole);

  // The typed path: reduce, then gelu.
  auto typed = gelu(redistribute<Replicate>(x, TP{}));
  auto ht = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), typed.local());
  CHECK(std::abs(ht(0, 0) - single) <= activation_tol * std::abs(single));

  // gelu on the partial sums' .local() block (what the checks cannot see),
  // then the all-reduce: the sum of gelu over the ranks.
  DistView<T, 2, On<TP, Partial<Sum>>> escaped(mesh, 1, 1);
  ops::gelu_forward(x.local(), escaped.local());
  auto summed = redistribute<Replicate>(escaped, TP{});
  auto hs = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), summed.local());
  if (w > 1) CHECK(std::abs(hs(0, 0) - single) > T(1e-4));
  if (world.rank() == 0)
    std::printf("gelu of the partial sums of 0.1 at %d ranks: weft::gelu after all-reduce %.6f, single process %.6f, "
                "gelu on .local() then all-reduce %.6f\n",
                w, double(ht(0, 0)), double(single), double(hs(0, 0)));
}

TEST_CASE("element-wise operations check shapes and meshes at run time") {
  auto& world = weft::test::world();
  const int w = world.size();
  Mesh<TP> mesh(world, w), other(world, w);
  DistView<T, 2, On<TP, Shard<1>>> a(mesh, 2, 4 * w), b(mesh, 2, 8 * w), c(other, 2, 4 * w);
  DistView<T, 1, On<TP, Shard<0>>> bias(mesh, 8 * w);
  CHECK(contains(error_text([&] { (void)add(a, b); }), "weft::add: the operands' global extents differ in dimension 1"));
  CHECK(contains(error_text([&] { (void)add(a, c); }), "live on different meshes"));
  CHECK(contains(error_text([&] { add(a, a, b); }), "and the result's " + std::to_string(8 * w)));
  CHECK(contains(error_text([&] { add(a, a, c); }), "live on different meshes"));
  CHECK(contains(error_text([&] { (void)bias_add(a, bias); }),
                 "the bias has " + std::to_string(8 * w) + " elements but the tensor's last dimension has " +
                     std::to_string(4 * w)));
}
