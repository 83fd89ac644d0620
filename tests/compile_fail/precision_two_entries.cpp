// Misuse: two precision entries in one strategy.
#include <weft/vocabulary/strategy.hpp>
using S = weft::Strategy<weft::Precision<weft::BF16, weft::F32>, weft::On<weft::DP, weft::FullyShard>,
                         weft::Precision<weft::F32>>;
S s;
