// Mesh: coordinates, rank order (last axis innermost), per-axis and per-group
// communicators, static and dynamic extents, node topology, and the errors of
// bad extents -- on every mesh shape that the world size allows.
#include <algorithm>
#include <sstream>
#include <string>
#include <vector>

#include "weft_test.hpp"

namespace {

using weft::ConfigError;
using weft::CP;
using weft::DP;
using weft::PP;
using weft::TP;

// The world ranks of a communicator, in its rank order.
std::vector<int> members(weft::Comm& c) {
  int me = weft::test::world().rank();
  Kokkos::View<int*, Kokkos::HostSpace> mine("me", 1), all("all", static_cast<std::size_t>(c.size()));
  mine(0) = me;
  c.all_gather(mine, all);
  return std::vector<int>(all.data(), all.data() + all.size());
}

// Checks the mesh against its definition: rank r has coordinates
// coords_of(r) in row-major order; the comm of axis set S holds exactly the
// ranks that agree with this one outside S, ordered row-major over S.
template <class M>
void check_mesh(M& m) {
  auto& w = weft::test::world();
  REQUIRE(m.size() == w.size());
  const auto e = m.extents();
  // Row-major: the last axis is innermost.
  int r = 0;
  for (int k = 0; k < m.size(); ++k) {
    auto c = m.coords_of(k);
    CHECK(m.rank_of(c) == k);
    int lin = 0;
    for (std::size_t i = 0; i < M::rank; ++i) lin = lin * e[i] + c[i];
    CHECK(lin == k);
    r = k;
  }
  (void)r;
  CHECK(m.coords() == m.coords_of(w.rank()));
  // Every single-axis communicator.
  auto check_axis = [&](weft::Comm& c, std::size_t axis) {
    CHECK(c.size() == e[axis]);
    CHECK(c.rank() == m.coords()[axis]);
    CHECK(c.name() == std::string(M::axis_name(axis)));
    auto got = members(c);
    for (int k = 0; k < c.size(); ++k) {
      auto want = m.coords();
      want[axis] = k;
      CHECK(got[static_cast<std::size_t>(k)] == m.rank_of(want));
    }
  };
  [&]<std::size_t... I>(std::index_sequence<I...>) {
    (check_axis(m.template axis<typename M::template tag_at<I>>(), I), ...);
  }(std::make_index_sequence<M::rank>{});
}

}  // namespace

TEST_CASE("1-axis mesh over the whole world") {
  auto& w = weft::test::world();
  weft::Mesh<DP> m(w, w.size());
  CHECK(m.extent<DP>() == w.size());
  CHECK(m.coord<DP>() == w.rank());
  CHECK(m.axis<DP>().size() == w.size());
  CHECK(m.describe() == "dp=" + std::to_string(w.size()));
  check_mesh(m);
}

TEST_CASE("2-axis meshes: every factorisation of the world, e.g. 2x4, 1x8, 8x1") {
  auto& w = weft::test::world();
  const int n = w.size();
  for (int a = 1; a <= n; ++a) {
    if (n % a) continue;
    INFO("mesh dp=", a, " tp=", n / a);
    weft::Mesh<DP, TP> m(w, a, n / a);
    check_mesh(m);
    // TP is innermost: consecutive ranks share a TP group.
    CHECK(m.coord<TP>() == w.rank() % (n / a));
    CHECK(m.coord<DP>() == w.rank() / (n / a));
    // The group of both axes is the whole mesh, ordered like it.
    auto& both = m.axes<DP, TP>();
    CHECK(both.size() == n);
    CHECK(both.rank() == w.rank());
    CHECK(both.name() == "dp*tp");
    // Asking in another order returns the same communicator.
    CHECK(&m.axes<TP, DP>() == &both);
    CHECK(&m.axes<TP>() == &m.axis<TP>());
  }
}

TEST_CASE("3-axis meshes, e.g. 2x2x2, with axis-group communicators") {
  auto& w = weft::test::world();
  const int n = w.size();
  for (int a = 1; a <= n; ++a) {
    for (int b = 1; a * b <= n; ++b) {
      if (n % (a * b)) continue;
      const int c = n / (a * b);
      INFO("mesh dp=", a, " pp=", b, " tp=", c);
      weft::Mesh<DP, PP, TP> m(w, {.dp = a, .pp = b, .tp = c});
      check_mesh(m);
      // The DP x TP group: ranks with this rank's PP coordinate, row-major over (dp, tp).
      auto& g = m.axes<DP, TP>();
      CHECK(g.size() == a * c);
      CHECK(g.rank() == m.coord<DP>() * c + m.coord<TP>());
      auto got = members(g);
      for (int k = 0; k < g.size(); ++k)
        CHECK(got[static_cast<std::size_t>(k)] == m.rank_of({k / c, m.coord<PP>(), k % c}));
    }
  }
}

TEST_CASE("static extents, mixed with dynamic ones") {
  auto& w = weft::test::world();
  using M1 = weft::Mesh<weft::Axis<DP, 1>, TP>;
  static_assert(M1::rank_dynamic == 1);
  M1 m1(w, w.size());
  CHECK(m1.extent<DP>() == 1);
  CHECK(m1.extent<TP>() == w.size());
  check_mesh(m1);
  if (w.size() % 2 == 0) {
    weft::Mesh<weft::Axis<TP, 2>, DP> m2(w, w.size() / 2);
    CHECK(m2.extent<TP>() == 2);
    check_mesh(m2);
    weft::Mesh<weft::Axis<TP, 2>, DP> m3(w, {.dp = 0, .tp = 2});  // dp inferred
    CHECK(m3.extent<DP>() == w.size() / 2);
  }
  if (w.size() == 8) {
    weft::Mesh<weft::Axis<DP, 2>, weft::Axis<TP, 4>> m4(w);
    static_assert(decltype(m4)::static_size() == 8);
    check_mesh(m4);
  }
}

TEST_CASE("one extent may be left out and is inferred") {
  auto& w = weft::test::world();
  weft::Mesh<DP, TP> m(w, {.tp = 1});
  CHECK(m.extent<DP>() == w.size());
  weft::Mesh<DP, TP> m2(w, {.dp = 1});
  CHECK(m2.extent<TP>() == w.size());
}

TEST_CASE("bad extents are ConfigErrors naming the sizes and the fix") {
  auto& w = weft::test::world();
  const int n = w.size();
  auto msg = [](auto&& f) -> std::string {
    try {
      f();
    } catch (const ConfigError& e) {
      return e.what();
    }
    return "(no error)";
  };
  std::string s = msg([&] { weft::Mesh<DP, TP> m(w, n, 2); });
  if (n == 1) {
    CHECK(s.find("must be between 1 and the communicator size 1, got 2") != std::string::npos);
  } else {
    CHECK(s.find("the extents dp=" + std::to_string(n) + " x tp=2 = " + std::to_string(2 * n) + " do not match the " +
                 std::to_string(n) + " ranks of communicator 'world'") != std::string::npos);
    CHECK(s.find("choose extents whose product is " + std::to_string(n)) != std::string::npos);
  }
  s = msg([&] { weft::Mesh<DP, TP> m(w, 0, 1); });
  CHECK(s.find("the extent of axis 'dp' must be between 1") != std::string::npos);
  s = msg([&] { weft::Mesh<DP, TP> m(w, {.dp = 1, .tp = n, .cp = 2}); });
  CHECK(s.find("the sizes name cp=2 but this mesh has no 'cp' axis") != std::string::npos);
  s = msg([&] { weft::Mesh<DP, TP, PP> m(w, {.dp = 1}); });
  CHECK(s.find("the extents of both 'tp' and 'pp' are missing") != std::string::npos);
  if (n > 1) {
    s = msg([&] { weft::Mesh<DP, TP> m(w, {.tp = n + 1}); });
    CHECK(s.find("cannot infer the extent of axis 'dp'") != std::string::npos);
  }
  s = msg([&] { weft::Mesh<weft::Axis<DP, 1>, TP> m(w, {.dp = 3, .tp = n}); });
  CHECK(s.find("axis 'dp' has the static extent 1 but the sizes give dp=3") != std::string::npos);
  weft::Mesh<DP> ok(w, n);
  s = msg([&] { (void)ok.coords_of(n); });
  CHECK(s.find("rank " + std::to_string(n) + " is outside") != std::string::npos);
  s = msg([&] { (void)ok.rank_of({-1}); });
  CHECK(s.find("coordinate -1 on axis 'dp'") != std::string::npos);
}

TEST_CASE("node topology: one node here, so every axis group stays inside it") {
  auto& w = weft::test::world();
  if (weft::detail::test_ranks_per_node() != 0 && weft::detail::test_ranks_per_node() < w.size()) return;  // next case
  weft::Mesh<DP, TP> m(w, 1, w.size());
  CHECK(m.num_nodes() == 1);
  CHECK(m.node().size() == w.size());
  CHECK(m.within_node<TP>());
  CHECK(m.within_node<DP, TP>());
  CHECK(m.within_node<DP>());  // cached the second time
  CHECK(m.within_node<DP>());
}

// CTest runs this at 4 ranks with WEFT_TEST_RANKS_PER_NODE=2 and at 8 with 4
// (test_mesh.nodes_*): the mesh sees the simulated nodes.
TEST_CASE("node topology follows WEFT_TEST_RANKS_PER_NODE (simulated nodes)") {
  auto& w = weft::test::world();
  const int k = weft::detail::test_ranks_per_node();
  if (k == 0 || k >= w.size()) return;  // one node: the case above
  REQUIRE(w.size() % k == 0);
  const int nodes = w.size() / k;
  // TP groups of k consecutive ranks: one simulated node each; DP crosses them.
  weft::Mesh<DP, TP> m(w, nodes, k);
  CHECK(m.num_nodes() == nodes);
  CHECK(m.node().size() == k);
  CHECK(m.within_node<TP>());
  CHECK_FALSE(m.within_node<DP>());
  CHECK_FALSE(m.within_node<DP, TP>());
  // TP over all ranks spans every node.
  weft::Mesh<DP, TP> wide(w, 1, w.size());
  CHECK_FALSE(wide.within_node<TP>());
  CHECK(wide.within_node<DP>());  // DP groups of one rank
  CHECK(weft::detail::node_name().find("/node" + std::to_string(w.rank() / k)) != std::string::npos);
}

TEST_CASE("per-axis statistics are reported by axis name") {
  auto& w = weft::test::world();
  weft::Mesh<DP, TP> m(w, 1, w.size());
  Kokkos::View<double*> x("x", 10);
  m.axis<TP>().all_reduce(x);
  m.axis<TP>().all_reduce(x);
  m.axis<DP>().broadcast(x, 0);
  std::ostringstream os;
  m.print_stats(os);
  const std::string table = os.str();
  CHECK(table.find("tp         all_reduce               2            160") != std::string::npos);
  CHECK(table.find("dp         broadcast                1             80") != std::string::npos);
  const std::string js = m.stats_json();
  CHECK(js.find("\"tp\": {\"all_reduce\": {\"calls\": 2, \"bytes\": 160") != std::string::npos);
  m.reset_stats();
  CHECK(m.stats_json() == "{}");
}

TEST_CASE("a mesh over a sub-communicator") {
  auto& w = weft::test::world();
  if (w.size() < 2) return;
  // Split the world into halves; each half gets its own mesh.
  weft::Comm half = w.split(w.rank() < w.size() / 2 ? 0 : 1, w.rank(), "half");
  weft::Mesh<DP> m(half, half.size());
  CHECK(m.size() == half.size());
  CHECK(m.coord<DP>() == half.rank());
  CHECK(m.axis<DP>().size() == half.size());
}
