// Must not compile. A replicated tensor cannot become Partial.
#include <weft/placement/propagation.hpp>
#include <weft/placement/redistribute.hpp>

using namespace weft;

void f(const DistView<float, 2, On<TP, Replicate>>& x) { (void)redistribute<Partial<Sum>>(x, TP{}); }
