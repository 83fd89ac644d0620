// Misuse: interleaved 1F1B with a microbatch count that is not a multiple of the stages.
#include <weft/vocabulary/schedule.hpp>
void f() { weft::Pipeline<weft::Interleaved1F1B<2>, 4, 6> pipeline; }
