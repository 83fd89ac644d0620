// Must not compile. The mean of integers is not an integer.
#include <weft/placement/propagation.hpp>
#include <weft/placement/redistribute.hpp>

using namespace weft;

void f(const DistView<int, 1, On<TP, Partial<Avg>>>& x) { (void)redistribute<Replicate>(x, TP{}); }
