// Must not compile. Shard<2> of a matrix.
#include <weft/placement/propagation.hpp>
#include <weft/placement/redistribute.hpp>

using namespace weft;

DistView<float, 2, On<TP, Shard<2>>> x;
