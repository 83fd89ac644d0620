// Misuse: sharded parameters with replicated gradients over DP (a combination that means nothing).
#include <weft/vocabulary/strategy.hpp>
using S = weft::Strategy<weft::On<weft::DP, weft::DPStates<weft::Shard<0>, weft::Replicate, weft::Shard<0>>>>;
S s;
