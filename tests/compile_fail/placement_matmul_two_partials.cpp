// Must not compile. The product of two partial sums is not a partial sum.
#include <weft/placement/propagation.hpp>
#include <weft/placement/redistribute.hpp>

using namespace weft;

using C = matmul_placement_t<Partial<Sum>, Partial<Sum>>;
C c;
