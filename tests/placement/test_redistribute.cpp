// Every redistribution pair, checked by its law on every element: after
// redistribute<To>, each rank's block equals the global tensor (reduced, where
// the source was Partial) at the global indices the new placement gives it.
// On 1-axis meshes of every rank count and on every 2-axis factorisation of it.
#include <optional>
#include <string>

#include "placement_test_util.hpp"

using namespace weft;
using weft::test::contribution;
using weft::test::fill;
using weft::test::global_value;
using weft::test::mismatches;
using weft::test::reduced;
using weft::test::wrong;

namespace {

template <class From, class To>
struct Pair {
  using from = From;
  using to = To;
};

using Pairs = type_list<
    Pair<Shard<0>, Replicate>, Pair<Shard<1>, Replicate>, Pair<Shard<2>, Replicate>,          // all-gather
    Pair<Partial<Sum>, Replicate>, Pair<Partial<Max>, Replicate>, Pair<Partial<Min>, Replicate>,  // all-reduce
    Pair<Partial<Sum>, Shard<0>>, Pair<Partial<Sum>, Shard<1>>, Pair<Partial<Sum>, Shard<2>>,   // reduce-scatter
    Pair<Partial<Max>, Shard<1>>,
    Pair<Shard<0>, Shard<1>>, Pair<Shard<0>, Shard<2>>, Pair<Shard<1>, Shard<0>>,                // all-to-all
    Pair<Shard<1>, Shard<2>>, Pair<Shard<2>, Shard<0>>, Pair<Shard<2>, Shard<1>>,
    Pair<Replicate, Shard<0>>, Pair<Replicate, Shard<1>>, Pair<Replicate, Shard<2>>,          // local slice
    Pair<Replicate, Replicate>, Pair<Shard<1>, Shard<1>>, Pair<Partial<Sum>, Partial<Sum>>>;  // nothing
// The mean exists for floating-point elements only.
using AvgPairs = type_list<Pair<Partial<Avg>, Replicate>, Pair<Partial<Avg>, Shard<2>>>;

// The collective a pair must use, or none.
template <class From, class To>
std::optional<CommKind> expected_kind() {
  if constexpr (std::is_same_v<From, To> || is_replicate_v<From>) return std::nullopt;
  else if constexpr (is_shard_v<From> && is_replicate_v<To>) return CommKind::all_gather;
  else if constexpr (is_partial_v<From> && is_replicate_v<To>) return CommKind::all_reduce;
  else if constexpr (is_partial_v<From>) return CommKind::reduce_scatter;
  else return CommKind::all_to_all;
}

// Ranks that split dimension d under DV's placements, computed from the mesh.
template <class DV, class MeshT>
std::size_t parts(MeshT& mesh, std::size_t d) {
  std::size_t n = 1;
  [&]<class... O>(type_list<O...>) {
    ((n *= (detail::shard_dim_or_npos<typename O::placement>() == d ? std::size_t(mesh.template extent<typename O::axis>()) : 1)), ...);
  }(typename DV::placements{});
  return n;
}

// Redistributes a tensor placed From over Axis (and Others over other axes,
// listed first so that Axis is the innermost split) to To, and checks every
// element, the local shape and the collective used.
template <class T, class Space, class Axis, class From, class To, class... Others, class MeshT>
void check_pair(MeshT& mesh, const std::array<std::size_t, 3>& global) {
  using Src = BasicDistView<T, dextents<3>, Space, Others..., On<Axis, From>>;
  const int p = mesh.template extent<Axis>();
  const int c = mesh.template coord<Axis>();
  const std::string what = mesh.describe() + ": " + Src::describe() + " to " + placement_name<To>() + " over " +
                           std::string(Axis::name);
  INFO(what);
  Src x(mesh, global);
  fill(x, [&](std::size_t g) {
    const T f = global_value<T>(g);
    if constexpr (is_partial_v<From>) return contribution<typename From::op>(f, c);
    else return f;
  });
  Comm& comm = mesh.template axis<Axis>();
  const CommStats before = comm.stats();

  auto y = redistribute<To>(x, Axis{});

  using Y = decltype(y);
  static_assert(std::is_same_v<typename Y::template placement_on<Axis>, To>);
  for (std::size_t d = 0; d < 3; ++d) {
    CHECK(y.global_extent(d) == global[d]);
    CHECK(y.local().extent(d) * parts<Y>(mesh, d) == global[d]);
  }
  const std::size_t bad = mismatches(y, [&](std::size_t g) {
    const T f = global_value<T>(g);
    if constexpr (is_partial_v<From> && is_partial_v<To>) return contribution<typename From::op>(f, c);
    else if constexpr (is_partial_v<From>) return reduced<typename From::op>(f, p);
    else return f;
  });
  CHECK(wrong(what, bad) == wrong(what, 0));
  const auto kind = expected_kind<From, To>();
  const CommStats& after = comm.stats();
  if (kind) {
    CHECK(after[*kind].calls == before[*kind].calls + 1);
    CHECK(after.total().calls == before.total().calls + 1);
  } else {
    CHECK(after.total().calls == before.total().calls);
  }
  if constexpr (std::is_same_v<From, To>) CHECK(y.local().data() == x.local().data());
}

template <class T, class Space, class Axis, class... Others, class MeshT, class... P>
void check_pairs(MeshT& mesh, type_list<P...>) {
  const std::array<std::size_t, 3> global{8, 16, 8};
  (check_pair<T, Space, Axis, typename P::from, typename P::to, Others...>(mesh, global), ...);
}

template <class T, class Space, class Axis, class... Others, class MeshT>
void check_all_pairs(MeshT& mesh) {
  check_pairs<T, Space, Axis, Others...>(mesh, Pairs{});
  if constexpr (std::is_floating_point_v<T>) check_pairs<T, Space, Axis, Others...>(mesh, AvgPairs{});
}

}  // namespace

TEST_CASE_TEMPLATE("every redistribution pair on a 1-axis mesh", T, float, double, int) {
  auto& world = weft::test::world();
  Mesh<TP> mesh(world, world.size());
  weft::test::for_each_exec_space([&]<class Exec>() { check_all_pairs<T, typename Exec::memory_space, TP>(mesh); });
}

TEST_CASE_TEMPLATE("every redistribution pair on 2-axis meshes", T, float, double, int) {
  auto& world = weft::test::world();
  for (int dp = 1; dp <= world.size(); ++dp) {
    if (world.size() % dp != 0) continue;
    Mesh<DP, TP> mesh(world, dp, world.size() / dp);
    weft::test::for_each_exec_space([&]<class Exec>() {
      using Space = typename Exec::memory_space;
      // The other axis shards a dimension too (the same one, for some pairs).
      check_all_pairs<T, Space, TP, On<DP, Shard<0>>>(mesh);
      check_all_pairs<T, Space, DP, On<TP, Shard<2>>>(mesh);
    });
  }
}
