// Misuse: "interleaving" a single chunk per rank.
#include <weft/vocabulary/schedule.hpp>
void f() { weft::Pipeline<weft::Interleaved1F1B<1>> pipeline(4, 8); }
