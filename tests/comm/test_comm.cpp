#include "weft_test.hpp"

TEST_CASE("smoke") {
  auto& w = weft::test::world();
  Kokkos::View<double*> x("x", 4), y("y", 4);
  Kokkos::deep_copy(x, double(w.rank() + 1));
  w.all_reduce(x, y);
  auto h = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), y);
  CHECK(h(0) == doctest::Approx(w.size() * (w.size() + 1) / 2.0));
}
