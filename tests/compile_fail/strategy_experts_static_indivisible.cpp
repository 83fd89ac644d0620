// Misuse: 4 routed experts over a static EP axis of 3 ranks.
#include <weft/mesh/mesh.hpp>
#include <weft/vocabulary/strategy.hpp>
using S = weft::Strategy<weft::On<weft::EP, weft::Experts<4>>>;
static_assert(weft::check_strategy_mesh<S, weft::Mesh<weft::DP, weft::Axis<weft::EP, 3>>>());
