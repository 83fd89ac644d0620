// context::attention_of<S, T>(mesh) for a strategy with no Context<...> entry:
// there is no context parallelism to give, and the call says so instead of
// returning an empty one that the model would take as cp = 1.
#include <weft/mesh/mesh.hpp>
#include <weft/parallel/context.hpp>

using S = weft::Strategy<weft::On<weft::DP, weft::Replicated>>;

auto make(weft::Mesh<weft::DP, weft::CP>& mesh) { return weft::context::attention_of<S, float>(mesh); }
