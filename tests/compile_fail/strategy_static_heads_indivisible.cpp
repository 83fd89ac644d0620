// Misuse: 6 attention heads over a static TP axis of 4 ranks.
#include <weft/mesh/mesh.hpp>
#include <weft/vocabulary/strategy.hpp>
using S = weft::Strategy<weft::On<weft::TP, weft::TensorParallel<>>>;
static_assert(weft::check_strategy_sizes<S, weft::Mesh<weft::DP, weft::Axis<weft::TP, 4>>, weft::ModelSizes<6, 8>>());
