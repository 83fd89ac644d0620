// Misuse: sequence parallelism on a TP axis of static extent 1.
#include <weft/mesh/mesh.hpp>
#include <weft/vocabulary/strategy.hpp>
using S = weft::Strategy<weft::On<weft::TP, weft::TensorParallel<weft::SequenceParallel>>>;
static_assert(weft::check_strategy_mesh<S, weft::Mesh<weft::DP, weft::Axis<weft::TP, 1>>>());
