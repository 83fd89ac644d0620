// Must not compile. Static extents on both sides: checked when the DistView is built.
#include <weft/placement/propagation.hpp>
#include <weft/placement/redistribute.hpp>

using namespace weft;

void f(Mesh<Axis<TP, 4>>& m) { BasicDistView<float, Extents<10, 8>, Kokkos::HostSpace, On<TP, Shard<0>>> x(m, 10, 8); }
