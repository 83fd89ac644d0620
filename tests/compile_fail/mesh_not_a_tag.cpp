// Misuse: a mesh axis that is not an axis tag.
#include <weft/mesh/mesh.hpp>
void f(weft::Comm& c) { weft::Mesh<int> m(c, 1); }
