// Misuse: tensor parallelism placed on the DP axis.
#include <weft/vocabulary/strategy.hpp>
using S = weft::Strategy<weft::On<weft::DP, weft::TensorParallel<>>>;
S s;
