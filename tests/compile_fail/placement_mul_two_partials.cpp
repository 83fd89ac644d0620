// Misuse: the element-wise product of two Partial<Sum> tensors (e.g. two
// row-parallel matmul outputs before their all-reduce). Each rank would
// multiply its partial values, and the sum of those products is not the
// product of the sums.
#include <weft/placement/elementwise.hpp>

int main(int argc, char** argv) {
  weft::Environment env(argc, argv);
  weft::Mesh<weft::TP> mesh(env.world(), env.world().size());
  weft::DistView<float, 2, weft::On<weft::TP, weft::Partial<weft::Sum>>> a(mesh, 4, 4), b(mesh, 4, 4);
  auto y = weft::mul(a, b);
  return int(y.local().size());
}
