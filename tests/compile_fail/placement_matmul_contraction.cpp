// Must not compile. A splits the contraction dimension but B is whole.
#include <weft/placement/propagation.hpp>
#include <weft/placement/redistribute.hpp>

using namespace weft;

using C = matmul_placement_t<Shard<1>, Replicate>;
C c;
