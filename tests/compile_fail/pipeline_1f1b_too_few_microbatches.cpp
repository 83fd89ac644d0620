// Misuse: 1F1B with fewer microbatches than stages, both sizes static.
#include <weft/vocabulary/schedule.hpp>
void f() { weft::Pipeline<weft::OneFOneB, 4, 2> pipeline; }
