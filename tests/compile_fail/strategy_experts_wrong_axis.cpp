// Misuse: expert parallelism placed on the DP axis.
#include <weft/vocabulary/strategy.hpp>
using S = weft::Strategy<weft::On<weft::DP, weft::Experts<8>>>;
S s;
