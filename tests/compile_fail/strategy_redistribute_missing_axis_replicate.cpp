// Must not compile. The tensor is placed over TP only and its mesh has no CP
// axis: redistributing to Replicate over CP used to compile and do nothing.
#include <weft/mesh/mesh.hpp>
#include <weft/placement/redistribute.hpp>

void replicate_over_missing_axis(weft::Mesh<weft::TP>& mesh) {
  weft::DistView<float, 2, weft::On<weft::TP, weft::Shard<1>>> x(mesh, 4, 8);
  auto y = weft::redistribute<weft::Replicate>(x, weft::CP{});
  (void)y;
}
