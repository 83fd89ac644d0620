// Must not compile. The tensor is placed over TP only and its mesh has no CP
// axis: sharding it over CP used to compile and fail at run time.
#include <weft/mesh/mesh.hpp>
#include <weft/placement/redistribute.hpp>

void shard_over_missing_axis(weft::Mesh<weft::TP>& mesh) {
  weft::DistView<float, 2, weft::On<weft::TP, weft::Shard<1>>> x(mesh, 4, 8);
  auto y = weft::redistribute<weft::Shard<0>>(x, weft::CP{});
  (void)y;
}
