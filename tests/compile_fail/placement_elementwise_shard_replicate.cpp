// Must not compile. Element-wise operands must be placed alike.
#include <weft/placement/propagation.hpp>
#include <weft/placement/redistribute.hpp>

using namespace weft;

using C = elementwise_placement_t<Additive, Shard<0>, Replicate>;
C c;
