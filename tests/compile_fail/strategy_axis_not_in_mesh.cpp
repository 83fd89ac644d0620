// Misuse: a strategy whose pipeline policy names an axis (PP) that the mesh lacks.
#include <weft/mesh/mesh.hpp>
#include <weft/vocabulary/strategy.hpp>
using S = weft::Strategy<weft::On<weft::DP, weft::FullyShard>, weft::On<weft::PP, weft::Pipeline<weft::OneFOneB>>>;
static_assert(weft::check_strategy_mesh<S, weft::Mesh<weft::DP>>());
