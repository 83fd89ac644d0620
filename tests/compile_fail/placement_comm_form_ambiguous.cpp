// Must not compile. A communicator cannot say which of two axes changes.
#include <weft/placement/propagation.hpp>
#include <weft/placement/redistribute.hpp>

using namespace weft;

void f(const DistView<float, 2, On<DP, Shard<0>>, On<TP, Shard<1>>>& x, Comm& c) { (void)redistribute<Replicate>(x, c); }
