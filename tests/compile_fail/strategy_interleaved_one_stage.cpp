// Misuse: an interleaved schedule on a PP axis of static extent 1.
#include <weft/mesh/mesh.hpp>
#include <weft/vocabulary/strategy.hpp>
using S = weft::Strategy<weft::On<weft::PP, weft::Pipeline<weft::Interleaved1F1B<2>>>>;
static_assert(weft::check_strategy_mesh<S, weft::Mesh<weft::DP, weft::Axis<weft::PP, 1>>>());
