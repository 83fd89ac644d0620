// Must not compile. A residual add of a replicated tensor to partial sums
// would count the replicated tensor once per rank of the axis.
#include <weft/mesh/mesh.hpp>
#include <weft/placement/elementwise.hpp>

void residual_onto_partial_sums(weft::Mesh<weft::TP>& mesh) {
  weft::DistView<float, 2, weft::On<weft::TP, weft::Partial<weft::Sum>>> x(mesh, 4, 8);
  weft::DistView<float, 2, weft::On<weft::TP, weft::Replicate>> residual(mesh, 4, 8);
  auto y = weft::add(x, residual);
  (void)y;
}
