// Must not compile. Partial values of one reduction are not those of another.
#include <weft/placement/propagation.hpp>
#include <weft/placement/redistribute.hpp>

using namespace weft;

void f(const DistView<float, 2, On<TP, Partial<Sum>>>& x) { (void)redistribute<Partial<Max>>(x, TP{}); }
