// Built against the installed weft package by tests/downstream/run_downstream.cmake:
// an Environment, a one-axis Mesh and an all_reduce whose result is checked. It
// prints the KOKKOS_VERSION its Kokkos headers define, which the test compares
// with the Kokkos weft was configured with.
#include <weft/weft.hpp>

#include <cstdint>
#include <cstdio>

int main(int argc, char** argv) {
  weft::Environment env(argc, argv);
  weft::Mesh<weft::DP> mesh(env.world(), env.world().size());
  const int n = mesh.size();
  const std::int64_t r = mesh.coord<weft::DP>();

  constexpr int len = 64;
  Kokkos::View<std::int64_t*> x("x", len);
  Kokkos::parallel_for("fill", len, KOKKOS_LAMBDA(int i) { x(i) = r + i; });
  mesh.axis<weft::DP>().all_reduce(x);  // in place: sum over the dp ranks

  auto h = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), x);
  int bad = 0;
  for (int i = 0; i < len; ++i) bad += h(i) != std::int64_t(n) * (n - 1) / 2 + std::int64_t(n) * i;
  Kokkos::View<int*, Kokkos::HostSpace> total("bad", 1);
  total(0) = bad;
  env.world().all_reduce(total);
  if (r == 0)
    std::printf("downstream: weft %s, KOKKOS_VERSION %d, on %d ranks: all_reduce %s\n", weft::version_string,
                KOKKOS_VERSION, n, total(0) == 0 ? "correct" : "WRONG");
  return total(0) == 0 ? 0 : 1;
}
