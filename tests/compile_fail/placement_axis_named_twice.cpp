// Must not compile. One placement per axis.
#include <weft/placement/propagation.hpp>
#include <weft/placement/redistribute.hpp>

using namespace weft;

DistView<float, 2, On<TP, Shard<0>>, On<TP, Replicate>> x;
