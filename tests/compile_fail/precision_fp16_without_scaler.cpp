// Misuse: fp16 parameters without a loss scaler.
#include <weft/vocabulary/strategy.hpp>
using S = weft::Strategy<weft::On<weft::DP, weft::FullyShard>, weft::Precision<weft::FP16, weft::F32>>;
S s;
