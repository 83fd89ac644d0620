// Misuse: the precision given as the policy of a mesh axis.
#include <weft/vocabulary/strategy.hpp>
using S = weft::Strategy<weft::On<weft::DP, weft::Precision<weft::BF16, weft::F32>>>;
S s;
