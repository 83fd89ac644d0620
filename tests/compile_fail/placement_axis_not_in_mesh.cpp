// Must not compile. The placements name CP but the mesh has no CP axis.
#include <weft/placement/propagation.hpp>
#include <weft/placement/redistribute.hpp>

using namespace weft;

void f(Mesh<DP, TP>& m) { DistView<float, 1, On<CP, Shard<0>>> x(m, 8); }
