// Must not compile, and the placed layer's own message must be the first
// error: a replicated input into a row-parallel layer (which multiplies only
// this rank's input features, Shard<1>).
#include <weft/mesh/mesh.hpp>
#include <weft/nn/tensor_parallel.hpp>

void row_parallel_fed_replicated(weft::Mesh<weft::TP>& mesh) {
  weft::nn::Linear<float, weft::On<weft::TP, weft::Shard<1>>> down(mesh, 16, 8);
  weft::DistView<float, 2, weft::On<weft::TP, weft::Replicate>> x(mesh, 4, 16);
  auto y = down.forward(x);
  (void)y;
}
