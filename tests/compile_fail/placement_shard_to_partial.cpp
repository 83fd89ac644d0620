// Must not compile. A shard cannot become Partial.
#include <weft/placement/propagation.hpp>
#include <weft/placement/redistribute.hpp>

using namespace weft;

void f(const DistView<float, 2, On<TP, Shard<1>>>& x) { (void)redistribute<Partial<Sum>>(x, TP{}); }
