// Must not compile. Adding a replicated tensor to partial sums counts it once per rank.
#include <weft/placement/propagation.hpp>
#include <weft/placement/redistribute.hpp>

using namespace weft;

using C = elementwise_placement_t<Additive, Partial<Sum>, Replicate>;
C c;
