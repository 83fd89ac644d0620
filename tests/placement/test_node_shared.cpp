// NodeShared: DistViews in node-shared windows, and redistribute copying the
// peers' blocks straight out of them. Every result is checked element by
// element against the global tensor; the tests also check which path ran
// (NodeShared::direct_redistributions), the statistics recorded, the
// fallback when one rank's input is not shared, inputs at an offset inside a
// window, non-blocking and chained forms, 2-axis meshes and misuse errors.
#include <string>

#include "placement_test_util.hpp"

using namespace weft;
using weft::test::contains;
using weft::test::error_text;
using weft::test::fill;
using weft::test::global_value;
using weft::test::identity;
using weft::test::mismatches;
using weft::test::wrong;

namespace {

using Host = Kokkos::HostSpace;

// The node-shared path runs when the axis has more than one rank and lies in
// one node (always, on a single machine).
template <class Axis, class MeshT>
bool direct_expected(MeshT& mesh) {
  return mesh.template axis<Axis>().size() > 1 && mesh.template within_node<Axis>();
}

// x (placed From over Axis, Others elsewhere) allocated in shm; redistributes
// it to To over Axis, checks every element, the statistics and the path.
template <class T, class Axis, class From, class To, class... Others, class MeshT>
void check_direct(NodeShared& shm, MeshT& mesh, const std::array<std::size_t, 3>& global) {
  using Src = BasicDistView<T, dextents<3>, Host, Others..., On<Axis, From>>;
  const std::string what = mesh.describe() + ": node-shared " + Src::describe() + " to " + placement_name<To>() +
                           " over " + std::string(Axis::name);
  INFO(what);
  auto x = shm.dist_view<Src>(mesh, global);
  fill(x, identity<T>());
  Comm& comm = mesh.template axis<Axis>();
  const CommStats before = comm.stats();
  const auto direct_before = NodeShared::direct_redistributions();
  auto y = redistribute<To>(x, Axis{});
  CHECK(wrong(what, mismatches(y, identity<T>())) == wrong(what, 0));
  constexpr CommKind kind = is_replicate_v<To> ? CommKind::all_gather : CommKind::all_to_all;
  CHECK(comm.stats()[kind].calls == before[kind].calls + 1);
  CHECK(comm.stats()[kind].bytes > before[kind].bytes);
  CHECK(comm.stats().total().calls == before.total().calls + 1);
  const bool direct = direct_expected<Axis>(mesh);
  CHECK(NodeShared::direct_redistributions() == direct_before + (direct ? 1 : 0));
  // x is still what it was: the copy only read it.
  CHECK(wrong(what + " (input)", mismatches(x, identity<T>())) == wrong(what + " (input)", 0));
}

}  // namespace

TEST_CASE_TEMPLATE("node-shared inputs: every Shard pair on a 1-axis mesh", T, float, int) {
  auto& world = weft::test::world();
  Mesh<TP> mesh(world, world.size());
  NodeShared shm(mesh);
  CHECK(mesh.axis<TP>().node_shared_peers() == mesh.within_node<TP>());
  const std::array<std::size_t, 3> g{8, 16, 8};
  check_direct<T, TP, Shard<0>, Replicate>(shm, mesh, g);
  check_direct<T, TP, Shard<1>, Replicate>(shm, mesh, g);
  check_direct<T, TP, Shard<2>, Replicate>(shm, mesh, g);
  check_direct<T, TP, Shard<0>, Shard<1>>(shm, mesh, g);
  check_direct<T, TP, Shard<1>, Shard<0>>(shm, mesh, g);
  check_direct<T, TP, Shard<1>, Shard<2>>(shm, mesh, g);
  check_direct<T, TP, Shard<2>, Shard<0>>(shm, mesh, g);
  CHECK(shm.windows() == 7);
  shm.release();
  CHECK(shm.released());
  CHECK(shm.windows() == 0);
  CHECK_FALSE(mesh.axis<TP>().node_shared_peers());
}

TEST_CASE("node-shared inputs on 2-axis meshes, one axis at a time and chained") {
  auto& world = weft::test::world();
  for (int dp = 1; dp <= world.size(); ++dp) {
    if (world.size() % dp != 0) continue;
    Mesh<DP, TP> mesh(world, dp, world.size() / dp);
    NodeShared shm(mesh);
    const std::array<std::size_t, 3> g{8, 16, 8};
    check_direct<double, TP, Shard<1>, Replicate, On<DP, Shard<0>>>(shm, mesh, g);
    check_direct<double, TP, Shard<1>, Shard<2>, On<DP, Shard<0>>>(shm, mesh, g);
    check_direct<double, DP, Shard<2>, Replicate, On<TP, Shard<1>>>(shm, mesh, g);
    check_direct<double, DP, Shard<0>, Shard<2>, On<TP, Shard<1>>>(shm, mesh, g);

    // A chain: the first step reads node-shared memory, the second reads the
    // first step's (ordinary) result and so takes the MPI collective.
    using X = BasicDistView<double, dextents<3>, Host, On<DP, Shard<0>>, On<TP, Shard<1>>>;
    auto x = shm.dist_view<X>(mesh, g);
    fill(x, identity<double>());
    const auto before = NodeShared::direct_redistributions();
    auto y = redistribute<On<TP, Replicate>, On<DP, Replicate>>(x);
    const std::string what = mesh.describe() + ": chained TP then DP";
    CHECK(wrong(what, mismatches(y, identity<double>())) == wrong(what, 0));
    CHECK(NodeShared::direct_redistributions() == before + (direct_expected<TP>(mesh) ? 1 : 0));

    // Non-blocking: the node-shared copy happens when the handle starts.
    auto pending = iredistribute<Shard<2>>(x, TP{});
    auto z = pending.wait();
    CHECK(wrong(what + " (iredistribute)", mismatches(z, identity<double>())) == wrong(what + " (iredistribute)", 0));
  }
}

TEST_CASE("node-shared inputs: one rank's input is not shared, so every rank falls back") {
  auto& world = weft::test::world();
  Mesh<TP> mesh(world, world.size());
  NodeShared shm(mesh);
  using X = BasicDistView<float, dextents<2>, Host, On<TP, Shard<1>>>;
  const std::size_t rows = 2 * static_cast<std::size_t>(world.size()), cols = 4 * static_cast<std::size_t>(world.size());
  auto shared = shm.dist_view<X>(mesh, rows, cols);  // collective: every rank allocates
  X x = shared;
  if (world.rank() == world.size() - 1) {
    typename X::view_type own(std::string("private"), shared.local().extent(0), shared.local().extent(1));
    x = X(mesh, {rows, cols}, own);
  }
  fill(x, identity<float>());
  const auto before = NodeShared::direct_redistributions();
  const CommStats stats_before = mesh.axis<TP>().stats();
  auto y = redistribute<Replicate>(x, TP{});
  CHECK(wrong("fallback to Replicate", mismatches(y, identity<float>())) == wrong("fallback to Replicate", 0));
  auto z = redistribute<Shard<0>>(x, TP{});
  CHECK(wrong("fallback to Shard<0>", mismatches(z, identity<float>())) == wrong("fallback to Shard<0>", 0));
  CHECK(NodeShared::direct_redistributions() == before);
  CHECK(mesh.axis<TP>().stats()[CommKind::all_gather].calls == stats_before[CommKind::all_gather].calls + 1);
  CHECK(mesh.axis<TP>().stats()[CommKind::all_to_all].calls == stats_before[CommKind::all_to_all].calls + 1);
}

TEST_CASE("node-shared inputs at different offsets inside a window") {
  auto& world = weft::test::world();
  Mesh<TP> mesh(world, world.size());
  NodeShared shm(mesh);
  using X = BasicDistView<int, dextents<2>, Host, On<TP, Shard<1>>>;
  const std::size_t rows = 2 * static_cast<std::size_t>(world.size()), cols = 2 * rows;
  const auto local = X::local_extents_on(mesh, {rows, cols});
  // Three slots per rank; rank r's tensor sits in slot r % 3, so the offsets differ.
  auto slab = shm.view<int>("slab", 3, local[0], local[1]);
  auto slot = Kokkos::subview(slab, world.rank() % 3, Kokkos::ALL, Kokkos::ALL);
  X x(mesh, {rows, cols}, typename X::view_type(slot.data(), local[0], local[1]));
  fill(x, identity<int>());
  const auto before = NodeShared::direct_redistributions();
  auto y = redistribute<Replicate>(x, TP{});
  CHECK(wrong("offset to Replicate", mismatches(y, identity<int>())) == wrong("offset to Replicate", 0));
  using Y0 = BasicDistView<int, dextents<2>, Host, On<TP, Shard<0>>>;
  Y0 out(mesh, rows, cols);
  redistribute<Shard<0>>(x, TP{}, out);
  CHECK(wrong("offset to Shard<0>", mismatches(out, identity<int>())) == wrong("offset to Shard<0>", 0));
  CHECK(NodeShared::direct_redistributions() == before + (direct_expected<TP>(mesh) ? 2 : 0));
  // The other slots are untouched (zero-filled at allocation).
  for (std::size_t s = 0; s < 3; ++s) {
    if (s == static_cast<std::size_t>(world.rank() % 3)) continue;
    int nonzero = 0;
    for (std::size_t i = 0; i < local[0]; ++i)
      for (std::size_t j = 0; j < local[1]; ++j) nonzero += slab(s, i, j) != 0;
    CHECK(nonzero == 0);
  }
}

TEST_CASE("node-shared inputs in checked mode") {
  auto& world = weft::test::world();
  Mesh<TP> mesh(world, world.size());
  NodeShared shm(mesh);
  mesh.axis<TP>().set_checked(true, 30.0);
  const std::array<std::size_t, 3> g{4, 8, 4 * static_cast<std::size_t>(world.size())};
  check_direct<float, TP, Shard<2>, Replicate>(shm, mesh, g);
  check_direct<float, TP, Shard<2>, Shard<1>>(shm, mesh, g);
  mesh.axis<TP>().set_checked(false);
}

TEST_CASE("NodeShared misuse gives errors that say what to do") {
  auto& world = weft::test::world();
  Mesh<TP> mesh(world, world.size());
  Mesh<TP> other(world, world.size());
  NodeShared shm(mesh);
  using X = BasicDistView<float, dextents<1>, Host, On<TP, Shard<0>>>;
  const auto n = static_cast<std::size_t>(world.size());
  const auto e1 = error_text([&] { (void)shm.dist_view<X>(other, std::array<std::size_t, 1>{n}); });
  CHECK(contains(e1, "not the one this NodeShared was made for"));
  const auto e2 = error_text([&] { (void)shm.view<float>("neg", 2, -1); });
  CHECK(contains(e2, "extent 1 is negative"));
  const auto e3 = error_text([&] { (void)shm.dist_view<X>(mesh, std::array<std::size_t, 1>{n + 1}); });
  CHECK((world.size() == 1 || contains(e3, "not divisible")));
  CHECK(shm.windows() == (world.size() == 1 ? 1u : 0u));  // n + 1 divides among 1 rank
  shm.release();
  shm.release();  // a second release does nothing
  const auto e4 = error_text([&] { (void)shm.view<float>("late", 4); });
  CHECK(contains(e4, "after release()"));
}

TEST_CASE("the transport is a type: transport::Mpi takes none of the node-local paths") {
  static_assert(std::is_same_v<transport::default_for_t<Kokkos::HostSpace>, transport::NodeLocal>);
  static_assert(std::is_same_v<CommOver<transport::NodeLocal>, Comm>);
  static_assert(std::is_same_v<CommOver<transport::Mpi>, Comm>);
  static_assert(Transport<transport::Mpi> && Transport<transport::NodeLocal> && Transport<transport::Nccl>);
  static_assert(!Transport<int> && !Transport<Replicate>);
  auto& world = weft::test::world();
  Mesh<TP> mesh(world, world.size());
  NodeShared shm(mesh);
  using X = BasicDistView<float, dextents<2>, Host, On<TP, Shard<1>>>;
  const std::size_t rows = 2 * static_cast<std::size_t>(world.size()), cols = 8 * static_cast<std::size_t>(world.size());
  auto x = shm.dist_view<X>(mesh, rows, cols);
  fill(x, identity<float>());
  const bool direct = direct_expected<TP>(mesh);
  const auto direct0 = NodeShared::direct_redistributions();
  const auto staged0 = staged_redistributions();
  const auto cma0 = cross_memory_redistributions();
  const CommStats before = mesh.axis<TP>().stats();

  auto y = redistribute<Replicate, transport::Mpi>(x, TP{});
  CHECK(wrong("Mpi to Replicate", mismatches(y, identity<float>())) == wrong("Mpi to Replicate", 0));
  auto z = redistribute<Shard<0>, transport::Mpi>(x, TP{});
  CHECK(wrong("Mpi to Shard<0>", mismatches(z, identity<float>())) == wrong("Mpi to Shard<0>", 0));
  redistribute<Replicate, transport::Mpi>(x, TP{}, y);
  CHECK(wrong("Mpi into Replicate", mismatches(y, identity<float>())) == wrong("Mpi into Replicate", 0));
  CHECK(NodeShared::direct_redistributions() == direct0);
  CHECK(staged_redistributions() == staged0);
  CHECK(cross_memory_redistributions() == cma0);
  CHECK(mesh.axis<TP>().stats()[CommKind::all_gather].calls == before[CommKind::all_gather].calls + 2);
  CHECK(mesh.axis<TP>().stats()[CommKind::all_to_all].calls == before[CommKind::all_to_all].calls + 1);

  // Named NodeLocal is the default: the same views take the node-shared path.
  redistribute<Replicate, transport::NodeLocal>(x, TP{}, y);
  CHECK(wrong("NodeLocal into Replicate", mismatches(y, identity<float>())) == wrong("NodeLocal into Replicate", 0));
  auto w = redistribute<Shard<0>>(x, TP{});
  CHECK(wrong("default to Shard<0>", mismatches(w, identity<float>())) == wrong("default to Shard<0>", 0));
  CHECK(NodeShared::direct_redistributions() == direct0 + (direct ? 2 : 0));
  // Placed on one rank, no transport moves anything.
  auto same = redistribute<Shard<1>, transport::Mpi>(x, TP{});
  CHECK(same.local().data() == x.local().data());
}
