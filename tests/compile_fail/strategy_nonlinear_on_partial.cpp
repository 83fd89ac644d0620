// Must not compile. gelu of partial sums (a row-parallel matmul's output
// before its all-reduce) is not gelu of their sum; reduce first.
#include <weft/mesh/mesh.hpp>
#include <weft/placement/elementwise.hpp>

void gelu_of_partial_sums(weft::Mesh<weft::TP>& mesh) {
  weft::DistView<float, 2, weft::On<weft::TP, weft::Partial<weft::Sum>>> x(mesh, 4, 8);
  auto y = weft::gelu(x);
  (void)y;
}
