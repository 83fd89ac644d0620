// Must not compile. A bias added to partial sums on every rank is added once
// per rank of the axis; the tensor must be reduced first.
#include <weft/mesh/mesh.hpp>
#include <weft/placement/elementwise.hpp>

void bias_onto_partial_sums(weft::Mesh<weft::TP>& mesh) {
  weft::DistView<float, 2, weft::On<weft::TP, weft::Partial<weft::Sum>>> x(mesh, 4, 8);
  weft::DistView<float, 1> b(mesh, 8);  // Replicate over TP
  auto y = weft::bias_add(x, b);
  (void)y;
}
