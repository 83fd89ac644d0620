// Must not compile. A placement without its axis says nothing.
#include <weft/placement/propagation.hpp>
#include <weft/placement/redistribute.hpp>

using namespace weft;

DistView<float, 2, Shard<0>> x;
