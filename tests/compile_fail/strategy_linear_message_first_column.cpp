// Must not compile, and the placed layer's own message must be the first
// error: two column-parallel layers in a row (the first one's Shard<1> output
// into the second, which needs a replicated input).
#include <weft/mesh/mesh.hpp>
#include <weft/nn/tensor_parallel.hpp>

void two_column_parallel_layers(weft::Mesh<weft::TP>& mesh) {
  weft::nn::Linear<float, weft::On<weft::TP, weft::Shard<0>>> a(mesh, 8, 16), b(mesh, 16, 16);
  weft::DistView<float, 2> x(mesh, 4, 8);
  auto h = a.forward(x);  // On<TP, Shard<1>>
  auto y = b.forward(h);  // no redistribute in between
  (void)y;
}
