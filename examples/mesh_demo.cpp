// mesh_demo: the ranks of MPI_COMM_WORLD arranged as a dp x pp x tp mesh. Prints
// each rank's coordinates and the members of its sub-communicators, runs one of
// each collective on a mesh axis (checking the results against values computed
// by hand), and prints rank 0's communication statistics.
//
//   mpirun -n 8 ./mesh_demo      (dp=2 x pp=2 x tp=2; other rank counts work too)
#include <weft/weft.hpp>

#include <cstdio>
#include <iostream>
#include <string>
#include <vector>

namespace {

using Mesh = weft::Mesh<weft::DP, weft::PP, weft::TP>;
using Vec = Kokkos::View<double*>;  // in the default execution space's memory

// v(i) = f(i), filled on the view's own execution space.
template <class F>
Vec make(const std::string& label, int n, F f) {
  Vec v(label, n);
  Kokkos::parallel_for(label, n, KOKKOS_LAMBDA(int i) { v(i) = f(i); });
  return v;
}

// Compares v with expected(i) on the host; returns the number of mismatches.
template <class F>
int mismatches(const Vec& v, F expected) {
  auto h = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), v);
  int bad = 0;
  for (int i = 0; i < static_cast<int>(h.extent(0)); ++i) bad += h(i) != expected(i);
  return bad;
}

// The mesh ranks of this rank's group on a communicator, as "0 1 2 3".
std::string members(weft::Comm& c, int my_rank) {
  Kokkos::View<int*, Kokkos::HostSpace> mine("mine", 1), all("all", c.size());
  mine(0) = my_rank;
  c.all_gather(mine, all);
  std::string s;
  for (int i = 0; i < c.size(); ++i) {
    if (i) s += ' ';
    s += std::to_string(all(i));
  }
  return s;
}

}  // namespace

int main(int argc, char** argv) {
  weft::Environment env(argc, argv);
  weft::Comm& world = env.world();
  const int n = world.size();

  // tp=2 when the rank count is even, pp=2 when it divides by 4, dp the rest
  // (0 = inferred): 8 ranks give dp=2 x pp=2 x tp=2.
  Mesh mesh(world, {.dp = 0, .pp = n % 4 == 0 ? 2 : 1, .tp = n % 2 == 0 ? 2 : 1});
  const int me = mesh.rank_in_mesh();
  const int dp = mesh.coord<weft::DP>(), pp = mesh.coord<weft::PP>(), tp = mesh.coord<weft::TP>();

  // 1. Coordinates and sub-communicators, one line per rank, printed by rank 0.
  char line[160];
  std::snprintf(line, sizeof line, "%4d   (%d, %d, %d)   %-10s %-10s %-10s %-12s", me, dp, pp, tp,
                members(mesh.axis<weft::TP>(), me).c_str(), members(mesh.axis<weft::PP>(), me).c_str(),
                members(mesh.axis<weft::DP>(), me).c_str(), members(mesh.axes<weft::DP, weft::TP>(), me).c_str());
  Kokkos::View<char*, Kokkos::HostSpace> mine("line", sizeof line), lines("lines", sizeof line * n);
  for (std::size_t i = 0; i < sizeof line; ++i) mine(i) = line[i];
  world.all_gather(mine, lines);
  if (me == 0) {
    std::printf("weft %s, Kokkos %d.%d.%d (%s), %d ranks as the mesh %s on %d node(s)\n\n", weft::version_string,
                weft::kokkos_version / 10000, weft::kokkos_version / 100 % 100, weft::kokkos_version % 100,
                Kokkos::DefaultExecutionSpace::name(), n, mesh.describe().c_str(), mesh.num_nodes());
    std::printf("rank   (dp,pp,tp)  tp group   pp group   dp group   dp*tp group\n");
    for (int r = 0; r < n; ++r) std::printf("%s\n", &lines(static_cast<std::size_t>(r) * sizeof line));
    std::printf("\ntp stays inside a node: %s\n\n", mesh.within_node<weft::TP>() ? "yes" : "no");
  } else {
    (void)mesh.within_node<weft::TP>();  // collective
  }

  // 2. One of each collective, each checked against values computed by hand.
  mesh.reset_stats();  // count only these in the table below
  constexpr int len = 1024;
  int bad = 0;
  auto mesh_rank = [&](int d, int p, int t) { return mesh.rank_of({d, p, t}); };

  {  // all_reduce over tp: the sum of the group's mesh ranks.
    const int T = mesh.extent<weft::TP>();
    Vec x = make("x", len, KOKKOS_LAMBDA(int i) { return me + 0.5 * i; }), y("y", len);
    mesh.axis<weft::TP>().all_reduce(x, y);
    double sum = 0;
    for (int t = 0; t < T; ++t) sum += mesh_rank(dp, pp, t);
    bad += mismatches(y, [&](int i) { return sum + 0.5 * i * T; });
  }
  {  // all_gather over dp: block d holds the mesh rank of dp coordinate d.
    const int D = mesh.extent<weft::DP>();
    Vec x = make("x", len, KOKKOS_LAMBDA(int) { return me; }), y("y", len * D);
    mesh.axis<weft::DP>().all_gather(x, y);
    bad += mismatches(y, [&](int i) { return mesh_rank(i / len, pp, tp); });
  }
  {  // reduce_scatter over dp*tp (non-blocking): block g of the sum comes to group rank g.
    weft::Comm& g = mesh.axes<weft::DP, weft::TP>();
    Vec x = make("x", len * g.size(), KOKKOS_LAMBDA(int i) { return i / len + 1.0; }), y("y", len);
    auto request = g.ireduce_scatter(x, y);
    request.wait();  // compute could overlap with the communication here
    bad += mismatches(y, [&](int) { return (g.rank() + 1.0) * g.size(); });
  }
  {  // broadcast over pp from the first stage.
    Vec x = make("x", len, KOKKOS_LAMBDA(int i) { return pp == 0 ? me * 1000.0 + i : -1.0; });
    mesh.axis<weft::PP>().broadcast(x, 0);
    bad += mismatches(x, [&](int i) { return mesh_rank(dp, 0, tp) * 1000.0 + i; });
  }
  {  // all_to_all over the whole mesh: block j of rank r holds 100 r + j.
    Vec x = make("x", len * n, KOKKOS_LAMBDA(int i) { return 100.0 * me + i / len; }), y("y", len * n);
    mesh.all().all_to_all(x, y);
    bad += mismatches(y, [&](int i) { return 100.0 * (i / len) + me; });
  }
  {  // sendrecv around the pp ring: each stage passes its mesh rank to the next.
    const int P = mesh.extent<weft::PP>();
    Vec x = make("x", len, KOKKOS_LAMBDA(int) { return me; }), y("y", len);
    mesh.axis<weft::PP>().sendrecv(x, (pp + 1) % P, y, (pp + P - 1) % P);
    bad += mismatches(y, [&](int) { return mesh_rank(dp, (pp + P - 1) % P, tp); });
  }

  // 3. Did every rank get every value right? Then rank 0's statistics.
  Kokkos::View<int*, Kokkos::HostSpace> total("bad", 1);
  total(0) = bad;
  world.all_reduce(total);
  if (me == 0) {
    if (total(0) == 0) std::printf("all_reduce, all_gather, reduce_scatter, broadcast, all_to_all, sendrecv: correct on every rank\n\n");
    else std::printf("%d wrong values (over all ranks)\n\n", total(0));
    std::printf("communication of rank 0 (bytes as nccl-tests count them; seconds: wall, exposed: blocked)\n");
    mesh.print_stats(std::cout);
  }
  return total(0) == 0 ? 0 : 1;
}
