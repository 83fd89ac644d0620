// Misuse: a loss scaler on bf16, whose gradients have float's range.
#include <weft/vocabulary/strategy.hpp>
using S = weft::Strategy<weft::Precision<weft::BF16, weft::F32, weft::DynamicLossScale>>;
S s;
