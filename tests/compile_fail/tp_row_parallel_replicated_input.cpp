// Must not compile. A row-parallel layer multiplies only this rank's input
// features (Shard<1>); a replicated input must be sliced first.
#include <weft/mesh/mesh.hpp>
#include <weft/nn/tensor_parallel.hpp>

void row_parallel_fed_replicated(weft::Mesh<weft::TP>& mesh) {
  weft::nn::Linear<float, weft::On<weft::TP, weft::Shard<1>>> down(mesh, 16, 8);
  weft::DistView<float, 2> x(mesh, 4, 16);  // Replicate over TP
  auto y = down.forward(x);
  (void)y;
}
