// Misuse: a mesh axis that is not an axis tag.
#include <weft/weft.hpp>
void f(weft::Comm& c) { weft::Mesh<int> m(c, 1); }
