// Misuse: expert parallelism placed on the DP axis.
#include <weft/parallel/strategy.hpp>
using S = weft::Strategy<weft::On<weft::DP, weft::Experts<8>>>;
S s;
