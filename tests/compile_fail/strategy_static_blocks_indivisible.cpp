// Misuse: 6 blocks over 2 static pipeline stages of 2 interleaved chunks each.
#include <weft/mesh/mesh.hpp>
#include <weft/vocabulary/strategy.hpp>
using S = weft::Strategy<weft::On<weft::PP, weft::Pipeline<weft::Interleaved1F1B<2>>>>;
static_assert(weft::check_strategy_sizes<S, weft::Mesh<weft::Axis<weft::PP, 2>>, weft::ModelSizes<weft::dynamic_extent, 6>>());
