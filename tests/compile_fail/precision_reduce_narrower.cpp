// Misuse: fp32 parameters whose gradients are reduced in bf16.
#include <weft/vocabulary/strategy.hpp>
using S = weft::Strategy<weft::On<weft::DP, weft::Replicated>, weft::Precision<weft::F32, weft::BF16>>;
S s;
