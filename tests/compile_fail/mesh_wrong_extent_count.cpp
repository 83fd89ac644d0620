// Misuse: a mesh with two dynamic axes given one extent.
#include <weft/mesh/mesh.hpp>
void f(weft::Comm& c) { weft::Mesh<weft::DP, weft::TP> m(c, 2); }
