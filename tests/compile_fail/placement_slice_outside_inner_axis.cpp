// Must not compile. Splitting dimension 0 over DP outside TP's existing split is no local slice.
#include <weft/placement/propagation.hpp>
#include <weft/placement/redistribute.hpp>

using namespace weft;

void f(const DistView<float, 1, On<DP, Replicate>, On<TP, Shard<0>>>& x) { (void)redistribute<Shard<0>>(x, DP{}); }
