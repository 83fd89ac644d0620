// Must not compile. With DP and TP both splitting dimension 0, DP's blocks are not contiguous.
#include <weft/placement/propagation.hpp>
#include <weft/placement/redistribute.hpp>

using namespace weft;

void f(const DistView<float, 1, On<DP, Shard<0>>, On<TP, Shard<0>>>& x) { (void)redistribute<Replicate>(x, DP{}); }
