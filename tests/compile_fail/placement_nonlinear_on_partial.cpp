// Must not compile. A non-linear function of partial values is not the function of their sum.
#include <weft/placement/propagation.hpp>
#include <weft/placement/redistribute.hpp>

using namespace weft;

using C = unary_placement_t<Nonlinear, Partial<Sum>>;
C c;
