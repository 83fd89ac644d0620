// Misuse: two data-parallel policies on the DP axis.
#include <weft/vocabulary/strategy.hpp>
using S = weft::Strategy<weft::On<weft::DP, weft::FullyShard>, weft::On<weft::DP, weft::ZeRO<1>>>;
S s;
