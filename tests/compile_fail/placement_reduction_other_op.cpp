// Must not compile. A max over partial sums does not reduce the true values.
#include <weft/placement/propagation.hpp>
#include <weft/placement/redistribute.hpp>

using namespace weft;

using C = reduction_placement_t<Partial<Sum>, 0, Max>;
C c;
