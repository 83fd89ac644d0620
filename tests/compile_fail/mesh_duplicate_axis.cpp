// Misuse: the same axis tag twice in one mesh.
#include <weft/mesh/mesh.hpp>
void f(weft::Comm& c) { weft::Mesh<weft::DP, weft::DP> m(c, 1, 1); }
