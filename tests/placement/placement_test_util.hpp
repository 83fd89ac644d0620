// Helpers of the placement tests: a global tensor every rank can compute, the
// partial values a rank contributes to it, element-by-element comparison
// of a DistView's local block with the global tensor, the text of the
// error a call throws, and the check of one host redistribution step that the
// node-local path tests share.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <string>
#include <tuple>

#include "weft_test.hpp"

namespace weft::test {

// Distinct small integers: exact in every element type, sums of a few of them
// too, and a misplaced element always shows.
template <class T>
T global_value(std::size_t g) {
  return static_cast<T>(g + 1);
}

// What coordinate c of an axis holds of value f when the tensor is Partial<Op>.
template <class Op, class T>
T contribution(T f, int c) {
  if constexpr (std::is_same_v<Op, Sum> || std::is_same_v<Op, Avg>) return f * static_cast<T>(c + 1);
  else if constexpr (std::is_same_v<Op, Max>) return f + static_cast<T>(c);
  else return f - static_cast<T>(c);
}

// The reduction over the p ranks of an axis of what contribution() gives.
template <class Op, class T>
T reduced(T f, int p) {
  if constexpr (std::is_same_v<Op, Sum>) return f * static_cast<T>(p * (p + 1) / 2);
  else if constexpr (std::is_same_v<Op, Avg>) return f * static_cast<T>(p + 1) / static_cast<T>(2);
  else if constexpr (std::is_same_v<Op, Max>) return f + static_cast<T>(p - 1);
  else return f - static_cast<T>(p - 1);
}

// Writes value(global linear index) into every local element.
template <class DV, class F>
void fill(const DV& x, F value) {
  auto h = Kokkos::create_mirror_view(x.local());
  const auto m = x.index_map();
  for (std::size_t n = 0; n < h.size(); ++n) h.data()[n] = value(m.global_linear(n));
  Kokkos::deep_copy(x.local(), h);
}

// How many local elements differ from expected(global linear index).
template <class DV, class F>
std::size_t mismatches(const DV& y, F expected) {
  auto h = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), y.local());
  const auto m = y.index_map();
  std::size_t bad = 0;
  for (std::size_t n = 0; n < h.size(); ++n)
    if (h.data()[n] != expected(m.global_linear(n))) ++bad;
  return bad;
}

// "what: N wrong elements", so that a failing CHECK says which case failed
// (the MPI harness reports the expression and its values only).
inline std::string wrong(const std::string& what, std::size_t n) {
  return what + ": " + std::to_string(n) + " wrong elements";
}

// The global tensor as a function of the global index, for fill and mismatches.
template <class T>
auto identity() {
  return [](std::size_t g) { return global_value<T>(g); };
}

// Whether the environment leaves a default-on switch on (anything but "0").
inline bool env_switch_on(const char* name) {
  const char* e = std::getenv(name);
  return !(e != nullptr && std::strcmp(e, "0") == 0);
}

// What check_host_step saw: how far `counter` moved over its two calls and
// the bytes of the rank's input.
struct HostStep {
  std::uint64_t moved = 0;
  std::size_t local_bytes = 0;
};

// An ordinary host x (From over Axis, Others elsewhere) of the given global
// extents redistributed to To over Axis in both forms (returning, and into an
// existing view): checks every element of both results, that the axis'
// statistics count two calls of the collective the step stands for, and that
// x is unchanged. `counter()` is the path counter the caller asks about.
template <class T, class Axis, class From, class To, class... Others, class MeshT, class Counter>
HostStep check_host_step(MeshT& mesh, const std::array<std::size_t, 3>& global, Counter counter) {
  using Src = BasicDistView<T, dextents<3>, Kokkos::HostSpace, Others..., On<Axis, From>>;
  using Dst = redistributed_t<Src, Axis, To>;
  const std::string what = mesh.describe() + ": " + Src::describe() + " to " + placement_name<To>() + " over " +
                           std::string(Axis::name) + " (" + std::to_string(global[0]) + "x" +
                           std::to_string(global[1]) + "x" + std::to_string(global[2]) + ")";
  INFO(what);
  Src x(mesh, global);
  fill(x, identity<T>());
  Comm& comm = mesh.template axis<Axis>();
  const CommStats before = comm.stats();
  const std::uint64_t counted = counter();
  auto y = redistribute<To>(x, Axis{});
  CHECK(wrong(what, mismatches(y, identity<T>())) == wrong(what, 0));
  Dst out(mesh, global);
  redistribute<To>(x, Axis{}, out);
  CHECK(wrong(what + " (into)", mismatches(out, identity<T>())) == wrong(what + " (into)", 0));
  constexpr CommKind kind = is_replicate_v<To> ? CommKind::all_gather : CommKind::all_to_all;
  CHECK(comm.stats()[kind].calls == before[kind].calls + 2);
  CHECK(comm.stats().total().calls == before.total().calls + 2);
  CHECK(wrong(what + " (input)", mismatches(x, identity<T>())) == wrong(what + " (input)", 0));
  HostStep r;
  r.moved = counter() - counted;
  r.local_bytes = sizeof(T);
  for (std::size_t e : x.local_extents()) r.local_bytes *= e;
  return r;
}

// Calls f.template operator()<From, To>() for every Shard -> Replicate and
// Shard<i> -> Shard<j> (i != j) step of a rank-3 tensor.
template <class F>
void for_each_shard_step(F&& f) {
  f.template operator()<Shard<0>, Replicate>();
  f.template operator()<Shard<1>, Replicate>();
  f.template operator()<Shard<2>, Replicate>();
  f.template operator()<Shard<0>, Shard<1>>();
  f.template operator()<Shard<0>, Shard<2>>();
  f.template operator()<Shard<1>, Shard<0>>();
  f.template operator()<Shard<1>, Shard<2>>();
  f.template operator()<Shard<2>, Shard<0>>();
  f.template operator()<Shard<2>, Shard<1>>();
}

// Calls f.template operator()<Exec>() for every execution space of the build.
template <class F>
void for_each_exec_space(F&& f) {
  [&]<class... E>(std::tuple<E...>*) { (f.template operator()<E>(), ...); }(static_cast<std::tuple<WEFT_TEST_EXEC_SPACES>*>(nullptr));
}

}  // namespace weft::test
