// Node-shared staging: ordinary host DistViews redistributed Shard -> Replicate
// and Shard -> Shard through their axis' node-shared scratch window. Every
// result is checked element by element against the global tensor; the tests
// also check which path ran (weft::staged_redistributions), the statistics,
// the window's growth across calls, the per-communicator switch, 2-axis
// meshes, chained and non-blocking forms, and checked mode. The same binary
// runs a second time with WEFT_NODE_SHARED_STAGING=0, where nothing may stage.
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

// What the environment asks for (the default is on).
bool staging_by_default() { return env_switch_on("WEFT_NODE_SHARED_STAGING"); }

// Whether the staged path runs for a step From -> To over Axis with
// `local_bytes` of input per rank: staging is on, the axis has more than one
// rank in one node, the step splits a non-leading dimension (Shard<0> ->
// Replicate is a plain all-gather), and what a rank copies into the window
// stays within the default limit (512 KiB; every test tensor here does).
template <class Axis, class From, class To, class MeshT>
bool staged_expected(MeshT& mesh, std::size_t local_bytes = 0) {
  Comm& c = mesh.template axis<Axis>();
  const bool packs = is_shard_v<To> || From::dim > 0;
  const auto p = static_cast<std::size_t>(c.size());
  const std::size_t copied = is_shard_v<To> ? local_bytes / p * (p - 1) : local_bytes;
  return c.node_shared_staging() && p > 1 && mesh.template within_node<Axis>() && packs &&
         copied <= (std::size_t(512) << 10);
}

// Both forms of the step, checked element by element (check_host_step), and
// the path: staged exactly when expected, into a window of two buffers.
template <class T, class Axis, class From, class To, class... Others, class MeshT>
void check_staged(MeshT& mesh, const std::array<std::size_t, 3>& global) {
  const auto step = weft::test::check_host_step<T, Axis, From, To, Others...>(mesh, global, staged_redistributions);
  const bool staged = staged_expected<Axis, From, To>(mesh, step.local_bytes);
  CHECK(step.moved == (staged ? 2u : 0u));
  if (staged) CHECK(mesh.template axis<Axis>().node_shared_staging_bytes() >= 2 * step.local_bytes);  // two buffers
}

}  // namespace

TEST_CASE("node-shared staging follows WEFT_NODE_SHARED_STAGING and the per-communicator switch") {
  auto& world = weft::test::world();
  Mesh<TP> mesh(world, world.size());
  Comm& tp = mesh.axis<TP>();
  CHECK(tp.node_shared_staging() == staging_by_default());
  CHECK(tp.node_shared_staging_bytes() == 0u);  // nothing allocated before a staged step
  tp.set_node_shared_staging(false);
  CHECK_FALSE(tp.node_shared_staging());
  tp.set_node_shared_staging(true);
  CHECK(tp.node_shared_staging());
}

TEST_CASE_TEMPLATE("node-shared staging: every Shard pair on a 1-axis mesh", T, float, int, double) {
  auto& world = weft::test::world();
  Mesh<TP> mesh(world, world.size());
  const auto p = static_cast<std::size_t>(world.size());
  const std::array<std::size_t, 3> g{2 * p, 2 * p, 3 * p};
  weft::test::for_each_shard_step([&]<class From, class To>() { check_staged<T, TP, From, To>(mesh, g); });
}

TEST_CASE("node-shared staging: the window grows with larger inputs and is reused for smaller ones") {
  auto& world = weft::test::world();
  Mesh<TP> mesh(world, world.size());
  Comm& tp = mesh.axis<TP>();
  const auto p = static_cast<std::size_t>(world.size());
  const bool staged = staged_expected<TP, Shard<1>, Replicate>(mesh);
  check_staged<float, TP, Shard<1>, Replicate>(mesh, {2, 2 * p, 2});
  const std::size_t small = tp.node_shared_staging_bytes();
  CHECK((small > 0) == staged);
  // 2p x 16384 x 2 floats split along dimension 1: 256 KiB per rank, above
  // the first window's 64 KiB buffers.
  check_staged<float, TP, Shard<1>, Shard<0>>(mesh, {2 * p, 16384, 2});
  const std::size_t large = tp.node_shared_staging_bytes();
  CHECK((large > small) == staged);
  CHECK((large >= 2 * (std::size_t(256) << 10)) == staged);
  // Smaller inputs, another element type: the same window, results still exact.
  check_staged<double, TP, Shard<2>, Replicate>(mesh, {2, 3, 4 * p});
  check_staged<int, TP, Shard<1>, Shard<2>>(mesh, {3, 2 * p, 2 * p});
  CHECK(tp.node_shared_staging_bytes() == large);
  // Larger again, in double: 2p x 8 x 4096 split along dimension 2, 512 KiB per rank.
  check_staged<double, TP, Shard<2>, Shard<0>>(mesh, {2 * p, 8, 4096});
  CHECK((tp.node_shared_staging_bytes() > large) == staged);
}

TEST_CASE("node-shared staging switched off takes the MPI path with the same results") {
  auto& world = weft::test::world();
  Mesh<TP> mesh(world, world.size());
  Comm& tp = mesh.axis<TP>();
  const auto p = static_cast<std::size_t>(world.size());
  tp.set_node_shared_staging(false);
  const auto before = staged_redistributions();
  check_staged<float, TP, Shard<1>, Replicate>(mesh, {2, 2 * p, 3});
  check_staged<float, TP, Shard<2>, Shard<1>>(mesh, {2, 2 * p, 2 * p});
  CHECK(staged_redistributions() == before);
  CHECK(tp.node_shared_staging_bytes() == 0u);
  tp.set_node_shared_staging(staging_by_default());
  check_staged<float, TP, Shard<2>, Shard<1>>(mesh, {2, 2 * p, 2 * p});
}

TEST_CASE("node-shared staging on 2-axis meshes, one axis at a time, chained and non-blocking") {
  auto& world = weft::test::world();
  for (int dp = 1; dp <= world.size(); ++dp) {
    if (world.size() % dp != 0) continue;
    Mesh<DP, TP> mesh(world, dp, world.size() / dp);
    const std::array<std::size_t, 3> g{8, 8, 8};
    check_staged<double, TP, Shard<1>, Replicate, On<DP, Shard<0>>>(mesh, g);
    check_staged<double, TP, Shard<1>, Shard<2>, On<DP, Shard<0>>>(mesh, g);
    check_staged<double, DP, Shard<2>, Replicate, On<TP, Shard<1>>>(mesh, g);
    check_staged<double, DP, Shard<0>, Shard<2>, On<TP, Shard<1>>>(mesh, g);

    // Both steps of a chain stage when their axes do (TP's result is the
    // input of DP's step).
    using X = BasicDistView<double, dextents<3>, Host, On<DP, Shard<1>>, On<TP, Shard<2>>>;
    X x(mesh, g);
    fill(x, identity<double>());
    const auto before = staged_redistributions();
    auto y = redistribute<On<TP, Replicate>, On<DP, Replicate>>(x);
    const std::string what = mesh.describe() + ": chained TP then DP";
    CHECK(wrong(what, mismatches(y, identity<double>())) == wrong(what, 0));
    const int expect = (staged_expected<TP, Shard<2>, Replicate>(mesh) ? 1 : 0) +
                       (staged_expected<DP, Shard<1>, Replicate>(mesh) ? 1 : 0);  // tiny tensors
    CHECK(staged_redistributions() == before + static_cast<std::uint64_t>(expect));

    // Non-blocking: the staged copy happens when the handle starts.
    auto pending = iredistribute<Shard<0>>(x, TP{});
    auto z = pending.wait();
    CHECK(wrong(what + " (iredistribute)", mismatches(z, identity<double>())) == wrong(what + " (iredistribute)", 0));
  }
}

TEST_CASE("node-shared staging in checked mode, and meshes made and freed in a loop") {
  auto& world = weft::test::world();
  const auto p = static_cast<std::size_t>(world.size());
  for (int round = 0; round < 3; ++round) {
    Mesh<TP> mesh(world, world.size());
    mesh.axis<TP>().set_checked(true, 30.0);
    check_staged<float, TP, Shard<2>, Replicate>(mesh, {2, 3, 2 * p});
    check_staged<float, TP, Shard<2>, Shard<1>>(mesh, {2, 2 * p, 2 * p});
    // The mesh, its communicators and their staging windows go here, on
    // every rank at the same point.
  }
}
