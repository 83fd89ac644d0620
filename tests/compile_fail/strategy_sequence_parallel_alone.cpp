// Misuse: sequence parallelism as a policy of its own, without tensor parallelism.
#include <weft/vocabulary/strategy.hpp>
using S = weft::Strategy<weft::On<weft::DP, weft::Replicated>, weft::On<weft::TP, weft::SequenceParallel>>;
S s;
