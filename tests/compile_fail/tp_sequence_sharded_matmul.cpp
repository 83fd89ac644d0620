// Must not compile. A sequence-sharded activation (Shard<0> over TP, as
// sequence parallelism keeps it between the TP regions) must be all-gathered
// before it enters a column-parallel matmul.
#include <weft/mesh/mesh.hpp>
#include <weft/nn/tensor_parallel.hpp>

void sequence_sharded_into_matmul(weft::Mesh<weft::TP>& mesh) {
  weft::nn::Linear<float, weft::On<weft::TP, weft::Shard<0>>> up(mesh, 8, 16);
  weft::DistView<float, 2, weft::On<weft::TP, weft::Shard<0>>> x(mesh, 4, 8);
  auto y = up.forward(x);
  (void)y;
}
