// Cross-memory reads: ordinary host DistViews redistributed Shard -> Replicate
// and Shard -> Shard (splitting a non-leading dimension) with each rank reading
// its peers' blocks straight into its result (Comm::cross_memory_attach).
// Every result is checked element by element against the global tensor; the
// tests also check which path ran (weft::cross_memory_redistributions), the
// statistics, that inputs are left as they were, the per-communicator switch,
// 2-axis meshes, chained and non-blocking forms, checked mode and sizes that
// need several process_vm_readv calls. The same binary runs a second time
// with WEFT_CROSS_MEMORY_ATTACH=0, where nothing may read across processes.
#include <cstdlib>
#include <cstring>
#include <string>

#include "placement_test_util.hpp"

using namespace weft;
using weft::test::env_switch_on;
using weft::test::fill;
using weft::test::identity;
using weft::test::mismatches;
using weft::test::wrong;

namespace {

using Host = Kokkos::HostSpace;

bool cma_by_default() { return env_switch_on("WEFT_CROSS_MEMORY_ATTACH"); }

// Whether a step From -> To over Axis reads across processes: the switch is
// on, the axis has more than one rank in one node and the step splits a
// non-leading dimension (Shard<0> -> Replicate is a plain all-gather). Every
// tensor here is below the 8 MiB from which derived datatypes take over.
template <class Axis, class From, class To, class MeshT>
bool cma_expected(MeshT& mesh) {
  Comm& c = mesh.template axis<Axis>();
  const bool packs = is_shard_v<To> || From::dim > 0;
  return c.cross_memory_attach() && c.size() > 1 && mesh.template within_node<Axis>() && packs;
}

// Both forms of the step, checked element by element (check_host_step), and
// the path: read across processes, before staging, exactly when expected.
template <class T, class Axis, class From, class To, class... Others, class MeshT>
void check_read(MeshT& mesh, const std::array<std::size_t, 3>& global) {
  const auto staged_before = staged_redistributions();
  const auto step = weft::test::check_host_step<T, Axis, From, To, Others...>(mesh, global, cross_memory_redistributions);
  const bool read = cma_expected<Axis, From, To>(mesh);
  CHECK(step.moved == (read ? 2u : 0u));
  if (read) CHECK(staged_redistributions() == staged_before);
}

}  // namespace

TEST_CASE("cross-memory reads follow WEFT_CROSS_MEMORY_ATTACH and the per-communicator switch") {
  auto& world = weft::test::world();
  Mesh<TP> mesh(world, world.size());
  Comm& tp = mesh.axis<TP>();
  CHECK(tp.cross_memory_attach() == cma_by_default());
  tp.set_cross_memory_attach(false);
  CHECK_FALSE(tp.cross_memory_attach());
  const auto p = static_cast<std::size_t>(world.size());
  const auto before = cross_memory_redistributions();
  check_read<float, TP, Shard<1>, Replicate>(mesh, {2, 2 * p, 3});
  CHECK(cross_memory_redistributions() == before);
  tp.set_cross_memory_attach(true);
  CHECK(tp.cross_memory_attach());
  check_read<float, TP, Shard<1>, Replicate>(mesh, {2, 2 * p, 3});
  CHECK(cross_memory_redistributions() == before + (world.size() > 1 && mesh.within_node<TP>() ? 2 : 0));
  tp.set_cross_memory_attach(cma_by_default());
}

TEST_CASE_TEMPLATE("cross-memory reads: every Shard pair on a 1-axis mesh", T, float, int, double) {
  auto& world = weft::test::world();
  Mesh<TP> mesh(world, world.size());
  const auto p = static_cast<std::size_t>(world.size());
  const std::array<std::size_t, 3> g{2 * p, 2 * p, 3 * p};
  weft::test::for_each_shard_step([&]<class From, class To>() { check_read<T, TP, From, To>(mesh, g); });
}

TEST_CASE("cross-memory reads: many short runs need several process_vm_readv calls") {
  auto& world = weft::test::world();
  Mesh<TP> mesh(world, world.size());
  const auto p = static_cast<std::size_t>(world.size());
  // 3000 rows of one element per rank and peer: runs that cannot merge, more
  // than the 1024 of one call.
  check_read<float, TP, Shard<1>, Replicate>(mesh, {3000, p, 1});
  check_read<double, TP, Shard<2>, Shard<0>>(mesh, {2 * p, 1500, p});
  // A large contiguous chunk per peer (1 MiB), which merges into few runs.
  check_read<float, TP, Shard<1>, Shard<0>>(mesh, {4 * p, 65536 * p / 4, 1});
}

TEST_CASE("cross-memory reads on 2-axis meshes, chained and non-blocking, in checked mode") {
  auto& world = weft::test::world();
  for (int dp = 1; dp <= world.size(); ++dp) {
    if (world.size() % dp != 0) continue;
    Mesh<DP, TP> mesh(world, dp, world.size() / dp);
    const std::array<std::size_t, 3> g{8, 8, 8};
    check_read<double, TP, Shard<1>, Replicate, On<DP, Shard<0>>>(mesh, g);
    check_read<double, TP, Shard<1>, Shard<2>, On<DP, Shard<0>>>(mesh, g);
    check_read<double, DP, Shard<2>, Replicate, On<TP, Shard<1>>>(mesh, g);
    check_read<double, DP, Shard<0>, Shard<2>, On<TP, Shard<1>>>(mesh, g);

    using X = BasicDistView<double, dextents<3>, Host, On<DP, Shard<1>>, On<TP, Shard<2>>>;
    X x(mesh, g);
    fill(x, identity<double>());
    const auto before = cross_memory_redistributions();
    auto y = redistribute<On<TP, Replicate>, On<DP, Replicate>>(x);
    const std::string what = mesh.describe() + ": chained TP then DP";
    CHECK(wrong(what, mismatches(y, identity<double>())) == wrong(what, 0));
    const int expect = (cma_expected<TP, Shard<2>, Replicate>(mesh) ? 1 : 0) +
                       (cma_expected<DP, Shard<1>, Replicate>(mesh) ? 1 : 0);
    CHECK(cross_memory_redistributions() == before + static_cast<std::uint64_t>(expect));

    auto pending = iredistribute<Shard<0>>(x, TP{});
    auto z = pending.wait();
    CHECK(wrong(what + " (iredistribute)", mismatches(z, identity<double>())) == wrong(what + " (iredistribute)", 0));

    mesh.axis<TP>().set_checked(true, 30.0);
    check_read<float, TP, Shard<2>, Shard<1>>(mesh, {2, 2 * std::size_t(world.size()), 2 * std::size_t(world.size())});
    mesh.axis<TP>().set_checked(false);
  }
}
